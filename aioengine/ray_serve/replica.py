"""A Ray Serve replica of the engine: one AsyncEngine and the server's own aiohttp app in the replica's event
loop. Each request from the ingress goes through that app over a Unix socket, so that every route, error
shape and stream format is the server's own; the replica also reports its cached block hashes to the router
and its engine's death to Serve's health check (Serve then replaces it)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any

import aiohttp
from aiohttp import web

from aioengine.cli.commands import serve_configs
from aioengine.engine.async_engine import AsyncEngine
from aioengine.http.app import build_app
from aioengine.http.front.proxy import HOP_BY_HOP, end_to_end
from aioengine.http.front.replicas import sets_flag
from aioengine.model.tokenizer import NullTokenizer
from aioengine.ray_serve.calls import HTTPCall, ResponseHead, RoutingInfo

logger = logging.getLogger("aioengine.ray_serve")

# Headers Serve's proxy writes itself (the request id is the one it passed in): not sent twice
SET_BY_SERVE = HOP_BY_HOP | {"date", "server", "x-request-id"}
# The most block hashes a replica reports a period, the most recently cached first: Serve's controller sends
# every replica's report to every handle (and prints it), so the report stays small; older blocks are
# routed by the router's own records, or as not held.
MAX_REPORTED_BLOCKS = 8192


def replica_flags(engine_args: Sequence[str], cpus: float | None) -> list[str]:
    """The replica's serve flags: the app's, with ``--num-threads`` set to the CPUs Ray gave the replica
    when the app sets none (replicas sharing a node would otherwise each take every core)."""
    flags = list(engine_args)
    if not sets_flag(flags, "--num-threads") and cpus:
        flags += ["--num-threads", str(max(1, int(cpus)))]
    return flags


def routing_info(engine: AsyncEngine) -> RoutingInfo:
    """What the ingress hashes prompts with: the started engine's block size, tokenizer and adapters."""
    tokenizer = engine.tokenizer
    return RoutingInfo(
        block_size=engine.args.block_size,
        tokenizer=None if isinstance(tokenizer, NullTokenizer) else tokenizer,
        lora_names=tuple(engine.lora_modules),
        prefix_caching=engine.args.enable_prefix_caching,
    )


class EngineReplica:
    async def __init__(self, engine_args: Sequence[str]) -> None:  # type: ignore[misc]  # Serve awaits it
        import ray
        from ray import serve

        self._closed = True  # nothing to close until the fields below exist
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
        # on each response, so that a client (or a test) sees where the router sent it
        self._replica_header = ("X-Aioengine-Replica", serve.get_replica_context().replica_id.unique_id)
        args, config = serve_configs(replica_flags(engine_args, cpus))
        self.engine = AsyncEngine(args)
        self._dir = tempfile.mkdtemp(prefix="aioengine-replica-")
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        try:
            await self.engine.start()
            self._runner = web.AppRunner(build_app(self.engine, config), handler_cancellation=True)
            await self._runner.setup()
            socket = os.path.join(self._dir, "http.sock")
            await web.UnixSite(self._runner, socket).start()
            self._session = aiohttp.ClientSession(
                # no cap: every request Serve lets in reaches the engine (aiohttp's default is 100)
                connector=aiohttp.UnixConnector(path=socket, limit=0),
                timeout=aiohttp.ClientTimeout(total=None),  # a stream lasts as long as its generation
                auto_decompress=False,
            )
        except BaseException:
            await self._close()
            raise
        logger.info("replica serving %s (pid %d)", self.engine.model_name, os.getpid())

    async def forward(self, call: HTTPCall) -> AsyncIterator[ResponseHead | bytes]:
        """The response to ``call``: its head, then its body as the app writes it. Closing the generator
        (the client left) closes the connection, and the app aborts the request."""
        assert self._session is not None
        url = "http://replica" + call.target
        async with self._session.request(
            call.method, url, headers=call.headers, data=call.body, allow_redirects=False
        ) as up:
            yield ResponseHead(
                up.status, [*end_to_end(up.headers.items(), SET_BY_SERVE), self._replica_header]
            )
            async for chunk in up.content.iter_any():
                yield chunk

    def routing_info(self) -> RoutingInfo:
        return routing_info(self.engine)

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve's hook, each ``request_routing_stats_period_s``: what the router scores this replica by."""
        return {
            "block_hashes": self.engine.cached_prefix_hashes(MAX_REPORTED_BLOCKS),
            "load": self.engine.stats().num_unfinished,
        }

    async def check_health(self) -> None:
        """Serve's hook: a dead engine fails it, and Serve starts a new replica in this one's place."""
        if self.engine.dead_error is not None:
            raise RuntimeError(f"the engine is dead: {self.engine.dead_error}")

    def __del__(self) -> Awaitable[None] | None:
        """Serve's graceful shutdown, which awaits what this returns (the first time only: the collector
        calls it again later)."""
        if self._closed:
            return None
        return self._close()

    async def _close(self) -> None:
        """The app, the engine, the socket's folder."""
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._runner is not None:
            with contextlib.suppress(Exception):
                await self._runner.cleanup()
            self._runner = None
        try:
            await self.engine.shutdown()
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)
