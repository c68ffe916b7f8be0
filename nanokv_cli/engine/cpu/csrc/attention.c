/* Paged decode attention: one query token per row, read through the block table. */
#include "kernels.h"

/* The query heads that share a KV head (GQA) go through its cache rows together, up to
   GROUP_TILE at a time (what AVX2's 16 registers hold): each row is loaded, and converted from
   float16, once for all of them. */
#define GROUP_TILE 3

/* scores[g * row + t] = scale * (q_g . k_t) for the G heads q_g = q + g * dim and the m keys
   k_t = k + t * stride (cache elements). G is a constant where it is inlined. */
static inline __attribute__((always_inline)) void group_scores(const float *q, int G, const void *k,
        int64_t stride, int64_t m, int64_t dim, float scale, float *scores, int64_t row, int half) {
    int64_t t = 0;
#ifdef __AVX512F__
    if (dim % 16 == 0) {
        for (; t + 4 <= m; t += 4) {
            __m512 acc[GROUP_TILE][4];
            for (int g = 0; g < G; g++)
                for (int u = 0; u < 4; u++) acc[g][u] = _mm512_setzero_ps();
            for (int64_t d = 0; d < dim; d += 16) {
                __m512 keys[4];
                for (int u = 0; u < 4; u++) keys[u] = cache_load16(k, (t + u) * stride + d, half);
                for (int g = 0; g < G; g++) {
                    const __m512 qv = _mm512_loadu_ps(q + g * dim + d);
                    for (int u = 0; u < 4; u++) acc[g][u] = _mm512_fmadd_ps(qv, keys[u], acc[g][u]);
                }
            }
            for (int g = 0; g < G; g++) {
                /* four 16-lane sums to four scores: pairs interleaved, then the 128-bit lanes */
                const __m512 a01 = _mm512_add_ps(_mm512_unpacklo_ps(acc[g][0], acc[g][1]),
                                                 _mm512_unpackhi_ps(acc[g][0], acc[g][1]));
                const __m512 a23 = _mm512_add_ps(_mm512_unpacklo_ps(acc[g][2], acc[g][3]),
                                                 _mm512_unpackhi_ps(acc[g][2], acc[g][3]));
                const __m512d p01 = _mm512_castps_pd(a01), p23 = _mm512_castps_pd(a23);
                const __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p01, p23)),
                                               _mm512_castpd_ps(_mm512_unpackhi_pd(p01, p23)));
                const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
                const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
                _mm_storeu_ps(scores + g * row + t, _mm_mul_ps(s4, _mm_set1_ps(scale)));
            }
        }
    }
#endif
#ifdef __AVX2__
    if (dim % 8 == 0) {
        const __m256 vscale = _mm256_set1_ps(scale);
        for (; t + 4 <= m; t += 4) {
            __m256 acc[GROUP_TILE][4];
            for (int g = 0; g < G; g++)
                for (int u = 0; u < 4; u++) acc[g][u] = _mm256_setzero_ps();
            for (int64_t d = 0; d < dim; d += 8) {
                __m256 keys[4];
                for (int u = 0; u < 4; u++) keys[u] = cache_load8(k, (t + u) * stride + d, half);
                for (int g = 0; g < G; g++) {
                    const __m256 qv = _mm256_loadu_ps(q + g * dim + d);
                    for (int u = 0; u < 4; u++) acc[g][u] = _mm256_fmadd_ps(qv, keys[u], acc[g][u]);
                }
            }
            /* per head, the horizontal sums of its four accumulators as four scores */
            for (int g = 0; g < G; g++) {
                const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]),
                                                _mm256_hadd_ps(acc[g][2], acc[g][3]));
                const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
                _mm_storeu_ps(scores + g * row + t, _mm_mul_ps(sums, _mm256_castps256_ps128(vscale)));
            }
        }
    }
#endif
    for (; t < m; t++)
        for (int g = 0; g < G; g++) {
            float s = 0.0f;
            for (int64_t d = 0; d < dim; d++) s += q[g * dim + d] * cache_load1(k, t * stride + d, half);
            scores[g * row + t] = s * scale;
        }
}

/* scores of one KV head's `group` query heads (q, `group` rows of dim) against m cache rows k,
   into scores (rows `row` apart): G is made a constant for each tile of heads. */
static void group_scores_any(const float *q, int64_t group, const void *k, int64_t stride,
                             int64_t m, int64_t dim, float scale, float *scores, int64_t row, int half) {
    for (int64_t g0 = 0; g0 < group; g0 += GROUP_TILE) {
        const float *qg = q + g0 * dim;
        float *sg = scores + g0 * row;
        if (group - g0 >= 3) group_scores(qg, 3, k, stride, m, dim, scale, sg, row, half);
        else if (group - g0 == 2) group_scores(qg, 2, k, stride, m, dim, scale, sg, row, half);
        else group_scores(qg, 1, k, stride, m, dim, scale, sg, row, half);
    }
}

/* acc[d] += sum_t p[t] * v_t[d], v_t = v + t * stride (cache elements), t < m: one query head,
   eight independent accumulators over 64 dims (AVX2 has registers for no more heads). */
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

#ifdef __AVX512F__
/* The same for G heads sharing v (probabilities p + g * prow, sums acc + g * dim), dim a multiple
   of 64: each 64-dim slice of a row is converted once for all G, whose 4G accumulators fit
   AVX-512's 32 registers. */
static inline __attribute__((always_inline)) void group_values(const float *p, int G, int64_t prow,
        const void *v, int64_t stride, int64_t m, int64_t dim, float *acc, int half) {
    for (int64_t d0 = 0; d0 < dim; d0 += 64) {
        __m512 a[GROUP_TILE][4];
        for (int g = 0; g < G; g++)
            for (int u = 0; u < 4; u++) a[g][u] = _mm512_loadu_ps(acc + g * dim + d0 + 16 * u);
        for (int64_t t = 0; t < m; t++) {
            __m512 x[4];
            for (int u = 0; u < 4; u++) x[u] = cache_load16(v, t * stride + d0 + 16 * u, half);
            for (int g = 0; g < G; g++) {
                const __m512 pt = _mm512_set1_ps(p[g * prow + t]);
                for (int u = 0; u < 4; u++) a[g][u] = _mm512_fmadd_ps(pt, x[u], a[g][u]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int u = 0; u < 4; u++) _mm512_storeu_ps(acc + g * dim + d0 + 16 * u, a[g][u]);
    }
}
#endif

/* Values of one KV head's `group` query heads (probabilities p, rows prow apart) into acc. */
static void group_values_any(const float *p, int64_t group, int64_t prow, const void *v,
                             int64_t stride, int64_t m, int64_t dim, float *acc, int half) {
#ifdef __AVX512F__
    if (dim % 64 == 0) {
        for (int64_t g0 = 0; g0 < group; g0 += GROUP_TILE) {
            const float *pg = p + g0 * prow;
            float *ag = acc + g0 * dim;
            if (group - g0 >= 3) group_values(pg, 3, prow, v, stride, m, dim, ag, half);
            else if (group - g0 == 2) group_values(pg, 2, prow, v, stride, m, dim, ag, half);
            else group_values(pg, 1, prow, v, stride, m, dim, ag, half);
        }
        return;
    }
#endif
    for (int64_t g = 0; g < group; g++)
        weighted_values(p + g * prow, v, stride, m, dim, acc + g * dim, half);
}

/* Rows of a sequence's cache read together: all of them in one block. Fewer than a block so
   that the next chunk can be fetched (prefetch_rows) while this one is read; measured at 64
   sequences: 16 rows of float16 or 32 of float32 (SmolLM2, 384 or 768 bytes a row). */
#define CHUNK_HALF 16
#define CHUNK_FLOAT 32
static inline int64_t chunk_rows(int64_t t, int64_t len, int64_t block_size, int half) {
    const int64_t chunk = half ? CHUNK_HALF : CHUNK_FLOAT, in_block = block_size - t % block_size;
    const int64_t m = len - t < chunk ? len - t : chunk;
    return m < in_block ? m : in_block;
}

/* Into L2: prefetching a whole chunk into L1 measured 1.3-1.7x slower at 64 sequences of
   370-700 tokens than into L2. */
static inline void prefetch_rows(const void *cache, int64_t first, int64_t m, int64_t row_bytes) {
#ifdef __AVX2__
    const char *p = (const char *)cache + first * row_bytes;
    for (int64_t b = 0; b < m * row_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
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

/* Query rows that read a chunk of cache rows while it is in L1: consecutive positions of one
   prompt (a prefill chunk) form tiles of up to this many; a decode row is a tile of its own.
   Every row of a tile computes its scores, softmax and values with the operations a decode row
   of the same context takes, in the same order (chunk boundaries fall at the same positions:
   they depend on the position and the block size, and the last one on the row's own length),
   so a row's output is the same bits in a decode step, in a prompt chunk cut anywhere, or
   recomputed after a preemption. (A transposed-query tile for AVX-512, 16 rows a vector, saved
   ~1/6 of the prefill attention but summed each score in another order: scripts/BENCHMARKS.md.) */
#define QUERY_TILE 16

typedef struct {
    const float *q;
    const void *k_cache, *v_cache;
    const int64_t *block_tables, *context_lens, *tiles;
    float *out;
    int64_t q_stride, out_stride, width, dim, block_size, group, slot, row_bytes, span, parts, hq, row;
    float scale;
    int half;
    _Atomic int failed;
} AttentionJob;

/* One work item: the query rows of tile item / parts (tiles[tile] to tiles[tile + 1], one
   sequence, context lengths ascending), its KV heads from (item % parts) * span, span of them. */
static void attend(void *arg, int64_t item) {
    AttentionJob *j = arg;
    const int64_t dim = j->dim, group = j->group, slot = j->slot, hq = j->hq, row = j->row;
    const int64_t tile = item / j->parts, h0 = item % j->parts * j->span;
    const int64_t first = j->tiles[tile], rows = j->tiles[tile + 1] - first;
    const int64_t *lens = j->context_lens + first, len = lens[rows - 1];
    const int64_t *table = j->block_tables + first * j->width;
    const size_t elem = j->half ? 2 : 4;
    float *scores = malloc(sizeof(float) * (size_t)(rows * hq * row));
    if (scores == NULL) {
        atomic_store(&j->failed, 1);
        return;
    }
    for (int64_t t0 = 0, m; t0 < len; t0 += m) {
        const int64_t at = chunk_at(j->k_cache, table, t0, len, j->block_size, j->half, j->row_bytes, &m) * slot + h0 * dim;
        for (int64_t r = rows - 1; r >= 0 && lens[r] > t0; r--) { /* the rows that reach t0 */
            const int64_t mr = lens[r] - t0 < m ? lens[r] - t0 : m;
            const float *qr = j->q + (first + r) * j->q_stride + h0 * group * dim;
            for (int64_t h = 0; h < j->span; h++)
                group_scores_any(qr + h * group * dim, group, (const char *)j->k_cache + (at + h * dim) * elem,
                                 slot, mr, dim, j->scale, scores + (r * hq + h * group) * row + t0, row, j->half);
        }
    }
    float totals[rows * hq];
    for (int64_t g = 0; g < rows * hq; g++) {
        const int64_t n = lens[g / hq];
        float *sg = scores + g * row, top = -INFINITY, total = 0.0f;
        #pragma omp simd reduction(max:top)
        for (int64_t t = 0; t < n; t++) top = sg[t] > top ? sg[t] : top;
        #pragma omp simd reduction(+:total)
        for (int64_t t = 0; t < n; t++) {
            sg[t] = exp_clamped(sg[t] - top);
            total += sg[t];
        }
        totals[g] = total;
    }
    for (int64_t r = 0; r < rows; r++)
        memset(j->out + (first + r) * j->out_stride + h0 * group * dim, 0, sizeof(float) * (size_t)(hq * dim));
    for (int64_t t0 = 0, m; t0 < len; t0 += m) {
        const int64_t at = chunk_at(j->v_cache, table, t0, len, j->block_size, j->half, j->row_bytes, &m) * slot + h0 * dim;
        for (int64_t r = rows - 1; r >= 0 && lens[r] > t0; r--) { /* the rows that reach t0 */
            const int64_t mr = lens[r] - t0 < m ? lens[r] - t0 : m;
            float *or = j->out + (first + r) * j->out_stride + h0 * group * dim;
            for (int64_t h = 0; h < j->span; h++)
                group_values_any(scores + (r * hq + h * group) * row + t0, group, row,
                                 (const char *)j->v_cache + (at + h * dim) * elem, slot, mr, dim,
                                 or + h * group * dim, j->half);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float *or = j->out + (first + r) * j->out_stride + h0 * group * dim;
        for (int64_t g = 0; g < hq; g++) {
            const float inv = 1.0f / totals[r * hq + g];
            for (int64_t d = 0; d < dim; d++) or[g * dim + d] *= inv;
        }
    }
    free(scores);
}

/* Row i continues row i - 1's prompt: same block table, the next position. */
static int continues(const int64_t *tables, const int64_t *lens, int64_t width, int64_t i) {
    return lens[i] == lens[i - 1] + 1 &&
           memcmp(tables + i * width, tables + (i - 1) * width, sizeof(int64_t) * (size_t)width) == 0;
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
    /* A work item is a tile's KV heads: all of them where there are tiles enough to keep the
       threads busy, so each cache row (every KV head's slice, side by side) comes from memory
       once, a chunk of rows ahead of its use; one each for a few tiles. The tile's rows and the
       query heads sharing a KV head (GQA) read each chunk in turn while it is in L1. */
    if (half && !cache_half_supported()) return 1;
    int64_t *tiles = malloc(sizeof(int64_t) * (size_t)(n + 1)), count = 0, max_len = 0;
    if (tiles == NULL) return 1;
    for (int64_t i = 0; i < n; i++) {
        if (i == 0 || i - tiles[count - 1] == QUERY_TILE || !continues(block_tables, context_lens, width, i))
            tiles[count++] = i;
        max_len = context_lens[i] > max_len ? context_lens[i] : max_len;
    }
    tiles[count] = n;
    const int64_t group = heads / kv_heads, slot = kv_heads * dim;
    const int64_t span = count >= 4 * threads ? kv_heads : 1;
    AttentionJob job = {q, k_cache, v_cache, block_tables, context_lens, tiles, out, q_stride,
                        out_stride, width, dim, block_size, group, slot, slot * (half ? 2 : 4),
                        span, kv_heads / span, span * group, max_len + 8, scale, half, 0};
    run_tasks(count * job.parts, threads, attend, &job);
    free(tiles);
    return atomic_load(&job.failed);
}
