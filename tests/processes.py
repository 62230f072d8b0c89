"""Servers started as a user starts them (``python -m aioengine serve ...``), read through their log and
/proc: the port their ready line names, their children, and whether a process still runs."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time


def wait_for_port(proc: subprocess.Popen, pattern: str, timeout_s: float, lines: list[str]) -> int | None:
    """Read ``proc``'s stderr (each line kept in ``lines``) until one matches ``pattern``, whose first group
    is the port; None when the stream ends or ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            return None
        lines.append(line)
        m = re.search(pattern, line)
        if m:
            return int(m.group(1))
    return None


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children of each of its threads, and theirs)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(FileNotFoundError):
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(x) for x in f.read().split()]
                out += kids
                todo += kids
    return out
