/* int8-weight GEMVs for a few float32 rows: a decode reads each weight once, one byte instead of bf16's two
 * or float32's four, widened in registers.
 * - qgemv_int8_f32: y[r, j] = scale[j] * sum_k x[r, k] * q[j, k] (+ bias[j]), per-output-channel scales
 *   (gpu/cpu/quant.py's int8). torch's own int8 kernel is fast only for bf16 activations, which a CPU
 *   without bf16 instructions does not run.
 * GGUF's own block codes (a scale per 16 or 32 inputs) have their kernels in cpu_q8.c. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "cpu_omp.h"

#include "cpu_kernels.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif
#define MAXR 8
/* y rows 0..M-1 for outputs j and j+1: each int8 chunk is widened once and used by every row. M is a
 * compile-time constant at each call (qdot2 is inlined per case), so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void qdot2(const float *x, int64_t ldx, const int8_t *a,
                                                         const int8_t *b, const int M, int64_t k, float *out) {
    int64_t i = 0;
#ifdef __AVX512F__
    __m512 acc_a[MAXR], acc_b[MAXR];
    for (int r = 0; r < M; r++) acc_a[r] = acc_b[r] = _mm512_setzero_ps();
    for (; i + 16 <= k; i += 16) {
        __m512 wa = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(a + i))));
        __m512 wb = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + i))));
        for (int r = 0; r < M; r++) {
            __m512 xv = _mm512_loadu_ps(x + r * ldx + i);
            acc_a[r] = _mm512_fmadd_ps(xv, wa, acc_a[r]);
            acc_b[r] = _mm512_fmadd_ps(xv, wb, acc_b[r]);
        }
    }
    for (int r = 0; r < M; r++) {
        out[2 * r] = _mm512_reduce_add_ps(acc_a[r]);
        out[2 * r + 1] = _mm512_reduce_add_ps(acc_b[r]);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc_a[MAXR], acc_b[MAXR];
    for (int r = 0; r < M; r++) acc_a[r] = acc_b[r] = _mm256_setzero_ps();
    for (; i + 8 <= k; i += 8) {
        __m256 wa = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(a + i))));
        __m256 wb = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + i))));
        for (int r = 0; r < M; r++) {
            __m256 xv = _mm256_loadu_ps(x + r * ldx + i);
            acc_a[r] = _mm256_fmadd_ps(xv, wa, acc_a[r]);
            acc_b[r] = _mm256_fmadd_ps(xv, wb, acc_b[r]);
        }
    }
    for (int r = 0; r < M; r++) {
        float lanes[16];
        _mm256_storeu_ps(lanes, acc_a[r]), _mm256_storeu_ps(lanes + 8, acc_b[r]);
        out[2 * r] = out[2 * r + 1] = 0.0f;
        for (int l = 0; l < 8; l++) out[2 * r] += lanes[l], out[2 * r + 1] += lanes[8 + l];
    }
#elif defined(__aarch64__) && defined(__ARM_NEON)
    float32x4_t acc_a[MAXR], acc_b[MAXR];
    for (int r = 0; r < M; r++) acc_a[r] = acc_b[r] = vdupq_n_f32(0.0f);
    for (; i + 4 <= k; i += 4) {
        int8_t wa8[8] = {a[i], a[i + 1], a[i + 2], a[i + 3]}, wb8[8] = {b[i], b[i + 1], b[i + 2], b[i + 3]};
        const float32x4_t wa = vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vld1_s8(wa8)))));
        const float32x4_t wb = vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vld1_s8(wb8)))));
        for (int r = 0; r < M; r++) {
            const float32x4_t xv = vld1q_f32(x + r * ldx + i);
            acc_a[r] = vfmaq_f32(acc_a[r], xv, wa), acc_b[r] = vfmaq_f32(acc_b[r], xv, wb);
        }
    }
    for (int r = 0; r < M; r++) out[2 * r] = vaddvq_f32(acc_a[r]), out[2 * r + 1] = vaddvq_f32(acc_b[r]);
#else
    for (int r = 0; r < M; r++) out[2 * r] = out[2 * r + 1] = 0.0f;
#endif
    for (; i < k; i++)
        for (int r = 0; r < M; r++) {
            out[2 * r] += x[r * ldx + i] * (float)a[i];
            out[2 * r + 1] += x[r * ldx + i] * (float)b[i];
        }
}

static void qdot2_any(const float *x, int64_t ldx, const int8_t *a, const int8_t *b, int m, int64_t k, float *out) {
    switch (m) {
    case 1: qdot2(x, ldx, a, b, 1, k, out); break;
    case 2: qdot2(x, ldx, a, b, 2, k, out); break;
    case 3: qdot2(x, ldx, a, b, 3, k, out); break;
    case 4: qdot2(x, ldx, a, b, 4, k, out); break;
    case 5: qdot2(x, ldx, a, b, 5, k, out); break;
    case 6: qdot2(x, ldx, a, b, 6, k, out); break;
    case 7: qdot2(x, ldx, a, b, 7, k, out); break;
    default: qdot2(x, ldx, a, b, 8, k, out); break;
    }
}

void qgemv_int8_f32(const float *x, int64_t ldx, const int8_t *q, const float *scale, const float *bias,
                    float *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads) {
    int64_t pairs = (n + 1) / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < pairs; p++) {
        int64_t j = 2 * p, j2 = j + 1 < n ? j + 1 : j; /* an odd n repeats its last row */
        float dots[2 * MAXR];
        for (int64_t r0 = 0; r0 < m; r0 += MAXR) {
            int mm = (int)(m - r0 < MAXR ? m - r0 : MAXR);
            qdot2_any(x + r0 * ldx, ldx, q + j * k, q + j2 * k, mm, k, dots);
            for (int r = 0; r < mm; r++) {
                y[(r0 + r) * ldy + j] = scale[j] * dots[2 * r] + (bias ? bias[j] : 0.0f);
                if (j2 != j) y[(r0 + r) * ldy + j2] = scale[j2] * dots[2 * r + 1] + (bias ? bias[j2] : 0.0f);
            }
        }
    }
}
