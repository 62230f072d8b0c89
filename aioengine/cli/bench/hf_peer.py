"""`aioengine bench hf-peer`: transformers' continuous batching on the throughput bench's own workload.

The same requests as `aioengine bench throughput` with the same dataset flags (same prompts, seed and
output lengths; ``--num-prompts 200`` takes the first 200 of a larger run's, the draws being sequential),
greedy, no EOS. The model is a checkpoint directory or ``random:NAME``: transformers' LlamaForCausalLM of
that shape with random weights made on the device. Reports output tokens/s and mean TTFT / TPOT.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from aioengine.cli.bench.datasets import BenchRequest, add_dataset_args, build_dataset
from aioengine.cli.bench.report import write_json


def run_continuous_batching(
    model: Any, requests: list[BenchRequest], time_limit_s: float | None = None
) -> tuple[float, list, int]:
    """(seconds from the first submission to the last result, finished GenerationOutputs in order, output
    tokens). With ``time_limit_s`` the requests stream (each new token is seen) and the run stops at the
    limit: the tokens are then those made so far, finished requests or not."""
    from transformers import GenerationConfig

    gc = GenerationConfig(
        max_new_tokens=max(r.output_len for r in requests), do_sample=False, eos_token_id=None, pad_token_id=0
    )
    results: dict[str, Any] = {}  # transformers' GenerationOutputs
    made: dict[str, int] = {}  # streaming: tokens so far per request
    streaming = time_limit_s is not None
    with model.continuous_batching_context_manager(generation_config=gc, block=True, timeout=5) as manager:
        t0 = time.perf_counter()  # after the manager's warm-up (its CUDA graphs)
        deadline = None if time_limit_s is None else t0 + time_limit_s
        ids = [
            manager.add_request(
                r.prompt_token_ids,
                request_id=f"r{i}",
                max_new_tokens=r.output_len,
                record_timestamps=True,
                eos_token_id=-1,
                streaming=streaming,
            )
            for i, r in enumerate(requests)
        ]
        while len(results) < len(requests):
            if deadline is not None and time.perf_counter() >= deadline:
                break
            res = manager.get_result(
                timeout=1 if deadline is None else max(0.01, min(1, deadline - time.perf_counter()))
            )
            if res is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped early")
                continue
            made[res.request_id] = len(res.generated_tokens)
            if res.is_finished():
                if res.error:
                    raise RuntimeError(f"transformers failed request {res.request_id}: {res.error}")
                results[res.request_id] = res
        elapsed = time.perf_counter() - t0
    finished = [results[i] for i in ids if i in results]
    return (
        elapsed,
        finished,
        sum(made.values()) if streaming else sum(len(o.generated_tokens) for o in finished),
    )


def run_generate_batch(model: Any, requests: list[BenchRequest]) -> tuple[float, list]:
    """Fallback for a transformers without per-request ``add_request``: ``generate_batch`` with one
    ``max_new_tokens`` for all (the mean output length, so the token count stays comparable)."""
    from transformers import GenerationConfig

    mean_out = round(sum(r.output_len for r in requests) / len(requests))
    gc = GenerationConfig(max_new_tokens=mean_out, do_sample=False, eos_token_id=None, pad_token_id=0)
    t0 = time.perf_counter()
    res = model.generate_batch([r.prompt_token_ids for r in requests], generation_config=gc)
    return time.perf_counter() - t0, list(res.values())


def latency_stats(outputs: list) -> dict:
    ttft, tpot = [], []
    for o in outputs:
        ts = o.timestamps or []
        if ts:
            ttft.append(ts[0] - o.created_time)
        if len(ts) > 1:
            tpot.append((ts[-1] - ts[0]) / (len(ts) - 1))
    return {
        "mean_ttft_ms": 1e3 * sum(ttft) / max(len(ttft), 1),
        "mean_tpot_ms": 1e3 * sum(tpot) / max(len(tpot), 1),
    }


def load_peer_model(name: str, device: str, dtype_name: str) -> Any:
    import torch

    dtype = getattr(torch, dtype_name)
    if name.startswith("random:"):
        from aioengine.gpu.random_model import build_random_hf_model

        return build_random_hf_model(name, dtype, device)
    from transformers import AutoModelForCausalLM

    from aioengine.model import float_checkpoint
    from aioengine.model.files import resolve_model

    folder = resolve_model(name)
    if float_checkpoint.has_codes(folder):  # a GGUF mixture's experts are codes: transformers reads float32
        folder = float_checkpoint.reference_checkpoint(folder)
    model: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    return model.to(device).eval()  # (Any: transformers types its to() as unbound)


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="aioengine bench hf-peer", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="a checkpoint directory, 'default' or random:NAME")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    add_dataset_args(ap)
    ap.add_argument(
        "--time-limit",
        type=float,
        help="stop after this many seconds and count the tokens made so far (requests stream)",
    )
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    from aioengine.config import EngineArgs, KernelConfig
    from aioengine.gpu.backends import make_backend, resolve_device

    device = resolve_device(args.device)
    # The backend answers which dtype a peer runs at here; its own kernels are not needed.
    backend = make_backend(EngineArgs(device=device, kernels=KernelConfig(cpu_kernels=False)))
    dtype = args.dtype if args.dtype != "auto" else backend.peer_dtype
    from aioengine.model.random_gguf import gguf_alias

    name = gguf_alias(args.model) or args.model  # a random GGUF: the peer reads the file
    model = load_peer_model(name, device, dtype)
    if name.startswith("random:"):
        from aioengine.model.tokenizer import NullTokenizer

        tokenizer = NullTokenizer(model.config.vocab_size)
    else:
        from aioengine.model.files import resolve_model
        from aioengine.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(str(resolve_model(name)))
    requests = build_dataset(args, tokenizer)
    note = None
    if hasattr(model, "continuous_batching_context_manager"):
        elapsed, outputs, out_tokens = run_continuous_batching(model, requests, args.time_limit)
        if len(outputs) < len(requests):
            note = (
                f"stopped at the {args.time_limit:g} s time limit with {len(outputs)} of {len(requests)} "
                "requests finished: output tokens are those made until then"
            )
    else:
        note = "generate_batch fallback: every request generates the mean output length"
        elapsed, outputs = run_generate_batch(model, requests)
        out_tokens = sum(len(o.generated_tokens) for o in outputs)
    in_tokens = sum(len(r.prompt_token_ids) for r in requests)
    result = {
        "mode": "hf-peer",
        "model": args.model,
        "device": device,
        "dtype": dtype,
        "num_requests": len(requests),
        "elapsed_s": elapsed,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / elapsed,
        "requests_per_s": len(requests) / elapsed,
        "finished_requests": len(outputs),
        "note": note,
        **latency_stats(outputs),
    }
    print(
        f"transformers continuous batching: {result['output_tokens_per_s']:.1f} output tokens/s "
        f"({len(requests)} requests, {out_tokens} output tokens in {elapsed:.2f} s); "
        f"mean TTFT {result['mean_ttft_ms']:.1f} ms, "
        f"mean TPOT {result['mean_tpot_ms']:.2f} ms" + (f" ({note})" if note else "")
    )
    write_json(args.output_json, result)
    return result
