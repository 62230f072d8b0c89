/* The decoder layer's elementwise ops for bf16 on the CPU, one pass over each row instead of torch's
 * chain of ops (each of which allocates, converts to float32 and back, and launches its own threads).
 *
 * They round where the torch path rounds, so they give its bits except where a float32 sum is evaluated
 * in another order (rms_norm's mean of squares): then a bf16 result can move by one ulp. The torch path
 * stays the reference (tests/kernels/cpu/test_elementwise.py). bf16's silu_and_mul is not here: torch's
 * vectorized exp already runs it as fast as a C loop does (measured); float32's is, for decode_stack_f32.
 * Rows are independent; large calls split them over OpenMP threads (torch's pool: libgomp is shared).
 * With AVX512-BF16 the norm and rotary run 16 lanes a step, rounding with vcvtneps2bf16, faster than gcc's
 * vectorization of the scalar loops, whose roundings are integer emulation.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_kernels.h"

static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

#define PARALLEL_MIN_ELEMS (1 << 14) /* below this the thread hand-off costs more than it saves */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AVX512DQ__)
#include "cpu_avx512.h"
#define ELEMENTWISE_AVX512 1

/* float_to_bf16 on 16 lanes, bit for bit: vcvtneps2bf16 rounds to nearest even as it does, but flushes
 * subnormals and quiets NaNs its own way, so a vector holding either (never, in practice) takes float_to_bf16
 * lane by lane. */
static inline __m256i bf16x16(__m512 f) {
    if (__builtin_expect(_mm512_fpclass_ps_mask(f, 0x01 | 0x20 | 0x80) != 0, 0)) { /* QNaN, subnormal, SNaN */
        uint16_t out[16];
        float v[16];
        _mm512_storeu_ps(v, f);
        for (int i = 0; i < 16; i++) out[i] = float_to_bf16(v[i]);
        return _mm256_loadu_si256((const __m256i *)out);
    }
    return (__m256i)_mm512_cvtneps_pbh(f);
}

static inline __m512 round_bf16x16(__m512 f) { return widen_bf16_bits(bf16x16(f)); } /* float -> bf16 -> float */

/* One row of add_rms_norm_bf16, 16 columns a step: the roundings of the scalar loop below; the mean of
 * squares is summed in 16 lanes (another order: a result can move by an ulp, as against torch already). */
/* The norms' first pass over a row: r = bf16(x + res) written to res_out (when x is given, else r = res),
 * and 1 / sqrt(mean(r^2) + eps). */
static inline float residual_inv_rms(const uint16_t *xi, const uint16_t *res, uint16_t *res_out, int64_t hidden,
                                     float eps) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < hidden; j += 16) {
        const __mmask16 m = lanes_mask(hidden - j);
        __m512 r = widen_bf16x16(res + j, m);
        if (xi != NULL) {
            const __m256i rb = bf16x16(_mm512_add_ps(widen_bf16x16(xi + j, m), r));
            _mm256_mask_storeu_epi16(res_out + j, m, rb);
            r = widen_bf16_bits(rb);
        }
        sum = _mm512_fmadd_ps(r, r, sum);
    }
    return 1.0f / sqrtf(_mm512_reduce_add_ps(sum) / (float)hidden + eps);
}

static void add_rms_norm_row(const uint16_t *xi, const uint16_t *res, uint16_t *res_out, const uint16_t *weight,
                             uint16_t *o, int64_t hidden, float eps) {
    const float inv = residual_inv_rms(xi, res, res_out, hidden, eps);
    const uint16_t *r_row = xi != NULL ? res_out : res;
    const __m512 iv = _mm512_set1_ps(inv);
    for (int64_t j = 0; j < hidden; j += 16) {
        const __mmask16 m = lanes_mask(hidden - j);
        const __m512 normed = round_bf16x16(_mm512_mul_ps(widen_bf16x16(r_row + j, m), iv));
        _mm256_mask_storeu_epi16(o + j, m, bf16x16(_mm512_mul_ps(widen_bf16x16(weight + j, m), normed)));
    }
}

/* One (sub-)row of gemma_rms_norm_bf16: the same first pass as add_rms_norm_row, then
 * bf16((r * inv) * (1 + w)) in float32, one rounding (HF's Gemma3RMSNorm). o may be res (in place). */
static void gemma_norm_row(const uint16_t *xi, const uint16_t *res, uint16_t *res_out, const uint16_t *weight,
                           uint16_t *o, int64_t hidden, float eps) {
    const float inv = residual_inv_rms(xi, res, res_out, hidden, eps);
    const uint16_t *r_row = xi != NULL ? res_out : res;
    const __m512 iv = _mm512_set1_ps(inv), one = _mm512_set1_ps(1.0f);
    for (int64_t j = 0; j < hidden; j += 16) {
        const __mmask16 m = lanes_mask(hidden - j);
        const __m512 normed = _mm512_mul_ps(widen_bf16x16(r_row + j, m), iv);
        const __m512 scale = _mm512_add_ps(one, widen_bf16x16(weight + j, m));
        _mm256_mask_storeu_epi16(o + j, m, bf16x16(_mm512_mul_ps(normed, scale)));
    }
}

/* One token's heads of rotary_bf16, 16 dims a step within each half (any even head_dim). */
static void rotary_row(const uint16_t *x, const uint16_t *c, const uint16_t *s, uint16_t *out, int64_t heads,
                       int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        const uint16_t *xi = x + h * head_dim;
        uint16_t *o = out + h * head_dim;
        for (int64_t j = 0; j < head_dim; j += 16) {
            const int64_t end = j < half ? half : head_dim; /* a step stays within its half */
            const __mmask16 m = lanes_mask(end - j);
            const int64_t from = j < half ? j + half : j - half;
            const __m512 a = round_bf16x16(_mm512_mul_ps(widen_bf16x16(xi + j, m), widen_bf16x16(c + j, m)));
            const __m512 b = round_bf16x16(_mm512_mul_ps(widen_bf16x16(xi + from, m), widen_bf16x16(s + j, m)));
            _mm256_mask_storeu_epi16(o + j, m, bf16x16(_mm512_add_ps(a, b)));
            if (end - j < 16) j = end - 16; /* the next step starts at the other half */
        }
    }
}
#endif

/* residual_out = x + residual (when x is given), out = weight * bf16(r / sqrt(mean(r^2) + eps)) with r the
 * (new) residual: vLLM's fused add + RMSNorm in Hugging Face's rounding order. Rows have their own strides. */
void add_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *residual, int64_t residual_stride,
                       uint16_t *residual_out, const uint16_t *weight, uint16_t *out, int64_t rows, int64_t hidden,
                       float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * hidden >= PARALLEL_MIN_ELEMS)
    for (int64_t i = 0; i < rows; i++) {
#ifdef ELEMENTWISE_AVX512
        add_rms_norm_row(x != NULL ? x + i * x_stride : NULL, residual + i * residual_stride,
                         residual_out + i * hidden, weight, out + i * hidden, hidden, eps);
        continue;
#endif
        const uint16_t *res = residual + i * residual_stride;
        uint16_t *res_out = residual_out + i * hidden;
        float sum = 0.0f;
        if (x != NULL) {
            const uint16_t *xi = x + i * x_stride;
            for (int64_t j = 0; j < hidden; j++) {
                const float r = round_bf16(bf16_to_float(xi[j]) + bf16_to_float(res[j]));
                res_out[j] = float_to_bf16(r);
                sum += r * r;
            }
        } else {
            for (int64_t j = 0; j < hidden; j++) {
                const float r = bf16_to_float(res[j]);
                sum += r * r;
            }
        }
        const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
        const uint16_t *r_row = x != NULL ? res_out : res;
        uint16_t *o = out + i * hidden;
        for (int64_t j = 0; j < hidden; j++)
            o[j] = float_to_bf16(bf16_to_float(weight[j]) * round_bf16(bf16_to_float(r_row[j]) * inv));
    }
}

/* Gemma's norm: as add_rms_norm_bf16, but out = bf16(r / sqrt(mean(r^2) + eps) * (1 + weight)) in float32
 * (HF's Gemma3RMSNorm, one rounding). Each of `rows` rows holds `heads` sub-rows of `hidden` normalised
 * alone (q/k norms: a token's heads, contiguous; then x must be NULL); out rows have stride out_stride. */
void gemma_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *residual, int64_t residual_stride,
                         uint16_t *residual_out, const uint16_t *weight, uint16_t *out, int64_t out_stride,
                         int64_t rows, int64_t heads, int64_t hidden, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * heads * hidden >= PARALLEL_MIN_ELEMS)
    for (int64_t i = 0; i < rows; i++)
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *xi = x != NULL ? x + i * x_stride : NULL;
            const uint16_t *res = residual + i * residual_stride + h * hidden;
            uint16_t *res_out = xi != NULL ? residual_out + i * hidden : NULL, *o = out + i * out_stride + h * hidden;
#ifdef ELEMENTWISE_AVX512
            gemma_norm_row(xi, res, res_out, weight, o, hidden, eps);
            continue;
#endif
            float sum = 0.0f;
            for (int64_t j = 0; j < hidden; j++) {
                const float r = xi != NULL ? round_bf16(bf16_to_float(xi[j]) + bf16_to_float(res[j]))
                                           : bf16_to_float(res[j]);
                if (xi != NULL) res_out[j] = float_to_bf16(r);
                sum += r * r;
            }
            const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
            const uint16_t *r_row = xi != NULL ? res_out : res;
            for (int64_t j = 0; j < hidden; j++)
                o[j] = float_to_bf16(bf16_to_float(r_row[j]) * inv * (1.0f + bf16_to_float(weight[j])));
        }
}

/* out[t, h] = x[t, h] * cos2[p] + roll(x[t, h], D/2) * sin2[p], p = positions[t], each product and the sum
 * rounded to bf16 (torch's three ops); cos2 = [cos, cos], sin2 = [-sin, sin] (CpuOps.rope_tables in
 * aioengine/gpu/cpu/backend.py).
 * x rows have a token stride (q and k heads side by side in the qkv projection); out is contiguous. */
void rotary_bf16(const uint16_t *x, int64_t token_stride, const int64_t *positions, const uint16_t *cos2,
                 const uint16_t *sin2, uint16_t *out, int64_t tokens, int64_t heads, int64_t head_dim,
                 int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *c = cos2 + positions[t] * head_dim, *s = sin2 + positions[t] * head_dim;
#ifdef ELEMENTWISE_AVX512
        rotary_row(x + t * token_stride, c, s, out + t * heads * head_dim, heads, head_dim);
        continue;
#endif
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *xi = x + t * token_stride + h * head_dim;
            uint16_t *o = out + (t * heads + h) * head_dim;
            for (int64_t j = 0; j < head_dim; j++) {
                const float rolled = bf16_to_float(xi[j < half ? j + half : j - half]);
                const float a = round_bf16(bf16_to_float(xi[j]) * bf16_to_float(c[j]));
                const float b = round_bf16(rolled * bf16_to_float(s[j]));
                o[j] = float_to_bf16(a + b);
            }
        }
    }
}

/* A key whose unsigned order is the float order of a bf16: -0 counts as +0 (torch's ties pick the first of
 * either), and every NaN is the largest (torch's argmax returns the first NaN). Integer ops only, so
 * -ffast-math cannot reorder or drop them. */
static inline uint16_t bf16_order_key(uint16_t h) {
    if ((h & 0x7fffu) > 0x7f80u) return 0xffffu; /* NaN */
    if (h == 0x8000u) h = 0;                     /* -0 */
    return (uint16_t)((h & 0x8000u) ? ~h : (h | 0x8000u));
}

#if defined(__AVX512BW__)
#include <immintrin.h>

static inline __m512i bf16_order_keys(__m512i v) { /* bf16_order_key on 32 lanes */
    const __mmask32 nan = _mm512_cmpgt_epu16_mask(_mm512_and_si512(v, _mm512_set1_epi16(0x7fff)),
                                                  _mm512_set1_epi16(0x7f80));
    v = _mm512_mask_mov_epi16(v, _mm512_cmpeq_epi16_mask(v, _mm512_set1_epi16((short)0x8000)), _mm512_setzero_si512());
    const __mmask32 neg = _mm512_test_epi16_mask(v, _mm512_set1_epi16((short)0x8000));
    __m512i k = _mm512_mask_mov_epi16(_mm512_or_si512(v, _mm512_set1_epi16((short)0x8000)), neg,
                                      _mm512_xor_si512(v, _mm512_set1_epi16(-1)));
    return _mm512_mask_mov_epi16(k, nan, _mm512_set1_epi16(-1));
}

static int64_t argmax_row(const uint16_t *row, int64_t cols) {
    __m512i best = _mm512_setzero_si512();
    int64_t j = 0;
    for (; j + 32 <= cols; j += 32) best = _mm512_max_epu16(best, bf16_order_keys(_mm512_loadu_si512(row + j)));
    uint16_t lanes[32], top = 0;
    _mm512_storeu_si512(lanes, best);
    for (int l = 0; l < 32; l++) top = lanes[l] > top ? lanes[l] : top;
    for (int64_t t = j; t < cols; t++) top = bf16_order_key(row[t]) > top ? bf16_order_key(row[t]) : top;
    const __m512i want = _mm512_set1_epi16((short)top);
    for (j = 0; j + 32 <= cols; j += 32) {
        const __mmask32 hit = _mm512_cmpeq_epi16_mask(bf16_order_keys(_mm512_loadu_si512(row + j)), want);
        if (hit) return j + __builtin_ctz(hit);
    }
    for (; j < cols; j++)
        if (bf16_order_key(row[j]) == top) return j;
    return 0;
}
#else
static int64_t argmax_row(const uint16_t *row, int64_t cols) {
    uint16_t top = 0;
    for (int64_t j = 0; j < cols; j++) top = bf16_order_key(row[j]) > top ? bf16_order_key(row[j]) : top;
    for (int64_t j = 0; j < cols; j++)
        if (bf16_order_key(row[j]) == top) return j;
    return 0;
}
#endif

/* out[i] = the first index of row i's largest value (torch.argmax's answer), for bf16 logits: widening them
 * to float32 first (what torch needs for a fast argmax on the CPU) writes and reads the rows twice more. */
void argmax_bf16(const uint16_t *x, int64_t row_stride, int64_t rows, int64_t cols, int64_t *out,
                 int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMS)
    for (int64_t i = 0; i < rows; i++) out[i] = argmax_row(x + i * row_stride, cols);
}

/* float32 versions of the two above, for a CPU whose models run in float32 (no bf16 instructions): one pass
 * instead of torch's chain of ops. No roundings to mimic; the mean of squares is summed in another order
 * than torch's, so a result can move by an ulp. gcc vectorizes the loops (-O3 -ffast-math -march=native). */
void add_rms_norm_f32(const float *x, int64_t x_stride, const float *residual, int64_t residual_stride,
                      float *residual_out, const float *weight, float *out, int64_t rows, int64_t hidden,
                      float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * hidden >= PARALLEL_MIN_ELEMS)
    for (int64_t i = 0; i < rows; i++) {
        const float *res = residual + i * residual_stride;
        const float *r_row = res;
        float sum = 0.0f;
        if (x != NULL) {
            const float *xi = x + i * x_stride;
            float *res_out = residual_out + i * hidden;
            for (int64_t j = 0; j < hidden; j++) {
                const float r = xi[j] + res[j];
                res_out[j] = r;
                sum += r * r;
            }
            r_row = res_out;
        } else {
            for (int64_t j = 0; j < hidden; j++) sum += res[j] * res[j];
        }
        const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
        float *o = out + i * hidden;
        for (int64_t j = 0; j < hidden; j++) o[j] = weight[j] * (r_row[j] * inv);
    }
}

void rotary_f32(const float *x, int64_t token_stride, const int64_t *positions, const float *cos2,
                const float *sin2, float *out, int64_t tokens, int64_t heads, int64_t head_dim, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos2 + positions[t] * head_dim, *s = sin2 + positions[t] * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *xi = x + t * token_stride + h * head_dim;
            float *o = out + (t * heads + h) * head_dim;
            for (int64_t j = 0; j < half; j++) o[j] = xi[j] * c[j] + xi[j + half] * s[j];
            for (int64_t j = half; j < head_dim; j++) o[j] = xi[j] * c[j] + xi[j - half] * s[j];
        }
    }
}

/* silu(gate) * up for float32 rows [gate | up] (d each), as torch's silu (g / (1 + e^-g)): the float32 MLP's
 * activation in the Python path and in decode_stack_f32 alike, so the two give the same bits. */
void silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t out_stride, int64_t rows, int64_t d,
                      int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * d >= PARALLEL_MIN_ELEMS)
    for (int64_t i = 0; i < rows; i++) {
        const float *g = x + i * x_stride, *u = g + d;
        float *o = out + i * out_stride;
        for (int64_t j = 0; j < d; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}
