"""The official openai client against the live server: chat and completions, streaming and not."""

from __future__ import annotations

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_paris(client, server):
    r = client.chat.completions.create(model="default", messages=CHAT, temperature=0, max_tokens=20)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.usage.prompt_tokens > 5 and 0 < r.usage.completion_tokens <= 20
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert server.wait_idle()["unfinished"] == 0
