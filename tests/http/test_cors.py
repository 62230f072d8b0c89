"""CORS (--allowed-origins, --allowed-methods, --allowed-headers): a page of an allowed origin calls the API
from Chromium, preflight and key included, streaming too; a page of another origin is refused by the
browser; and the preflight's answers themselves."""

from __future__ import annotations

import pytest

from tests.http.conftest import API_KEY, CORS_ORIGIN
from tests.http.test_chat_page import ARGS, CHROMIUM, sync_api

FETCH = """async ([url, key, stream]) => {
    try {
        const r = await fetch(url + '/v1/chat/completions', {
            method: 'POST',
            headers: {'Content-Type': 'application/json', 'Authorization': 'Bearer ' + key},
            body: JSON.stringify({messages: [{role: 'user', content: 'What is the capital of France?'}],
                                  max_tokens: 8, temperature: 0, stream: stream}),
        });
        return {status: r.status, body: await r.text(), id: r.headers.get('X-Request-Id')};
    } catch (e) {
        return {error: String(e)};
    }
}"""


@pytest.fixture(scope="module")
def page():
    with sync_api.sync_playwright() as p:
        # A routed page has no address space, so Chromium's local-network check would block its calls to
        # 127.0.0.1 before CORS is even asked; a page on a real public host gets a permission prompt.
        lna = "--disable-features=LocalNetworkAccessChecks,PrivateNetworkAccessRespectPreflightResults"
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[*ARGS, lna], timeout=60_000)
        try:
            page = browser.new_page()
            # The page of another origin: served by the browser's own router, no server needed.
            page.route(CORS_ORIGIN + "/**", lambda route: route.fulfill(body="<html><body>app</body></html>"))
            page.goto(CORS_ORIGIN + "/app.html")
            yield page
        finally:
            browser.close()


def test_a_page_of_an_allowed_origin_calls_the_api_streamed_or_not(page, server):
    got = page.evaluate(FETCH, [server.url("cors"), API_KEY, False])
    assert got.get("status") == 200, got
    assert "Paris" in got["body"] and got["id"]  # X-Request-Id is exposed to the page
    streamed = page.evaluate(FETCH, [server.url("cors"), API_KEY, True])
    assert streamed.get("status") == 200 and streamed["body"].rstrip().endswith("data: [DONE]"), streamed


def test_a_server_without_cors_is_refused_by_the_browser(page, server):
    got = page.evaluate(FETCH, [server.url("keyed"), API_KEY, False])
    assert "error" in got and "Failed to fetch" in got["error"], got


def test_the_preflight_is_answered_before_auth_and_only_for_allowed_origins(http, server):
    from tests.http.conftest import Http

    cors = Http(server.url("cors"))
    asked = {
        "Origin": CORS_ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    r = cors.request("OPTIONS", "/v1/chat/completions", headers=asked)
    assert r.status == 200  # no key on a preflight, and none needed
    assert r.headers["access-control-allow-origin"] == CORS_ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-allow-headers"] == "authorization, content-type"
    assert int(r.headers["access-control-max-age"]) > 0
    other = cors.request("OPTIONS", "/v1/chat/completions", headers={**asked, "Origin": "http://evil.test"})
    assert other.status == 400 and "access-control-allow-origin" not in other.headers
    plain = http.request("OPTIONS", "/v1/chat/completions", headers=asked)  # a server without CORS
    assert plain.status == 400 and "access-control-allow-origin" not in plain.headers
    # the actual request still needs the key, and carries the CORS headers
    denied = cors.post("/v1/models", json=None, headers={"Origin": CORS_ORIGIN})
    assert denied.status in (401, 405) and denied.headers.get("access-control-allow-origin") == CORS_ORIGIN


def test_the_flags_take_vllms_json_lists_or_commas():
    import argparse

    from aioengine.cli.commands import parse_origin_list

    assert parse_origin_list('["http://a:1", "https://b"]') == ["http://a:1", "https://b"]
    assert parse_origin_list("http://a:1, https://b") == ["http://a:1", "https://b"]
    assert parse_origin_list("[]") == []
    for bad in ("[1]", '["x"', '[{"a": 1}]'):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_origin_list(bad)
