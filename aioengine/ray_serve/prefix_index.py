"""Where a request's prompt blocks are taken to be held, and the routing rule over it: the part of the
prefix-aware router that does not touch Ray (ray_serve/router.py wraps it in Serve's RequestRouter).

A replica's report (its cached block hashes) replaces the last one; between two reports, the blocks of each
request the router sent are taken as held by its replica for ``record_ttl_s``, as SGLang's router does, so
that a conversation's next turn follows it before the replica has said so.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

DECISIONS = ("prefix_hit", "miss", "load_fallback")
# The router's settings and their defaults (RayServeConfig.router_kwargs): choose() and PrefixIndex say what
# each does.
# balance_abs 16, not the local front's 4: an engine batches its requests, and at 4 a third of a 16-client
# multi-turn run fell back to load (docs/benchmarks.md, "Data parallelism").
ROUTER_SETTINGS = {"balance_abs": 16, "balance_rel": 1.5, "min_match": 0.5, "record_ttl_s": 30.0}


def router_settings(kwargs: dict[str, Any]) -> dict[str, float]:
    """The defaults with ``kwargs`` over them; ValueError names a setting there is not."""
    unknown = sorted(set(kwargs) - set(ROUTER_SETTINGS))
    if unknown:
        raise ValueError(f"unknown router_kwargs {unknown}; known: {sorted(ROUTER_SETTINGS)}")
    return {k: float(kwargs.get(k, v)) for k, v in ROUTER_SETTINGS.items()}


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
    num_recorded: dict[str, int] = field(default_factory=dict)  # replica -> hashes recorded for it

    def report(self, replica: str, stats: dict[str, Any]) -> None:
        self.reports[replica] = Report(frozenset(stats.get("block_hashes", ())), int(stats.get("load", 0)))

    def record(self, replica: str, hashes: list[int], now: float) -> None:
        for h in hashes:
            holders = self.recorded.pop(h, {})
            if replica not in holders:
                self.num_recorded[replica] = self.num_recorded.get(replica, 0) + 1
            holders[replica] = now
            self.recorded[h] = holders
        while len(self.recorded) > self.max_recorded:
            for r in self.recorded.popitem(last=False)[1]:
                self.num_recorded[r] -= 1

    def held(self, replica: str) -> int:
        """About how many blocks the replica holds: its report's, and those recorded for it since."""
        report = self.reports.get(replica)
        return (len(report.hashes) if report is not None else 0) + self.num_recorded.get(replica, 0)

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
        self.num_recorded.pop(replica, None)
        for holders in self.recorded.values():
            holders.pop(replica, None)


def choose(
    index: PrefixIndex,
    replicas: list[str],
    loads: dict[str, int],
    hashes: list[int],
    now: float,
    balance_abs: float = 16,
    balance_rel: float = 1.5,
    min_match: float = 0.5,
) -> tuple[str, list[str]]:
    """(the decision, the replica to try first, or [] for power of two choices on queue length), SGLang's
    cache-aware rules:
    - loads more than ``balance_abs`` apart and more than ``balance_rel`` times apart: a load fallback, [];
    - the replica holding the longest leading run of the prompt's blocks, if that is at least ``min_match``
      of them (the template's opening block, which every chat shares, must not pull every conversation to
      one replica): a prefix hit;
    - else a miss, sent to the least loaded replica holding the fewest blocks, which spreads new prompts
      over the replicas' caches.
    ``hashes`` empty (nothing to score): a miss, []."""
    if not hashes or not replicas:
        return "miss", []
    lo, hi = min(loads.values(), default=0), max(loads.values(), default=0)
    if hi - lo > balance_abs and hi > balance_rel * lo:
        return "load_fallback", []
    matched = {r: index.matched(r, hashes, now) for r in replicas}
    best = max(replicas, key=lambda r: (matched[r], -loads.get(r, 0)))
    if matched[best] == 0 or matched[best] < min_match * len(hashes):
        return "miss", [min(replicas, key=lambda r: (loads.get(r, 0), index.held(r), r))]
    return "prefix_hit", [best]


# This process's routers, by (application, deployment): the ingress beside them reports their decisions.
# Here, not in router.py: Serve pickles the router's module by value, and a weak dictionary cannot be.
# (Any: the router imports this module.)
ROUTERS: weakref.WeakValueDictionary[tuple[str, str], Any] = weakref.WeakValueDictionary()
