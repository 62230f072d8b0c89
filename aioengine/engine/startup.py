"""How an AsyncEngine starts, step by named step: resolve the checkpoint, the config and device defaults, load
the model and tokenizer, size the KV cache, allocate it and capture the fast paths, then the scheduler."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aioengine.config import EngineArgs, EngineConfig, resolve_max_model_len
from aioengine.model.checkpoint import generation_defaults, load_engine_tokenizer
from aioengine.model.source import ModelSource, resolve_source
from aioengine.sampling_params import SamplingParams
from aioengine.sched.kv_cache_spec import capacity_tokens
from aioengine.sched.scheduler import Scheduler, SchedulerConfig

if TYPE_CHECKING:  # importing these imports torch: start() does, lazily
    from aioengine.engine.kv_disk import KVDiskTier
    from aioengine.executor import Executor
    from aioengine.gpu.backend import Backend
    from aioengine.gpu.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Started:
    """What start-up built; the engine holds it for its lifetime."""

    backend: Backend
    executor: Executor  # rank 0's worker, and the other ranks under tensor parallelism
    runner: ModelRunner
    tokenizer: Any
    model_path: str
    model_name: str
    config: EngineConfig
    vocab_size: int
    eos_token_id: int | None
    default_sampling_params: dict
    num_blocks: int
    kv_capacity_tokens: int
    scheduler: Scheduler
    kv_disk: KVDiskTier | None  # the offload tier's block files (--kv-offload-dir)
    structured_build: concurrent.futures.Future  # the StructuredOutputManager, built on a thread


async def start(args: EngineArgs, new_structured_manager: Callable[[Any, int, int | None], Any]) -> Started:
    """Every start-up step in order; the executor (its worker, its ranks) is shut down again when one fails.

    ``new_structured_manager(tokenizer, vocab_size, eos_token_id)`` builds xgrammar's tables (on a thread).
    """
    from aioengine.executor import make_executor
    from aioengine.gpu.backends import make_backend

    backend = make_backend(args)  # the one choice of device (the CPU's kernels build now)
    source = await resolve_model(args)
    model_path, model_name, cfg_probe = source.path, source.name, source.config
    config = resolve_config(args, backend, cfg_probe)
    executor = await make_executor(args, backend)  # TP > 1: the other ranks start and join here
    try:
        runner, tokenizer = await load(args, executor, config, model_path, cfg_probe)
        eos = cfg_probe["eos_token_id"]
        if eos is None:
            eos = tokenizer.eos_token_id
        defaults = generation_defaults(args.generation_config, cfg_probe["generation_config"])
        SamplingParams(**defaults)  # a bad value in the file stops the start, not each request
        if defaults:
            logger.info("default sampling parameters from the generation config: %s", defaults)
        # xgrammar's tokenizer tables (CPU-heavy, GIL released) build on a thread while the KV cache is set
        # up; the engine waits for them before its first step: built after it, they took the cores from it.
        builder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aioengine-grammar")
        structured_build = builder.submit(new_structured_manager, tokenizer, cfg_probe["vocab_size"], eos)
        builder.shutdown(wait=False)
        num_blocks = await size_kv_cache(args, backend, executor, runner, config)
        capacity, scheduler, kv_disk = await initialize_kv_cache(
            args, backend, executor, runner, config, num_blocks, model_path
        )
        with contextlib.suppress(Exception):  # a failure (no xgrammar) is raised per structured request
            await asyncio.wrap_future(structured_build)
    except BaseException:
        await asyncio.get_running_loop().run_in_executor(None, executor.shutdown)
        raise
    return Started(
        backend,
        executor,
        runner,
        tokenizer,
        model_path,
        model_name,
        config,
        cfg_probe["vocab_size"],
        eos,
        defaults,
        num_blocks,
        capacity,
        scheduler,
        kv_disk,
        structured_build,
    )


async def resolve_model(args: EngineArgs) -> ModelSource:
    """The checkpoint (the default model is converted once), the name it is served under, its config."""
    loop = asyncio.get_running_loop()
    source = await loop.run_in_executor(None, resolve_source, args)
    # transformers' lazy module is not safe to import from two threads at once: import it once here,
    # before the tokenizer thread and the model loader race for it.
    await loop.run_in_executor(None, _import_heavy_modules)
    return source


def resolve_config(args: EngineArgs, backend: Backend, cfg_probe: dict[str, Any]) -> EngineConfig:
    """EngineArgs, the checkpoint's limits and the backend's defaults -> the engine's sizes."""
    return EngineConfig(
        device=backend.name,
        dtype=args.dtype if args.dtype != "auto" else backend.default_dtype(),
        max_model_len=resolve_max_model_len(args.max_model_len, cfg_probe["max_position_embeddings"]),
        max_num_seqs=args.max_num_seqs or backend.default_max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens or backend.default_max_num_batched_tokens,
    )


async def load(
    args: EngineArgs,
    executor: Executor,
    config: EngineConfig,
    model_path: str,
    cfg_probe: dict[str, Any],
) -> tuple[ModelRunner, Any]:
    """The model on every rank, and the tokenizer loaded beside it on a thread."""
    import torch

    from aioengine.model.files import ModelNotFoundError

    spec = args.speculative()
    draft_path = None
    if spec is not None and spec.model is not None:  # a name, a GGUF or a folder, as the model's
        try:
            draft = await resolve_model(dataclasses.replace(args, model=spec.model, served_model_name=None))
        except ModelNotFoundError as e:
            raise ModelNotFoundError(f"speculative_config model: {e}") from None
        draft_path = draft.path
    loop = asyncio.get_running_loop()
    tokenizer_fut = loop.run_in_executor(
        None, load_engine_tokenizer, args, model_path, cfg_probe["vocab_size"]
    )
    try:
        runner = await asyncio.wrap_future(
            executor.collective_rpc(
                "load",
                model_path,
                getattr(torch, config.dtype),
                config.max_num_seqs,
                config.max_model_len,
                args.block_size,
                args.seed,
                args.quantization,
                draft_path,
                (list(args.lora_modules.items()), args.max_loras, args.max_lora_rank)
                if args.enable_lora
                else None,
            )
        )
    except BaseException:
        # The model's error is the one raised: the tokenizer thread finishes first (nothing keeps loading
        # behind a failed start) and its own error, if any, is retrieved, not left to the loop's logger.
        await asyncio.wait([tokenizer_fut])
        if not tokenizer_fut.cancelled():
            tokenizer_fut.exception()
        raise
    return runner, await tokenizer_fut


async def size_kv_cache(
    args: EngineArgs, backend: Backend, executor: Executor, runner: ModelRunner, config: EngineConfig
) -> int:
    """KV blocks: ``num_kv_blocks``, else what the backend's budget holds, never more than every sequence
    at full length needs."""
    if args.num_kv_blocks is not None:
        num_blocks = args.num_kv_blocks
    else:
        fits = await asyncio.wrap_future(
            executor.submit(  # rank 0's budget: every rank holds the same share of the heads, or more
                backend.num_kv_blocks, runner, args, config.max_num_batched_tokens, config.max_num_seqs
            )
        )
        per_seq = -(-config.max_model_len // args.block_size) * len(runner.kv_cache_groups)
        num_blocks = min(fits, config.max_num_seqs * per_seq + 1)
    if num_blocks < 2:
        raise ValueError(f"the KV cache budget fits {num_blocks} blocks; at least 2 are needed")
    return num_blocks


async def initialize_kv_cache(
    args: EngineArgs,
    backend: Backend,
    executor: Executor,
    runner: ModelRunner,
    config: EngineConfig,
    num_blocks: int,
    model_path: str,
) -> tuple[int, Scheduler, KVDiskTier | None]:
    """Allocate the cache and the backend's fast paths over it (CUDA graphs are captured here), the offload
    tier's host slots and files; then the scheduler that hands the blocks out. Returns the tokens the cache
    holds, the scheduler and the disk tier."""
    await asyncio.wrap_future(executor.collective_rpc("initialize_kv_cache", num_blocks))
    await asyncio.wrap_future(
        executor.collective_rpc("build_fast_paths", args, config.max_num_batched_tokens)
    )
    offload_slots, kv_disk, disk_index, disk_blocks = 0, None, None, 0
    if args.kv_offload_size:
        offload_slots, kv_disk, disk_index, disk_blocks = await initialize_kv_offload(
            args, backend, executor, runner, config, model_path
        )
    capacity = capacity_tokens(
        runner.kv_cache_groups,
        num_blocks - 1,
        args.block_size,
        config.max_num_batched_tokens,
        config.max_model_len,
    )
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            num_blocks=num_blocks,
            block_size=args.block_size,
            enable_prefix_caching=args.enable_prefix_caching,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            target_itl_ms=args.target_itl_ms or 0.0,
            target_itl_ratio=args.target_itl_ratio or 0.0,
            policy=args.scheduling_policy,
            kv_cache_groups=runner.kv_cache_groups,
            speculative=args.speculative(),
            kv_events=args.kv_events() is not None,
            max_loras=args.max_loras if args.enable_lora else 0,
            kv_offload_slots=offload_slots,
            kv_offload_disk_index=disk_index,
            kv_offload_disk_blocks=disk_blocks,
        )
    )
    return capacity, scheduler, kv_disk


async def initialize_kv_offload(
    args: EngineArgs,
    backend: Backend,
    executor: Executor,
    runner: ModelRunner,
    config: EngineConfig,
    model_path: str,
) -> tuple[int, KVDiskTier | None, list[tuple[int, int]] | None, int]:
    """The offload tier's host slots (what ``kv_offload_size`` GiB holds) and, with ``kv_offload_dir``, its
    block files: the slot count, the disk tier, the keys its files already hold and the most files it
    keeps (``kv_offload_dir_size``; 0: no cap)."""
    assert args.kv_offload_size
    bytes_per_block = runner.kv_cache_bytes_per_block()
    slots = int(args.kv_offload_size * (1 << 30)) // bytes_per_block
    if slots < 1:
        raise ValueError(
            f"kv_offload_size {args.kv_offload_size} GiB holds no KV block ({bytes_per_block} bytes each)"
        )
    await asyncio.wrap_future(executor.collective_rpc("initialize_kv_offload", slots))
    logger.info("KV offload: %d host slots (%.2f GiB)", slots, slots * bytes_per_block / (1 << 30))
    if args.kv_offload_dir is None:
        return slots, None, None, 0
    from aioengine.engine.kv_disk import KVDiskTier, fingerprint
    from aioengine.version import __version__

    spec = args.speculative()
    print_ = fingerprint(
        model_path,
        device=backend.name,
        dtype=config.dtype,
        block_size=args.block_size,
        quantization=args.quantization,
        kernels=repr(args.kernels),
        draft=spec.model if spec is not None else None,
        # a block's shape in each tensor (the pool's size may change from one start to the next)
        layout=[(t.shape[0], *t.shape[2:]) for t in runner.kv_tensors],
        aioengine=__version__,
        python=sys.version_info[:2],
    )
    loop = asyncio.get_running_loop()
    assert runner.kv_host is not None
    block_bytes = runner.kv_host.block_bytes
    try:
        disk = await loop.run_in_executor(None, KVDiskTier, args.kv_offload_dir, print_, block_bytes)
    except OSError as e:
        raise ValueError(f"kv_offload_dir {args.kv_offload_dir!r} cannot hold block files: {e}") from None
    index = await loop.run_in_executor(None, disk.scan)
    disk_blocks = 0
    if args.kv_offload_dir_size:
        disk_blocks = int(args.kv_offload_dir_size * (1 << 30)) // disk.file_bytes(args.block_size)
        if disk_blocks < 1:
            disk.close()
            raise ValueError(f"kv_offload_dir_size {args.kv_offload_dir_size} GiB holds no block file")
    # rank 0 is in this process (a disk tier needs one rank)
    runner.kv_host.disk_write, runner.kv_host.disk_delete = disk.write, disk.delete
    logger.info("KV offload: disk tier %s holds %d blocks", disk.dir, len(index))
    return slots, disk, index, disk_blocks


def _import_heavy_modules() -> None:
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401  (resolves the lazy attributes)

    import aioengine.gpu.model_runner  # noqa: F401  (torch, the models, the loader)


def kv_event_publisher(args: EngineArgs, medium: str) -> Any:
    """The KV-event publisher ``args.kv_events_config`` asks for (engine/kv_events.py), or None."""
    cfg = args.kv_events()
    if cfg is None:
        return None
    try:
        from aioengine.engine.kv_events import ZmqEventPublisher
    except ImportError as e:
        raise ValueError(
            f"KV events need pyzmq and msgspec (pip install 'aioengine[kv-events]'): {e}"
        ) from None
    return ZmqEventPublisher(cfg, medium)
