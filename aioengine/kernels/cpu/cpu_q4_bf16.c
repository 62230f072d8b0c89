/* Affine 4-bit block codes (Q4_1, Q4_K's sub-blocks: w = d q + m, q in [0, 15], blocks of 32) against bf16
 * rows with AVX512-BF16 dots: qgemv_q8_bf16's path for such weights (cpu_q8.c), where the CPU has them.
 *
 * A code is exact in bf16, and so is the product of two bf16 values in float32. So
 * sum w x = d sum q x + m sum x is computed from the file's weights and the bf16 activations as they are (no
 * cut of x, unlike cpu_q8.c's integer dots), with the arithmetic of the bf16 GEMM: a register holds 16
 * outputs' codes for 2 inputs, and one dot against the 2 inputs broadcast feeds all 16, so nothing is summed
 * across lanes. The codes are unpacked once per block and serve every row of a pass (up to Q4T_MAXR), so a
 * step of several rows (a query verifying drafts) reads 0.56 bytes a weight against bf16's 2 and costs about
 * the GEMM's arithmetic.
 *
 * Layout (q4t_pack): outputs in tiles of 16 (n padded with zero codes), then blocks of 32 inputs; a tile's
 * block is 8 groups of 32 bytes, byte 2 o + e of group g holding output o's codes for inputs 2 g + e (low
 * nibble) and 2 g + 16 + e (high nibble). Widened to 16 bits, a group's low nibbles are the dot's operand
 * for inputs 2 g, 2 g + 1 of the 16 outputs, its high ones for inputs 2 g + 16, 2 g + 17. Scales and
 * offsets are float32 [tiles, blocks, 16]. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_omp.h"

#include "cpu_bf16.h"
#include "cpu_kernels.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define Q4T_MAXR 10 /* rows per pass: 16 codes registers, a scale, an offset and 4 partial sums beside them */
#ifndef Q4T_PF
#define Q4T_PF 4 /* blocks ahead to prefetch */
#endif

void q4t_pack(const uint8_t *q, uint8_t *out, int64_t n, int64_t k, int num_threads) {
    const int64_t tiles = (n + 15) / 16, blocks = k / 32;
#pragma omp parallel for num_threads(num_threads)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t b = 0; b < blocks; b++)
            for (int64_t g = 0; g < 8; g++)
                for (int64_t j = 0; j < 32; j++) {
                    const int64_t row = 16 * t + j / 2, col = 32 * b + 2 * g + j % 2;
                    const uint8_t lo = row < n ? q[row * k + col] & 15 : 0;
                    const uint8_t hi = row < n ? q[row * k + col + 16] & 15 : 0;
                    out[((t * blocks + b) * 8 + g) * 32 + j] = (uint8_t)(lo | hi << 4);
                }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
int q4t_available(void) { return 1; }

typedef float q4t_pair __attribute__((may_alias)); /* two bf16 inputs, moved as one 32-bit lane */

/* One tile's 16 outputs for M rows: acc[r] lanes = outputs. x rows bf16 (natural order), sums [M][blocks]. */
static inline __attribute__((always_inline)) void q4t_tile(const uint16_t *const *xs, const float *sums,
                                                             int64_t blocks, const uint8_t *u, const float *d,
                                                             const float *mn, const int M, __m512 *acc) {
    /* bf16 of 0..15, as a 32-entry table (vpermw reads 5 index bits; codes never reach the upper half) */
    const __m512i lut = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x4170, 0x4160, 0x4150,
                                         0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080,
                                         0x4040, 0x4000, 0x3f80, 0x0000);
    const __m512i nib = _mm512_set1_epi16(15);
    for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = u + b * 256;
        _mm_prefetch((const char *)(p + Q4T_PF * 256), _MM_HINT_T0);
        _mm_prefetch((const char *)(p + Q4T_PF * 256 + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(p + Q4T_PF * 256 + 128), _MM_HINT_T0);
        _mm_prefetch((const char *)(p + Q4T_PF * 256 + 192), _MM_HINT_T0);
        __m512bh w[16];
        for (int g = 0; g < 8; g++) {
            const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p + 32 * g)));
            w[g] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(v, nib), lut);
            w[g + 8] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), lut);
        }
        const __m512 scale = _mm512_loadu_ps(d + 16 * b), offset = _mm512_loadu_ps(mn + 16 * b);
        for (int r = 0; r < M; r++) {
            /* the block's 16 input pairs, each broadcast to the 16 outputs straight from memory (through a
             * general register it costs more than the dot) */
            const q4t_pair *pair = (const q4t_pair *)(xs[r] + 32 * b);
            __m512 t0 = _mm512_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;
            for (int g = 0; g < 16; g += 4) { /* four partial sums: a short chain at one row */
                t0 = _mm512_dpbf16_ps(t0, w[g], (__m512bh)_mm512_set1_ps(pair[g]));
                t1 = _mm512_dpbf16_ps(t1, w[g + 1], (__m512bh)_mm512_set1_ps(pair[g + 1]));
                t2 = _mm512_dpbf16_ps(t2, w[g + 2], (__m512bh)_mm512_set1_ps(pair[g + 2]));
                t3 = _mm512_dpbf16_ps(t3, w[g + 3], (__m512bh)_mm512_set1_ps(pair[g + 3]));
            }
            const __m512 t = _mm512_add_ps(_mm512_add_ps(t0, t1), _mm512_add_ps(t2, t3));
            acc[r] = _mm512_fmadd_ps(t, scale, acc[r]);
            acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(sums[r * blocks + b]), acc[r]);
        }
    }
}

static void q4t_tile_any(const uint16_t *const *xs, const float *sums, int64_t blocks, const uint8_t *u,
                         const float *d, const float *mn, int m, __m512 *acc) {
#define Q4T_M(M)                                                                                                  \
    case M: q4t_tile(xs, sums, blocks, u, d, mn, M, acc); break;
    switch (m) { /* a constant row count per call: the accumulators stay in registers */
        Q4T_M(1) Q4T_M(2) Q4T_M(3) Q4T_M(4) Q4T_M(5) Q4T_M(6) Q4T_M(7) Q4T_M(8) Q4T_M(9)
    default: q4t_tile(xs, sums, blocks, u, d, mn, Q4T_MAXR, acc); break;
    }
#undef Q4T_M
}

/* bf16 y = x W^T (+ bias), or act(gate) * up (OUT_ACT_MUL: the codes' rows in gate/up pairs), with u, d and
 * mn from q4t_pack's layout; k a multiple of 32. Returns 0, or -3 out of memory. */
int q4t_gemv_bf16(const uint16_t *x, int64_t ldx, const uint8_t *u, const float *d, const float *mn,
                  const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int out,
                  const float *act_table, int num_threads) {
    const int64_t tiles = (n + 15) / 16, blocks = k / 32;
    float *sums = malloc(sizeof *sums * (size_t)(m * blocks + 1));
    const uint16_t **xs = malloc(sizeof *xs * (size_t)(m + 1));
    if (sums == NULL || xs == NULL) {
        free(sums), free(xs);
        return -3;
    }
    for (int64_t r = 0; r < m; r++) {
        xs[r] = x + r * ldx;
        for (int64_t b = 0; b < blocks; b++) {
            float s = 0.0f;
            for (int64_t i = 0; i < 32; i++) s += bf16_to_float(xs[r][32 * b + i]);
            sums[r * blocks + b] = s;
        }
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t r0 = 0; r0 < m; r0 += Q4T_MAXR) {
            const int mm = (int)(m - r0 < Q4T_MAXR ? m - r0 : Q4T_MAXR);
            __m512 acc[Q4T_MAXR];
            q4t_tile_any(xs + r0, sums + r0 * blocks, blocks, u + t * blocks * 256, d + t * blocks * 16,
                         mn + t * blocks * 16, mm, acc);
            for (int r = 0; r < mm; r++) {
                float v[16];
                _mm512_storeu_ps(v, acc[r]);
                uint16_t *row = y + (r0 + r) * ldy;
                for (int o = 0; o < 16 && 16 * t + o < n; o += out == OUT_ACT_MUL ? 2 : 1) {
                    const int64_t j = 16 * t + o;
                    if (out == OUT_ACT_MUL) /* gemm_bf16's roundings: bf16 gate and up, act by table */
                        row[j / 2] = float_to_bf16(act_table[float_to_bf16(v[o])] *
                                                   bf16_to_float(float_to_bf16(v[o + 1])));
                    else
                        row[j] = float_to_bf16(v[o] + (bias ? bf16_to_float(bias[j]) : 0.0f));
                }
            }
        }
    }
    free(sums), free(xs);
    return 0;
}
#else
int q4t_available(void) { return 0; } /* no AVX512-BF16: qgemv_q8_bf16 cuts x for the integer dots instead */

int q4t_gemv_bf16(const uint16_t *x, int64_t ldx, const uint8_t *u, const float *d, const float *mn,
                  const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int out,
                  const float *act_table, int num_threads) {
    (void)x, (void)ldx, (void)u, (void)d, (void)mn, (void)bias, (void)y, (void)ldy, (void)m, (void)n, (void)k;
    (void)out, (void)act_table, (void)num_threads;
    return -2;
}
#endif
