"""The Llama family (Llama 2/3, SmolLM, Mistral) over the flat batch and the paged KV cache.

Parameter names follow Hugging Face except the fused ``qkv_proj`` and ``gate_up_proj``, which
``load_weights`` fills from ``q/k/v_proj`` and ``gate/up_proj`` (vLLM's stacked params).
Qwen2/Qwen3 reuse these classes with the switches in ``LlamaForCausalLM``'s class attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import nn
from torch.nn.utils import skip_init

from aioengine.gpu.backend import REFERENCE_OPS, Ops
from aioengine.gpu.layers import RMSNorm, RotaryEmbedding, SiluAndMul, get_rope
from aioengine.kernels.metadata import AttentionMetadata
from aioengine.sched.kv_cache_spec import KVCacheGroup, kv_cache_groups, layer_slots

# Our fused linears and the checkpoint's tensors they hold, stacked by rows in this order.
FUSED_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: Any) -> nn.Linear:
    # Weights come from the checkpoint: skip the (slow, useless) random init.
    return skip_init(nn.Linear, in_features, out_features, bias=bias, dtype=dtype, device=device)


def head_dim_of(config: Any) -> int:
    """``config.head_dim`` when set, else hidden_size / num_attention_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config: Any) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        device: Any,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        rotary_emb: RotaryEmbedding,
        ops: Ops,
        sliding_window: int | None = None,
        kv_group: int = 0,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.sliding_window = sliding_window  # this layer's window (None: full attention)
        self.kv_group = kv_group  # its KV cache group: whose block table and slots it uses
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = num_kv_heads_of(config)
        assert self.num_heads % self.num_kv_heads == 0, "GQA needs heads to be a multiple of KV heads"
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        hidden = config.hidden_size
        self.qkv_proj = _linear(hidden, self.q_size + 2 * self.kv_size, qkv_bias, dtype, device)
        cast(Any, self.qkv_proj).shard_offsets = {
            "q_proj": (0, self.q_size),
            "k_proj": (self.q_size, self.kv_size),
            "v_proj": (self.q_size + self.kv_size, self.kv_size),
        }
        self.o_proj = _linear(self.q_size, hidden, o_bias, dtype, device)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if qk_norm:  # Qwen3: per-head RMSNorm on q and k before RoPE
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device, ops)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device, ops)
        self.rotary_emb = rotary_emb  # shared by all layers
        # gpt-oss: each head's learned sink logit, in every softmax's denominator
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=dtype, device=device)) if sinks else None

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            assert self.k_norm is not None  # set together with q_norm
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        meta = meta.for_group(self.kv_group)
        self.ops.store_kv(k, v, kv_cache, meta.slot_mapping)
        # only a layer with sinks passes them: an op set without the argument serves every other model
        sinks = {} if self.sinks is None else {"sinks": self.sinks}
        out = self.ops.attention(q, kv_cache, meta, self.scaling, window=self.sliding_window, **sinks)
        return self.ops.all_reduce(self.o_proj(out.view(num_tokens, self.q_size)))


class LlamaMLP(nn.Module):
    def __init__(
        self, config: Any, dtype: torch.dtype, device: Any, ops: Ops, act_fn: nn.Module | None = None
    ) -> None:
        """``act_fn``: the gated activation over the fused gate_up output (default SiluAndMul)."""
        super().__init__()
        if act_fn is None:
            assert getattr(config, "hidden_act", "silu") == "silu", (
                f"unsupported hidden_act {config.hidden_act}"
            )
            act_fn = SiluAndMul(ops)
        inter = config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = _linear(config.hidden_size, 2 * inter, bias, dtype, device)
        cast(Any, self.gate_up_proj).shard_offsets = {"gate_proj": (0, inter), "up_proj": (inter, inter)}
        self.down_proj = _linear(inter, config.hidden_size, bias, dtype, device)
        self.act_fn = act_fn
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.all_reduce(self.down_proj(self.act_fn(self.gate_up_proj(x))))


def sliding_window(cfg: Any) -> int | None:
    """The attention window a config asks for (Mistral: `sliding_window`; Qwen: only with
    `use_sliding_window`), or None."""
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    window = get("sliding_window")
    return int(window) if window and get("use_sliding_window", True) else None


def layer_windows(config: Any, layer_types: list[str] | None = None) -> list[int | None]:
    """Each layer's attention window: the config's ``sliding_window`` on the layers ``layer_types`` (by
    default the config's) marks "sliding_attention" (every layer when there are none, as Mistral), or None
    for full attention."""
    window = sliding_window(config)
    types = layer_types if layer_types is not None else getattr(config, "layer_types", None)
    n = config.num_hidden_layers
    if window is None:
        return [None] * n
    if types is None:
        return [window] * n
    assert len(types) == n, f"layer_types names {len(types)} layers, the model has {n}"
    return [window if t == "sliding_attention" else None for t in types]


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        device: Any,
        ops: Ops,
        mlp: nn.Module | None = None,
        **attn_switches: Any,
    ) -> None:
        """``mlp``: the layer's feed-forward block (default: a LlamaMLP; a routed block of experts)."""
        super().__init__()
        self.self_attn = LlamaAttention(config, dtype, device, ops=ops, **attn_switches)
        self.mlp = mlp if mlp is not None else LlamaMLP(config, dtype, device, ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, ops)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # vLLM's residual threading: each norm also performs the previous residual add.
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, meta)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        device: Any,
        ops: Ops,
        make_mlp: Callable[[int], nn.Module | None] | None = None,
        **attn_switches: bool,
    ) -> None:
        """``make_mlp(layer_index)``: that layer's feed-forward block, or None for the default LlamaMLP."""
        super().__init__()
        self.embed_tokens = skip_init(
            nn.Embedding, config.vocab_size, config.hidden_size, dtype=dtype, device=device
        )
        rope = get_rope(head_dim_of(config), config.max_position_embeddings, config, dtype, device, ops)
        windows = layer_windows(config)
        self.kv_cache_groups = kv_cache_groups(windows)
        slots = layer_slots(self.kv_cache_groups, len(windows))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config,
                dtype,
                device,
                ops,
                mlp=make_mlp(i) if make_mlp is not None else None,
                rotary_emb=rope,
                sliding_window=w,
                kv_group=g,
                **attn_switches,
            )
            for i, (w, (g, _)) in enumerate(zip(windows, slots, strict=True))
        )
        self.norm: nn.Module = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, ops)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        assert len(kv_caches) == len(self.layers), "one KV cache per layer"
        hidden_states = self.embed(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, residual = layer(positions, hidden_states, residual, kv_cache, meta)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """``forward`` maps the flat batch to hidden states; ``compute_logits`` maps chosen rows to logits."""

    qk_norm = False  # Qwen3 turns this on
    attention_sinks = False  # gpt-oss turns this on
    has_experts = False  # a mixture of experts (moe.py) turns this on

    @classmethod
    def attention_biases(cls, config: Any) -> tuple[bool, bool]:
        """(qkv_proj bias, o_proj bias) for this architecture."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def __init__(
        self, config: Any, dtype: torch.dtype = torch.float32, device: Any = "cpu", ops: Ops = REFERENCE_OPS
    ) -> None:
        """``ops``: the backend's op set (the torch references by default)."""
        super().__init__()
        self.config = config
        self.ops = ops
        qkv_bias, o_bias = self.attention_biases(config)
        self.model = LlamaModel(
            config,
            dtype,
            device,
            ops,
            make_mlp=lambda i: self.make_mlp(config, i, dtype, device, ops),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=self.qk_norm,
            sinks=self.attention_sinks,
        )
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens  # same weight; the checkpoint may omit lm_head
        else:
            self.lm_head = _linear(config.hidden_size, config.vocab_size, False, dtype, device)

    def make_mlp(
        self, config: Any, layer: int, dtype: torch.dtype, device: Any, ops: Ops
    ) -> nn.Module | None:
        """Layer ``layer``'s feed-forward block; None: the dense LlamaMLP (a mixture of experts overrides)."""
        return None

    @property
    def kv_cache_groups(self) -> tuple[KVCacheGroup, ...]:
        """The layers grouped by attention window, as the KV cache manager and the runner lay them out."""
        groups: tuple[KVCacheGroup, ...] = self.model.kv_cache_groups
        return groups

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions ``[T]`` (int64) -> hidden states ``[T, hidden_size]``."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden ``[N, hidden_size]`` -> logits ``[N, vocab_size]`` in the model's dtype, or float32 from a
        head packed for cpu_gemm.c (the sampler widens bf16 logits when it does more than an argmax)."""
        head = self.lm_head
        if isinstance(head, nn.Embedding):  # tied
            return nn.functional.linear(hidden_states, head.weight)
        return head(hidden_states)  # nn.Linear, a packed or a quantized head

    def cover_positions(self, max_model_len: int) -> None:
        """Make the rotary table reach ``max_model_len`` positions (it holds ``max_position_embeddings``):
        past the trained context RoPE extrapolates, as transformers computes it, instead of reading
        past the table's end."""
        layers = self.model.layers
        table = cast(LlamaAttention, layers[0].self_attn).rotary_emb.cos_sin_cache if len(layers) else None
        if table is None or table.shape[0] >= max_model_len:
            return
        rope = get_rope(
            head_dim_of(self.config), max_model_len, self.config, table.dtype, table.device, self.ops
        )
        for layer in layers:
            cast(LlamaAttention, layer.self_attn).rotary_emb = rope

    def compute_greedy(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The greedy token of each row (int64 ``[N]``) straight from the head, where it can pick it without
        writing the logits (a head packed for cpu_gemm.c: the argmax of the float32 logits ``compute_logits``
        returns; a Q8Head: its exact dots' pick, q8_head.py); else None."""
        argmax = getattr(self.lm_head, "argmax", None)
        return argmax(hidden_states) if argmax is not None else None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters, casting to their dtype and device."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        expected: set[tuple[str, str | None]] = set()  # (param, shard) pairs the checkpoint must fill
        for name in params:
            offsets = getattr(modules[name.rpartition(".")[0]], "shard_offsets", None)
            expected |= {(name, shard) for shard in offsets} if offsets else {(name, None)}
        loaded: set[tuple[str, str | None]] = set()
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue
            if hf_name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # tied: the embedding is the head
            name, shard = self._param_name(hf_name)
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for {type(self).__name__}")
            target = params[name].data
            if shard is not None:
                offsets = modules[name.rpartition(".")[0]].shard_offsets[shard]
                if len(offsets) == 3:  # (expert, start, size): rows of one expert in a stacked [E, ...]
                    target = target[offsets[0]]
                target = target.narrow(0, offsets[-2], offsets[-1])
            if target.shape != tensor.shape:
                raise ValueError(
                    f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add((name, shard))
        missing = sorted(f"{n}[{s}]" if s else n for n, s in expected - loaded)
        if missing:
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}{more}")

    def _param_name(self, hf_name: str) -> tuple[str, str | None]:
        """HF name -> (our parameter name, shard of a fused parameter or None)."""
        for fused, shards in FUSED_SHARDS.items():
            for shard in shards:
                if f".{shard}." in hf_name:
                    return hf_name.replace(f".{shard}.", f".{fused}."), shard
        return hf_name, None
