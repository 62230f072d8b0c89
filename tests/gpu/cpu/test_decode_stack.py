"""cpu_decode_stack.c: a step's decoder layers in one C call give the Python path's bits exactly (hidden
states and the KV cache it writes), for decodes and for prompt chunks beside them (bf16), and for float32
decodes on the layers' block codes (every level with vectorized codes), and the stack steps aside where it
does not apply."""

from types import SimpleNamespace

import pytest
import torch

from aioengine.config import KernelConfig
from aioengine.gpu.cpu.backend import CpuBackend
from aioengine.gpu.cpu.decode_stack import CpuDecodeStack
from aioengine.gpu.cpu.linear import pack_linears
from aioengine.gpu.cpu.q8_linear import Q8Linear
from aioengine.gpu.cpu.quant import QuantizedLinear, quantize_model
from aioengine.gpu.loader import load_model
from aioengine.kernels.cpu import clib as cpu_kernels
from aioengine.kernels.cpu import q8
from aioengine.kernels.metadata import AttentionMetadata
from tests.engine.conftest import make_tiny_checkpoint
from tests.gpu.cpu.block_coded import as_block_codes, attach_codes

needs_gemm = pytest.mark.skipif(
    not cpu_kernels.gemm_available(), reason="needs the AVX512-BF16 build of the C kernels"
)
needs_codes = pytest.mark.skipif(not q8.available(), reason="cpu_q8.c is not vectorized at this level")
BLOCK = 16


# Gemma 3: two windowed layers (window 16, so the longer rows attend past it) and a full one, three KV groups
GEMMA = dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=16)


def _model(
    tmp_path,
    arch: str,
    head_dim: int = 64,
    codes: bool = False,
    q4_1: bool = False,
    dtype=torch.bfloat16,
    quantization: str | None = None,
):
    """A tiny random checkpoint (conftest's, heads of 64 or 128 for the AVX512-BF16 attention loop) in
    ``dtype``, packed; ``codes``: its projections exact block codes (``q4_1``: all Q4_1), run on them
    (gpu/cpu/q8_linear.py); ``quantization``: its linears quantized first (gpu/cpu/quant.py)."""
    hf = make_tiny_checkpoint(
        arch,
        tmp_path,
        **(GEMMA if arch == "gemma3" else {}),
        hidden_size=384,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=head_dim,
        vocab_size=300,
    )
    if codes:
        as_block_codes(hf, q4_1=q4_1)
        hf.save_pretrained(tmp_path)
    backend = CpuBackend()
    model, cfg = load_model(tmp_path, dtype=dtype, ops=backend.ops)
    if quantization is not None:
        quantize_model(model, quantization)
    pack_linears(model)
    if codes:
        assert attach_codes(model, tmp_path) == 4 * cfg.num_hidden_layers
    return model, cfg, backend


def _kv(backend, cfg, num_blocks, dtype=torch.bfloat16):
    return backend.allocate_kv_caches(cfg, num_blocks, BLOCK, dtype)


def _decode(model, cfg, backend, stack: bool, seq_lens: list[int], query_lens: list[int] | None = None):
    """One step through the backend over caches filled with noise: (hidden states, caches after it). Each
    request's query is its last ``query_lens`` tokens (default 1: decodes; decodes come first)."""
    gen = torch.Generator().manual_seed(len(seq_lens))
    query_lens = query_lens or [1] * len(seq_lens)
    rows = len(seq_lens)
    tokens = sum(query_lens)
    max_blocks = -(-max(seq_lens) // BLOCK)
    kv = _kv(backend, cfg, rows * max_blocks + 3, model.model.norm.weight.dtype)
    for cache in kv:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    table = (
        torch.randperm(rows * max_blocks + 3, generator=gen)[: rows * max_blocks].view(rows, max_blocks).int()
    )
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=gen)
    positions = torch.tensor([p for n, q in zip(seq_lens, query_lens, strict=True) for p in range(n - q, n)])
    req = torch.repeat_interleave(torch.arange(rows), torch.tensor(query_lens))
    runner = SimpleNamespace(model=model, kv_caches=kv, lora_active=False)
    backend.decode_stack = None
    if stack:
        backend.build_fast_paths(runner, None, 0)
    assert (backend.decode_stack is not None) == stack
    meta = AttentionMetadata.build(query_lens, seq_lens, table, BLOCK)
    groups = 1 + max(layer.self_attn.kv_group for layer in model.model.layers)
    views = []
    for _ in range(1, groups):  # each further KV group has its own blocks for the same positions
        other = table[torch.randperm(rows, generator=gen)]
        slots = other.long()[req].gather(1, (positions // BLOCK)[:, None])[:, 0] * BLOCK + positions % BLOCK
        views.append((other, slots))
    meta.add_group_views(views)
    with torch.inference_mode():
        hidden = backend.forward(runner, ids, positions, meta)
    return hidden, kv


@needs_gemm
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("seq_lens", [[1], [17, 1, 40, 33, 16], [300] * 3, [5 + 7 * i for i in range(29)]])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_stack_gives_the_python_paths_bits(tmp_path, arch, seq_lens, head_dim):
    model, cfg, backend = _model(tmp_path, arch, head_dim)
    want, want_kv = _decode(model, cfg, backend, False, seq_lens)
    got, got_kv = _decode(model, cfg, backend, True, seq_lens)
    assert torch.equal(got, want)
    assert all(torch.equal(g, w) for g, w in zip(got_kv, want_kv, strict=True))


@needs_gemm
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize(
    ("seq_lens", "query_lens"),
    [
        ([17, 40, 33], [1, 1, 33]),  # decodes and a whole prompt
        ([9, 300, 70, 5], [1, 1, 20, 1]),  # a prompt chunk after cached blocks, a one-token chunk last
        ([90, 64], [90, 7]),  # prompt chunks only (past the window of Gemma's windowed layers)
    ],
)
def test_steps_with_prompt_chunks_give_the_python_paths_bits(tmp_path, arch, seq_lens, query_lens):
    model, cfg, backend = _model(tmp_path, arch)
    want, want_kv = _decode(model, cfg, backend, False, seq_lens, query_lens)
    got, got_kv = _decode(model, cfg, backend, True, seq_lens, query_lens)
    assert backend.decode_stack.mixed
    assert torch.equal(got, want)
    assert all(torch.equal(g, w) for g, w in zip(got_kv, want_kv, strict=True))


@needs_gemm
@needs_codes
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize(
    ("seq_lens", "query_lens"),
    [([40], None), ([17, 33], None), ([17, 1, 40, 33, 16], None), ([17, 40, 33], [1, 1, 33])],
)
@pytest.mark.parametrize("q4_1", [False, True])
def test_the_stack_on_block_codes_gives_the_python_paths_bits(tmp_path, arch, seq_lens, query_lens, q4_1):
    """Steps of up to each linear's max_rows run its codes (blocks of 32 to 2 rows, of 16 one row), larger
    ones the GEMMs, in both paths alike; Q4_1's 4-bit codes and offsets too."""
    model, cfg, backend = _model(tmp_path, arch, codes=True, q4_1=q4_1)
    assert all((m.mins is not None) == q4_1 for m in model.modules() if isinstance(m, Q8Linear))
    want, want_kv = _decode(model, cfg, backend, False, seq_lens, query_lens)
    got, got_kv = _decode(model, cfg, backend, True, seq_lens, query_lens)
    assert torch.equal(got, want)
    assert all(torch.equal(g, w) for g, w in zip(got_kv, want_kv, strict=True))


@needs_gemm
def test_the_stack_steps_aside_where_it_does_not_apply(tmp_path):
    model, cfg, backend = _model(tmp_path, "llama")
    kv = _kv(backend, cfg, 8)
    stack = CpuDecodeStack.build(model, kv, backend.ops.rope_tables)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    ids = torch.zeros(3, dtype=torch.int64)
    assert stack.takes(ids[:2], AttentionMetadata.build([1, 1], [5, 9], table, BLOCK))
    assert stack.takes(ids, AttentionMetadata.build([1, 2], [5, 9], table, BLOCK))  # with a prompt chunk
    assert not stack.takes(ids, AttentionMetadata.build([1, 1], [5, 9], table, BLOCK))  # padded rows
    # without the packed prefill kernel the Python path runs prompt chunks through SDPA: the stack does not
    no_prefill = CpuDecodeStack.build(model, kv, backend.ops.rope_tables, prefill_kernel=False)
    assert not no_prefill.takes(ids, AttentionMetadata.build([1, 2], [5, 9], table, BLOCK))
    assert no_prefill.takes(ids[:2], AttentionMetadata.build([1, 1], [5, 9], table, BLOCK))
    runner = SimpleNamespace(model=model, kv_caches=kv, lora_active=False)
    for off in (
        KernelConfig(cpu_elementwise=False),
        KernelConfig(cpu_decode_stack=False),
    ):  # torch paths; off
        other = CpuBackend(off)
        other.build_fast_paths(runner, None, 0)
        assert other.decode_stack is None
    backend.build_fast_paths(runner, None, 0)
    assert backend.decode_stack is not None


@needs_gemm
def test_qwen3_keeps_the_python_path(tmp_path):
    model, cfg, backend = _model(tmp_path / "q3", "qwen3")  # per-head q/k norms: not in the C stack
    assert CpuDecodeStack.build(model, _kv(backend, cfg, 4), backend.ops.rope_tables) is None


@needs_gemm
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_heads_greedy_pick_is_the_argmax_of_its_logits(tmp_path, arch):
    """model.compute_greedy (the runner's path for plain greedy rows) against compute_logits + argmax,
    tied (llama) and untied (qwen2) heads."""
    model, cfg, _ = _model(tmp_path, arch)
    hidden = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    with torch.inference_mode():
        picked = model.compute_greedy(hidden)
        assert picked is not None and torch.equal(picked, model.compute_logits(hidden).argmax(-1))


@needs_gemm
@needs_codes
@pytest.mark.parametrize("stack", [True, False])
def test_prompt_rows_take_the_gemm_and_decode_rows_the_codes(tmp_path, stack):
    """A step of one prompt chunk of 2 rows gives the bits of the same model without codes (the backend and
    the C stack both keep prompts on the GEMM); a step of 2 decodes does not (it runs on the codes)."""
    model, cfg, backend = _model(tmp_path, "llama", codes=True, q4_1=True)
    coded, _ = _decode(model, cfg, backend, stack, [40], [2])
    decoded, _ = _decode(model, cfg, backend, stack, [40, 17])
    for module in model.modules():
        for name, child in list(module.named_children()):
            if isinstance(child, Q8Linear):
                setattr(module, name, child.gemm)
    plain, _ = _decode(model, cfg, backend, stack, [40], [2])
    assert torch.equal(coded, plain)
    assert not torch.equal(decoded, _decode(model, cfg, backend, stack, [40, 17])[0])


@needs_codes
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("seq_lens", [[1], [40], [17, 1, 40, 33, 16], [5 + 7 * i for i in range(16)]])
@pytest.mark.parametrize("q4_1", [False, True])
def test_the_float32_stack_on_block_codes_gives_the_python_paths_bits(tmp_path, arch, seq_lens, q4_1):
    """float32 decodes (the default dtype of the levels without bf16 dots) on the layers' codes: the C stack
    gives the hidden states and KV cache of the Python path (Qwen2: the qkv bias too), up to 16 rows."""
    model, cfg, backend = _model(tmp_path, arch, codes=True, q4_1=q4_1, dtype=torch.float32)
    want, want_kv = _decode(model, cfg, backend, False, seq_lens)
    got, got_kv = _decode(model, cfg, backend, True, seq_lens)
    assert torch.equal(got, want)
    assert all(torch.equal(g, w) for g, w in zip(got_kv, want_kv, strict=True))


@needs_codes
def test_the_float32_stack_takes_decodes_the_codes_take(tmp_path):
    """Past the codes' rows, with a prompt chunk, without codes, for float32 Gemma: the Python path."""
    model, cfg, backend = _model(tmp_path / "l", "llama", codes=True, dtype=torch.float32)
    kv = _kv(backend, cfg, 40, torch.float32)
    stack = CpuDecodeStack.build(model, kv, backend.ops.rope_tables)
    assert stack is not None and not stack.mixed and stack.max_rows == 16
    table = torch.arange(34, dtype=torch.int32).view(17, 2)
    ids = torch.zeros(17, dtype=torch.int64)
    assert stack.takes(ids[:16], AttentionMetadata.build([1] * 16, [9] * 16, table[:16], BLOCK))
    assert not stack.takes(ids, AttentionMetadata.build([1] * 17, [9] * 17, table, BLOCK))
    assert not stack.takes(ids[:3], AttentionMetadata.build([1, 2], [5, 9], table[:2], BLOCK))
    plain, cfg, backend = _model(tmp_path / "p", "llama", dtype=torch.float32)
    assert CpuDecodeStack.build(plain, _kv(backend, cfg, 4, torch.float32), backend.ops.rope_tables) is None
    gemma, cfg, backend = _model(tmp_path / "g", "gemma3", codes=True, dtype=torch.float32)
    assert CpuDecodeStack.build(gemma, _kv(backend, cfg, 4, torch.float32), backend.ops.rope_tables) is None


@needs_codes
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("seq_lens", [[1], [17, 1, 40, 33, 16], [5 + 7 * i for i in range(8)]])
@pytest.mark.parametrize("method", ["int4", "int8"])
def test_the_float32_stack_takes_quantized_layers_with_python_paths_bits(tmp_path, arch, seq_lens, method):
    """--quantization int4 and int8 in float32: their linears' codes (affine 4-bit per 32 inputs; int8 per
    output) go through the stack, up to their 8 rows, with the Python path's hidden states and KV cache."""
    model, cfg, backend = _model(tmp_path, arch, dtype=torch.float32, quantization=method)
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantizedLinear)
    want, want_kv = _decode(model, cfg, backend, False, seq_lens)
    got, got_kv = _decode(model, cfg, backend, True, seq_lens)
    assert torch.equal(got, want)
    assert all(torch.equal(g, w) for g, w in zip(got_kv, want_kv, strict=True))
    assert backend.decode_stack.max_rows == 8
