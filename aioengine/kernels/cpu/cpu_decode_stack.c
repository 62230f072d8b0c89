/* A step's whole decoder stack in one call: for each layer, the same C kernels in the same order as the
 * Python path (gpu/models/llama.py and gemma3.py with bf16 on the CPU), so the same bits, without Python,
 * torch's dispatch and ctypes' argument conversion between them: a small model's decode step is short enough
 * for them to count, and so is a step that carries a short prompt chunk beside its decodes.
 * aioengine/gpu/cpu/decode_stack.py fills the structs and decides when it applies: Llama/Qwen2/Gemma 3 layers
 * whose linears are packed for cpu_gemm.c with the activation fused (some also on their GGUF block codes, for
 * steps of a few rows); decode rows first, then each prompt chunk through the packed prefill kernel (the
 * Python path's attention for such a step). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"

/* A linear's GGUF block codes (codes NULL: none; mins non-NULL: affine 4-bit ones, in cpu_q4_bf16.c's tiles
 * where the CPU has AVX512-BF16, in cpu_q4_f32.c's layout for float32 rows with fma set, else cpu_q8.c's),
 * run for steps of up to max_rows rows in place of its packed GEMM, as gpu/cpu/q8_linear.py's Q8Linear does;
 * block 0 (float32 stack only): --quantization int8's codes, one scale per output (cpu_qgemv.c). */
typedef struct {
    const uint8_t *codes;
    const float *scales, *mins;
    int64_t block, max_rows, fma;
} q8_codes;

/* One layer's weights, cache, rotary tables and window (fixed for the engine's life). Biases may be NULL;
 * the Gemma norms (q_norm, k_norm, pre_ff_norm, post_ff_norm) are NULL in a Llama-family layer. */
typedef struct {
    const void *input_norm, *post_norm;
    const void *qkv, *qkv_bias, *o, *o_bias, *gate_up, *down, *down_bias;
    void *key_cache, *value_cache;
    const void *q_norm, *k_norm, *pre_ff_norm, *post_ff_norm;
    const void *cos2, *sin2; /* rotary tables [max_position, head_dim] */
    int64_t window;              /* 0: full attention */
    int64_t group;               /* its KV cache group: which block table and slots it uses */
    q8_codes qkv_q8, o_q8, gate_up_q8, down_q8;
} layer_weights;

/* Shapes shared by the layers, and this step's inputs and scratch (rows: the step's tokens, the decodes
 * first; requests num_decodes..num_reqs-1 are prompt chunks, rows query_start_loc[i]..[i + 1]). */
typedef struct {
    int64_t hidden, intermediate, num_heads, num_kv_heads, head_dim;
    float eps, scale;
    int64_t gemma; /* Gemma 3's layer: (1 + w) norms, q/k norms, post-norms */
    int64_t block_size, block_stride, token_stride, head_stride, num_slots;
    const float *act_table;
    int64_t rows;
    const int64_t *positions;
    const int64_t *const *slots;          /* per KV cache group */
    const int32_t *const *block_tables;   /* per KV cache group */
    const int64_t *table_strides;         /* per KV cache group */
    const int32_t *seq_lens;
    void *normed, *qkv_out, *qk_normed, *qk_rotated, *attn, *act, *gate_up; /* scratch, rows x their widths */
    int num_threads;
    int64_t num_decodes, num_reqs, max_seq_len;
    const int64_t *query_start_loc; /* [num_reqs + 1] */
} stack_args;

/* y = x W^T (+ bias, or the gated epilogue) on the codes where the step is decodes only and small enough,
 * else the GEMM (a prompt's rows never take the codes: its KV, pooled vector and logprobs are the same
 * alone as in a batch) */
static int linear(const q8_codes *q, const stack_args *a, const uint16_t *x, int64_t ldx, const uint16_t *packed,
                  const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t n, int64_t k, int out) {
    if (q->codes != NULL && a->rows <= q->max_rows && a->num_decodes == a->rows)
        return qgemv_q8_bf16(x, ldx, q->codes, q->scales, q->mins, q->block, bias, y, ldy, a->rows, n, k, out, a->act_table,
                             a->num_threads);
    return gemm_bf16(x, ldx, packed, bias, y, ldy, a->rows, n, k, out, a->act_table, a->num_threads);
}

/* hidden [rows, H] in: the embeddings; out: the last layer's MLP output. residual [rows, H] out: the residual
 * stream to add before the final norm (as LlamaModel threads it). Returns 0, or the failing kernel's status. */
int decode_stack_bf16(const layer_weights *layers, int num_layers, const stack_args *a, uint16_t *hidden,
                      uint16_t *residual) {
    const int64_t rows = a->rows, h = a->hidden, d = a->head_dim, hq = a->num_heads, hkv = a->num_kv_heads;
    const int64_t qkv_width = (hq + 2 * hkv) * d, qk_width = (hq + hkv) * d, nt = a->num_threads;
    uint16_t *normed = a->normed, *qkv_out = a->qkv_out, *qk_normed = a->qk_normed, *qk_rotated = a->qk_rotated;
    uint16_t *attn = a->attn, *act = a->act;
    for (int l = 0; l < num_layers; l++) {
        const layer_weights *w = layers + l;
        if (l == 0) /* the first layer's residual is its input */
            memcpy(residual, hidden, (size_t)(rows * h) * sizeof *hidden);
        const uint16_t *x = l == 0 ? NULL : hidden;
        if (a->gemma)
            gemma_rms_norm_bf16(x, h, residual, h, residual, w->input_norm, normed, h, rows, 1, h, a->eps, nt);
        else
            add_rms_norm_bf16(x, h, residual, h, residual, w->input_norm, normed, rows, h, a->eps, nt);
        int status = linear(&w->qkv_q8, a, normed, h, w->qkv, w->qkv_bias, qkv_out, qkv_width, qkv_width, h,
                            OUT_BF16);
        if (status) return status;
        const uint16_t *qk = qkv_out; /* q and k heads, token stride qk_stride */
        int64_t qk_stride = qkv_width;
        if (a->gemma) { /* per-head norms of q, then k, side by side in qk_normed */
            gemma_rms_norm_bf16(NULL, 0, qkv_out, qkv_width, NULL, w->q_norm, qk_normed, qk_width, rows, hq, d,
                                a->eps, nt);
            gemma_rms_norm_bf16(NULL, 0, qkv_out + hq * d, qkv_width, NULL, w->k_norm, qk_normed + hq * d,
                                qk_width, rows, hkv, d, a->eps, nt);
            qk = qk_normed;
            qk_stride = qk_width;
        }
        rotary_bf16(qk, qk_stride, a->positions, w->cos2, w->sin2, qk_rotated, rows, hq + hkv, d, nt);
        store_kv_cpu((const char *)(qk_rotated + hq * d), qk_width, (const char *)(qkv_out + (hq + hkv) * d),
                     qkv_width, (char *)w->key_cache, (char *)w->value_cache, a->slots[w->group], rows, (int)hkv,
                     (int)d, (int)a->block_size, a->block_stride, a->token_stride, a->head_stride, 2, a->num_slots);
        /* within its window a windowed layer attends fully (the Python path drops the window then too) */
        const int window = w->window && a->max_seq_len > w->window ? (int)w->window : 0;
        const int32_t *table = a->block_tables[w->group];
        const int64_t table_stride = a->table_strides[w->group];
        if (a->num_decodes) {
            status = decode_attention_bf16(qk_rotated, qk_width, w->key_cache, w->value_cache, table, table_stride,
                                           a->seq_lens, attn, (int)a->num_decodes, (int)hq, (int)hkv, (int)d,
                                           (int)a->block_size, a->scale, window, a->block_stride, a->token_stride,
                                           a->head_stride, (int)nt);
            if (status) return status;
        }
        for (int64_t i = a->num_decodes; i < a->num_reqs; i++) {
            const int64_t s0 = a->query_start_loc[i], s1 = a->query_start_loc[i + 1];
            status = prefill_attention_bf16(qk_rotated + s0 * qk_width, qk_width, w->key_cache, w->value_cache,
                                            table + i * table_stride, (int)(s1 - s0), a->seq_lens[i],
                                            attn + s0 * hq * d, (int)hq, (int)hkv, (int)d, (int)a->block_size,
                                            a->scale, window, a->block_stride, a->token_stride, a->head_stride, (int)nt);
            if (status) return status;
        }
        status = linear(&w->o_q8, a, attn, hq * d, w->o, w->o_bias, hidden, h, h, hq * d, OUT_BF16);
        if (status) return status;
        if (a->gemma) { /* post-attention norm in place, then the pre-MLP norm performs the residual add */
            gemma_rms_norm_bf16(NULL, 0, hidden, h, NULL, w->post_norm, hidden, h, rows, 1, h, a->eps, nt);
            gemma_rms_norm_bf16(hidden, h, residual, h, residual, w->pre_ff_norm, normed, h, rows, 1, h, a->eps,
                                nt);
        } else {
            add_rms_norm_bf16(hidden, h, residual, h, residual, w->post_norm, normed, rows, h, a->eps, nt);
        }
        status = linear(&w->gate_up_q8, a, normed, h, w->gate_up, NULL, act, a->intermediate,
                        2 * a->intermediate, h, OUT_ACT_MUL);
        if (status) return status;
        status = linear(&w->down_q8, a, act, a->intermediate, w->down, w->down_bias, hidden, h, h,
                        a->intermediate, OUT_BF16);
        if (status) return status;
        if (a->gemma) gemma_rms_norm_bf16(NULL, 0, hidden, h, NULL, w->post_ff_norm, hidden, h, rows, 1, h, a->eps, nt);
    }
    return 0;
}

/* A float32 linear on its codes (3 limbs, as gpu/cpu/q8_linear.py's float32 Q8Linear): the stack takes float32
 * steps only where every linear has codes and the step fits their max_rows (decode_stack.py checks). */
static int linear_f32(const q8_codes *q, const stack_args *a, const float *x, int64_t ldx, const float *bias,
                      float *y, int64_t ldy, int64_t n, int64_t k) {
    if (q->codes == NULL || a->rows > q->max_rows) return -1;
    if (q->block == 0) { /* --quantization int8: int8 codes with a scale per output (cpu_qgemv.c) */
        qgemv_int8_f32(x, ldx, (const int8_t *)q->codes, q->scales, bias, y, ldy, a->rows, n, k, a->num_threads);
        return 0;
    }
    if (q->fma)
        return q4f_gemv_f32(x, ldx, q->codes, q->scales, q->mins, bias, y, ldy, a->rows, n, k, a->num_threads);
    return qgemv_q8_f32(x, ldx, q->codes, q->scales, q->mins, q->block, bias, y, ldy, a->rows, n, k, NULL, NULL, 3,
                        a->num_threads);
}

/* decode_stack_bf16's float32 twin for Llama-family layers of decodes only, on the layers' GGUF codes: the float32
 * Python path's kernels in its order (norm, qkv, rotary, store, decode attention, o, norm, gate_up, silu * up,
 * down), so the same bits. The levels without bf16 dots (AVX2, AVX-512 without BF16, NEON) default to float32. */
int decode_stack_f32(const layer_weights *layers, int num_layers, const stack_args *a, float *hidden,
                     float *residual) {
    if (a->gemma || a->num_decodes != a->rows || a->num_reqs != a->rows) return -1;
    const int64_t rows = a->rows, h = a->hidden, d = a->head_dim, hq = a->num_heads, hkv = a->num_kv_heads;
    const int64_t qkv_width = (hq + 2 * hkv) * d, qk_width = (hq + hkv) * d, inter = a->intermediate;
    const int nt = a->num_threads;
    float *normed = a->normed, *qkv_out = a->qkv_out, *qk_rotated = a->qk_rotated, *attn = a->attn;
    float *act = a->act, *gate_up = a->gate_up;
    for (int l = 0; l < num_layers; l++) {
        const layer_weights *w = layers + l;
        if (l == 0) /* the first layer's residual is its input */
            memcpy(residual, hidden, (size_t)(rows * h) * sizeof *hidden);
        add_rms_norm_f32(l == 0 ? NULL : hidden, h, residual, h, residual, w->input_norm, normed, rows, h, a->eps,
                         nt);
        int status = linear_f32(&w->qkv_q8, a, normed, h, w->qkv_bias, qkv_out, qkv_width, qkv_width, h);
        if (status) return status;
        rotary_f32(qkv_out, qkv_width, a->positions, w->cos2, w->sin2, qk_rotated, rows, hq + hkv, d, nt);
        store_kv_cpu((const char *)(qk_rotated + hq * d), qk_width, (const char *)(qkv_out + (hq + hkv) * d),
                     qkv_width, (char *)w->key_cache, (char *)w->value_cache, a->slots[w->group], rows, (int)hkv,
                     (int)d, (int)a->block_size, a->block_stride, a->token_stride, a->head_stride, 4, a->num_slots);
        const int window = w->window && a->max_seq_len > w->window ? (int)w->window : 0;
        status = decode_attention_f32(qk_rotated, qk_width, w->key_cache, w->value_cache, a->block_tables[w->group],
                                      a->table_strides[w->group], a->seq_lens, attn, (int)rows, (int)hq, (int)hkv,
                                      (int)d, (int)a->block_size, a->scale, window, a->block_stride, a->token_stride,
                                      a->head_stride, nt);
        if (status) return status;
        status = linear_f32(&w->o_q8, a, attn, hq * d, w->o_bias, hidden, h, h, hq * d);
        if (status) return status;
        add_rms_norm_f32(hidden, h, residual, h, residual, w->post_norm, normed, rows, h, a->eps, nt);
        status = linear_f32(&w->gate_up_q8, a, normed, h, NULL, gate_up, 2 * inter, 2 * inter, h);
        if (status) return status;
        silu_and_mul_f32(gate_up, 2 * inter, act, inter, rows, inter, nt);
        status = linear_f32(&w->down_q8, a, act, inter, w->down_bias, hidden, h, h, inter);
        if (status) return status;
    }
    return 0;
}
