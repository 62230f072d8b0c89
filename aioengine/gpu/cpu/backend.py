"""The CPU backend: C kernels where they apply (else the torch references), packed weights, the decode stack.

Every choice comes from the engine's ``KernelConfig``, so two engines in one process may differ.
"""

from __future__ import annotations

import datetime
import functools
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from aioengine.config import EngineArgs, KernelConfig
from aioengine.gpu.backend import Backend, Ops, RunnerParts
from aioengine.gpu.cpu.coded_experts import FusedCodes, attach_coded_experts
from aioengine.gpu.cpu.codes_cache import checkpoint_codes
from aioengine.gpu.cpu.decode_stack import CpuDecodeStack
from aioengine.gpu.cpu.linear import pack_linears
from aioengine.gpu.cpu.openmp import release_thread_pool
from aioengine.gpu.cpu.q8_head import attach_q8_head
from aioengine.gpu.cpu.q8_linear import attach_q8_linears
from aioengine.gpu.cpu.quant import quantize_model
from aioengine.gpu.cpu.worker import CpuWorker
from aioengine.gpu.loader import kv_cache_shape
from aioengine.kernels import reference, reference_moe
from aioengine.kernels.cpu import clib, isa, q8
from aioengine.kernels.metadata import AttentionMetadata
from aioengine.sched.output import ModelRunnerOutput

DEFAULT_KV_CACHE_BYTES = 2 << 30


_NORM_DTYPES = (torch.bfloat16, torch.float32)  # the fused norm and rotary kernels' types


class CpuOps(Ops):
    """The layers' ops on the CPU: bf16 C kernels where ``KernelConfig`` allows them and the shapes fit."""

    def __init__(self, kernels: KernelConfig | None = None) -> None:
        kernels = kernels or KernelConfig()
        self.c_kernels = kernels.cpu_kernels
        self.elementwise = kernels.cpu_kernels and kernels.cpu_elementwise
        self.c_attention = kernels.cpu_kernels and kernels.cpu_attention
        self.c_prefill = self.c_attention and kernels.cpu_prefill_attention
        # Full-width rotary tables (cos|cos, -sin|sin) per cos_sin_cache, and the last step's gathered rows.
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._memo: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.elementwise and x.dim() == 2 and clib.elementwise_ok(x, _NORM_DTYPES):  # one fused pass
            if residual is None:
                return clib.add_rms_norm(None, x, weight, eps)[0]
            return clib.add_rms_norm(x, residual, weight, eps)
        return reference.add_rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        # float32 through the C loop the float32 decode stack runs, so both paths give the same bits
        if self.elementwise and x.dim() == 2 and clib.elementwise_ok(x, (torch.float32,)):
            return clib.silu_and_mul_f32(x)
        return reference.silu_and_mul(x)

    def gemma_rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # bf16 only: float32 Gemma keeps the torch reference, the parity tests' exact HF order
        if (
            self.elementwise
            and x.dim() in (2, 3)
            and (x.dim() == 2 or (residual is None and x.stride(1) == x.shape[2]))
            and clib.elementwise_ok(x)
        ):
            if residual is None:
                return clib.gemma_rms_norm(None, x, weight, eps)[0]
            return clib.gemma_rms_norm(x, residual, weight, eps)
        return reference.gemma_rms_norm(x, weight, eps, residual)

    def rope_tables(self, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos2, sin2)``: a rotation is then ``x * cos2 + roll(x) * sin2`` (4 ops for q and k together
        instead of 8 each; the same roundings as HF's rotate_half, so the same bits)."""
        entry = self._tables.get(id(cos_sin_cache))
        if entry is None or entry[0] is not cos_sin_cache:
            cos, sin = cos_sin_cache.chunk(2, dim=-1)
            entry = (cos_sin_cache, torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1))
            self._tables[id(cos_sin_cache)] = entry
        return entry[1], entry[2]

    def rotary(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_heads = query.shape[1]
        if _adjacent_heads(query, key):  # q and k heads of one fused qkv row: rotate them in one go
            both = query.as_strided(
                (query.shape[0], num_heads + key.shape[1], query.shape[2]), query.stride()
            )
            q, k = self.rotate(positions, both, cos_sin_cache).split([num_heads, key.shape[1]], dim=1)
            return q, k
        return self.rotate(positions, query, cos_sin_cache), self.rotate(positions, key, cos_sin_cache)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, H, D]`` (heads contiguous within a token) by ``positions``."""
        cos2, sin2 = self.rope_tables(cos_sin_cache)
        if (
            self.elementwise
            and cos2.dtype == x.dtype
            and x.stride(2) == 1
            and x.stride(1) == x.shape[2]
            and positions.dtype == torch.int64
            and positions.is_contiguous()
            and clib.elementwise_ok(x, _NORM_DTYPES)
        ):
            return clib.rotary(x, positions, cos2, sin2)  # one pass (bf16: the same roundings)
        memo = self._memo
        if (
            memo is not None and memo[0] is positions and memo[1] is cos2
        ):  # the layers of a step share one lookup
            rows_cos, rows_sin = memo[2], memo[3]
        else:
            rows_cos = cos2.index_select(0, positions).unsqueeze(1)
            rows_sin = sin2.index_select(0, positions).unsqueeze(1)
            self._memo = (positions, cos2, rows_cos, rows_sin)
        return x * rows_cos + x.roll(x.shape[2] // 2, -1) * rows_sin

    def store_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        num_tokens = slot_mapping.shape[0]
        if key.shape[0] != num_tokens:  # padded past num_tokens
            key, value = key[:num_tokens], value[:num_tokens]
        if self.c_attention and clib.store_ok(key, kv_cache):
            clib.store_kv(key, value, kv_cache, slot_mapping)
        else:
            reference.store_kv(key, value, kv_cache, slot_mapping)

    def attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if window is not None and meta.max_seq_len <= window:
            window = None  # within its window a windowed layer attends fully
        if sinks is not None:  # the C kernels have no sinks
            return reference.paged_attention(query, kv_cache, meta, scale, window=window, sinks=sinks)
        if not self.c_attention:
            return reference.paged_attention(query, kv_cache, meta, scale, window=window)
        pure_decode = meta.num_reqs == meta.num_decodes and query.shape[0] == meta.num_decodes
        if not pure_decode and self.c_prefill and clib.fast_prefill(query, kv_cache):
            return _c_mixed(query, kv_cache, meta, scale, window)
        if clib.supports(query, kv_cache) and clib.load() is not None:
            decodes = functools.partial(_c_decodes, window=window)
            return reference.paged_attention(query, kv_cache, meta, scale, decodes=decodes, window=window)
        return reference.paged_attention(query, kv_cache, meta, scale, window=window)

    def fused_moe(
        self,
        x: torch.Tensor,
        experts: reference_moe.ExpertSet,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """A GGUF's affine 4-bit experts in one C call (cpu_q4_f32.c's moe_q4f_f32), else expert by expert."""
        fused = getattr(experts, "fused", None)
        if isinstance(fused, FusedCodes) and x.dim() == 2:
            rows = x.to(torch.float32).contiguous()
            return q8.moe_q4f(rows, topk_ids, topk_weights, fused.tables, fused.intermediate).to(x.dtype)
        return super().fused_moe(x, experts, topk_weights, topk_ids)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Widening bf16 is exact (the same winner), and torch's CPU argmax is much faster on float32 than
        on bf16; the C kernel skips the widened copy altogether."""
        if logits.dtype == torch.float32:
            return logits.argmax(-1)
        if self.c_kernels and logits.dim() == 2 and clib.elementwise_ok(logits):  # bf16, unit inner stride
            return clib.argmax(logits)
        return logits.float().argmax(-1)


def _adjacent_heads(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether key's heads follow query's in memory with the same token stride (views of one qkv row)."""
    return (
        query.dtype == key.dtype
        and query.stride() == key.stride()
        and query.stride(2) == 1
        and query.stride(1) == query.shape[2] == key.shape[2]
        and query.shape[0] == key.shape[0]
        and key.data_ptr() == query.data_ptr() + query.shape[1] * query.shape[2] * query.element_size()
    )


def _c_decodes(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """The decode rows straight from the blocks: no gather, no padding (cpu_decode_attention.c)."""
    nd = meta.num_decodes
    return clib.decode_attention(query[:nd], kv_cache, meta.block_table, meta.seq_lens, scale, window)


def _c_mixed(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None
) -> torch.Tensor:
    """bf16 on AVX512-BF16: decodes through the decode kernel, every prompt chunk (one token or thousands)
    through the packed prefill kernel, whose per-row arithmetic ignores how the prompt was chunked: a
    prefix-cache hit gives the same bits as computing the prompt afresh."""
    n, starts, nd = meta.num_actual_tokens, meta.query_start_loc_cpu, meta.num_decodes
    output = torch.zeros_like(query) if query.shape[0] > n else torch.empty_like(query)
    if nd:
        output[:nd] = clib.decode_attention(
            query[:nd], kv_cache, meta.block_table[:nd], meta.seq_lens[:nd], scale, window
        )
    for i in range(nd, meta.num_reqs):
        output[starts[i] : starts[i + 1]] = clib.prefill_attention(
            query[starts[i] : starts[i + 1]],
            kv_cache,
            meta.block_table[i],
            meta.seq_lens_cpu[i],
            scale,
            window,
        )
    return output


class CpuStaging:
    """On the CPU a step's arrays are its tensors: ``torch.from_numpy`` shares their memory."""

    def begin_step(self) -> None:
        pass

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array))


class CpuBackend(Backend):
    ops: CpuOps
    name = "cpu"
    device = torch.device("cpu")
    default_max_num_seqs = 128
    default_max_num_batched_tokens = 512
    # Sorting the whole vocabulary for top-p costs a CPU more than the rest of a step's sampling together.
    sample_top_p_from_candidates = True
    grammar_check_argmax_first = True

    def __init__(self, kernels: KernelConfig | None = None, num_threads: int = 1) -> None:
        self.kernels = kernels or KernelConfig()
        self.num_threads = num_threads
        self.ops = CpuOps(self.kernels)
        self.decode_stack: CpuDecodeStack | None = None
        # The ISA level, chosen once: its defaults apply even without the C kernels. ValueError for a level
        # this CPU cannot run, or (a process runs one library) another than the one already loaded.
        requested = self.kernels.cpu_isa
        loaded = clib.loaded_level()
        self.cpu_isa = loaded if requested == "auto" and loaded else isa.resolve_level(requested)
        if self.kernels.cpu_kernels:  # gcc builds the C kernels (seconds when cold) while the model loads
            clib.check_level(requested)
            threading.Thread(
                target=clib.load, args=(requested,), name="aioengine-cpu-kernels", daemon=True
            ).start()

    def default_dtype(self) -> str:
        return "bfloat16" if isa.level_has_fast_bf16(self.cpu_isa) else "float32"

    def make_process_group(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    def make_shm_allreduce(self, store: Any, rank: int, size: int, slot_bytes: int, timeout_s: float) -> Any:
        from aioengine.gpu.cpu.shm_allreduce import ShmAllReduce

        return ShmAllReduce(store, rank, size, slot_bytes, timeout_s)

    def engine_started(self) -> None:
        # torch work on the starting thread (loading, a caller's own) left it an OpenMP pool that would
        # throttle the worker's (gpu/cpu/openmp.py)
        release_thread_pool()

    def make_worker(self) -> CpuWorker:
        return CpuWorker(self.num_threads)

    def make_staging(self) -> CpuStaging:
        return CpuStaging()

    def prepare_model(
        self,
        model: nn.Module,
        quantization: str | None,
        checkpoint: str | None = None,
        activations_apart: bool = False,
    ) -> None:
        linear = self.kernels.cpu_linear if self.kernels.cpu_kernels else _without_c(self.kernels.cpu_linear)
        if quantization is not None:
            quantize_model(model, quantization, linear=linear, c_kernels=self.kernels.cpu_kernels)
        pack_linears(model, linear, fuse_activations=not activations_apart)
        # A GGUF's Q8_0 head and the layers' block types (symmetric, Q4_1 and Q4_K), exact from the converted
        # float32 weights (a tensor-parallel rank's weights are slices of the file's: they keep the GEMM).
        k = self.kernels
        if checkpoint and quantization is None and k.cpu_kernels and self.ops.tp is None:
            with checkpoint_codes(checkpoint) as codes:  # opened once: the head and the linears
                if k.cpu_q8_head:
                    attach_q8_head(model, codes)
                if k.cpu_q8_linears:
                    attach_q8_linears(model, codes)
        if self.kernels.cpu_kernels:
            clib.load(self.kernels.cpu_isa)  # built now (seconds), not inside the first step
            attach_coded_experts(model)  # a GGUF mixture's experts: on their codes, in the kernels

    def allocate_kv_caches(
        self,
        hf_config: Any,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        num_tensors: int | None = None,
    ) -> list[torch.Tensor]:
        """Head-major memory (``[2, blocks, heads, block_size, D]``) behind the usual shape: a decode reads
        one KV head's rows of a block as one contiguous run, which DRAM serves faster than rows strided by
        the other heads. Zeroed: padded attention reads slots nobody wrote (0 * NaN = NaN)."""
        two, blocks, size, heads, dim = kv_cache_shape(hf_config, num_blocks, block_size)
        with torch.inference_mode(False):  # normal tensors: writable under inference_mode and no_grad alike
            return [
                torch.zeros((two, blocks, heads, size, dim), dtype=dtype).transpose(2, 3)
                for _ in range(num_tensors or hf_config.num_hidden_layers)
            ]

    def num_kv_blocks(
        self, runner: RunnerParts, args: EngineArgs, max_num_batched_tokens: int, max_num_seqs: int
    ) -> int:
        return (args.kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES) // runner.kv_cache_bytes_per_block()

    def build_fast_paths(self, runner: RunnerParts, args: EngineArgs, max_num_batched_tokens: int) -> None:
        k = self.kernels
        # The one-call stack runs every layer in C: a tensor-parallel rank's all-reduces sit between them.
        if (
            self.ops.tp is None
            and k.cpu_kernels
            and k.cpu_decode_stack
            and k.cpu_elementwise
            and k.cpu_attention
        ):
            self.decode_stack = CpuDecodeStack.build(
                runner.model, runner.kv_caches, self.ops.rope_tables, prefill_kernel=self.ops.c_prefill
            )

    def forward(
        self, runner: RunnerParts, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        coded = getattr(runner.model, "coded_steps", None)  # decoder linears on GGUF codes (q8_linear.py)
        if coded is not None:
            coded.decodes_only = meta.num_decodes == meta.num_reqs == input_ids.shape[0]
        stack = self.decode_stack
        # every layer in one C call, the same bits (not with LoRA rows: the stack skips the adapters' hooks)
        if stack is not None and not runner.lora_active and stack.takes(input_ids, meta):
            decoder: Any = runner.model.model  # a Llama-family or Gemma 3 decoder (checked when built)
            hidden, residual = stack.run(decoder.embed(input_ids), positions, meta)
            return decoder.norm(hidden, residual)[0]
        return runner.model(input_ids, positions, runner.kv_caches, meta)

    def finish_step(
        self, tensors: list[torch.Tensor], finish: Callable[..., ModelRunnerOutput]
    ) -> ModelRunnerOutput:
        return finish(*tensors)


def _without_c(linear: str) -> str:
    """Without the C kernels, "auto" means oneDNN's layout."""
    return "onednn" if linear == "auto" else linear
