"""AttentionMetadata: the flat batch's attention inputs (vLLM's names), built once per step by the runner.

The batch is sorted decodes first: requests ``0..num_decodes-1`` have exactly one query token. The j-th
query token of request i sits at position ``seq_lens[i] - q_len_i + j`` and attends causally to cache
positions ``0..position`` (its own K/V are stored before attention runs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class AttentionMetadata:
    num_reqs: int
    num_decodes: int  # the first num_decodes requests are decodes: 1 query token each, past the prompt
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], cumulative query lengths
    seq_lens: torch.Tensor  # int32 [num_reqs], tokens in the KV cache after this step
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks_per_req], physical block ids
    slot_mapping: torch.Tensor  # int64 [num_actual_tokens], slot of each new token
    query_start_loc_cpu: list[int]  # host copies used by CPU loops
    seq_lens_cpu: list[int]
    # Torch path only: decode grouping planned by the first layer of a step, reused by the others.
    decode_groups: list[Any] | None = None
    # Torch path only: windowed decodes' gather plan per window size, likewise built once a step.
    window_plans: dict[int, Any] | None = None
    # With several KV cache groups: each group's view of this batch (its block table and slot mapping),
    # by group index (this one is group 0's); None with one group.
    group_metadata: list[AttentionMetadata] | None = None

    def for_group(self, group: int) -> AttentionMetadata:
        return self if self.group_metadata is None else self.group_metadata[group]

    def add_group_views(self, views: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Groups 1.. see this batch through their own (block table, slot mapping); group 0 is this one."""
        others = [dataclasses.replace(self, block_table=t, slot_mapping=m) for t, m in views]
        if others:
            self.group_metadata = [self, *others]

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_table: torch.Tensor,
        block_size: int,
        num_decodes: int | None = None,
    ) -> AttentionMetadata:
        """Metadata from per-request lists (tests and simple callers; the runner builds its own).

        By default the leading run of 1-token queries counts as decodes (a 1-token chunk attends
        exactly like a decode); a 1-token query after it takes the per-request path.
        """
        assert len(query_lens) == len(seq_lens) == block_table.shape[0]
        assert all(0 < q <= s for q, s in zip(query_lens, seq_lens, strict=True))
        if num_decodes is None:
            num_decodes = 0
            while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
                num_decodes += 1
        assert all(q == 1 for q in query_lens[:num_decodes]), "decodes come first, one token each"
        starts = [0]
        slots: list[int] = []
        table = block_table.tolist()
        for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
            starts.append(starts[-1] + q_len)
            slots += [
                table[i][p // block_size] * block_size + p % block_size
                for p in range(seq_len - q_len, seq_len)
            ]
        device = block_table.device
        return cls(
            num_reqs=len(query_lens),
            num_decodes=num_decodes,
            num_actual_tokens=starts[-1],
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_table=block_table.to(torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc_cpu=starts,
            seq_lens_cpu=list(seq_lens),
        )
