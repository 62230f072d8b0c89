"""Many models in one process: each loaded on its first request and unloaded when idle past its keep_alive
or when the cap on loaded models (or on their resident bytes) needs its place, least recently used first.

Ollama's rules (``keep_alive``: seconds, 0 unloads after the reply, a negative value never) and llama.cpp's
router's (``--models-max``, LRU, explicit load and unload). Each loaded model is its own AsyncEngine with
its own step coroutine on the running loop. Concurrent first requests share one load; a model with requests
in flight is never unloaded (a request waits for room instead). A model whose load fails fails its own
requests (``ModelLoadError``) and leaves the others serving; its next request tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aioengine.config import EngineArgs
from aioengine.engine import gc_freeze
from aioengine.errors import ModelLoadError, UnknownModelError

if TYPE_CHECKING:
    from aioengine.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

DEFAULT_KEEP_ALIVE_S = 300.0  # Ollama's 5 minutes
NEVER_S = 10 * 365 * 86400.0  # a keep_alive this long or longer is "never" (Ollama's clients send huge ones)


@dataclass(slots=True, eq=False)
class PooledModel:
    """One served model and what the pool knows of it."""

    name: str
    path: str
    engine: AsyncEngine | None = None
    loading: asyncio.Future[AsyncEngine] | None = None
    unloading: asyncio.Future[None] | None = None  # its engine shutting down, its memory not yet given back
    active: int = 0  # requests holding it (acquired, not released)
    last_used: float = 0.0  # monotonic
    expires: float | None = None  # monotonic deadline once idle; None: never
    evict: bool = False  # unload asked for while busy: it goes once idle, whatever keep_alive says
    load_seconds: float | None = None  # the last load's
    resident_bytes: int = 0  # what the last load added to the process's RSS

    @property
    def loaded(self) -> bool:
        return self.engine is not None


@dataclass(slots=True)
class PoolConfig:
    max_loaded: int | None = None  # models resident at once (None: no cap)
    max_memory_bytes: int | None = None  # their summed resident bytes (None: no cap)
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S  # idle time before unloading; < 0: never
    models: dict[str, str] = field(default_factory=dict)  # name -> path, in listing order


def parse_keep_alive(value: object) -> float | None:
    """Seconds from Ollama's ``keep_alive``: a number of seconds, or a duration string ("10m", "1h30m",
    "45s", "-1"); negative means never, and so does ten years or more. None for None; ValueError for anything
    else (NaN and infinities included)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError("keep_alive must be a duration or a number of seconds")
    if isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            seconds = _duration(text, value)
    else:
        seconds = float(value)
    return _finite(seconds, value)


def _duration(text: str, value: str) -> float:
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    sign, rest, total = (-1.0, text[1:], 0.0) if text.startswith("-") else (1.0, text, 0.0)
    if not rest:
        raise ValueError("keep_alive must be a duration or a number of seconds")
    while rest:
        i = 0
        while i < len(rest) and (rest[i].isdigit() or rest[i] == "."):
            i += 1
        j = i
        while j < len(rest) and not (rest[j].isdigit() or rest[j] == "."):
            j += 1
        number, unit = rest[:i], rest[i:j]
        if not number or unit not in units:
            raise ValueError(f"keep_alive {value!r} is not a duration (e.g. 30s, 5m, 1h)")
        try:
            total += float(number) * units[unit]
        except ValueError:
            raise ValueError(f"keep_alive {value!r} is not a duration (e.g. 30s, 5m, 1h)") from None
        rest = rest[j:]
    return sign * total


def _finite(seconds: float, value: object) -> float:
    if not math.isfinite(seconds):
        raise ValueError(f"keep_alive {value!r} is not a finite duration")
    return -1.0 if seconds >= NEVER_S else seconds


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc keeps them otherwise)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class ModelPool:
    """The served models by name; ``acquire`` / ``release`` around each request that uses one."""

    def __init__(
        self,
        config: PoolConfig,
        engine_args: Callable[[str, str], EngineArgs],
        new_engine: Callable[[EngineArgs], AsyncEngine] | None = None,
    ) -> None:
        self.config = config
        self.models = {name: PooledModel(name, path) for name, path in config.models.items()}
        self._engine_args = engine_args  # (name, path) -> that model's EngineArgs
        self._new_engine = new_engine
        self._changed = asyncio.Event()  # a release, an unload or a load ended: waiters look again
        self._reaper: asyncio.Task[None] | None = None
        self._closed = False
        self.listeners: list[Callable[[str, PooledModel], None]] = []  # ("load" | "unload", model)

    # ---- what is served ------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self.models)

    def get(self, name: str) -> PooledModel:
        model = self.models.get(name)
        if model is None:
            raise UnknownModelError(name, self.names())
        return model

    def loaded(self) -> list[PooledModel]:
        return [m for m in self.models.values() if m.engine is not None]

    # ---- requests ------------------------------------------------------------------------------------
    async def acquire(self, name: str) -> tuple[AsyncEngine, float | None]:
        """The model's started engine, loading it first if needed (the load's seconds are returned when this
        call waited for one, else None). The model stays loaded until the matching ``release``."""
        model = self.get(name)
        model.active += 1
        try:
            waited = model.engine is None
            engine = await self._ensure_loaded(model)
        except BaseException:
            model.active -= 1
            self._touch()
            raise
        model.last_used, model.expires = time.monotonic(), None
        return engine, (model.load_seconds if waited else None)

    def release(self, name: str, keep_alive_s: float | None = None) -> None:
        """One request is done with the model; once idle it stays ``keep_alive_s`` seconds (the pool's
        default when None; 0: unload now; negative: never)."""
        model = self.get(name)
        assert model.active > 0, f"release without acquire: {name}"
        model.active -= 1
        self._idle_from_now(model, keep_alive_s)
        self._touch()

    def _idle_from_now(self, model: PooledModel, keep_alive_s: float | None) -> None:
        """The model was last used now; once idle it expires after ``keep_alive_s`` (the pool's default when
        None; negative: never), or at once when an unload was asked for."""
        keep = self.config.keep_alive_s if keep_alive_s is None else keep_alive_s
        model.last_used = time.monotonic()
        model.expires = model.last_used if model.evict else None if keep < 0 else model.last_used + keep

    async def load(self, name: str) -> float:
        """Load the model now (``POST /models/load``); returns the load's seconds (0 when it was loaded)."""
        _, seconds = await self.acquire(name)
        self.release(name, None)
        return seconds or 0.0

    async def unload(self, name: str) -> bool:
        """Unload the model once its requests are done (``POST /models/unload``); False if not loaded."""
        model = self.get(name)
        if model.loading is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(model.loading)
        if model.engine is None:
            return False
        model.expires, model.evict = time.monotonic(), True  # due now: the reaper unloads it when idle
        if model.active == 0:
            await self._unload(model)
        else:
            self._touch()
        return True

    async def close(self) -> None:
        """Unload every model (the server's shutdown)."""
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for model in list(self.models.values()):
            if model.loading is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.shield(model.loading)
            if model.engine is not None:
                await self._unload(model)

    def start(self) -> None:
        """Start the keep_alive reaper on the running loop."""
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap(), name="aioengine-model-reaper")

    # ---- loading and unloading -----------------------------------------------------------------------
    async def _ensure_loaded(self, model: PooledModel) -> AsyncEngine:
        while True:
            if model.engine is not None and model.engine.dead_error is not None:
                await self._unload(model)  # a dead engine (its requests failed): load the model afresh
            if model.engine is not None:
                return model.engine
            if model.unloading is not None:  # load again once the last engine's memory is back
                await asyncio.shield(model.unloading)
                continue
            if model.loading is None:
                if not await self._make_room(model):
                    await self._wait_change()
                    continue
                if model.engine is not None or model.loading is not None:
                    continue
                model.loading = asyncio.ensure_future(self._load(model))
            return await asyncio.shield(model.loading)

    async def _load(self, model: PooledModel) -> AsyncEngine:
        from aioengine.engine.async_engine import AsyncEngine

        t0, rss0 = time.perf_counter(), _rss_bytes()
        args = self._engine_args(model.name, model.path)
        engine = (self._new_engine or AsyncEngine)(args)
        try:
            await engine.start()
        except BaseException as e:
            with contextlib.suppress(Exception):
                await engine.shutdown()
            del engine
            self._collect()
            error = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            model.loading = None
            self._touch()
            logger.error("model %s failed to load from %s: %s", model.name, model.path, error)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise ModelLoadError(f"The model `{model.name}` failed to load: {error}") from e
        model.engine, model.loading = engine, None
        model.load_seconds = time.perf_counter() - t0
        self._idle_from_now(model, None)  # until a request holds it (the one that asked may have gone)
        model.resident_bytes = max(_rss_bytes() - rss0, 0)
        mb = model.resident_bytes >> 20
        logger.info("model %s loaded in %.2f s (%d MB resident)", model.name, model.load_seconds, mb)
        for listener in self.listeners:
            listener("load", model)
        self._touch()
        return engine

    async def _unload(self, model: PooledModel) -> None:
        """Stop the model's engine and give its memory back; a caller cancelled meanwhile (a client gone)
        does not stop it halfway."""
        engine, model.engine, model.expires, model.evict = model.engine, None, None, False
        if engine is None:
            return
        model.unloading = asyncio.ensure_future(self._stop(model, engine))
        del engine
        await asyncio.shield(model.unloading)

    async def _stop(self, model: PooledModel, engine: AsyncEngine) -> None:
        try:
            for listener in self.listeners:
                listener("unload", model)
            await engine.shutdown()
            del engine
            self._collect()
            logger.info("model %s unloaded", model.name)
        finally:
            model.unloading = None
            self._touch()

    def _collect(self) -> None:
        """What the unloaded engine held goes back to the system: its cycles are collected (out of the frozen
        generation, where other engines' starts put them), and the C heap is trimmed."""
        gc_freeze.refreeze()
        _trim_heap()

    async def _make_room(self, model: PooledModel) -> bool:
        """Unload idle models, least recently used first, until ``model`` fits the caps; False when the
        resident ones are all busy and it does not fit yet."""
        cap, budget = self.config.max_loaded, self.config.max_memory_bytes
        need = model.resident_bytes  # known after its first load; else only the count cap holds it back
        while True:
            resident = [m for m in self.models.values() if m is not model and self._resident(m)]
            over_count = cap is not None and len(resident) + 1 > cap
            used = sum(m.resident_bytes for m in resident)
            over_memory = budget is not None and resident and used + need > budget
            if not over_count and not over_memory:
                return True
            idle = sorted((m for m in resident if self._idle(m)), key=lambda m: m.last_used)
            if not idle:
                return False
            await self._unload(idle[0])

    @staticmethod
    def _resident(model: PooledModel) -> bool:
        return model.engine is not None or model.loading is not None or model.unloading is not None

    @staticmethod
    def _idle(model: PooledModel) -> bool:
        return model.engine is not None and model.active == 0

    def _touch(self) -> None:
        self._changed.set()

    async def _wait_change(self) -> None:
        self._changed.clear()
        await self._changed.wait()

    async def _reap(self) -> None:
        """Unload each idle model whose keep_alive ran out."""
        while not self._closed:
            now = time.monotonic()
            for model in list(self.models.values()):
                if self._idle(model) and model.expires is not None and model.expires <= now:
                    try:
                        await self._unload(model)
                    except Exception:  # its engine's own failure: keep reaping the others
                        logger.exception("unloading model %s failed", model.name)
            deadlines = [m.expires for m in self.models.values() if self._idle(m) and m.expires is not None]
            timeout = max(min(deadlines) - time.monotonic(), 0.0) if deadlines else None
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)


def model_engine_args(base: EngineArgs) -> Callable[[str, str], EngineArgs]:
    """Each served model's EngineArgs: the server's, with its own path and name."""

    def make(name: str, path: str) -> EngineArgs:
        return dataclasses.replace(base, model=path, served_model_name=name)

    return make
