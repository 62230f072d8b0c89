"""Random-weight GGUF files of realistic shapes: the ``random:NAME`` models that exist as a file, written once
into the cache, so that llama.cpp can be measured on the very file the engine serves.

``olmoe-1b-7b-q4_k`` is OLMoE-1B-7B's size in Qwen3-MoE's layout (16 layers, 64 experts, top-8, hidden 2048,
expert FFN 1024): 6.4B expert weights in Q4_K (3.6 GB), attention and the head in Q8_0, routers and norms
float32, the default model's tokenizer (49,152 tokens). Q4_K blocks get random codes with every sub-block's
scale and min at 32 and dmin = 7.5 d, so each weight is ``32 d (q - 7.5)``: zero mean, standard deviation
about 0.02, and tokens spread over the experts as a trained router's would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aioengine.env import cache_dir
from aioengine.model.files import default_gguf_path
from aioengine.model.gguf_file import read_header

TOKENIZER_ARRAYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"})
STD = 0.02


@dataclass(frozen=True, slots=True)
class MoEShape:
    layers: int = 16
    experts: int = 64
    top_k: int = 8
    hidden: int = 2048  # a multiple of 256 (Q4_K's block)
    expert_ffn: int = 1024
    heads: int = 16
    kv_heads: int = 4
    expert_type: str = "q4_k"  # or "q8_0"


GGUF_SHAPES: dict[str, MoEShape] = {
    "olmoe-1b-7b-q4_k": MoEShape(),
    "moe-tiny-q4_k": MoEShape(layers=2, experts=4, top_k=2, hidden=256, expert_ffn=256, heads=2, kv_heads=1),
}


def gguf_alias(model: str) -> str | None:
    """The GGUF file ``random:NAME`` stands for when NAME is in GGUF_SHAPES (written on first use), else None:
    such a model loads as any GGUF file, and a peer reads that file."""
    name = model.removeprefix("random:")
    if not model.startswith("random:") or name not in GGUF_SHAPES:
        return None
    return str(random_gguf_path(name))


def random_gguf_path(name: str, seed: int = 0) -> Path:
    """The file of ``random:NAME`` (NAME in GGUF_SHAPES), written on first use (a whole file or none)."""
    path = cache_dir() / "random" / f"{name}-seed{seed}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            write_moe_gguf(tmp, GGUF_SHAPES[name], seed)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def q4_k_blocks(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K blocks for a ``shape`` tensor (inputs a multiple of 256): ``[..., inputs / 256 * 144]``."""
    n = int(np.prod(shape)) // 256
    blocks = np.empty((n, 144), dtype=np.uint8)
    d = np.float16(STD / (32 * np.sqrt((16**2 - 1) / 12)))
    blocks[:, 0:2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    blocks[:, 2:4] = np.frombuffer(np.float16(7.5 * float(d)).tobytes(), dtype=np.uint8)
    # 6-bit scales and mins all 32: bytes 0-7 hold 32 in their low 6 bits and the high bits of the upper
    # four sub-blocks' (2, as 32 = 0b10_0000), bytes 8-11 those four's low nibbles (0)
    blocks[:, 4:12] = 32 | (2 << 6)
    blocks[:, 12:16] = 0
    blocks[:, 16:] = rng.integers(0, 256, size=(n, 128), dtype=np.uint8)
    return blocks.reshape(*shape[:-1], shape[-1] // 256 * 144)


def q8_0_blocks(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random Q8_0 blocks for a ``shape`` tensor: codes uniform in -127..127, d making the weights' standard
    deviation about STD: ``[..., inputs / 32 * 34]``."""
    n = int(np.prod(shape)) // 32
    blocks = np.empty((n, 34), dtype=np.uint8)
    blocks[:, 0:2] = np.frombuffer(np.float16(STD / (127 / np.sqrt(3))).tobytes(), dtype=np.uint8)
    blocks[:, 2:] = rng.integers(-127, 128, size=(n, 32), dtype=np.int8).view(np.uint8)
    return blocks.reshape(*shape[:-1], shape[-1] // 32 * 34)


def write_moe_gguf(out: Path, s: MoEShape, seed: int = 0) -> None:
    """A random Qwen3-MoE GGUF of shape ``s`` at ``out``, with the default model's tokenizer."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    src = read_header(default_gguf_path(), keep_arrays=TOKENIZER_ARRAYS)
    tokens = src.metadata["tokenizer.ggml.tokens"]
    vocab, hidden, head_dim = len(tokens), s.hidden, s.hidden // s.heads
    w = GGUFWriter(str(out), "qwen3moe")
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.expert_ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.top_k)
    w.add_expert_feed_forward_length(s.expert_ffn)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model(src.metadata["tokenizer.ggml.model"])
    w.add_tokenizer_pre(src.metadata.get("tokenizer.ggml.pre", "default"))
    w.add_token_list(tokens)
    w.add_token_types(src.metadata["tokenizer.ggml.token_type"])
    w.add_token_merges(src.metadata["tokenizer.ggml.merges"])
    w.add_bos_token_id(src.metadata["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(src.metadata["tokenizer.ggml.eos_token_id"])
    w.add_chat_template(src.metadata["tokenizer.chat_template"])

    def q8(shape: tuple[int, int]) -> np.ndarray:  # normal weights, quantized
        return quantize((STD * rng.standard_normal(shape)).astype(np.float32), GGMLQuantizationType.Q8_0)

    def norm(n: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    q8_0, q4_k = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K
    w.add_tensor("token_embd.weight", q8((vocab, hidden)), raw_dtype=q8_0)
    w.add_tensor("output_norm.weight", norm(hidden))
    w.add_tensor("output.weight", q8((vocab, hidden)), raw_dtype=q8_0)
    q, kv, e, f = s.heads * head_dim, s.kv_heads * head_dim, s.experts, s.expert_ffn
    for i in range(s.layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", norm(hidden))
        w.add_tensor(b + "ffn_norm.weight", norm(hidden))
        w.add_tensor(b + "attn_q_norm.weight", norm(head_dim))
        w.add_tensor(b + "attn_k_norm.weight", norm(head_dim))
        for name, shape in (("attn_q", (q, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden))):
            w.add_tensor(b + name + ".weight", q8(shape), raw_dtype=q8_0)
        w.add_tensor(b + "attn_output.weight", q8((hidden, q)), raw_dtype=q8_0)
        w.add_tensor(b + "ffn_gate_inp.weight", rng.standard_normal((e, hidden)).astype(np.float32) * 0.05)
        for part, stacked in (("gate", (e, f, hidden)), ("up", (e, f, hidden)), ("down", (e, hidden, f))):
            if s.expert_type == "q8_0":
                w.add_tensor(b + f"ffn_{part}_exps.weight", q8_0_blocks(stacked, rng), raw_dtype=q8_0)
            else:
                w.add_tensor(b + f"ffn_{part}_exps.weight", q4_k_blocks(stacked, rng), raw_dtype=q4_k)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
