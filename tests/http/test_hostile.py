"""Hostile input: oversized or absurd fields get a quick 400 within RequestLimits, websockets close cleanly
on binary or oversized frames, and neither the API key nor prompts reach the logs (without --log-requests).

"Quick" and "off the loop" are measured against units taken in the same test (tests/timing.py): a /health
round trip plus parsing the body once; the request's own duration; engine steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time

import aiohttp
import orjson
import pytest

import aioengine.http.app as server_module
from aioengine.cli.bench.loop_lag import LoopLagProbe
from aioengine.http.errors import APIError
from aioengine.http.openai.chat import parse_chat_request
from aioengine.http.openai.completions import parse_completion_request
from aioengine.http.schema import RequestLimits
from tests.http.conftest import API_KEY, IDLE_STEPS, Http
from tests.timing import HANG_S, median_s

CHAT, COMP, EMB = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
MSG = [{"role": "user", "content": "Hi"}]
LIMITS = RequestLimits()
# A hostile body's 400 within 25 units: a /health round trip plus parsing the body once (measured worst: 7.5).
QUICK_400_UNITS = 25
# Off the loop: no loop stall reaches a quarter of the request's time, which the off-loop work dominates.
STALL_PER_REQUEST = 0.25


def chat(**kw) -> dict:
    return {"messages": MSG, "max_tokens": 2, **kw}


def comp(**kw) -> dict:
    return {"prompt": "Hi", "max_tokens": 2, **kw}


def raw(obj: dict) -> bytes:
    return json.dumps(obj).encode()  # the stdlib writes integers beyond 64 bits, as a hostile client may


def nested(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


def deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


# (id, path, body, param, a word of the message)
CASES = [
    ("nested-100k", CHAT, nested(100_000), None, "deeper than 64"),
    ("nested-65", CHAT, nested(65), None, "deeper than 64"),
    (
        "nested-schema",
        CHAT,
        orjson.dumps(
            chat(response_format={"type": "json_schema", "json_schema": {"schema": deep_schema(40)}})
        ),
        None,
        "deeper than 64",
    ),
    ("utf8-in-string", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', None, "UTF-8"),
    ("lone-surrogate", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', None, "JSON"),
    ("n-beyond-64-bits", CHAT, raw(chat(n=10**30)), "n", "128"),
    ("n-huge", COMP, raw(comp(n=2**62)), "n", "128"),
    ("seed-beyond-64-bits", COMP, raw(comp(seed=2**70)), "seed", "64-bit"),
    ("max-tokens-fraction", COMP, raw(comp(max_tokens=2.5)), "max_tokens", "integer"),
    ("max-tokens-beyond-64-bits", CHAT, raw(chat(max_tokens=10**30)), "max_tokens", "context length"),
    ("max-tokens-huge", COMP, raw(comp(max_tokens=2**63 - 1)), "max_tokens", "context length"),
    (
        "max-completion-tokens-huge",
        CHAT,
        raw(chat(max_completion_tokens=2**62)),
        "max_tokens",
        "context length",
    ),
    ("logprobs-huge", COMP, raw(comp(logprobs=10**20)), "logprobs", "20"),
    # These reached the worker before: a top_k past 64 bits raised OverflowError in the step and killed the
    # engine for everyone.
    ("top-k-beyond-64-bits", CHAT, raw(chat(top_k=10**30)), "top_k", "at most"),
    ("min-tokens-beyond-64-bits", COMP, raw(comp(min_tokens=10**30, max_tokens=4)), "min_tokens", "at most"),
    ("temperature-past-float32", CHAT, raw(chat(temperature=1e300)), "temperature", "float32"),
    (
        "repetition-penalty-past-float32",
        COMP,
        raw(comp(repetition_penalty=1e300)),
        "repetition_penalty",
        "float32",
    ),
    ("top-logprobs-huge", CHAT, raw(chat(logprobs=True, top_logprobs=2**40)), "top_logprobs", "20"),
    ("stop-100k", CHAT, orjson.dumps(chat(stop=["x"] * 100_000)), "stop", "32"),
    ("stop-one-giant-string", CHAT, orjson.dumps(chat(stop=["x" * 100_000])), "stop[0]", "1024"),
    (
        "stop-token-ids-200k",
        CHAT,
        orjson.dumps(chat(stop_token_ids=[1] * 200_000)),
        "stop_token_ids",
        "16384",
    ),
    (
        "allowed-token-ids-200k",
        COMP,
        orjson.dumps(comp(allowed_token_ids=[1] * 200_000)),
        "allowed_token_ids",
        "16384",
    ),
    (
        "logit-bias-40k",
        CHAT,
        orjson.dumps(chat(logit_bias={str(i): 1 for i in range(40_000)})),
        "logit_bias",
        "1024",
    ),
    (
        "bad-words-10k",
        COMP,
        orjson.dumps(comp(bad_words=[f"w{i}" for i in range(10_000)])),
        "bad_words",
        "128",
    ),
    ("messages-100k", CHAT, orjson.dumps(chat(messages=MSG * 100_000)), "messages", "4096"),
    ("prompts-1000", COMP, orjson.dumps(comp(prompt=["Hi"] * 1000)), "prompt", "256"),
    ("embedding-inputs-1000", EMB, orjson.dumps({"input": ["Hi"] * 1000}), "input", "256"),
    ("embedding-ids-beyond-64-bits", EMB, raw({"input": [1, 10**30]}), "input[1]", "integer"),
    ("embedding-dimensions-huge", EMB, raw({"input": "Hi", "dimensions": 10**30}), "dimensions", "1"),
    ("embedding-nested-100k", EMB, b'{"input": ' + b"[" * 99_999 + b"]" * 99_999 + b"}", None, "deeper"),
    (
        "template-kwargs-messages",
        CHAT,
        orjson.dumps(chat(chat_template_kwargs={"messages": 5})),
        "chat_template_kwargs.messages",
        "may not set",
    ),
    (
        "template-kwargs-template",
        CHAT,
        orjson.dumps(
            chat(chat_template_kwargs={"chat_template": "{% for i in range(10**9) %}x{% endfor %}"})
        ),
        "chat_template_kwargs.chat_template",
        "may not set",
    ),
    (
        "tokenize-template-kwargs",
        "/tokenize",
        orjson.dumps({"messages": MSG, "chat_template_kwargs": {"tokenize": False}}),
        "chat_template_kwargs.tokenize",
        "may not set",
    ),
]


def _parse_once(body: bytes) -> None:
    with contextlib.suppress(orjson.JSONDecodeError):
        orjson.loads(body)


@pytest.mark.serial  # its time is compared with a unit measured beside it
@pytest.mark.parametrize(("name", "path", "body", "param", "word"), CASES, ids=[c[0] for c in CASES])
def test_hostile_field_is_a_quick_400(http, name, path, body, param, word):
    responses = []
    elapsed = median_s(lambda: responses.append(http.request("POST", path, body=body)), 3)
    unit = median_s(lambda: http.get("/health"), 5) + median_s(lambda: _parse_once(body), 3)
    for r in responses:
        assert r.status == 400, r.body[:300]
        err = r.json()["error"]
        assert err["type"] == "BadRequestError" and err["param"] == param
        assert err["code"] in (400, "context_length_exceeded")
        assert word in err["message"], err["message"]
    assert elapsed < QUICK_400_UNITS * unit, f"{name}: {elapsed * 1000:.1f} ms, unit {unit * 1000:.2f} ms"


@pytest.mark.serial  # measures the loop's stalls
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_huge_prompt_is_tokenized_off_the_loop(server, http, kind):
    """~1.8 MB of prompt: tokenizing it on the loop stalled every stream for ~0.5 s (4 MiB: 1.4-2.2 s)."""

    async def start_probe() -> LoopLagProbe:
        return LoopLagProbe().start()

    body = (
        {"prompt": "hello " * 300_000}
        if kind == "completion"
        else {"messages": [{"role": "user", "content": "hello " * 150}] * 2000}
    )
    probe = server.run(start_probe())
    t0 = time.perf_counter()
    r = http.post(CHAT if kind == "chat" else COMP, json={**body, "max_tokens": 2})
    elapsed = time.perf_counter() - t0  # mostly the tokenization: on the loop, one stall as long
    server.run(probe.stop())
    assert r.status == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert max(probe.lags) < STALL_PER_REQUEST * elapsed, (
        f"the loop stalled {max(probe.lags) * 1000:.0f} ms in a request of {elapsed * 1000:.0f} ms"
    )


@pytest.mark.serial  # measures the loop's stalls
def test_a_huge_json_schema_compiles_off_the_loop(server, http):
    """A 0.2 MB schema (3,000 patterned properties): compiling it on the loop stalled every stream ~1.5 s."""

    async def start_probe() -> LoopLagProbe:
        return LoopLagProbe().start()

    props = {f"p{j}": {"type": "string", "pattern": "[a-z]{1,8}[0-9]{2,4}"} for j in range(3000)}
    schema = {"type": "object", "properties": props, "required": list(props)}
    plain_s = median_s(lambda: http.post(COMP, json=comp()), 3)  # the same request without the schema
    probe = server.run(start_probe())
    t0 = time.perf_counter()
    r = http.post(COMP, json=comp(structured_outputs={"json": schema}))
    elapsed = time.perf_counter() - t0
    server.run(probe.stop())
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 2
    # The compile must be most of the request (over 3/4 of it), or a compile on the loop would not show.
    assert elapsed > 4 * plain_s, "the schema compiled too fast to show anything: make it bigger"
    assert max(probe.lags) < STALL_PER_REQUEST * elapsed, (
        f"the loop stalled {max(probe.lags) * 1000:.0f} ms in a request of {elapsed * 1000:.0f} ms"
    )


def test_limits_are_configurable():
    limits = RequestLimits(max_n=2, max_stop=1, max_logit_bias=1, max_messages=1, max_token_ids=2)
    for body, param in [
        (chat(n=3, temperature=1), "n"),
        (chat(stop=["a", "b"]), "stop"),
        (chat(logit_bias={"1": 1, "2": 1}), "logit_bias"),
        (chat(messages=MSG * 2), "messages"),
        (chat(stop_token_ids=[1, 2, 3]), "stop_token_ids"),
    ]:
        parse_chat_request(dict(body), limits=LIMITS)  # the defaults allow it
        with pytest.raises(APIError) as e:
            parse_chat_request(dict(body), limits=limits)
        assert e.value.status == 400 and e.value.param == param
    with pytest.raises(APIError):
        parse_completion_request(
            comp(prompt=["a", "b"], n=2, temperature=1), limits=RequestLimits(max_prompts=3)
        )


def test_request_limit_flag():
    import argparse

    from aioengine.cli.commands import parse_request_limit

    assert parse_request_limit("max_n=16") == ("max_n", 16)
    for text in ("max_n=0", "max_n=x", "nope=3", "max_n"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_request_limit(text)


def test_a_normal_request_works_after_the_hostile_ones(http, server):
    r = http.post(CHAT, json=chat(temperature=0, max_tokens=4))
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert server.wait_idle()["unfinished"] == 0


# ---- websocket: oversized and binary frames close the socket; nothing is left running -------------
LONG = {
    "type": "completion",
    "id": "long",
    "body": {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True},
}


async def _ws_close_code(server, frame: str | bytes) -> tuple[int | None, int, int]:
    """Start a long generation, let it stream, send a hostile frame: (close code, requests before, engine
    steps from the close until no request was left)."""
    async with aiohttp.ClientSession() as s, s.ws_connect(server.url() + "/v1/ws", max_msg_size=0) as ws:
        await ws.send_json(LONG)
        while (await asyncio.wait_for(ws.receive_json(), HANG_S))["type"] != "delta":
            pass
        busy = server.engine_state()["unfinished"]
        # The server closes while a big frame is still being written: send in the background, read here.
        sender = asyncio.create_task(ws.send_str(frame) if isinstance(frame, str) else ws.send_bytes(frame))
        try:
            while (msg := await asyncio.wait_for(ws.receive(), HANG_S)).type != aiohttp.WSMsgType.CLOSE:
                assert msg.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY), msg
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
        closed_at = server.steps()
        deadline = time.monotonic() + HANG_S
        while server.engine_state()["unfinished"] and server.steps() - closed_at <= IDLE_STEPS:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        return msg.data, busy, server.steps() - closed_at


@pytest.mark.parametrize(
    ("frame", "code"),
    [('{"type": "ping", "pad": "' + "x" * (4 << 20) + '"}', 1009), (b'{"type": "ping"}', 1003)],
    ids=["oversized", "binary"],
)
def test_websocket_hostile_frame_closes_and_aborts(server, frame, code):
    close_code, busy, steps = asyncio.run(_ws_close_code(server, frame))
    assert busy == 1 and close_code == code
    assert steps <= IDLE_STEPS  # its 1000-token generation was aborted at once: within the steps in flight
    assert server.wait_idle() == {"running": 0, "waiting": 0, "kv_usage": 0.0, "unfinished": 0}


def test_websocket_deep_or_malformed_message_is_an_error_not_a_close(server):
    async def main():
        async with aiohttp.ClientSession() as s, s.ws_connect(server.url() + "/v1/ws") as ws:
            replies = []
            for text in (
                '{"type": "ping", "x": ' + "[" * 500 + "]" * 500 + "}",
                '{"type": "ping",',
                "\u0000",
            ):
                await ws.send_str(text)
                replies.append(await asyncio.wait_for(ws.receive_json(), 10))
            await ws.send_json({"type": "ping", "id": 1})
            return replies, await ws.receive_json()

    replies, pong = asyncio.run(main())
    assert [r["error"]["status"] for r in replies] == [400, 400, 400]
    assert "deeper than 64" in replies[0]["error"]["message"]
    assert pong == {"type": "pong", "id": "1"}


# ---- logs: no API key, no prompt unless --log-requests --------------------------------------------
def _logged_text(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


async def _ws_ping(url: str, **kw) -> int | None:
    async with aiohttp.ClientSession() as s:
        try:
            async with s.ws_connect(url + "/v1/ws", **kw) as ws:
                await ws.send_json({"type": "ping"})
                await ws.receive_json()
                return 101
        except aiohttp.WSServerHandshakeError as e:
            return e.status


def test_api_key_is_compared_in_constant_time_and_never_logged(server, caplog, monkeypatch):
    calls, real = [], hmac.compare_digest

    def spy(a, b):
        calls.append(b)
        return real(a, b)

    monkeypatch.setattr(server_module.hmac, "compare_digest", spy)
    caplog.set_level(logging.DEBUG)
    keyed = Http(server.url("keyed"))
    wrong = "sk-wrong-key-5f1c9a"
    statuses = []
    for key in (API_KEY, wrong):
        for method, path, body in (("GET", "/v1/models", None), ("POST", COMP, orjson.dumps(comp()))):
            statuses.append(
                keyed.request(method, path, body=body, headers={"Authorization": f"Bearer {key}"}).status
            )
        statuses.append(asyncio.run(_ws_ping(server.url("keyed"), params={"api_key": key})))
        statuses.append(
            asyncio.run(_ws_ping(server.url("keyed"), headers={"Authorization": f"Bearer {key}"}))
        )
    assert statuses == [200, 200, 101, 101, 401, 401, 401, 401]
    assert calls and set(calls) == {API_KEY.encode()}
    deadline = (
        time.monotonic() + HANG_S
    )  # the access log line is written once the server has closed the socket
    while '"GET /v1/ws?api_key=' not in (text := _logged_text(caplog)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert '"GET /v1/ws?api_key=REDACTED' in text  # the access log saw the websocket, without its key
    assert API_KEY not in text and wrong not in text


@pytest.mark.parametrize(("app", "logged"), [("main", False), ("logged", True)])
def test_prompts_and_outputs_are_logged_only_with_log_requests(server, caplog, app, logged):
    caplog.set_level(logging.DEBUG)
    h = Http(server.url(app))
    marker = f"zebra-quartz-{app}-7781"
    r1 = h.post(
        CHAT,
        json={
            "messages": [{"role": "user", "content": f"Say {marker}."}],
            "max_tokens": 6,
            "temperature": 0,
            "user": f"user-{marker}",
        },
    )
    r2 = h.post(COMP, json={"prompt": f"{marker} is", "max_tokens": 6, "temperature": 0, "stream": True})
    assert r1.status == 200 and r2.status == 200
    output = r1.json()["choices"][0]["message"]["content"]
    server.wait_idle()
    text = _logged_text(caplog)
    assert (marker in text) == logged
    if len(output) >= 8:
        assert output not in text
