/* The C kernels that call one another (cpu_decode_stack.c strings the others together): their
 * prototypes in one place, included by the files that define them too, so the compiler checks that
 * caller and definition agree. */
#ifndef AIOENGINE_CPU_KERNELS_H
#define AIOENGINE_CPU_KERNELS_H
#include <stdint.h>

/* gemm_bf16's epilogues (clib.py's GEMM_*) */
#define OUT_BF16 0
#define OUT_F32 1
#define OUT_ACT_MUL 2 /* act(gate) * up in torch's roundings: bf16 after each op, act (silu, gelu) by table */
#define OUT_ARGMAX 3   /* each row's argmax over N (the LM head for greedy rows: no logits written) */

void add_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *residual, int64_t residual_stride,
                       uint16_t *residual_out, const uint16_t *weight, uint16_t *out, int64_t rows, int64_t hidden,
                       float eps, int num_threads);
void gemma_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *residual, int64_t residual_stride,
                         uint16_t *residual_out, const uint16_t *weight, uint16_t *out, int64_t out_stride,
                         int64_t rows, int64_t heads, int64_t hidden, float eps, int num_threads);
void rotary_bf16(const uint16_t *x, int64_t token_stride, const int64_t *positions, const uint16_t *cos2,
                 const uint16_t *sin2, uint16_t *out, int64_t tokens, int64_t heads, int64_t head_dim,
                 int num_threads);
int gemm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *packed, const uint16_t *bias, void *y, int64_t ldy,
              int64_t m, int64_t n, int64_t k, int out, const float *act_table, int num_threads);
int decode_attention_bf16(const uint16_t *query, int64_t query_stride, const uint16_t *key_cache,
                          const uint16_t *value_cache, const int32_t *block_table, int64_t table_stride,
                          const int32_t *seq_lens, uint16_t *out, int num_reqs, int num_heads, int num_kv_heads,
                          int head_dim, int block_size, float scale, int window, int64_t block_stride,
                          int64_t token_stride, int64_t head_stride, int num_threads);
int prefill_attention_bf16(const uint16_t *query, int64_t query_stride, const uint16_t *key_cache,
                           const uint16_t *value_cache, const int32_t *blocks, int q_len, int seq_len, uint16_t *out,
                           int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int window,
                           int64_t block_stride, int64_t token_stride, int64_t head_stride, int num_threads);
void store_kv_cpu(const char *key, int64_t key_stride, const char *value, int64_t value_stride, char *key_cache,
                  char *value_cache, const int64_t *slots, int64_t num_tokens, int num_kv_heads, int head_dim,
                  int block_size, int64_t block_stride, int64_t token_stride, int64_t head_stride, int elem,
                  int64_t num_slots);
int decode_attention_f32(const float *query, int64_t query_stride, const float *key_cache, const float *value_cache,
                         const int32_t *block_table, int64_t table_stride, const int32_t *seq_lens, float *out,
                         int num_reqs, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                         int window, int64_t block_stride, int64_t token_stride, int64_t head_stride,
                         int num_threads);
void add_rms_norm_f32(const float *x, int64_t x_stride, const float *residual, int64_t residual_stride,
                      float *residual_out, const float *weight, float *out, int64_t rows, int64_t hidden, float eps,
                      int num_threads);
void rotary_f32(const float *x, int64_t token_stride, const int64_t *positions, const float *cos2, const float *sin2,
                float *out, int64_t tokens, int64_t heads, int64_t head_dim, int num_threads);
void silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t out_stride, int64_t rows, int64_t d,
                      int num_threads);
void qgemv_int8_f32(const float *x, int64_t ldx, const int8_t *q, const float *scale, const float *bias, float *y,
                    int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads);
void q8_pack(const int8_t *q, uint8_t *out, int64_t n, int64_t k, int64_t block, int num_threads);
void q4_pack(const uint8_t *q, uint8_t *out, int64_t n, int64_t k, int num_threads);
int qgemv_q8_f32(const float *x, int64_t ldx, const uint8_t *u, const float *scale, const float *mins, int64_t block,
                 const float *bias, float *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int64_t *argmax,
                 const float *scale_max, int limbs, int num_threads);
int qgemv_q8_vectorized(void); /* cpu_q8_dot.h: 1 where this level's dots are vectorized */
int qgemv_q8_bf16(const uint16_t *x, int64_t ldx, const uint8_t *u, const float *scale, const float *mins,
                  int64_t block, const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                  int out, const float *act_table, int num_threads);

/* cpu_q4_bf16.c: affine 4-bit codes against bf16 rows with bf16 dots (qgemv_q8_bf16's path where it exists) */
int q4t_available(void);
void q4t_pack(const uint8_t *q, uint8_t *out, int64_t n, int64_t k, int num_threads);
int q4t_gemv_bf16(const uint16_t *x, int64_t ldx, const uint8_t *u, const float *d, const float *mn,
                  const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int out,
                  const float *act_table, int num_threads);

/* cpu_q4_f32.c: affine 4-bit and symmetric 8-bit codes against float32 rows with float32 FMAs (codes widened
 * in registers) */
int q4f_preferred(void); /* 1 where float32 rows take these over cpu_q8.c's integer dots (measured) */
void q4f_pack(const uint8_t *q, uint8_t *out, int64_t n, int64_t k, int num_threads);
int q4f_gemv_f32(const float *x, int64_t ldx, const uint8_t *u, const float *d, const float *mn, const float *bias,
                 float *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads);
void q8f_pack(const int8_t *q, uint8_t *out, int64_t n, int64_t k, int num_threads);
int q8f_gemv_f32(const float *x, int64_t ldx, const uint8_t *u, const float *d, const float *bias, float *y,
                 int64_t ldy, int64_t m, int64_t n, int64_t k, int num_threads);
int moe_q4f_f32(const float *x, int64_t T, int64_t H, int64_t I, int64_t k, const int64_t *ids,
                const float *weights, const int64_t *w13, const int64_t *d13, const int64_t *m13, const int64_t *w2,
                const int64_t *d2, const int64_t *m2, int64_t E, float *out, int num_threads);

/* cpu_isa.c: the level this library was compiled for (clib.py's _LEVEL_CODES) */
int aioengine_isa_level(void);

#endif
