"""The prefix cache's changes as events (vLLM's BlockStored, BlockRemoved, AllBlocksCleared), recorded by
the block pool when KV events are on and taken once a step for the engine's publisher."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class BlockStored:
    """Blocks published under their chained hashes, in chain order: ``parent_block_hash`` is the hash of
    the block before the first (None at a prompt's start); ``token_ids`` are theirs, block after block."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    group_idx: int


@dataclass(slots=True)
class BlockRemoved:
    """Blocks evicted: their hashes no longer name cached KV."""

    block_hashes: list[int]
    group_idx: int


@dataclass(slots=True)
class AllBlocksCleared:
    """The prefix cache was reset: no hash names cached KV any more."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
