"""A local server's CPU per thread over a benchmark run, read from Linux's /proc: the event loop (the main
thread) against the worker and the kernels' threads, and the bench client's own, on the machine they share."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass


class ProcCpuError(RuntimeError):
    """The process cannot be read (not running, not ours, or not Linux)."""


def thread_cpu_s(pid: int) -> dict[int, float]:
    """User plus system CPU seconds of each live thread of ``pid``, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError as e:
        raise ProcCpuError(f"cannot read the threads of process {pid}: {e.strerror}") from None
    out: dict[int, float] = {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # the thread ended between the listing and the read
            continue
        # the name (field 2) is in parentheses and may hold spaces or ")": the fields after its last ")"
        fields = stat[stat.rindex(b")") + 2 :].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15)
    return out


@dataclass(slots=True)
class CpuSnapshot:
    threads: dict[int, float]
    client_s: float  # this process's own CPU (the bench client)

    @classmethod
    def take(cls, pid: int) -> CpuSnapshot:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return cls(thread_cpu_s(pid), ru.ru_utime + ru.ru_stime)


def cpu_split(pid: int, before: CpuSnapshot, after: CpuSnapshot, wall_s: float) -> dict:
    """What each thread of ``pid`` spent between the snapshots: the loop (the main thread, whose id is the
    pid) and the others, busiest first (a thread started in between counts from zero; one that ended is
    lost), with the client's CPU and the machine's CPU seconds in that wall time for scale."""
    spent = {tid: s - before.threads.get(tid, 0.0) for tid, s in after.threads.items()}
    others = sorted((s for tid, s in spent.items() if tid != pid), reverse=True)
    return {
        "pid": pid,
        "loop_s": spent.get(pid, 0.0),
        "other_threads_s": [round(s, 3) for s in others if s > 0],
        "server_s": sum(spent.values()),
        "client_s": after.client_s - before.client_s,
        "machine_s": wall_s * len(os.sched_getaffinity(pid)),  # what its CPUs could have given
    }
