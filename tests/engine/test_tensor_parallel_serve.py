"""`aioengine serve --tensor-parallel-size 2` on the default model, as a user runs it: it answers, and when
rank 1 is killed mid-stream the stream ends with an error, /health says 503, and serve exits non-zero with
no process left behind."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

from tests.processes import alive, children, wait_for_port

pytestmark = pytest.mark.timeout(300)


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads the process tree from /proc")
def test_serve_tp2_answers_then_a_killed_rank_gives_errors_503_and_a_nonzero_exit():
    proc = subprocess.Popen(
        [sys.executable, "-m", "aioengine", "serve", "--port", "0", "--tensor-parallel-size", "2"]
        + ["--max-model-len", "512", "--max-num-seqs", "8", "--step-timeout-s", "30"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        text=True,
    )
    lines: list[str] = []
    try:
        port = wait_for_port(proc, r"on http://127\.0\.0\.1:(\d+)", 180, lines)
        assert port, "".join(lines)
        (rank1,) = children(proc.pid)

        async def traffic() -> tuple[str, int]:
            url = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as s:
                chat = {
                    "messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "temperature": 0,
                    "max_tokens": 16,
                }
                r = await s.post(url + "/v1/chat/completions", json=chat)
                assert r.status == 200
                assert "Paris" in (await r.json())["choices"][0]["message"]["content"]
                metrics = await (await s.get(url + "/metrics")).text()
                for rank in (0, 1):  # both ranks ran the steps, and each timed its own
                    steps = re.search(rf'aioengine:rank_steps_total{{[^}}]*rank="{rank}"}} (\S+)', metrics)
                    busy = re.search(
                        rf'aioengine:rank_step_seconds_total{{[^}}]*rank="{rank}"}} (\S+)', metrics
                    )
                    assert steps and float(steps.group(1)) >= 3 and busy and float(busy.group(1)) > 0, metrics
                long = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
                resp = await s.post(url + "/v1/completions", json=long)
                await resp.content.readline()
                os.kill(rank1, signal.SIGKILL)
                body = (await resp.read()).decode()
                health = (await s.get(url + "/health")).status
                return body, health

        body, health = asyncio.run(traffic())
        assert '"error"' in body and "rank 1" in body, body[-500:]
        assert health == 503
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(lines) + proc.stderr.read()
    assert rc != 0, out
    assert not alive(rank1)


def _serve_tiny(path) -> tuple[subprocess.Popen, int, list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "aioengine", "serve", "--port", "0", "--tensor-parallel-size", "2"]
        + ["--model", str(path), "--dtype", "float32", "--shutdown-timeout", "1"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        text=True,
    )
    lines: list[str] = []
    if wait_for_port(proc, r"on http://127\.0\.0\.1:(\d+)", 120, lines):
        return proc, children(proc.pid)[0], lines
    proc.kill()
    raise AssertionError("".join(lines))


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads the process tree from /proc")
def test_sigterm_reaps_the_ranks_and_a_killed_parent_takes_them_along(tiny_checkpoint_of):
    path = tiny_checkpoint_of("llama", num_key_value_heads=1)
    proc, rank1, lines = _serve_tiny(path)
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(lines) + proc.stderr.read()
        assert not alive(rank1)
        # SIGKILL leaves no handler to run: rank 1 sees its stdin close and leaves by itself
        proc, rank1, lines = _serve_tiny(path)
        proc.kill()
        proc.wait(30)
        deadline = time.monotonic() + 10
        while alive(rank1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(rank1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
