/* AVX512 helpers shared by the kernels (cpu_decode_attention.c, cpu_prefill_attention.c, cpu_gemm.c,
 * cpu_elementwise.c). */
#ifndef AIOENGINE_CPU_AVX512_H
#define AIOENGINE_CPU_AVX512_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "cpu_bf16.h"

/* The first min(left, 16) lanes (none for left <= 0): a vector's share of a row's tail. */
static inline __mmask16 lanes_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
}

/* 16 bf16 bit patterns (the low halves of 16 words) as the float32 values they are: exact. */
static inline __m512 widen_bf16_bits(__m256i bits) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* 16 bf16 from memory widened to float32; masked lanes read nothing and are 0. */
static inline __m512 widen_bf16x16(const uint16_t *p, __mmask16 mask) {
    return widen_bf16_bits(_mm256_maskz_loadu_epi16(mask, p));
}

/* In place: r[i] dword j <- r[j] dword i (a 16x16 transpose of 32-bit elements, 64 shuffles). */
static inline void transpose16x16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* u[4i + j], 128-bit lane L: rows 4i..4i+3 of column 4L + j */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) { /* gather lane L of u[j], u[4+j], u[8+j], u[12+j] into column 4L + j */
        const __m512i y0 = _mm512_shuffle_i32x4(u[j], u[4 + j], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i y1 = _mm512_shuffle_i32x4(u[j], u[4 + j], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512i y2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i y3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(3, 2, 3, 2));
        r[j] = _mm512_shuffle_i32x4(y0, y2, _MM_SHUFFLE(2, 0, 2, 0));
        r[4 + j] = _mm512_shuffle_i32x4(y0, y2, _MM_SHUFFLE(3, 1, 3, 1));
        r[8 + j] = _mm512_shuffle_i32x4(y1, y3, _MM_SHUFFLE(2, 0, 2, 0));
        r[12 + j] = _mm512_shuffle_i32x4(y1, y3, _MM_SHUFFLE(3, 1, 3, 1));
    }
}

/* e^x for 16 floats, inline: a libm call would spill every zmm register the caller keeps live (the ABI
 * saves none), and the kernels call this once per tile. x = n ln2 + f with |f| <= ln2/2 (Cody-Waite, two
 * parts of ln2), e^f by its Taylor series to degree 7 (truncation under 6e-9 relative), times 2^n by
 * vscalefps, which underflows to 0 and overflows to inf as expf does (its measured error against float64's
 * e^x: docs/benchmarks.md); -inf gives 0 and NaN stays NaN (the clamp's operand order keeps it). Builtins
 * only, so -ffast-math cannot reorder the reduction. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x); /* e^-104 rounds to 0; max(a, NaN) is NaN */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), f);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* e^x for one float, by exp16: a libm expf call would spill the caller's live zmm registers. */
static inline float exp1(float x) { return _mm512_cvtss_f32(exp16(_mm512_set1_ps(x))); }

/* acc's vectors 2h and 2h + 1 hold dims 32h..32h + 31 in the order vpunpck{l,h}wd leaves value pairs in,
 * which both kernels use: the index of output dim d (lane 4L + i: dim 32h + 8L + i, then 32h + 8L + 4 + i). */
static inline int acc_index(int d) {
    const int w = d & 31;
    return (d & ~31) + ((w & 7) >= 4 ? 16 : 0) + 4 * (w >> 3) + (w & 3);
}

/* A row's output: acc / run_sum in bf16 (0 for an empty row), in dim order. */
static inline void store_row(uint16_t *op, const float *acc, float run_sum, int head_dim) {
    const float inv = run_sum > 0.0f ? 1.0f / run_sum : 0.0f;
    for (int d = 0; d < head_dim; d++) op[d] = float_to_bf16(acc[acc_index(d)] * inv);
}

#endif
