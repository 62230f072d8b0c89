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

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

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
