"""ModelPool's rules with engines that only start and stop: one shared load per model, LRU eviction that
never takes a model with requests in flight, keep_alive (0, a duration, -1), failed loads and retries."""

from __future__ import annotations

import asyncio

import pytest

from aioengine.config import EngineArgs
from aioengine.engine.pool import ModelPool, PoolConfig, model_engine_args, parse_keep_alive
from aioengine.errors import ModelLoadError, UnknownModelError


class StubEngine:
    """Starts (after a short wait, or failing for a path named bad), and records its shutdown."""

    started: list[str] = []
    stopped: list[str] = []

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.dead_error = None

    async def start(self) -> StubEngine:
        await asyncio.sleep(0.05)
        if "bad" in self.args.model:
            raise ValueError(f"{self.args.model}: not a GGUF file")
        StubEngine.started.append(self.args.served_model_name or "")
        return self

    async def shutdown(self) -> None:
        StubEngine.stopped.append(self.args.served_model_name or "")


def _pool(max_loaded: int | None = None, keep: float = 300.0) -> ModelPool:
    StubEngine.started, StubEngine.stopped = [], []
    models = {"a": "/m/a.gguf", "b": "/m/b.gguf", "c": "/m/c.gguf", "bad": "/m/bad.gguf"}
    config = PoolConfig(max_loaded, None, keep, models)
    return ModelPool(config, model_engine_args(EngineArgs()), StubEngine)  # type: ignore[arg-type]


def test_parse_keep_alive_takes_seconds_and_ollamas_durations():
    assert parse_keep_alive(None) is None
    assert parse_keep_alive(0) == 0.0 and parse_keep_alive(-1) == -1.0 and parse_keep_alive(2.5) == 2.5
    assert parse_keep_alive("10m") == 600.0 and parse_keep_alive("1h30m") == 5400.0
    assert parse_keep_alive("45s") == 45.0 and parse_keep_alive("-1") == -1.0
    assert parse_keep_alive("-1m") == -60.0
    assert parse_keep_alive("250ms") == 0.25 and parse_keep_alive("30") == 30.0
    assert parse_keep_alive(1e12) == -1.0 and parse_keep_alive("99999999h") == -1.0  # that long: never
    for bad in ("", "soon", "10x", "m", "1..5s", "nan", "inf", float("nan"), float("-inf"), True, [], {}):
        with pytest.raises(ValueError):
            parse_keep_alive(bad)


def test_concurrent_first_requests_share_one_load_and_the_lru_idle_model_goes_first():
    async def run() -> None:
        pool = _pool(max_loaded=2)
        got = await asyncio.gather(*(pool.acquire("a") for _ in range(3)))
        assert StubEngine.started == ["a"] and len({id(e) for e, _ in got}) == 1
        assert [s is not None for _, s in got] == [True, True, True]  # each waited for that one load
        for _ in range(3):
            pool.release("a")
        await pool.acquire("b")
        pool.release("b")
        assert (await pool.acquire("a"))[1] is None  # loaded already: no load to report
        pool.release("a")  # a is now the more recently used
        await pool.acquire("c")  # a third model: b, the least recently used idle one, leaves
        assert StubEngine.stopped == ["b"] and {m.name for m in pool.loaded()} == {"a", "c"}
        pool.release("c")
        with pytest.raises(UnknownModelError, match="Served: a, b, c, bad"):
            await pool.acquire("zzz")
        await pool.close()
        assert sorted(StubEngine.stopped) == ["a", "b", "c"]

    asyncio.run(run())


def test_a_model_in_use_is_never_unloaded_a_request_waits_for_room_instead():
    async def run() -> None:
        pool = _pool(max_loaded=1)
        await pool.acquire("a")  # held
        waiting = asyncio.create_task(pool.acquire("b"))
        await asyncio.sleep(0.2)
        assert not waiting.done() and StubEngine.stopped == [] and [m.name for m in pool.loaded()] == ["a"]
        pool.release("a")
        engine, seconds = await asyncio.wait_for(waiting, 5)
        assert StubEngine.stopped == ["a"] and [m.name for m in pool.loaded()] == ["b"]
        assert seconds is not None
        pool.release("b")
        await pool.close()

    asyncio.run(run())


def test_keep_alive_zero_unloads_after_the_reply_a_duration_later_and_minus_one_never():
    async def run() -> None:
        pool = _pool(keep=-1)
        pool.start()
        await pool.acquire("a")
        pool.release("a", 0.0)
        await asyncio.sleep(0.1)
        assert not pool.get("a").loaded and StubEngine.stopped == ["a"]
        await pool.acquire("b")
        pool.release("b", 0.3)
        await asyncio.sleep(0.1)
        assert pool.get("b").loaded
        await asyncio.sleep(0.4)
        assert not pool.get("b").loaded
        await pool.acquire("c")
        pool.release("c")  # the pool's default here: never
        await asyncio.sleep(0.3)
        assert pool.get("c").loaded
        assert await pool.unload("c") and not pool.get("c").loaded
        assert not await pool.unload("c")  # not loaded: nothing to do
        await pool.acquire("a")
        assert await pool.unload("a") and pool.get("a").loaded  # busy: it goes once its request is done
        pool.release("a", -1)  # whatever this request's keep_alive says
        await asyncio.sleep(0.2)
        assert not pool.get("a").loaded
        await pool.close()

    asyncio.run(run())


def test_a_failed_load_fails_its_requests_only_and_is_tried_again():
    async def run() -> None:
        pool = _pool()
        await pool.acquire("a")
        pool.release("a")
        for _ in range(2):  # each request tries again, and says why it failed
            with pytest.raises(ModelLoadError, match="bad.gguf: not a GGUF file"):
                await pool.acquire("bad")
        assert pool.get("bad").active == 0 and not pool.get("bad").loaded
        assert pool.get("a").loaded and (await pool.acquire("a"))[0] is not None
        pool.release("a")
        await pool.close()

    asyncio.run(run())
