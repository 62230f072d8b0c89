"""CUDA graphs for uniform decode batches: bucket sizes, static input buffers, padding, capture, replay.

A batch of ``n`` decode rows replays the graph of the smallest captured size ``>= n``; the ``size - n``
padded rows get slot -1 (the KV store skips them), sequence length 1 and block 0 (the null block), and
their outputs are ignored. A verified query of 1 + k tokens (speculative decoding) reaches attention as
1 + k such rows, each with its own sequence length (model_runner.py), so steps of decodes and verified
drafts replay the same graphs; the sizes then reach ``max_num_seqs x (1 + k)``. Any other batch runs
eagerly. The Triton attention kernel's grid depends only on shapes and it reads lengths and
block tables from device tensors, so one capture serves every replay of its size.

Only the model's forward is captured; logits and sampling stay eager (they depend on per-request
sampling knobs). Graphs share one memory pool, captured largest first; a replayed graph's output is
read (by the logits gather, queued on the same stream) before the next replay can overwrite it.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import torch

from aioengine.kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = (
    512  # the tour's cap: min(max_num_seqs x 1 x 2, 512) on an H100 (--max-cudagraph-capture-size)
)


def capture_sizes(
    max_num_seqs: int, max_num_batched_tokens: int, cap: int = MAX_CAPTURE_SIZE, decode_query_len: int = 1
) -> list[int]:
    """1, 2, 4, then steps of 8 up to 256 and of 16 beyond, up to min(max_num_seqs x decode_query_len,
    token budget, cap), where decode_query_len is 1 + the speculative tokens a request verifies; that limit
    itself is always a size, so every decode batch up to it has a bucket."""
    assert decode_query_len >= 1
    limit = min(max_num_seqs * decode_query_len, max_num_batched_tokens, cap)
    if limit < 1:
        return []
    sizes = [s for s in (1, 2, 4, *range(8, 256, 8), *range(256, cap + 1, 16)) if s <= limit]
    if sizes[-1] != limit:
        sizes.append(limit)
    return sizes


def is_uniform_decode(meta: AttentionMetadata, num_input_tokens: int) -> bool:
    """Every attention row has exactly one query token: decodes and verified drafts (no prompt chunk, no
    padding)."""
    return meta.num_decodes == meta.num_reqs == meta.num_actual_tokens == num_input_tokens


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest of the (sorted) ``sizes`` that holds ``n`` rows, or None."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    """Static buffers for ``max_size`` decode rows and one captured graph per bucket size."""

    def __init__(
        self,
        model: Any,
        kv_caches: list[torch.Tensor],
        max_size: int,
        max_blocks_per_req: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_size = max_size
        groups = len(getattr(model, "kv_cache_groups", ())) or 1  # a block table and slots per KV group
        with torch.inference_mode(False):  # normal tensors: writable in and out of inference mode
            self.input_ids = torch.zeros(max_size, dtype=torch.int64, device=device)
            self.positions = torch.zeros(max_size, dtype=torch.int64, device=device)
            self.slot_mapping = torch.full((groups, max_size), -1, dtype=torch.int64, device=device)
            self.seq_lens = torch.ones(max_size, dtype=torch.int32, device=device)
            self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)
            self.block_table = torch.zeros(
                groups, max_size, max_blocks_per_req, dtype=torch.int32, device=device
            )
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self.sizes: list[int] = []  # captured, ascending
        self.num_replays = 0

    def metadata(self, size: int) -> AttentionMetadata:
        """Metadata over the static buffers: only device tensors and shape-derived host ints."""
        meta = AttentionMetadata(
            num_reqs=size,
            num_decodes=size,
            num_actual_tokens=size,
            max_query_len=1,
            max_seq_len=self.block_table.shape[-1],  # unused by the Triton path
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[0, :size],
            slot_mapping=self.slot_mapping[0, :size],
            query_start_loc_cpu=[],
            seq_lens_cpu=[],
        )
        meta.add_group_views(
            (table[:size], slots[:size])
            for table, slots in zip(self.block_table[1:], self.slot_mapping[1:], strict=True)
        )
        return meta

    def load(
        self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """Copy a decode batch of ``n = meta.num_reqs`` rows into the buffers and pad rows n..size-1."""
        n = meta.num_reqs
        width = meta.block_table.shape[1]
        assert n <= size <= self.max_size and width <= self.block_table.shape[-1]
        self.input_ids[:n].copy_(input_ids[:n], non_blocking=True)
        self.positions[:n].copy_(positions[:n], non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens[:n], non_blocking=True)
        for g in range(self.block_table.shape[0]):
            group = meta.for_group(g)
            self.slot_mapping[g, :n].copy_(group.slot_mapping[:n], non_blocking=True)
            self.block_table[g, :n, :width].copy_(group.block_table[:n], non_blocking=True)
        if size > n:  # padding rows: no KV write, attend to one slot of the null block
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[:, n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
            self.block_table[:, n:size, 0].zero_()

    def forward(self, size: int) -> torch.Tensor:
        """The model over the first ``size`` static rows (what a graph captures)."""
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self.metadata(size))

    def capture(self, sizes: list[int], time_limit_s: float) -> list[int]:
        """Capture a graph per size, largest first, until ``time_limit_s``; sizes not reached run eagerly."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.block_table.zero_()
        skipped: list[int] = []
        for size in sorted(sizes, reverse=True):
            if time.perf_counter() - t0 > time_limit_s:
                skipped.append(size)
                continue
            self.forward(size)  # warm-up outside the capture: compiles this shape's Triton kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(size)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()
        self.sizes = sorted(self.graphs)
        elapsed = time.perf_counter() - t0
        logger.info(
            "captured %d CUDA graphs for decode batches of %s rows in %.1f s (time limit %.0f s)",
            len(self.sizes),
            _ranges(self.sizes),
            elapsed,
            time_limit_s,
        )
        if skipped:
            logger.warning(
                "CUDA graph capture hit its time limit of %.0f s: batches of %s rows pad to a larger "
                "graph or run eagerly",
                time_limit_s,
                _ranges(sorted(skipped)),
            )
        return self.sizes

    def size_for(self, meta: AttentionMetadata, num_input_tokens: int) -> int | None:
        """The captured size a batch replays, or None when it runs eagerly (not a uniform decode, or larger
        than every graph)."""
        if not is_uniform_decode(meta, num_input_tokens):
            return None
        return bucket_for(meta.num_reqs, self.sizes)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """Hidden states ``[n, hidden]`` by replaying a graph, or None when this batch runs eagerly."""
        size = self.size_for(meta, input_ids.shape[0])
        return None if size is None else self.replay(size, input_ids, positions, meta)

    def replay(
        self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` from the graph of ``size`` (``size_for``'s answer for this batch)."""
        n = meta.num_reqs
        self.load(size, input_ids, positions, meta)
        graph, out = self.graphs[size]
        graph.replay()
        self.num_replays += 1
        return out[:n]


def _ranges(sizes: list[int]) -> str:
    if not sizes:
        return "no"
    return str(sizes[0]) if len(sizes) == 1 else f"{len(sizes)} sizes {sizes[0]}..{sizes[-1]}"
