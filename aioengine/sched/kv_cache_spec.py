"""KV cache groups: the model's layers grouped by attention type, each group with its own block table.

Blocks come from one pool. A block id addresses one slot in each of ``group_size`` per-position cache
tensors: layer ``layers[p]`` of every group uses tensor ``p``. So groups hold at most ``group_size`` layers
(vLLM's hybrid allocator): a model with one attention type is one group of all its layers (today's
layout), and Gemma 3's 15 sliding and 3 full layers become six groups of three.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    layers: tuple[int, ...]  # model layer indices; layer layers[p] uses cache tensor p
    sliding_window: int | None  # None: full attention

    def blocks_needed_from(self, num_computed_tokens: int, block_size: int) -> int:
        """The first block the next token still attends to: earlier ones hold only positions outside the
        window of every token computed from here on (0 for full attention)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // block_size


def kv_cache_groups(windows: list[int | None]) -> tuple[KVCacheGroup, ...]:
    """Group layers by window (``windows[l]``: layer l's, None for full attention), full groups first; each
    type's layers are cut into groups of the smallest type's size."""
    assert windows, "a model has layers"
    by_type: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_type.setdefault(window, []).append(layer)
    size = min(len(v) for v in by_type.values())
    groups = []
    for window in sorted(by_type, key=lambda w: (w is not None, w or 0)):
        layers = by_type[window]
        groups += [KVCacheGroup(tuple(layers[i : i + size]), window) for i in range(0, len(layers), size)]
    return tuple(groups)


def group_size(groups: tuple[KVCacheGroup, ...]) -> int:
    """How many cache tensors the groups share (a block id costs one slot in each)."""
    return max(len(g.layers) for g in groups)


def layer_slots(groups: tuple[KVCacheGroup, ...], num_layers: int) -> list[tuple[int, int]]:
    """(group, tensor) of each layer."""
    out: list[tuple[int, int] | None] = [None] * num_layers
    for g, group in enumerate(groups):
        for p, layer in enumerate(group.layers):
            out[layer] = (g, p)
    assert all(s is not None for s in out), "every layer belongs to a group"
    return [s for s in out if s is not None]


def window_blocks_bound(group: KVCacheGroup, block_size: int, max_num_batched_tokens: int) -> int | None:
    """The most blocks one request holds in a windowed group: the window behind the first token a step
    computes, plus that step's tokens, plus one block for the window's ragged start (None: full)."""
    if group.sliding_window is None:
        return None
    return -(-(group.sliding_window - 1 + max_num_batched_tokens) // block_size) + 1


def capacity_tokens(
    groups: tuple[KVCacheGroup, ...],
    num_usable_blocks: int,
    block_size: int,
    max_num_batched_tokens: int,
    max_model_len: int,
) -> int:
    """The longest request (in whole blocks of tokens, at most max_model_len) the pool can ever hold
    alone: k blocks of tokens take k blocks in a full group and at most min(k, bound) in a windowed one."""
    bounds = [window_blocks_bound(g, block_size, max_num_batched_tokens) for g in groups]

    def need(k: int) -> int:
        return sum(k if b is None else min(k, b) for b in bounds)

    max_blocks = -(-max_model_len // block_size)
    if need(max_blocks) <= num_usable_blocks:
        return max_model_len
    lo, hi = 0, max_blocks  # need(lo) fits, need(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(mid) <= num_usable_blocks else (lo, mid)
    return lo * block_size
