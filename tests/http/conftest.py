"""One live server for the tests/http suite: a real engine (default model) serving several apps.

The engine and its apps run in one uvloop event loop on a background thread, as `aioengine serve` runs
them; tests talk HTTP/websocket to 127.0.0.1 and read engine state on the loop thread via `call`.
"""

from __future__ import annotations

import asyncio
import http.client as httplib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from aioengine import AsyncEngine, EngineArgs
from aioengine.http.app import bound_port, build_app, start_server
from aioengine.http.cors import CorsConfig
from tests.timing import HANG_S

CORS_ORIGIN = "http://localhost:8765"  # a page's origin: tests/http/test_cors.py serves one there
API_KEY = "test-key-123"
QUEUE_LIMIT = 2
OVERLOAD_QUEUE_LIMIT = 128
MAX_NUM_SEQS = 16
ACCESS_LOGGED = ("keyed", "logged")  # apps started with an access log, as `serve --log-requests` does
IDLE_STEPS = 4  # a finished or aborted request has left the engine within this many steps (two are in flight)


class LiveServer:
    def __init__(self) -> None:
        import uvloop

        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="aioengine-test-loop", daemon=True)
        self.thread.start()
        self.engine: AsyncEngine | None = None
        self.runners: dict[str, Any] = {}
        self.ports: dict[str, int] = {}

    def run(self, coro: Any, timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run a plain function on the loop thread (engine state is only touched there)."""

        async def wrapper() -> Any:
            return fn()

        return self.run(wrapper(), 10.0)

    async def _start(self) -> None:
        self.engine = AsyncEngine(
            EngineArgs(
                model="default",
                max_model_len=2048,
                max_num_seqs=MAX_NUM_SEQS,
                num_kv_blocks=512,
                max_num_batched_tokens=512,
            )
        )
        await self.engine.start()
        apps = {
            "main": build_app(self.engine),
            "keyed": build_app(self.engine, api_key=API_KEY),
            # pages of CORS_ORIGIN may call it, with the key (tests/http/test_cors.py)
            "cors": build_app(self.engine, api_key=API_KEY, cors=CorsConfig((CORS_ORIGIN,))),
            # tests/http/test_reasoning.py: its regexes force think text, so they cover the block too
            "reasoning": build_app(
                self.engine, reasoning_parser="qwen3", structured_outputs_in_reasoning=True
            ),
            # the default: structured outputs constrain the answer after the think block
            "reasoning-answer": build_app(self.engine, reasoning_parser="qwen3"),
            "reasoning-r1": build_app(self.engine, reasoning_parser="deepseek_r1"),
            "limited": build_app(self.engine, max_num_queued_reqs=QUEUE_LIMIT),
            "logged": build_app(self.engine, log_requests=True, served_model_names=["alias", "default"]),
            "overload": build_app(self.engine, max_num_queued_reqs=OVERLOAD_QUEUE_LIMIT),
        }
        for name, app in apps.items():
            access_log = logging.getLogger("aiohttp.access") if name in ACCESS_LOGGED else None
            runner = await start_server(app, "127.0.0.1", 0, shutdown_timeout=1.0, access_log=access_log)
            self.runners[name] = runner
            self.ports[name] = bound_port(runner)

    async def _stop(self) -> None:
        for runner in self.runners.values():
            await runner.cleanup()
        if self.engine is not None:
            await self.engine.shutdown()

    def start(self) -> LiveServer:
        self.run(self._start())
        return self

    def stop(self) -> None:
        try:
            self.run(self._stop(), 30.0)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10.0)

    def url(self, app: str = "main") -> str:
        return f"http://127.0.0.1:{self.ports[app]}"

    def engine_state(self) -> dict:
        e = self.engine
        snap = self.call(e.stats)
        return {
            "running": snap.num_running,
            "waiting": snap.num_waiting,
            "kv_usage": snap.kv_cache_usage,
            "unfinished": snap.num_unfinished,
        }

    def steps(self) -> int:
        """How many steps the engine has finished so far (its own counter)."""
        e = self.engine
        return int(self.call(lambda: e.host_s["steps"]))

    def wait_idle(
        self, max_steps: int = IDLE_STEPS, since: int | None = None, timeout: float = HANG_S
    ) -> dict:
        """Poll until no request is left and no KV block is used; returns the last state seen.

        Gives up, returning a busy state, once the engine has finished more than `max_steps` steps since
        `since` (a `steps()` value; default: now): requests that are done or aborted leave within a step or
        two (the ones in flight), however long a step takes on this machine. `timeout` only stops a hang.
        """
        since = self.steps() if since is None else since
        deadline = time.monotonic() + timeout
        while True:
            state = self.engine_state()
            if (state["running"], state["waiting"], state["unfinished"], state["kv_usage"]) == (0, 0, 0, 0.0):
                return state
            if self.steps() - since > max_steps or time.monotonic() > deadline:
                return state
            time.sleep(0.02)


@dataclass
class Resp:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


class Http:
    """A tiny blocking HTTP client (stdlib): one connection per request, nothing hidden."""

    def __init__(self, base_url: str) -> None:
        self.host, port = base_url.removeprefix("http://").split(":")
        self.port = int(port)

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        json: Any = None,
        headers: dict[str, str] | None = None,
        timeout: float = 60.0,
    ) -> Resp:
        if json is not None:
            body = orjson.dumps(json)
        conn = httplib.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request(
                method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})}
            )
            r = conn.getresponse()
            return Resp(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
        finally:
            conn.close()

    def get(self, path: str, **kw: Any) -> Resp:
        return self.request("GET", path, **kw)

    def post(self, path: str, json: Any = None, **kw: Any) -> Resp:
        return self.request("POST", path, json=json, **kw)


@pytest.fixture(scope="package")
def server():
    s = LiveServer()
    try:
        yield s.start()
    finally:
        s.stop()


@pytest.fixture(scope="package")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url() + "/v1", api_key="unused", max_retries=0, timeout=60.0)


@pytest.fixture(scope="package")
def http(server):
    return Http(server.url())
