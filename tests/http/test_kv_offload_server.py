"""`aioengine serve --kv-offload-size --kv-offload-dir`, started as a user starts it, on the default model
with a KV pool far smaller than a multi-turn workload: later turns come back from the host tier (the
bench and /metrics count them), and a restarted server answers the first turns from the disk tier."""

from __future__ import annotations

import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

from aioengine.cli.bench.multi_turn import main as multi_turn
from tests.processes import wait_for_port

BENCH = ["--conversations", "6", "--turns", "3", "--output-len", "8", "--max-concurrency", "2", "--seed", "3"]


def _serve(folder: Path) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "aioengine", "serve", "--port", "0", "--max-model-len", "1024",
            "--num-kv-blocks", "40", "--max-num-seqs", "4", "--kv-offload-size", "0.25",
            "--kv-offload-dir", str(folder), "--stats-interval", "1"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    port = wait_for_port(proc, r"Serving .* on http://127\.0\.0\.1:(\d+)", 120, lines)
    assert port is not None, "".join(lines[-30:])
    assert proc.stderr is not None
    threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    return proc, f"http://127.0.0.1:{port}"


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        assert proc.wait(timeout=60) == 0  # a clean stop: the queued block writes land first
    finally:
        if proc.poll() is None:
            proc.kill()


def test_offload_tiers_through_the_server_and_a_restart(tmp_path):
    proc, url = _serve(tmp_path)
    try:
        first = multi_turn(["--base-url", url, *BENCH])
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
    finally:
        _stop(proc)
    assert first["offload_host_hit_tokens"] > 0 and first["offload_disk_read_blocks"] == 0
    assert "aioengine:kv_offload_stored_blocks_total" in metrics
    assert len(list(tmp_path.glob("*/*.kv"))) > 10

    proc, url = _serve(tmp_path)
    try:
        again = multi_turn(["--base-url", url, *BENCH, "--turns", "1"])
    finally:
        _stop(proc)
    assert again["offload_disk_read_blocks"] > 0  # a new process: only the disk tier knew these blocks
