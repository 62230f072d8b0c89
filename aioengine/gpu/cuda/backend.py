"""CUDA backend: Triton kernels, pinned staging, memory-profiled KV sizing, decode graphs, awaited events."""

from __future__ import annotations

import datetime
import functools
import logging
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from aioengine.config import EngineArgs, KernelConfig
from aioengine.gpu.backend import Backend, Ops, RunnerParts
from aioengine.gpu.cuda.async_output import AsyncOutput, HostFunctions
from aioengine.gpu.cuda.graphs import MAX_CAPTURE_SIZE, DecodeGraphs, capture_sizes, is_uniform_decode
from aioengine.gpu.cuda.memory import kv_cache_blocks, profile_memory, warmup_lengths
from aioengine.gpu.cuda.staging import HostStaging
from aioengine.gpu.cuda.timeline import GpuTimeline
from aioengine.gpu.cuda.worker import CudaWorker
from aioengine.gpu.loader import kv_cache_shape
from aioengine.gpu.models.moe import Experts
from aioengine.kernels import reference, reference_moe
from aioengine.kernels.metadata import AttentionMetadata
from aioengine.sched.output import ModelRunnerOutput

logger = logging.getLogger(__name__)


@functools.cache
def _triton() -> SimpleNamespace:
    """The Triton kernels, imported once (and only by a CUDA engine)."""
    from aioengine.kernels.triton.activation import silu_and_mul_triton
    from aioengine.kernels.triton.attention import paged_attention_triton
    from aioengine.kernels.triton.kv_store import store_kv_triton
    from aioengine.kernels.triton.moe import fused_moe_triton
    from aioengine.kernels.triton.norm_rope import rms_norm_triton, rotary_triton

    return SimpleNamespace(
        rms_norm=rms_norm_triton,
        rotary=rotary_triton,
        silu_and_mul=silu_and_mul_triton,
        store_kv=store_kv_triton,
        attention=paged_attention_triton,
        fused_moe=fused_moe_triton,
    )


class CudaOps(Ops):
    """Every layer op as a Triton kernel."""

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return _triton().rms_norm(x, weight, eps, residual)

    def rotary(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _triton().rotary(positions, query, key, cos_sin_cache)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return _triton().silu_and_mul(x)

    def store_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        _triton().store_kv(key, value, kv_cache, slot_mapping)

    def fused_moe(
        self,
        x: torch.Tensor,
        experts: reference_moe.ExpertSet,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Plain SwiGLU experts stacked as floats: Triton's grouped GEMMs; others (gpt-oss's biased, clamped
        experts, a GGUF's codes) expert by expert."""
        w13, w2 = getattr(experts, "w13", None), getattr(experts, "w2", None)
        if type(experts) is Experts and w13 is not None and w2 is not None:
            return cast(torch.Tensor, _triton().fused_moe(x, w13.weight, w2.weight, topk_weights, topk_ids))
        return super().fused_moe(x, experts, topk_weights, topk_ids)

    def attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if sinks is not None:  # the Triton kernel has no sinks: torch's ops on the device
            return reference.paged_attention(query, kv_cache, meta, scale, window=window, sinks=sinks)
        return _triton().attention(query, kv_cache, meta, scale, window=window)


class CudaBackend(Backend):
    name = "cuda"
    kv_event_medium = "GPU"
    default_max_num_seqs = 1024
    default_max_num_batched_tokens = 8192

    def __init__(self, kernels: KernelConfig | None = None, device_index: int = 0) -> None:
        self.kernels = kernels or KernelConfig()
        self.device = torch.device("cuda", device_index)
        self.ops = CudaOps()
        self.graphs: DecodeGraphs | None = None
        self.timeline = GpuTimeline()  # CUDA events around each step: how long the GPU idled between them
        self._copy_stream: torch.cuda.Stream | None = None  # sampled tokens go to pinned memory on it
        self.host_functions = HostFunctions()  # wake the loop when a copy is done (or poll, once one is lost)

    ray_bundle = (("GPU", 1.0), ("CPU", 1.0))
    peer_dtype = "bfloat16"
    roofline_matmul_n = 8192  # big enough to fill the GPU

    def default_dtype(self) -> str:
        return "bfloat16"

    def check_tensor_parallel_size(self, size: int) -> None:
        visible = torch.cuda.device_count()
        if visible < size:
            raise ValueError(
                f"tensor_parallel_size {size} needs {size} GPUs on this node; {visible} are visible"
            )

    def make_process_group(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
        options: Any = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def make_worker(self) -> CudaWorker:
        return CudaWorker(self.device.index or 0)

    def make_staging(self) -> HostStaging:
        return HostStaging(self.device)

    def prepare_model(
        self,
        model: nn.Module,
        quantization: str | None,
        checkpoint: str | None = None,
        activations_apart: bool = False,
    ) -> None:
        if quantization is not None:
            raise ValueError(f"quantization={quantization!r} is a CPU option (its kernels are CPU kernels)")

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Pinned: the copies to and from it run as DMA."""
        with torch.inference_mode(False):
            return torch.empty(shape, dtype=dtype, pin_memory=True)

    def allocate_kv_caches(
        self,
        hf_config: Any,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        num_tensors: int | None = None,
    ) -> list[torch.Tensor]:
        """Zeroed: padded attention reads slots nobody wrote, and 0 * NaN = NaN."""
        shape = kv_cache_shape(hf_config, num_blocks, block_size)
        with torch.inference_mode(False):  # normal tensors: writable under inference_mode and no_grad alike
            n = num_tensors or hf_config.num_hidden_layers
            return [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(n)]

    def num_kv_blocks(
        self, runner: RunnerParts, args: EngineArgs, max_num_batched_tokens: int, max_num_seqs: int
    ) -> int:
        """With ``kv_cache_memory_bytes``: that budget. Else what ``gpu_memory_utilization`` leaves after a
        warm-up forward at the full token budget."""
        bytes_per_block = runner.kv_cache_bytes_per_block()
        if args.kv_cache_memory_bytes is not None:
            return args.kv_cache_memory_bytes // bytes_per_block
        lens = warmup_lengths(max_num_batched_tokens, runner.max_model_len, max_num_seqs)
        try:
            profile = profile_memory(
                runner.model,
                lambda n: self.allocate_kv_caches(runner.hf_config, n, runner.block_size, runner.dtype),
                self.device,
                runner.block_size,
                lens,
                max_num_seqs,
            )
        except torch.OutOfMemoryError as e:
            raise RuntimeError(
                f"the warm-up step ({max_num_batched_tokens} tokens, logits for {max_num_seqs} "
                "rows) does not fit in GPU memory next to the weights: lower "
                "--max-num-batched-tokens or --max-num-seqs"
            ) from e
        utilization = args.gpu_memory_utilization
        num_blocks = kv_cache_blocks(profile, utilization, bytes_per_block)
        gib = 1 << 30
        logger.info(
            "GPU memory: %.1f GiB total x %.2f, peak %.2f GiB (weights and a %d-token step), %.2f GiB "
            "outside torch: %d KV blocks (%.1f GiB)",
            profile.total_bytes / gib,
            utilization,
            profile.peak_torch_bytes / gib,
            sum(lens),
            profile.non_torch_bytes / gib,
            num_blocks,
            num_blocks * bytes_per_block / gib,
        )
        return num_blocks

    def build_fast_paths(self, runner: RunnerParts, args: EngineArgs, max_num_batched_tokens: int) -> None:
        if args.enforce_eager:
            return
        if getattr(runner.model, "has_experts", False):
            # the fused-MoE op here is the torch reference, whose per-expert loop reads the routing on the
            # host: it cannot be captured, so a mixture runs eagerly until the op has a kernel
            logger.warning("a mixture of experts: CUDA graphs are off (the fused-MoE op syncs with the host)")
            return
        spec = args.speculative()
        query_len = 1 + (spec.num_speculative_tokens if spec is not None else 0)
        self.capture_graphs(runner, max_num_batched_tokens, args.max_cudagraph_capture_size, query_len)

    def capture_graphs(
        self,
        runner: RunnerParts,
        max_num_batched_tokens: int,
        max_capture_size: int | None = None,
        decode_query_len: int = 1,
    ) -> list[int]:
        """Capture decode graphs at the bucket sizes (after the KV cache exists); returns the sizes.
        ``decode_query_len``: 1 + the drafts a verified request carries, whose rows replay the graphs too."""
        sizes = capture_sizes(
            runner.max_num_reqs,
            max_num_batched_tokens,
            max_capture_size or MAX_CAPTURE_SIZE,
            decode_query_len,
        )
        graphs = DecodeGraphs(
            runner.model, runner.kv_caches, sizes[-1], runner.max_blocks_per_req, self.device
        )
        try:
            with torch.inference_mode():
                graphs.capture(sizes, self.kernels.cuda_graph_capture_timeout_s)
        except Exception as e:
            raise RuntimeError(
                f"CUDA graph capture failed ({e!r}); --enforce-eager runs without graphs"
            ) from e
        self.graphs = graphs
        return graphs.sizes

    def forward(
        self, runner: RunnerParts, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """A uniform decode batch replays a graph; anything else runs eagerly."""
        num_tokens = input_ids.shape[0]
        graphs = self.graphs if not runner.lora_active else None  # a graph replay skips the LoRA hooks
        size = graphs.size_for(meta, num_tokens) if graphs is not None else None
        self.timeline.start(
            "decode_graph"
            if size is not None
            else "decode_eager"
            if is_uniform_decode(meta, num_tokens)
            else "mixed"
        )
        if size is not None:
            assert self.graphs is not None
            return self.graphs.replay(size, input_ids, positions, meta)
        return runner.model(input_ids, positions, runner.kv_caches, meta)

    def end_step(self) -> None:
        self.timeline.end()

    def finish_step(
        self, tensors: list[torch.Tensor], finish: Callable[..., ModelRunnerOutput]
    ) -> AsyncOutput:
        """Copy into pinned memory on the copy stream; an event (and a host function) marks the end."""
        self.timeline.end()
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        host = []
        with torch.cuda.stream(stream):
            for t in tensors:
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                t.record_stream(stream)  # the allocator must not reuse t before the copy ran
                host.append(h)
            event = torch.cuda.Event()
            event.record(stream)
        return AsyncOutput(event, self.host_functions.signal_after(stream), functools.partial(finish, *host))
