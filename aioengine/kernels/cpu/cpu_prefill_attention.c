/* Causal attention for a prefill chunk on the CPU (AVX512-BF16): the prompt tokens of one request.
 *
 * The request's keys and values are packed once per call into the layouts vdpbf16ps wants:
 *   keys   [Hkv][tile][pair c][16 tokens]  (a token's dims 2c, 2c+1 as one dword: one lane per token),
 *   values [Hkv][tile][token pair][D]      (tokens 2p, 2p+1 of a dim as one dword: one lane per dim, in
 *                                           vpunpck{l,h}wd's order within each 32 dims; store_row undoes it),
 * and each task (a KV head and a run of query tokens) walks them in chunks of 64 keys: the tiles' score
 * chains interleaved, one online-softmax update per chunk, and p.V with the probabilities as two bf16 parts
 * (hi + lo, as exact as float32 for this sum) in four chains. A chunk's packed keys and values (16 KiB at
 * D = 64) stay in L1 while every row of the task uses them.
 *
 * A row's arithmetic depends only on its position and the keys it sees, never on the chunk it came in:
 * a prompt computed whole, in budget-sized chunks, or after a prefix-cache hit gets the same bits (so a
 * cached prefix cannot change a greedy answer). Every prompt token comes here, one-token chunks too; the
 * decode kernel (cpu_decode_attention.c) serves decodes only.
 *
 * Layouts (aioengine/kernels/reference.py): caches [num_blocks, block_size, Hkv, D] with any block, token and
 * head strides (elements, D contiguous); query [q_len, Hq, D] with a token stride; out [q_len, Hq, D]
 * contiguous. Query token i sits at position seq_len - q_len + i and sees positions 0..that one, or with a
 * window (sliding-window layers; 0: none) only the last `window` of them. Chunks start at multiples of 64
 * whatever the window, so a windowed row's bits do not depend on its chunking either, and no tile wholly
 * before every row's window is packed or read.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"

#define PF_MAX_ROWS 32 /* query rows (tokens x heads of a KV group) one task carries */

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "cpu_avx512.h"

#define PF_MAX_HEAD_DIM 256
#define PF_CHUNK 64 /* keys per online-softmax update */

/* Scores of one row against the chunk's tiles: pair-by-pair dot products with the tiles interleaved, so NT x 2
 * chains of vdpbf16ps are in flight at once (one tile at a time left the loop waiting on each's latency). */
static inline __attribute__((always_inline)) void chunk_scores(__m512 *s, const int32_t *qd, const int32_t *kt,
                                                               int pairs, const int NT) {
    __m512 even[PF_CHUNK / 16], odd[PF_CHUNK / 16];
    for (int j = 0; j < NT; j++) even[j] = odd[j] = _mm512_setzero_ps();
    for (int c = 0; c < pairs; c += 2) {
        const __m512bh q0 = (__m512bh)_mm512_set1_epi32(qd[c]), q1 = (__m512bh)_mm512_set1_epi32(qd[c + 1]);
        for (int j = 0; j < NT; j++) {
            const int32_t *k = kt + (int64_t)j * pairs * 16 + c * 16;
            even[j] = _mm512_dpbf16_ps(even[j], (__m512bh)_mm512_load_si512(k), q0);
            odd[j] = _mm512_dpbf16_ps(odd[j], (__m512bh)_mm512_load_si512(k + 16), q1);
        }
    }
    for (int j = 0; j < NT; j++) s[j] = _mm512_add_ps(even[j], odd[j]);
}

/* Lanes [0, n) of a 16-lane tile (n clamped to 0..16). */
static inline __mmask16 first_lanes(int n) { return n >= 16 ? 0xffff : (n <= 0 ? 0 : (__mmask16)((1u << n) - 1)); }

/* One row (a query head at one position) against one chunk of `nt` 16-token tiles: it sees keys
 * [skip, valid) of the chunk (skip > 0: the start of its window falls inside the chunk). NV: output
 * vectors per row (head_dim / 16), a constant where inlined. */
static inline __attribute__((always_inline)) void row_chunk(
    float *acc, float *run_max, float *run_sum, const int32_t *qd, const int32_t *kt, const int32_t *vt,
    int nt, int skip, int valid, int pairs, int head_dim, float scale, const int NV) {
    if (nt > (valid + 15) / 16) nt = (valid + 15) / 16; /* only the tiles this row sees: the same work whoever calls */
    __m512 s[PF_CHUNK / 16] = {0};
    switch (nt) { /* constant tile counts: the interleaved chains stay in registers */
    case 4: chunk_scores(s, qd, kt, pairs, 4); break;
    case 3: chunk_scores(s, qd, kt, pairs, 3); break;
    case 2: chunk_scores(s, qd, kt, pairs, 2); break;
    default: chunk_scores(s, qd, kt, pairs, 1); break;
    }
    for (int j = 0; j < nt; j++) {
        /* keys of this tile the row sees: below valid, and not before its window */
        const __mmask16 m = first_lanes(valid - 16 * j) & (__mmask16)~first_lanes(skip - 16 * j);
        s[j] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), m, s[j], _mm512_set1_ps(scale));
    }
    __m512 mx = s[0];
    for (int j = 1; j < nt; j++) mx = _mm512_max_ps(mx, s[j]);
    const float chunk_max = _mm512_reduce_max_ps(mx);
    const float new_max = chunk_max > *run_max ? chunk_max : *run_max;
    const float correction = exp1(*run_max - new_max);
    const __m512 nm = _mm512_set1_ps(new_max);
    __m512 total = _mm512_setzero_ps();
    int32_t p_hi[PF_CHUNK / 2] __attribute__((aligned(64))), p_lo[PF_CHUNK / 2] __attribute__((aligned(64)));
    for (int j = 0; j < nt; j++) {
        const __m512 p = exp16(_mm512_sub_ps(s[j], nm));
        total = _mm512_add_ps(total, p);
        const __m256bh hi = _mm512_cvtneps_pbh(p);
        _mm256_store_si256((__m256i *)(p_hi + 8 * j), (__m256i)hi);
        _mm256_store_si256((__m256i *)(p_lo + 8 * j), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(p, _mm512_cvtpbh_ps(hi))));
    }
    *run_sum = *run_sum * correction + _mm512_reduce_add_ps(total);
    *run_max = new_max;
    /* p.V in separate chains for the hi and lo parts of p and for even and odd token pairs (4 x NV
     * accumulators in flight), summed once a chunk */
    __m512 a[4][PF_MAX_HEAD_DIM / 16];
    const __m512 cv = _mm512_set1_ps(correction);
    for (int h = 0; h < NV; h++) {
        a[0][h] = _mm512_mul_ps(_mm512_load_ps(acc + 16 * h), cv);
        a[1][h] = a[2][h] = a[3][h] = _mm512_setzero_ps();
    }
    /* token pairs with a visible key, rounded up to an even count (a pair past them has p = 0 and zeroed or
     * finite packed values, so it adds nothing) */
    const int npairs = (((valid < 16 * nt ? valid : 16 * nt) + 3) >> 2) << 1;
    for (int q = 0; q < npairs; q += 2) {
        const int32_t *v0 = vt + (int64_t)(q >> 3) * 8 * head_dim + (int64_t)(q & 7) * head_dim;
        const int32_t *v1 = v0 + head_dim; /* q even: q + 1 is in the same tile */
        const __m512bh h0 = (__m512bh)_mm512_set1_epi32(p_hi[q]), l0 = (__m512bh)_mm512_set1_epi32(p_lo[q]);
        const __m512bh h1 = (__m512bh)_mm512_set1_epi32(p_hi[q + 1]), l1 = (__m512bh)_mm512_set1_epi32(p_lo[q + 1]);
        for (int h = 0; h < NV; h++) {
            const __m512bh x0 = (__m512bh)_mm512_load_si512(v0 + 16 * h), x1 = (__m512bh)_mm512_load_si512(v1 + 16 * h);
            a[0][h] = _mm512_dpbf16_ps(a[0][h], x0, h0);
            a[1][h] = _mm512_dpbf16_ps(a[1][h], x0, l0);
            a[2][h] = _mm512_dpbf16_ps(a[2][h], x1, h1);
            a[3][h] = _mm512_dpbf16_ps(a[3][h], x1, l1);
        }
    }
    for (int h = 0; h < NV; h++)
        _mm512_store_ps(acc + 16 * h, _mm512_add_ps(_mm512_add_ps(a[0][h], a[2][h]), _mm512_add_ps(a[1][h], a[3][h])));
}

/* Pack one KV head's keys and values of tile `tile` (16 positions from 16 * tile; zeros before first_key and
 * from seq_len on: a block wholly before every row's window may be freed, and its slots are never read). */
static inline void pack_tile(const uint16_t *k_head, const uint16_t *v_head, const int32_t *blocks, int tile,
                             int first_key, int seq_len, int head_dim, int block_size, int64_t block_stride,
                             int64_t token_stride, int32_t *kt, int32_t *vt) {
    const int pairs = head_dim / 2;
    const uint16_t *krow[16], *vrow[16];
    int b = 16 * tile / block_size, off = 16 * tile % block_size; /* one division a tile, not two a token */
    for (int t = 0; t < 16; t++) {
        if (16 * tile + t < seq_len && 16 * tile + t >= first_key) {
            const int64_t at = (int64_t)blocks[b] * block_stride + (int64_t)off * token_stride;
            krow[t] = k_head + at;
            vrow[t] = v_head + at;
        } else {
            krow[t] = vrow[t] = NULL;
        }
        if (++off == block_size) {
            off = 0;
            b++;
        }
    }
    for (int c0 = 0; c0 < pairs; c0 += 16) { /* keys: 16 pairs x 16 tokens, transposed in registers */
        __m512i r[16];
        for (int t = 0; t < 16; t++)
            r[t] = krow[t] ? _mm512_loadu_si512(krow[t] + 2 * c0) : _mm512_setzero_si512();
        transpose16x16(r); /* r[c] lane t: pair c0 + c of token t */
        for (int c = 0; c < 16; c++) _mm512_store_si512(kt + (int64_t)(c0 + c) * 16, r[c]);
    }
    for (int p = 0; p < 8; p++) /* values: tokens 2p, 2p + 1 interleaved per dim, in vpunpck{l,h}wd's order */
        for (int d = 0; d < head_dim; d += 32) {
            const __m512i a = vrow[2 * p] ? _mm512_loadu_si512(vrow[2 * p] + d) : _mm512_setzero_si512();
            const __m512i b = vrow[2 * p + 1] ? _mm512_loadu_si512(vrow[2 * p + 1] + d) : _mm512_setzero_si512();
            _mm512_store_si512(vt + (int64_t)p * head_dim + d, _mm512_unpacklo_epi16(a, b));
            _mm512_store_si512(vt + (int64_t)p * head_dim + d + 16, _mm512_unpackhi_epi16(a, b));
        }
}

int prefill_attention_bf16(const uint16_t *query, int64_t query_stride, const uint16_t *key_cache,
                           const uint16_t *value_cache, const int32_t *blocks, int q_len, int seq_len, uint16_t *out,
                           int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int window,
                           int64_t block_stride, int64_t token_stride, int64_t head_stride, int num_threads) {
    const int group = num_heads / num_kv_heads;
    if (head_dim % 32 || head_dim > PF_MAX_HEAD_DIM || group > PF_MAX_ROWS || q_len > seq_len || q_len < 1 ||
        window < 0)
        return -1;
    const int context = seq_len - q_len;
    /* the first chunk any row sees; tiles are packed from there (tile0) on */
    const int first_key = window && context - window + 1 > 0 ? context - window + 1 : 0;
    const int tile0 = first_key / PF_CHUNK * (PF_CHUNK / 16);
    const int pairs = head_dim / 2, ntiles = (seq_len + 15) / 16 - tile0;
    const int64_t ktile = (int64_t)pairs * 16, vtile = 8 * (int64_t)head_dim; /* dwords per packed tile */
    int32_t *kp = aligned_alloc(64, (size_t)num_kv_heads * ntiles * ktile * 4);
    int32_t *vp = aligned_alloc(64, (size_t)num_kv_heads * ntiles * vtile * 4);
    if (kp == NULL || vp == NULL) {
        free(kp);
        free(vp);
        return -2;
    }
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads)
    for (int kvh = 0; kvh < num_kv_heads; kvh++)
        for (int tile = 0; tile < ntiles; tile++)
            pack_tile(key_cache + (int64_t)kvh * head_stride, value_cache + (int64_t)kvh * head_stride, blocks,
                      tile0 + tile, first_key, seq_len, head_dim, block_size, block_stride, token_stride,
                      kp + ((int64_t)kvh * ntiles + tile) * ktile, vp + ((int64_t)kvh * ntiles + tile) * vtile);
    const int per_task = PF_MAX_ROWS / group; /* query tokens per task */
    const int ntasks = (q_len + per_task - 1) / per_task, nv = head_dim / 16;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
    for (int kvh = 0; kvh < num_kv_heads; kvh++)
        for (int task = 0; task < ntasks; task++) {
            const int first = task * per_task, count = q_len - first < per_task ? q_len - first : per_task;
            const int rows = count * group;
            float acc[PF_MAX_ROWS][PF_MAX_HEAD_DIM] __attribute__((aligned(64)));
            int32_t qd[PF_MAX_ROWS][PF_MAX_HEAD_DIM / 2];
            float run_max[PF_MAX_ROWS], run_sum[PF_MAX_ROWS];
            for (int r = 0; r < rows; r++) {
                const int i = first + r / group, head = kvh * group + r % group;
                memcpy(qd[r], query + (int64_t)i * query_stride + (int64_t)head * head_dim, 2 * (size_t)head_dim);
                memset(acc[r], 0, sizeof(float) * head_dim);
                run_max[r] = -INFINITY;
                run_sum[r] = 0.0f;
            }
            const int last_pos = context + first + count - 1;
            const int task_key = window && context + first - window + 1 > 0 ? context + first - window + 1 : 0;
            const int32_t *kh = kp + (int64_t)kvh * ntiles * ktile, *vh = vp + (int64_t)kvh * ntiles * vtile;
            for (int start = task_key / PF_CHUNK * PF_CHUNK; start <= last_pos; start += PF_CHUNK) {
                const int end = start + PF_CHUNK <= last_pos + 1 ? start + PF_CHUNK : last_pos + 1;
                const int nt = (end - start + 15) / 16, tile = start / 16 - tile0;
                const int32_t *kt = kh + (int64_t)tile * ktile, *vt = vh + (int64_t)tile * vtile;
                for (int r = 0; r < rows; r++) {
                    const int pos = context + first + r / group;
                    const int valid = pos + 1 - start; /* keys before this one the row may see */
                    const int skip = window ? pos - window + 1 - start : 0; /* keys before its window */
                    if (valid <= 0 || skip >= PF_CHUNK) continue;
#define CHUNK(NV)                                                                                        \
    row_chunk(acc[r], &run_max[r], &run_sum[r], qd[r], kt, vt, nt, skip, valid, pairs, head_dim, scale, NV)
                    switch (nv) {
                    case 2: CHUNK(2); break;
                    case 4: CHUNK(4); break;
                    case 6: CHUNK(6); break;
                    case 8: CHUNK(8); break;
                    default: CHUNK(nv); break;
                    }
#undef CHUNK
                }
            }
            for (int r = 0; r < rows; r++) {
                const int i = first + r / group, head = kvh * group + r % group;
                store_row(out + ((int64_t)i * num_heads + head) * head_dim, acc[r], run_sum[r], head_dim);
            }
        }
    free(kp);
    free(vp);
    return 0;
}
#else
int prefill_attention_bf16(const uint16_t *query, int64_t query_stride, const uint16_t *key_cache,
                           const uint16_t *value_cache, const int32_t *blocks, int q_len, int seq_len, uint16_t *out,
                           int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int window,
                           int64_t block_stride, int64_t token_stride, int64_t head_stride, int num_threads) {
    return -3; /* not built: clib.fast_prefill routes nothing here without AVX512-BF16 */
}
#endif
