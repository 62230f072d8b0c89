"""Awaiting the device without blocking the loop, proven on CPU with fake events and a fake host-function
launcher (the real cudaLaunchHostFunc path is in tests/gpu/cuda/test_device.py, on a GPU)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from aioengine.config import EngineArgs
from aioengine.engine.async_engine import AsyncEngine
from aioengine.errors import EngineDeadError
from aioengine.gpu.cuda import async_output
from aioengine.gpu.cuda.async_output import AsyncOutput, HostFunctions, HostSignal, await_cuda_event
from aioengine.gpu.cuda.timeline import GpuTimeline


class FakeEvent:
    """query() turns True after ``ready_after`` seconds (or never, for None)."""

    def __init__(self, ready_after: float | None) -> None:
        self.t_ready = None if ready_after is None else time.monotonic() + ready_after
        self.queries = 0
        self.complete_looks = 0  # queries that found it complete

    def query(self) -> bool:
        self.queries += 1
        done = self.t_ready is not None and time.monotonic() >= self.t_ready
        self.complete_looks += done
        return done


async def _ticks_while(coro) -> tuple[object, int]:
    """Run ``coro`` and count how often the loop got to run a ticker meanwhile (it must not block)."""
    ticks = 0
    stop = False

    async def ticker() -> None:
        nonlocal ticks
        while not stop:
            ticks += 1
            await asyncio.sleep(0)

    t = asyncio.create_task(ticker())
    try:
        return await coro, ticks
    finally:
        stop = True
        await t


def test_polling_fallback_resumes_when_the_event_completes_and_never_blocks():
    ev = FakeEvent(0.05)
    _, ticks = asyncio.run(_ticks_while(await_cuda_event(ev)))
    assert ev.query() and ev.queries > 3 and ticks > 3


def test_already_complete_event_returns_at_once():
    ev = FakeEvent(0.0)
    asyncio.run(await_cuda_event(ev))
    assert ev.queries == 1


@pytest.mark.parametrize("set_first", [True, False])
def test_host_signal_set_from_another_thread(set_first):
    sig = HostSignal()

    async def main() -> None:
        if set_first:
            sig.set()
        else:
            threading.Timer(0.05, sig.set).start()
        await asyncio.wait_for(await_cuda_event(FakeEvent(None), sig), 5)

    asyncio.run(main())
    assert sig.is_set()


def test_host_function_pointer_sets_the_signal_it_was_armed_for():
    """signal_after hands (stream, token) to the launcher; a CUDA driver thread would later call
    the C function pointer with the token. Here a thread calls that pointer through ctypes."""
    calls = []

    def launcher(stream_handle: int, token: int) -> bool:
        calls.append((stream_handle, token))
        fn = async_output._HOST_FN_TYPE(async_output.HOST_FN_ADDRESS)
        threading.Timer(0.05, fn, args=(token,)).start()
        return True

    class Stream:
        cuda_stream = 1234

    async def main() -> None:
        sig = HostFunctions(launcher).signal_after(Stream())
        assert sig is not None and not sig.is_set()
        await asyncio.wait_for(await_cuda_event(FakeEvent(None), sig), 5)

    asyncio.run(main())
    assert calls and calls[0][0] == 1234
    assert calls[0][1] not in async_output._signals  # popped by the callback


def test_a_host_function_that_never_runs_cannot_hang_the_wait(caplog):
    """A launch that reports success but whose callback never comes: once the event has been complete for
    two looks, the wait ends, with a warning, and that engine's later outputs are polled."""
    host_functions = HostFunctions(lambda s, t: True, grace_s=0.02)
    other = HostFunctions(lambda s, t: True, grace_s=0.02)  # another engine's: unaffected

    class Stream:
        cuda_stream = 1

    event = FakeEvent(0.01)

    async def main() -> HostSignal:
        sig = host_functions.signal_after(Stream())
        assert sig is not None
        await asyncio.wait_for(await_cuda_event(event, sig), 5)  # only a hang guard
        return sig

    sig = asyncio.run(main())
    assert event.complete_looks == 2  # it ended at the second look that found the event complete
    assert not sig.is_set()  # only the host function sets it
    assert host_functions.polling and "did not run" in caplog.text
    assert host_functions.signal_after(Stream()) is None  # polled from now on
    assert not other.polling and other.signal_after(Stream()) is not None
    async_output._signals.clear()


def test_a_host_function_that_runs_keeps_the_launcher():

    def launch(stream_handle: int, token: int) -> bool:
        threading.Timer(0.05, async_output._on_host_func, args=(token,)).start()
        return True

    host_functions = HostFunctions(launch, grace_s=0.01)

    class Stream:
        cuda_stream = 1

    async def main() -> None:
        sig = host_functions.signal_after(Stream())
        await asyncio.wait_for(await_cuda_event(FakeEvent(None), sig), 5)  # the event never looks complete
        assert sig.is_set()

    asyncio.run(main())
    assert not host_functions.polling and host_functions.launcher() is launch


def test_failed_launch_falls_back_to_polling():
    class Stream:
        cuda_stream = 0

    assert HostFunctions(lambda s, t: False).signal_after(Stream()) is None
    assert not async_output._signals


def test_async_output_finishes_after_the_event():
    order = []
    out = AsyncOutput(FakeEvent(0.02), None, lambda: order.append("finish") or "result")
    assert asyncio.run(_await(out)) == "result" and order == ["finish"]


async def _await(x):
    return await x


def _engine(step_timeout_s: float) -> AsyncEngine:
    """An engine whose step results are awaited by the CUDA worker's ``output`` (no thread, no device)."""
    from aioengine.executor import UniProcExecutor
    from aioengine.gpu.cuda.worker import CudaWorker

    engine = AsyncEngine(EngineArgs(step_timeout_s=step_timeout_s))
    # output() needs none of the worker thread's state
    engine._executor = UniProcExecutor(object.__new__(CudaWorker), None)
    return engine


def test_engine_awaits_a_worker_future_then_an_async_output():
    engine = _engine(5.0)

    async def main():
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(AsyncOutput(FakeEvent(0.02), None, lambda: "tokens"))
        return await engine._await_step(fut)

    assert asyncio.run(main()) == "tokens"


def test_engine_plain_result_still_works():
    engine = _engine(5.0)

    async def main():
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result("cpu output")
        return await engine._await_step(fut)

    assert asyncio.run(main()) == "cpu output"


def test_watchdog_covers_the_device_wait():
    engine = _engine(0.1)

    async def main():
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(AsyncOutput(FakeEvent(None), None, lambda: "never"))
        await engine._await_step(fut)

    with pytest.raises(EngineDeadError, match="watchdog"):
        asyncio.run(main())


class TimedEvent:
    """A fake timing event: ``record()`` stamps the next time from a script."""

    clock: list[float] = []

    def __init__(self) -> None:
        self.t = None
        self.done = True

    def record(self) -> None:
        self.t = TimedEvent.clock.pop(0)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, other: TimedEvent) -> float:
        return other.t - self.t


def test_timeline_idle_fraction():
    # Step 1 runs 0-10 ms, step 2 starts at 10 (queued in time: no gap), step 3 starts 5 ms late.
    TimedEvent.clock = [0.0, 10.0, 10.0, 18.0, 23.0, 30.0]
    tl = GpuTimeline(TimedEvent)
    for _ in range(3):
        tl.start()
        tl.end()
    s = tl.stats()
    assert s.steps == 3 and s.busy_ms == pytest.approx(25.0) and s.idle_ms == pytest.approx(5.0)
    assert s.idle_fraction == pytest.approx(5.0 / 30.0)
    assert s.as_dict()["gpu_idle_fraction"] == pytest.approx(1 / 6)
    TimedEvent.clock = [100.0, 101.0]
    tl.reset()  # a new window: no gap from the last step before it
    tl.start()
    tl.end()
    s = tl.stats()
    assert (s.steps, s.busy_ms, s.idle_ms) == (1, 1.0, 0.0)


def test_timeline_sums_idle_and_busy_time_per_kind_of_step():
    # A mixed step 0-10, a graph decode 12-15 (2 ms gap), an eager decode 15-19, a graph decode 20-23.
    TimedEvent.clock = [0.0, 10.0, 12.0, 15.0, 15.0, 19.0, 20.0, 23.0]
    tl = GpuTimeline(TimedEvent)
    for kind in ("mixed", "decode_graph", "decode_eager", "decode_graph"):
        tl.start(kind)
        tl.end()
    s = tl.stats()
    assert (s.steps, s.busy_ms, s.idle_ms) == (4, 20.0, 3.0)
    g, e, m = s.by_kind["decode_graph"], s.by_kind["decode_eager"], s.by_kind["mixed"]
    assert (g.steps, g.busy_ms, g.idle_ms) == (2, 6.0, 3.0) and g.idle_fraction == pytest.approx(3 / 9)
    assert (e.steps, e.idle_ms, m.steps, m.idle_ms) == (1, 0.0, 1, 0.0)
    d = s.as_dict()
    assert d["gpu_steps_decode_graph"] == 2 and d["gpu_idle_fraction_decode_graph"] == pytest.approx(1 / 3)
    assert d["gpu_idle_fraction"] == pytest.approx(3 / 23)
    s.by_kind["mixed"].steps = 99  # stats() hands out a copy
    assert tl.stats().by_kind["mixed"].steps == 1


def test_timeline_leaves_incomplete_steps_for_later():
    TimedEvent.clock = [0.0, 4.0]
    tl = GpuTimeline(TimedEvent)
    tl.start()
    tl._make_event = lambda: _pending_event()
    tl.end()
    assert tl.stats(wait=False).steps == 0
    assert tl.stats(wait=True).steps == 1


def _pending_event() -> TimedEvent:
    ev = TimedEvent()
    ev.done = False
    return ev
