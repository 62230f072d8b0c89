"""Write small GGUF files of a tiny random Llama with the gguf package's writer and quantizers (tests only).

The tokenizer (and its chat template) is copied from the bundled SmolLM2 GGUF, cut to its first
TINY_VOCAB tokens and the merges among them (the whole 49k vocabulary costs transformers' GGUF reader
seconds per file). Block types the gguf
package cannot quantize (the K-quants) get random blocks whose float16 scales are set to finite values;
their reference is the package's own dequantizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from aioengine.model.files import default_gguf_path
from aioengine.model.gguf_file import read_header

TOKENIZER_ARRAYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"})
TINY_VOCAB = 2048  # the special tokens, the 256 bytes and the first merges
# byte offsets of each K-quant block's float16 scales (ggml's block_q*_K layouts)
_K_SCALES = {
    GGMLQuantizationType.Q2_K: (80, 82),
    GGMLQuantizationType.Q3_K: (108,),
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
}


@dataclass
class TinyLlama:
    hidden: int = 256  # a multiple of 256: K-quant rows are whole super-blocks
    intermediate: int = 512
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    weights: dict[str, np.ndarray] = field(default_factory=dict)  # HF names, HF layout


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf's permute), from the HF layout."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _blocks(w: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """``w`` stored as ``qtype``: quantized where the package can, else random blocks with sane scales."""
    if qtype == GGMLQuantizationType.F32:
        return w.astype(np.float32)
    if qtype not in _K_SCALES:
        return quantize(w, qtype)
    block, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(w.shape[0], w.shape[1] // block, nbytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    for at in _K_SCALES[qtype]:
        raw[:, :, at : at + 2] = scale
    return raw.reshape(w.shape[0], -1)


def write_tiny_llama(
    path: Path,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    seed: int = 0,
    arch: str = "llama",
    with_tokenizer: bool = True,
    shapes: dict[str, tuple[int, ...]] | None = None,
    raw_types: dict[str, GGMLQuantizationType] | None = None,
    mixed: list[GGMLQuantizationType] | None = None,
    expert_count: int | None = None,
    experts: int = 0,
) -> dict[str, np.ndarray]:
    """Write the file; return the weights the loader must produce (HF names, float32, HF layout).

    ``shapes`` overrides a GGUF tensor's shape (a wrong-shape file); ``raw_types`` stores a tensor as
    that type's bytes without quantizing (an unsupported type); ``mixed``: the weight matrices take these
    types in turn instead of ``qtype`` (one file covers them all); ``expert_count``: the metadata of a
    mixture of experts alone; ``experts``: a real mixture of that many experts, top-2, as llama.cpp writes
    it (stacked ``ffn_*_exps``, a float32 router; ``llama`` is Mixtral, ``qwen3moe`` has q/k norms,
    ``qwen2moe`` q/k/v biases and a gated shared expert), its weights named as the Hub's checkpoints."""
    m = TinyLlama()
    rng = np.random.default_rng(seed)
    src = read_header(default_gguf_path(), keep_arrays=TOKENIZER_ARRAYS)
    tokens = src.metadata["tokenizer.ggml.tokens"][:TINY_VOCAB]
    known = set(tokens)
    merges = [
        m for m in src.metadata["tokenizer.ggml.merges"] if {*m.split(" ", 1), m.replace(" ", "", 1)} <= known
    ]
    vocab = len(tokens)
    w = GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(m.hidden)
    w.add_block_count(m.layers)
    w.add_feed_forward_length(m.intermediate)
    w.add_head_count(m.heads)
    w.add_head_count_kv(m.kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    if expert_count is not None:  # the metadata of a mixture (its tensors stay dense)
        w.add_expert_count(expert_count)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(2)
        w.add_expert_feed_forward_length(m.intermediate)
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(m.intermediate)
    if with_tokenizer:
        w.add_tokenizer_model(src.metadata["tokenizer.ggml.model"])
        w.add_tokenizer_pre(src.metadata.get("tokenizer.ggml.pre", "default"))
        w.add_token_list(tokens)
        w.add_token_types(src.metadata["tokenizer.ggml.token_type"][:vocab])
        w.add_token_merges(merges)
        w.add_bos_token_id(src.metadata["tokenizer.ggml.bos_token_id"])
        w.add_eos_token_id(src.metadata["tokenizer.ggml.eos_token_id"])
        w.add_chat_template(src.metadata["tokenizer.chat_template"])

    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    plan: list[tuple[str, str, tuple[int, int] | tuple[int], int | None]] = [
        ("token_embd.weight", "model.embed_tokens.weight", (vocab, m.hidden), None),
        ("output_norm.weight", "model.norm.weight", (m.hidden,), None),
        ("output.weight", "lm_head.weight", (vocab, m.hidden), None),
    ]
    for i in range(m.layers):
        hf = f"model.layers.{i}."
        plan += [
            (f"blk.{i}.attn_norm.weight", hf + "input_layernorm.weight", (m.hidden,), None),
            (f"blk.{i}.ffn_norm.weight", hf + "post_attention_layernorm.weight", (m.hidden,), None),
            (f"blk.{i}.attn_q.weight", hf + "self_attn.q_proj.weight", (q, m.hidden), m.heads),
            (f"blk.{i}.attn_k.weight", hf + "self_attn.k_proj.weight", (kv, m.hidden), m.kv_heads),
            (f"blk.{i}.attn_v.weight", hf + "self_attn.v_proj.weight", (kv, m.hidden), None),
            (f"blk.{i}.attn_output.weight", hf + "self_attn.o_proj.weight", (m.hidden, q), None),
        ]
        if experts:
            plan += _moe_plan(m, i, arch, experts)
        else:
            plan += [
                (f"blk.{i}.ffn_gate.weight", hf + "mlp.gate_proj.weight", (m.intermediate, m.hidden), None),
                (f"blk.{i}.ffn_up.weight", hf + "mlp.up_proj.weight", (m.intermediate, m.hidden), None),
                (f"blk.{i}.ffn_down.weight", hf + "mlp.down_proj.weight", (m.hidden, m.intermediate), None),
            ]
    expected = {}
    matrices = 0
    for gguf_name, hf_name, shape, heads in plan:
        shape = (shapes or {}).get(gguf_name, shape)
        if len(shape) == 1:  # norms (and biases) stay float32, as llama.cpp keeps them
            value = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            w.add_tensor(gguf_name, value)
            # Qwen2-MoE's shared-expert gate is [1, H] in the model and a vector in the file
            expected[hf_name] = value.reshape(1, -1) if "gate_inp_shexp" in gguf_name else value
            continue
        hf_value = (0.05 * rng.standard_normal(shape)).astype(np.float32)
        if gguf_name.endswith("ffn_gate_inp.weight"):  # llama.cpp keeps routers in float32
            w.add_tensor(gguf_name, hf_value)
            expected[hf_name] = hf_value
            continue
        if len(shape) == 3:  # a layer's stacked experts, saved per expert
            loaded = _store(w, gguf_name, hf_value, qtype, rng)
            for e in range(shape[0]):
                expected[hf_name.format(e=e)] = loaded[e]
            continue
        permuted = bool(heads) and arch == "llama"
        stored = _permute(hf_value, heads) if permuted else hf_value
        raw_type = (raw_types or {}).get(gguf_name)
        if raw_type is not None:
            block, nbytes = GGML_QUANT_SIZES[raw_type]
            data = rng.integers(0, 256, size=(shape[0], shape[1] // block * nbytes), dtype=np.uint8)
            w.add_tensor(gguf_name, data, raw_dtype=raw_type)
            continue
        if mixed:
            qtype = mixed[matrices % len(mixed)]
        matrices += 1
        loaded = _store(w, gguf_name, stored, qtype, rng)
        expected[hf_name] = _unpermute(loaded, heads) if permuted else loaded
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _store(
    w: GGUFWriter, name: str, value: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator
) -> np.ndarray:
    """Add ``value`` (2-D, or 3-D stacked experts) as ``qtype``; return what the file dequantizes to: the
    package's quantizer where it has one (rows quantize alone, so row order commutes with it), else random
    blocks, whose reference is the package's dequantizer."""
    if qtype == GGMLQuantizationType.F32:
        w.add_tensor(name, value)
        return value
    rows = value.reshape(-1, value.shape[-1])
    data = _blocks(rows, qtype, rng)
    w.add_tensor(name, data.reshape(*value.shape[:-1], -1), raw_dtype=qtype)
    if qtype not in _K_SCALES:
        return dequantize(quantize(value, qtype), qtype).astype(np.float32)
    return dequantize(data, qtype).reshape(value.shape).astype(np.float32)


_MIXTRAL = {"gate": "w1", "up": "w3", "down": "w2"}


def _moe_plan(m: TinyLlama, i: int, arch: str, n: int) -> list:
    """Layer ``i``'s routed feed-forward: the router, the stacked experts (HF names with ``{e}``), and for
    qwen2moe the gated shared expert."""
    hf = f"model.layers.{i}."
    block = "block_sparse_moe" if arch == "llama" else "mlp"
    plan: list = [(f"blk.{i}.ffn_gate_inp.weight", f"{hf}{block}.gate.weight", (n, m.hidden), None)]
    for part, shape in (("gate", (n, m.intermediate, m.hidden)), ("up", (n, m.intermediate, m.hidden))) + (
        ("down", (n, m.hidden, m.intermediate)),
    ):
        proj = _MIXTRAL[part] if arch == "llama" else f"{part}_proj"
        plan.append(
            (f"blk.{i}.ffn_{part}_exps.weight", f"{hf}{block}.experts.{{e}}.{proj}.weight", shape, None)
        )
    if arch == "qwen3moe":
        plan += [
            (f"blk.{i}.attn_q_norm.weight", hf + "self_attn.q_norm.weight", (m.head_dim,), None),
            (f"blk.{i}.attn_k_norm.weight", hf + "self_attn.k_norm.weight", (m.head_dim,), None),
        ]
    if arch == "qwen2moe":
        q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
        plan += [
            (f"blk.{i}.attn_q.bias", hf + "self_attn.q_proj.bias", (q,), None),
            (f"blk.{i}.attn_k.bias", hf + "self_attn.k_proj.bias", (kv,), None),
            (f"blk.{i}.attn_v.bias", hf + "self_attn.v_proj.bias", (kv,), None),
            (f"blk.{i}.ffn_gate_inp_shexp.weight", hf + "mlp.shared_expert_gate.weight", (m.hidden,), None),
            (
                f"blk.{i}.ffn_gate_shexp.weight",
                hf + "mlp.shared_expert.gate_proj.weight",
                (m.intermediate, m.hidden),
                None,
            ),
            (
                f"blk.{i}.ffn_up_shexp.weight",
                hf + "mlp.shared_expert.up_proj.weight",
                (m.intermediate, m.hidden),
                None,
            ),
            (
                f"blk.{i}.ffn_down_shexp.weight",
                hf + "mlp.shared_expert.down_proj.weight",
                (m.hidden, m.intermediate),
                None,
            ),
        ]
    return plan


def write_tiny_gpt_oss(path: Path, hf_model) -> None:  # type: ignore[no-untyped-def]
    """``hf_model`` (a transformers GptOssForCausalLM whose vocabulary is TINY_VOCAB) as llama.cpp's
    converter writes it: float32 tensors, each expert stack split into ``ffn_gate_exps`` and ``ffn_up_exps``
    ([E, I, H], outputs first) and ``ffn_down_exps``, their biases likewise, the sinks as
    ``attn_sinks.weight``, YaRN's parameters in the metadata."""
    cfg = hf_model.config
    src = read_header(default_gguf_path(), keep_arrays=TOKENIZER_ARRAYS)
    tokens = src.metadata["tokenizer.ggml.tokens"][:TINY_VOCAB]
    known = set(tokens)
    merges = [
        m for m in src.metadata["tokenizer.ggml.merges"] if {*m.split(" ", 1), m.replace(" ", "", 1)} <= known
    ]
    assert cfg.vocab_size == len(tokens), "the model's vocabulary is the cut tokenizer's"
    w = GGUFWriter(str(path), "gpt-oss")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_sliding_window(cfg.sliding_window)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(src.metadata["tokenizer.ggml.model"])
    w.add_tokenizer_pre(src.metadata.get("tokenizer.ggml.pre", "default"))
    w.add_token_list(tokens)
    w.add_token_types(src.metadata["tokenizer.ggml.token_type"][: len(tokens)])
    w.add_token_merges(merges)
    w.add_bos_token_id(src.metadata["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(src.metadata["tokenizer.ggml.eos_token_id"])
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "self_attn.sinks": "attn_sinks.weight",
        "mlp.router.weight": "ffn_gate_inp.weight",
        "mlp.router.bias": "ffn_gate_inp.bias",
    }
    for proj, short in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")):
        for kind in ("weight", "bias"):
            per_layer[f"self_attn.{proj}_proj.{kind}"] = f"attn_{short}.{kind}"
    for name, p in hf_model.state_dict().items():
        value = p.detach().float().numpy()
        if name in names:
            w.add_tensor(names[name], value)
            continue
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        blk = f"blk.{layer}"
        if rest in per_layer:
            w.add_tensor(f"{blk}.{per_layer[rest]}", value)
        elif rest == "mlp.experts.gate_up_proj":  # [E, H, 2I] -> gate and up [E, I, H]
            rows = value.swapaxes(1, 2)
            w.add_tensor(f"{blk}.ffn_gate_exps.weight", np.ascontiguousarray(rows[:, ::2]))
            w.add_tensor(f"{blk}.ffn_up_exps.weight", np.ascontiguousarray(rows[:, 1::2]))
        elif rest == "mlp.experts.gate_up_proj_bias":
            w.add_tensor(f"{blk}.ffn_gate_exps.bias", np.ascontiguousarray(value[:, ::2]))
            w.add_tensor(f"{blk}.ffn_up_exps.bias", np.ascontiguousarray(value[:, 1::2]))
        elif rest == "mlp.experts.down_proj":  # [E, I, H] -> [E, H, I]
            w.add_tensor(f"{blk}.ffn_down_exps.weight", np.ascontiguousarray(value.swapaxes(1, 2)))
        elif rest == "mlp.experts.down_proj_bias":
            w.add_tensor(f"{blk}.ffn_down_exps.bias", value)
        else:
            raise AssertionError(f"no GGUF name for {name}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
