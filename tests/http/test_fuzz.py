"""Schemathesis against the live server's /openapi.json: generated valid and invalid requests to every
operation never get a 5xx; the server serves normally afterwards.

Hypothesis runs derandomized (the same examples every run) with few examples per operation. Generation is
kept short: max_tokens and n are capped before a request is sent (larger values are only slower).
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

import aioengine
from aioengine.http.openapi import openapi_spec

OPERATIONS = [
    (method.upper(), path)
    for path, ops in openapi_spec(aioengine.__version__)["paths"].items()
    for method in ops
]
GENERATION = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}
EXAMPLES = {True: 20, False: 6}  # per mode, for generation routes / the others
CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "n": 3}


@pytest.fixture(scope="module")
def schema(server):
    return schemathesis.openapi.from_url(server.url() + "/openapi.json")


def cap(body: Any, path: str) -> None:
    """Keep generation short: integer max_tokens / n above the cap come down to it (also when written as a
    float, 81.0, which JSON schema's integer allows)."""
    if not isinstance(body, dict):
        return
    for key, limit in CAPS.items():
        value = body.get(key)
        if (type(value) is int or (type(value) is float and value.is_integer())) and value > limit:
            body[key] = limit
    # Unset, completions generate 16 tokens and chat up to the context: set a short one.
    if path == "/v1/completions" and body.get("max_tokens") is None:
        body["max_tokens"] = CAPS["max_tokens"]
    if (
        path == "/v1/chat/completions"
        and body.get("max_tokens") is None
        and body.get("max_completion_tokens") is None
    ):
        body["max_tokens"] = CAPS["max_tokens"]
    if path == "/v1/responses" and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = CAPS["max_output_tokens"]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_no_server_error(server, schema, method, path, mode):
    if mode == GenerationMode.NEGATIVE and method == "GET" and "{" not in path:
        pytest.skip("no parameters and no body: nothing to make invalid")
    operation = schema[path][method].ok() if hasattr(schema[path][method], "ok") else schema[path][method]
    base_url = server.url()
    seen: list[int] = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES[path in GENERATION],
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    def run(case: schemathesis.Case) -> None:
        cap(case.body, path)
        response = case.call(base_url=base_url, timeout=60)
        seen.append(response.status_code)
        case.validate_response(response, checks=[not_a_server_error])
        assert response.status_code < 500, response.text[:500]

    run()
    print(f"\n[fuzz] {method} {path} {mode.value}: {len(seen)} requests, statuses {sorted(set(seen))}")
    assert seen and server.wait_idle()["unfinished"] == 0


def test_json_integers_may_be_written_as_floats_and_top_k_minus_one_is_off(http):
    """JSON (and the schema) do not tell 4 from 4.0; -1 is the usual "off" for top_k."""
    r = http.post(
        "/v1/completions",
        json={
            "prompt": [1.0, 2.0],
            "max_tokens": 2.0,
            "n": 1.0,
            "top_k": -1,
            "stop_token_ids": [0.0],
            "logprobs": 1.0,
        },
    )
    assert r.status == 200, r.body
    assert r.json()["usage"]["prompt_tokens"] == 2 and 1 <= r.json()["usage"]["completion_tokens"] <= 2


def test_a_valid_request_works_after_the_fuzzing(http, server):
    r = http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    )
    assert r.status == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert server.wait_idle()["unfinished"] == 0
