"""The chat page in headless Chromium (Debian's chromium driven by playwright): type, see text stream in."""

from __future__ import annotations

import os
import re
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
    assert re.search(r"TTFT \d+ ms · \d+\.\d tok/s", reply.locator(".meta").inner_text())
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


def test_the_conversation_survives_a_reload_and_new_chat_clears_it(page, server):
    before = page.locator(".msg").all_inner_texts()
    assert len(before) >= 4  # the two turns above
    page.reload()
    page.wait_for_selector("#status.online", timeout=20_000)
    assert page.locator(".msg").all_inner_texts() == before
    history = page.evaluate("() => JSON.parse(localStorage.getItem('aioengine-chat')).history")
    assert [m["role"] for m in history][:2] == ["user", "assistant"]
    assert "Paris" in history[1]["content"]  # sent again with the next turn
    page.click("#clear")
    assert page.locator(".msg").count() == 0
    page.reload()
    page.wait_for_selector("#status.online", timeout=20_000)
    assert page.locator(".msg").count() == 0


REPLY = (
    "<think>the user wants code</think>Here is **bold**, `inline`, and:\n\n"
    "```python\nprint('hi')\n```\n\n<img src=x onerror=\"window.__pwned = 1\">"
)


def test_replies_render_markdown_and_code_safely_with_reasoning_folded(page, server):
    html = page.evaluate(
        """(text) => {
            const el = addMessage('assistant', '');
            el.dataset.state = 'streaming';
            render(el, text);
            const open = el.querySelector('details.reasoning').open;
            el.dataset.state = 'done';
            const of = (sel) => el.querySelector(sel).textContent;
            return {open, html: el.innerHTML, reasoning: el.querySelector('details.reasoning').innerText,
                    code: of('pre code'), strong: of('strong')};
        }""",
        REPLY,
    )
    assert html["open"] is True  # unfolded while it streams
    assert "the user wants code" in html["reasoning"] and "Reasoning" in html["reasoning"]
    assert html["code"].strip() == "print('hi')" and html["strong"] == "bold"
    assert "<think>" not in html["html"] and "onerror" not in html["html"]
    assert page.evaluate("() => window.__pwned") is None  # the model's HTML never runs


def test_reasoning_sent_apart_shows_folded_like_inline_think_text(page, server):
    """A server with --reasoning-parser sends a chat's think text in each delta's "reasoning": the page shows
    it in the same collapsible block, and the conversation keeps only the answer."""
    page.goto(server.url() + "/")
    out = page.evaluate(
        """() => {
            const el = addMessage('assistant', '');
            el.dataset.state = 'streaming';
            current = {id: 't', el, text: '', thinking: false, sent: performance.now(), first: null};
            for (const m of [{reasoning: 'the user'}, {reasoning: ' asks', text: ''}, {text: 'Paris'},
                             {text: ' it is.'}])
                onMessage({type: 'delta', id: 't', text: '', ...m});
            const reasoning = el.querySelector('details.reasoning').innerText;
            const body = el.querySelector('div.body').textContent;
            const usage = {completion_tokens: 5};
            onMessage({type: 'done', id: 't', choices: [{finish_reason: 'stop'}], usage});
            return {reasoning, body, last: history[history.length - 1]};
        }"""
    )
    assert "the user asks" in out["reasoning"]
    assert out["body"].strip() == "Paris it is."
    assert out["last"] == {"role": "assistant", "content": "Paris it is."}
