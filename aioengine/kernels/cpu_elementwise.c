/* The decoder layer's elementwise ops for bf16 on the CPU, one pass over each row instead of torch's
 * chain of ops (each of which allocates, converts to float32 and back, and launches its own threads).
 *
 * They round where the torch path rounds, so they give its bits except where a float32 sum is evaluated
 * in another order (rms_norm's mean of squares): then a bf16 result can move by one ulp. The torch path
 * stays the reference (tests/kernels/test_cpu_elementwise.py). silu_and_mul is not here: torch's
 * vectorized exp already runs it as fast as a C loop does (measured).
 * Rows are independent; large calls split them over OpenMP threads (torch's pool: libgomp is shared).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_kernels.h"

static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

#define PARALLEL_MIN_ELEMS (1 << 14) /* below this the thread hand-off costs more than it saves */

/* residual_out = x + residual (when x is given), out = weight * bf16(r / sqrt(mean(r^2) + eps)) with r the
 * (new) residual: vLLM's fused add + RMSNorm in Hugging Face's rounding order. Rows have their own strides. */
void add_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *residual, int64_t residual_stride,
                       uint16_t *residual_out, const uint16_t *weight, uint16_t *out, int64_t rows, int64_t hidden,
                       float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * hidden >= PARALLEL_MIN_ELEMS)
    for (int64_t i = 0; i < rows; i++) {
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

/* out[t, h] = x[t, h] * cos2[p] + roll(x[t, h], D/2) * sin2[p], p = positions[t], each product and the sum
 * rounded to bf16 (torch's three ops); cos2 = [cos, cos], sin2 = [-sin, sin] (aioengine/gpu/layers.py).
 * x rows have a token stride (q and k heads side by side in the qkv projection); out is contiguous. */
void rotary_bf16(const uint16_t *x, int64_t token_stride, const int64_t *positions, const uint16_t *cos2,
                 const uint16_t *sin2, uint16_t *out, int64_t tokens, int64_t heads, int64_t head_dim,
                 int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *c = cos2 + positions[t] * head_dim, *s = sin2 + positions[t] * head_dim;
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
