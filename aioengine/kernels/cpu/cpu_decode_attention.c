/* Paged decode attention for the CPU: one query token per request, read straight from the KV blocks.
 *
 * The torch path gathers each request's blocks into a padded tensor and runs SDPA, whose per-(request,
 * head) overhead dominates at small query lengths. Here each (request, KV head) pair streams its blocks
 * once, scores the query heads of its GQA group against each key, and keeps a running softmax
 * (flash-decoding's rescaling per block), so there is no gather, no padding and no mask.
 *
 * Layouts (aioengine/kernels/reference.py): key/value caches [num_blocks, block_size, Hkv, D] with any
 * block, token and head strides (elements; D contiguous): token-major, or the CPU's head-major memory;
 * query [B, Hq, D] with a token stride; block_table [B, table_stride] int32; seq_lens [B] int32.
 * window > 0 (a sliding-window layer): each query sees only its last `window` positions.
 * Accumulation is in float32; bf16 inputs are widened exactly and the output rounded to nearest even.
 *
 * Where the compiler targets AVX512-BF16 (-march=native on such a CPU), bf16 with a head_dim that is a
 * multiple of 32 runs decode_attention_bf16_avx512 below instead: 16 tokens a tile, dot products on bf16
 * pairs, and software prefetch (three blocks ahead into L2, the next one into L1): a decode's blocks are
 * scattered in DRAM, whose latency still costs more than the arithmetic left.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_kernels.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define MAX_BLOCK 64

#define SPLIT 256 /* positions a task: see DEFINE_KERNEL */

/* a request's first visible position: a window sees the last `window` (blocks before are never read) */
static inline int first_position(int seq_len, int window) {
    return window > 0 && seq_len > window ? seq_len - window : 0;
}

/* the request whose runs hold `run` (first: each request's first run, ascending) */
static inline int request_of(const int64_t *first, int num_reqs, int64_t run) {
    int lo = 0, hi = num_reqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (first[mid] <= run) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Run `run`'s request (*r) and positions [*p0, *p1); whether that request is cut in several runs. */
static inline int run_span(const int64_t *first, int num_reqs, const int32_t *seq_lens, int window, int64_t run,
                           int *r, int *p0, int *p1) {
    *r = request_of(first, num_reqs, run);
    const int cut = first[*r + 1] - first[*r] > 1;
    *p0 = first_position(seq_lens[*r], window) + (int)(run - first[*r]) * SPLIT;
    *p1 = cut && *p0 + SPLIT < seq_lens[*r] ? *p0 + SPLIT : seq_lens[*r];
    return cut;
}

/* One query head's output from its runs' partial states (acc[D], max, sum; `stride` floats apart), rescaled to
 * the largest max; written as float32 (elem 4) or bf16 (2). */
static void merge_runs(const float *part, int64_t runs, int64_t stride, int head_dim, void *out, size_t elem) {
    float m = -INFINITY, sum = 0.0f, acc[MAX_HEAD_DIM] = {0};
    for (int64_t i = 0; i < runs; i++) m = part[i * stride + head_dim] > m ? part[i * stride + head_dim] : m;
    for (int64_t i = 0; i < runs; i++) {
        const float *p = part + i * stride;
        if (p[head_dim + 1] == 0.0f) continue; /* an empty run (its max is -inf) */
        const float c = expf(p[head_dim] - m);
        sum += c * p[head_dim + 1];
        for (int d = 0; d < head_dim; d++) acc[d] += c * p[d];
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int d = 0; d < head_dim; d++) {
        if (elem == 4) ((float *)out)[d] = acc[d] * inv;
        else ((uint16_t *)out)[d] = float_to_bf16(acc[d] * inv);
    }
}

/* Each request's first run (first[r]; first[num_reqs]: all runs) and, where some request is cut in several,
 * room for the runs' partial states (*parts, else NULL). 0, -1 for a negative count, or -3 out of memory
 * (nothing left allocated). */
static int plan_runs(const int32_t *seq_lens, int num_reqs, int window, int num_heads, int head_dim,
                     int64_t **first_out, float **parts_out) {
    if (num_reqs < 0) return -1;
    int64_t *first = malloc((size_t)(num_reqs + 1) * sizeof *first);
    if (first == NULL) return -3;
    first[0] = 0;
    for (int r = 0; r < num_reqs; r++) {
        const int n = seq_lens[r] - first_position(seq_lens[r], window);
        first[r + 1] = first[r] + (n > SPLIT ? (n + SPLIT - 1) / SPLIT : 1);
    }
    float *parts = NULL;
    if (first[num_reqs] > num_reqs) {
        parts = malloc((size_t)(first[num_reqs] * num_heads * (head_dim + 2)) * sizeof *parts);
        if (parts == NULL) {
            free(first);
            return -3;
        }
    }
    *first_out = first;
    *parts_out = parts;
    return 0;
}

/* Every cut request's heads merged from their runs' states (acc, max, sum a head, a run's heads side by side)
 * into out (elem 4: float32, 2: bf16). */
static void merge_cut(const int64_t *first, const float *parts, int num_reqs, int num_heads, int head_dim, void *out,
                      size_t elem, int num_threads) {
    const int64_t width = head_dim + 2;
#pragma omp parallel for collapse(2) num_threads(num_threads)
    for (int r = 0; r < num_reqs; r++)
        for (int h = 0; h < num_heads; h++)
            if (first[r + 1] - first[r] > 1)
                merge_runs(parts + (first[r] * num_heads + h) * width, first[r + 1] - first[r], num_heads * width,
                           head_dim, (char *)out + ((int64_t)r * num_heads + h) * head_dim * (int64_t)elem, elem);
}

/* One (request, KV head) over positions [p0, p1) of its sequence, for the query heads of its GQA group: each
 * head's output accumulators, running max and sum (flash-decoding's rescaling per block). */
#define DEFINE_PART(NAME, T, LOAD, ROW)                                                                         \
    static void NAME(const T *query, const T *key_cache, const T *value_cache, const int32_t *blocks, int p0,   \
                     int p1, int group, int head_dim, int block_size, float scale, int64_t base_head,           \
                     int64_t block_stride, int64_t token_stride, float acc[][MAX_HEAD_DIM], float *run_max,     \
                     float *run_sum) {                                                                          \
        float q[MAX_GROUP][MAX_HEAD_DIM], row[MAX_HEAD_DIM], scores[MAX_GROUP][MAX_BLOCK];                      \
        for (int g = 0; g < group; g++) {                                                                       \
            for (int d = 0; d < head_dim; d++) {                                                                \
                q[g][d] = LOAD(query[g * head_dim + d]) * scale;                                                \
                acc[g][d] = 0.0f;                                                                               \
            }                                                                                                   \
            run_max[g] = -INFINITY;                                                                             \
            run_sum[g] = 0.0f;                                                                                  \
        }                                                                                                       \
        for (int start = p0 - p0 % block_size; start < p1; start += block_size) {                               \
            const int n = p1 - start < block_size ? p1 - start : block_size;                                    \
            const int t0 = start < p0 ? p0 - start : 0;                                                         \
            const int64_t base = (int64_t)blocks[start / block_size] * block_stride + base_head;                \
            for (int t = t0; t < n; t++) {                                                                      \
                const float *kr = ROW(key_cache + base + t * token_stride, row, head_dim);                      \
                for (int g = 0; g < group; g++) {                                                               \
                    float s = 0.0f;                                                                             \
                    for (int d = 0; d < head_dim; d++) s += q[g][d] * kr[d];                                    \
                    scores[g][t] = s;                                                                           \
                }                                                                                               \
            }                                                                                                   \
            for (int g = 0; g < group; g++) {                                                                   \
                float m = run_max[g];                                                                           \
                for (int t = t0; t < n; t++) m = scores[g][t] > m ? scores[g][t] : m;                           \
                const float correction = expf(run_max[g] - m);                                                  \
                run_sum[g] *= correction;                                                                       \
                for (int d = 0; d < head_dim; d++) acc[g][d] *= correction;                                     \
                for (int t = t0; t < n; t++) {                                                                  \
                    scores[g][t] = expf(scores[g][t] - m);                                                      \
                    run_sum[g] += scores[g][t];                                                                 \
                }                                                                                               \
                run_max[g] = m;                                                                                 \
            }                                                                                                   \
            for (int t = t0; t < n; t++) {                                                                      \
                const float *vr = ROW(value_cache + base + t * token_stride, row, head_dim);                    \
                for (int g = 0; g < group; g++) {                                                               \
                    const float p = scores[g][t];                                                               \
                    for (int d = 0; d < head_dim; d++) acc[g][d] += p * vr[d];                                  \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
    }

/* Tasks are (run of SPLIT positions of a request, KV head): a long sequence's keys are spread over the threads
 * whatever the batch (a single request has as few tasks as it has KV heads otherwise, which leaves threads idle),
 * and how a request's positions are cut depends on its length alone, so its output is the same in any batch.
 * The runs of a request cut in several are merged after the loop. Returns 0, -1 for shapes past the limits, -3
 * out of memory. */
#define DEFINE_KERNEL(NAME, PART, T, STORE)                                                                     \
    int NAME(const T *query, int64_t query_stride, const T *key_cache, const T *value_cache,                    \
             const int32_t *block_table, int64_t table_stride, const int32_t *seq_lens, T *out, int num_reqs,   \
             int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int window,            \
             int64_t block_stride, int64_t token_stride, int64_t head_stride, int num_threads) {                \
        const int group = num_heads / num_kv_heads;                                                             \
        if (head_dim > MAX_HEAD_DIM || group > MAX_GROUP || block_size > MAX_BLOCK) return -1;                  \
        int64_t *first;                                                                                         \
        float *parts;                                                                                           \
        const int planned = plan_runs(seq_lens, num_reqs, window, num_heads, head_dim, &first, &parts);         \
        if (planned) return planned;                                                                            \
        const int64_t runs = first[num_reqs], width = head_dim + 2; /* a partial state: acc, max, sum */        \
        _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")                   \
        for (int64_t run = 0; run < runs; run++) {                                                              \
            for (int kvh = 0; kvh < num_kv_heads; kvh++) {                                                      \
                float acc[MAX_GROUP][MAX_HEAD_DIM], run_max[MAX_GROUP], run_sum[MAX_GROUP];                     \
                int r, p0, p1;                                                                                  \
                const int cut = run_span(first, num_reqs, seq_lens, window, run, &r, &p0, &p1);                 \
                PART(query + r * query_stride + (int64_t)kvh * group * head_dim, key_cache, value_cache,        \
                     block_table + (int64_t)r * table_stride, p0, p1, group, head_dim, block_size, scale,       \
                     (int64_t)kvh * head_stride, block_stride, token_stride, acc, run_max, run_sum);            \
                for (int g = 0; g < group; g++) {                                                               \
                    const int64_t h = (int64_t)kvh * group + g;                                                 \
                    if (cut) {                                                                                  \
                        float *part = parts + (run * num_heads + h) * width;                                    \
                        memcpy(part, acc[g], (size_t)head_dim * sizeof *part);                                  \
                        part[head_dim] = run_max[g];                                                            \
                        part[head_dim + 1] = run_sum[g];                                                        \
                        continue;                                                                               \
                    }                                                                                           \
                    T *op = out + ((int64_t)r * num_heads + h) * head_dim;                                      \
                    const float inv = run_sum[g] > 0.0f ? 1.0f / run_sum[g] : 0.0f;                             \
                    for (int d = 0; d < head_dim; d++) op[d] = STORE(acc[g][d] * inv);                          \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        if (parts != NULL) merge_cut(first, parts, num_reqs, num_heads, head_dim, out, sizeof *out, num_threads);\
        free(parts);                                                                                            \
        free(first);                                                                                            \
        return 0;                                                                                               \
    }

/* A cached key or value row as float32: float32 ones are read in place (a copy was a libc call a token, most
 * of a long context's step), bf16 ones widened into buf. */
static inline const float *row_f32(const float *p, float *buf, int n) {
    (void)buf, (void)n;
    return p;
}

static inline const float *row_bf16(const uint16_t *p, float *buf, int n) {
    for (int d = 0; d < n; d++) buf[d] = bf16_to_float(p[d]);
    return buf;
}

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
DEFINE_PART(part_f32, float, LOAD_F32, row_f32)
DEFINE_PART(part_bf16, uint16_t, bf16_to_float, row_bf16)
DEFINE_KERNEL(decode_attention_f32, part_f32, float, STORE_F32)
DEFINE_KERNEL(decode_attention_bf16_generic, part_bf16, uint16_t, float_to_bf16)

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "cpu_avx512.h"

/* The running state of one query head: its bf16 pairs, the softmax's max and sum, and the output
 * accumulators. acc_lo/acc_hi[h] dword 4L + i hold output dims 32h + 8L + i and 32h + 8L + 4 + i (the
 * order vpunpck{l,h}wd leaves the value pairs in; undone once at the end). */
typedef struct {
    __m512 acc_lo[MAX_HEAD_DIM / 32], acc_hi[MAX_HEAD_DIM / 32];
    int32_t qd[MAX_HEAD_DIM / 2];
    float run_max, run_sum;
} head_state;

/* One tile (m <= 16 tokens of one block, one token per lane) for the query heads st[0..group) of one KV
 * head. Scores: the tile's keys are transposed in registers (a key's bf16 pairs become one lane of 16
 * vectors), so q.k for 16 tokens is head_dim/2 vdpbf16ps (exact products, float32 sums) with no
 * horizontal reductions; the softmax runs on whole vectors. p.V: each pair of value rows is interleaved,
 * so one vdpbf16ps adds two tokens' contributions to 16 outputs; the probabilities go in as two bf16
 * parts (hi + lo), which keeps them as exact as float32 would for this sum. Inlined with constant group and
 * halves, the accumulators live in registers for the tile as independent dependency chains. */
static inline __attribute__((always_inline)) void tile_bf16_avx512(
    head_state *st, const uint16_t *k_rows, const uint16_t *v_rows, int m, const int group, const int halves,
    int64_t token_stride, float scale) {
    __m512 s_even[MAX_GROUP], s_odd[MAX_GROUP]; /* two chains per head */
    for (int g = 0; g < group; g++) s_even[g] = s_odd[g] = _mm512_setzero_ps();
    for (int h = 0; h < halves; h++) {
        __m512i k[16];
        for (int t = 0; t < 16; t++) /* rows past the tile read as zero (stale slots may hold NaN) */
            k[t] = _mm512_maskz_loadu_epi32(t < m ? 0xffff : 0, k_rows + t * token_stride + 32 * h);
        transpose16x16(k); /* k[c] lane t: pair c of token t */
        for (int c = 0; c < 16; c += 2)
            for (int g = 0; g < group; g++) {
                s_even[g] = _mm512_dpbf16_ps(s_even[g], (__m512bh)k[c],
                                             (__m512bh)_mm512_set1_epi32(st[g].qd[16 * h + c]));
                s_odd[g] = _mm512_dpbf16_ps(s_odd[g], (__m512bh)k[c + 1],
                                            (__m512bh)_mm512_set1_epi32(st[g].qd[16 * h + c + 1]));
            }
    }
    const __mmask16 live = (__mmask16)((1u << m) - 1);
    /* probabilities of token pairs (2c, 2c + 1) as bf16 pairs, split in two: p = hi + lo to ~16 bits, so
     * p.V loses nothing a float32 p.V would keep (a single bf16 p would move the logits against float32) */
    int32_t pd_hi[MAX_GROUP][8], pd_lo[MAX_GROUP][8];
    __m512 acc_lo[MAX_GROUP][MAX_HEAD_DIM / 32], acc_hi[MAX_GROUP][MAX_HEAD_DIM / 32];
    for (int g = 0; g < group; g++) {
        const __m512 x = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), live, _mm512_add_ps(s_even[g], s_odd[g]),
                                            _mm512_set1_ps(scale));
        const float mx = _mm512_reduce_max_ps(x);
        for (int h = 0; h < halves; h++) {
            acc_lo[g][h] = st[g].acc_lo[h];
            acc_hi[g][h] = st[g].acc_hi[h];
        }
        /* Past the first tiles the max rarely grows, and then the correction is e^0 = 1 exactly: skipping
         * the exp and the rescale keeps every bit. */
        if (mx > st[g].run_max) {
            const float correction = exp1(st[g].run_max - mx);
            st[g].run_sum *= correction;
            st[g].run_max = mx;
            const __m512 cv = _mm512_set1_ps(correction);
            for (int h = 0; h < halves; h++) {
                acc_lo[g][h] = _mm512_mul_ps(acc_lo[g][h], cv);
                acc_hi[g][h] = _mm512_mul_ps(acc_hi[g][h], cv);
            }
        }
        const __m512 p = exp16(_mm512_sub_ps(x, _mm512_set1_ps(st[g].run_max)));
        st[g].run_sum += _mm512_reduce_add_ps(p);
        const __m256bh hi = _mm512_cvtneps_pbh(p);
        _mm256_storeu_si256((__m256i *)pd_hi[g], (__m256i)hi);
        _mm256_storeu_si256((__m256i *)pd_lo[g], (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(p, _mm512_cvtpbh_ps(hi))));
    }
    for (int c = 0; 2 * c < m; c++) {
        const uint16_t *v0 = v_rows + (int64_t)(2 * c) * token_stride;
        const __mmask16 second = 2 * c + 1 < m ? 0xffff : 0;
        for (int h = 0; h < halves; h++) {
            const __m512i a = _mm512_loadu_si512(v0 + 32 * h);
            const __m512i b = _mm512_maskz_loadu_epi32(second, v0 + token_stride + 32 * h);
            const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
            const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
            for (int g = 0; g < group; g++) {
                const __m512bh p_hi = (__m512bh)_mm512_set1_epi32(pd_hi[g][c]);
                const __m512bh p_lo = (__m512bh)_mm512_set1_epi32(pd_lo[g][c]);
                acc_lo[g][h] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc_lo[g][h], lo, p_hi), lo, p_lo);
                acc_hi[g][h] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc_hi[g][h], hi, p_hi), hi, p_lo);
            }
        }
    }
    for (int g = 0; g < group; g++)
        for (int h = 0; h < halves; h++) {
            st[g].acc_lo[h] = acc_lo[g][h];
            st[g].acc_hi[h] = acc_hi[g][h];
        }
}

#define PF_FAR 3 /* blocks ahead prefetched into L2 (the next one goes to L1) */

/* Prefetch one head's key and value rows of block NJ with HINT (a macro: as an inlined function with the hint
 * as a parameter, gcc's code ran slower). */
#define PREFETCH_BLOCK(NJ, HINT)                                                                         \
    do {                                                                                                 \
        const int64_t nb = (int64_t)blocks[NJ] * block_stride;                                           \
        const int rows = (NJ) < last ? block_size : seq_len - (NJ) * block_size;                         \
        for (int t = 0; t < rows; t++)                                                                   \
            for (int off = 0; off < 2 * head_dim; off += 64) {                                           \
                _mm_prefetch((const char *)(k_head + nb + t * token_stride) + off, HINT);                \
                _mm_prefetch((const char *)(v_head + nb + t * token_stride) + off, HINT);                \
            }                                                                                            \
    } while (0)

/* One task per (run of a request's positions, KV head), the runs as in the generic loop: a single long request
 * keeps every thread busy, and its output is the same alone as in a batch. */
static int decode_attention_bf16_avx512(const uint16_t *query, int64_t query_stride, const uint16_t *key_cache,
                                        const uint16_t *value_cache, const int32_t *block_table,
                                        int64_t table_stride, const int32_t *seq_lens, uint16_t *out, int num_reqs,
                                        int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                                        int window, int64_t block_stride, int64_t token_stride,
                                        int64_t head_stride, int num_threads) {
    const int group = num_heads / num_kv_heads;
    const int halves = head_dim / 32;
    int64_t *first;
    float *parts;
    const int planned = plan_runs(seq_lens, num_reqs, window, num_heads, head_dim, &first, &parts);
    if (planned) return planned;
    const int64_t runs = first[num_reqs];
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t run = 0; run < runs; run++) {
        for (int kvh = 0; kvh < num_kv_heads; kvh++) {
            int r, p0, seq_len; /* seq_len: this run's end */
            const int cut = run_span(first, num_reqs, seq_lens, window, run, &r, &p0, &seq_len);
            head_state st[MAX_GROUP];
            for (int g = 0; g < group; g++) {
                memcpy(st[g].qd, query + r * query_stride + (int64_t)(kvh * group + g) * head_dim, 2 * head_dim);
                for (int h = 0; h < halves; h++) st[g].acc_lo[h] = st[g].acc_hi[h] = _mm512_setzero_ps();
                st[g].run_max = -INFINITY;
                st[g].run_sum = 0.0f;
            }
            const int32_t *blocks = block_table + (int64_t)r * table_stride;
            const int last = (seq_len - 1) / block_size;
            const uint16_t *k_head = key_cache + (int64_t)kvh * head_stride, *v_head = value_cache + (int64_t)kvh * head_stride;
            for (int pos = p0; pos < seq_len;) {
                const int in_block = pos % block_size, j = pos / block_size;
                if (in_block == 0) { /* scattered blocks defeat the hardware prefetchers: without these the
                                        loop waits on DRAM. Far blocks go to L2 first, which keeps more lines in
                                        flight than L1's miss buffers allow; the next block then moves to L1. */
                    for (int nj = j == 0 ? 1 : j + PF_FAR; nj <= j + PF_FAR && nj <= last; nj++)
                        if (nj > j + 1) PREFETCH_BLOCK(nj, _MM_HINT_T1);
                    for (int nj = j + 1; nj <= j + 1 && nj <= last; nj++) PREFETCH_BLOCK(nj, _MM_HINT_T0);
                }
                int m = block_size - in_block < 16 ? block_size - in_block : 16;
                m = seq_len - pos < m ? seq_len - pos : m;
                const int64_t base = (int64_t)blocks[j] * block_stride + (int64_t)in_block * token_stride;
                const uint16_t *k = k_head + base, *v = v_head + base;
#define TILE(G, H) tile_bf16_avx512(st, k, v, m, G, H, token_stride, scale)
                /* The common shapes get their own unrolled copy (head_dim 64 or 128, GQA groups 1-8). */
                switch (halves * 100 + group) {
                case 201: TILE(1, 2); break;
                case 202: TILE(2, 2); break;
                case 203: TILE(3, 2); break;
                case 204: TILE(4, 2); break;
                case 205: TILE(5, 2); break;
                case 206: TILE(6, 2); break;
                case 207: TILE(7, 2); break;
                case 208: TILE(8, 2); break;
                case 401: TILE(1, 4); break;
                case 402: TILE(2, 4); break;
                case 403: TILE(3, 4); break;
                case 404: TILE(4, 4); break;
                case 405: TILE(5, 4); break;
                case 406: TILE(6, 4); break;
                case 407: TILE(7, 4); break;
                case 408: TILE(8, 4); break;
                default: TILE(group, halves); break;
                }
#undef TILE
                pos += m;
            }
            for (int g = 0; g < group; g++) {
                float acc[MAX_HEAD_DIM] __attribute__((aligned(64)));
                for (int h = 0; h < halves; h++) {
                    _mm512_store_ps(acc + 32 * h, st[g].acc_lo[h]);
                    _mm512_store_ps(acc + 32 * h + 16, st[g].acc_hi[h]);
                }
                const int64_t h = (int64_t)kvh * group + g;
                if (!cut) {
                    store_row(out + ((int64_t)r * num_heads + h) * head_dim, acc, st[g].run_sum, head_dim);
                    continue;
                }
                float *part = parts + (run * num_heads + h) * (head_dim + 2); /* store_row's order, unscaled */
                for (int d = 0; d < head_dim; d++) part[d] = acc[acc_index(d)];
                part[head_dim] = st[g].run_max;
                part[head_dim + 1] = st[g].run_sum;
            }
        }
    }
    if (parts != NULL) merge_cut(first, parts, num_reqs, num_heads, head_dim, out, sizeof *out, num_threads);
    free(parts);
    free(first);
    return 0;
}
#endif

/* The bf16 entry point: the AVX512-BF16 loop where the CPU and shapes allow, else the generic one. */
int decode_attention_bf16(const uint16_t *query, int64_t query_stride, const uint16_t *key_cache,
                          const uint16_t *value_cache, const int32_t *block_table, int64_t table_stride,
                          const int32_t *seq_lens, uint16_t *out, int num_reqs, int num_heads, int num_kv_heads,
                          int head_dim, int block_size, float scale, int window, int64_t block_stride,
                          int64_t token_stride, int64_t head_stride, int num_threads) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (head_dim % 32 == 0 && head_dim <= MAX_HEAD_DIM && num_heads / num_kv_heads <= MAX_GROUP
        && block_size <= MAX_BLOCK)
        return decode_attention_bf16_avx512(query, query_stride, key_cache, value_cache, block_table, table_stride,
                                            seq_lens, out, num_reqs, num_heads, num_kv_heads, head_dim, block_size,
                                            scale, window, block_stride, token_stride, head_stride, num_threads);
#endif
    return decode_attention_bf16_generic(query, query_stride, key_cache, value_cache, block_table, table_stride,
                                         seq_lens, out, num_reqs, num_heads, num_kv_heads, head_dim, block_size,
                                         scale, window, block_stride, token_stride, head_stride, num_threads);
}

/* out[i] = exp16(x[i]), the attention kernels' e^x, for the tests; -1 where the AVX512 loops are not built. */
int exp_f32(const float *x, float *out, int64_t n) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = lanes_mask(n - i);
        _mm512_mask_storeu_ps(out + i, m, exp16(_mm512_maskz_loadu_ps(m, x + i)));
    }
    return 0;
#else
    (void)x, (void)out, (void)n;
    return -1;
#endif
}

/* Whether decode_attention_bf16 has its AVX512-BF16 loop (the caller routes prefill through it only then). */
int decode_attention_bf16_vectorized(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* Write T tokens' keys and values ([T, Hkv, D] with token strides, any element size) into their cache slots
 * (slot = block * block_size + offset) of a cache with the given strides (elements). A slot outside the
 * cache (-1 marks a padded row, as in vLLM) writes nothing. */
void store_kv_cpu(const char *key, int64_t key_stride, const char *value, int64_t value_stride, char *key_cache,
                  char *value_cache, const int64_t *slots, int64_t num_tokens, int num_kv_heads, int head_dim,
                  int block_size, int64_t block_stride, int64_t token_stride, int64_t head_stride, int elem,
                  int64_t num_slots) {
    const size_t row = (size_t)head_dim * elem;
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0 || slot >= num_slots) continue;
        const int64_t base = (slot / block_size) * block_stride + (slot % block_size) * token_stride;
        for (int h = 0; h < num_kv_heads; h++) {
            const int64_t at = (base + h * head_stride) * elem;
            memcpy(key_cache + at, key + (t * key_stride + (int64_t)h * head_dim) * elem, row);
            memcpy(value_cache + at, value + (t * value_stride + (int64_t)h * head_dim) * elem, row);
        }
    }
}
