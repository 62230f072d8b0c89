"""The Ray backend on a local Ray cluster: ray.init() here, rank 1 as a CPU actor, TP=1's greedy tokens.
Ray is an optional extra (`pip install -e '.[ray]'`): without it this module skips."""

from __future__ import annotations

import asyncio

import pytest

from aioengine.errors import EngineDeadError
from tests.engine.test_tensor_parallel import _greedy, _start_tp2, _until_dead

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_tp2_greedy_equals_tp1(local_ray, tiny_checkpoint_of):
    path = tiny_checkpoint_of("qwen3", num_attention_heads=6, num_key_value_heads=3)
    ref, _ = asyncio.run(_greedy(path, 1))
    got, stats = asyncio.run(_greedy(path, 2, distributed_executor_backend="ray"))
    assert got == ref
    assert stats["executor"] == "RayExecutor" and stats["rank_calls"][0] > 0


def test_a_killed_ray_actor_ends_every_stream(local_ray, tiny_checkpoint_of):
    path = tiny_checkpoint_of("llama", num_key_value_heads=1)

    async def main():
        engine = await _start_tp2(path, step_timeout_s=60, distributed_executor_backend="ray")
        (actor,) = engine._executor.actors
        ends, took = await _until_dead(engine, lambda: ray.kill(actor), 60)
        assert all(isinstance(e, EngineDeadError) for e in ends), ends
        assert "rank 1 exited" in str(ends[0]) and took < 30
        await engine.shutdown()

    asyncio.run(main())
