"""The knobs vLLM's users reach for, over HTTP: prompt_logprobs and a per-request deadline (timeout_s)
(the engine's side, and the grammar compile limit: tests/engine/test_request_limits.py)."""

from __future__ import annotations

import time

import pytest

PROMPT = "The capital of France is"


def test_prompt_logprobs_in_completions_are_the_echoed_prompts_logprobs(http):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2})
    assert r.status == 200, r.body[:300]
    body = r.json()
    plp = body["choices"][0]["prompt_logprobs"]
    assert len(plp) == body["usage"]["prompt_tokens"] and plp[0] is None
    tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    for tid, entry in zip(tokens[1:], plp[1:], strict=True):
        assert str(tid) in entry and 1 <= len(entry) <= 3  # the prompt's own token, and the top 2
        assert all(
            v["rank"] >= 1 and v["logprob"] <= 0 and isinstance(v["decoded_token"], str)
            for v in entry.values()
        )
    echo = http.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "echo": True, "logprobs": 2}
    ).json()
    echoed = echo["choices"][0]["logprobs"]["token_logprobs"][: len(tokens)]
    assert "prompt_logprobs" not in echo["choices"][0]  # echo's are its own, in the legacy format
    assert echoed[0] is None
    for tid, entry, lp in zip(tokens[1:], plp[1:], echoed[1:], strict=True):
        assert entry[str(tid)]["logprob"] == pytest.approx(lp, abs=1e-6)


def test_prompt_logprobs_in_chat_sit_beside_the_choices(http):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0}
    body = http.post("/v1/chat/completions", json=chat).json()
    plp = body["prompt_logprobs"]
    assert len(plp) == body["usage"]["prompt_tokens"] and plp[0] is None
    assert all(len(entry) == 1 for entry in plp[1:])  # 0: the prompt's own token alone
    assert (
        "prompt_logprobs"
        not in http.post("/v1/chat/completions", json={**chat, "prompt_logprobs": None}).json()
    )


@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1, "stream": True},
        ),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 10**6}),
        ("/v1/completions", {"prompt": "x", "timeout_s": 0}),
        ("/v1/completions", {"prompt": "x", "timeout_s": -3}),
        ("/v1/completions", {"prompt": "x", "timeout_s": "soon"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "timeout_s": True}),
    ],
)
def test_bad_knob_values_are_400s_naming_the_field(http, route, body):
    r = http.post(route, json=body)
    assert r.status == 400, r.body[:300]
    err = r.json()["error"]
    assert err["param"] in ("prompt_logprobs", "timeout_s"), err


@pytest.mark.serial  # it times the deadline
def test_a_deadline_ends_the_request_with_finish_reason_timeout_and_frees_its_blocks(http, server):
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "timeout_s": 0.5}
    t0 = time.monotonic()
    r = http.post("/v1/completions", json=body)
    took = time.monotonic() - t0
    c = r.json()["choices"][0]
    assert r.status == 200 and c["finish_reason"] == "timeout"
    assert 0 < r.json()["usage"]["completion_tokens"] < 1500 and c["text"]  # what it made is kept
    assert 0.5 <= took < 5
    assert server.wait_idle() == {"running": 0, "waiting": 0, "kv_usage": 0.0, "unfinished": 0}
    streamed = http.post("/v1/completions", json={**body, "stream": True}).body.decode()
    assert '"finish_reason":"timeout"' in streamed and streamed.rstrip().endswith("data: [DONE]")
