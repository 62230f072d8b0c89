"""The front's routing policy: the replica whose cached prefixes match a request longest, unless the
replicas' loads are too far apart (then the least loaded), as SGLang's cache-aware router does.

The front does no model work, so it knows prefixes by the request's text, not its tokens: the text a
prompt is built from (the model, system, messages or prompt fields, serialized in order) cut into chunks
of ``chunk`` characters and hashed as a chain. A replica that served a request is taken to hold its
chunks; a later request sharing the first k chunks scores k there. The map is bounded (least recently
used entries go first), so it forgets as the replicas' caches do.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

PREFIX_FIELDS = ("model", "system", "instructions", "messages", "input", "prompt")


def prefix_text(body: Any) -> str:
    """The part of a request body its prompt is built from, serialized so that a conversation's next turn
    extends the previous turn's text (JSON of each field, in PREFIX_FIELDS' order)."""
    if not isinstance(body, dict):
        return ""
    parts = []
    for key in PREFIX_FIELDS:
        if key in body:
            text = json.dumps(body[key], sort_keys=True, ensure_ascii=False)
            if key in ("messages", "input") and text.endswith("]"):
                text = text[:-1]  # a list that grows by appending: its opening stays a prefix
            parts.append(f"{key}:{text}")
    return "\n".join(parts)


@dataclass(slots=True)
class Decision:
    replica: int
    matched: int  # leading chunks the chosen replica was taken to hold
    reason: str  # "prefix_hit", "miss" (no replica held any chunk), "load_fallback"


class PrefixRouter:
    def __init__(
        self,
        num_replicas: int,
        chunk: int = 256,
        max_entries: int = 1 << 18,
        balance_abs: int = 4,
        balance_rel: float = 1.5,
        policy: str = "prefix",
    ) -> None:
        """``balance_abs``/``balance_rel``: loads (requests in flight) differing by more than both make the
        least loaded replica win; ``policy`` "round_robin" ignores prefixes (the baseline)."""
        assert num_replicas >= 1 and chunk >= 1 and policy in ("prefix", "round_robin")
        self.n, self.chunk, self.max_entries = num_replicas, chunk, max_entries
        self.balance_abs, self.balance_rel, self.policy = balance_abs, balance_rel, policy
        self.owners: OrderedDict[int, set[int]] = OrderedDict()  # chain hash -> replicas taken to hold it
        self.decisions = {"prefix_hit": 0, "miss": 0, "load_fallback": 0}
        self._next = 0

    def chain(self, text: str) -> list[int]:
        hashes, h = [], 0
        for i in range(0, len(text) - self.chunk + 1, self.chunk):
            h = hash((h, text[i : i + self.chunk]))
            hashes.append(h)
        return hashes

    def choose(self, text: str, loads: list[int], healthy: list[bool]) -> Decision:
        """The replica for a request of ``text`` (``loads``: requests in flight on each)."""
        live = [r for r in range(self.n) if healthy[r]]
        if not live:
            raise LookupError("no replica is serving")
        if self.policy == "round_robin":
            for _ in range(self.n):
                r, self._next = self._next, (self._next + 1) % self.n
                if healthy[r]:
                    return self._count(Decision(r, 0, "miss"))
        least = min(live, key=lambda r: (loads[r], r))
        lo, hi = loads[least], max(loads[r] for r in live)
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            return self._count(Decision(least, 0, "load_fallback"))
        matched = dict.fromkeys(live, 0)
        running = set(live)  # replicas that hold every chunk so far
        for h in self.chain(text):
            running &= self.owners.get(h, set())
            if not running:
                break
            for r in running:
                matched[r] += 1
        best = max(live, key=lambda r: (matched[r], -loads[r], -r))
        if matched[best] == 0:
            return self._count(Decision(least, 0, "miss"))
        return self._count(Decision(best, matched[best], "prefix_hit"))

    def record(self, text: str, replica: int) -> None:
        """``replica`` served ``text``: it holds the chunks now."""
        for h in self.chain(text):
            holders = self.owners.pop(h, set())
            holders.add(replica)
            self.owners[h] = holders
        while len(self.owners) > self.max_entries:
            self.owners.popitem(last=False)

    def forget(self, replica: int) -> None:
        """``replica`` restarted with an empty cache."""
        for holders in self.owners.values():
            holders.discard(replica)

    def _count(self, d: Decision) -> Decision:
        self.decisions[d.reason] += 1
        return d
