/* Affine 4-bit block codes (Q4_1, Q4_K's sub-blocks: w = d q + m, q in [0, 15], blocks of 32), and symmetric
 * 8-bit ones (Q8_0: w = d q, q in [-127, 127]), against float32 rows with float32 FMAs: a float32 Q8Linear's path for such weights (gpu/cpu/q8_linear.py) on the levels
 * where that beats cpu_q8.c's integer dots, which cut x into three bytes and pay three dots a weight for it;
 * and a mixture's whole routed layer on its experts' 4-bit codes in one call (moe_q4f_f32, at every level).
 *
 * sum w x = d sum q x + m sum x, per block: a code is exact in float32, so x is used as it is (no cut) and the
 * only roundings are float32's own, as in torch's GEMM over the dequantized weight. The codes are widened in
 * registers by shifts and masks, no shuffles: each 32-bit lane holds 8 codes, and code j of lane t is input
 * 8 j + t of its 64-input chunk, so the j-th widened vector meets x[8 j .. 8 j + 8) as it lies in memory. The
 * widened codes serve every row of a pass (up to Q4F_MAXR), so an extra row costs 8 FMAs per 64 weights; from
 * QP_FROM rows the weights are widened into panels once for all rows instead (qp_gemm).
 * Written with GCC's vector extensions: AVX2 and NEON (two registers a vector) from one source.
 *
 * Layout (q4f_pack): per output, per 64-input chunk, 32 bytes: byte 4 t + i holds the codes of inputs
 * 16 i + t (low nibble) and 16 i + 8 + t (high). Scales and offsets are float32 [N, K / 32].
 * Layout (q8f_pack): per output, per 32-input block, 32 bytes: byte 4 t + j holds the code of input 8 j + t,
 * widened by a shift left and an arithmetic shift right. */
#include <math.h>
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

/* each lane's code j of a word of codes: 4-bit (j < 8: nibble j, q4f_pack) or 8-bit (j < 4: signed byte j,
 * q8f_pack) */
static inline q4f_vi qf_code(q4f_vi v, const int bits, int j) {
    return bits == 4 ? (v >> (4 * j)) & 15 : (v << (24 - 8 * j)) >> 24;
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
            for (int j = 0; j < 8; j++) f[j] = __builtin_convertvector(qf_code(w, 4, j), q4f_vf);
        } else {
            q4f_vi w[2];
            memcpy(w, u + c, sizeof w);
            for (int j = 0; j < 8; j++) f[j] = __builtin_convertvector(qf_code(w[j / 4], 8, j % 4), q4f_vf);
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

/* one output of M rows (1..Q4F_MAXR, a constant per call so that the sums stay in registers) */
static void q4f_rows(const float *const *xs, const int M, const uint8_t *uo, const float *dq, int64_t k, float *out) {
    switch (M) {
    case 1: q4f_output(xs, uo, dq, k, 1, 4, out); break;
    case 2: q4f_output(xs, uo, dq, k, 2, 4, out); break;
    case 3: q4f_output(xs, uo, dq, k, 3, 4, out); break;
    default: q4f_output(xs, uo, dq, k, 4, 4, out); break;
    }
}

/* the offsets' share of one output for one row: sum over the blocks of m times the row's block sum */
static inline float q4f_offset(const float *mq, const float *s, int64_t blocks) {
    float off = 0.0f;
    for (int64_t b = 0; b < blocks; b++) off += mq[b] * s[b];
    return off;
}

/* each row's sum per block of 32 of r [n, k] into s [n, k / 32] (the offsets' share: m sum x) */
static inline void q4f_block_sums(const float *r, int64_t k, float *s) {
    for (int64_t b = 0; b < k / 32; b++) {
        float acc = 0.0f;
        for (int64_t i = 0; i < 32; i++) acc += r[32 * b + i];
        s[b] = acc;
    }
}

/* From QP_FROM rows a thread widens a panel of QP_WIDTH outputs' weights into a buffer once, d q + m in one
 * rounding (d q is exact: a float16-sized scale times a small code), which is the float32 weight the codes were
 * recovered from (gpu/cpu/block_codes.py), laid out k-major, and meets every row with it QP_ROWS rows at a
 * time, as a GEMM's micro-kernel does: each input of a row is broadcast against 16 outputs' weights, so there
 * is no sum across lanes and no offsets are left to add, and the widening is paid once for all rows. */
#define QP_FROM 10  /* rows; below, the passes of Q4F_MAXR rows were as fast or faster (docs/benchmarks.md) */
#define QP_WIDTH 16 /* outputs a panel: two vectors */
#define QP_ROWS 6   /* rows a tile: 12 sums, 2 weight vectors and a broadcast x in AVX2's 16 registers */
#define QP_KC 2048  /* inputs a panel holds (128 KB): wider layers are summed chunk by chunk, the panel in L2 */

/* Outputs o0 .. o0 + QP_WIDTH's weights d q (+ m) at inputs c0 .. c1, k-major: p[(c - c0) * QP_WIDTH + i] is
 * output o0 + i's weight at input c (outputs at or past n repeat the last one, never written out). A vector
 * gathers the same 32-bit word of 8 outputs' codes, so the widening shifts and masks meet 8 outputs at one
 * input. */
static void qp_widen(const uint8_t *u, const float *d, const float *mn, int64_t n, int64_t o0, int64_t k,
                     int64_t c0, int64_t c1, const int bits, float *p) {
    const int64_t blocks = k / 32;
    for (int h = 0; h < QP_WIDTH / 8; h++) {
        int64_t o[8];
        for (int i = 0; i < 8; i++) o[i] = o0 + 8 * h + i < n ? o0 + 8 * h + i : n - 1;
        for (int64_t c = c0; c < c1; c += 64) {
            q4f_vf dv[2], mv[2];
            for (int b = 0; b < 2; b++)
                for (int i = 0; i < 8; i++) {
                    dv[b][i] = d[o[i] * blocks + c / 32 + b];
                    mv[b][i] = mn != NULL ? mn[o[i] * blocks + c / 32 + b] : 0.0f;
                }
            for (int t = 0; t < 8; t++) /* word t of a 32-byte group holds inputs 8 j + t (q4f_pack, q8f_pack) */
                for (int g = 0; g < bits / 4; g++) {
                    q4f_vi v;
                    for (int i = 0; i < 8; i++) {
                        uint32_t word;
                        memcpy(&word, u + (o[i] * k + c) * bits / 8 + 32 * g + 4 * t, sizeof word);
                        v[i] = (int32_t)word;
                    }
                    for (int j = 0; j < 32 / bits; j++) { /* 8 codes (4-bit) or 4 (8-bit) a word */
                        const int at = bits == 4 ? 8 * j + t : 32 * g + 8 * j + t;
                        const q4f_vi code = qf_code(v, bits, j);
                        const q4f_vf w = __builtin_convertvector(code, q4f_vf) * dv[at / 32] + mv[at / 32];
                        memcpy(p + (c - c0 + at) * QP_WIDTH + 8 * h, &w, sizeof w);
                    }
                }
        }
    }
}

/* M rows (a constant per call) against a widened panel of k inputs: y[r][o0 + i] for i < no, plus bias for the
 * first chunk of inputs, plus what y holds for the others */
static inline __attribute__((always_inline)) void qp_tile(const float *x, int64_t ldx, const float *p, int64_t k,
                                                           const int M, const float *bias, float *y, int64_t ldy,
                                                           int no, int first) {
    q4f_vf acc[QP_ROWS][2];
    for (int r = 0; r < M; r++) acc[r][0] = acc[r][1] = (q4f_vf){0};
    for (int64_t c = 0; c < k; c++) {
        const q4f_vf w0 = q4f_load(p + c * QP_WIDTH), w1 = q4f_load(p + c * QP_WIDTH + 8);
        for (int r = 0; r < M; r++) {
            const float xs = x[r * ldx + c];
            acc[r][0] += xs * w0;
            acc[r][1] += xs * w1;
        }
    }
    for (int r = 0; r < M; r++) {
        float out[QP_WIDTH];
        memcpy(out, &acc[r][0], sizeof acc[r][0]);
        memcpy(out + 8, &acc[r][1], sizeof acc[r][1]);
        for (int i = 0; i < no; i++)
            y[r * ldy + i] = out[i] + (!first ? y[r * ldy + i] : bias != NULL ? bias[i] : 0.0f);
    }
}

static int qp_gemm(const float *x, int64_t ldx, const uint8_t *u, const float *d, const float *mn, const float *bias,
                   float *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads, const int bits) {
    const int64_t panels = (n + QP_WIDTH - 1) / QP_WIDTH;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *p = malloc((size_t)(QP_WIDTH * (k < QP_KC ? k : QP_KC) + 1) * sizeof *p);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < panels; t++) {
            if (p == NULL) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            const int64_t o0 = t * QP_WIDTH;
            const int no = n - o0 < QP_WIDTH ? (int)(n - o0) : QP_WIDTH;
            const float *b = bias != NULL ? bias + o0 : NULL;
            for (int64_t c0 = 0; c0 < k || c0 == 0; c0 += QP_KC) { /* k = 0: one empty chunk writes the bias */
                const int64_t kc = k - c0 < QP_KC ? k - c0 : QP_KC;
                qp_widen(u, d, mn, n, o0, k, c0, c0 + kc, bits, p);
                for (int64_t r0 = 0; r0 < m; r0 += QP_ROWS) {
                    const float *xr = x + r0 * ldx + c0;
                    float *yr = y + r0 * ldy + o0;
                    const int f = c0 == 0;
                    switch (m - r0 < QP_ROWS ? (int)(m - r0) : QP_ROWS) { /* a constant M: sums in registers */
                    case 1: qp_tile(xr, ldx, p, kc, 1, b, yr, ldy, no, f); break;
                    case 2: qp_tile(xr, ldx, p, kc, 2, b, yr, ldy, no, f); break;
                    case 3: qp_tile(xr, ldx, p, kc, 3, b, yr, ldy, no, f); break;
                    case 4: qp_tile(xr, ldx, p, kc, 4, b, yr, ldy, no, f); break;
                    case 5: qp_tile(xr, ldx, p, kc, 5, b, yr, ldy, no, f); break;
                    default: qp_tile(xr, ldx, p, kc, 6, b, yr, ldy, no, f); break;
                    }
                }
            }
        }
        free(p);
    }
    return failed ? -3 : 0;
}

/* y = x [M, K] W^T (+ bias), float32, W = d q (+ m) per block of 32 from q4f_pack's codes (bits 4, mn given)
 * or q8f_pack's (bits 8, mn NULL), K a multiple of 64, d and mn float32 [N, K / 32]. */
static int qf_gemv(const float *x, int64_t ldx, const uint8_t *u, const float *d, const float *mn, const float *bias,
                   float *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads, const int bits) {
    if (k % 64 != 0 || m < 0) return -2;
    if (m == 0) return 0;
    if (m >= QP_FROM) return qp_gemm(x, ldx, u, d, mn, bias, y, ldy, m, n, k, num_threads, bits);
    const int64_t blocks = k / 32;
    float *sums = NULL; /* each row's sum of x per block, for the offsets */
    if (mn != NULL) {
        sums = malloc((size_t)(m * blocks) * sizeof *sums);
        if (sums == NULL) return -3;
        for (int64_t r = 0; r < m; r++) q4f_block_sums(x + r * ldx, k, sums + r * blocks);
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
            if (bits == 4) q4f_rows(xs, M, uo, dq, k, out);
            else switch (M) {
                case 1: q4f_output(xs, uo, dq, k, 1, 8, out); break;
                case 2: q4f_output(xs, uo, dq, k, 2, 8, out); break;
                case 3: q4f_output(xs, uo, dq, k, 3, 8, out); break;
                default: q4f_output(xs, uo, dq, k, 4, 8, out); break;
                }
            for (int r = 0; r < M; r++) {
                const float off = mn != NULL ? q4f_offset(mn + o * blocks, sums + (r0 + r) * blocks, blocks) : 0.0f;
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

#define MOE_CHUNK 16 /* outputs a work unit: a chosen expert's outputs split among the threads in these */

/* One expert group's outputs [o0, o1) for its rows: rows r of the group read in[row(r)], write res[(first + r) *
 * ldr + o] = sum d q in + m sums (codes q4f_pack'd [n_out, k / 2], d and mn float32 [n_out, k / 32]). */
static void moe_unit(const float *in, int64_t ldi, const int64_t *rows, const float *sums, int64_t n_rows,
                     const uint8_t *u, const float *d, const float *mn, int64_t k, int64_t o0, int64_t o1, float *res,
                     int64_t ldr) {
    const int64_t blocks = k / 32;
    for (int64_t r0 = 0; r0 < n_rows; r0 += Q4F_MAXR) {
        const int M = n_rows - r0 < Q4F_MAXR ? (int)(n_rows - r0) : Q4F_MAXR;
        const float *xs[Q4F_MAXR];
        for (int r = 0; r < M; r++) xs[r] = in + rows[r0 + r] * ldi;
        for (int64_t o = o0; o < o1; o++) {
            float out[Q4F_MAXR];
            q4f_rows(xs, M, u + o * k / 2, d + o * blocks, k, out);
            for (int r = 0; r < M; r++)
                res[(r0 + r) * ldr + o] = out[r] + q4f_offset(mn + o * blocks, sums + rows[r0 + r] * blocks, blocks);
        }
    }
}

/* A mixture's routed experts on their q4f_pack codes for T tokens, each choosing k of E experts (ids, weights
 * [T, k]): out [T, H] = sum over a token's experts, in increasing id, of weight * down(silu(gate x) * up x).
 * Expert e's gate_up is w13[e] (packed [2I, H / 2], gate rows then up rows; d13[e], m13[e] float32 [2I, H / 32])
 * and its down w2[e] ([H, I / 2]; d2[e], m2[e] [H, I / 32]), given as address tables [E]. The token-expert
 * pairs are grouped by expert (a counting sort, token order within one), so an expert chosen by several tokens
 * streams its codes once for all of them and an unchosen one is never read. One parallel region: the gate_up
 * outputs of all chosen experts split among the threads, then the activations, then the down outputs, then
 * each token's sum. Returns 0, -2 for a call it cannot take (an id out of range, H or I not a multiple of 64,
 * k over 64),
 * -3 out of memory. */
int moe_q4f_f32(const float *x, int64_t T, int64_t H, int64_t I, int64_t k, const int64_t *ids,
                const float *weights, const int64_t *w13, const int64_t *d13, const int64_t *m13, const int64_t *w2,
                const int64_t *d2, const int64_t *m2, int64_t E, float *out, int num_threads) {
    if (H % 64 || I % 64 || T < 0 || k <= 0 || k > 64 || E <= 0) return -2;
    if (T == 0) return 0;
    const int64_t P = T * k;
    for (int64_t p = 0; p < P; p++)
        if (ids[p] < 0 || ids[p] >= E) return -2;
    int64_t *start = calloc((size_t)(E + 1), sizeof *start), *fill = malloc((size_t)E * sizeof *fill);
    int64_t *tok = malloc((size_t)P * sizeof *tok), *pos = malloc((size_t)P * sizeof *pos);
    int64_t *gexp = malloc((size_t)E * sizeof *gexp), *self = malloc((size_t)P * sizeof *self);
    float *h = malloc((size_t)(P * 2 * I) * sizeof *h), *a = malloc((size_t)(P * I) * sizeof *a);
    float *yp = malloc((size_t)(P * H) * sizeof *yp), *sx = malloc((size_t)(T * H / 32) * sizeof *sx);
    float *sa = malloc((size_t)(P * I / 32) * sizeof *sa);
    int status = 0;
    if (!start || !fill || !tok || !pos || !gexp || !self || !h || !a || !yp || !sx || !sa) {
        status = -3;
        goto done;
    }
    for (int64_t p = 0; p < P; p++) start[ids[p] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    int64_t G = 0;
    for (int64_t e = 0; e < E; e++) {
        fill[e] = start[e];
        if (start[e + 1] > start[e]) gexp[G++] = e;
    }
    for (int64_t p = 0; p < P; p++) { /* sorted position of each pair; the token of each position */
        pos[p] = fill[ids[p]]++;
        tok[pos[p]] = p / k;
        self[pos[p]] = pos[p];
    }
    const int64_t c1 = (2 * I + MOE_CHUNK - 1) / MOE_CHUNK, c2 = (H + MOE_CHUNK - 1) / MOE_CHUNK;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) q4f_block_sums(x + t * H, H, sx + t * (H / 32));
        /* static: at batch 1 every expert has one row (dynamic measured 8% slower there); a prompt's uneven
         * experts may leave a thread waiting */
#pragma omp for schedule(static)
        for (int64_t w = 0; w < G * c1; w++) { /* gate_up of every chosen expert, for its tokens */
            const int64_t e = gexp[w / c1], o0 = (w % c1) * MOE_CHUNK, first = start[e];
            const int64_t o1 = o0 + MOE_CHUNK < 2 * I ? o0 + MOE_CHUNK : 2 * I;
            moe_unit(x, H, tok + first, sx, start[e + 1] - first, (const uint8_t *)w13[e], (const float *)d13[e],
                     (const float *)m13[e], H, o0, o1, h + first * 2 * I, 2 * I);
        }
#pragma omp for schedule(static)
        for (int64_t q = 0; q < P; q++) { /* silu(gate) * up, then its block sums */
            const float *g = h + q * 2 * I;
            float *aq = a + q * I;
            for (int64_t i = 0; i < I; i++) aq[i] = g[i] / (1.0f + expf(-g[i])) * g[I + i];
            q4f_block_sums(aq, I, sa + q * (I / 32));
        }
#pragma omp for schedule(static)
        for (int64_t w = 0; w < G * c2; w++) { /* down of every chosen expert */
            const int64_t e = gexp[w / c2], o0 = (w % c2) * MOE_CHUNK, first = start[e];
            const int64_t o1 = o0 + MOE_CHUNK < H ? o0 + MOE_CHUNK : H;
            moe_unit(a, I, self + first, sa, start[e + 1] - first, (const uint8_t *)w2[e], (const float *)d2[e],
                     (const float *)m2[e], I, o0, o1, yp + first * H, H);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) { /* the token's experts in increasing id, as the torch path adds them */
            int64_t js[64];
            const int64_t n = k;
            for (int64_t j = 0; j < n; j++) {
                int64_t i = j;
                while (i > 0 && ids[t * k + js[i - 1]] > ids[t * k + j]) {
                    js[i] = js[i - 1];
                    i--;
                }
                js[i] = j;
            }
            float *ot = out + t * H;
            for (int64_t c = 0; c < H; c++) ot[c] = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                const float wj = weights[t * k + js[j]];
                const float *y = yp + pos[t * k + js[j]] * H;
                for (int64_t c = 0; c < H; c++) ot[c] += y[c] * wj;
            }
        }
    }
done:
    free(start); free(fill); free(tok); free(pos); free(gexp); free(self);
    free(h); free(a); free(yp); free(sx); free(sa);
    return status;
}
