"""KV-cache sizing on CUDA: what is left of ``gpu_memory_utilization`` after weights and a full-budget step.

The runner measures, after a warm-up forward at the full ``max_num_batched_tokens`` budget (plus the
logits and sampling temporaries of ``max_num_seqs`` rows): the GPU's total memory, what torch's
allocator peaked at (weights included), and what the process uses outside torch's allocator (the CUDA
context, cuBLAS workspaces, other processes). The arithmetic lives here, apart, so it is tested on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class MemoryProfile:
    total_bytes: int  # the device's memory
    peak_torch_bytes: int  # torch allocator's peak during the warm-up, without its temporary KV cache
    non_torch_bytes: int  # used on the device outside torch's allocator


def kv_cache_blocks(profile: MemoryProfile, gpu_memory_utilization: float, bytes_per_block: int) -> int:
    """``(total * utilization - non-torch - peak) // bytes_per_block``, never below 0."""
    assert 0.0 < gpu_memory_utilization <= 1.0 and bytes_per_block > 0
    budget = int(profile.total_bytes * gpu_memory_utilization) - profile.non_torch_bytes - profile.peak_torch_bytes
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
