"""Embedding requests in the runner: their hidden states pooled across prompt chunks into one unit vector.

The model's forward gives every scheduled token's final (normed) hidden state; a request's prompt may come
in several chunks, so mean pooling keeps a running float32 sum and CLS pooling the first token's state
until the chunk that completes the prompt (aioengine/model/pooling.py has the types).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(slots=True)
class _Pooled:
    kind: str  # "last" | "mean" | "cls"
    acc: torch.Tensor | None = None  # mean: the running sum; cls: the first token's state
    count: int = 0


class Pooler:
    """The runner's embedding requests, by id, and their partial pools."""

    def __init__(self) -> None:
        self.live: dict[str, _Pooled] = {}

    def add(self, req_id: str, kind: str) -> None:
        assert kind in ("last", "mean", "cls"), kind
        self.live[req_id] = _Pooled(kind)  # (a preempted request starts over: it recomputes from 0)

    def remove(self, req_id: str) -> None:
        self.live.pop(req_id, None)

    def is_pooling(self, req_ids: list[str]) -> np.ndarray:
        """Which of ``req_ids`` are embedding requests (they sample nothing)."""
        live = self.live
        return np.fromiter((r in live for r in req_ids), dtype=bool, count=len(req_ids))

    def step(
        self,
        req_ids: list[str],
        query_start_loc: list[int],
        seq_lens: list[int],
        prompt_lens: np.ndarray,
        hidden: torch.Tensor,
    ) -> dict[str, Any]:
        """Fold one step's hidden states ``[T, H]`` into the pools; the normalized float32 vector (numpy)
        of each request whose prompt this step completes."""
        out: dict[str, Any] = {}
        for i, rid in enumerate(req_ids):
            p = self.live.get(rid)
            if p is None:
                continue
            lo, hi = query_start_loc[i], query_start_loc[i + 1]
            if p.kind == "mean":
                part = hidden[lo:hi].float().sum(0)
                p.acc = part if p.acc is None else p.acc + part
                p.count += hi - lo
            elif p.kind == "cls" and seq_lens[i] - (hi - lo) == 0:
                p.acc = hidden[lo].float().clone()
            if seq_lens[i] < prompt_lens[i]:
                continue
            if p.kind == "last":
                vector = hidden[hi - 1].float()
            else:
                assert p.acc is not None, "mean and CLS pools see the prompt from its first token"
                vector = p.acc / p.count if p.kind == "mean" else p.acc
            out[rid] = F.normalize(vector, dim=0).cpu().numpy()
            del self.live[rid]
        return out
