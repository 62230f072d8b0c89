"""Waiting queues: first-come-first-served, or by (priority, arrival time)."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from aioengine.sched.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request) -> None:
        """A preempted request goes back to the front."""
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Lower priority value first, then earlier arrival. Removal is lazy (O(log n) amortised)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._removed: set[int] = set()
        self._live: dict[int, int] = {}  # id(request) -> entry seq
        self._seq = itertools.count()

    def add(self, request: Request) -> None:
        seq = next(self._seq)
        self._live[id(request)] = seq
        heapq.heappush(self._heap, (request.priority, request.arrival_time, seq, request))

    prepend = add  # order comes from (priority, arrival), so a preempted request finds its place

    def _clean(self) -> None:
        while self._heap and self._heap[0][2] in self._removed:
            self._removed.discard(heapq.heappop(self._heap)[2])

    def peek(self) -> Request:
        self._clean()
        return self._heap[0][3]

    def pop(self) -> Request:
        self._clean()
        request = heapq.heappop(self._heap)[3]
        del self._live[id(request)]
        return request

    def remove(self, request: Request) -> None:
        self._removed.add(self._live.pop(id(request)))

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap) if e[2] not in self._removed)


def create_request_queue(policy: str) -> FCFSQueue | PriorityQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}: expected 'fcfs' or 'priority'")
