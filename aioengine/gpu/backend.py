"""The one interface a device implements (CPU, CUDA): picked once per engine; nothing else tests the device.

A backend owns what differs by device: the worker, how a step's output is awaited (the worker's
``output``), the KV cache's layout and size, the op set the layers call (``Ops``), the fast paths (the
CPU's one-call decode stack, CUDA graphs) and how a step's inputs reach the device (``Staging``).
"""

from __future__ import annotations

import concurrent.futures
import datetime
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from aioengine.config import EngineArgs
from aioengine.kernels import reference, reference_lora, reference_moe
from aioengine.kernels.metadata import AttentionMetadata
from aioengine.sched.output import ModelRunnerOutput


class Ops:
    """The ops the model's layers call. This base runs the torch references; a backend overrides them."""

    tp: Any = None  # the rank's TPGroup under tensor parallelism (set once, at start), else None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel layer's partial output over the tensor-parallel ranks (one device: ``x``)."""
        return x if self.tp is None else self.tp.all_reduce(x)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``."""
        return reference.add_rms_norm(x, weight, eps, residual)

    def rotary(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query ``[T, Hq, D]`` and key ``[T, Hkv, D]`` (views of one fused qkv row may be given)."""
        return reference.rotary(positions, query, key, cos_sin_cache)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return reference.silu_and_mul(x)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return reference.gelu_tanh_and_mul(x)

    def gemma_rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x) * (1 + weight)`` (Gemma); with ``residual`` as rms_norm."""
        return reference.gemma_rms_norm(x, weight, eps, residual)

    def store_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
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
        """Causal paged attention; ``window``: a sliding-window layer's span (itself, window - 1 before);
        ``sinks``: each query head's sink logit (gpt-oss), in every softmax's denominator."""
        return reference.paged_attention(query, kv_cache, meta, scale, window=window, sinks=sinks)

    def add_lora(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        a_flat: torch.Tensor,
        b_flat: torch.Tensor,
        mask: torch.Tensor,
    ) -> None:
        """Each adapter's rows of ``out`` gain their LoRA delta, in place: the masked products of
        ``reference_lora.add_lora_masked`` (equal to its per-adapter ``add_lora``)."""
        reference_lora.add_lora_masked(out, x, a_flat, b_flat, mask)

    def fused_moe(
        self,
        x: torch.Tensor,
        experts: reference_moe.ExpertSet,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """The routed experts' MLP of tokens ``x`` ``[T, H]`` (see ``reference_moe``); under tensor
        parallelism the rank's part of each expert, summed by the caller's all-reduce."""
        return reference_moe.fused_moe_by_expert(x, experts, topk_weights, topk_ids)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax (int64; torch's: first maximum, NaN wins), for a plain greedy batch."""
        return logits.argmax(-1)


REFERENCE_OPS = Ops()


class Staging(Protocol):
    """How a step's host arrays reach the device."""

    def begin_step(self) -> None: ...

    def to_device(self, array: np.ndarray) -> torch.Tensor: ...


class Worker(Protocol):
    """Runs the runner's calls in submission order; ``output`` awaits what a step call returned."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future: ...

    async def output(self, fut: concurrent.futures.Future) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


class RunnerParts(Protocol):
    """What a backend reads of the model runner it serves."""

    @property
    def model(self) -> nn.Module: ...
    @property
    def hf_config(self) -> Any: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def block_size(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def max_num_reqs(self) -> int: ...
    @property
    def max_blocks_per_req(self) -> int: ...
    @property
    def kv_caches(self) -> list[torch.Tensor]: ...
    @property
    def lora_active(self) -> bool: ...

    def kv_cache_bytes_per_block(self) -> int: ...


class Backend(ABC):
    """One per engine. ``ops`` is handed to the model's layers when they are built."""

    name: str
    device: torch.device
    ops: Ops
    default_max_num_seqs: int
    default_max_num_batched_tokens: int
    # Sampler knobs that pay on one device and not the other (see Sampler).
    sample_top_p_from_candidates: bool = False
    grammar_check_argmax_first: bool = False
    timeline: Any = (
        None  # CUDA: a GpuTimeline of events around each step (the bench reports the GPU's idle time)
    )
    # Device questions asked outside the step: what one tensor-parallel rank reserves in a Ray placement
    # group, the dtype a peer engine (transformers) runs at here, and the matmul size that fills the device.
    ray_bundle: tuple[tuple[str, float], ...] = (("CPU", 1.0),)
    peer_dtype: str = "float32"
    roofline_matmul_n: int = 2048
    kv_event_medium: str = "CPU"  # where the KV blocks live, as vLLM's KV events name it ("GPU" on CUDA)

    def check_tensor_parallel_size(self, size: int) -> None:  # noqa: B027 (a hook: the CPU has no limit)
        """Raise ValueError when this node cannot hold ``size`` ranks of this device."""

    @abstractmethod
    def make_process_group(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
        """The process group the model's all-reduces run in (gloo on CPU, NCCL on CUDA)."""

    def make_shm_allreduce(self, store: Any, rank: int, size: int, slot_bytes: int, timeout_s: float) -> Any:
        """A same-node shared-memory all-reduce where the device has one (the CPU's), else None."""
        return None

    def synchronize(self) -> None:  # noqa: B027 (a hook: CPU work is done when the op returns)
        """Wait for the device's queued work (benchmarks time matmuls with it)."""

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host memory this device copies to and from at its best (the KV offload tier's slots)."""
        with torch.inference_mode(False):
            return torch.empty(shape, dtype=dtype)

    @abstractmethod
    def default_dtype(self) -> str:
        """The dtype "auto" means here."""

    @abstractmethod
    def make_worker(self) -> Worker: ...

    @abstractmethod
    def make_staging(self) -> Staging: ...

    @abstractmethod
    def prepare_model(
        self,
        model: nn.Module,
        quantization: str | None,
        checkpoint: str | None = None,
        activations_apart: bool = False,
    ) -> None:
        """After loading: quantize and repack the weights for this device's kernels. ``checkpoint``: the
        folder the weights came from, where a backend reads a form of them it runs faster;
        ``activations_apart``: no linear may fuse the gated activation (LoRA adds to gate_up before it)."""

    @abstractmethod
    def allocate_kv_caches(
        self,
        hf_config: Any,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        num_tensors: int | None = None,
    ) -> list[torch.Tensor]:
        """``num_tensors`` zeroed caches (the KV cache groups' shared tensors; default one per layer), in
        this device's layout behind the shape of ``kv_cache_shape``."""

    @abstractmethod
    def num_kv_blocks(
        self, runner: RunnerParts, args: EngineArgs, max_num_batched_tokens: int, max_num_seqs: int
    ) -> int:
        """How many KV blocks fit this device's budget (runs on the worker)."""

    @abstractmethod
    def build_fast_paths(self, runner: RunnerParts, args: EngineArgs, max_num_batched_tokens: int) -> None:
        """After the KV cache exists: the decode stack (CPU) or the captured decode graphs (CUDA)."""

    @abstractmethod
    def forward(
        self, runner: RunnerParts, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The step's hidden states, through a fast path where one applies."""

    @abstractmethod
    def finish_step(self, tensors: list[torch.Tensor], finish: Callable[..., ModelRunnerOutput]) -> Any:
        """``finish(*host copies of tensors)``, or an awaitable that gives it once the copy is done."""

    def end_step(self) -> None:  # noqa: B027 (a hook: most backends record nothing)
        """A step with nothing to sample ends here."""

    def engine_started(self) -> None:  # noqa: B027 (a hook: only the CPU has something to do)
        """Called on the thread that started the engine, once the engine is ready."""
