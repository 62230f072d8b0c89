"""`aioengine serve` flags, bench dispatch, and the serve lifecycle: SIGTERM -> exit 0, dead engine -> 1."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time

import aiohttp
import orjson
import pytest

from aioengine import EngineArgs
from aioengine.cli import commands as cli
from aioengine.config import KernelConfig
from aioengine.http.app import ServerConfig, bound_port, build_app, start_server
from aioengine.http.run import serve_engine
from tests.http.fake_engine import FakeEngine
from tests.processes import wait_for_port

GRACE_S = (
    5.0  # shutdown_timeout: how long a stopping server waits for live requests and aiohttp for connections
)


def test_every_engine_arg_has_a_vllm_style_flag():
    parser = cli.build_parser()
    flags = {
        a
        for action in parser._subparsers._group_actions[0].choices["serve"]._actions
        for a in action.option_strings
    }
    for f in (*dataclasses.fields(EngineArgs), *dataclasses.fields(KernelConfig)):
        if f.name != "kernels":  # the group: one flag per KernelConfig field
            assert "--" + f.name.replace("_", "-") in flags, f.name
    assert {
        "--no-enable-prefix-caching",
        "--enforce-eager",
        "--api-key",
        "--max-num-queued-reqs",
        "--log-requests",
        "--log-level",
        "--host",
        "--port",
    } <= flags


def test_flags_build_engine_args():
    args = cli.build_parser().parse_args(
        [
            "serve",
            "mymodel",
            "--max-model-len",
            "1024",
            "--max-num-batched-tokens",
            "256",
            "--max-num-seqs",
            "8",
            "--block-size",
            "32",
            "--num-kv-blocks",
            "100",
            "--kv-cache-memory-bytes",
            "1.5G",
            "--gpu-memory-utilization",
            "0.5",
            "--no-enable-prefix-caching",
            "--long-prefill-token-threshold",
            "64",
            "--scheduling-policy",
            "priority",
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--seed",
            "7",
            "--served-model-name",
            "a",
            "b",
            "--enforce-eager",
        ]
    )
    ea = cli.engine_args_from(args)
    assert ea == EngineArgs(
        model="mymodel",
        max_model_len=1024,
        max_num_batched_tokens=256,
        max_num_seqs=8,
        block_size=32,
        num_kv_blocks=100,
        kv_cache_memory_bytes=int(1.5 * 2**30),
        gpu_memory_utilization=0.5,
        enable_prefix_caching=False,
        long_prefill_token_threshold=64,
        scheduling_policy="priority",
        dtype="float32",
        device="cpu",
        seed=7,
        served_model_name="a",
        enforce_eager=True,
    )
    assert args.served_model_name == ["a", "b"]
    assert cli.engine_args_from(cli.build_parser().parse_args(["serve"])) == EngineArgs()


def test_offload_flags_build_engine_args(tmp_path):
    args = cli.build_parser().parse_args(
        ["serve", "--kv-offload-size", "0.5", "--kv-offload-dir", str(tmp_path)]
    )
    assert cli.engine_args_from(args) == EngineArgs(kv_offload_size=0.5, kv_offload_dir=str(tmp_path))


def test_kernel_flags_build_the_kernel_config():
    args = cli.build_parser().parse_args(
        [
            "serve",
            "--no-cpu-kernels",
            "--cpu-linear",
            "onednn",
            "--no-cpu-decode-stack",
            "--cuda-graph-capture-timeout-s",
            "30",
        ]
    )
    assert cli.engine_args_from(args).kernels == KernelConfig(
        cpu_kernels=False, cpu_linear="onednn", cpu_decode_stack=False, cuda_graph_capture_timeout_s=30
    )
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--cpu-linear", "mkl"])


@pytest.mark.parametrize(
    ("text", "value"),
    [("4096", 4096), ("2K", 2048), ("512MiB", 512 << 20), ("2G", 2 << 30), ("1.5gb", int(1.5 * 2**30))],
)
def test_parse_bytes(text, value):
    assert cli.parse_bytes(text) == value


def test_bench_dispatches_to_bench_main(monkeypatch, capsys):
    import types

    seen = []
    monkeypatch.setitem(
        sys.modules, "aioengine.cli.bench", types.SimpleNamespace(main=lambda argv: seen.append(argv))
    )
    assert cli.main(["bench", "throughput", "--num-prompts", "3"]) == 0
    assert seen == [["throughput", "--num-prompts", "3"]]
    monkeypatch.setitem(sys.modules, "aioengine.cli.bench", None)  # as if it were not installed
    assert cli.main(["bench"]) == 2
    assert "aioengine bench is not available" in capsys.readouterr().err


def test_bad_engine_flags_exit_2(capsys):
    assert cli.main(["serve", "--block-size", "3"]) == 2
    assert "block_size" in capsys.readouterr().err
    assert cli.main(["serve", "--kv-offload-dir", "/tmp/kv"]) == 2
    assert "kv_offload_dir needs kv_offload_size" in capsys.readouterr().err


def test_bad_flags_for_several_models_exit_2(capsys, tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    cases = [
        (["--models-dir", str(tmp_path / "nope")], "not a folder"),
        (["--models-dir", str(tmp_path / "empty-but-file")], "not a folder"),
        (["--model", "=x"], "NAME=PATH"),
        (["--model", "a=x", "--model", "a=y"], "given twice"),
        (["--models-dir", str(tmp_path), "--data-parallel-size", "2"], "data-parallel"),
        (["--models-dir", str(tmp_path), "--max-loaded-models", "0"], "at least 1"),
        (["--models-dir", str(tmp_path), "--keep-alive", "nan"], "finite"),
    ]
    for argv, message in cases:
        assert cli.main(["serve", *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv
    with pytest.raises(SystemExit, match="NAME=PATH serves several models"):  # serve's alone
        cli.main(["bench", "latency", "--model", "a=b"])


# ---- lifecycle, with a fake engine (fast) ---------------------------------------------------------------
def test_dead_engine_health_503_stream_error_and_exit_1():
    async def main():
        engine = FakeEngine()
        stop = asyncio.Event()
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        serve = asyncio.create_task(
            serve_engine(
                engine,
                ServerConfig(),
                "127.0.0.1",
                0,
                stop,
                stats_interval=None,
                shutdown_timeout=GRACE_S,
                on_ready=ready.set_result,
            )
        )
        port = await asyncio.wait_for(ready, 10)
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as s:
            assert (await s.get(url + "/health")).status == 200
            resp = await s.post(url + "/v1/completions", json={"prompt": "x", "stream": True})
            assert b"Hello" in await resp.content.readline() + await resp.content.readline()
            engine.die()
            t0 = time.monotonic()
            body = (await resp.read()).decode()
            events = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            err = orjson.loads(events[-2])["error"]
            assert err["code"] == "engine_dead" and "boom" in err["message"]
            health = await s.get(url + "/health")
            assert health.status == 503 and (await health.json())["error"]["code"] == "engine_dead"
            r = await s.post(url + "/v1/completions", json={"prompt": "x"})
            assert r.status == 503
        rc = await asyncio.wait_for(serve, 10)
        return rc, time.monotonic() - t0

    rc, elapsed = asyncio.run(main())
    # An ordering, not a speed: a dead engine has nothing to drain, so the server exits before any grace
    # it would give live requests (GRACE_S, which is also aiohttp's limit for closing connections) runs out.
    assert rc == 1 and elapsed < GRACE_S


def test_stop_aborts_in_flight_after_grace_and_exits_0():
    async def main():
        engine = FakeEngine()
        stop = asyncio.Event()
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        serve = asyncio.create_task(
            serve_engine(
                engine,
                ServerConfig(),
                "127.0.0.1",
                0,
                stop,
                stats_interval=None,
                shutdown_timeout=0.3,
                on_ready=ready.set_result,
            )
        )
        url = f"http://127.0.0.1:{await asyncio.wait_for(ready, 10)}"
        async with aiohttp.ClientSession() as s:
            resp = await s.post(
                url + "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "x"}], "stream": True},
            )
            await resp.content.readline()
            stop.set()
            body = (await resp.read()).decode()
        assert '"finish_reason":"abort"' in body and body.rstrip().endswith("data: [DONE]")
        return await asyncio.wait_for(serve, 10), engine.shut_down

    assert asyncio.run(main()) == (0, True)


def test_port_in_use_exits_1():
    async def main():
        blocker = await start_server(build_app(FakeEngine()), "127.0.0.1", 0)
        try:
            return await serve_engine(
                FakeEngine(),
                ServerConfig(),
                "127.0.0.1",
                bound_port(blocker),
                asyncio.Event(),
                stats_interval=None,
            )
        finally:
            await blocker.cleanup()

    assert asyncio.run(main()) == 1


# ---- the real thing: `python -m aioengine serve` in a subprocess ----------------------------------------
def test_serve_subprocess_sigterm_exits_0():
    env = {**os.environ, "AIOENGINE_API_KEY": "sekrit", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aioengine",
            "serve",
            "--port",
            "0",
            "--max-model-len",
            "256",
            "--num-kv-blocks",
            "32",
            "--max-num-seqs",
            "4",
            "--stats-interval",
            "0.5",
            "--shutdown-timeout",
            "0.5",
            "--served-model-name",
            "tiny",
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    lines: list[str] = []
    try:
        port = wait_for_port(proc, r"Serving tiny on http://127\.0\.0\.1:(\d+)", 120, lines)
        assert port, "".join(lines)

        async def traffic():
            url, auth = f"http://127.0.0.1:{port}", {"Authorization": "Bearer sekrit"}
            async with aiohttp.ClientSession() as s:
                assert (await s.get(url + "/v1/models")).status == 401
                r = await s.post(
                    url + "/v1/completions",
                    headers=auth,
                    json={"model": "tiny", "prompt": "Hello", "max_tokens": 3},
                )
                assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 3
                resp = await s.post(
                    url + "/v1/completions",
                    headers=auth,
                    json={"prompt": "Once", "max_tokens": 200, "ignore_eos": True, "stream": True},
                )
                await resp.content.readline()
                proc.send_signal(signal.SIGTERM)  # mid-stream: finishes or is aborted, then exit 0
                body = (await resp.read()).decode()
                assert body.rstrip().endswith("data: [DONE]")

        asyncio.run(traffic())
        rc = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(lines) + proc.stderr.read()
    assert rc == 0, out
    assert "Avg prompt throughput" in out and "Running:" in out
    assert "received SIGTERM" in out and "shut down" in out
