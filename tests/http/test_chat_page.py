"""The chat page in headless Chromium (Debian's chromium driven by playwright): type, see text stream in."""

from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM = os.environ.get("AIOENGINE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install playwright)"
)
if not os.path.exists(CHROMIUM):
    pytest.skip("chromium is not installed (apt-get install chromium)", allow_module_level=True)


@pytest.fixture(scope="module")
def page():
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, timeout=60_000)
        try:
            yield browser.new_page()
        finally:
            browser.close()


def test_question_streams_an_answer(page, server):
    # Record every text the reply shows, to prove it grew piece by piece rather than all at once.
    page.goto(server.url() + "/")
    page.wait_for_selector("#status.online", timeout=20_000)
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "24")
    page.fill("#prompt", "What is the capital of France?")
    page.evaluate("""() => {
        window.__seen = [];
        new MutationObserver(() => {
            const el = document.querySelector('.msg.assistant');
            if (el) window.__seen.push(el.firstChild ? el.firstChild.textContent : '');
        }).observe(document.getElementById('messages'),
                   {subtree: true, childList: true, characterData: true});
    }""")
    page.keyboard.press("Enter")
    reply = page.locator(".msg.assistant").last
    reply.wait_for(timeout=10_000)
    page.wait_for_selector('.msg.assistant[data-state="done"]', timeout=60_000)
    text = reply.evaluate("el => el.firstChild.textContent")
    assert "Paris" in text
    assert int(reply.get_attribute("data-deltas")) >= 2
    seen = [s for s in page.evaluate("window.__seen") if s]
    assert len(set(seen)) >= 2 and seen[-1] == text  # partial texts before the whole
    assert page.locator(".msg.user").first.inner_text() == "What is the capital of France?"
    assert "tokens" in reply.locator(".meta").inner_text()
    assert page.locator("#model").inner_text() == "model: default"


def test_stop_button_cancels(page, server):
    page.fill("#max-tokens", "1000")
    page.fill("#temperature", "0.8")
    page.fill("#prompt", "Write a very long story about dragons.")
    page.click("#send")
    reply = page.locator(".msg.assistant").last
    page.wait_for_function(
        "() => Number(document.querySelector('.msg.assistant:last-of-type').dataset.deltas) > 2",
        timeout=30_000,
    )
    page.click("#stop")
    page.wait_for_selector('.msg.assistant:last-of-type[data-state="done"]', timeout=10_000)
    assert "abort" in reply.locator(".meta").inner_text()
    assert server.wait_idle()["unfinished"] == 0
