"""A draft model for speculative decoding: its own KV cache behind the target's block tables, written by the
same tokens as the target's every step, and greedy proposals of up to k tokens after each sampled one."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from aioengine.gpu.backend import Backend
from aioengine.gpu.loader import kv_cache_bytes_per_block, load_model
from aioengine.gpu.states import RequestStates
from aioengine.kernels.metadata import AttentionMetadata
from aioengine.sched.kv_cache_spec import KVCacheGroup, group_size, layer_slots


class DraftModelError(ValueError):
    """The draft model cannot serve this target (another vocabulary or attention layout)."""


class Drafter:
    """Runs on the worker with the target's runner. Proposals are greedy (a one-hot q), so the target's
    sample-and-compare verification is the speculative-sampling rule exactly."""

    def __init__(
        self,
        path: str,
        backend: Backend,
        dtype: torch.dtype,
        max_model_len: int,
        target_config: Any,
        target_groups: tuple[KVCacheGroup, ...],
    ) -> None:
        self.model, self.hf_config = load_model(path, dtype=dtype, device=backend.device, ops=backend.ops)
        if self.hf_config.vocab_size != target_config.vocab_size:
            raise DraftModelError(
                f"the draft model {path!r} has a vocabulary of {self.hf_config.vocab_size} tokens, the "
                f"target {target_config.vocab_size}: a draft must share the target's vocabulary"
            )
        # The draft's layers read the target's block tables, group by group: the windows must line up.
        windows = [g.sliding_window for g in self.model.kv_cache_groups]
        if windows != [g.sliding_window for g in target_groups]:
            raise DraftModelError(
                f"the draft model {path!r} groups its layers' attention windows as {windows}, the target as "
                f"{[g.sliding_window for g in target_groups]}: they must match"
            )
        self.model.cover_positions(max_model_len)
        backend.prepare_model(self.model, None, path)
        self.backend = backend
        self.dtype = dtype
        self.kv_caches: list[torch.Tensor] = []

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return kv_cache_bytes_per_block(
            self.hf_config, block_size, self.dtype, group_size(self.model.kv_cache_groups)
        )

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        groups = self.model.kv_cache_groups
        tensors = self.backend.allocate_kv_caches(
            self.hf_config, num_blocks, block_size, self.dtype, group_size(groups)
        )
        self.kv_caches = [tensors[p] for _, p in layer_slots(groups, self.hf_config.num_hidden_layers)]

    def catch_up(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """The target's step through the draft: its KV then holds every token the target's does (rejected
        drafts' slots too, written again when the target writes them again)."""
        self.model(input_ids, positions, self.kv_caches, meta)

    def propose(
        self,
        states: RequestStates,
        rows: np.ndarray,
        positions: np.ndarray,
        num_drafts: np.ndarray,
        block_size: int,
    ) -> list[list[int]]:
        """Up to ``num_drafts[i]`` greedy tokens after the token request row ``rows[i]`` sampled last, which
        sits at ``positions[i]``. The KV slots of positions up to ``positions[i] + num_drafts[i] - 1`` are
        the request's (the scheduler reserved them)."""
        to_device = states.staging.to_device
        out: list[list[int]] = [[] for _ in rows]
        active = np.arange(len(rows))
        tokens = states.last_sampled_tokens[to_device(rows.astype(np.int64))]
        for j in range(int(num_drafts.max(initial=0))):
            keep = num_drafts[active] > j
            if not keep.all():
                tokens = tokens[to_device(np.flatnonzero(keep))]
                active = active[keep]
            if not active.size:
                break
            pos = positions[active] + j
            meta = _decode_metadata(states, rows[active], pos, block_size, to_device)
            hidden = self.model(tokens, to_device(pos), self.kv_caches, meta)
            greedy = self.model.compute_greedy(hidden)
            tokens = greedy if greedy is not None else self.model.compute_logits(hidden).argmax(-1)
            for i, t in zip(active.tolist(), tokens.tolist(), strict=True):
                out[i].append(t)
        return out


def _decode_metadata(
    states: RequestStates, rows: np.ndarray, positions: np.ndarray, block_size: int, to_device: Any
) -> AttentionMetadata:
    """One decode row per request: the token at ``positions`` attends to the KV up to itself."""
    n = len(rows)
    seq_lens = positions + 1
    tables = states.block_tables(rows, -(-int(seq_lens.max()) // block_size))
    slots = states.slot_mappings(rows, positions, block_size)
    cu = np.arange(n + 1, dtype=np.int32)
    meta = AttentionMetadata(
        num_reqs=n,
        num_decodes=n,
        num_actual_tokens=n,
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
        query_start_loc=to_device(cu),
        seq_lens=to_device(seq_lens.astype(np.int32)),
        block_table=to_device(tables[0]),
        slot_mapping=to_device(slots[0]),
        query_start_loc_cpu=cu.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
    )
    meta.add_group_views((to_device(t), to_device(m)) for t, m in zip(tables[1:], slots[1:], strict=True))
    return meta
