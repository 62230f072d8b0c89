"""`aioengine chat`: the terminal chat against the live server (the http tests' package-scoped server)."""

from __future__ import annotations

from aioengine.cli import commands as cli


def test_chat_command_streams_a_reply(server, monkeypatch, capsys):
    from aioengine.cli import chat as chat_client

    lines = iter(["What is the capital of France?", ""])
    monkeypatch.setattr(chat_client, "_prompt", lambda: next(lines))
    assert cli.main(["chat", "--url", server.url(), "--temperature", "0", "--max-tokens", "16"]) == 0
    assert "Paris" in capsys.readouterr().out
