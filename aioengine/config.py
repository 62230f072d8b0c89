"""EngineArgs and its KernelConfig: every knob of the engine, named as vLLM names them, and their defaults."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

# The names a user may give --device (gpu/backends.py resolves "auto"); not a device check.
DEVICE_CHOICES = ("auto", "cpu", "cuda")
POOLING_TYPES = ("last", "mean", "cls")  # embeddings: which hidden states embed() pools
DEFAULT_POOLING = "last"  # vLLM's default for a decoder-only model

# Speculative decoding: vLLM's `speculative_config` keys.
SPEC_METHODS = ("ngram", "draft_model")
_SPEC_KEYS = {
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
    "model",
}


_DEFAULT_LOOKUP = (2, 4)  # prompt_lookup_min, prompt_lookup_max


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """``disable_by_batch_size``: no speculation while more requests than this run (a verified draft costs
    a batch-1 step almost nothing, a large batch a full share of compute)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = _DEFAULT_LOOKUP[1]
    prompt_lookup_min: int = _DEFAULT_LOOKUP[0]
    disable_by_batch_size: int = 2
    model: str | None = None  # the draft model's checkpoint (method "draft_model")

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @staticmethod
    def from_dict(raw: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """vLLM's dict (or a SpeculativeConfig, or None); a bad key or value raises ValueError naming it."""
        if raw is None or isinstance(raw, SpeculativeConfig):
            return raw
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(raw).__name__}")
        unknown = sorted(set(raw) - _SPEC_KEYS)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown key {unknown[0]!r}; "
                f"known keys: {', '.join(sorted(_SPEC_KEYS))}"
            )
        # vLLM infers the method from a given model when none is named
        method = raw.get("method", "draft_model" if raw.get("model") is not None else "ngram")
        if method not in SPEC_METHODS:
            methods = ", ".join(SPEC_METHODS)
            raise ValueError(f"speculative_config method must be one of {methods}, got {method!r}")
        model = raw.get("model")
        if method == "draft_model":
            if not isinstance(model, str) or not model:
                raise ValueError("speculative_config method 'draft_model' needs 'model': the draft's path")
            lookup = sorted({"prompt_lookup_max", "prompt_lookup_min"} & set(raw))
            if lookup:
                raise ValueError(
                    f"speculative_config {lookup[0]} applies to method 'ngram', not 'draft_model'"
                )
        elif model is not None:
            raise ValueError(f"speculative_config method {method!r} takes no 'model'")
        ints = {}
        for key in (
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "disable_by_batch_size",
        ):
            if key in raw:
                value = raw[key]
                if type(value) is not int or value < 1:
                    raise ValueError(f"speculative_config {key} must be an integer >= 1, got {value!r}")
                ints[key] = value
        if "prompt_lookup_max" in ints and "prompt_lookup_min" not in ints:
            ints["prompt_lookup_min"] = min(ints["prompt_lookup_max"], _DEFAULT_LOOKUP[0])
        if "prompt_lookup_min" in ints and "prompt_lookup_max" not in ints:
            ints["prompt_lookup_max"] = max(ints["prompt_lookup_min"], _DEFAULT_LOOKUP[1])
        config = SpeculativeConfig(method=method, model=model, **ints)
        if config.num_speculative_tokens > 16:
            raise ValueError("speculative_config num_speculative_tokens must be at most 16")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({config.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({config.prompt_lookup_max})"
            )
        return config


logger = logging.getLogger(__name__)

CPU_LINEAR_CHOICES = ("auto", "onednn", "torch")
# The CPU kernels' ISA levels, lowest first per architecture (kernels/cpu/isa.py says what each needs).
CPU_ISA_LEVELS = ("avx2", "avx512", "avx512-bf16", "neon")
CPU_ISA_CHOICES = ("auto", *CPU_ISA_LEVELS)


@dataclass(slots=True)
class KernelConfig:
    """Which kernels a backend uses, per engine: two engines in one process can differ (tests, A/B runs)."""

    cpu_kernels: bool = True  # build and use the C kernels at all (False: torch ops, oneDNN linears)
    # The ISA level the C kernels are built for, and whose defaults (dtype) apply: "auto" is the highest this
    # CPU runs; a lower one (avx2 on an AVX512 machine) builds and runs exactly that level's library.
    cpu_isa: str = "auto"
    cpu_elementwise: bool = True  # residual add + RMSNorm and rotary as one C pass each (bf16, float32)
    cpu_attention: bool = True  # C decode attention and KV store
    cpu_prefill_attention: bool = True  # bf16 prompt chunks through cpu_prefill_attention.c
    # bf16 linears: "auto" packs for cpu_gemm.c where it is built (else oneDNN's layout), "onednn" always
    # takes oneDNN's layout, "torch" keeps plain weights for F.linear.
    cpu_linear: str = "auto"
    cpu_decode_stack: bool = True  # a step of decodes only runs every layer in one C call
    # A GGUF's Q8_0 LM head runs on its own codes for a few rows (gpu/cpu/q8_head.py) where the level
    # vectorizes them.
    cpu_q8_head: bool = True
    # A model's decoder linears run on a GGUF's block codes (symmetric types, and Q4_1's and Q4_K's 4-bit
    # ones with offsets) for a few rows (gpu/cpu/q8_linear.py) where the level vectorizes them.
    cpu_q8_linears: bool = True
    # Tensor-parallel CPU ranks of one node all-reduce through shared memory (False: through gloo).
    cpu_shm_allreduce: bool = True
    cuda_graph_capture_timeout_s: float = 180.0  # graph capture stops (smaller sizes run eagerly) past this

    def validate(self) -> None:
        if self.cpu_linear not in CPU_LINEAR_CHOICES:
            raise ValueError(
                f"cpu_linear must be one of {', '.join(CPU_LINEAR_CHOICES)}, got {self.cpu_linear!r}"
            )
        if self.cpu_isa not in CPU_ISA_CHOICES:
            raise ValueError(f"cpu_isa must be one of {', '.join(CPU_ISA_CHOICES)}, got {self.cpu_isa!r}")
        if self.cuda_graph_capture_timeout_s < 0:
            raise ValueError("cuda_graph_capture_timeout_s must be >= 0")


@dataclass(slots=True)
class EngineArgs:
    model: str = "default"  # "default" (the embedded SmolLM2-135M-Instruct) or a checkpoint directory
    tokenizer: str | None = None  # defaults to the model directory
    skip_tokenizer_init: bool = False  # no tokenizer: prompts are token ids, outputs carry no text
    served_model_name: str | None = None
    chat_template: str | None = (
        None  # a Jinja chat template, or a file holding one (replaces the tokenizer's)
    )
    # Where default sampling parameters come from (vLLM's --generation-config): "auto" = the model's
    # generation_config.json, "vllm" = none (OpenAI's defaults), or a directory holding such a file.
    generation_config: str = "auto"
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: bfloat16 on CUDA and at the CPU
    # kernels' avx512-bf16 level, else float32)
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_batched_tokens: int | None = None  # default: 512 on CPU, 8192 on CUDA
    max_num_seqs: int | None = None  # default: 128 on CPU, 1024 on CUDA
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides the memory budget below
    kv_cache_memory_bytes: int | None = None  # default on CPU: 2 GiB
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # A second tier for the prefix cache (vLLM's --kv-offloading-size): blocks the KV pool evicts are kept
    # in this many GiB of host memory, and loaded back on a later hit instead of computed again.
    kv_offload_size: float | None = None
    # ...and written to block files in this folder too, which a restarted server reads back,
    kv_offload_dir: str | None = None
    # ...at most this many GiB of them (the least recently used go first); None: no cap.
    kv_offload_dir_size: float | None = None
    long_prefill_token_threshold: int = 0
    # ITL-aware token budget (sched/step_cost.py): cut a step's prompt chunks so that its predicted duration
    # stays within this many ms; None: the token budget alone
    target_itl_ms: float | None = None
    # ...or within this many times the predicted duration of its decodes alone, which follows the machine's
    # speed and the batch; with both, a step may take the larger of the two. None: no relative target.
    target_itl_ratio: float | None = None
    scheduling_policy: str = "fcfs"  # or "priority"
    num_threads: int | None = None  # torch intra-op threads on CPU (default: all cores)
    enforce_eager: bool = False
    # Largest decode batch a CUDA graph is captured for (default: the tour's 512; bigger batches run eagerly).
    max_cudagraph_capture_size: int | None = None
    quantization: str | None = None  # CPU only: int8 | int4 weight-only (aioengine/gpu/cpu/quant.py)
    # embed()'s pooling: last | mean | cls (aioengine/model/pooling.py); default: the checkpoint's
    # sentence-transformers config, else last
    pooling: str | None = None
    step_timeout_s: float = 300.0  # watchdog: a step running longer marks the engine dead
    # A request's grammar (JSON schema, regex, EBNF) that takes longer to compile is refused (400); the
    # compile runs on a thread, so the streams never wait for it.
    grammar_compile_timeout_s: float = 10.0
    # vLLM's keys: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, ...}
    speculative_config: dict[str, Any] | SpeculativeConfig | None = None
    # vLLM's keys: {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", ...}
    kv_events_config: dict[str, Any] | KVEventsConfig | None = None
    # Tensor parallelism: ranks 1..N-1 are processes this engine spawns ("mp") or Ray actors ("ray", for
    # several nodes); the group meets at a TCP store (tcp://host:port; default: torchrun's MASTER_ADDR and
    # MASTER_PORT, else a free local port).
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    distributed_init_method: str | None = None
    # LoRA adapters (PEFT format) served beside the base model, each under its own name; a request picks one
    # (generate(lora=...), or the OpenAI "model" field). vLLM's names.
    enable_lora: bool = False
    lora_modules: dict[str, str] = field(default_factory=dict)  # name -> adapter folder
    # adapters that run at once, each in a slot on the device; more may be named: each is read and checked at
    # start, kept on the host and copied into a slot when a step needs it (the least recently used out)
    max_loras: int = 1
    max_lora_rank: int = 16
    enable_lora_runtime_updates: bool = False  # load_lora / unload_lora (and their HTTP routes) while serving
    kernels: KernelConfig = field(default_factory=KernelConfig)

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        for name in (
            "max_model_len",
            "max_num_batched_tokens",
            "max_num_seqs",
            "num_kv_blocks",
            "max_cudagraph_capture_size",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if self.device not in DEVICE_CHOICES:
            raise ValueError(f"device must be {', '.join(DEVICE_CHOICES)}, got {self.device!r}")
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f"quantization must be int8 or int4, got {self.quantization!r}")
        if self.target_itl_ms is not None and not self.target_itl_ms > 0:
            raise ValueError(f"target_itl_ms must be > 0, got {self.target_itl_ms}")
        if self.target_itl_ratio is not None and not self.target_itl_ratio > 1:
            raise ValueError(f"target_itl_ratio must be > 1, got {self.target_itl_ratio}")
        if self.pooling not in (None, *POOLING_TYPES):
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(
                f"distributed_executor_backend must be mp or ray, got {self.distributed_executor_backend!r}"
            )
        self._validate_kv_offload()
        self.kernels.validate()
        SpeculativeConfig.from_dict(self.speculative_config)  # raises ValueError naming a bad key or value
        KVEventsConfig.from_dict(self.kv_events_config)
        self._validate_lora()

    def _validate_kv_offload(self) -> None:
        size = self.kv_offload_size
        if size is not None and not (isinstance(size, int | float) and 0 < size < float("inf")):
            raise ValueError(f"kv_offload_size must be a positive number of GiB, got {size!r}")
        cap = self.kv_offload_dir_size
        if cap is not None:
            if not (isinstance(cap, int | float) and 0 < cap < float("inf")):
                raise ValueError(f"kv_offload_dir_size must be a positive number of GiB, got {cap!r}")
            if self.kv_offload_dir is None:
                raise ValueError("kv_offload_dir_size needs kv_offload_dir")
        if self.kv_offload_dir is not None:
            if not size:
                raise ValueError("kv_offload_dir needs kv_offload_size (the host tier disk reads land in)")
            if self.tensor_parallel_size > 1:
                raise ValueError("kv_offload_dir is not supported with tensor parallelism yet")
        if size and not self.enable_prefix_caching:
            raise ValueError("kv_offload_size extends the prefix cache: it needs enable_prefix_caching")

    def _validate_lora(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(
                f"max_loras and max_lora_rank must be at least 1 ({self.max_loras}, {self.max_lora_rank})"
            )
        if (self.lora_modules or self.enable_lora_runtime_updates) and not self.enable_lora:
            raise ValueError("lora_modules and enable_lora_runtime_updates need enable_lora")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters are not supported with tensor parallelism yet")

    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.from_dict(self.speculative_config)

    def kv_events(self) -> KVEventsConfig | None:
        """The KV-event publisher's config, when it publishes (else None)."""
        cfg = KVEventsConfig.from_dict(self.kv_events_config)
        return cfg if cfg is not None and cfg.publishes else None


@dataclass(slots=True, frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config``: the prefix cache's changes (BlockStored, BlockRemoved,
    AllBlocksCleared) published as msgspec-encoded batches on a ZMQ PUB socket, one batch a step, with
    a ROUTER socket replaying the last ``buffer_steps`` batches from a sequence number."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq", or "null" (nothing published)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark: past it ZMQ drops for a slow subscriber
    max_queue_size: int = 100_000  # batches waiting for the publisher's thread; past it they are dropped
    topic: str = ""

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @staticmethod
    def from_dict(raw: dict[str, Any] | KVEventsConfig | None) -> KVEventsConfig | None:
        """vLLM's dict (or a KVEventsConfig, or None); a bad key or value raises ValueError naming it."""
        if raw is None or isinstance(raw, KVEventsConfig):
            return raw
        if not isinstance(raw, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {type(raw).__name__}")
        known = {f for f in KVEventsConfig.__dataclass_fields__}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"kv_events_config has unknown key {unknown[0]!r}; known keys: {', '.join(sorted(known))}"
            )
        cfg = KVEventsConfig(**raw)
        if cfg.publisher not in ("null", "zmq"):
            raise ValueError(f"kv_events_config publisher must be zmq or null, got {cfg.publisher!r}")
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(cfg, key)
            if type(value) is not int or value < 1:
                raise ValueError(f"kv_events_config {key} must be a positive integer, got {value!r}")
        for key in ("endpoint", "topic"):
            if not isinstance(getattr(cfg, key), str):
                raise ValueError(f"kv_events_config {key} must be a string")
        if not isinstance(cfg.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config enable_kv_cache_events must be true or false")
        return cfg


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """What ``start()`` resolved from EngineArgs, the checkpoint's config and the backend's defaults."""

    device: str
    dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int


def resolve_max_model_len(requested: int | None, max_position_embeddings: int) -> int:
    """The context length: ``requested`` or the model's (sliding windows cap nothing: attention applies
    them)."""
    max_model_len = requested or max_position_embeddings
    if max_model_len > max_position_embeddings:
        logger.warning(
            "max_model_len %d is past the model's max_position_embeddings (%d): positions beyond it "
            "extrapolate RoPE, as transformers does, and quality may drop there",
            max_model_len,
            max_position_embeddings,
        )
    return max_model_len


def default_num_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
