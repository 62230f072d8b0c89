"""`aioengine chat`: a terminal chat with a running server, streamed over its websocket."""

from __future__ import annotations

import asyncio
import sys

import aiohttp


async def chat_repl(
    url: str, api_key: str | None, temperature: float, max_tokens: int, system: str | None
) -> int:
    ws_url = url.rstrip("/").replace("http://", "ws://", 1).replace("https://", "wss://", 1) + "/v1/ws"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    loop = asyncio.get_running_loop()
    try:
        async with aiohttp.ClientSession() as session, session.ws_connect(ws_url, headers=headers) as ws:
            print(f"Connected to {url}. Type a message; an empty line or Ctrl-D quits.", file=sys.stderr)
            turn = 0
            while True:
                line = await loop.run_in_executor(None, _prompt)
                if not line:
                    return 0
                history.append({"role": "user", "content": line})
                turn += 1
                body = {"messages": history, "temperature": temperature, "max_tokens": max_tokens}
                await ws.send_json({"type": "chat", "id": turn, "body": body})
                reply: list[str] | None = []
                while True:
                    msg = await ws.receive_json()
                    if msg["type"] == "delta" and reply is not None:
                        reply.append(msg["text"])
                        print(msg["text"], end="", flush=True)
                    elif msg["type"] == "done":
                        print()
                        break
                    elif msg["type"] == "error":
                        print(f"\n[error] {msg['error']['message']}", file=sys.stderr)
                        history.pop()
                        reply = None
                        break
                if reply is not None:
                    history.append({"role": "assistant", "content": "".join(reply)})
    except (aiohttp.ClientError, ConnectionError) as e:
        print(f"cannot chat with {url}: {e}", file=sys.stderr)
        return 1


def _prompt() -> str:
    try:
        return input("> ").strip()
    except EOFError:
        return ""
