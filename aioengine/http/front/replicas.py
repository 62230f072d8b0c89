"""The front's replicas: N ``aioengine serve`` processes on local ports, each with its share of the CPU
cores (or its own GPU), watched and restarted when one dies.

Each replica is a whole server (its own event loop, engine and KV cache), so the front only forwards
bytes. On a CPU the cores are split evenly (``--num-threads``) unless the command line sets them; with
as many GPUs as replicas each gets one (``env.replica_environment``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from aioengine.env import replica_environment

logger = logging.getLogger("aioengine.front")


@dataclass(slots=True)
class Replica:
    index: int
    port: int = 0
    proc: asyncio.subprocess.Process | None = None
    healthy: bool = False
    load: int = 0  # requests in flight through the front
    restarts: int = 0
    watcher: asyncio.Task | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the front dies (Linux's PR_SET_PDEATHSIG; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_FRONT_FLAGS = ("--data-parallel-size", "--data-parallel-routing", "--host", "--port")


def sets_flag(argv: list[str], flag: str) -> bool:
    """Whether the command line gives ``flag`` (as ``--flag value`` or ``--flag=value``)."""
    return any(a.split("=", 1)[0] == flag for a in argv)


def replica_argv(argv: list[str]) -> list[str]:
    """The serve command line less the front's own flags (data parallelism, host, port; argparse's
    abbreviations of them too), ending with ``--data-parallel-size 1`` (the last value wins, so a replica
    never starts a front of its own)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if len(name) > 3 and any(flag.startswith(name) for flag in _FRONT_FLAGS):
            skip = "=" not in a
            continue
        out.append(a)
    return [*out, "--data-parallel-size", "1"]


def replica_kv_events(argv: list[str], index: int) -> list[str]:
    """``argv`` with its --kv-events-config endpoints' TCP ports moved up by ``index`` (vLLM's rule for
    data-parallel ranks), so the replicas do not bind the same sockets."""
    out = list(argv)
    for i, a in enumerate(out):
        name, eq, value = a.partition("=")
        if name != "--kv-events-config":
            continue
        at, raw = (i, value) if eq else (i + 1, out[i + 1] if i + 1 < len(out) else "")
        try:
            cfg = json.loads(raw)
        except ValueError:
            return out  # the replica reports the bad value itself
        for key in ("endpoint", "replay_endpoint"):
            ep = cfg.get(key) if isinstance(cfg, dict) else None
            if isinstance(ep, str) and ep.startswith("tcp://") and ep.rsplit(":", 1)[-1].isdigit():
                host, port = ep.rsplit(":", 1)
                cfg[key] = f"{host}:{int(port) + index}"
        out[at] = f"--kv-events-config={json.dumps(cfg)}" if eq else json.dumps(cfg)
    return out


class ReplicaSet:
    def __init__(
        self,
        argv: list[str],
        num_replicas: int,
        on_restart: Callable[[int], None] = lambda r: None,
        startup_timeout_s: float = 900.0,
        gpus_per_replica: int = 1,
    ) -> None:
        """``argv``: the serve command line for every replica (replica_argv's); ``on_restart(i)``: replica
        i came back with an empty cache."""
        self.argv = argv
        self.replicas = [Replica(i) for i in range(num_replicas)]
        self.on_restart = on_restart
        self.startup_timeout_s = startup_timeout_s
        self.gpus_per_replica = gpus_per_replica  # its tensor-parallel size
        self.stopping = False
        self._session: aiohttp.ClientSession | None = None

    def _threads(self) -> list[str]:
        if sets_flag(self.argv, "--num-threads"):
            return []
        return ["--num-threads", str(max(1, (os.cpu_count() or 1) // len(self.replicas)))]

    async def start(self) -> None:
        """Start every replica and wait until each answers /health; one that exits first raises."""
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        await asyncio.gather(*(self._spawn(r) for r in self.replicas))
        await asyncio.gather(*(self._until_healthy(r) for r in self.replicas))
        for r in self.replicas:
            r.watcher = asyncio.create_task(self._watch(r))

    async def _spawn(self, r: Replica) -> None:
        r.port = _free_port()
        r.healthy = False
        argv = replica_kv_events(self.argv, r.index)  # argv: "serve", ...
        cmd = [sys.executable, "-m", "aioengine", *argv, *self._threads()]
        cmd += ["--host", "127.0.0.1", "--port", str(r.port)]
        env = replica_environment(r.index, len(self.replicas), self.gpus_per_replica)
        # its own session (a terminal's Ctrl-C reaches the front alone, which stops it), and killed with
        # the front should the front die without stopping it
        r.proc = await asyncio.create_subprocess_exec(
            *cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent
        )
        logger.info("replica %d: pid %d on port %d", r.index, r.proc.pid, r.port)

    async def _until_healthy(self, r: Replica) -> None:
        assert self._session is not None and r.proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if r.proc.returncode is not None:
                raise RuntimeError(f"replica {r.index} exited with code {r.proc.returncode} while starting")
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with self._session.get(r.url + "/health") as resp:
                    if resp.status == 200:
                        r.healthy = True
                        return
            await asyncio.sleep(0.25)
        raise RuntimeError(f"replica {r.index} did not start within {self.startup_timeout_s:.0f} s")

    async def _watch(self, r: Replica) -> None:
        """Restart ``r`` whenever it exits (its in-flight streams end with an error at the front), waiting
        longer after each restart that did not come up (0.5 s doubling to a minute)."""
        backoff = 0.5
        while not self.stopping:
            assert r.proc is not None
            rc = await r.proc.wait()
            r.healthy = False
            if self.stopping:
                return
            logger.error("replica %d exited with code %s: restarting it in %.1f s", r.index, rc, backoff)
            r.restarts += 1
            self.on_restart(r.index)
            await asyncio.sleep(backoff)
            try:
                await self._spawn(r)
                await self._until_healthy(r)
            except (RuntimeError, OSError) as e:
                logger.error("replica %d: %s", r.index, e)
                backoff = min(backoff * 2, 60.0)
                if r.proc is not None and r.proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        r.proc.kill()  # never came up: the loop waits for it and tries again
            else:
                backoff = 0.5
                logger.info("replica %d is serving again", r.index)

    async def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM every replica (a graceful stop), SIGKILL what is left after ``timeout_s``."""
        self.stopping = True
        for r in self.replicas:
            if r.watcher is not None:
                r.watcher.cancel()
            if r.proc is not None and r.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    r.proc.send_signal(signal.SIGTERM)
        procs = [r.proc for r in self.replicas if r.proc is not None]
        if procs:
            await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=timeout_s)
        for p in procs:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
        for p in procs:
            await p.wait()
        if self._session is not None:
            await self._session.close()
