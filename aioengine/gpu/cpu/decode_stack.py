"""CPU steps through cpu_decode_stack.c: all decoder layers in one C call, same bits as the Python path.

bf16: Llama-family layers (Llama, Mistral, SmolLM, Qwen2) and Gemma 3's, sliding windows and KV cache
groups included, once ``pack_linears`` has packed every linear for cpu_gemm.c and fused the MLP's
activation into gate_up. Steps of decodes only, and, where the packed prefill kernel runs
(``KernelConfig.cpu_prefill_attention``), steps that carry prompt chunks beside their decodes: with the
stack such a step costs its tokens, not the Python path's fixed cost per layer, which was the largest gap
between the serving ITL's median and its tail (docs/benchmarks.md).
float32 (the default of the levels without bf16 dots): Llama-family layers whose linears all run on their
GGUF codes (gpu/cpu/q8_linear.py), for steps of decodes that fit the codes' rows; the kernels themselves
are a small model's decode step, and Python between them was about as long again (docs/benchmarks.md).
Qwen3's q/k norms and float32 Gemma keep the Python path. ``KernelConfig.cpu_decode_stack=False`` turns
it off.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from aioengine.gpu.cpu.linear import PackedLinear
from aioengine.gpu.cpu.openmp import SleepWatch
from aioengine.gpu.cpu.q8_linear import Q8Linear
from aioengine.gpu.cpu.quant import QuantizedLinear
from aioengine.gpu.layers import SiluAndMul
from aioengine.kernels.cpu import clib as cpu_kernels
from aioengine.kernels.metadata import AttentionMetadata

_P, _I64, _F, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class _Q8Codes(ctypes.Structure):  # cpu_decode_stack.c's q8_codes
    _fields_ = [
        ("codes", _P),
        ("scales", _P),
        ("mins", _P),
        ("block", _I64),
        ("max_rows", _I64),
        ("fma", _I64),
    ]


class _LayerWeights(ctypes.Structure):  # cpu_decode_stack.c's layer_weights
    _fields_ = (
        [
            (name, _P)
            for name in (
                "input_norm",
                "post_norm",
                "qkv",
                "qkv_bias",
                "o",
                "o_bias",
                "gate_up",
                "down",
                "down_bias",
                "key_cache",
                "value_cache",
                "q_norm",
                "k_norm",
                "pre_ff_norm",
                "post_ff_norm",
                "cos2",
                "sin2",
            )
        ]
        + [("window", _I64), ("group", _I64)]
        + [(f"{n}_q8", _Q8Codes) for n in ("qkv", "o", "gate_up", "down")]
    )


class _StackArgs(ctypes.Structure):  # cpu_decode_stack.c's stack_args
    _fields_ = [
        ("hidden", _I64),
        ("intermediate", _I64),
        ("num_heads", _I64),
        ("num_kv_heads", _I64),
        ("head_dim", _I64),
        ("eps", _F),
        ("scale", _F),
        ("gemma", _I64),
        ("block_size", _I64),
        ("block_stride", _I64),
        ("token_stride", _I64),
        ("head_stride", _I64),
        ("num_slots", _I64),
        ("act_table", _P),
        ("rows", _I64),
        ("positions", _P),
        ("slots", _P),
        ("block_tables", _P),
        ("table_strides", _P),
        ("seq_lens", _P),
        ("normed", _P),
        ("qkv_out", _P),
        ("qk_normed", _P),
        ("qk_rotated", _P),
        ("attn", _P),
        ("act", _P),
        ("gate_up", _P),
        ("num_threads", _I),
        ("num_decodes", _I64),
        ("num_reqs", _I64),
        ("max_seq_len", _I64),
        ("query_start_loc", _P),
    ]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _gemm(module: Any) -> Any:
    """The packed GEMM of a linear (a Q8Linear keeps one beside its codes)."""
    return module.gemm if isinstance(module, Q8Linear) else module


def _packed(module: Any, epilogue: int) -> bool:
    gemm = _gemm(module)
    return isinstance(gemm, PackedLinear) and gemm.c_gemm and gemm.epilogue == epilogue


def _q8(module: Any) -> _Q8Codes:
    if isinstance(module, Q8Linear):
        mins = 0 if module.mins is None else module.mins.data_ptr()
        packed, scales = module.packed.data_ptr(), module.scales.data_ptr()
        return _Q8Codes(packed, scales, mins, module.block, module.max_rows, module.fma)
    if _quantized_f32(module):  # --quantization's float32 rows: the Python path's kernels on its codes
        int4 = module.int4_mins is not None  # affine 4-bit codes per 32 inputs, else int8 per output: block 0
        return _Q8Codes(
            module.packed.data_ptr(),
            module.scales_zeros.data_ptr(),
            module.int4_mins.data_ptr() if int4 else 0,
            32 if int4 else 0,
            module.max_rows_quantized,
            module.fma,
        )
    return _Q8Codes()


def _quantized_f32(module: Any) -> bool:
    """A float32 int4 or int8 linear whose few rows run on its codes (quant.py: the affine 4-bit block codes,
    or cpu_qgemv.c's int8 rows)."""
    return (
        isinstance(module, QuantizedLinear)
        and (module.int4_mins is not None or module.c_gemv)
        and module.weight is not None  # the stack's rows past its codes take the dequantized GEMM
        and module.weight.dtype == torch.float32
    )


class CpuDecodeStack:
    """The layers' pointers, gathered once; ``run`` fills a step's inputs and makes the call."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        rope_tables: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        mixed: bool = False,
    ) -> None:
        """``mixed``: take steps with prompt chunks too (where the Python path's attention would run them
        through the packed prefill kernel)."""
        decoder: Any = model.model  # a LlamaModel or Gemma3Model: its layers are read by attribute
        self.mixed = mixed
        self.dtype = kv_caches[0].dtype  # bf16 (packed GEMMs, codes for a few rows) or float32 (codes only)
        bf16 = self.dtype == torch.bfloat16
        self.watch = SleepWatch()
        first = decoder.layers[0]
        attn, mlp = first.self_attn, first.mlp
        cache = kv_caches[0]
        self.gemma = _is_gemma(first)
        self.num_groups = 1 + max(layer.self_attn.kv_group for layer in decoder.layers)
        self.layers = (_LayerWeights * len(decoder.layers))()
        tables = []
        for w, layer, kv in zip(self.layers, decoder.layers, kv_caches, strict=True):
            a, m = layer.self_attn, layer.mlp
            w.input_norm, w.post_norm = (
                _ptr(layer.input_layernorm.weight),
                _ptr(layer.post_attention_layernorm.weight),
            )
            w.qkv_bias, w.o_bias = _ptr(a.qkv_proj.bias), _ptr(a.o_proj.bias)
            w.down_bias = _ptr(m.down_proj.bias)
            if bf16:
                w.qkv, w.o = _ptr(_gemm(a.qkv_proj).packed), _ptr(_gemm(a.o_proj).packed)
                w.gate_up, w.down = _ptr(_gemm(m.gate_up_proj).packed), _ptr(_gemm(m.down_proj).packed)
            w.qkv_q8, w.o_q8 = _q8(a.qkv_proj), _q8(a.o_proj)
            w.gate_up_q8, w.down_q8 = _q8(m.gate_up_proj), _q8(m.down_proj)
            w.key_cache, w.value_cache = cpu_kernels.cache_pointers(kv)
            if self.gemma:
                w.q_norm, w.k_norm = _ptr(a.q_norm.weight), _ptr(a.k_norm.weight)
                w.pre_ff_norm = _ptr(layer.pre_feedforward_layernorm.weight)
                w.post_ff_norm = _ptr(layer.post_feedforward_layernorm.weight)
            cos2, sin2 = rope_tables(a.rotary_emb.cos_sin_cache)  # per layer: Gemma's local and global bases
            tables.append((cos2, sin2))
            w.cos2, w.sin2 = _ptr(cos2), _ptr(sin2)
            w.window, w.group = a.sliding_window or 0, a.kv_group
        self.args = _StackArgs(
            hidden=attn.o_proj.out_features,
            intermediate=mlp.gate_up_proj.out_features // 2,
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            eps=first.input_layernorm.variance_epsilon,
            scale=attn.scaling,
            gemma=self.gemma,
            block_size=cache.shape[2],
            block_stride=cache.stride(1),
            token_stride=cache.stride(2),
            head_stride=cache.stride(3),
            num_slots=cache.shape[1] * cache.shape[2],
            act_table=cpu_kernels.activation_table(mlp.gate_up_proj.activation).data_ptr() if bf16 else None,
        )
        # float32 runs every linear on its codes: a step past the fewest rows they take keeps the Python path
        self.max_rows = None if bf16 else min(_linears_max_rows(decoder.layers))
        self.widths = {
            "normed": self.args.hidden,
            "qkv_out": attn.q_size + 2 * attn.kv_size,
            "qk_normed": attn.q_size + attn.kv_size if self.gemma else 0,
            "qk_rotated": attn.q_size + attn.kv_size,
            "attn": attn.q_size,
            "act": self.args.intermediate,
            "gate_up": 0 if bf16 else 2 * self.args.intermediate,
        }
        self._keep = (kv_caches, tables)  # the pointers above stay valid while these live

    @staticmethod
    def build(
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        rope_tables: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        prefill_kernel: bool = True,
    ) -> CpuDecodeStack | None:
        """The stack for this model and cache, or None where the C call does not apply. ``rope_tables(cache)``
        gives the full-width ``(cos2, sin2)`` tables of a rotary ``cos_sin_cache``; ``prefill_kernel``: the
        backend runs prompt chunks through the packed prefill kernel (then so does the stack)."""
        if not kv_caches:
            return None
        decoder: Any = getattr(model, "model", None)
        dtype = kv_caches[0].dtype
        if not getattr(decoder, "layers", None) or dtype not in (torch.bfloat16, torch.float32):
            return None
        first = decoder.layers[0]
        eps, gemma = first.input_layernorm.variance_epsilon, _is_gemma(first)
        if dtype == torch.float32 and gemma:  # float32 Gemma's norms keep the torch reference
            return None
        check = _bf16_layer if dtype == torch.bfloat16 else _f32_layer
        for layer in decoder.layers:
            a, m = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if (
                a is None
                or getattr(m, "gate_up_proj", None) is None  # a routed block of experts: not in the stack
                or _is_gemma(layer) != gemma
                or (a.q_norm is not None) != gemma  # Qwen3's (plain RMSNorm) q/k norms are not in the stack
                or not check(a, m, gemma)
                or any(n.variance_epsilon != eps for n in _norms(layer))
            ):
                return None
            cos2, _ = rope_tables(a.rotary_emb.cos_sin_cache)
            if cos2.dtype != dtype or not cos2.is_contiguous():
                return None
        attn = first.self_attn
        query = torch.empty(1, attn.num_heads, attn.head_dim, dtype=dtype)  # the decode kernel's limits
        if not cpu_kernels.supports(query, kv_caches[0]):
            return None
        mixed = prefill_kernel and cpu_kernels.fast_prefill(query, kv_caches[0])
        return CpuDecodeStack(model, kv_caches, rope_tables, mixed)

    def takes(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A step of decodes only, or (``mixed``) of decodes and prompt chunks; no padding rows."""
        rows = input_ids.shape[0]
        if meta.num_decodes == meta.num_reqs == rows > 0:
            return self.max_rows is None or rows <= self.max_rows
        starts = meta.query_start_loc_cpu
        return self.mixed and meta.num_reqs > 0 and starts[-1] == meta.num_actual_tokens == rows

    def run(
        self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings ``[rows, H]`` -> (the last layer's output, the residual stream), both ``[rows, H]``."""
        rows = hidden.shape[0]
        hidden = hidden.contiguous()
        residual = torch.empty_like(hidden)
        scratch = {
            name: torch.empty((rows, width), dtype=self.dtype) for name, width in self.widths.items() if width
        }
        positions = (
            positions
            if positions.dtype == torch.int64 and positions.is_contiguous()
            else positions.to(torch.int64).contiguous()
        )
        groups = [meta.for_group(g) for g in range(self.num_groups)]
        slots = [
            m.slot_mapping if m.slot_mapping.dtype == torch.int64 else m.slot_mapping.long() for m in groups
        ]
        tables = [
            m.block_table if m.block_table.dtype == torch.int32 else m.block_table.int() for m in groups
        ]
        seq_lens = meta.seq_lens if meta.seq_lens.dtype == torch.int32 else meta.seq_lens.to(torch.int32)
        assert all(t.stride(1) == 1 for t in tables) and all(s.is_contiguous() for s in slots)
        assert seq_lens.is_contiguous()
        slot_ptrs = (ctypes.c_void_p * self.num_groups)(*(s.data_ptr() for s in slots))
        table_ptrs = (ctypes.c_void_p * self.num_groups)(*(t.data_ptr() for t in tables))
        table_strides = (ctypes.c_int64 * self.num_groups)(*(t.stride(0) for t in tables))
        starts = torch.tensor(meta.query_start_loc_cpu, dtype=torch.int64)
        a = self.args
        a.rows, a.positions, a.seq_lens = rows, positions.data_ptr(), seq_lens.data_ptr()
        a.num_decodes, a.num_reqs, a.max_seq_len = meta.num_decodes, meta.num_reqs, meta.max_seq_len
        a.query_start_loc = starts.data_ptr()
        a.slots, a.block_tables = ctypes.addressof(slot_ptrs), ctypes.addressof(table_ptrs)
        a.table_strides = ctypes.addressof(table_strides)
        for name, t in scratch.items():
            setattr(a, name, t.data_ptr())
        a.num_threads = torch.get_num_threads()
        lib = cpu_kernels.load()
        assert lib is not None  # build() found the C kernels
        fn = lib.decode_stack_bf16 if self.dtype == torch.bfloat16 else lib.decode_stack_f32
        status = self.watch.run(  # hundreds of parallel regions in one call: where throttling shows
            fn,
            ctypes.addressof(self.layers),
            len(self.layers),
            ctypes.addressof(a),
            hidden.data_ptr(),
            residual.data_ptr(),
        )
        if status == -3:
            raise MemoryError(f"{fn.__name__}: a kernel found no memory for its scratch")
        assert status == 0, f"{fn.__name__} failed ({status})"
        return hidden, residual


def _bf16_layer(a: Any, m: Any, gemma: bool) -> bool:
    """Every linear packed for cpu_gemm.c, the MLP's activation fused into gate_up."""
    return (
        _packed(a.qkv_proj, cpu_kernels.GEMM_BF16)
        and _packed(a.o_proj, cpu_kernels.GEMM_BF16)
        and isinstance(m.act_fn, nn.Identity)
        and _packed(m.gate_up_proj, cpu_kernels.GEMM_ACT_MUL)
        and m.gate_up_proj.activation == ("gelu_tanh" if gemma else "silu")
        and _packed(m.down_proj, cpu_kernels.GEMM_BF16)
    )


def _f32_layer(a: Any, m: Any, gemma: bool) -> bool:
    """Every linear on float32 rows' codes (a float32 Q8Linear, or int4's or int8's), silu * up after an
    unbiased gate_up."""
    linears = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
    return (
        not gemma
        and all(_quantized_f32(q) or _f32_codes(q) for q in linears)
        and type(m.act_fn) is SiluAndMul
        and m.gate_up_proj.bias is None
    )


def _f32_codes(q: Any) -> bool:
    return isinstance(q, Q8Linear) and q.dtype == torch.float32 and q.activation is None


def _linears_max_rows(layers: Any) -> list[int]:
    return [
        q.max_rows_quantized if isinstance(q, QuantizedLinear) else q.max_rows
        for layer in layers
        for q in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj)
        + (layer.mlp.down_proj,)
    ]


def _is_gemma(layer: nn.Module) -> bool:
    """Gemma 3's layer shape: (1 + w) norms before and after attention and the MLP, q/k norms."""
    return hasattr(layer, "pre_feedforward_layernorm") and hasattr(layer, "post_feedforward_layernorm")


def _norms(layer: Any) -> list[Any]:
    names = (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    )
    norms = [getattr(layer, n) for n in names if hasattr(layer, n)]
    return norms + [n for n in (layer.self_attn.q_norm, layer.self_attn.k_norm) if n is not None]
