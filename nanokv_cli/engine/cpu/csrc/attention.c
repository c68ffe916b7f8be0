/* Paged decode attention: one query token per row, read through the block table. */
#include "common.h"

/* scores[t] = scale * (q . k_t), k_t = k + t * stride (cache elements), t < m */
static inline __attribute__((always_inline)) void key_scores(const float *q, const void *k,
        int64_t stride, int64_t m, int64_t dim, float scale, float *scores, int half) {
    int64_t t = 0;
#ifdef __AVX2__
    if (dim % 8 == 0) {
        const __m256 vscale = _mm256_set1_ps(scale);
        for (; t + 8 <= m; t += 8) {
            const int64_t k0 = t * stride;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            __m256 a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (int64_t d = 0; d < dim; d += 8) {
                const __m256 qv = _mm256_loadu_ps(q + d);
                a0 = _mm256_fmadd_ps(qv, cache_load8(k, k0 + d, half), a0);
                a1 = _mm256_fmadd_ps(qv, cache_load8(k, k0 + stride + d, half), a1);
                a2 = _mm256_fmadd_ps(qv, cache_load8(k, k0 + 2 * stride + d, half), a2);
                a3 = _mm256_fmadd_ps(qv, cache_load8(k, k0 + 3 * stride + d, half), a3);
                a4 = _mm256_fmadd_ps(qv, cache_load8(k, k0 + 4 * stride + d, half), a4);
                a5 = _mm256_fmadd_ps(qv, cache_load8(k, k0 + 5 * stride + d, half), a5);
                a6 = _mm256_fmadd_ps(qv, cache_load8(k, k0 + 6 * stride + d, half), a6);
                a7 = _mm256_fmadd_ps(qv, cache_load8(k, k0 + 7 * stride + d, half), a7);
            }
            /* Horizontal sums of the eight accumulators, as one vector of eight scores. */
            const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
            const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20),
                                              _mm256_permute2f128_ps(h0, h1, 0x31));
            _mm256_storeu_ps(scores + t, _mm256_mul_ps(sums, vscale));
        }
    }
#endif
    for (; t < m; t++) {
        float s = 0.0f;
        for (int64_t d = 0; d < dim; d++) s += q[d] * cache_load1(k, t * stride + d, half);
        scores[t] = s * scale;
    }
}

/* acc[d] += sum_t p[t] * v_t[d], v_t = v + t * stride (cache elements), t < m */
static inline __attribute__((always_inline)) void weighted_values(const float *p, const void *v,
        int64_t stride, int64_t m, int64_t dim, float *acc, int half) {
    int64_t d0 = 0;
#ifdef __AVX2__
    for (; d0 + 64 <= dim; d0 += 64) {
        float *a = acc + d0;
        __m256 a0 = _mm256_loadu_ps(a), a1 = _mm256_loadu_ps(a + 8);
        __m256 a2 = _mm256_loadu_ps(a + 16), a3 = _mm256_loadu_ps(a + 24);
        __m256 a4 = _mm256_loadu_ps(a + 32), a5 = _mm256_loadu_ps(a + 40);
        __m256 a6 = _mm256_loadu_ps(a + 48), a7 = _mm256_loadu_ps(a + 56);
        for (int64_t t = 0; t < m; t++) {
            const int64_t vt = t * stride + d0;
            const __m256 pt = _mm256_set1_ps(p[t]);
            a0 = _mm256_fmadd_ps(pt, cache_load8(v, vt, half), a0);
            a1 = _mm256_fmadd_ps(pt, cache_load8(v, vt + 8, half), a1);
            a2 = _mm256_fmadd_ps(pt, cache_load8(v, vt + 16, half), a2);
            a3 = _mm256_fmadd_ps(pt, cache_load8(v, vt + 24, half), a3);
            a4 = _mm256_fmadd_ps(pt, cache_load8(v, vt + 32, half), a4);
            a5 = _mm256_fmadd_ps(pt, cache_load8(v, vt + 40, half), a5);
            a6 = _mm256_fmadd_ps(pt, cache_load8(v, vt + 48, half), a6);
            a7 = _mm256_fmadd_ps(pt, cache_load8(v, vt + 56, half), a7);
        }
        _mm256_storeu_ps(a, a0); _mm256_storeu_ps(a + 8, a1);
        _mm256_storeu_ps(a + 16, a2); _mm256_storeu_ps(a + 24, a3);
        _mm256_storeu_ps(a + 32, a4); _mm256_storeu_ps(a + 40, a5);
        _mm256_storeu_ps(a + 48, a6); _mm256_storeu_ps(a + 56, a7);
    }
#endif
    for (int64_t t = 0; t < m; t++) {
        const float pt = p[t];
        for (int64_t d = d0; d < dim; d++) acc[d] += pt * cache_load1(v, t * stride + d, half);
    }
}

/* Rows of a sequence's cache read together: all of them in one block. Fewer than a block so
   that the next chunk can be fetched (prefetch_rows) while this one is read; measured at 64
   sequences: 16 rows of float16 or 32 of float32 (SmolLM2, 384 or 768 bytes a row). */
static inline int64_t chunk_rows(int64_t t, int64_t len, int64_t block_size, int half) {
    const int64_t chunk = half ? 16 : 32, in_block = block_size - t % block_size;
    const int64_t m = len - t < chunk ? len - t : chunk;
    return m < in_block ? m : in_block;
}

static inline void prefetch_rows(const void *cache, int64_t first, int64_t m, int64_t row_bytes) {
#ifdef __AVX2__
    const char *p = (const char *)cache + first * row_bytes;
    for (int64_t b = 0; b < m * row_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
#else
    (void)cache, (void)first, (void)m, (void)row_bytes;
#endif
}

/* The chunk of a sequence's cache rows that starts at position t (of len, through table):
   its length in *m, its first cache row returned, and the chunk after it prefetched. */
static inline int64_t chunk_at(const void *cache, const int64_t *table, int64_t t, int64_t len,
                               int64_t block_size, int half, int64_t row_bytes, int64_t *m) {
    *m = chunk_rows(t, len, block_size, half);
    const int64_t next = t + *m;
    if (next < len)
        prefetch_rows(cache, table[next / block_size] * block_size + next % block_size,
                      chunk_rows(next, len, block_size, half), row_bytes);
    return table[t / block_size] * block_size + t % block_size;
}

/* One query token per row: q [n, heads, dim] (token stride q_stride), caches
   [num_blocks, block_size, kv_heads, dim], block_tables [n, width], out [n, heads, dim]
   (token stride out_stride). Row i attends to the first context_lens[i] positions of its
   block table: a decode, or one position of a prefill chunk whose K/V are already stored.
   half: the caches hold float16 (F16C builds only). */
int paged_decode_f32(const float *q, int64_t q_stride, const void *k_cache,
                     const void *v_cache, const int64_t *block_tables,
                     const int64_t *context_lens, int64_t n, int64_t width, int64_t heads,
                     int64_t kv_heads, int64_t dim, int64_t block_size, float scale,
                     float *out, int64_t out_stride, int half, int threads) {
    /* A work item is a sequence's KV heads: all of them where there are sequences enough to
       keep the threads busy, so each cache row (every KV head's slice, side by side) comes from
       memory once, a chunk of rows ahead of its use; one each for a few sequences. The query
       heads sharing a KV head (GQA) read each chunk in turn while it is in L1. */
    const int64_t group = heads / kv_heads, slot = kv_heads * dim, row_bytes = slot * (half ? 2 : 4);
    const int64_t span = n >= 4 * threads ? kv_heads : 1, parts = kv_heads / span, hq = span * group;
    if (half && !cache_half_supported()) return 1;
    int64_t max_len = 0;
    for (int64_t i = 0; i < n; i++) max_len = context_lens[i] > max_len ? context_lens[i] : max_len;
    const int64_t row = max_len + 8;
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (threads > 1 && n * parts > 1)
    {
        float *scores = malloc(sizeof(float) * (size_t)(hq * row));
        if (scores == NULL) {
            failed = 1;
        } else {
            #pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < n * parts; item++) {
                const int64_t i = item / parts, h0 = item % parts * span, len = context_lens[i];
                const int64_t *table = block_tables + i * width;
                const float *qi = q + i * q_stride + h0 * group * dim;
                float *oi = out + i * out_stride + h0 * group * dim;
                for (int64_t t0 = 0, m; t0 < len; t0 += m) {
                    const int64_t at = chunk_at(k_cache, table, t0, len, block_size, half, row_bytes, &m) * slot + h0 * dim;
                    for (int64_t g = 0; g < hq; g++) {
                        const int64_t a = at + g / group * dim;
                        if (half)
                            key_scores(qi + g * dim, (const uint16_t *)k_cache + a, slot, m, dim, scale, scores + g * row + t0, 1);
                        else
                            key_scores(qi + g * dim, (const float *)k_cache + a, slot, m, dim, scale, scores + g * row + t0, 0);
                    }
                }
                float totals[hq];
                for (int64_t g = 0; g < hq; g++) {
                    float *sg = scores + g * row, top = -INFINITY, total = 0.0f;
                    for (int64_t t = 0; t < len; t++) top = sg[t] > top ? sg[t] : top;
                    #pragma omp simd reduction(+:total)
                    for (int64_t t = 0; t < len; t++) {
                        sg[t] = exp_clamped(sg[t] - top);
                        total += sg[t];
                    }
                    totals[g] = total;
                }
                memset(oi, 0, sizeof(float) * (size_t)(hq * dim));
                for (int64_t t0 = 0, m; t0 < len; t0 += m) {
                    const int64_t at = chunk_at(v_cache, table, t0, len, block_size, half, row_bytes, &m) * slot + h0 * dim;
                    for (int64_t g = 0; g < hq; g++) {
                        const int64_t a = at + g / group * dim;
                        if (half)
                            weighted_values(scores + g * row + t0, (const uint16_t *)v_cache + a, slot, m, dim, oi + g * dim, 1);
                        else
                            weighted_values(scores + g * row + t0, (const float *)v_cache + a, slot, m, dim, oi + g * dim, 0);
                    }
                }
                for (int64_t g = 0; g < hq; g++) {
                    const float inv = 1.0f / totals[g];
                    for (int64_t d = 0; d < dim; d++) oi[g * dim + d] *= inv;
                }
            }
            free(scores);
        }
    }
    return failed;
}

