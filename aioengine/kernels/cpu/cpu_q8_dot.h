/* q8dot2 per ISA level, included by cpu_q8.c (after q8_row): the dots of up to Q8_MAXR cut rows against two
 * outputs' codes, over one row of the weight. Each level leaves the same integer lane sums (exact), scaled and
 * summed in float32 in its own order:
 * - AVX512-VNNI: 16 lanes a chunk, one vpdpbusd (u8 x s8) per cut byte;
 * - AVX2: 8 lanes, vpdpbusd where the core has AVX-VNNI, else vpmaddubsw + vpmaddwd. maddubs sums two u8 x s8
 *   products into int16 with saturation: exact while u < 16 (4-bit codes), so 8-bit codes go in as two nibbles;
 * - NEON: 4 lanes, sdot where the core has dotprod, else widening multiplies; the codes as signed bytes
 *   (u - 128, or the 4-bit code itself), so no correction term;
 * - else scalar: correct, but slower than the torch path (qgemv_q8_vectorized() says 0). */
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
int qgemv_q8_vectorized(void) { return 1; }
#define Q8_MAXR 4
#ifndef Q8_PF
#define Q8_PF 8
#endif
/* one chunk of one row against one output's codes: its 16 lane sums, as float32 in units of xq */
static inline __attribute__((always_inline)) __m512 q8_lanes(__m512i u, __m512i b2, __m512i b1, __m512i b0,
                                                             __m512i corr_hi, __m512i corr_lo, const int limbs) {
    if (limbs == 1) return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(corr_lo, u, b0));
    const __m512i lo = _mm512_add_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, b1), 8),
                                        _mm512_dpbusd_epi32(corr_lo, u, b0));
    if (limbs == 2) return _mm512_cvtepi32_ps(lo);
    const __m512i hi = _mm512_dpbusd_epi32(corr_hi, u, b2);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(65536.0f), _mm512_cvtepi32_ps(lo));
}

/* a chunk's 2 or 4 block scales, repeated across the 16 lanes as the lanes take turns among the blocks */
static inline __attribute__((always_inline)) __m512 q8_scales(const float *s, const int per) {
    if (per == 2) return _mm512_castpd_ps(_mm512_set1_pd(*(const double *)s));
    return _mm512_broadcast_f32x4(_mm_loadu_ps(s));
}

/* a chunk's 64 four-bit codes (32 bytes from q4_pack) as the 8-bit layout's 64 bytes */
static inline __attribute__((always_inline)) __m512i q4_unpack(const uint8_t *p) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p), nib = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* nib: a and b are q4_pack'ed (k / 2 bytes a row, codes unsigned: no correction), with offsets ma and mb */
static inline __attribute__((always_inline)) void q8dot2(const q8_row *rows, const uint8_t *a, const uint8_t *b,
                                                          const float *sa, const float *sb, const float *ma,
                                                          const float *mb, const int M, int64_t k, const int limbs,
                                                          const int per, const int nib, float *out) {
    __m512 acc_a[Q8_MAXR], acc_b[Q8_MAXR];
    for (int r = 0; r < M; r++) acc_a[r] = acc_b[r] = _mm512_setzero_ps();
    const int64_t row_bytes = nib ? k / 2 : k;
    for (int64_t c = 0; c < k; c += 64) {
        /* the pair Q8_PF pairs ahead (rows a + 2 Q8_PF k on): the hardware prefetcher alone leaves DRAM idle */
        const uint8_t *ahead = a + 2 * Q8_PF * row_bytes + (nib ? c : 2 * c);
        _mm_prefetch((const char *)ahead, _MM_HINT_T1);
        if (!nib) _mm_prefetch((const char *)(ahead + 64), _MM_HINT_T1);
        const __m512i ua = nib ? q4_unpack(a + c / 2) : _mm512_loadu_si512(a + c);
        const __m512i ub = nib ? q4_unpack(b + c / 2) : _mm512_loadu_si512(b + c);
        const __m512 da = q8_scales(sa + c / 64 * per, per), db = q8_scales(sb + c / 64 * per, per);
        const __m512 oa = nib ? q8_scales(ma + c / 64 * per, per) : _mm512_setzero_ps();
        const __m512 ob = nib ? q8_scales(mb + c / 64 * per, per) : _mm512_setzero_ps();
        for (int r = 0; r < M; r++) {
            const q8_row *w = rows + r;
            if (nib) {
                const __m512 xs = _mm512_loadu_ps(w->xsum + c / 4);
                acc_a[r] = _mm512_fmadd_ps(oa, xs, acc_a[r]), acc_b[r] = _mm512_fmadd_ps(ob, xs, acc_b[r]);
            }
            const __m512i b2 = limbs == 3 ? _mm512_loadu_si512(w->b2 + c) : _mm512_setzero_si512();
            const __m512i ch = limbs == 3 && !nib ? _mm512_loadu_si512(w->corr_hi + c / 4) : _mm512_setzero_si512();
            const __m512i b1 = limbs > 1 ? _mm512_loadu_si512(w->b1 + c) : _mm512_setzero_si512();
            const __m512i b0 = _mm512_loadu_si512(w->b0 + c);
            const __m512i cl = nib ? _mm512_setzero_si512() : _mm512_loadu_si512(w->corr_lo + c / 4);
            const __m512 sx = _mm512_loadu_ps(w->sx + c / 4);
            acc_a[r] = _mm512_fmadd_ps(q8_lanes(ua, b2, b1, b0, ch, cl, limbs), _mm512_mul_ps(da, sx), acc_a[r]);
            acc_b[r] = _mm512_fmadd_ps(q8_lanes(ub, b2, b1, b0, ch, cl, limbs), _mm512_mul_ps(db, sx), acc_b[r]);
        }
    }
    for (int r = 0; r < M; r++) {
        out[2 * r] = _mm512_reduce_add_ps(acc_a[r]);
        out[2 * r + 1] = _mm512_reduce_add_ps(acc_b[r]);
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
int qgemv_q8_vectorized(void) { return 1; }
#define Q8_MAXR 4
#ifndef Q8_PF
#define Q8_PF 8
#endif
#define Q8_INLINE static inline __attribute__((always_inline))
/* each 4-byte lane's sum of u x b (u unsigned, b signed) as int32; small: every u < 16, or every |b| < 64 */
Q8_INLINE __m256i q8_dot(__m256i u, __m256i b, const int small) {
#ifdef __AVXVNNI__
    (void)small;
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, b);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if (small) return _mm256_madd_epi16(_mm256_maddubs_epi16(u, b), ones);
    const __m256i nib = _mm256_set1_epi8(15);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(u, 4), nib), lo = _mm256_and_si256(u, nib);
    return _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(hi, b), ones), 4),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(lo, b), ones));
#endif
}

/* one half-chunk (32 inputs, 8 lanes) of one row against one output's codes, as float32 in units of xq */
Q8_INLINE __m256 q8_lanes(__m256i u, __m256i b2, __m256i b1, __m256i b0, __m256i corr_hi, __m256i corr_lo,
                          const int limbs, const int small) {
    if (limbs == 1) /* the screen's bytes are within +-63: maddubs cannot saturate, whatever u */
        return _mm256_cvtepi32_ps(_mm256_add_epi32(corr_lo, q8_dot(u, b0, 1)));
    const __m256i lo = _mm256_add_epi32(_mm256_slli_epi32(q8_dot(u, b1, small), 8),
                                        _mm256_add_epi32(corr_lo, q8_dot(u, b0, small)));
    if (limbs == 2) return _mm256_cvtepi32_ps(lo);
    const __m256i hi = _mm256_add_epi32(corr_hi, q8_dot(u, b2, small));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_set1_ps(65536.0f), _mm256_cvtepi32_ps(lo));
}

/* a chunk's 2 or 4 block scales across 8 lanes (both halves of a chunk see the same pattern: per divides 8) */
Q8_INLINE __m256 q8_scales(const float *s, const int per) {
    if (per == 2) return _mm256_castpd_ps(_mm256_set1_pd(*(const double *)s));
    return _mm256_broadcast_ps((const __m128 *)s);
}

Q8_INLINE float q8_sum(__m256 v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

Q8_INLINE void q8dot2(const q8_row *rows, const uint8_t *a, const uint8_t *b, const float *sa, const float *sb,
                      const float *ma, const float *mb, const int M, int64_t k, const int limbs, const int per,
                      const int nib, float *out) {
    __m256 acc_a[Q8_MAXR], acc_b[Q8_MAXR];
    for (int r = 0; r < M; r++) acc_a[r] = acc_b[r] = _mm256_setzero_ps();
    const int64_t row_bytes = nib ? k / 2 : k;
    const __m256i mask = _mm256_set1_epi8(15);
    for (int64_t c = 0; c < k; c += 64) {
        const uint8_t *ahead = a + 2 * Q8_PF * row_bytes + (nib ? c : 2 * c);
        _mm_prefetch((const char *)ahead, _MM_HINT_T1);
        if (!nib) _mm_prefetch((const char *)(ahead + 64), _MM_HINT_T1);
        /* 4-bit codes: 32 bytes a chunk, the low nibbles its first half and the high ones its second */
        const __m256i va = _mm256_loadu_si256((const __m256i *)(nib ? a + c / 2 : a + c));
        const __m256i vb = _mm256_loadu_si256((const __m256i *)(nib ? b + c / 2 : b + c));
        const __m256 da = q8_scales(sa + c / 64 * per, per), db = q8_scales(sb + c / 64 * per, per);
        const __m256 oa = nib ? q8_scales(ma + c / 64 * per, per) : _mm256_setzero_ps();
        const __m256 ob = nib ? q8_scales(mb + c / 64 * per, per) : _mm256_setzero_ps();
        for (int h = 0; h < 2; h++) {
            const int64_t at = c + 32 * h, lane = c / 4 + 8 * h;
            __m256i ua, ub;
            if (nib) {
                ua = h ? _mm256_and_si256(_mm256_srli_epi16(va, 4), mask) : _mm256_and_si256(va, mask);
                ub = h ? _mm256_and_si256(_mm256_srli_epi16(vb, 4), mask) : _mm256_and_si256(vb, mask);
            } else {
                ua = h ? _mm256_loadu_si256((const __m256i *)(a + at)) : va;
                ub = h ? _mm256_loadu_si256((const __m256i *)(b + at)) : vb;
            }
            for (int r = 0; r < M; r++) {
                const q8_row *w = rows + r;
                const __m256 sx = _mm256_loadu_ps(w->sx + lane);
                if (nib) {
                    const __m256 xs = _mm256_loadu_ps(w->xsum + lane);
                    acc_a[r] = _mm256_fmadd_ps(oa, xs, acc_a[r]), acc_b[r] = _mm256_fmadd_ps(ob, xs, acc_b[r]);
                }
                const __m256i zero = _mm256_setzero_si256();
                const __m256i b2 = limbs == 3 ? _mm256_loadu_si256((const __m256i *)(w->b2 + at)) : zero;
                const __m256i ch =
                    limbs == 3 && !nib ? _mm256_loadu_si256((const __m256i *)(w->corr_hi + lane)) : zero;
                const __m256i b1 = limbs > 1 ? _mm256_loadu_si256((const __m256i *)(w->b1 + at)) : zero;
                const __m256i b0 = _mm256_loadu_si256((const __m256i *)(w->b0 + at));
                const __m256i cl = nib ? zero : _mm256_loadu_si256((const __m256i *)(w->corr_lo + lane));
                acc_a[r] = _mm256_fmadd_ps(q8_lanes(ua, b2, b1, b0, ch, cl, limbs, nib), _mm256_mul_ps(da, sx),
                                           acc_a[r]);
                acc_b[r] = _mm256_fmadd_ps(q8_lanes(ub, b2, b1, b0, ch, cl, limbs, nib), _mm256_mul_ps(db, sx),
                                           acc_b[r]);
            }
        }
    }
    for (int r = 0; r < M; r++) out[2 * r] = q8_sum(acc_a[r]), out[2 * r + 1] = q8_sum(acc_b[r]);
}
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
int qgemv_q8_vectorized(void) { return 1; }
#define Q8_MAXR 4
#define Q8_INLINE static inline __attribute__((always_inline))
/* each 4-byte lane's sum of q x b, both signed, as int32 (exact: |q x b| <= 2^14) */
Q8_INLINE int32x4_t q8_dot(int8x16_t q, int8x16_t b) {
#ifdef __ARM_FEATURE_DOTPROD
    return vdotq_s32(vdupq_n_s32(0), q, b);
#else
    const int32x4_t lo = vpaddlq_s16(vmull_s8(vget_low_s8(q), vget_low_s8(b)));
    const int32x4_t hi = vpaddlq_s16(vmull_high_s8(q, b));
    return vpaddq_s32(lo, hi);
#endif
}

/* one quarter-chunk (16 inputs, 4 lanes) of one row against one output's codes, in units of xq */
Q8_INLINE float32x4_t q8_lanes(int8x16_t q, int8x16_t b2, int8x16_t b1, int8x16_t b0, const int limbs) {
    if (limbs == 1) return vcvtq_f32_s32(q8_dot(q, b0));
    const int32x4_t lo = vaddq_s32(vshlq_n_s32(q8_dot(q, b1), 8), q8_dot(q, b0));
    if (limbs == 2) return vcvtq_f32_s32(lo);
    return vfmaq_n_f32(vcvtq_f32_s32(lo), vcvtq_f32_s32(q8_dot(q, b2)), 65536.0f);
}

/* a chunk's 2 or 4 block scales across 4 lanes (each quarter of a chunk sees the same pattern) */
Q8_INLINE float32x4_t q8_scales(const float *s, const int per) {
    if (per == 2) return vcombine_f32(vld1_f32(s), vld1_f32(s));
    return vld1q_f32(s);
}

/* quarter h of a chunk's codes as signed bytes: 4-bit codes as they are, 8-bit ones less their 128 */
Q8_INLINE int8x16_t q8_codes(const uint8_t *row, int64_t c, int h, const int nib) {
    if (!nib) return vreinterpretq_s8_u8(veorq_u8(vld1q_u8(row + c + 16 * h), vdupq_n_u8(128)));
    const uint8x16_t v = vld1q_u8(row + c / 2 + 16 * (h & 1));
    return vreinterpretq_s8_u8(h < 2 ? vandq_u8(v, vdupq_n_u8(15)) : vshrq_n_u8(v, 4));
}

Q8_INLINE void q8dot2(const q8_row *rows, const uint8_t *a, const uint8_t *b, const float *sa, const float *sb,
                      const float *ma, const float *mb, const int M, int64_t k, const int limbs, const int per,
                      const int nib, float *out) {
    float32x4_t acc_a[Q8_MAXR], acc_b[Q8_MAXR];
    for (int r = 0; r < M; r++) acc_a[r] = acc_b[r] = vdupq_n_f32(0.0f);
    for (int64_t c = 0; c < k; c += 64) {
        const float32x4_t da = q8_scales(sa + c / 64 * per, per), db = q8_scales(sb + c / 64 * per, per);
        const float32x4_t oa = nib ? q8_scales(ma + c / 64 * per, per) : vdupq_n_f32(0.0f);
        const float32x4_t ob = nib ? q8_scales(mb + c / 64 * per, per) : vdupq_n_f32(0.0f);
        for (int h = 0; h < 4; h++) {
            const int64_t at = c + 16 * h, lane = c / 4 + 4 * h;
            const int8x16_t qa = q8_codes(a, c, h, nib), qb = q8_codes(b, c, h, nib);
            for (int r = 0; r < M; r++) {
                const q8_row *w = rows + r;
                const float32x4_t sx = vld1q_f32(w->sx + lane);
                if (nib) {
                    const float32x4_t xs = vld1q_f32(w->xsum + lane);
                    acc_a[r] = vfmaq_f32(acc_a[r], oa, xs), acc_b[r] = vfmaq_f32(acc_b[r], ob, xs);
                }
                const int8x16_t b2 = limbs == 3 ? vld1q_s8(w->b2 + at) : vdupq_n_s8(0);
                const int8x16_t b1 = limbs > 1 ? vld1q_s8(w->b1 + at) : vdupq_n_s8(0), b0 = vld1q_s8(w->b0 + at);
                acc_a[r] = vfmaq_f32(acc_a[r], q8_lanes(qa, b2, b1, b0, limbs), vmulq_f32(da, sx));
                acc_b[r] = vfmaq_f32(acc_b[r], q8_lanes(qb, b2, b1, b0, limbs), vmulq_f32(db, sx));
            }
        }
    }
    for (int r = 0; r < M; r++) out[2 * r] = vaddvq_f32(acc_a[r]), out[2 * r + 1] = vaddvq_f32(acc_b[r]);
}
#else
int qgemv_q8_vectorized(void) { return 0; } /* the scalar path below: correct, but slower than bf16's GEMM */
#define Q8_MAXR 4
/* the code at packed position p of the row (the 8-bit layout's order) */
static inline int64_t q8_code(const uint8_t *row, int64_t p, int nib) {
    if (!nib) return (int64_t)row[p] - 128;
    const int64_t c = p / 64 * 64, i = p % 64;
    return i < 32 ? row[c / 2 + i] & 15 : row[c / 2 + i - 32] >> 4;
}

static inline void q8dot2(const q8_row *rows, const uint8_t *a, const uint8_t *b, const float *sa, const float *sb,
                          const float *ma, const float *mb, const int M, int64_t k, const int limbs, const int per,
                          const int nib, float *out) {
    (void)limbs; /* the digits of 1 or 2 limbs leave b2 (and b1) 0 */
    for (int r = 0; r < M; r++) {
        float ta = 0.0f, tb = 0.0f;
        for (int64_t c = 0; c < k; c += 4) {
            const q8_row *w = rows + r;
            int64_t da = 0, db = 0;
            for (int i = 0; i < 4; i++) {
                const int64_t xq = 65536 * w->b2[c + i] + 256 * w->b1[c + i] + w->b0[c + i];
                da += q8_code(a, c + i, nib) * xq, db += q8_code(b, c + i, nib) * xq;
            }
            const int64_t s = (c / 4) % per + per * (c / 64); /* the lane's block */
            ta += (float)da * sa[s] * w->sx[c / 4];
            tb += (float)db * sb[s] * w->sx[c / 4];
            if (nib) ta += ma[s] * w->xsum[c / 4], tb += mb[s] * w->xsum[c / 4];
        }
        out[2 * r] = ta, out[2 * r + 1] = tb;
    }
}
#endif
