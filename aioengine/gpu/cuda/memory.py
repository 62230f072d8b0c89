"""KV-cache sizing on CUDA: what is left of ``gpu_memory_utilization`` after weights and a full-budget step.

The runner measures, after a warm-up forward at the full ``max_num_batched_tokens`` budget (plus the
logits and sampling temporaries of ``max_num_seqs`` rows): the GPU's total memory, what torch's
allocator peaked at (weights included), and what the process uses outside torch's allocator (the CUDA
context, cuBLAS workspaces, other processes). The arithmetic lives here, apart, so it is tested on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class MemoryProfile:
    total_bytes: int  # the device's memory
    peak_torch_bytes: int  # torch allocator's peak during the warm-up, without its temporary KV cache
    non_torch_bytes: int  # used on the device outside torch's allocator


def kv_cache_blocks(profile: MemoryProfile, gpu_memory_utilization: float, bytes_per_block: int) -> int:
    """``(total * utilization - non-torch - peak) // bytes_per_block``, never below 0."""
    assert 0.0 < gpu_memory_utilization <= 1.0 and bytes_per_block > 0
    budget = (
        int(profile.total_bytes * gpu_memory_utilization) - profile.non_torch_bytes - profile.peak_torch_bytes
    )
    return max(budget, 0) // bytes_per_block


def warmup_lengths(num_tokens: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    """Prompt lengths of the warm-up batch: ``num_tokens`` in all, each at most ``max_model_len``, and no
    more requests than ``max_num_seqs`` (the budget is then cut short)."""
    lens: list[int] = []
    left = num_tokens
    while left > 0 and len(lens) < max_num_seqs:
        lens.append(min(left, max_model_len))
        left -= lens[-1]
    return lens


def profile_memory(
    model: Any,
    allocate_kv_caches: Callable[[int], list[Any]],
    device: Any,
    block_size: int,
    lens: list[int],
    num_logit_rows: int,
) -> MemoryProfile:
    """Run prompts of ``lens`` through ``model`` (a throwaway KV cache just big enough, from
    ``allocate_kv_caches(num_blocks)``), then logits and sampling temporaries for ``num_logit_rows`` rows;
    measure the peak (CUDA only; blocks the caller)."""
    import torch

    from aioengine.kernels.metadata import AttentionMetadata

    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    blocks = [-(-n // block_size) for n in lens]
    with torch.inference_mode():
        kv_caches = allocate_kv_caches(sum(blocks) + 1)
        kv_bytes = sum(t.numel() * t.element_size() for t in kv_caches)
        table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
        first = 1  # block 0 is the null block
        for i, nb in enumerate(blocks):
            table[i, :nb] = torch.arange(first, first + nb, dtype=torch.int32)
            first += nb
        meta = AttentionMetadata.build(lens, lens, table.to(device), block_size)
        num_tokens = sum(lens)
        positions = torch.cat([torch.arange(n) for n in lens]).to(device)
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        hidden = model(input_ids, positions, kv_caches, meta)
        rows = torch.arange(num_logit_rows, device=device) % num_tokens
        probs = (
            model.compute_logits(hidden[rows]).float().softmax(-1)
        )  # the sampler's [rows, vocab] temporaries
        (probs / torch.rand_like(probs)).argmax(-1)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - kv_bytes
        del kv_caches, hidden, probs
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = total - free - torch.cuda.memory_reserved(device)
    return MemoryProfile(total_bytes=total, peak_torch_bytes=peak, non_torch_bytes=max(non_torch, 0))
