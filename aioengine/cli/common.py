"""What the command line and the benchmarks share: EngineArgs (KernelConfig included) as flags, and uvloop."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from aioengine.config import (
    CPU_ISA_CHOICES,
    CPU_LINEAR_CHOICES,
    DEVICE_CHOICES,
    POOLING_TYPES,
    EngineArgs,
    KernelConfig,
)

# Help for the EngineArgs fields; a field added to EngineArgs later still gets a flag (with generic help).
_ENGINE_HELP = {
    "model": "'default' (the embedded SmolLM2-135M-Instruct), a Hugging Face checkpoint directory, "
    "or random:NAME (random weights of a known shape made on the device: random:llama-3.1-8b, random:tiny); "
    "serve: NAME=PATH, repeated, serves several models",
    "tokenizer": "tokenizer directory (default: the model's)",
    "skip_tokenizer_init": "no tokenizer: prompts must be token ids and outputs carry no text",
    "served_model_name": "name(s) the API answers to; the first is reported (default: the model)",
    "chat_template": "a Jinja chat template file, or the template itself (default: the tokenizer's)",
    "generation_config": "default sampling parameters: auto (the model's generation_config.json), "
    "vllm (none), or a directory with a generation_config.json",
    "dtype": "weights and activations dtype (auto: float32 on CPU, bfloat16 on CUDA)",
    "device": "where the model runs",
    "seed": "seed of the sampler's generator",
    "max_model_len": "context length: prompt plus output tokens (default: the model's)",
    "max_num_batched_tokens": "token budget of one engine step",
    "max_num_seqs": "most sequences in one step",
    "block_size": "tokens per KV-cache block (a power of two)",
    "num_kv_blocks": "KV-cache blocks (overrides the memory budget)",
    "kv_cache_memory_bytes": "KV-cache memory budget, e.g. 2G or 512MiB",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "kv_offload_size": "GiB of host memory that keeps the KV blocks the cache evicts, loaded back on a later "
    "prefix hit (vLLM's --kv-offloading-size; default: none)",
    "kv_offload_dir": "also keep evicted KV blocks as checksummed files in this folder, read back on a hit "
    "and after a restart (needs --kv-offload-size)",
    "kv_offload_dir_size": "GiB of block files --kv-offload-dir keeps at most; the least recently used go "
    "first (default: no cap)",
    "long_prefill_token_threshold": "cap on prompt tokens one request may take per step (0: off)",
    "target_itl_ms": "cut each step's prompt chunks so that its predicted duration (fitted to measured "
    "steps) stays within this many ms; default: no target",
    "target_itl_ratio": "cut each step's prompt chunks so that its predicted duration stays within this many "
    "times that of its decodes alone (> 1; with --target-itl-ms, the larger of the two); default: none",
    "scheduling_policy": "fcfs, or priority (requests then honour their `priority` field)",
    "num_threads": "torch intra-op threads on CPU (default: all cores)",
    "enforce_eager": "never capture CUDA graphs",
    "max_cudagraph_capture_size": "largest decode batch that replays a CUDA graph "
    "(default 512; larger batches run eagerly)",
    "step_timeout_s": "watchdog: a step running longer marks the engine dead",
    "speculative_config": "speculative decoding, as JSON with vLLM's keys: "
    '\'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
    'or \'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 3}\'',
    "kv_events_config": "publish the prefix cache's changes as vLLM's KV events, as JSON with vLLM's keys: "
    '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}\'',
    "quantization": "CPU weight-only quantization of the linear layers (int4: groups of 32, like GGUF Q4_1)",
    "pooling": "embeddings' pooling (default: the checkpoint's sentence-transformers config, else last)",
    "enable_lora": "serve LoRA adapters beside the base model (--lora-modules)",
    "lora_modules": "LoRA adapters (PEFT folders) as name=path; a request's model field picks one by name",
    "max_loras": "LoRA adapters that run at once (slots); more may be named: the least recently used "
    "leaves its slot for one a step needs",
    "max_lora_rank": "the largest LoRA rank an adapter may have",
    "enable_lora_runtime_updates": "POST /v1/load_lora_adapter and /v1/unload_lora_adapter add and remove "
    "adapters while serving (behind the API key)",
    # KernelConfig
    "cpu_kernels": "build and use the CPU's C kernels (off: torch ops, oneDNN linears)",
    "cpu_isa": "CPU: the ISA level the C kernels are built for and whose defaults apply "
    "(auto: the highest this CPU runs; a lower one runs exactly that level's library)",
    "cpu_elementwise": "CPU: residual add + RMSNorm and rotary as one C pass each (bf16, float32)",
    "cpu_attention": "CPU: C decode attention and KV store",
    "cpu_prefill_attention": "CPU: bf16 prompt chunks through the packed prefill kernel",
    "cpu_linear": "CPU bf16 linears: auto (cpu_gemm.c where built, else oneDNN), onednn, "
    "or torch (plain weights)",
    "cpu_decode_stack": "CPU: a step of decodes only runs every layer in one C call",
    "cpu_q8_head": "CPU: a GGUF's Q8_0 LM head runs on its own int8 codes for a few rows",
    "cpu_q8_linears": "CPU: a model's decoder linears run on a GGUF's Q8_0/Q5_0/Q4_0/Q6_K/Q4_1/Q4_K codes "
    "for a few rows",
    "cuda_graph_capture_timeout_s": "seconds CUDA graph capture may take (sizes not reached run eagerly)",
}
_CHOICES = {
    "dtype": ["auto", "float32", "bfloat16", "float16"],
    "device": list(DEVICE_CHOICES),
    "scheduling_policy": ["fcfs", "priority"],
    "quantization": ["int8", "int4"],
    "pooling": list(POOLING_TYPES),
    "cpu_linear": list(CPU_LINEAR_CHOICES),
    "cpu_isa": list(CPU_ISA_CHOICES),
}
_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'4096', '512M', '2G', '1.5GiB' -> bytes (K/M/G/T are powers of 1024, as vLLM reads them)."""
    m = _BYTES.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}")
    unit = m.group(2).lower()
    scale = 1024 ** ("kmgt".index(unit) + 1) if unit else 1
    return int(float(m.group(1)) * scale)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"a LoRA module is name=path, got {text!r}")
    return name, path


def _field_type(f: dataclasses.Field) -> Callable[[str], Any]:
    ann = str(f.type)
    if f.name.endswith("_bytes"):
        return parse_bytes
    if f.name in ("speculative_config", "kv_events_config"):
        return _json_object
    if ann.startswith("int"):
        return int
    if ann.startswith("float"):
        return float
    return str


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineArgs field, named as vLLM names it (--max-model-len, --enable-prefix-caching...),
    and one per KernelConfig field in a group of their own."""
    _add_fields(parser.add_argument_group("engine"), EngineArgs, skip={"kernels"})
    _add_fields(parser.add_argument_group("kernels"), KernelConfig, skip=set())


def _add_fields(group: argparse._ArgumentGroup, cls: type, skip: set[str]) -> None:
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = None if f.default is dataclasses.MISSING else f.default
        help_text = _ENGINE_HELP.get(f.name, f.name.replace("_", " "))
        if f.name == "model":  # repeated NAME=PATH (serve): several models in one server
            group.add_argument(flag, action="append", default=None, metavar="MODEL", help=help_text)
        elif f.name == "served_model_name":
            group.add_argument(flag, nargs="+", default=None, metavar="NAME", help=help_text)
        elif f.name == "lora_modules":
            group.add_argument(
                flag, nargs="+", type=_lora_module, default=None, metavar="NAME=PATH", help=help_text
            )
        elif str(f.type) == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            group.add_argument(
                flag, type=_field_type(f), default=default, choices=_CHOICES.get(f.name), help=help_text
            )


def named_models(args: argparse.Namespace) -> dict[str, str]:
    """The ``--model NAME=PATH`` entries, in order (ValueError for an empty name or path, or a name twice)."""
    return _model_flags(args)[0]


def _model_flags(args: argparse.Namespace) -> tuple[dict[str, str], list[str]]:
    """The ``--model`` values: NAME=PATH entries by name, and the plain ones in order."""
    named: dict[str, str] = {}
    plain: list[str] = []
    for value in args.model or ():
        name, sep, path = value.partition("=")
        if not sep or os.path.exists(value):  # a plain path that holds an "=" is a path
            plain.append(value)
            continue
        if not name or not path:
            raise ValueError(f"--model NAME=PATH: got {value!r}")
        if name in named:
            raise ValueError(f"--model {name}= is given twice")
        named[name] = path
    return named, plain


def engine_args_from(args: argparse.Namespace, named_ok: bool = False) -> EngineArgs:
    """The EngineArgs the flags give (the last plain ``--model``; NAME=PATH entries are ``named_models``',
    which only ``serve`` takes: elsewhere the command exits saying so)."""
    named, plain = _model_flags(args)
    if named and not named_ok:
        raise SystemExit("aioengine: --model NAME=PATH serves several models: `aioengine serve` only")
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs) if f.name != "kernels"}
    values["model"] = plain[-1] if plain else "default"
    if getattr(args, "model_tag", None):
        values["model"] = args.model_tag
    if values["served_model_name"]:
        values["served_model_name"] = values["served_model_name"][0]
    values["lora_modules"] = dict(values["lora_modules"] or ())
    kernels = KernelConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(KernelConfig)})
    return EngineArgs(**values, kernels=kernels)


T = TypeVar("T")


def run_in_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop when it is installed: one loop for the engine and the server."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
