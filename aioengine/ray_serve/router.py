"""Ray Serve's request router for engine replicas: a request goes to the replica whose prefix cache holds the
longest run of its prompt's blocks (the engine's own chained block hashes), unless the replicas' loads are
too far apart: then power of two choices on queue length (prefix_index.choose has the rules).

A replica's cached hashes come in its routing stats (`EngineReplica.record_routing_stats`, every
``request_routing_stats_period_s``); ray_serve/prefix_index.py keeps them and decides. Serve pickles this
module by value into each process that holds a handle to the replicas.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from typing import Any

from ray.serve.metrics import Counter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from aioengine.ray_serve import prefix_index  # a module travels by name; its ROUTERS could not by value
from aioengine.ray_serve.calls import HTTPCall
from aioengine.ray_serve.prefix_index import DECISIONS, PrefixIndex, choose, router_settings

MAX_PENDING = 1 << 14


# No FIFOMixin: it hands the replica chosen for one request to the oldest pending one, whose prompt differs.
class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        """The rule's settings (RayServeConfig.router_kwargs; prefix_index.choose says what they do)."""
        settings = router_settings(kwargs)
        self.balance_abs, self.balance_rel = settings["balance_abs"], settings["balance_rel"]
        self.min_match = settings["min_match"]
        self.index = PrefixIndex(settings["record_ttl_s"])
        self.decisions = dict.fromkeys(DECISIONS, 0)
        # replica -> the stats dict last read (held, so that a new report is never taken for it by its id)
        self._seen_stats: dict[str, dict[str, Any]] = {}
        # request -> (decision, the replica chosen) until Serve says where it went; bounded, for requests
        # cancelled before
        self._pending: OrderedDict[str, tuple[str, str | None]] = OrderedDict()
        self._counter = Counter(
            "aioengine_router_decisions",
            description="Routing decisions of the prefix-aware router",
            tag_keys=("decision",),
        )
        if self._deployment_id is not None:
            prefix_index.ROUTERS[(self._deployment_id.app_name, self._deployment_id.name)] = self

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
            if stats and self._seen_stats.get(key) is not stats:
                self._seen_stats[key] = stats
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
            self.index,
            list(by_id),
            loads,
            hashes,
            time.monotonic(),
            self.balance_abs,
            self.balance_rel,
            self.min_match,
        )
        if pending_request is not None and hashes:  # a prompt of a block or more: counted once routed
            self._pending[pending_request.metadata.internal_request_id] = (
                decision,
                order[0] if order else None,
            )
            while len(self._pending) > MAX_PENDING:
                self._pending.popitem(last=False)
        ranks = [[by_id[k] for k in order]] if order else []
        rest = [r for k, r in by_id.items() if k not in order]
        if rest:  # power of two choices: Serve takes the shorter queue of the two (or of the first's refusal)
            ranks.append(random.sample(rest, min(2, len(rest))))
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        entry = self._pending.pop(pending_request.metadata.internal_request_id, None)
        if entry is None:
            return
        decision, chosen = entry
        if decision == "prefix_hit" and replica_id.unique_id != chosen:
            decision = "load_fallback"  # the replica holding the prefix refused it: its queue was full
        self.decisions[decision] += 1
        self._counter.inc(tags={"decision": decision})
        self.index.record(replica_id.unique_id, _hashes(pending_request), time.monotonic())

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._pending.pop(internal_request_id, None)

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
