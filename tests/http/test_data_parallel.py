"""`aioengine serve --data-parallel-size 2`: two replicas of the default model behind one port. Prefix-aware
routing keeps each conversation on the replica holding its prefix (more prefix-cache hits than round robin on
an interleaved multi-turn workload); a replica SIGKILLed mid-stream ends its stream with an error event while
the other replica's stream completes, is restarted, and nothing is left running after shutdown; the websocket
passes through. The router's rules have unit tests of their own."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import aiohttp
import pytest

from aioengine.http.front.replicas import replica_argv, replica_kv_events
from aioengine.http.front.router import PrefixRouter, prefix_text
from tests.processes import alive, descendants, wait_for_port


def test_prefix_text_of_a_conversation_extends_its_previous_turn():
    turn1 = {"model": "m", "messages": [{"role": "user", "content": "hi " * 100}]}
    turn2 = {"model": "m", "messages": [*turn1["messages"], {"role": "assistant", "content": "yo"}]}
    assert prefix_text(turn2).startswith(prefix_text(turn1)) and prefix_text(turn1)
    assert prefix_text("not a dict") == "" and prefix_text({"max_tokens": 3}) == ""


def test_the_router_follows_prefixes_falls_back_on_load_and_forgets_a_restarted_replica():
    r = PrefixRouter(3, chunk=8, balance_abs=2, balance_rel=1.5)
    a, b = "A" * 40, "B" * 40
    first = r.choose(a, [0, 0, 0], [True] * 3)
    assert first.reason == "miss" and first.replica == 0  # nothing known: the least loaded
    r.record(a, 1)
    r.record(b, 2)
    assert r.choose(a + "more text", [0, 1, 0], [True] * 3) == r.choose(a, [0, 1, 0], [True] * 3)
    d = r.choose(a + "more text", [0, 1, 0], [True] * 3)
    assert (d.replica, d.reason, d.matched) == (1, "prefix_hit", 5)
    assert r.choose(b, [0, 0, 0], [True] * 3).replica == 2
    assert r.choose(b, [0, 0, 0], [True, True, False]).reason == "miss"  # its holder is down
    fallback = r.choose(a, [0, 9, 0], [True] * 3)  # 9 - 0 > 2 and 9 > 1.5 * 0: load wins
    assert (fallback.replica, fallback.reason) == (0, "load_fallback")
    r.forget(1)
    assert r.choose(a, [0, 0, 0], [True] * 3).reason == "miss"
    assert r.decisions == {"prefix_hit": 4, "miss": 3, "load_fallback": 1}
    rr = PrefixRouter(2, policy="round_robin")
    assert [rr.choose(a, [0, 0], [True, True]).replica for _ in range(4)] == [0, 1, 0, 1]
    with pytest.raises(LookupError):
        rr.choose(a, [0, 0], [False, False])


def test_replicas_get_the_command_line_less_the_fronts_flags():
    argv = ["serve", "m", "--data-parallel-s", "2", "--port=9", "--host", "0.0.0.0", "--max-model-len", "64"]
    assert replica_argv(argv) == ["serve", "m", "--max-model-len", "64", "--data-parallel-size", "1"]
    cfg = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}'
    moved = replica_kv_events(["serve", "--kv-events-config", cfg], 2)
    assert json.loads(moved[2])["endpoint"] == "tcp://*:5559"  # vLLM's rule: the port plus the rank
    same = ["serve", f"--kv-events-config={cfg}"]
    assert json.loads(replica_kv_events(same, 0)[1].partition("=")[2]) == json.loads(cfg)


@contextlib.contextmanager
def front(policy: str) -> Iterator[tuple[str, subprocess.Popen]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "aioengine", "serve", "--port", "0", "--data-parallel-size", "2"]
        + ["--data-parallel-routing", policy, "--max-model-len", "1024", "--disable-log-stats"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        text=True,
    )
    lines: list[str] = []
    everyone: list[int] = []
    try:
        port = wait_for_port(proc, r"Serving 2 replicas on http://127\.0\.0\.1:(\d+)", 240, lines)
        assert port, "".join(lines[-30:])
        # keep reading: the replicas share this pipe, and a full one would stop them
        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
        everyone = descendants(proc.pid)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        everyone += descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
        time.sleep(0.5)
        assert not [p for p in everyone if alive(p)], "a replica outlived the front"


CONVERSATIONS, TURNS = 7, 3  # odd: round robin moves a conversation between the two replicas each turn


async def _multi_turn(url: str) -> tuple[float, float]:
    """The interleaved conversations; returns the prefix-cache hit rate summed over the replicas and the
    router's prefix_hit share."""
    histories = [
        [{"role": "user", "content": f"Conversation {c}: " + "tell me about the history of Paris. " * 12}]
        for c in range(CONVERSATIONS)
    ]
    async with aiohttp.ClientSession() as s:
        for _ in range(TURNS):
            for h in histories:
                body = {"messages": h, "max_tokens": 4, "temperature": 0}
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    answer = (await r.json())["choices"][0]["message"]["content"]
                h += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
        metrics = await (await s.get(url + "/metrics")).text()
    hits = sum(
        float(x) for x in re.findall(r'aioengine:prefix_cache_hits_total\{replica="\d"[^}]*\} (\S+)', metrics)
    )
    queries = sum(
        float(x)
        for x in re.findall(r'aioengine:prefix_cache_queries_total\{replica="\d"[^}]*\} (\S+)', metrics)
    )
    decisions = dict(re.findall(r'aioengine:router_decisions_total\{decision="(\w+)"\} (\S+)', metrics))
    assert set(re.findall(r'aioengine:num_requests_running\{replica="(\d)"', metrics)) == {"0", "1"}
    return hits / queries, float(decisions["prefix_hit"]) / (CONVERSATIONS * TURNS)


async def _websocket_through_the_front(url: str) -> None:
    async with aiohttp.ClientSession() as s, s.ws_connect(url + "/v1/ws") as ws:
        await ws.send_json({"type": "completion", "id": 1, "body": {"prompt": "Hello", "max_tokens": 4}})
        kinds = []
        while not kinds or kinds[-1] != "done":
            kinds.append((await asyncio.wait_for(ws.receive_json(), 60))["type"])
        assert kinds[0] == "start" and "delta" in kinds, kinds
        await ws.send_json({"type": "ping", "id": 2})
        assert (await asyncio.wait_for(ws.receive_json(), 60))["type"] == "pong"


async def _kill_one_mid_stream(url: str, proc: subprocess.Popen) -> None:
    replicas = [p for p in descendants(proc.pid) if alive(p)]
    assert len(replicas) >= 2
    async with aiohttp.ClientSession() as s:
        long = {"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "stream": True}
        a = await s.post(url + "/v1/completions", json=long)
        b = await s.post(url + "/v1/completions", json={**long, "prompt": "In a land far away"})
        await a.content.readline()
        await b.content.readline()
        # the two streams went to different replicas (the least loaded each time): kill one replica's
        # process group, and exactly one stream breaks
        victim = replicas[0]
        os.killpg(os.getpgid(victim), signal.SIGKILL)
        bodies = [(await a.read()).decode(), (await b.read()).decode()]
        broken = [x for x in bodies if '"engine_dead"' in x]
        whole = [x for x in bodies if x.rstrip().endswith("data: [DONE]")]
        assert len(broken) == 1 and len(whole) == 1, [x[-300:] for x in bodies]  # one stream a replica
        ok = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        async with s.post(url + "/v1/completions", json=ok) as r:
            assert r.status == 200, await r.text()
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # the killed replica comes back
            async with s.get(url + "/health") as r:
                if r.status == 200:
                    break
            await asyncio.sleep(1)
        else:
            raise AssertionError("the killed replica did not come back")
        metrics = await (await s.get(url + "/metrics")).text()
        assert re.search(r'aioengine:replica_restarts_total\{replica="\d"\} 1', metrics), metrics[-500:]


@pytest.mark.serial
@pytest.mark.timeout(600)
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads the process tree from /proc")
def test_prefix_routing_beats_round_robin_and_a_killed_replica_is_replaced():
    with front("round_robin") as (url, _):
        rr_rate, rr_share = asyncio.run(_multi_turn(url))
    with front("prefix") as (url, proc):
        prefix_rate, prefix_share = asyncio.run(_multi_turn(url))
        asyncio.run(_websocket_through_the_front(url))
        asyncio.run(_kill_one_mid_stream(url, proc))
    assert rr_share == 0 and prefix_share > 0.5
    assert prefix_rate > rr_rate + 0.1, (prefix_rate, rr_rate)


def test_a_dying_replicas_stream_ends_in_its_apis_own_error_format():
    import orjson

    from aioengine.http.front.proxy import _error, stream_error

    nd = stream_error("/api/chat", "application/x-ndjson", "gone")
    assert orjson.loads(nd) == {"error": "gone"} and nd.endswith(b"\n")
    msg = stream_error("/v1/messages", "text/event-stream", "gone").decode()
    assert msg.startswith("event: error\ndata: ") and '"overloaded_error"' in msg
    resp = stream_error("/v1/responses", "text/event-stream", "gone").decode()
    assert resp.startswith("event: error\ndata: ") and '"engine_dead"' in resp
    chat = stream_error("/v1/chat/completions", "text/event-stream", "gone").decode()
    assert chat.startswith("data: ") and orjson.loads(chat[6:])["error"]["type"] == "engine_dead"
    assert orjson.loads(_error(503, "x", "/api/tags").body) == {"error": "x"}
    assert orjson.loads(_error(503, "x", "/v1/messages").body)["type"] == "error"
    assert orjson.loads(_error(503, "x", "/v1/models").body)["error"]["code"] == 503
