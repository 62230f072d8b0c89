"""Each bench mode runs on a tiny model and reports sane fields (no timing assertions)."""

from __future__ import annotations

import json
import os
import threading

import pytest

from aioengine.cli.bench import _MODES
from aioengine.cli.bench import main as bench_main
from aioengine.cli.bench.datasets import (
    grounded_workload,
    prefix_repetition_workload,
    random_workload,
    shared_workload,
    sharegpt_workload,
)
from tests.engine.conftest import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-tiny")
    make_tiny_checkpoint("llama", path)
    return path


@pytest.mark.parametrize("dataset", ["shared", "random", "sharegpt", "prefix-repetition"])
def test_bench_throughput_reports(tiny, tmp_path, dataset, capsys):
    out = tmp_path / "r.json"
    rc = bench_main(
        [
            "throughput",
            "--model",
            str(tiny),
            "--dataset",
            dataset,
            "--num-prompts",
            "6",
            "--output-len",
            "5",
            "--input-len",
            "20",
            "--prefix-len",
            "40",
            "--suffix-len",
            "8",
            "--max-model-len",
            "512",
            "--sharegpt-max-len",
            "200",
            "--no-progress",
            "--output-json",
            str(out),
        ]
    )
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["num_requests"] == 6
    if dataset != "sharegpt":  # sharegpt draws its own output lengths
        assert r["output_tokens"] == 30
    assert r["output_tokens_per_s"] > 0 and r["input_tokens"] > 0 and r["elapsed_s"] > 0
    assert r["matmul_gflops"] > 0 and r["fraction_of_roofline"] > 0 and r["device"] == "cpu"
    host = r["host_ms_per_step"]  # every phase of the loop and of the worker, per step, measured
    assert set(host) == {
        "loop_schedule",
        "loop_update",
        "loop_outputs",
        "worker_prepare",
        "worker_forward",
        "worker_sample",
    }
    assert all(v > 0 for v in host.values()) and host["worker_forward"] < 1e3 * r["elapsed_s"]
    out = capsys.readouterr().out
    assert "output tokens/s" in out and "Host ms per step: loop_outputs" in out


def test_bench_throughput_no_ignore_eos_ends_each_request_at_its_eos(tiny, tmp_path):
    """--no-ignore-eos: a request stops at the checkpoint's EOS, which is made here a token greedy decoding
    writes early; by default every request runs to --output-len."""
    import asyncio
    import shutil

    from aioengine.engine.async_engine import AsyncEngine
    from aioengine.sampling_params import SamplingParams

    async def greedy(model) -> list[list[int]]:
        async with AsyncEngine(model=str(model), max_model_len=512) as engine:
            prompts = grounded_workload(engine.tokenizer, 2, 8)
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            outs = [await engine.generate(r.prompt_token_ids, params) for r in prompts]
            return [list(o.outputs[0].token_ids) for o in outs]

    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    first, second = asyncio.run(greedy(model))
    eos = next(t for i, t in enumerate(first) if i >= 2 and t not in first[:i])
    for name in ("config.json", "generation_config.json"):
        path = model / name
        if path.exists():
            cfg = json.loads(path.read_text())
            cfg["eos_token_id"] = eos
            path.write_text(json.dumps(cfg))
    expected = sum(out.index(eos) + 1 if eos in out else len(out) for out in (first, second))
    assert expected < 16
    for flags, want in (([], 16), (["--no-ignore-eos"], expected)):
        out = tmp_path / "r.json"
        args = ["throughput", "--model", str(model), "--dataset", "grounded", "--num-prompts", "2"]
        args += ["--output-len", "8", "--max-model-len", "512", "--no-progress", "--output-json", str(out)]
        assert bench_main(args + flags) == 0
        r = json.loads(out.read_text())
        assert r["output_tokens"] == want and r["ignore_eos"] == (not flags)


def test_bench_latency_reports(tiny, tmp_path):
    out = tmp_path / "l.json"
    assert (
        bench_main(
            [
                "latency",
                "--model",
                str(tiny),
                "--batch-size",
                "2",
                "--output-len",
                "6",
                "--num-iters",
                "1",
                "--num-iters-warmup",
                "0",
                "--output-json",
                str(out),
            ]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert r["batch_size"] == 2 and r["decode_step_ms_median"] > 0 and r["decode_tokens_per_s"] > 0


def test_datasets_have_the_promised_shapes():
    from aioengine.model.files import resolve_model
    from aioengine.model.tokenizer import load_tokenizer

    tok = load_tokenizer(str(resolve_model("default")))
    shared = shared_workload(tok, 64, 128)
    assert all(64 <= len(r.prompt_token_ids) <= 256 and r.output_len == 128 for r in shared)
    rnd = random_workload(tok, 20, 100, 50, range_ratio=0.5)
    assert all(50 <= len(r.prompt_token_ids) <= 150 and 25 <= r.output_len <= 75 for r in rnd)
    sg = sharegpt_workload(tok, 300)
    mean_in = sum(len(r.prompt_token_ids) for r in sg) / 300
    assert 150 < mean_in < 300
    pr = prefix_repetition_workload(tok, 8, 64, 8, 16, num_prefixes=2)
    assert pr[0].prompt_token_ids[:64] == pr[2].prompt_token_ids[:64] != pr[1].prompt_token_ids[:64]


def test_bench_serve_refuses_a_server_pid_it_cannot_read(capsys):
    with pytest.raises(SystemExit) as e:  # before loading a tokenizer or sending a request
        bench_main(["serve", "--server-pid", str(2**22 + 12345)])
    assert e.value.code == 2 and "--server-pid: cannot read the threads of process" in capsys.readouterr().err


def test_bench_usage_errors():
    assert bench_main([]) == 2
    assert bench_main(["nonsense"]) == 2
    with pytest.raises(SystemExit) as e:  # a usage error, not a StatisticsError after loading the model
        bench_main(["latency", "--output-len", "2"])
    assert e.value.code == 2


@pytest.mark.parametrize("mode", _MODES)
def test_every_bench_mode_answers_help(mode, capsys):
    """Each mode in the dispatcher has an entry point whose --help exits 0 (before running anything)."""
    with pytest.raises(SystemExit) as e:
        bench_main([mode, "--help"])
    assert e.value.code == 0
    assert f"usage: aioengine bench {mode}" in capsys.readouterr().out


def test_bench_serve_reports_against_a_live_server(tiny, tmp_path):
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aioengine",
            "serve",
            str(tiny),
            "--port",
            str(port),
            "--max-model-len",
            "512",
            "--block-size",
            "4",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        out, png = tmp_path / "s.json", tmp_path / "s.png"
        assert (
            bench_main(
                [
                    "serve",
                    "--base-url",
                    f"http://127.0.0.1:{port}",
                    "--max-concurrency",
                    "3",
                    "--num-prompts",
                    "12",
                    "--output-len",
                    "40",
                    "--ignore-eos",
                    "--save-result",
                    str(out),
                    "--save-detailed",
                    "--plot",
                    str(png),
                    "--server-pid",
                    str(server.pid),
                ]
            )
            == 0
        )
        r = json.loads(out.read_text())
        # the server's threads over the run: its loop, and the worker that computed (/proc counts clock ticks:
        # the run streams enough tokens for the loop's share to pass one)
        cpu = r["server_cpu"]
        assert cpu["pid"] == server.pid and 0 < cpu["loop_s"] < cpu["server_s"]
        # /proc counts each thread in clock ticks: on a run this short their sum may pass the wall time by a
        # tick a thread
        tick = 1 / os.sysconf("SC_CLK_TCK")
        assert cpu["server_s"] <= cpu["machine_s"] + tick * (1 + len(cpu["other_threads_s"]))
        assert cpu["other_threads_s"] and cpu["other_threads_s"][0] > 0 and cpu["client_s"] > 0
        detail = r["requests"]  # --save-detailed: every request's own timings
        assert len(detail) == 12 and all(d["output_tokens"] == 40 and len(d["itl_s"]) == 39 for d in detail)
        assert all(d["start_s"] >= 0 and 0 < d["ttft_s"] <= d["e2el_s"] and not d["error"] for d in detail)
        assert r["completed"] == 12 and r["failed"] == 0 and r["output_tokens"] == 480
        for key in ("ttft_s", "tpot_s", "itl_s", "e2el_s"):
            assert set(r[key]) == {"mean", "p50", "p90", "p99"}
            assert 0 < r[key]["p50"] <= r[key]["p99"]
        assert r["ttft_s"]["p99"] <= r["e2el_s"]["p99"]
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_roofline_takes_the_best_of_its_timings(monkeypatch):
    """A roofline is a peak: one slow timing (a busy moment on a shared machine) must not lower it."""
    from aioengine.cli.bench import roofline

    ticks = iter([0.0, 1.0, 1.0, 1.5, 1.5, 5.5, 5.5, 6.0])  # repeats of 1.0 s, 0.5 s, 4.0 s and 0.5 s
    monkeypatch.setattr(roofline.time, "perf_counter", lambda: next(ticks))
    from aioengine.gpu.cpu.backend import CpuBackend

    gflops = roofline.matmul_gflops("float32", CpuBackend(), n=8, iters=3, repeats=4)
    assert gflops == pytest.approx(2 * 8**3 * 3 / 0.5 / 1e9)


def _tiny_throughput(tiny, *extra: str) -> int:
    """``bench throughput`` on the tiny checkpoint: 3 random prompts of 16 tokens, 4 tokens each."""
    argv = ["throughput", "--model", str(tiny), "--dataset", "random", "--num-prompts", "3"]
    argv += ["--output-len", "4", "--input-len", "16", "--max-model-len", "512", "--no-progress", *extra]
    return bench_main(argv)


def test_bench_throughput_keeps_the_better_of_its_two_rooflines(tiny, tmp_path, monkeypatch):
    """The roofline is measured before the run and after it: a busy spell during one (half the rate)
    must not double the fraction. Both run on the engine's worker: an OpenMP pool of the bench's own
    thread would make libgomp throttle the kernels' threads through the run."""
    from aioengine.cli.bench import throughput

    rates = iter([400.0, 200.0])
    threads: list[str] = []

    def fake_roofline(*a, **k):
        threads.append(threading.current_thread().name)
        return next(rates)

    monkeypatch.setattr(throughput, "matmul_gflops", fake_roofline)
    out = tmp_path / "r.json"
    assert _tiny_throughput(tiny, "--output-json", str(out)) == 0
    assert len(threads) == 2 and all(t.startswith("aioengine-step") for t in threads), threads
    r = json.loads(out.read_text())
    assert r["matmul_gflops_runs"] == [400.0, 200.0] and r["matmul_gflops"] == 400.0
    assert r["fraction_of_roofline"] == pytest.approx(r["output_tokens_per_s"] / r["roofline_tokens_per_s"])
    assert r["num_active_parameters"] == r["num_parameters"]  # dense: every parameter, every token
    assert r["roofline_tokens_per_s"] == pytest.approx(400e9 / (2 * r["num_active_parameters"]))


def test_bench_throughput_profile_host_writes_both_threads(tiny, tmp_path):
    prof = tmp_path / "host.txt"
    assert _tiny_throughput(tiny, "--profile-host", str(prof)) == 0
    text = prof.read_text()
    assert "==== loop thread, by tottime" in text and "scheduler.py" in text  # the loop plans steps
    assert "execute_model" in text  # the worker's steps: its own profiler, or (3.12+) the loop's covers it


def test_bench_allreduce_reports_both_transports(tmp_path):
    from aioengine.cli.bench.allreduce import main as allreduce

    out = tmp_path / "ar.json"
    allreduce(["--num-tokens", "1", "3", "--hidden-size", "8", "--iters", "3", "--output-json", str(out)])
    result = json.loads(out.read_text())
    for transport in ("gloo", "shm"):
        assert set(result[transport]) == {"1x8_us", "3x8_us"} and all(
            v > 0 for v in result[transport].values()
        )
