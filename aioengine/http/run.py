"""Run a started engine (or a pool of models) behind the HTTP server until a signal or engine death; shut down
gracefully.

Exit codes: 0 after SIGINT/SIGTERM (in-flight requests finish within the grace period, the rest are
aborted), 1 when the engine dies, so that a supervisor restarts the process.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable

from aiohttp import web

from aioengine.engine.client import EngineClient
from aioengine.engine.pool import ModelPool
from aioengine.http.app import STATE, ServerConfig, bound_port, build_app, start_server
from aioengine.http.metrics import PoolMetrics, StatsLogger

logger = logging.getLogger("aioengine.serve")

# After the engine dies, keep answering (503 engine_dead on /health and new requests) this long before the
# listener closes: health checks and clients learn why, instead of seeing the connection refused.
DEATH_GRACE_S = 0.5


def install_signal_handlers(stop: asyncio.Event) -> None:
    """First SIGINT/SIGTERM: graceful stop. A second one: leave at once."""
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            logger.warning("second %s: exiting now", sig.name)
            raise SystemExit(1)
        logger.info("received %s: shutting down", sig.name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)


async def serve_engine(
    engine: EngineClient,
    config: ServerConfig,
    host: str,
    port: int,
    stop: asyncio.Event,
    stats_interval: float | None = 10.0,
    shutdown_timeout: float = 5.0,
    access_log: bool = False,
    on_ready: Callable[[int], None] | None = None,
) -> int:
    """Serve until `stop` is set (-> 0) or the engine dies (-> 1). The engine must be started."""
    app = build_app(engine, config)
    serving = (engine.model_name, " (chat page /, API /v1, metrics /metrics)")
    runner = await _listen(app, host, port, shutdown_timeout, access_log, serving, on_ready)
    if runner is None:
        await engine.shutdown()
        return 1
    stats_task = None
    if stats_interval:
        metrics = app[STATE].metrics
        assert metrics is not None, "set when the app started"
        stats_task = asyncio.create_task(_log_stats(StatsLogger(metrics), stats_interval))
    dead = await _wait_stop_or_death(engine, stop)
    if dead:
        logger.error("the engine is dead (%s): exiting", engine.dead_error)
        await asyncio.sleep(DEATH_GRACE_S)
    await _drain(app, runner, lambda: engine.stats().num_unfinished, 0.0 if dead else shutdown_timeout)
    await engine.shutdown()  # aborts the rest: their streams end with finish_reason "abort"
    if stats_task is not None:
        stats_task.cancel()
    await runner.cleanup()
    logger.info("shut down")
    return 1 if dead else 0


async def _listen(
    app: web.Application,
    host: str,
    port: int,
    shutdown_timeout: float,
    access_log: bool,
    serving: tuple[str, str],
    on_ready: Callable[[int], None] | None,
) -> web.AppRunner | None:
    """The app served on host:port, its ready line logged ("Serving WHAT on URL NOTE") and ``on_ready`` told
    the port; None (logged) when it cannot listen there."""
    try:
        runner = await start_server(
            app,
            host,
            port,
            shutdown_timeout=min(shutdown_timeout, 5.0),
            access_log=logging.getLogger("aiohttp.access") if access_log else None,
        )
    except OSError as e:
        logger.error("cannot listen on %s:%d: %s", host, port, e)
        return None
    what, note = serving
    logger.info("Serving %s on http://%s:%d%s", what, host, bound_port(runner), note)
    if on_ready is not None:
        on_ready(bound_port(runner))
    return runner


async def _drain(
    app: web.Application, runner: web.AppRunner, busy: Callable[[], int], timeout: float
) -> None:
    """Refuse new generations (503) and connections, then give the ``busy()`` requests ``timeout`` seconds to
    finish; the caller aborts what is left."""
    app[STATE].draining = True  # new generations on open connections get 503
    for site in list(runner.sites):
        await site.stop()  # no new connections
    deadline = time.monotonic() + timeout
    while busy() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if timeout and busy():
        logger.info("aborting %d unfinished requests", busy())


async def _wait_stop_or_death(engine: EngineClient, stop: asyncio.Event) -> bool:
    """Wait for ``stop`` or the engine's end; True when the engine died."""
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(engine.stopped.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    return engine.dead_error is not None


async def _log_stats(stats: StatsLogger, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        line = stats.line()
        if line is not None:
            logger.info("%s", line)


async def serve_pool(
    pool: ModelPool,
    config: ServerConfig,
    host: str,
    port: int,
    stop: asyncio.Event,
    shutdown_timeout: float = 5.0,
    on_ready: Callable[[int], None] | None = None,
    stats_interval: float | None = 10.0,
    access_log: bool = False,
) -> int:
    """Serve the pool's models until `stop` is set (-> 0); each loads on its first request."""
    app = build_app(None, config, pool=pool)
    serving = (
        f"{len(pool.names())} models ({', '.join(pool.names())})",
        ", each loaded on its first request",
    )
    runner = await _listen(app, host, port, shutdown_timeout, access_log, serving, on_ready)
    if runner is None:
        return 1
    stats_task = None
    if stats_interval:
        pool_metrics = app[STATE].pool_metrics
        assert pool_metrics is not None, "set when the app started"
        stats_task = asyncio.create_task(_log_pool_stats(pool_metrics, stats_interval))
    await stop.wait()
    if stats_task is not None:
        stats_task.cancel()
    await _drain(app, runner, lambda: sum(m.active for m in pool.models.values()), shutdown_timeout)
    await pool.close()  # every engine stopped: what still streams ends with finish_reason "abort"
    await runner.cleanup()
    logger.info("shut down")
    return 0


async def _log_pool_stats(pool_metrics: PoolMetrics, interval: float) -> None:
    """Each loaded model's stats line, named (a model loaded since the last line starts its own)."""
    loggers: dict[str, StatsLogger] = {}
    while True:
        await asyncio.sleep(interval)
        engines = pool_metrics.engines
        for name in list(loggers):
            if name not in engines or loggers[name].metrics is not engines[name]:
                del loggers[name]
        for name, metrics in engines.items():
            line = loggers.setdefault(name, StatsLogger(metrics)).line()
            if line is not None:
                logger.info("%s: %s", name, line)
