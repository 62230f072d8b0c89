"""Bad input never gets a 500: each gets its status and OpenAI error JSON, then a good request works."""

from __future__ import annotations

import orjson
import pytest

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "Hi"}]


def chat(**kw):
    return {"model": "default", "messages": MSG, "max_tokens": 4, **kw}


def comp(**kw):
    return {"model": "default", "prompt": "Hi", "max_tokens": 4, **kw}


# (id, method, path, body: dict | bytes | None, status, param)
CASES = [
    ("malformed-json", "POST", CHAT, b'{"model": ', 400, None),
    ("json-array", "POST", CHAT, b"[1, 2]", 400, None),
    ("empty-body", "POST", CHAT, b"", 400, None),
    ("not-utf8", "POST", CHAT, b"\xff\xfe{", 400, None),
    ("missing-messages", "POST", CHAT, {"model": "default"}, 400, "messages"),
    ("messages-string", "POST", CHAT, chat(messages="hi"), 400, "messages"),
    ("messages-empty", "POST", CHAT, chat(messages=[]), 400, "messages"),
    ("message-not-object", "POST", CHAT, chat(messages=[1]), 400, "messages[0]"),
    ("message-no-role", "POST", CHAT, chat(messages=[{"content": "x"}]), 400, "messages[0].role"),
    (
        "message-bad-role",
        "POST",
        CHAT,
        chat(messages=[{"role": "wizard", "content": "x"}]),
        400,
        "messages[0].role",
    ),
    (
        "message-content-int",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": 5}]),
        400,
        "messages[0].content",
    ),
    (
        "message-content-null",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": None}]),
        400,
        "messages[0].content",
    ),
    (
        "message-image-part",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        "messages[0].content[0].type",
    ),
    (
        "message-unknown-field",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": "x", "mood": 1}]),
        400,
        "messages[0].mood",
    ),
    ("unknown-model", "POST", CHAT, chat(model="gpt-5"), 404, "model"),
    ("unknown-model-completions", "POST", COMP, comp(model="gpt-5"), 404, "model"),
    ("max-tokens-string", "POST", CHAT, chat(max_tokens="x"), 400, "max_tokens"),
    ("max-tokens-zero", "POST", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", "POST", COMP, comp(max_tokens=-1), 400, "max_tokens"),
    ("max-tokens-float", "POST", CHAT, chat(max_tokens=1.5), 400, "max_tokens"),
    ("max-tokens-bool", "POST", CHAT, chat(max_tokens=True), 400, "max_tokens"),
    ("context-length", "POST", CHAT, chat(max_tokens=5000), 400, "max_tokens"),
    ("prompt-too-long", "POST", COMP, comp(prompt="hello " * 3000), 400, "prompt"),
    ("temperature-negative", "POST", CHAT, chat(temperature=-1), 400, "temperature"),
    ("temperature-string", "POST", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("top-p-zero", "POST", CHAT, chat(top_p=0), 400, "top_p"),
    ("top-p-above-one", "POST", COMP, comp(top_p=1.5), 400, "top_p"),
    ("n-zero", "POST", CHAT, chat(n=0), 400, "n"),
    ("n-string", "POST", CHAT, chat(n="2"), 400, "n"),
    ("n-too-big", "POST", COMP, comp(n=1000), 400, "n"),
    ("n2-greedy", "POST", CHAT, chat(n=2, temperature=0), 400, "n"),
    ("top-k-negative", "POST", CHAT, chat(top_k=-5), 400, "top_k"),
    ("min-p-above-one", "POST", CHAT, chat(min_p=2), 400, "min_p"),
    ("seed-string", "POST", CHAT, chat(seed="abc"), 400, "seed"),
    ("stop-int", "POST", CHAT, chat(stop=5), 400, "stop"),
    ("stop-empty-string", "POST", COMP, comp(stop=[""]), 400, "stop[0]"),
    ("stop-token-ids-strings", "POST", CHAT, chat(stop_token_ids=["a"]), 400, "stop_token_ids[0]"),
    ("min-tokens-above-max", "POST", CHAT, chat(min_tokens=10, max_tokens=2), 400, "min_tokens"),
    ("ignore-eos-string", "POST", CHAT, chat(ignore_eos="no"), 400, "ignore_eos"),
    ("speculative-string", "POST", COMP, comp(speculative="no"), 400, "speculative"),
    ("unknown-field", "POST", CHAT, chat(foo=1), 400, "foo"),
    ("logprobs-string", "POST", CHAT, chat(logprobs="yes"), 400, "logprobs"),
    ("top-logprobs-without-logprobs", "POST", CHAT, chat(top_logprobs=3), 400, "top_logprobs"),
    ("top-logprobs-out-of-range", "POST", CHAT, chat(top_logprobs=50), 400, "top_logprobs"),
    ("stream-string", "POST", CHAT, chat(stream="yes"), 400, "stream"),
    (
        "stream-options-without-stream",
        "POST",
        CHAT,
        chat(stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    (
        "stream-options-unknown",
        "POST",
        CHAT,
        chat(stream=True, stream_options={"foo": True}),
        400,
        "stream_options.foo",
    ),
    ("tools-not-functions", "POST", CHAT, chat(tools=[{"type": "code_interpreter"}]), 400, "tools[0].type"),
    (
        "tool-choice-bad",
        "POST",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="always"),
        400,
        "tool_choice",
    ),
    (
        "function-call-message",
        "POST",
        CHAT,
        chat(
            messages=[
                {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}
            ]
        ),
        400,
        "messages[0].function_call",
    ),
    ("metadata-not-strings", "POST", CHAT, chat(metadata={"a": 1}), 400, "metadata.a"),
    ("reasoning-effort-bad", "POST", CHAT, chat(reasoning_effort="extreme"), 400, "reasoning_effort"),
    ("response-format-xml", "POST", CHAT, chat(response_format={"type": "xml"}), 400, "response_format.type"),
    (
        "response-format-no-schema",
        "POST",
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {}}),
        400,
        "response_format.json_schema.schema",
    ),
    (
        "structured-two-kinds",
        "POST",
        COMP,
        comp(structured_outputs={"regex": "a+", "choice": ["b"]}),
        400,
        "structured_outputs",
    ),
    (
        "structured-unknown-key",
        "POST",
        COMP,
        comp(structured_outputs={"foo": 1}),
        400,
        "structured_outputs.foo",
    ),
    (
        "structured-bad-schema",
        "POST",
        COMP,
        comp(structured_outputs={"json": "{not json"}),
        400,
        "structured_outputs",
    ),
    ("logit-bias-bad-key", "POST", CHAT, chat(logit_bias={"abc": 1}), 400, "logit_bias.abc"),
    ("logit-bias-out-of-vocab", "POST", CHAT, chat(logit_bias={"99999999": 1}), 400, "logit_bias"),
    ("bad-words-int", "POST", COMP, comp(bad_words=5), 400, "bad_words"),
    ("allowed-token-ids-empty", "POST", COMP, comp(allowed_token_ids=[]), 400, "allowed_token_ids"),
    ("presence-penalty-out-of-range", "POST", CHAT, chat(presence_penalty=5), 400, "presence_penalty"),
    ("priority-with-fcfs", "POST", CHAT, chat(priority=1), 400, "priority"),
    ("missing-prompt", "POST", COMP, {"model": "default"}, 400, "prompt"),
    ("prompt-int", "POST", COMP, comp(prompt=123), 400, "prompt"),
    ("prompt-empty-string", "POST", COMP, comp(prompt=""), 400, "prompt"),
    ("prompt-empty-list", "POST", COMP, comp(prompt=[]), 400, "prompt"),
    ("prompt-mixed-list", "POST", COMP, comp(prompt=["a", 1]), 400, "prompt[1]"),
    ("prompt-token-out-of-vocab", "POST", COMP, comp(prompt=[99999999]), 400, "prompt"),
    ("completions-logprobs-too-many", "POST", COMP, comp(logprobs=50), 400, "logprobs"),
    ("echo-logprobs-too-many", "POST", COMP, comp(echo=True, logprobs=21), 400, "logprobs"),
    ("completions-suffix", "POST", COMP, comp(suffix="x"), 400, "suffix"),
    ("best-of-not-n", "POST", COMP, comp(best_of=3), 400, "best_of"),
    ("echo-string", "POST", COMP, comp(echo="x"), 400, "echo"),
    ("request-id-bad-chars", "POST", COMP, comp(request_id="a b/c"), 400, "request_id"),
    ("route-not-found", "GET", "/v1/nope", None, 404, None),
    ("method-not-allowed", "GET", CHAT, None, 405, None),
    ("body-too-large", "POST", CHAT, b'{"x": "' + b"a" * (4 << 20) + b'"}', 413, None),
    ("tokenize-nothing", "POST", "/tokenize", {"model": "default"}, 400, "prompt"),
    ("tokenize-unknown-model", "POST", "/tokenize", {"model": "x", "prompt": "hi"}, 404, "model"),
    ("detokenize-strings", "POST", "/detokenize", {"tokens": ["a"]}, 400, "tokens[0]"),
    ("detokenize-out-of-vocab", "POST", "/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
]
TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
}


def test_at_least_30_cases():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(
    ("name", "method", "path", "body", "status", "param"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_request(http, name, method, path, body, status, param):
    content = body if isinstance(body, bytes) or body is None else orjson.dumps(body)
    r = http.request(method, path, body=content)
    assert r.status == status, r.body
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == TYPES[status]
    assert err["param"] == param
    assert err["code"] == status or isinstance(err["code"], str)


def test_context_length_message_has_counts(http):
    r = http.post(CHAT, json=chat(max_tokens=5000))
    msg = r.json()["error"]["message"]
    assert "2048" in msg and "5000" in msg and r.json()["error"]["code"] == "context_length_exceeded"


def test_good_request_after_bad_ones(http, server):
    for _name, method, path, body, *_ in CASES[:10]:
        http.request(
            method, path, body=body if isinstance(body, bytes) or body is None else orjson.dumps(body)
        )
    r = http.post(CHAT, json=chat(temperature=0))
    assert r.status == 200, r.body
    assert r.json()["choices"][0]["message"]["content"]
    assert server.wait_idle()["unfinished"] == 0


def test_speculative_false_opts_the_request_out_of_drafts():
    from aioengine.http.openai.chat import parse_chat_request
    from aioengine.http.openai.completions import parse_completion_request

    assert parse_completion_request({"prompt": "a", "speculative": False}).params.speculative is False
    chat_request = parse_chat_request({"messages": [{"role": "user", "content": "hi"}]})
    assert chat_request.params.speculative is True
