"""Write a random-weight Qwen3-MoE GGUF of a realistic shape, for benchmarks against llama.cpp on one file.

usage: python scripts/random_moe_gguf.py OUT.gguf [--layers 16 --experts 64 --top-k 8 --hidden 2048
       --expert-ffn 1024 --heads 16 --kv-heads 4 --expert-type q4_k|q8_0]

The default is OLMoE-1B-7B's size in Qwen3-MoE's layout (16 layers, 64 experts, top-8, hidden 2048, expert FFN
1024): 6.4B expert weights in Q4_K (3.6 GB), attention and the head in Q8_0, routers and norms float32, the
default model's tokenizer (49,152 tokens). Q4_K blocks get random codes with every sub-block's scale and min
at 32 and dmin = 7.5 d, so each weight is ``32 d (q - 7.5)``: zero mean, standard deviation about 0.02, and
tokens spread over the experts as a trained router's would.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from aioengine.model.files import default_gguf_path
from aioengine.model.gguf_file import read_header

TOKENIZER_ARRAYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"})
STD = 0.02


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--expert-ffn", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--expert-type", choices=("q4_k", "q8_0"), default="q4_k")
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    src = read_header(default_gguf_path(), keep_arrays=TOKENIZER_ARRAYS)
    tokens = src.metadata["tokenizer.ggml.tokens"]
    vocab, hidden, head_dim = len(tokens), a.hidden, a.hidden // a.heads
    w = GGUFWriter(str(a.out), "qwen3moe")
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(a.expert_ffn)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_expert_count(a.experts)
    w.add_expert_used_count(a.top_k)
    w.add_expert_feed_forward_length(a.expert_ffn)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model(src.metadata["tokenizer.ggml.model"])
    w.add_tokenizer_pre(src.metadata.get("tokenizer.ggml.pre", "default"))
    w.add_token_list(tokens)
    w.add_token_types(src.metadata["tokenizer.ggml.token_type"])
    w.add_token_merges(src.metadata["tokenizer.ggml.merges"])
    w.add_bos_token_id(src.metadata["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(src.metadata["tokenizer.ggml.eos_token_id"])
    w.add_chat_template(src.metadata["tokenizer.chat_template"])

    def q8(shape: tuple[int, int]) -> np.ndarray:
        return quantize((STD * rng.standard_normal(shape)).astype(np.float32), GGMLQuantizationType.Q8_0)

    def norm(n: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    q8_0, q4_k = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K
    w.add_tensor("token_embd.weight", q8((vocab, hidden)), raw_dtype=q8_0)
    w.add_tensor("output_norm.weight", norm(hidden))
    w.add_tensor("output.weight", q8((vocab, hidden)), raw_dtype=q8_0)
    q, kv, e, f = a.heads * head_dim, a.kv_heads * head_dim, a.experts, a.expert_ffn
    for i in range(a.layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", norm(hidden))
        w.add_tensor(b + "ffn_norm.weight", norm(hidden))
        w.add_tensor(b + "attn_q_norm.weight", norm(head_dim))
        w.add_tensor(b + "attn_k_norm.weight", norm(head_dim))
        for name, shape in (("attn_q", (q, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden))):
            w.add_tensor(b + name + ".weight", q8(shape), raw_dtype=q8_0)
        w.add_tensor(b + "attn_output.weight", q8((hidden, q)), raw_dtype=q8_0)
        w.add_tensor(b + "ffn_gate_inp.weight", rng.standard_normal((e, hidden)).astype(np.float32) * 0.05)
        for part, shape in (("gate", (e, f, hidden)), ("up", (e, f, hidden)), ("down", (e, hidden, f))):
            if a.expert_type == "q8_0":
                w.add_tensor(b + f"ffn_{part}_exps.weight", q8_0_blocks(shape, rng), raw_dtype=q8_0)
            else:
                w.add_tensor(b + f"ffn_{part}_exps.weight", q4_k_blocks(shape, rng), raw_dtype=q4_k)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(a.out)


if __name__ == "__main__":
    main()
