/* Paged decode attention for the CPU: one query token per request, read straight from the KV blocks.
 *
 * The torch path gathers each request's blocks into a padded tensor and runs SDPA, whose per-(request,
 * head) overhead dominates at small query lengths. Here each (request, KV head) pair streams its blocks
 * once, scores the query heads of its GQA group against each key, and keeps a running softmax
 * (flash-decoding's rescaling per block), so there is no gather, no padding and no mask.
 *
 * Layouts (aioengine/kernels/attention.py): key/value caches [num_blocks, block_size, Hkv, D];
 * query [B, Hq, D] with a token stride; block_table [B, table_stride] int32; seq_lens [B] int32.
 * Accumulation is in float32; bf16 inputs are widened exactly and the output rounded to nearest even.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define MAX_BLOCK 64

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define DEFINE_KERNEL(NAME, T, LOAD, STORE)                                                              \
    int NAME(const T *query, int64_t query_stride, const T *key_cache, const T *value_cache,            \
             const int32_t *block_table, int64_t table_stride, const int32_t *seq_lens, T *out,           \
             int num_reqs, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,    \
             int num_threads) {                                                                          \
        const int group = num_heads / num_kv_heads;                                                      \
        if (head_dim > MAX_HEAD_DIM || group > MAX_GROUP || block_size > MAX_BLOCK) return -1;           \
        const int64_t token_stride = (int64_t)num_kv_heads * head_dim;                                   \
        const int64_t block_stride = token_stride * block_size;                                          \
        _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")            \
        for (int r = 0; r < num_reqs; r++) {                                                             \
            for (int kvh = 0; kvh < num_kv_heads; kvh++) {                                               \
                float q[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];                          \
                float row[MAX_HEAD_DIM], scores[MAX_GROUP][MAX_BLOCK];                                   \
                float run_max[MAX_GROUP], run_sum[MAX_GROUP];                                            \
                for (int g = 0; g < group; g++) {                                                        \
                    const T *qp = query + r * query_stride + (int64_t)(kvh * group + g) * head_dim;       \
                    for (int d = 0; d < head_dim; d++) {                                                 \
                        q[g][d] = LOAD(qp[d]) * scale;                                                   \
                        acc[g][d] = 0.0f;                                                                \
                    }                                                                                    \
                    run_max[g] = -INFINITY;                                                              \
                    run_sum[g] = 0.0f;                                                                   \
                }                                                                                        \
                const int seq_len = seq_lens[r];                                                         \
                const int32_t *blocks = block_table + (int64_t)r * table_stride;                         \
                for (int start = 0; start < seq_len; start += block_size) {                              \
                    const int n = seq_len - start < block_size ? seq_len - start : block_size;           \
                    const int64_t base = (int64_t)blocks[start / block_size] * block_stride               \
                                         + (int64_t)kvh * head_dim;                                      \
                    for (int t = 0; t < n; t++) {                                                        \
                        const T *kp = key_cache + base + t * token_stride;                               \
                        for (int d = 0; d < head_dim; d++) row[d] = LOAD(kp[d]);                         \
                        for (int g = 0; g < group; g++) {                                                \
                            float s = 0.0f;                                                              \
                            for (int d = 0; d < head_dim; d++) s += q[g][d] * row[d];                    \
                            scores[g][t] = s;                                                            \
                        }                                                                                \
                    }                                                                                    \
                    for (int g = 0; g < group; g++) {                                                    \
                        float m = run_max[g];                                                            \
                        for (int t = 0; t < n; t++) m = scores[g][t] > m ? scores[g][t] : m;             \
                        const float correction = expf(run_max[g] - m);                                   \
                        run_sum[g] *= correction;                                                        \
                        for (int d = 0; d < head_dim; d++) acc[g][d] *= correction;                      \
                        for (int t = 0; t < n; t++) {                                                    \
                            scores[g][t] = expf(scores[g][t] - m);                                       \
                            run_sum[g] += scores[g][t];                                                  \
                        }                                                                                \
                        run_max[g] = m;                                                                  \
                    }                                                                                    \
                    for (int t = 0; t < n; t++) {                                                        \
                        const T *vp = value_cache + base + t * token_stride;                             \
                        for (int d = 0; d < head_dim; d++) row[d] = LOAD(vp[d]);                         \
                        for (int g = 0; g < group; g++) {                                                \
                            const float p = scores[g][t];                                                \
                            for (int d = 0; d < head_dim; d++) acc[g][d] += p * row[d];                  \
                        }                                                                                \
                    }                                                                                    \
                }                                                                                        \
                for (int g = 0; g < group; g++) {                                                        \
                    T *op = out + ((int64_t)r * num_heads + kvh * group + g) * head_dim;                 \
                    const float inv = seq_len > 0 ? 1.0f / run_sum[g] : 0.0f;                            \
                    for (int d = 0; d < head_dim; d++) op[d] = STORE(acc[g][d] * inv);                   \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        return 0;                                                                                        \
    }

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
DEFINE_KERNEL(decode_attention_f32, float, LOAD_F32, STORE_F32)
DEFINE_KERNEL(decode_attention_bf16, uint16_t, bf16_to_float, float_to_bf16)
