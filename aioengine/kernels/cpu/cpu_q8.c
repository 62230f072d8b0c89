/* GEMVs for a few rows on a GGUF's own block codes: int8 codes and a float32 scale per block of 32 inputs
 * (Q8_0, Q5_0, Q4_0) or 16 (Q6_K), so the weight is the file's, exactly, at 1.125-1.25 bytes a weight
 * instead of bf16's 2. A decode step streams every weight from DRAM; fewer bytes are a shorter step.
 * - qgemv_q8_f32: float32 rows in, float32 out (+ bias) or each row's argmax (gpu/cpu/q8_head.py's LM head,
 *   a float32 model's Q8Linear);
 * - qgemv_q8_bf16: bf16 rows in, bf16 out (+ bias), or act(gate) * up for a fused gate_up weight in
 *   gemm_bf16's OUT_ACT_MUL roundings (gpu/cpu/q8_linear.py, cpu_decode_stack.c).
 *
 * The codes are stored as u = q + 128 (uint8). Within each 64-input chunk the 16 four-byte lanes take turns
 * among the chunk's 64 / block blocks (q8_pack): lane l holds 4 inputs of block l % (64 / block). One VNNI dot
 * (u8 x s8, four products a lane) then leaves each block's sums in its own lanes, and one broadcast of the
 * chunk's 2 or 4 scales scales them all.
 * Each row of x is cut per lane (4 inputs) into integers xq = round(x / sx), as two signed bytes
 * (xq = 256 b1 + b0, |xq| <= 32639) for bf16 activations or three (65536 b2 + 256 b1 + b0) for float32 ones.
 * The dots are exact in int32; the only rounding of x is that step, at most sx / 2: 2^-16 of the lane's
 * largest |x| (finer than the bf16 value itself but where 4 inputs span more than 2^8) or 2^-24 (about
 * float32's own rounding). sum u * xq = sum q * xq + 128 sum xq: the second term is the row's own,
 * subtracted up front (per part, so no sum overflows).
 * Affine 4-bit blocks (Q4_1: w = d q + m, q in [0, 15], blocks of 32; gpu/cpu/block_codes.py) take the same
 * path at 0.75 bytes a weight: q4_pack keeps a chunk's 64 codes in 32 bytes, the low nibbles its packed
 * positions 0-31 and the high ones 32-63, so one mask and one shift give the u of the 8-bit layout (the codes
 * unsigned already: no 128 to take off), and the offsets add m times each lane's sum of the cut x (per lane,
 * beside the dots: one more FMA a chunk). The dots themselves, per ISA level, are cpu_q8_dot.h's. Where the
 * CPU has AVX512-BF16, bf16 rows against affine codes take cpu_q4_bf16.c's bf16 dots instead, with x uncut and
 * the codes in its own layout (q4t_pack). */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "cpu_omp.h"

#include "cpu_bf16.h"
#include "cpu_kernels.h"

/* 63 for the argmax screen's one byte (u x b then fits maddubs' int16 without saturating), 127 (256 + 1),
 * 127 (65536 + 256 + 1) */
static const float q8_xq_max[4] = {0.0f, 63.0f, 32639.0f, 8355711.0f};

/* packed byte p of a chunk <- its input index in the chunk; per: blocks per chunk (64 / block) */
static inline int64_t q8_src(int64_t p, int64_t per) {
    const int64_t lane = p / 4;
    return (64 / per) * (lane % per) + 4 * (lane / per) + p % 4;
}

void q4_pack(const uint8_t *q, uint8_t *out, int64_t n, int64_t k, int num_threads) {
#pragma omp parallel for num_threads(num_threads)
    for (int64_t j = 0; j < n; j++)
        for (int64_t c = 0; c < k; c += 64)
            for (int64_t p = 0; p < 32; p++)
                out[(j * k + c) / 2 + p] =
                    (uint8_t)((q[j * k + c + q8_src(p, 2)] & 15) | (q[j * k + c + q8_src(p + 32, 2)] & 15) << 4);
}

void q8_pack(const int8_t *q, uint8_t *out, int64_t n, int64_t k, int64_t block, int num_threads) {
    const int64_t per = 64 / block;
#pragma omp parallel for num_threads(num_threads)
    for (int64_t j = 0; j < n; j++)
        for (int64_t c = 0; c < k; c += 64)
            for (int64_t p = 0; p < 64; p++) out[j * k + c + p] = (uint8_t)(q[j * k + c + q8_src(p, per)] + 128);
}

/* One row of x cut for the dots, each array in the packed order: the bytes b2, b1, b0 [k]; per lane
 * -128 sum b2 and -128 sum (256 b1 + b0) [k / 4], sx [k / 4], and the sum of the lane's cut x [k / 4]. */
typedef struct {
    int8_t *b2, *b1, *b0;
    int32_t *corr_hi, *corr_lo;
    float *sx, *xsum;
} q8_row;

static void q8_cut_row(const float *x, int64_t k, int64_t per, int limbs, q8_row row) {
    const float xq_max = q8_xq_max[limbs];
    for (int64_t c = 0; c < k; c += 64)
        for (int64_t lane = 0; lane < 16; lane++) {
            const float *src = x + c + q8_src(4 * lane, per); /* the lane's 4 inputs are adjacent in x */
            uint32_t top = 0; /* largest |x| by its bits: NaN > inf > finite, whatever -ffast-math assumes */
            for (int i = 0; i < 4; i++) {
                uint32_t u;
                memcpy(&u, src + i, 4);
                u &= 0x7fffffffu;
                top = u > top ? u : top;
            }
            float amax;
            memcpy(&amax, &top, 4);
            const int finite = top < 0x7f800000u;
            const float inv = finite && top != 0 ? xq_max / amax : 0.0f;
            const int64_t at = c / 4 + lane;
            row.sx[at] = finite ? amax / xq_max : amax; /* a non-finite lane: xq 0, its sums NaN */
            row.corr_hi[at] = row.corr_lo[at] = 0;
            int32_t lane_sum = 0;
            for (int i = 0; i < 4; i++) {
                int32_t xq = (int32_t)lrintf(src[i] * inv);
                xq = xq > (int32_t)xq_max ? (int32_t)xq_max : xq < -(int32_t)xq_max ? -(int32_t)xq_max : xq;
                /* balanced base-256 digits: floor division keeps each in [-128, 127] */
                const int32_t b0 = ((xq + 128) & 255) - 128, rest = (xq - b0) / 256;
                const int32_t b1 = ((rest + 128) & 255) - 128, b2 = (rest - b1) / 256;
                row.b2[c + 4 * lane + i] = (int8_t)b2, row.b1[c + 4 * lane + i] = (int8_t)b1;
                row.b0[c + 4 * lane + i] = (int8_t)b0;
                row.corr_hi[at] -= 128 * b2;
                row.corr_lo[at] -= 128 * (256 * b1 + b0);
                lane_sum += xq;
            }
            row.xsum[at] = (float)((double)lane_sum * (double)row.sx[at]);
        }
}

#include "cpu_q8_dot.h" /* q8dot2 per ISA level, and qgemv_q8_vectorized */

static void q8dot2_any(const q8_row *rows, const uint8_t *a, const uint8_t *b, const float *sa, const float *sb,
                       const float *ma, const float *mb, int m, int64_t k, int limbs, int per, int nib, float *out) {
#define Q8_ROWS(L, P, N)                                                                                         \
    switch (m) {                                                                                                 \
    case 1: q8dot2(rows, a, b, sa, sb, ma, mb, 1, k, L, P, N, out); break;                                       \
    case 2: q8dot2(rows, a, b, sa, sb, ma, mb, 2, k, L, P, N, out); break;                                       \
    case 3: q8dot2(rows, a, b, sa, sb, ma, mb, 3, k, L, P, N, out); break;                                       \
    default: q8dot2(rows, a, b, sa, sb, ma, mb, 4, k, L, P, N, out); break;                                      \
    }
    if (nib && limbs == 2) /* q4_pack'ed codes come in blocks of 32 only */
        Q8_ROWS(2, 2, 1)
    else if (nib)
        Q8_ROWS(3, 2, 1)
    else if (limbs == 1 && per == 2) /* the argmax screen's one byte */
        Q8_ROWS(1, 2, 0)
    else if (limbs == 1)
        Q8_ROWS(1, 4, 0)
    else if (limbs == 2 && per == 2)
        Q8_ROWS(2, 2, 0)
    else if (limbs == 2)
        Q8_ROWS(2, 4, 0)
    else if (per == 2)
        Q8_ROWS(3, 2, 0)
    else
        Q8_ROWS(3, 4, 0)
#undef Q8_ROWS
}

static inline int q8_isnan(float f) { /* by its bits: -ffast-math lets the compiler assume no NaNs */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x7fffffffu) > 0x7f800000u;
}

/* One thread's running argmax of one row over its outputs, seen in increasing order. */
typedef struct {
    float value;
    int64_t index, first_nan; /* -1: none yet */
} q8_best;

static inline void q8_best_see(q8_best *b, float v, int64_t j) {
    if (b->first_nan >= 0) return;
    if (q8_isnan(v))
        b->first_nan = j;
    else if (b->index < 0 || v > b->value)
        b->value = v, b->index = j;
}

/* Row r's argmax from each thread's (bests [threads, m]), threads in order: ties go to the earlier one, and
 * the first NaN wins. */
static int64_t q8_best_merge(const q8_best *bests, int64_t m, int64_t r, int num_threads) {
    q8_best all = {0.0f, -1, -1};
    for (int t = 0; t < num_threads && all.first_nan < 0; t++) {
        const q8_best *b = bests + (int64_t)t * m + r;
        if (b->first_nan >= 0)
            all.first_nan = b->first_nan;
        else if (b->index >= 0 && (all.index < 0 || b->value > all.value))
            all.value = b->value, all.index = b->index;
    }
    return all.first_nan >= 0 ? all.first_nan : all.index >= 0 ? all.index : 0;
}

/* Where a call's sums go: float32 y (+ bias_f32), each row's argmax, bf16 y (+ bias), or act(gate) * up as
 * bf16 (the codes' rows in gate/up pairs, q8_pack'ed from [gate_0, up_0, gate_1, up_1, ...]). */
typedef struct {
    int out;
    void *y;
    int64_t ldy;
    int64_t *argmax;
    const uint16_t *bias;
    const float *bias_f32;
    const float *act_table;
} q8_sink;

/* The shared body: rows already cut; outputs in pairs (an odd n repeats its last), contiguous per thread.
 * mins: the affine blocks' offsets [N, K / 32] (u then from q4_pack), or NULL. */
static int q8_run(const q8_row *rows, int64_t m, const uint8_t *u, const float *scale, const float *mins, int64_t n,
                  int64_t k, int64_t block, int limbs, const q8_sink *s, int num_threads) {
    const int64_t pairs = (n + 1) / 2, groups = k / block, per = 64 / block;
    const int nib = mins != NULL;
    const int64_t row_bytes = nib ? k / 2 : k;
    q8_best *bests = NULL;
    if (s->out == OUT_ARGMAX) {
        bests = malloc(sizeof *bests * (size_t)(m > 0 ? m : 1) * (size_t)num_threads);
        if (bests == NULL) return -3;
        for (int64_t i = 0; i < m * num_threads; i++) bests[i] = (q8_best){0.0f, -1, -1};
    }
#pragma omp parallel num_threads(num_threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        q8_best *mine = bests == NULL ? NULL : bests + (int64_t)t * m;
        for (int64_t p = pairs * t / nt; p < pairs * (t + 1) / nt; p++) {
            const int64_t j = 2 * p, j2 = j + 1 < n ? j + 1 : j;
            float dots[2 * Q8_MAXR];
            for (int64_t r0 = 0; r0 < m; r0 += Q8_MAXR) {
                const int mm = (int)(m - r0 < Q8_MAXR ? m - r0 : Q8_MAXR);
                q8dot2_any(rows + r0, u + j * row_bytes, u + j2 * row_bytes, scale + j * groups,
                           scale + j2 * groups, nib ? mins + j * groups : NULL, nib ? mins + j2 * groups : NULL, mm,
                           k, limbs, (int)per, nib, dots);
                for (int r = 0; r < mm; r++) {
                    const int64_t row = r0 + r;
                    const float da = dots[2 * r], db = dots[2 * r + 1];
                    if (s->out == OUT_ARGMAX) {
                        q8_best_see(mine + row, da, j);
                        if (j2 != j) q8_best_see(mine + row, db, j2);
                    } else if (s->out == OUT_F32) {
                        float *y = (float *)s->y + row * s->ldy;
                        y[j] = da + (s->bias_f32 ? s->bias_f32[j] : 0.0f);
                        if (j2 != j) y[j2] = db + (s->bias_f32 ? s->bias_f32[j2] : 0.0f);
                    } else if (s->out == OUT_ACT_MUL) { /* gemm_bf16's roundings: bf16 gate and up, act by table */
                        const float act = s->act_table[float_to_bf16(da)];
                        ((uint16_t *)s->y)[row * s->ldy + p] = float_to_bf16(act * bf16_to_float(float_to_bf16(db)));
                    } else {
                        uint16_t *y = (uint16_t *)s->y + row * s->ldy;
                        y[j] = float_to_bf16(da + (s->bias ? bf16_to_float(s->bias[j]) : 0.0f));
                        if (j2 != j) y[j2] = float_to_bf16(db + (s->bias ? bf16_to_float(s->bias[j2]) : 0.0f));
                    }
                }
            }
        }
    }
    for (int64_t r = 0; bests != NULL && r < m; r++) s->argmax[r] = q8_best_merge(bests, m, r, num_threads);
    free(bests);
    return 0;
}

/* Scratch for m cut rows of k inputs (one block: per row 3 x k bytes, then 4 x k / 4 int32 or float), and k
 * floats for widening a bf16 row; NULL out of memory (free *scratch either way). */
static q8_row *q8_rows(int64_t m, int64_t k, char **scratch, float **wide) {
    *scratch = aligned_alloc(64, (size_t)(m * 7 * k + 4 * k) + 64);
    q8_row *rows = malloc(sizeof *rows * (size_t)(m > 0 ? m : 1));
    if (*scratch == NULL || rows == NULL) {
        free(rows);
        return NULL;
    }
    for (int64_t r = 0; r < m; r++) {
        char *base = *scratch + r * 7 * k;
        rows[r] = (q8_row){(int8_t *)base,           (int8_t *)(base + k),      (int8_t *)(base + 2 * k),
                           (int32_t *)(base + 3 * k), (int32_t *)(base + 4 * k), (float *)(base + 5 * k),
                           (float *)(base + 6 * k)};
    }
    *wide = (float *)(*scratch + m * 7 * k);
    return rows;
}

static inline int q8_finite(float f) { /* by its bits, as q8_isnan */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x7fffffffu) < 0x7f800000u;
}

/* A greedy row's argmax without every output's exact sum. A first pass cuts x to one byte a lane (4
 * inputs) and takes every output's sum a with one dot a weight byte instead of 2 or 3, and a bound B on
 * |a - e|, e the exact path's sum (limbs bytes): |sum w (x - x1)| <= the output's largest |w| (128 times its
 * largest |scale|, scale_max) times the row's sum of |x - x1|, plus the exact path's own cut and both paths'
 * float32 roundings (up to k / 16 + 16 steps of 2^-24 of sum |w x|, bounded the same way). Then e is taken only
 * where a + B reaches the largest a - B: every output whose e could be the maximum, ties included. So the
 * pick is the exact path's, bit for bit: the same dots, in the same order, on those outputs. A row with a
 * non-finite x, or a sum or bound that is not finite, takes e everywhere (its first NaN wins as before). */
#define QS_ROWS 16 /* rows a screening pass: its first sums [rows, N] stay small */

/* a row's error mass after the one-byte cut (row: the cut): sum |x - x1| plus the exact cut's and both paths'
 * roundings' share */
static float q8_screen_mass(const float *x, int64_t k, int64_t per, int limbs, const q8_row *row) {
    /* both paths' roundings: up to k / 16 + 16 float32 steps each (a lane's chain: k / 64 on AVX-512, k / 32
     * on AVX2, k / 16 on NEON; then the last sum and the scales' products), with room to spare */
    const double slop = (double)(k / 8 + 64) * 0x1p-23, cut = 2.0 / q8_xq_max[limbs];
    double mass = 0.0;
    for (int64_t c = 0; c < k; c += 64)
        for (int64_t lane = 0; lane < 16; lane++) {
            const int64_t off = c + q8_src(4 * lane, per); /* the lane's 4 inputs, adjacent in x */
            const double sx = row->sx[c / 4 + lane];
            double err = 0.0, mag = 0.0, top = 0.0;
            for (int i = 0; i < 4; i++) {
                const double xi = x[off + i];
                err += fabs(xi - row->b0[c + 4 * lane + i] * sx);
                mag += fabs(xi);
                top = fabs(xi) > top ? fabs(xi) : top;
            }
            mass += err + slop * (mag + err) + cut * top;
        }
    return (float)(mass * (1.0 + 0x1p-20));
}

static int q8_argmax_screened(const float *x, int64_t ldx, int64_t m, const uint8_t *u, const float *scale,
                              const float *scale_max, int64_t n, int64_t k, int64_t block, int limbs,
                              int64_t *argmax, int num_threads) {
    const int64_t per = 64 / block, groups = k / block, pairs = (n + 1) / 2;
    const int64_t mg_max = m < QS_ROWS ? m : QS_ROWS;
    char *scratch;
    float *wide;
    q8_row *rows = q8_rows(2 * mg_max, k, &scratch, &wide); /* the one-byte cuts, then the exact ones */
    float *mass = malloc(sizeof *mass * (size_t)(mg_max + 1));
    float *hi = malloc(sizeof *hi * (size_t)(mg_max * n + 1));
    float *lows = malloc(sizeof *lows * (size_t)(num_threads * mg_max + 1));
    float *floor_ = malloc(sizeof *floor_ * (size_t)(mg_max + 1));
    int *every = malloc(sizeof *every * (size_t)(mg_max + 1));
    q8_best *bests = malloc(sizeof *bests * (size_t)(num_threads * mg_max + 1));
    int status = 0;
    if (rows == NULL || !mass || !hi || !lows || !floor_ || !every || !bests) {
        status = -3;
        goto done;
    }
    for (int64_t r0 = 0; r0 < m; r0 += QS_ROWS) {
        const int64_t mg = m - r0 < QS_ROWS ? m - r0 : QS_ROWS;
        for (int64_t r = 0; r < mg; r++) {
            const float *xr = x + (r0 + r) * ldx;
            every[r] = 0;
            for (int64_t i = 0; i < k; i++) every[r] |= !q8_finite(xr[i]);
            q8_cut_row(xr, k, per, 1, rows[r]);
            q8_cut_row(xr, k, per, limbs, rows[mg_max + r]);
            mass[r] = 128.0f * q8_screen_mass(xr, k, per, limbs, rows + r) * (1.0f + 0x1p-10f);
        }
        for (int64_t i = 0; i < num_threads * mg; i++) bests[i] = (q8_best){0.0f, -1, -1};
#pragma omp parallel num_threads(num_threads)
        {
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            float low[QS_ROWS]; /* this thread's largest a - B a row, kept local: the threads' slots share a line */
            for (int64_t r = 0; r < mg; r++) low[r] = -FLT_MAX;
            for (int64_t p = pairs * t / nt; p < pairs * (t + 1) / nt; p++) {
                const int64_t j = 2 * p, j2 = j + 1 < n ? j + 1 : j;
                float dots[2 * Q8_MAXR];
                for (int64_t s0 = 0; s0 < mg; s0 += Q8_MAXR) {
                    const int mm = (int)(mg - s0 < Q8_MAXR ? mg - s0 : Q8_MAXR);
                    q8dot2_any(rows + s0, u + j * k, u + j2 * k, scale + j * groups, scale + j2 * groups, NULL, NULL,
                               mm, k, 1, (int)per, 0, dots);
                    for (int r = 0; r < mm; r++)
                        for (int h = 0; h < (j2 != j ? 2 : 1); h++) {
                            const int64_t row = s0 + r, o = j + h;
                            const float a = dots[2 * r + h], b = fabsf(scale_max[o]) * mass[row];
                            if (!q8_finite(a) || !q8_finite(b) || !q8_finite(a + b)) {
#pragma omp atomic write
                                every[row] = 1;
                            }
                            hi[row * n + o] = a + b;
                            low[row] = a - b > low[row] ? a - b : low[row];
                        }
                }
            }
            for (int64_t r = 0; r < mg; r++) lows[(int64_t)t * mg + r] = low[r];
#pragma omp barrier
#pragma omp single
            for (int64_t r = 0; r < mg; r++) {
                floor_[r] = -FLT_MAX;
                for (int i = 0; i < nt; i++) floor_[r] = lows[i * mg + r] > floor_[r] ? lows[i * mg + r] : floor_[r];
            }
            q8_best *mine = bests + (int64_t)t * mg;
            for (int64_t o = n * t / nt; o < n * (t + 1) / nt; o++)
                for (int64_t r = 0; r < mg; r++) {
                    if (!every[r] && hi[r * n + o] < floor_[r]) continue;
                    float e[2];
                    q8dot2_any(rows + mg_max + r, u + o * k, u + o * k, scale + o * groups, scale + o * groups, NULL,
                               NULL, 1, k, limbs, (int)per, 0, e);
                    q8_best_see(mine + r, e[0], o);
                }
        }
        for (int64_t r = 0; r < mg; r++) argmax[r0 + r] = q8_best_merge(bests, mg, r, num_threads);
    }
done:
    free(scratch), free(rows), free(mass), free(hi), free(lows), free(floor_), free(every), free(bests);
    return status;
}

/* y [M, N] = x [M, K] W^T (+ bias), W = q * scale per block of 16 or 32 inputs: u [N, K] from q8_pack,
 * scale [N, K / block] float32, both contiguous; k a multiple of 64. With argmax (int64 [M]) each row's argmax
 * as torch picks it (the first NaN, else the first maximum) instead of y (which may then be NULL), screened
 * first where scale_max [N] (each output's largest |scale|) is given. limbs: 2
 * or 3 bytes a cut input (bf16 or float32 activations). Returns 0, -2 for a call it cannot take, or -3 out
 * of memory. With mins [N, K / 32] the weight is affine, W = q * scale + mins per block of 32, and u comes
 * from q4_pack. */
int qgemv_q8_f32(const float *x, int64_t ldx, const uint8_t *u, const float *scale, const float *mins, int64_t block,
                 const float *bias, float *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int64_t *argmax,
                 const float *scale_max, int limbs, int num_threads) {
    if ((limbs != 2 && limbs != 3) || (block != 16 && block != 32) || k % 64 != 0) return -2;
    if (mins != NULL && block != 32) return -2;
    if (argmax != NULL && mins == NULL && scale_max != NULL)
        return q8_argmax_screened(x, ldx, m, u, scale, scale_max, n, k, block, limbs, argmax, num_threads);
    char *scratch;
    float *wide;
    q8_row *rows = q8_rows(m, k, &scratch, &wide);
    if (rows == NULL) {
        free(scratch);
        return -3;
    }
    for (int64_t r = 0; r < m; r++) q8_cut_row(x + r * ldx, k, 64 / block, limbs, rows[r]);
    const q8_sink sink = {argmax != NULL ? OUT_ARGMAX : OUT_F32, y, ldy, argmax, NULL, bias, NULL};
    const int status = q8_run(rows, m, u, scale, mins, n, k, block, limbs, &sink, num_threads);
    free(scratch), free(rows);
    return status;
}

/* bf16 y = bf16 x [M, K] W^T (+ bias) with W's codes from q8_pack (block 16 or 32) and scale [N, K / block];
 * out OUT_BF16 (y [M, N]) or OUT_ACT_MUL (y [M, N / 2]: the codes' rows in gate/up pairs, no bias,
 * act_table as gemm_bf16 takes it). x is cut to 2 bytes per input (module comment). mins as qgemv_q8_f32's.
 * Returns 0, -2 for a call it cannot take, -3 out of memory. */
int qgemv_q8_bf16(const uint16_t *x, int64_t ldx, const uint8_t *u, const float *scale, const float *mins,
                  int64_t block, const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                  int out, const float *act_table, int num_threads) {
    if ((block != 16 && block != 32) || k % 64 != 0) return -2;
    if (mins != NULL && block != 32) return -2;
    if (out != OUT_BF16 && (out != OUT_ACT_MUL || n % 2 != 0 || bias != NULL || act_table == NULL)) return -2;
    const q8_sink sink = {out, y, ldy, NULL, bias, NULL, act_table};
    if (mins != NULL && q4t_available()) /* affine 4-bit codes from q4t_pack: bf16 dots on x as it is */
        return q4t_gemv_bf16(x, ldx, u, scale, mins, bias, y, ldy, m, n, k, out, act_table, num_threads);
    char *scratch;
    float *wide;
    q8_row *rows = q8_rows(m, k, &scratch, &wide);
    if (rows == NULL) {
        free(scratch);
        return -3;
    }
    for (int64_t r = 0; r < m; r++) {
        for (int64_t i = 0; i < k; i++) wide[i] = bf16_to_float(x[r * ldx + i]);
        q8_cut_row(wide, k, 64 / block, 2, rows[r]);
    }
    const int status = q8_run(rows, m, u, scale, mins, n, k, block, 2, &sink, num_threads);
    free(scratch), free(rows);
    return status;
}
