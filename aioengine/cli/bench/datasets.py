"""Benchmark workloads: random lengths, sharegpt-like chats, shared prefixes, and the peers' workload."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from typing import Any

_TEXT = "The history of computing is a story of abstraction layers. "


@dataclass(slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def _vocab_ids(tokenizer: Any, n: int, rng: random.Random) -> list[int]:
    # Random ids from the ordinary (non-special) part of the vocabulary.
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    top = len(tokenizer)
    out: list[int] = []
    while len(out) < n:
        t = rng.randrange(100, top)
        if t not in special:
            out.append(t)
    return out


def shared_workload(tokenizer: Any, num_prompts: int, output_len: int, seed: int = 0) -> list[BenchRequest]:
    """The workload of ../shared/bench/hf_peer.py: prompts of 64-256 tokens cut from a fixed text."""
    ids = tokenizer(_TEXT * 200)["input_ids"]
    rng = random.Random(seed)
    return [
        BenchRequest(ids[rng.randrange(0, 100) :][: rng.randint(64, 256)], output_len)
        for _ in range(num_prompts)
    ]


def random_workload(
    tokenizer: Any, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0
) -> list[BenchRequest]:
    """vLLM's `random` dataset: lengths uniform in [len*(1-r), len*(1+r)]."""
    rng = random.Random(seed)

    def draw(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))

    return [
        BenchRequest(_vocab_ids(tokenizer, draw(input_len), rng), draw(output_len))
        for _ in range(num_prompts)
    ]


def sharegpt_workload(
    tokenizer: Any,
    num_prompts: int,
    seed: int = 0,
    input_mean: int = 220,
    output_mean: int = 200,
    max_len: int = 1024,
) -> list[BenchRequest]:
    """Synthetic conversations with ShareGPT-like, long-tailed lengths (lognormal around the means)."""
    rng = random.Random(seed)
    import math

    def lognormal(mean: int) -> int:
        sigma = 0.8
        return max(4, min(max_len, int(rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma))))

    return [
        BenchRequest(_vocab_ids(tokenizer, lognormal(input_mean), rng), lognormal(output_mean))
        for _ in range(num_prompts)
    ]


def prefix_repetition_workload(
    tokenizer: Any,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    num_prefixes: int = 4,
    seed: int = 0,
) -> list[BenchRequest]:
    """Requests that share one of a few long prefixes (the prefix cache's best case)."""
    rng = random.Random(seed)
    prefixes = [_vocab_ids(tokenizer, prefix_len, rng) for _ in range(num_prefixes)]
    return [
        BenchRequest(prefixes[i % num_prefixes] + _vocab_ids(tokenizer, suffix_len, rng), output_len)
        for i in range(num_prompts)
    ]


_GROUNDED_SENTENCES = (
    "The committee met on Tuesday to review the budget for the new library.",
    "Each member of the team is responsible for testing their own changes before a release.",
    "The river rises every spring when the snow in the mountains begins to melt.",
    "def area(width, height):\n    return width * height\n",
    "Customers who order before noon receive their packages on the same day.",
    "for item in items:\n    if item.price > limit:\n        expensive.append(item)\n",
    "The museum opens at nine and closes at five, except on public holidays.",
    "A good report states the question, the method, the result and what is still unknown.",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "Trains to the airport leave every twenty minutes from the second platform.",
)
_GROUNDED_TASKS = (
    "Repeat the following text exactly as it is written:",
    "Copy this passage word for word, then stop:",
    "Rewrite the following text, keeping every sentence unchanged:",
)


def grounded_workload(tokenizer: Any, num_prompts: int, output_len: int, seed: int = 0) -> list[BenchRequest]:
    """Chat requests whose answer copies spans of their input (repeat, copy, rewrite a passage of prose and
    code): the input-grounded case where n-gram drafts from the prompt hold."""
    rng = random.Random(seed)
    out: list[BenchRequest] = []
    for _ in range(num_prompts):
        passage = " ".join(rng.sample(_GROUNDED_SENTENCES, rng.randint(3, 6)))
        messages = [{"role": "user", "content": f"{rng.choice(_GROUNDED_TASKS)}\n\n{passage}"}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = list(ids["input_ids"])
        out.append(BenchRequest(list(ids), output_len))
    return out


def add_dataset_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--dataset",
        choices=["shared", "random", "sharegpt", "prefix-repetition", "grounded"],
        default="shared",
        help="shared: the hf_peer.py workload (64-256 token prompts cut from a fixed text); grounded: chat "
        "requests that copy passages of their input (where n-gram speculation helps)",
    )
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128, help="random: mean prompt length")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.0)
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--sharegpt-max-len", type=int, default=1024, help="sharegpt: cap on each length")
    ap.add_argument("--dataset-seed", type=int, default=0)


def build_dataset(args: argparse.Namespace, tokenizer: Any) -> list[BenchRequest]:
    if args.dataset == "shared":
        return shared_workload(tokenizer, args.num_prompts, args.output_len, args.dataset_seed)
    if args.dataset == "random":
        return random_workload(
            tokenizer, args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.dataset_seed
        )
    if args.dataset == "grounded":
        return grounded_workload(tokenizer, args.num_prompts, args.output_len, args.dataset_seed)
    if args.dataset == "sharegpt":
        return sharegpt_workload(
            tokenizer, args.num_prompts, args.dataset_seed, max_len=args.sharegpt_max_len
        )
    return prefix_repetition_workload(
        tokenizer, args.num_prompts, args.prefix_len, args.suffix_len, args.output_len, seed=args.dataset_seed
    )
