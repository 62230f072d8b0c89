"""A soak run: for a set time, a seeded random mix of requests against a live server, every answer checked.

`await soak(url, duration_s)` returns a SoakReport: requests and errors by kind, latency percentiles. The
mix: chat and completions (JSON and SSE), n > 1, structured output (a JSON schema, a choice), websocket
generations (some cancelled), clients that hang up mid-stream, and bad requests (a 4xx is the right
answer). An error is any answer that is not what the request should get: a 5xx, a wrong status, a
malformed body or stream, a dropped connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import orjson

PROMPTS = [
    "Tell me about the sea.",
    "Write a haiku about rain.",
    "What is 2 + 2?",
    "Name three colours.",
    "Describe a red fox.",
    "Why is the sky blue?",
    "Give me a recipe for bread.",
    "Say hello.",
]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
CHOICES = ["yes", "no", "maybe"]
BAD = [  # (body, status): a request that must be refused
    ({"messages": []}, 400),
    ({"prompt": ""}, 400),
    ({"prompt": "Hi", "max_tokens": -1}, 400),
    ({"prompt": "Hi", "n": 0}, 400),
    ({"prompt": "Hi", "foo": 1}, 400),
    ({"prompt": "Hi", "model": "nope"}, 404),
    ({"messages": [{"role": "user", "content": "Hi"}], "temperature": "hot"}, 400),
    (b'{"prompt": ', 400),
    ({"prompt": "Hi", "max_tokens": 100000}, 400),
    ({"prompt": "Hi", "stop": ["x"] * 1000}, 400),
]
WEIGHTS = {
    "chat": 3,
    "completion": 3,
    "chat-stream": 3,
    "completion-stream": 2,
    "n>1": 1,
    "json-schema": 1,
    "choice": 1,
    "ws": 2,
    "abort": 2,
    "bad": 2,
}


class Wrong(Exception):
    """An answer that is not what the request should get; the message names the reason."""

    def __init__(self, reason: str, status: int | None = None) -> None:
        super().__init__(reason)
        self.status = status


@dataclass
class SoakReport:
    duration_s: float = 0.0
    requests: Counter = field(default_factory=Counter)  # by kind
    errors: Counter = field(default_factory=Counter)  # by "kind: reason"
    server_errors: int = 0  # answers with a 5xx status (HTTP or websocket error message)
    latencies: dict = field(default_factory=lambda: defaultdict(list))  # kind -> seconds, answered requests

    def percentile(self, q: float, kind: str | None = None) -> float:
        values = sorted(self.latencies[kind] if kind else [v for vs in self.latencies.values() for v in vs])
        return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0

    def summary(self) -> str:
        total = sum(self.requests.values())
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.requests.items()))
        return (
            f"{total} requests in {self.duration_s:.0f} s ({total / max(self.duration_s, 1e-9):.1f}/s): "
            f"{kinds}; errors {dict(self.errors) or 0}; latency p50 {self.percentile(0.5) * 1000:.0f} ms, "
            f"p99 {self.percentile(0.99) * 1000:.0f} ms"
        )


# ---- one request of each kind: returns normally when the answer is right, raises Wrong otherwise ---
async def _json(r: aiohttp.ClientResponse, status: int = 200) -> dict:
    if r.status != status:
        raise Wrong(f"status {r.status}", r.status)
    try:
        return await r.json()
    except (aiohttp.ContentTypeError, ValueError):
        raise Wrong("not JSON") from None


def _check_choice(c: dict, max_tokens: int, text_key: str) -> str:
    text = c["message"]["content"] if text_key == "message" else c["text"]
    if not isinstance(text, str) or c["finish_reason"] not in ("stop", "length"):
        raise Wrong("bad choice")
    return text


def _check_usage(usage: dict | None, max_tokens: int, n: int = 1) -> None:
    if not usage or not 0 <= usage["completion_tokens"] <= max_tokens * n or usage["prompt_tokens"] < 1:
        raise Wrong("bad usage")


async def _generate(
    s: aiohttp.ClientSession, url: str, rng: random.Random, chat: bool, n: int = 1, extra: dict | None = None
) -> list[str]:
    max_tokens = rng.randint(4, 16)
    body = {"max_tokens": max_tokens, "temperature": 0 if n == 1 else 0.8, "n": n, **(extra or {})}
    prompt = rng.choice(PROMPTS)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    async with s.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body) as r:
        data = await _json(r)
    if sorted(c["index"] for c in data["choices"]) != list(range(n)):
        raise Wrong("bad choices")
    _check_usage(data["usage"], max_tokens, n)
    return [_check_choice(c, max_tokens, "message" if chat else "text") for c in data["choices"]]


async def _stream(
    s: aiohttp.ClientSession, url: str, rng: random.Random, chat: bool, hang_up: bool = False
) -> None:
    max_tokens = 200 if hang_up else rng.randint(4, 16)
    body = {
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.7,
        **({"ignore_eos": True} if hang_up else {}),
    }
    prompt = rng.choice(PROMPTS)
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    finish, usage, done = None, None, False
    async with s.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body) as r:
        if r.status != 200:
            raise Wrong(f"status {r.status}", r.status)
        tokens = 0
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            if line.startswith(b"data: [DONE]"):
                done = True
                break
            chunk = orjson.loads(line[6:])
            if "error" in chunk:
                raise Wrong("error event")
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                finish = c["finish_reason"] or finish
                tokens += 1
            if hang_up and tokens >= 3:
                r.close()  # the client hangs up mid-stream
                return
    if not done or finish not in ("stop", "length"):
        raise Wrong("stream ended badly")
    _check_usage(usage, max_tokens)


async def _structured(s: aiohttp.ClientSession, url: str, rng: random.Random, schema: bool) -> None:
    extra = (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "ok", "schema": SCHEMA}}}
        if schema
        else {"structured_outputs": {"choice": CHOICES}}
    )
    text = (await _generate(s, url, rng, chat=True, extra=extra))[0]
    if schema:
        with contextlib.suppress(orjson.JSONDecodeError):  # cut short by max_tokens: not checkable
            value = orjson.loads(text)
            if not isinstance(value, dict) or set(value) != {"ok"} or not isinstance(value["ok"], bool):
                raise Wrong("breaks the schema")
    elif text not in CHOICES:
        raise Wrong("not a choice")


async def _websocket(s: aiohttp.ClientSession, url: str, rng: random.Random) -> None:
    cancel = rng.random() < 0.3
    max_tokens = 200 if cancel else rng.randint(4, 16)
    body = {
        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
        "max_tokens": max_tokens,
        **({"ignore_eos": True} if cancel else {}),
    }
    async with s.ws_connect(url + "/v1/ws") as ws:
        await ws.send_json({"type": "chat", "id": "g", "body": body})
        while True:
            msg = await ws.receive_json()
            if msg["type"] == "error":
                raise Wrong(f"ws error {msg['error']['status']}", msg["error"]["status"])
            if msg["type"] == "delta" and cancel:
                await ws.send_json({"type": "cancel", "id": "g"})
                cancel = None  # once; a late cancel may also answer 404
            elif msg["type"] == "done":
                reason = msg["choices"][0]["finish_reason"]
                if reason not in (("abort",) if cancel is None else ("stop", "length")):
                    raise Wrong(f"ws finish {reason}")
                _check_usage(msg["usage"], max_tokens)
                return


async def _bad(s: aiohttp.ClientSession, url: str, rng: random.Random) -> None:
    body, status = rng.choice(BAD)
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with s.post(url + path, data=data, headers={"Content-Type": "application/json"}) as r:
        err = await _json(r, status)
    if set(err.get("error", {})) != {"message", "type", "param", "code"}:
        raise Wrong("bad error JSON")


def _runners(s: aiohttp.ClientSession, url: str, rng: random.Random) -> dict[str, Callable[[], Awaitable]]:
    return {
        "chat": lambda: _generate(s, url, rng, chat=True),
        "completion": lambda: _generate(s, url, rng, chat=False),
        "chat-stream": lambda: _stream(s, url, rng, chat=True),
        "completion-stream": lambda: _stream(s, url, rng, chat=False),
        "n>1": lambda: _generate(s, url, rng, chat=False, n=rng.randint(2, 3)),
        "json-schema": lambda: _structured(s, url, rng, schema=True),
        "choice": lambda: _structured(s, url, rng, schema=False),
        "ws": lambda: _websocket(s, url, rng),
        "abort": lambda: _stream(s, url, rng, chat=rng.random() < 0.5, hang_up=True),
        "bad": lambda: _bad(s, url, rng),
    }


async def soak(
    url: str, duration_s: float, concurrency: int = 8, seed: int = 0, request_timeout_s: float = 120.0
) -> SoakReport:
    """Run the mix for `duration_s` seconds with `concurrency` clients; requests in flight then finish."""
    report = SoakReport()
    deadline = time.monotonic() + duration_s
    kinds, weights = list(WEIGHTS), list(WEIGHTS.values())

    async def client(i: int, s: aiohttp.ClientSession) -> None:
        rng = random.Random(seed * 1000 + i)
        runners = _runners(s, url, rng)
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            report.requests[kind] += 1
            t0 = time.perf_counter()
            try:
                await asyncio.wait_for(runners[kind](), request_timeout_s)
            except Wrong as e:
                report.errors[f"{kind}: {e}"] += 1
                report.server_errors += e.status is not None and e.status >= 500
                continue
            except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, TypeError) as e:
                report.errors[f"{kind}: {type(e).__name__}"] += 1
                continue
            report.latencies[kind].append(time.perf_counter() - t0)

    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(client(i, s) for i in range(concurrency)))
    report.duration_s = time.monotonic() - t0
    return report
