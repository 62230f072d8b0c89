/* Affine 4-bit block codes (Q4_1, Q4_K's sub-blocks: w = d q + m, q in [0, 15], blocks of 32), and symmetric
 * 8-bit ones (Q8_0: w = d q, q in [-127, 127]), against float32 rows with float32 FMAs: a float32 Q8Linear's path for such weights (gpu/cpu/q8_linear.py) on the levels
 * where that beats cpu_q8.c's integer dots, which cut x into three bytes and pay three dots a weight for it.
 *
 * sum w x = d sum q x + m sum x, per block: a code is exact in float32, so x is used as it is (no cut) and the
 * only roundings are float32's own, as in torch's GEMM over the dequantized weight. The codes are widened in
 * registers by shifts and masks, no shuffles: each 32-bit lane holds 8 codes, and code j of lane t is input
 * 8 j + t of its 64-input chunk, so the j-th widened vector meets x[8 j .. 8 j + 8) as it lies in memory. The
 * widened codes serve every row of a pass (up to Q4F_MAXR), so an extra row costs 8 FMAs per 64 weights.
 * Written with GCC's vector extensions: AVX2 and NEON (two registers a vector) from one source.
 *
 * Layout (q4f_pack): per output, per 64-input chunk, 32 bytes: byte 4 t + i holds the codes of inputs
 * 16 i + t (low nibble) and 16 i + 8 + t (high). Scales and offsets are float32 [N, K / 32].
 * Layout (q8f_pack): per output, per 32-input block, 32 bytes: byte 4 t + j holds the code of input 8 j + t,
 * widened by a shift left and an arithmetic shift right. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_omp.h"

#include "cpu_kernels.h"

#define Q4F_MAXR 4 /* rows per pass: 8 widened-code registers, 2 partial sums and the rows' sums beside them */

/* x86 levels without AVX512-VNNI: there the FMAs beat the three integer dots (docs/benchmarks.md); with it, and
 * on NEON (not measured), the dots stay. */
int q4f_preferred(void) {
#if (defined(__x86_64__) || defined(__i386__)) && !defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}

typedef float q4f_vf __attribute__((vector_size(32)));
typedef int32_t q4f_vi __attribute__((vector_size(32)));

void q4f_pack(const uint8_t *q, uint8_t *out, int64_t n, int64_t k, int num_threads) {
#pragma omp parallel for num_threads(num_threads)
    for (int64_t o = 0; o < n; o++)
        for (int64_t c = 0; c < k; c += 64)
            for (int64_t t = 0; t < 8; t++)
                for (int64_t i = 0; i < 4; i++) {
                    const uint8_t *src = q + o * k + c;
                    out[(o * k + c) / 2 + 4 * t + i] = (uint8_t)((src[16 * i + t] & 15) | (src[16 * i + 8 + t] & 15) << 4);
                }
}

void q8f_pack(const int8_t *q, uint8_t *out, int64_t n, int64_t k, int num_threads) {
#pragma omp parallel for num_threads(num_threads)
    for (int64_t o = 0; o < n; o++)
        for (int64_t c = 0; c < k; c += 32)
            for (int64_t t = 0; t < 8; t++)
                for (int64_t j = 0; j < 4; j++) out[o * k + c + 4 * t + j] = (uint8_t)q[o * k + c + 8 * j + t];
}

static inline q4f_vf q4f_load(const float *p) {
    q4f_vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float q4f_sum(q4f_vf v) {
    float s = 0.0f;
    for (int i = 0; i < 8; i++) s += v[i];
    return s;
}

/* one output's sum d q x over the blocks for M rows (no offsets), codes of ``bits`` (4 or 8) bits: out[r] */
static inline __attribute__((always_inline)) void q4f_output(const float *const *xs, const uint8_t *u,
                                                               const float *d, int64_t k, const int M,
                                                               const int bits, float *out) {
    q4f_vf acc[Q4F_MAXR];
    for (int r = 0; r < M; r++) acc[r] = (q4f_vf){0};
    for (int64_t c = 0; c < k; c += 64) {
        q4f_vf f[8];
        if (bits == 4) {
            q4f_vi w;
            memcpy(&w, u + c / 2, sizeof w);
            for (int j = 0; j < 8; j++) f[j] = __builtin_convertvector((w >> (4 * j)) & 15, q4f_vf);
        } else {
            q4f_vi w[2];
            memcpy(w, u + c, sizeof w);
            for (int j = 0; j < 8; j++) f[j] = __builtin_convertvector((w[j / 4] << (24 - 8 * (j % 4))) >> 24, q4f_vf);
        }
        const float d0 = d[c / 32], d1 = d[c / 32 + 1];
        for (int r = 0; r < M; r++) {
            const float *x = xs[r] + c;
            const q4f_vf s0 = q4f_load(x) * f[0] + q4f_load(x + 8) * f[1] + q4f_load(x + 16) * f[2] +
                              q4f_load(x + 24) * f[3];
            const q4f_vf s1 = q4f_load(x + 32) * f[4] + q4f_load(x + 40) * f[5] + q4f_load(x + 48) * f[6] +
                              q4f_load(x + 56) * f[7];
            acc[r] += s0 * d0 + s1 * d1;
        }
    }
    for (int r = 0; r < M; r++) out[r] = q4f_sum(acc[r]);
}

/* y = x [M, K] W^T (+ bias), float32, W = d q (+ m) per block of 32 from q4f_pack's codes (bits 4, mn given)
 * or q8f_pack's (bits 8, mn NULL), K a multiple of 64, d and mn float32 [N, K / 32]. */
static int qf_gemv(const float *x, int64_t ldx, const uint8_t *u, const float *d, const float *mn, const float *bias,
                   float *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads, const int bits) {
    if (k % 64 != 0 || m < 0) return -2;
    if (m == 0) return 0;
    const int64_t blocks = k / 32;
    float *sums = NULL; /* each row's sum of x per block, for the offsets */
    if (mn != NULL) {
        sums = malloc((size_t)(m * blocks) * sizeof *sums);
        if (sums == NULL) return -3;
        for (int64_t r = 0; r < m; r++)
            for (int64_t b = 0; b < blocks; b++) {
                float s = 0.0f;
                for (int64_t i = 0; i < 32; i++) s += x[r * ldx + 32 * b + i];
                sums[r * blocks + b] = s;
            }
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t o = 0; o < n; o++) {
        const uint8_t *uo = u + o * k * bits / 8;
        const float *dq = d + o * blocks;
        for (int64_t r0 = 0; r0 < m; r0 += Q4F_MAXR) {
            const int M = m - r0 < Q4F_MAXR ? (int)(m - r0) : Q4F_MAXR;
            const float *xs[Q4F_MAXR];
            float out[Q4F_MAXR];
            for (int r = 0; r < M; r++) xs[r] = x + (r0 + r) * ldx;
            /* a constant M and width per call: the rows' sums stay in registers, the widening is unrolled */
            if (bits == 4) switch (M) {
                case 1: q4f_output(xs, uo, dq, k, 1, 4, out); break;
                case 2: q4f_output(xs, uo, dq, k, 2, 4, out); break;
                case 3: q4f_output(xs, uo, dq, k, 3, 4, out); break;
                default: q4f_output(xs, uo, dq, k, 4, 4, out); break;
                }
            else switch (M) {
                case 1: q4f_output(xs, uo, dq, k, 1, 8, out); break;
                case 2: q4f_output(xs, uo, dq, k, 2, 8, out); break;
                case 3: q4f_output(xs, uo, dq, k, 3, 8, out); break;
                default: q4f_output(xs, uo, dq, k, 4, 8, out); break;
                }
            for (int r = 0; r < M; r++) {
                float off = 0.0f;
                if (mn != NULL) {
                    const float *s = sums + (r0 + r) * blocks, *mq = mn + o * blocks;
                    for (int64_t b = 0; b < blocks; b++) off += mq[b] * s[b];
                }
                y[(r0 + r) * ldy + o] = out[r] + off + (bias != NULL ? bias[o] : 0.0f);
            }
        }
    }
    free(sums);
    return 0;
}

/* Returns 0, -2 for a call it cannot take, -3 out of memory. */
int q4f_gemv_f32(const float *x, int64_t ldx, const uint8_t *u, const float *d, const float *mn, const float *bias,
                 float *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads) {
    if (mn == NULL) return -2;
    return qf_gemv(x, ldx, u, d, mn, bias, y, ldy, m, n, k, num_threads, 4);
}

int q8f_gemv_f32(const float *x, int64_t ldx, const uint8_t *u, const float *d, const float *bias, float *y,
                 int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads) {
    return qf_gemv(x, ldx, u, d, NULL, bias, y, ldy, m, n, k, num_threads, 8);
}
