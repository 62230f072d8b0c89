"""Speculative decoding (n-gram prompt lookup and a draft model): greedy tokens equal speculation off, token
for token, through chunked prefill, prefix hits, preemption, stop strings and aborts; the target as its own
draft has every draft accepted; sampled tokens keep their distribution."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from aioengine import AsyncEngine, EngineArgs, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def looping_prompts(n: int = 8, seed: int = 1) -> list[list[int]]:
    """Prompts that repeat a phrase: the n-gram proposer finds drafts in them (random weights rarely
    continue the phrase, so most drafts are rejected: that path is tested as much as acceptance)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(3, 49152) for _ in range(rng.randint(3, 6))]
        out.append([rng.randrange(3, 49152) for _ in range(rng.randint(1, 20))] + phrase * rng.randint(3, 6))
    return out


def engine_args(path, spec, **kwargs) -> EngineArgs:
    """A float32 CPU engine on ``path`` with blocks of 4 and ``spec`` as its speculative_config."""
    return EngineArgs(
        model=str(path), dtype="float32", device="cpu", block_size=4, speculative_config=spec, **kwargs
    )


def own_draft(path, num_speculative_tokens: int = 3) -> dict:
    """speculative_config with the model as its own draft: every draft holds (never disabled by batch)."""
    return {
        "method": "draft_model",
        "model": str(path),
        "num_speculative_tokens": num_speculative_tokens,
        "disable_by_batch_size": 64,
    }


async def generate_all(path, prompts, params, spec, **kwargs):
    async with AsyncEngine(engine_args(path, spec, **kwargs)) as engine:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        assert engine.kv_cache_usage() == 0.0
        totals = engine.scheduler.spec_totals
        return [o.outputs[0] for o in outs], totals


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 300))


# A draft model for each target: another architecture of the same vocabulary; for Gemma 3 another Gemma 3
# (its windows must line up with the target's).
DRAFT_OF = {"qwen2": ("llama", {}), "gemma3": ("gemma3", {"intermediate_size": 96})}


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3", "qwen3_moe"])
@pytest.mark.parametrize("case", ["chunked", "prefix", "preempt"])
def test_greedy_tokens_equal_speculation_off(tiny_checkpoint_of, kind, case):
    """n-gram drafts, and for two of the targets a draft model's, against the same run without drafts."""
    path = tiny_checkpoint_of(kind)
    prompts = looping_prompts()
    if case == "prefix":
        prompts = [prompts[0][:12] + p for p in prompts]
    kwargs = {
        "chunked": dict(max_num_batched_tokens=16, enable_prefix_caching=False),
        "prefix": dict(max_num_batched_tokens=256),
        "preempt": dict(max_num_batched_tokens=64, num_kv_blocks=1 + 40),
    }[case]
    # Speculate at every batch size here: the point is the mechanics, not the policy.
    specs = [{**NGRAM, "disable_by_batch_size": 64}]
    if kind in DRAFT_OF:
        draft = tiny_checkpoint_of(DRAFT_OF[kind][0], **DRAFT_OF[kind][1])
        specs.append(
            {
                "method": "draft_model",
                "model": str(draft),
                "num_speculative_tokens": 3,
                "disable_by_batch_size": 64,
            }
        )
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    off, _ = run(generate_all(path, prompts, params, None, **kwargs))
    for spec in specs:
        on, totals = run(generate_all(path, prompts, params, spec, **kwargs))
        assert [o.token_ids for o in on] == [o.token_ids for o in off], spec["method"]
        assert [o.text for o in on] == [o.text for o in off]
        assert totals.num_drafts > 0 and totals.num_draft_tokens > totals.num_drafts  # drafts were verified


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_the_target_as_its_own_draft_has_every_draft_accepted(tiny_checkpoint_of, kind):
    """Its own draft proposes exactly what greedy decoding samples: every draft holds (the mechanics:
    the draft's KV behind the target's block tables, its positions, the reserved slots)."""
    path = tiny_checkpoint_of(kind)
    spec = own_draft(path, 4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = looping_prompts(4, seed=3)
    off, _ = run(generate_all(path, prompts, params, None, max_num_batched_tokens=32))
    on, totals = run(generate_all(path, prompts, params, spec, max_num_batched_tokens=32))
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert totals.num_draft_tokens >= 4 * 20 and totals.num_accepted_tokens == totals.num_draft_tokens, totals


def test_a_draft_of_another_vocabulary_or_window_layout_stops_the_start(tiny_checkpoint_of):
    path = tiny_checkpoint_of("llama")
    for draft, words in (
        (tiny_checkpoint_of("llama", vocab_size=1000), "must share the target's vocabulary"),
        (tiny_checkpoint_of("mistral"), "attention windows"),
        ("/nonexistent/draft", "speculative_config model: unknown model '/nonexistent/draft'"),
    ):
        spec = {"method": "draft_model", "model": str(draft)}
        with pytest.raises(ValueError, match=words):
            run(generate_all(path, [[1, 2, 3]], SamplingParams(max_tokens=2), spec))


def test_default_model_copies_and_cuts_stops_inside_accepted_drafts_with_equal_tokens():
    """On the real model: a copy task where most drafts hold, and stop strings and max_tokens that cut
    inside accepted drafts; every output is the same as without drafts. One engine per side."""
    passage = (
        "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single "
        "step. All that glitters is not gold."
    )
    messages = [{"role": "user", "content": f"Repeat this text exactly:\n\n{passage}"}]
    count = "one two three four five six seven eight nine ten"
    prompt = f"Copy: {count}\nCopy: {count}\nCopy:"
    cuts = (
        SamplingParams(temperature=0, max_tokens=40, stop=["seven"]),
        SamplingParams(temperature=0, max_tokens=40, stop=["four five"], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=5),
    )

    async def side(spec):
        async with AsyncEngine(EngineArgs(speculative_config=spec)) as engine:
            copy = (await engine.chat(messages, SamplingParams(temperature=0, max_tokens=64))).outputs[0]
            copy_totals = dataclasses.replace(engine.scheduler.spec_totals)
            outs = [(await engine.generate(prompt, params)).outputs[0] for params in cuts]
            return copy, copy_totals, [(o.text, o.token_ids, o.finish_reason) for o in outs]

    off, _, off_cuts = run(side(None))
    on, totals, on_cuts = run(side(NGRAM))
    assert on.token_ids == off.token_ids and "All that glitters" in on.text
    assert totals.num_accepted_tokens > totals.num_draft_tokens / 2, totals
    assert on_cuts == off_cuts
    assert [finish for _, _, finish in off_cuts] == ["stop", "stop", "length"]


def test_logprobs_of_accepted_drafts_equal_speculation_off(tiny_checkpoint_of):
    """A request with logprobs speculates: each kept token's logprobs come from the row that sampled it."""
    path = tiny_checkpoint_of("llama")
    own = own_draft(path)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    prompts = looping_prompts(3, seed=7)
    off, _ = run(generate_all(path, prompts, params, None))
    on, totals = run(generate_all(path, prompts, params, own))
    assert totals.num_accepted_tokens > 0
    for a, b in zip(on, off, strict=True):
        assert a.token_ids == b.token_ids and len(a.logprobs) == len(b.logprobs) == 16
        for got, want, token in zip(a.logprobs, b.logprobs, a.token_ids, strict=True):
            assert token in got and set(got) == set(want)
            for t in want:
                assert abs(got[t].logprob - want[t].logprob) < 1e-4


def test_abort_while_drafts_are_in_flight_frees_everything(tiny_checkpoint_of):
    path = tiny_checkpoint_of("llama")

    async def main():
        async with AsyncEngine(engine_args(path, NGRAM)) as engine:
            params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            handles = [engine.generate(p, params) for p in looping_prompts(4)]
            seen = 0
            async for _ in handles[0]:
                seen += 1
                if seen == 3:
                    for h in handles:
                        h.abort()
            outs = await asyncio.gather(*handles[1:])
            assert all(o.outputs[0].finish_reason == "abort" for o in outs)
            for _ in range(50):
                if engine.num_unfinished_requests() == 0:
                    break
                await asyncio.sleep(0.01)
            assert engine.num_unfinished_requests() == 0 and engine.kv_cache_usage() == 0.0
            # the engine still serves, with drafts
            out = await engine.generate(
                looping_prompts(1, seed=5)[0], dataclasses.replace(params, max_tokens=8)
            )
            assert len(out.outputs[0].token_ids) == 8

    run(main())


def test_sampled_tokens_keep_their_distribution(tiny_checkpoint_of):
    """Four sampled tokens (temperature 0.5) after a prompt whose end recurs earlier in it, 1500 requests with
    drafts and 1500 without, on a model with a 24-token vocabulary: a chi-square test of each position's
    counts, on and off. With p < 1e-3 per position the whole test's false-alarm rate is below 0.4%."""
    path = tiny_checkpoint_of("llama", vocab_size=24)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    (first,), _ = run(generate_all(path, [[5, 9, 7]], greedy, None))
    # The proposer finds [5, 9, 7] at the start and drafts the model's own greedy path after it.
    prompt = [5, 9, 7, *first.token_ids, 5, 9, 7]
    params = SamplingParams(temperature=0.5, max_tokens=4, ignore_eos=True)
    n = 1500
    spec = {**NGRAM, "disable_by_batch_size": 256}
    off, _ = run(generate_all(path, [prompt] * n, params, None, max_num_seqs=256))
    on, totals = run(generate_all(path, [prompt] * n, params, spec, max_num_seqs=256))
    # Drafts were accepted and rejected often enough for both paths to shape the counts.
    assert totals.num_accepted_tokens > 300 and totals.num_draft_tokens - totals.num_accepted_tokens > 300
    for pos in range(4):
        a = np.bincount([o.token_ids[pos] for o in off], minlength=24)
        b = np.bincount([o.token_ids[pos] for o in on], minlength=24)
        keep = (a + b) >= 10  # chi-square needs populated cells
        p = chi2_contingency(np.stack([a[keep], b[keep]])).pvalue
        assert p > 1e-3, (pos, a.tolist(), b.tolist(), p)


def test_steps_that_verify_drafts_are_uniform_decode_batches_the_graph_sizes_hold(tiny_checkpoint_of):
    """With drafts, a step of decodes and verified queries reaches the backend as one decode row per
    token (what CUDA graphs replay, gpu/cuda/graphs.py), and the capture sizes, which count 1 + k rows a
    request, hold every such step. Checked on the CPU backend's calls: the runner builds the same batch
    for every backend."""
    from aioengine.gpu.cuda.graphs import bucket_for, capture_sizes, is_uniform_decode

    path = tiny_checkpoint_of("llama")
    # its own draft: every draft holds, so most steps verify drafts
    spec = own_draft(path)
    seqs, budget = 4, 64
    seen: list[tuple[bool, int]] = []

    async def main():
        args = engine_args(path, spec, max_num_seqs=seqs, max_num_batched_tokens=budget)
        async with AsyncEngine(args) as engine:
            backend = engine.backend
            forward = backend.forward

            def spy(runner, input_ids, positions, meta):
                n = input_ids.shape[0]
                seen.append((is_uniform_decode(meta, n), n))
                return forward(runner, input_ids, positions, meta)

            backend.forward = spy
            params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
            await asyncio.gather(*(engine.generate(p, params) for p in looping_prompts(seqs, seed=2)))
            return engine.scheduler.spec_totals

    totals = run(main())
    assert totals.num_drafts > 0
    sizes = capture_sizes(seqs, budget, decode_query_len=1 + spec["num_speculative_tokens"])
    verified = [rows for uniform, rows in seen if uniform and rows > seqs]  # more rows than requests
    assert verified, (totals, seen)
    assert all(bucket_for(rows, sizes) is not None for uniform, rows in seen if uniform)
    assert capture_sizes(seqs, budget)[-1] == seqs < max(verified)  # without the 1 + k: eager
