"""The small routes: health, version, models, tokenize/detokenize, openapi, the chat page, request ids."""

from __future__ import annotations

import logging

import aioengine


def test_health_and_version(http):
    r = http.get("/health")
    assert r.status == 200 and r.body == b""
    assert http.get("/version").json() == {"version": aioengine.__version__}


def test_models_card(http):
    data = http.get("/v1/models").json()
    assert data["object"] == "list" and data["data"][0]["id"] == "default"
    assert data["data"][0]["max_model_len"] == 2048


def test_tokenize_detokenize_roundtrip(http):
    r = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 2048
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 3 and chat["token_strs"] is None
    usage = http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    ).json()["usage"]
    assert usage["prompt_tokens"] == chat["count"]


def test_openapi_lists_every_route(http, server):
    spec = http.get("/openapi.json").json()
    assert spec["openapi"].startswith("3.")
    app = server.runners["main"].app
    routes = {r.resource.canonical for r in app.router.routes()}
    assert routes == set(spec["paths"])


def test_chat_page_is_served(http):
    r = http.get("/")
    assert r.status == 200 and r.headers["content-type"].startswith("text/html")
    assert b"<title>aioengine chat</title>" in r.body and b"/v1/ws" in r.body


def test_request_id_header_is_used_and_echoed(http):
    r = http.post(
        "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"X-Request-Id": "my-id-1"}
    )
    assert r.status == 200 and r.headers["x-request-id"] == "my-id-1" and r.json()["id"] == "my-id-1"


def test_content_parts_and_developer_role(http):
    r = http.post(
        "/v1/chat/completions",
        json={
            "max_tokens": 2,
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
                },
            ],
        },
    )
    assert r.status == 200, r.body


def test_log_requests_and_served_model_names(server, caplog):
    from tests.http.conftest import Http

    logged = Http(server.url("logged"))
    with caplog.at_level(logging.INFO, logger="aioengine.http"):
        r = logged.post(
            "/v1/completions",
            json={"model": "alias", "prompt": "Hi", "max_tokens": 2},
            headers={"X-Request-Id": "logged-1"},
        )
        assert r.status == 200 and r.json()["model"] == "alias"
        assert (
            logged.post("/v1/completions", json={"model": "default", "prompt": "Hi", "max_tokens": 1}).status
            == 200
        )
        server.wait_idle()
    text = caplog.text
    assert "Received request logged-1" in text and "Finished request logged-1" in text
    assert [m["id"] for m in logged.get("/v1/models").json()["data"]] == ["alias", "default"]
