"""`aioengine bench kv-cache-parity`: a quantized KV cache's parity cost, measured in transformers.

usage: aioengine bench kv-cache-parity [MODE]

MODE: bf16, int8 (the default), e4m3 (one scale per token and KV head), e4m3_noscale, e5m2_noscale. The
default model's converted weights run in float32; K (after RoPE) and V are cut to MODE and back, as a cache
of that kind would hold them. Eleven prompts, 64 greedy tokens each, against the same model uncut: where the
greedy continuations part, the greedy tokens' |delta logprob| (teacher-forced on the uncut continuation),
and the top-1 agreement. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MODES = ("bf16", "int8", "e4m3", "e4m3_noscale", "e5m2_noscale")
TEXTS = [
    "The river rises every spring when the snow in the mountains begins to melt.",
    "def area(width, height):\n    return width * height\n\nclass Point:\n    def __init__(self, x, y):",
    "Customers who order before noon receive their packages on the same day. " * 4,
    "Write a short poem about the sea.",
    "What is the capital of France? Answer in one sentence.",
    "List three prime numbers and explain why they are prime.",
    "Once upon a time, in a small village,",
    "import numpy as np\n\ndef softmax(x):",
]
NEW_TOKENS = 64


def cut(x: torch.Tensor, mode: str) -> torch.Tensor:
    """``x [..., head_dim]`` as a cache of ``mode`` would give it back (one scale per vector where scaled)."""
    import torch

    if mode == "bf16":
        return x.bfloat16().float()
    if mode in ("int8", "e4m3"):
        top = 127 if mode == "int8" else 448
        scale = x.abs().amax(-1, keepdim=True) / top
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        if mode == "int8":
            return (x / scale).round().clamp(-127, 127) * scale
        return (x / scale).to(torch.float8_e4m3fn).float() * scale
    if mode == "e4m3_noscale":
        return x.to(torch.float8_e4m3fn).float()
    if mode == "e5m2_noscale":
        return x.to(torch.float8_e5m2).float()
    raise SystemExit(f"unknown mode {mode!r}")


def run(mode: str) -> None:
    import torch
    import transformers.models.llama.modeling_llama as llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aioengine.model.files import resolve_model

    torch.manual_seed(0)
    torch.set_num_threads(2)
    folder = resolve_model("default")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    chats = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
        for t in TEXTS[3:6]
    ]
    prompts = [tok(t).input_ids for t in TEXTS + chats]

    @torch.no_grad()
    def greedy(p: list[int]) -> list[int]:
        out = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)
        return out[0, len(p) :].tolist()

    @torch.no_grad()
    def logits(p: list[int], cont: list[int]) -> torch.Tensor:
        return model(torch.tensor([p + cont])).logits[0, len(p) - 1 : -1].float()

    base = [greedy(p) for p in prompts]
    ref = [logits(p, c) for p, c in zip(prompts, base, strict=True)]

    rotary = llama.apply_rotary_pos_emb

    def rotary_then_cut(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:  # k [batch, kv heads, tokens, head_dim]
        q, k = rotary(q, k, cos, sin, *args, **kwargs)
        return q, cut(k, mode)

    def cut_values(module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        shape = out.shape
        return cut(out.reshape(*shape[:-1], shape[-1] // head_dim, head_dim), mode).reshape(shape)

    llama.apply_rotary_pos_emb = rotary_then_cut
    for layer in model.model.layers:
        layer.self_attn.v_proj.register_forward_hook(cut_values)
    quant = [greedy(p) for p in prompts]

    deltas: list[float] = []
    agree = 0
    parted: list[int | None] = []
    for p, b, q, lg_ref in zip(prompts, base, quant, ref, strict=True):
        lp_ref, lp = torch.log_softmax(lg_ref, -1), torch.log_softmax(logits(p, b), -1)
        chosen = torch.tensor(b)[:, None]
        deltas += (lp.gather(1, chosen) - lp_ref.gather(1, chosen)).abs().squeeze(1).tolist()
        agree += int((lp.argmax(-1) == lp_ref.argmax(-1)).sum())
        at = next((i for i, (x, y) in enumerate(zip(b, q, strict=True)) if x != y), None)
        parted.append(at)
        if at is not None:
            top2 = lg_ref[at].topk(2).values
            print(f"parted at token {at}: the uncut top-2 logits {float(top2[0] - top2[1]):.4f} apart")
    print(f"{mode}: first parting per prompt {parted} (None: the same {NEW_TOKENS} tokens)")
    cuts = sorted(deltas)
    print(
        f"|delta logprob| of the greedy token: mean {statistics.mean(deltas):.4f} "
        f"p50 {statistics.median(deltas):.4f} p99 {cuts[int(0.99 * len(cuts))]:.4f} max {cuts[-1]:.4f}; "
        f"top-1 agreement {agree} / {len(deltas)}"
    )


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="aioengine bench kv-cache-parity", description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="int8", choices=MODES, help="the cache's number format")
    args = ap.parse_args(argv)
    run(args.mode)
