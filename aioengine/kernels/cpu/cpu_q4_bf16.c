/* Affine 4-bit block codes (Q4_1, Q4_K's sub-blocks: w = d q + m, q in [0, 15], blocks of 32) against bf16
 * rows with AVX512-BF16 dots: the inner loop of qgemv_q8_bf16 (cpu_q8.c) for such weights.
 *
 * A code q is exact in bf16, and so is the product of two bf16 values in float32. So
 * sum w x = d sum q x + m sum x is computed from the file's weights and the bf16 activations themselves,
 * with no cutting of x (cpu_q8.c's integer path cuts each input to 16 bits): one VNNI-like bf16 dot per 32
 * inputs a row, about the bf16 GEMM's arithmetic. The codes are unpacked once per chunk and output and
 * serve up to Q4B_MAXR rows in one pass, so a step of several rows (a query verifying drafts) reads 0.56 bytes a weight
 * instead of bf16's 2, where cpu_q8.c's path costs several times the GEMM's arithmetic per row.
 *
 * The layout is q4_pack's (cpu_q8.c): a chunk's packed positions 0-31 in the low nibbles and 32-63 in the
 * high ones; position p holds input q8_src(p, 2), so 4-position lanes take turns between the chunk's two
 * blocks. A row of x is laid out in the same order (q4b_prepare_row). Float lane j of a dot sums positions
 * 2j, 2j + 1 (and 32 + 2j, 33 + 2j): block (j / 2) % 2, so one scale vector [d0 d0 d1 d1 ...] serves
 * both halves of a chunk. The offsets' share, m times each block's sum of x, is one short dot per row and
 * output after the loop. */
#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_kernels.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#ifndef Q4B_PF
#define Q4B_PF 8
#endif

/* the input index of packed position p in a chunk of two blocks of 32 (cpu_q8.c's q8_src with per = 2) */
static inline int64_t q4b_src(int64_t p) {
    const int64_t lane = p / 4;
    return 32 * (lane % 2) + 4 * (lane / 2) + p % 4;
}

void q4b_prepare_row(const uint16_t *x, int64_t k, uint16_t *xb, float *sums) {
    for (int64_t c = 0; c < k; c += 64)
        for (int64_t p = 0; p < 64; p++) xb[c + p] = x[c + q4b_src(p)];
    for (int64_t b = 0; b < k / 32; b++) {
        float t = 0.0f;
        for (int64_t i = 0; i < 32; i++) t += bf16_to_float(x[32 * b + i]);
        sums[b] = t;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
int q4b_max_rows(void) { return Q4B_MAXR; }

/* a chunk's two block scales per float lane: [d0 d0 d1 d1] four times */
static inline __attribute__((always_inline)) __m512 q4b_pairs(const float *s) {
    const __m512 v = _mm512_castpd_ps(_mm512_set1_pd(*(const double *)s)); /* d0 d1 d0 d1 ... */
    return _mm512_unpacklo_ps(v, v);
}

/* acc + mins[b] sums[b] over a row's g blocks, 16 at a time (lanes summed by the caller) */
static inline __attribute__((always_inline)) __m512 q4b_offsets(const float *mins, const float *sums, int64_t g,
                                                                 __m512 acc) {
    for (int64_t b = 0; b < g; b += 16) {
        const __mmask16 keep = g - b >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (g - b)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(keep, mins + b), _mm512_maskz_loadu_ps(keep, sums + b), acc);
    }
    return acc;
}

/* one output's codes (k / 2 bytes) against M rows: out[stride * r] */
static inline __attribute__((always_inline)) void q4b_dot_m(const q4b_row *rows, const uint8_t *a, const float *sa,
                                                              const float *ma, const int M, int64_t k, float *out,
                                                              int stride) {
    /* bf16 of 0..15, as a 32-entry table (vpermw reads 5 index bits; codes never reach the upper half) */
    const __m512i lut = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x4170, 0x4160, 0x4150,
                                         0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080,
                                         0x4040, 0x4000, 0x3f80, 0x0000);
    const __m512i nib = _mm512_set1_epi16(15);
    __m512 acc[Q4B_MAXR];
    for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < k; c += 64) {
        /* the output Q4B_PF ahead (its k / 2 bytes over the k loop, 64 a chunk: two ahead per pair of calls) */
        _mm_prefetch((const char *)(a + Q4B_PF * k / 2 + c), _MM_HINT_T1);
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(a + c / 2)));
        const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(w, nib), lut);
        const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), lut);
        const __m512 d = q4b_pairs(sa + c / 32);
        for (int r = 0; r < M; r++) {
            const q4b_row *x = rows + r;
            const __m512bh xl = (__m512bh)_mm512_loadu_si512(x->x + c);
            const __m512bh xh = (__m512bh)_mm512_loadu_si512(x->x + c + 32);
            const __m512 t = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), lo, xl), hi, xh);
            acc[r] = _mm512_fmadd_ps(t, d, acc[r]);
        }
    }
    for (int r = 0; r < M; r++) out[stride * r] = _mm512_reduce_add_ps(q4b_offsets(ma, rows[r].sums, k / 32, acc[r]));
}

static void q4b_dot(const q4b_row *rows, int m, const uint8_t *a, const float *sa, const float *ma, int64_t k,
                    float *out) {
#define Q4B_M(M)                                                                                                  \
    case M: q4b_dot_m(rows, a, sa, ma, M, k, out, 2); break;
    switch (m) { /* a constant row count per call: the accumulators stay in registers */
        Q4B_M(1) Q4B_M(2) Q4B_M(3) Q4B_M(4) Q4B_M(5) Q4B_M(6) Q4B_M(7) Q4B_M(8)
        Q4B_M(9) Q4B_M(10) Q4B_M(11) Q4B_M(12) Q4B_M(13) Q4B_M(14) Q4B_M(15)
    default: q4b_dot_m(rows, a, sa, ma, Q4B_MAXR, k, out, 2); break;
    }
#undef Q4B_M
}

void q4b_dot2(const q4b_row *rows, int m, const uint8_t *a, const uint8_t *b, const float *sa, const float *sb,
              const float *ma, const float *mb, int64_t k, float *out) {
    q4b_dot(rows, m, a, sa, ma, k, out);
    q4b_dot(rows, m, b, sb, mb, k, out + 1);
}
#else
int q4b_max_rows(void) { return 0; } /* no AVX512-BF16: qgemv_q8_bf16 cuts x for the integer dots instead */

void q4b_dot2(const q4b_row *rows, int m, const uint8_t *a, const uint8_t *b, const float *sa, const float *sb,
              const float *ma, const float *mb, int64_t k, float *out) {
    (void)rows, (void)m, (void)a, (void)b, (void)sa, (void)sb, (void)ma, (void)mb, (void)k, (void)out;
}
#endif
