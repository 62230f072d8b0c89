"""Every Triton kernel compiles for the H200 (sm_90) without a GPU.

The interpreter runs the kernels' Python but not Triton's compiler, which has its own rules (constexpr
typing, minimum ``tl.dot`` shapes, int widths). Triton compiles ahead of time for any target with its
bundled LLVM and ptxas, so a subprocess (the kernels decorated without ``TRITON_INTERPRET``) builds
the cubins the engine's launches will ask for.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from aioengine.kernels.triton.activation import _silu_and_mul_kernel
from aioengine.kernels.triton.kv_store import _store_kv_kernel
from aioengine.kernels.triton.norm_rope import _rms_norm_kernel, _rope_kernel
from aioengine.kernels.triton.attention import _paged_attention_kernel
from aioengine.kernels.triton.moe import _grouped_gemm_kernel

TARGET = GPUTarget("cuda", 90, 32)


def build(kernel, pointers, constants, scalars=()):
    names = kernel.arg_names
    signature = {}
    for name in names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in scalars else "i32"
    source = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constants.items()})
    compiled = triton.compile(source, target=TARGET, options={"num_warps": 4})
    assert compiled.asm["cubin"], kernel


for dtype, ptr in ((tl.bfloat16, "*bf16"), (tl.float32, "*fp32")):
    tensors = dict.fromkeys(("out_ptr", "query_ptr", "key_cache_ptr", "value_cache_ptr"), ptr)
    tensors.update(block_table_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32")
    # Llama-3-8B decode and prefill tiles, a Qwen3-tiny head (24) with an odd GQA group.
    for head_dim, group, block_m in ((128, 4, 16), (128, 4, 64), (24, 3, 16)):
        build(
            _paged_attention_kernel,
            tensors,
            dict(
                HEAD_DIM=head_dim, HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)), GROUP=group,
                BLOCK_SIZE=16, BLOCK_M=block_m, BLOCK_Q=block_m // group, TILE=32, DOT_DTYPE=dtype,
                DOT_PRECISION="ieee" if dtype == tl.float32 else "tf32", INTERPRET=False,
            ),
            scalars=("scale_log2",),
        )
    kv = dict.fromkeys(("key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr"), ptr)
    build(_store_kv_kernel, {**kv, "slot_mapping_ptr": "*i64"},
          dict(HEAD_DIM=128, BLOCK_SIZE=16, HEADS_P=8, HEAD_DIM_P=128, INTERPRET=False))
    norm = dict.fromkeys(("out_ptr", "residual_out_ptr", "x_ptr", "residual_ptr", "weight_ptr"), ptr)
    for residual, block in ((True, 4096), (False, 128)):
        build(_rms_norm_kernel, norm, dict(HAS_RESIDUAL=residual, BLOCK=block, INTERPRET=False), ("eps",))
    rope = dict.fromkeys(("q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr", "cache_ptr"), ptr)
    build(_rope_kernel, {**rope, "positions_ptr": "*i64"},
          dict(HALF=64, HALF_P=64, Q_HEADS_P=32, K_HEADS_P=8, INTERPRET=False))
    build(_silu_and_mul_kernel, {"out_ptr": ptr, "x_ptr": ptr}, dict(BLOCK=1024, INTERPRET=False))
    moe = {"a_ptr": ptr, "w_ptr": ptr, "c_ptr": ptr, "pairs_ptr": "*i64", "block_expert_ptr": "*i64"}
    build(_grouped_gemm_kernel, moe, dict(BLOCK_N=64, BLOCK_K=64, TILE_M=16, DOT_DTYPE=dtype,
          DOT_PRECISION="ieee" if dtype == tl.float32 else "tf32", INTERPRET=False))
print("compiled")
"""


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence 3.9's notice; fusion is its default
    root = str(Path(__file__).resolve().parents[3])  # the repository root
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-4000:]
