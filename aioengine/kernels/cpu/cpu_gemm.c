/* bf16 GEMM for the CPU's linear layers: y[M, N] = x[M, K] W[N, K]^T (+ bias), float32 sums, bf16 out
 * (or float32 out, for the LM head's logits: no rounding of the sums that pick the next token).
 *
 * The weight is packed once (pack_gemm_weight_bf16) into panels of 64 output columns, each panel a run
 * of K/2 rows of 64 (w[n][2k], w[n][2k+1]) pairs: the operand vdpbf16ps multiplies against a broadcast
 * pair of x. A panel is read front to back, so a whole weight is one sequential stream. The micro-kernel
 * holds 6 rows x 64 columns of float32 sums in 24 zmm registers and sums over k in order, one rounding
 * to bf16 at the end (the accuracy of oneDNN's kernel; its blocking sums some products in another order,
 * so the two can differ by one bf16 ulp in rare elements).
 *
 * Why not oneDNN: a decode step reads every weight from DRAM (the weights are larger than the last-level
 * cache), and oneDNN's kernel waits on it. Here each 6-row block of a panel prefetches its share of the
 * thread's next panel into L2, spread over its k loop.
 *
 * Work is split between threads in units of (panel, 6-row block), contiguous per thread, so a 9-panel
 * weight splits evenly too. Where the compiler does not target AVX512-BF16, gemm_bf16_vectorized() is 0
 * and the caller keeps oneDNN.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

#define PANEL 64 /* output columns per packed panel: 4 zmm of 16 floats */
#define ROWS 6   /* rows per micro-kernel call: 6 x 4 accumulators + 4 weight vectors + 1 broadcast */
#define ROW_CHUNK 240 /* rows per pass over the weight for large M: a chunk of x stays in L2 */

static inline int is_neg_inf(float f) { /* by its bits: -ffast-math lets the compiler assume no infinities */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u == 0xff800000u;
}

/* OUT_ARGMAX: one thread's running argmax of one row, per lane (lane l has seen columns 16j + l of the
 * thread's panels, in increasing order): the lane's maximum, the first column holding it (INT32_MAX while
 * unset), and the row's first NaN column (INT32_MAX if none). Merged over lanes and threads at the end. */
typedef struct {
    float value[16];
    int32_t column[16];
    int32_t first_nan;
    int32_t pad[15];
} lane_best;

/* Elements of a packed weight (panels padded to 64 columns, K to even). */
int64_t packed_gemm_weight_elems(int64_t n, int64_t k) {
    return (n + PANEL - 1) / PANEL * ((k + 1) / 2) * PANEL * 2;
}

/* gated (a fused gate_up weight, gate rows then up rows, n a multiple of 64): panel p holds gate columns
 * 32p..32p+31 then the up columns that pair with them, for OUT_ACT_MUL's epilogue. */
void pack_gemm_weight_bf16(const uint16_t *w, int64_t n, int64_t k, int gated, uint16_t *out, int num_threads) {
    const int64_t pairs = (k + 1) / 2, panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k2 = 0; k2 < pairs; k2++) {
            uint16_t *o = out + (p * pairs + k2) * PANEL * 2;
            for (int c = 0; c < PANEL; c++) {
                const int64_t half = PANEL / 2;
                const int64_t col = !gated ? p * PANEL + c : (c < half ? 0 : n / 2) + p * half + c % half;
                o[2 * c] = col < n ? w[col * k + 2 * k2] : 0;
                o[2 * c + 1] = col < n && 2 * k2 + 1 < k ? w[col * k + 2 * k2 + 1] : 0;
            }
        }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include "cpu_omp.h"

#include "cpu_avx512.h"

int gemm_bf16_vectorized(void) { return 1; }

static inline __mmask16 column_mask(int cols, int q) { return lanes_mask(cols - 16 * q); } /* panel vector q */

static inline uint32_t pair_at(const uint16_t *p) { /* x[2k], x[2k+1] as one dword (unaligned is fine) */
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* rows (<= ROWS, a constant after inlining) x one panel. pf/pf_lines: this call's share of the next
 * panel to prefetch, spread evenly over the k loop. */
static inline __attribute__((always_inline)) void micro(const uint16_t *x, int64_t ldx, const uint16_t *panel,
                                                         int64_t k, const uint16_t *bias, void *y,
                                                         int64_t ldy, int cols, const int rows, const char *pf,
                                                         int64_t pf_lines, const int out, const float *act_table,
                                                         int32_t col0) {
    const int64_t full_pairs = k / 2, pairs = (k + 1) / 2;
    __m512 acc[ROWS][4];
    for (int i = 0; i < rows; i++)
        for (int q = 0; q < 4; q++) acc[i][q] = _mm512_setzero_ps();
    int64_t pf_done = 0, pf_credit = 0;
    for (int64_t k2 = 0; k2 < pairs; k2++) {
        const uint16_t *wp = panel + k2 * PANEL * 2;
        __m512bh wv[4];
        for (int q = 0; q < 4; q++) wv[q] = (__m512bh)_mm512_loadu_si512(wp + 32 * q);
        for (pf_credit += pf_lines; pf_credit >= pairs; pf_credit -= pairs)
            _mm_prefetch(pf + 64 * pf_done++, _MM_HINT_T1);
        for (int i = 0; i < rows; i++) {
            const uint16_t *xp = x + i * ldx + 2 * k2;
            /* an odd K's last pair: the missing element is 0 (never read past the row) */
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)(k2 < full_pairs ? pair_at(xp) : xp[0]));
            for (int q = 0; q < 4; q++) acc[i][q] = _mm512_dpbf16_ps(acc[i][q], xv, wv[q]);
        }
    }
    if (out == OUT_ACT_MUL) { /* a gated panel: gate columns in acc[.][0..1], their up columns in [2..3] */
        for (int i = 0; i < rows; i++)
            for (int q = 0; q < 2; q++) {
                const __m512i gate_bits = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(acc[i][q]));
                const __m512 act = _mm512_i32gather_ps(gate_bits, act_table, 4);
                const __m512 up = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(acc[i][q + 2]));
                _mm256_storeu_si256((__m256i *)((uint16_t *)y + i * ldy + 16 * q),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(act, up)));
            }
        return;
    }
    if (out == OUT_ARGMAX) { /* fold this panel into the rows' running per-lane maxima: no reductions here */
        __mmask16 live[4];
        __m512 b[4];
        __m512i col[4];
        for (int q = 0; q < 4; q++) {
            live[q] = column_mask(cols, q);
            b[q] = bias == NULL ? _mm512_setzero_ps() : widen_bf16x16(bias + 16 * q, live[q]);
            col[q] = _mm512_add_epi32(_mm512_set1_epi32(col0 + 16 * q),
                                      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
        }
        for (int i = 0; i < rows; i++) {
            lane_best *s = (lane_best *)y + i;
            __m512 best = _mm512_loadu_ps(s->value);
            __m512i best_col = _mm512_loadu_si512(s->column);
            for (int q = 0; q < 4; q++) {
                const __m512 v = _mm512_add_ps(acc[i][q], b[q]);
                const __mmask16 nan = _mm512_mask_cmp_ps_mask(live[q], v, v, _CMP_UNORD_Q);
                if (__builtin_expect(nan != 0, 0) && col0 + 16 * q + __builtin_ctz(nan) < s->first_nan)
                    s->first_nan = col0 + 16 * q + __builtin_ctz(nan);
                /* strictly greater: a lane keeps the first column of its maximum */
                const __mmask16 gt = _mm512_mask_cmp_ps_mask(live[q], v, best, _CMP_GT_OQ);
                best = _mm512_mask_mov_ps(best, gt, v);
                best_col = _mm512_mask_mov_epi32(best_col, gt, col[q]);
            }
            _mm512_storeu_ps(s->value, best);
            _mm512_storeu_si512(s->column, best_col);
        }
        return;
    }
    for (int q = 0; q < 4 && 16 * q < cols; q++) {
        const __mmask16 mask = column_mask(cols, q);
        const __m512 b = bias == NULL ? _mm512_setzero_ps() : widen_bf16x16(bias + 16 * q, mask);
        for (int i = 0; i < rows; i++) {
            const __m512 v = _mm512_add_ps(acc[i][q], b);
            if (out == OUT_F32)
                _mm512_mask_storeu_ps((float *)y + i * ldy + 16 * q, mask, v);
            else
                _mm256_mask_storeu_epi16((uint16_t *)y + i * ldy + 16 * q, mask, (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

/* y: bf16 [M, N], float32 [M, N] (OUT_F32), bf16 [M, N / 2] (OUT_ACT_MUL, a weight packed gated, no
 * bias, and act_table: the activation of each of the 65536 bf16 values, rounded to bf16, as floats), or int64 [M]
 * (OUT_ARGMAX); ldy in elements. Returns 0; -2 for a call the epilogue cannot take; -3 out of memory. */
int gemm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *packed, const uint16_t *bias, void *y,
              int64_t ldy, int64_t m, int64_t n, int64_t k, int out, const float *act_table, int num_threads) {
    if (out == OUT_ACT_MUL && (n % PANEL != 0 || bias != NULL || act_table == NULL)) return -2;
    const int64_t pairs = (k + 1) / 2, panels = (n + PANEL - 1) / PANEL, panel_elems = pairs * PANEL * 2;
    lane_best *bests = NULL; /* OUT_ARGMAX: [threads][m] */
    if (out == OUT_ARGMAX) {
        if ((bests = aligned_alloc(64, sizeof *bests * (size_t)(num_threads * m))) == NULL) return -3;
        for (int64_t r = 0; r < num_threads * m; r++) {
            for (int l = 0; l < 16; l++) bests[r].value[l] = -INFINITY, bests[r].column[l] = INT32_MAX;
            bests[r].first_nan = INT32_MAX;
        }
    }
    const int64_t panel_lines = panel_elems * 2 / 64;
    for (int64_t m0 = 0; m0 < m; m0 += ROW_CHUNK) {
        const int64_t mc = m - m0 < ROW_CHUNK ? m - m0 : ROW_CHUNK, blocks = (mc + ROWS - 1) / ROWS;
        const int64_t units = panels * blocks;
#pragma omp parallel num_threads(num_threads) if (units > 1)
        {
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t u0 = units * t / nt, u1 = units * (t + 1) / nt;
            for (int64_t u = u0; u < u1; u++) {
                const int64_t p = u / blocks, j = u % blocks, i = m0 + j * ROWS;
                const uint16_t *panel = packed + p * panel_elems;
                /* block j prefetches lines [l0, l1) of the next panel, if this thread computes it */
                const int64_t l0 = panel_lines * j / blocks, l1 = panel_lines * (j + 1) / blocks;
                const char *pf = (const char *)(panel + panel_elems) + 64 * l0;
                const int64_t pf_lines = (p + 1) * blocks < u1 ? l1 - l0 : 0;
                const int cols = n - p * PANEL < PANEL ? (int)(n - p * PANEL) : PANEL;
                const uint16_t *xi = x + i * ldx, *bp = bias == NULL ? NULL : bias + p * PANEL;
                const int64_t y_col = out == OUT_ACT_MUL ? p * PANEL / 2 : p * PANEL;
                void *yi = out == OUT_ARGMAX ? (void *)(bests + t * m + i)
                                             : (char *)y + (i * ldy + y_col) * (out == OUT_F32 ? 4 : 2);
                const int rows = m0 + mc - i >= ROWS ? ROWS : (int)(m0 + mc - i);
#define MICRO(R, OUT) micro(xi, ldx, panel, k, bp, yi, ldy, cols, R, pf, pf_lines, OUT, act_table, \
                                  (int32_t)(p * PANEL))
#define MICRO_ROWS(OUT)                                                                                  \
    switch (rows) {                                                                                      \
    case 6: MICRO(6, OUT); break;                                                                        \
    case 5: MICRO(5, OUT); break;                                                                        \
    case 4: MICRO(4, OUT); break;                                                                        \
    case 3: MICRO(3, OUT); break;                                                                        \
    case 2: MICRO(2, OUT); break;                                                                        \
    default: MICRO(1, OUT); break;                                                                       \
    }
                if (out == OUT_F32)
                    MICRO_ROWS(OUT_F32)
                else if (out == OUT_ACT_MUL)
                    MICRO_ROWS(OUT_ACT_MUL)
                else if (out == OUT_ARGMAX)
                    MICRO_ROWS(OUT_ARGMAX)
                else
                    MICRO_ROWS(OUT_BF16)
#undef MICRO_ROWS
#undef MICRO
            }
        }
    }
    if (out == OUT_ARGMAX) { /* torch.argmax's answer: the first NaN, else the first maximum (0 if all -inf) */
        for (int64_t i = 0; i < m; i++) {
            int32_t first_nan = INT32_MAX;
            __m512 top = _mm512_set1_ps(-INFINITY);
            for (int t = 0; t < num_threads; t++) {
                const lane_best *s = bests + t * m + i;
                first_nan = s->first_nan < first_nan ? s->first_nan : first_nan;
                top = _mm512_max_ps(top, _mm512_loadu_ps(s->value));
            }
            const float mx = _mm512_reduce_max_ps(top);
            int32_t column = INT32_MAX;
            for (int t = 0; t < num_threads && first_nan == INT32_MAX && !is_neg_inf(mx); t++) {
                const lane_best *s = bests + t * m + i;
                const __mmask16 at = _mm512_cmp_ps_mask(_mm512_loadu_ps(s->value), _mm512_set1_ps(mx), _CMP_EQ_OQ);
                const int32_t c = _mm512_mask_reduce_min_epi32(at, _mm512_loadu_si512(s->column));
                column = c < column ? c : column;
            }
            ((int64_t *)y)[i] = first_nan != INT32_MAX ? first_nan : !is_neg_inf(mx) ? column : 0;
        }
        free(bests);
    }
    return 0;
}
#else
int gemm_bf16_vectorized(void) { return 0; }

int gemm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *packed, const uint16_t *bias, void *y,
              int64_t ldy, int64_t m, int64_t n, int64_t k, int out, const float *act_table, int num_threads) {
    (void)x, (void)ldx, (void)packed, (void)bias, (void)y, (void)ldy, (void)m, (void)n, (void)k, (void)out;
    (void)act_table;
    (void)num_threads;
    return -1;
}
#endif
