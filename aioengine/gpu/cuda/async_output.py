"""Awaiting the device without blocking the loop: a CUDA event, signalled by a host function or polled.

``AsyncOutput`` is what ``ModelRunner.sample_tokens`` returns on CUDA: the sampled tokens are being
copied into pinned host memory on a copy stream, an event is recorded after the copy, and ``await``
resumes the step coroutine once the copy is done (stop 10 of the tour, as an ``await``).

Two ways to learn that a copy is done, both without ``synchronize()`` on the loop thread:

- A host function (cuda-python's ``cudaLaunchHostFunc``) enqueued on the copy stream right after the
  event. CUDA calls it on a driver thread when the copy completes; it hands the news to the loop with
  ``loop.call_soon_threadsafe``. Armed by the worker thread at sample time, so a later step's work on
  the same stream never delays it.
- Polling ``event.query()`` from the loop with a growing sleep: the fallback when cuda-python is not
  importable (or the launch fails). Any object with ``query() -> bool`` works (tests use a fake).

Importing this module imports neither torch nor cuda-python; both are loaded when first needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import logging
import threading
from collections.abc import Callable, Generator
from typing import Any, cast

logger = logging.getLogger(__name__)

POLL_FIRST_S = 50e-6
POLL_MAX_S = 1e-3
HOST_FN_GRACE_S = (
    0.1  # default: how often a wait on a host function checks that its event has not long completed
)


class HostSignal:
    """Set once from any thread (a CUDA host function); awaited once on an event loop."""

    __slots__ = ("_lock", "_done", "_loop", "_fut", "_owner")

    def __init__(self, owner: HostFunctions | None = None) -> None:
        self._owner = owner  # told when this signal's host function is lost
        self._lock = threading.Lock()
        self._done = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fut: asyncio.Future | None = None

    def is_set(self) -> bool:
        return self._done

    def set(self) -> None:
        with self._lock:
            self._done = True
            loop, fut = self._loop, self._fut
        if fut is not None:
            assert loop is not None  # set together with fut, under the lock
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
                loop.call_soon_threadsafe(_set_done, fut)

    async def wait(self, event: Any = None) -> None:
        """Until ``set()``; with ``event``, also once the event has been complete for two looks in a row
        the owner's ``grace_s`` apart and the host function still has not run (a lost callback must not hang
        the engine: the owner logs, and polls later outputs)."""
        with self._lock:
            if self._done:
                return
            self._loop = loop = asyncio.get_running_loop()
            self._fut = fut = loop.create_future()
        if event is None:
            await fut
            return
        seen_complete = False
        grace_s = self._owner.grace_s if self._owner is not None else HOST_FN_GRACE_S
        handle: asyncio.TimerHandle

        def look() -> None:
            nonlocal handle, seen_complete
            if fut.done():
                return
            if event.query():
                if seen_complete:
                    if self._owner is not None:
                        self._owner.lost()
                    fut.set_result(None)
                    return
                seen_complete = True
            handle = loop.call_later(grace_s, look)

        handle = loop.call_later(grace_s, look)
        try:
            await fut
        finally:
            handle.cancel()


def _set_done(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


# ---- cuda-python host functions ---------------------------------------------------------------
_HOST_FN_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_signals: dict[int, HostSignal] = {}  # userData token -> signal; dict ops are atomic under the GIL
_tokens = itertools.count(1)


def _on_host_func(user_data: int | None) -> None:
    """Runs on a CUDA driver thread when the stream reaches it; must make no CUDA call."""
    signal = _signals.pop(user_data or 0, None)
    if signal is not None:
        signal.set()


_host_fn = _HOST_FN_TYPE(_on_host_func)  # module-lifetime: CUDA may call it at any time
HOST_FN_ADDRESS: int = cast(int, ctypes.cast(_host_fn, ctypes.c_void_p).value)  # never NULL


class _HostFuncLauncher:
    """``cudaLaunchHostFunc(stream, fn, userData)`` from cuda-python (``cuda.bindings.runtime``)."""

    def __init__(self, cudart: Any) -> None:
        self.cudart = cudart
        self.fn = cudart.cudaHostFn_t(HOST_FN_ADDRESS)

    def __call__(self, stream_handle: int, token: int) -> bool:
        (err,) = self.cudart.cudaLaunchHostFunc(stream_handle, self.fn, token)
        return err == self.cudart.cudaError_t.cudaSuccess


def _cuda_python_launcher() -> _HostFuncLauncher | None:
    try:
        try:
            from cuda.bindings import runtime as cudart
        except ImportError:  # cuda-python < 12.6 spells it cuda.cudart
            from cuda import cudart
        return _HostFuncLauncher(cudart)
    except Exception as e:  # not installed, or no CUDA runtime library
        logger.info("cuda-python is not usable (%s): step outputs are awaited by polling CUDA events", e)
        return None


class HostFunctions:
    """One engine's host functions: cuda-python's launcher (found on first use) or ``launcher`` if given,
    until one is lost; from then on this engine's outputs are polled."""

    def __init__(
        self, launcher: Callable[[int, int], bool] | None = None, grace_s: float = HOST_FN_GRACE_S
    ) -> None:
        self.grace_s = grace_s
        self._launcher: Callable[[int, int], bool] | None = launcher
        self._looked = launcher is not None
        self.polling = False  # a host function was lost: poll from now on

    def launcher(self) -> Callable[[int, int], bool] | None:
        if not self._looked:
            self._launcher, self._looked = _cuda_python_launcher(), True
        return None if self.polling else self._launcher

    def lost(self) -> None:
        """An event completed but its host function never ran."""
        if not self.polling:
            logger.warning(
                "a CUDA host function did not run after its event completed: step outputs are "
                "awaited by polling CUDA events from now on"
            )
            self.polling = True

    def signal_after(self, stream: Any) -> HostSignal | None:
        """Enqueue a host function on ``stream`` (a ``torch.cuda.Stream`` or anything with ``cuda_stream``)
        that sets the returned signal when the stream's work so far is done; None if that cannot be done."""
        launch = self.launcher()
        if launch is None:
            return None
        token = next(_tokens)
        signal = _signals[token] = HostSignal(self)
        try:
            ok = launch(int(stream.cuda_stream), token)
        except Exception as e:
            logger.warning("cudaLaunchHostFunc failed (%s): falling back to polling", e)
            ok = False
        if not ok:
            _signals.pop(token, None)
            return None
        return signal


async def await_cuda_event(event: Any, signal: HostSignal | None = None) -> None:
    """Resume when ``event`` has completed: by ``signal`` (a host function) when given, else by polling
    ``event.query()`` with a sleep that grows from 50 us to 1 ms. Never blocks the loop."""
    if signal is not None:
        await signal.wait(event)
        return
    delay = POLL_FIRST_S
    while not event.query():
        await asyncio.sleep(delay)
        delay = min(2 * delay, POLL_MAX_S)


class AsyncOutput:
    """A step's output whose device-to-host copy is in flight: ``await`` it for the ModelRunnerOutput."""

    __slots__ = ("event", "signal", "_finish")

    def __init__(self, event: Any, signal: HostSignal | None, finish: Callable[[], Any]) -> None:
        self.event = event
        self.signal = signal
        self._finish = finish  # builds the output from the pinned host tensors, once they are filled

    def __await__(self) -> Generator[Any, None, Any]:
        return self._resolve().__await__()

    async def _resolve(self) -> Any:
        await await_cuda_event(self.event, self.signal)
        return self._finish()
