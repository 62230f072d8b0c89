"""`serve run` with a YAML config, as a user starts it: one local Ray cluster holding three applications of
aioengine.ray_serve: the default model on 2 replicas with the prefix-aware router, the same with Serve's
power of two choices alone, and a tiny model on 2 replicas of 2 tensor-parallel ranks each.

- The OpenAI and Anthropic clients get what one engine of the same model answers (TP replicas too).
- On interleaved multi-turn conversations the replicas' prefix-cache hit rate (the replies' cached tokens)
  is higher with the prefix-aware router than with power of two choices; the router counts its hits.
- A replica SIGKILLed mid-stream ends its own stream with an error event; the other replica's stream
  completes, the next requests succeed, and Serve brings up a new replica in its place.
- SIGINT to `serve run` leaves no process of it running, Ray's included.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp
import pytest

from aioengine import AsyncEngine, EngineArgs, SamplingParams
from tests.engine.conftest import make_tiny_checkpoint
from tests.processes import alive, descendants

pytest.importorskip("ray.serve")
yaml = pytest.importorskip("yaml")

pytestmark = [pytest.mark.serial, pytest.mark.timeout(900)]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CONVERSATIONS, TURNS = 8, 3
TINY_FLAGS = "--max-model-len 256 --dtype float32"  # float32: the ranks' sums round as one engine's


@dataclass
class Cluster:
    url: str
    proc: subprocess.Popen
    tiny: str
    log: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _app(name: str, routing: str, engine_args: str, cpus: float) -> dict:
    return {
        "name": name,
        "route_prefix": f"/{name}",
        "import_path": "aioengine.ray_serve:app_builder",
        "args": {
            "engine_args": engine_args,
            "num_replicas": 2,
            "replica_cpus": cpus,
            "routing": routing,
            "stats_period_s": 0.5,
        },
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("serve-run")
    tiny = tmp / "tiny"
    make_tiny_checkpoint("llama", tiny)
    port = _free_port()
    smol = "--max-model-len 2048 --num-kv-blocks 512 --disable-log-stats"
    config = {
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            _app("prefix", "prefix", smol, 0.5),
            _app("pow2", "pow2", smol, 0.5),
            _app(
                "tp",
                "prefix",
                f"--model {tiny} --tensor-parallel-size 2 --num-threads 1 {TINY_FLAGS}",
                0,
            ),
        ],
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp / "serve.log"
    serve = os.path.join(os.path.dirname(sys.executable), "serve")
    with open(log, "w") as out:
        proc = subprocess.Popen([serve, "run", str(path)], cwd=tmp, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(_wait_ready(url, proc, log))
        yield Cluster(url, proc, str(tiny), str(log))
    finally:
        if proc.poll() is None:  # the last test stops it; a failure before it lands here
            proc.kill()
            for p in descendants(proc.pid):
                os.kill(p, signal.SIGKILL)


async def _wait_ready(url: str, proc: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + 400
    async with aiohttp.ClientSession() as s:
        for app in ("prefix", "pow2", "tp"):
            while True:
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                try:
                    async with s.get(f"{url}/{app}/v1/models") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(1)


def _local(model: str, messages: list[dict] | None, prompt: str | None, max_tokens: int, **kw) -> str:
    async def run() -> str:
        async with AsyncEngine(EngineArgs(model=model, **kw)) as engine:
            params = SamplingParams(max_tokens=max_tokens, temperature=0)
            handle = (
                engine.chat(messages, params) if messages is not None else engine.generate(prompt, params)
            )
            return (await handle).outputs[0].text

    return asyncio.run(run())


def test_the_clients_get_what_one_engine_answers(cluster):
    import anthropic
    import openai

    expected = _local("default", QUESTION, None, 16, max_model_len=2048)
    chat = openai.OpenAI(base_url=f"{cluster.url}/prefix/v1", api_key="none")
    r = chat.chat.completions.create(model="default", messages=QUESTION, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == expected
    stream = chat.chat.completions.create(
        model="default", messages=QUESTION, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    claude = anthropic.Anthropic(base_url=f"{cluster.url}/prefix", api_key="none")
    # the client dropped temperature: the body takes it (tests/http/test_anthropic.py does the same)
    m = claude.messages.create(
        model="default", messages=QUESTION, max_tokens=16, extra_body={"temperature": 0}
    )
    assert m.content[0].text == expected
    bad = chat.with_options(max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:  # the replica's own error, through the ingress
        bad.chat.completions.create(model="default", messages=[], max_tokens=4)
    assert "messages" in str(e.value)
    # tensor-parallel replicas answer as one engine of the same checkpoint
    prompt = "The quick brown fox"
    tp = openai.OpenAI(base_url=f"{cluster.url}/tp/v1", api_key="none")
    alone = _local(cluster.tiny, None, prompt, 12, max_model_len=256, dtype="float32")
    answered: set[str] = set()
    for i in range(20):  # until both replicas have answered (a prompt no replica holds goes to the emptier)
        raw = tp.completions.with_raw_response.create(
            model=cluster.tiny, prompt=f"{prompt} {i}" if i else prompt, max_tokens=12, temperature=0
        )
        if not i:
            assert raw.parse().choices[0].text == alone
        answered.add(raw.headers["X-Aioengine-Replica"])
        if len(answered) == 2:
            break
    assert len(answered) == 2, answered


async def _multi_turn(url: str) -> tuple[float, set[str]]:
    """The interleaved conversations: the replies' cached prompt tokens over their prompt tokens from turn 2
    on, and the replicas that answered."""
    histories = [
        [{"role": "user", "content": f"Conversation {c}: " + "tell me about the history of Paris. " * 12}]
        for c in range(CONVERSATIONS)
    ]
    cached = prompt = 0
    replicas: set[str] = set()
    async with aiohttp.ClientSession() as s:
        for turn in range(TURNS):
            for h in histories:
                body = {"model": "default", "messages": h, "max_tokens": 4, "temperature": 0}
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    reply = await r.json()
                    replicas.add(r.headers["X-Aioengine-Replica"])
                if turn:
                    cached += reply["usage"]["prompt_tokens_details"]["cached_tokens"]
                    prompt += reply["usage"]["prompt_tokens"]
                answer = reply["choices"][0]["message"]["content"]
                h += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
    return cached / prompt, replicas


def test_prefix_routing_beats_power_of_two_choices(cluster):
    pow2_rate, pow2_replicas = asyncio.run(_multi_turn(f"{cluster.url}/pow2"))
    prefix_rate, prefix_replicas = asyncio.run(_multi_turn(f"{cluster.url}/prefix"))
    assert len(pow2_replicas) == len(prefix_replicas) == 2  # both spread the conversations
    assert prefix_rate > 0.8 and prefix_rate > pow2_rate + 0.1, (prefix_rate, pow2_rate)

    async def decisions() -> dict[str, float]:
        async with aiohttp.ClientSession() as s, s.get(f"{cluster.url}/prefix/metrics") as r:
            text = await r.text()
        return {k: float(v) for k, v in re.findall(r'router_decisions_total\{decision="(\w+)"\} (\S+)', text)}

    counted = asyncio.run(decisions())
    assert counted["prefix_hit"] >= CONVERSATIONS * (TURNS - 1), counted
    assert counted["miss"] >= CONVERSATIONS  # each conversation's first turn


def _replica_pids(app: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f"ServeReplica:{app}:EngineReplica".encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


async def _kill_one_mid_stream(url: str) -> None:
    victims = _replica_pids("prefix")
    assert len(victims) == 2, victims
    async with aiohttp.ClientSession() as s:
        for _ in range(10):  # two streams on the two replicas (power of two choices on queue length)
            long = {"model": "default", "max_tokens": 400, "ignore_eos": True, "stream": True}
            a = await s.post(
                url + "/v1/completions", json={**long, "prompt": f"Once upon a time {uuid.uuid4()}"}
            )
            b = await s.post(
                url + "/v1/completions", json={**long, "prompt": f"In a land far away {uuid.uuid4()}"}
            )
            before = {a.headers["X-Aioengine-Replica"], b.headers["X-Aioengine-Replica"]}
            if len(before) == 2:
                break
            a.close()
            b.close()
        assert len(before) == 2, "the two streams never went to two replicas"
        await a.content.readline()
        await b.content.readline()
        os.kill(victims[0], signal.SIGKILL)
        bodies = [(await a.read()).decode(), (await b.read()).decode()]
        broken = [x for x in bodies if '"engine_dead"' in x]
        whole = [x for x in bodies if x.rstrip().endswith("data: [DONE]")]
        assert len(broken) == 1 and len(whole) == 1, [x[-300:] for x in bodies]
        deadline = time.monotonic() + 240
        seen: set[str] = set()
        while not seen - before:  # a new replica takes the killed one's place, and serves
            assert time.monotonic() < deadline, f"no new replica came up: {seen}"
            body = {"model": "default", "prompt": f"Hello {uuid.uuid4()}", "max_tokens": 2}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()  # the next requests succeed meanwhile
                seen.add(r.headers["X-Aioengine-Replica"])
            await asyncio.sleep(0.5)
    assert len(_replica_pids("prefix")) == 2


async def _leave_mid_stream(url: str) -> None:
    """A client that closes its stream: the replica's engine aborts the request (the load it reports, read
    through the ingress's /metrics, goes back to 0)."""

    async def loads(s: aiohttp.ClientSession) -> list[float]:
        async with s.get(url + "/v1/models"):  # a request through the router, which reads the reports
            pass
        async with s.get(url + "/metrics") as r:
            return [float(x) for x in re.findall(r"aioengine:replica_load\{[^}]*\} (\S+)", await r.text())]

    async with aiohttp.ClientSession() as s:
        body = {
            "model": "default",
            "prompt": f"Tell me {uuid.uuid4()}",
            "max_tokens": 2000,
            "ignore_eos": True,
        }
        r = await s.post(url + "/v1/completions", json={**body, "stream": True})
        await r.content.readline()
        deadline = time.monotonic() + 30
        while sum(await loads(s)) < 1:  # the replica has reported the request
            assert time.monotonic() < deadline, "the stream never showed in a replica's load"
            await asyncio.sleep(0.3)
        r.close()
        while sum(await loads(s)) > 0:
            assert time.monotonic() < deadline, "the request went on after its client left"
            await asyncio.sleep(0.3)


def test_a_client_that_leaves_ends_its_request(cluster):
    asyncio.run(_leave_mid_stream(f"{cluster.url}/prefix"))


def test_a_replica_killed_mid_stream_ends_only_its_stream_and_is_replaced(cluster):
    asyncio.run(_kill_one_mid_stream(f"{cluster.url}/prefix"))


def test_sigint_leaves_nothing_running(cluster):
    everyone = descendants(cluster.proc.pid)
    assert len(everyone) > 6  # Ray's daemons and the replicas
    cluster.proc.send_signal(signal.SIGINT)
    cluster.proc.wait(120)
    deadline = time.monotonic() + 60
    while [p for p in everyone if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [p for p in everyone if alive(p)]
    assert not left, f"{len(left)} of serve run's processes outlived it"
