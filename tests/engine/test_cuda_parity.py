"""Greedy parity with transformers through the whole engine on CUDA, with decode graphs and without
(skipped without a GPU). The checkpoints carry no tokenizer (the engine runs with skip_tokenizer_init), so
the test needs no default-model package."""

from __future__ import annotations

import asyncio

import pytest
import torch

from aioengine import AsyncEngine, EngineArgs, SamplingParams
from aioengine.gpu.models.moe import num_experts_of
from tests.engine.conftest import SMALL, TINY
from tests.engine.test_parity import NEW_TOKENS, hf_greedy, prompts
from tests.engine.test_spec_decode import looping_prompts

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]


@pytest.fixture(scope="module", params=sorted(TINY))
def checkpoint(request, tmp_path_factory):
    config_cls, model_cls, extra = TINY[request.param]
    if request.param == "gpt_oss" and _hard_coded_swiglu_limit():
        extra = {**extra, "swiglu_limit": 7.0}  # what such a transformers computes, whatever the config says
    torch.manual_seed(0)
    model = model_cls(config_cls(**SMALL, **extra)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "norm" in name else 0.3) + (1.0 if "norm" in name else 0.0))
    path = tmp_path_factory.mktemp(f"cuda-{request.param}")
    model.save_pretrained(path)
    return path, model


def _hard_coded_swiglu_limit() -> bool:
    """Whether this transformers' gpt-oss experts ignore the config's ``swiglu_limit`` (5.17, the GPU
    image's, clamps at 7.0 whatever it says; 5.25 reads it)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    extra = TINY["gpt_oss"][2]
    config = GptOssConfig(**{**SMALL, **extra})
    want = float(extra["swiglu_limit"])
    return float(getattr(config, "swiglu_limit", 7.0)) != want or float(GptOssExperts(config).limit) != want


def _args(path, **kwargs) -> EngineArgs:
    kwargs = {"max_num_seqs": 16, **kwargs}
    return EngineArgs(
        model=str(path), device="cuda", dtype="float32", block_size=16, skip_tokenizer_init=True, **kwargs
    )


async def _run(path, prompts_, **kwargs):
    args = _args(path, **kwargs)
    async with AsyncEngine(args) as engine:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts_))
        stats = await engine.run_on_worker(engine.backend.timeline.stats)
        graphs = engine.backend.graphs
        replays = graphs.num_replays if graphs is not None else 0
        assert engine.kv_cache_usage() == 0.0
    return [o.outputs[0].token_ids for o in outs], replays, stats


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("budget", [8192, 24], ids=["one-prefill", "chunked"])
def test_greedy_parity_with_transformers_on_cuda(checkpoint, graphs, budget):
    path, hf = checkpoint
    ps = prompts(shared_prefix=False)
    expected = [hf_greedy(hf, p) for p in ps]
    got, replays, stats = asyncio.run(_run(path, ps, enforce_eager=not graphs, max_num_batched_tokens=budget))
    assert got == expected
    # A mixture of experts runs eagerly on CUDA (its fused-MoE op reads the routing on the host).
    graphs = graphs and not num_experts_of(hf.config)
    assert (replays > 0) == graphs  # uniform decode steps replayed a graph, or nothing did
    # One step per new token (the first comes with the last prompt chunk); more when the prompt is chunked.
    assert stats.steps >= NEW_TOKENS and 0.0 <= stats.idle_fraction < 1.0
    assert set(stats.by_kind) == ({"mixed", "decode_graph"} if graphs else {"mixed", "decode_eager"})


@pytest.mark.parametrize("method", ["own_draft", "ngram"])
def test_verified_drafts_replay_graphs_with_greedy_parity(checkpoint, method):
    """Steps of 1 + k decode rows a request (drafts verified) replay the captured graphs, and the greedy
    tokens still equal transformers'. With max_num_seqs 2 a replay of more than 2 rows verifies drafts."""
    path, hf = checkpoint
    ps = looping_prompts(4, seed=3)  # phrases repeated: the n-gram proposer finds drafts
    expected = [hf_greedy(hf, p) for p in ps]
    spec = {"num_speculative_tokens": 3, "disable_by_batch_size": 64}
    if method == "own_draft":
        spec |= {"method": "draft_model", "model": str(path)}
    else:
        spec |= {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    rows: list[int] = []
    mixture = bool(num_experts_of(hf.config))  # runs eagerly on CUDA: the drafts' parity alone

    async def main():
        async with AsyncEngine(_args(path, max_num_seqs=2, speculative_config=spec)) as engine:
            graphs = engine.backend.graphs
            if mixture:
                assert graphs is None
            else:
                assert graphs is not None and graphs.sizes[-1] == 8  # 2 requests x (1 + 3) rows
                replay = graphs.replay

                def spy(size, input_ids, positions, meta):
                    rows.append(meta.num_reqs)
                    return replay(size, input_ids, positions, meta)

                graphs.replay = spy
            params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            outs = await asyncio.gather(*(engine.generate(p, params) for p in ps))
            totals = engine.scheduler.spec_totals
            assert engine.kv_cache_usage() == 0.0
        return [o.outputs[0].token_ids for o in outs], totals

    got, totals = asyncio.run(main())
    assert got == expected
    assert totals.num_drafts > 0
    if method == "own_draft":
        assert totals.num_accepted_tokens == totals.num_draft_tokens
        assert mixture or max(rows) > 2, rows  # verified drafts replayed a graph
