"""Ray Serve's request router for engine replicas: a request goes to the replica whose prefix cache holds the
longest run of its prompt's blocks (the engine's own chained block hashes), unless the replicas' loads are
too far apart; then, and for a request no replica holds any of, power of two choices on queue length.

A replica's cached hashes come in its routing stats (`EngineReplica.record_routing_stats`, every
``request_routing_stats_period_s``). Between two reports, the blocks of each request this router sent are
taken as held by its replica for ``record_ttl_s``, as SGLang's router does, so that a conversation's next
turn follows it before the replica has said so.
"""

from __future__ import annotations

import random
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ray.serve.metrics import Counter
from ray.serve.request_router import (
    FIFOMixin,
    LocalityMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from aioengine.ray_serve.calls import HTTPCall

DECISIONS = ("prefix_hit", "miss", "load_fallback")
MAX_PENDING = 1 << 14


@dataclass(slots=True)
class Report:
    hashes: frozenset[int]
    load: int  # requests unfinished on the replica when it reported


@dataclass
class PrefixIndex:
    """Which replicas hold which block hashes: their own reports, and this router's choices since."""

    record_ttl_s: float = 30.0
    max_recorded: int = 1 << 18
    reports: dict[str, Report] = field(default_factory=dict)
    # hash -> {replica: when this router sent it a request holding it}, least recently sent first
    recorded: OrderedDict[int, dict[str, float]] = field(default_factory=OrderedDict)

    def report(self, replica: str, stats: dict[str, Any]) -> None:
        self.reports[replica] = Report(frozenset(stats.get("block_hashes", ())), int(stats.get("load", 0)))

    def record(self, replica: str, hashes: list[int], now: float) -> None:
        for h in hashes:
            holders = self.recorded.pop(h, {})
            holders[replica] = now
            self.recorded[h] = holders
        while len(self.recorded) > self.max_recorded:
            self.recorded.popitem(last=False)

    def matched(self, replica: str, hashes: list[int], now: float) -> int:
        """How many leading blocks of ``hashes`` the replica is taken to hold."""
        report = self.reports.get(replica)
        held = report.hashes if report is not None else frozenset()
        n = 0
        for h in hashes:
            sent = self.recorded.get(h, {}).get(replica)
            if h not in held and (sent is None or now - sent > self.record_ttl_s):
                break
            n += 1
        return n

    def forget(self, replica: str) -> None:
        self.reports.pop(replica, None)
        for holders in self.recorded.values():
            holders.pop(replica, None)


def choose(
    index: PrefixIndex,
    replicas: list[str],
    loads: dict[str, int],
    hashes: list[int],
    now: float,
    balance_abs: int = 4,
    balance_rel: float = 1.5,
) -> tuple[str, list[str]]:
    """(the decision, the replicas to try in order): the longest match first, or [] for power of two choices.
    Loads differing by more than both ``balance_abs`` and ``balance_rel`` times make it a load fallback
    (SGLang's rule)."""
    if not hashes or not replicas:
        return "miss", []
    lo, hi = min(loads.values(), default=0), max(loads.values(), default=0)
    if hi - lo > balance_abs and hi > balance_rel * lo:
        return "load_fallback", []
    matched = {r: index.matched(r, hashes, now) for r in replicas}
    best = max(replicas, key=lambda r: (matched[r], -loads.get(r, 0)))
    if matched[best] == 0:
        return "miss", []
    return "prefix_hit", [best]


# This process's routers, by (application, deployment): the ingress beside them reports their decisions.
ROUTERS: weakref.WeakValueDictionary[tuple[str, str], PrefixAwareRouter] = weakref.WeakValueDictionary()


class PrefixAwareRouter(FIFOMixin, LocalityMixin, RequestRouter):
    def initialize_state(
        self, balance_abs: int = 4, balance_rel: float = 1.5, record_ttl_s: float = 30.0, **_: Any
    ) -> None:
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.index = PrefixIndex(record_ttl_s)
        self.decisions = dict.fromkeys(DECISIONS, 0)
        self._seen_stats: dict[str, int] = {}  # replica -> id() of the stats dict last read
        # request -> (decision, hashes) until Serve says where it went; bounded, for requests cancelled before
        self._pending: OrderedDict[str, tuple[str, list[int]]] = OrderedDict()
        self._counter = Counter(
            "aioengine_router_decisions",
            description="Routing decisions of the prefix-aware router",
            tag_keys=("decision",),
        )
        if self._deployment_id is not None:
            ROUTERS[(self._deployment_id.app_name, self._deployment_id.name)] = self

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for gone in set(self.index.reports) - live:  # a replica that left: its cache went with it
            self.index.forget(gone)
            self._seen_stats.pop(gone, None)

    def _refresh(self, replicas: list[RunningReplica]) -> None:
        for r in replicas:
            stats = r.routing_stats
            key = r.replica_id.unique_id
            if stats and self._seen_stats.get(key) != id(stats):
                self._seen_stats[key] = id(stats)
                self.index.report(key, stats)

    def _load(self, r: RunningReplica) -> int:
        queue_len = self.replica_queue_len_cache.get(r.replica_id)
        if queue_len is not None:
            return queue_len
        report = self.index.reports.get(r.replica_id.unique_id)
        return report.load if report is not None else 0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        self._refresh(candidate_replicas)
        hashes = _hashes(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {k: self._load(r) for k, r in by_id.items()}
        decision, order = choose(
            self.index, list(by_id), loads, hashes, time.monotonic(), self.balance_abs, self.balance_rel
        )
        if pending_request is not None:
            self._pending[pending_request.metadata.internal_request_id] = (decision, hashes)
            while len(self._pending) > MAX_PENDING:
                self._pending.popitem(last=False)
        ranks = [[by_id[k] for k in order]] if order else []
        rest = [r for k, r in by_id.items() if k not in order]
        if rest:  # power of two choices: Serve takes the shorter queue of the two
            ranks.append(random.sample(rest, min(2, len(rest))))
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        decision, hashes = self._pending.pop(pending_request.metadata.internal_request_id, ("miss", []))
        self.decisions[decision] += 1
        self._counter.inc(tags={"decision": decision})
        if hashes:
            self.index.record(replica_id.unique_id, hashes, time.monotonic())

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id.unique_id)


def _hashes(pending_request: PendingRequest | None) -> list[int]:
    if pending_request is None:
        return []
    for arg in pending_request.args:
        if isinstance(arg, HTTPCall):
            return arg.block_hashes
    return []
