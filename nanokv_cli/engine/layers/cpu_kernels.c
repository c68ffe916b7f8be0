#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    union { uint32_t u; float f; } v;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24 */
        v.f = (float)mantissa * 5.9604644775390625e-8f;
        v.u |= sign;
    } else if (exponent == 31) {
        v.u = sign | 0x7F800000u | (mantissa << 13);
    } else {
        v.u = sign | ((exponent + 112) << 23) | (mantissa << 13);
    }
    return v.f;
#endif
}

/* The KV cache holds float32 or, where F16C converts in hardware, float16 (half the bytes a
   decode step reads; see ModelRunner.kv_cache_dtype). Element `index` of a cache row: */
static inline __attribute__((always_inline)) float cache_load1(const void *base, int64_t index, int half) {
    return half ? half_to_float(((const uint16_t *)base)[index]) : ((const float *)base)[index];
}
#ifdef __AVX2__
static inline __attribute__((always_inline)) __m256 cache_load8(const void *base, int64_t index, int half) {
#ifdef __F16C__
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + index)));
#endif
    return _mm256_loadu_ps((const float *)base + index);
}
#endif

int cache_half_supported(void) {
#ifdef __F16C__
    return 1;
#else
    return 0;
#endif
}

/* exp(x) for x <= 88, Cephes-style 2^n * p(r) in plain arithmetic, so the loops around it
   vectorise; relative error ~1e-7; below -87 it returns ~exp(-87). */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    union { int32_t i; float f; } two_n;
    two_n.i = ((int32_t)n + 127) << 23;
    return p * two_n.f;
}

/* exp(x) for any float x: saturates outside [-87, 88]. */
static inline float exp_any(float x) { return exp_clamped(x > 88.0f ? 88.0f : x); }

/* Row r of a [outer, inner, dim] view with rows of dim contiguous: outer stride given. */
#define ROW(base, r, inner, outer_stride, dim) \
    ((base) + ((r) / (inner)) * (outer_stride) + ((r) % (inner)) * (dim))

/* RMSNorm over rows of dim, optionally after a residual add:
   with residual: residual[r] += x[r], out[r] = norm(residual[r]) * w; else out[r] = norm(x[r]) * w.
   Rows are addressed as [outer, inner, dim] (inner = heads for per-head norms, else 1);
   out may be x. Sum of squares in float32, as torch's mean. */
void rms_norm_f32(const float *x, int64_t x_stride, float *residual, int64_t residual_stride,
                  const float *w, int64_t rows, int64_t inner, int64_t dim, float eps,
                  float *out, int64_t out_stride, int threads) {
    #pragma omp parallel for num_threads(threads) if (threads > 1 && rows * dim >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = ROW(x, r, inner, x_stride, dim);
        float *orow = ROW(out, r, inner, out_stride, dim);
        const float *src = xr;
        if (residual != NULL) {
            float *res = ROW(residual, r, inner, residual_stride, dim);
            #pragma omp simd
            for (int64_t d = 0; d < dim; d++) res[d] = xr[d] + res[d];
            src = res;
        }
        float squares = 0.0f;
        #pragma omp simd reduction(+:squares)
        for (int64_t d = 0; d < dim; d++) squares += src[d] * src[d];
        const float inv = 1.0f / sqrtf(squares / (float)dim + eps);
        #pragma omp simd
        for (int64_t d = 0; d < dim; d++) orow[d] = w[d] * (src[d] * inv);
    }
}

/* Rotary embedding in place on x [n, heads, dim] (token stride x_stride, heads contiguous),
   half-split layout: table[pos] = [cos duplicated | sin with the first half negated]. */
void rotary_f32(float *x, int64_t x_stride, int64_t n, int64_t heads, int64_t dim,
                const float *table, const int64_t *positions, int threads) {
    const int64_t half = dim / 2;
    #pragma omp parallel for num_threads(threads) if (threads > 1 && n * heads * dim >= 65536)
    for (int64_t i = 0; i < n; i++) {
        const float *cs = table + positions[i] * 2 * dim, *sn = cs + dim;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + i * x_stride + h * dim;
            #pragma omp simd
            for (int64_t d = 0; d < half; d++) {
                const float x1 = v[d], x2 = v[d + half];
                v[d] = x1 * cs[d] + x2 * sn[d];
                v[d + half] = x2 * cs[d + half] + x1 * sn[d + half];
            }
        }
    }
}

/* k_cache[slots[i]] = k[i], v_cache[slots[i]] = v[i]; rows of `row` floats, token strides given;
   a float16 cache (half != 0, F16C builds only) stores them rounded to nearest. */
void store_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                  const int64_t *slots, int64_t n, int64_t row, void *k_cache, void *v_cache,
                  int half) {
    for (int64_t i = 0; i < n; i++) {
        if (!half) {
            memcpy((float *)k_cache + slots[i] * row, k + i * k_stride, sizeof(float) * row);
            memcpy((float *)v_cache + slots[i] * row, v + i * v_stride, sizeof(float) * row);
            continue;
        }
#ifdef __F16C__
        uint16_t *kd = (uint16_t *)k_cache + slots[i] * row, *vd = (uint16_t *)v_cache + slots[i] * row;
        for (int64_t d = 0; d < row; d++) {
            kd[d] = _cvtss_sh(k[i * k_stride + d], _MM_FROUND_TO_NEAREST_INT);
            vd[d] = _cvtss_sh(v[i * v_stride + d], _MM_FROUND_TO_NEAREST_INT);
        }
#endif
    }
}

/* out[i] = silu(x[i, :inter]) * x[i, inter:], x [n, 2 * inter] contiguous, out [n, inter]. */
void silu_mul_f32(const float *x, int64_t n, int64_t inter, float *out, int threads) {
    #pragma omp parallel for num_threads(threads) if (threads > 1 && n * inter >= 65536)
    for (int64_t i = 0; i < n; i++) {
        const float *gate = x + i * 2 * inter, *up = gate + inter;
        float *o = out + i * inter;
        #pragma omp simd
        for (int64_t d = 0; d < inter; d++) o[d] = gate[d] / (1.0f + exp_any(-gate[d])) * up[d];
    }
}

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

/* ---------------------------------------------------------------------------------------------
   Linear layers for few-row inputs (decode steps): y = x W^T + b.

   A decode step at batch 1 streams every weight once and does little arithmetic on it, so its
   speed is the bytes read per token plus whatever runs between the reads. Weights are held as
     LINEAR_F32  float32 [out][in]
     LINEAR_Q8   int8 [out][in], w = scale * q with one float16 scale per 32 inputs (Q8_0)
     LINEAR_Q8_FLOAT_INPUT  the same weights against unrounded float inputs (see row_q8_float)
     LINEAR_Q4   4-bit [out][in/2] in GGUF's Q4_0/Q4_1 nibble order (byte j of a 32-block holds
                 elements j and j + 16), w = scale * q + zero with float16 scale and zero per
                 32 inputs, q in 0..15 (Q4_0: zero = -8 scale; Q4_1: zero = its min)
   The quantized kernels quantize the input rows to int8 per 32-block first (as llama.cpp does)
   so the inner loop is integer multiply-adds: 32 products per AVX2 instruction. Batches run as
   tiled GEMMs on copies laid out for them: LINEAR_I16 (fixed point, from float32 weights) and
   LINEAR_Q4_PANELS (LINEAR_Q4's blocks unpacked), below.
   ------------------------------------------------------------------------------------------ */

enum { LINEAR_F32 = 0, LINEAR_Q8 = 1, LINEAR_Q4 = 2, LINEAR_Q8_FLOAT_INPUT = 3, LINEAR_I16 = 4,
       LINEAR_Q4_PANELS = 5 };
#define QBLOCK 32

typedef struct {
    int64_t kind, out, in;
    const void *weight;
    const uint16_t *scale; /* quantized: float16 [out][in / 32]; LINEAR_I16: float32 [out] */
    const uint16_t *zero;  /* LINEAR_Q4: float16 [out][in / 32] */
    const float *bias;  /* [out] or NULL */
} Linear;


/* Input rows quantized per 32-block: q = round(x / d), d = max|x| / 127; sum = d * sum(q). */
typedef struct {
    int8_t *q;
    float *d, *sum;
} QuantRows;

/* One 32-block of an input row: q = round(x / d), d = max|x| / 127; *sum = d * sum(q). */
static void quantize_block_q8(const float *x, int8_t *q, float *d, float *sum) {
    float amax = 0.0f;
#ifdef __AVX2__
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax8 = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(x + 8 * j);
        amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    __m256i i[4];
    for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)));
    /* the two packs interleave 32-bit groups across lanes; the permute restores element order */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    const int total = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
#else
    for (int j = 0; j < QBLOCK; j++) amax = fmaxf(amax, fabsf(x[j]));
    const float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    int total = 0;
    for (int j = 0; j < QBLOCK; j++) {
        q[j] = (int8_t)nearbyintf(x[j] * inv);
        total += q[j];
    }
#endif
    *d = scale;
    *sum = scale * (float)total;
}

static void quantize_rows(const float *x, int64_t x_stride, int64_t n, int64_t in, QuantRows qr) {
    const int64_t blocks = in / QBLOCK;
    for (int64_t i = 0; i < n; i++)
        for (int64_t b = 0; b < blocks; b++)
            quantize_block_q8(x + i * x_stride + b * QBLOCK, qr.q + i * in + b * QBLOCK,
                              qr.d + i * blocks + b, qr.sum + i * blocks + b);
}

#ifdef __AVX2__
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 unsigned 4-bit weights of one block, in element order. */
static inline __m256i q4_block(const uint8_t *p) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(0x0F));
}

/* The 32 products of unsigned u and signed s, summed into 8 int32 lanes, as floats. */
static inline __m256 dot_u8_s8(__m256i u, __m256i s) {
    const __m256i pairs = _mm256_maddubs_epi16(u, s);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

static inline __m256 dot_s8_s8(__m256i w, __m256i x) {
    return dot_u8_s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
#endif

#ifndef PF
#define PF 128
#endif
/* Four output rows o..o+3 of one input row: out[r] = W[o + r] . x (no bias). */
static void rows4_f32(const Linear *L, int64_t o, const float *x, float out[4]) {
    const int64_t in = L->in;
    const float *w = (const float *)L->weight + o * in;
    int64_t d = 0;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#ifdef __AVX2__
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (; d + 16 <= in; d += 16) {
        _mm_prefetch((const char *)(w + d + PF), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + in + d + PF), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + 2 * in + d + PF), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + 3 * in + d + PF), _MM_HINT_T0);
        const __m256 x0 = _mm256_loadu_ps(x + d), x1 = _mm256_loadu_ps(x + d + 8);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + d), x0, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + in + d), x0, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 2 * in + d), x0, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 3 * in + d), x0, a3);
        b0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + d + 8), x1, b0);
        b1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + in + d + 8), x1, b1);
        b2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 2 * in + d + 8), x1, b2);
        b3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 3 * in + d + 8), x1, b3);
    }
    s0 = hsum8(_mm256_add_ps(a0, b0));
    s1 = hsum8(_mm256_add_ps(a1, b1));
    s2 = hsum8(_mm256_add_ps(a2, b2));
    s3 = hsum8(_mm256_add_ps(a3, b3));
#endif
    for (; d < in; d++) {
        s0 += w[d] * x[d];
        s1 += w[in + d] * x[d];
        s2 += w[2 * in + d] * x[d];
        s3 += w[3 * in + d] * x[d];
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

#if defined(__AVX2__) && defined(__F16C__)
#define QUANT_SIMD 1

#define QUANT_BLOCK(k, acc)                                                                      \
    do {                                                                                         \
        const int64_t b = b0 + (k);                                                              \
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + b * QBLOCK));                \
        __m256 p;                                                                                \
        if (Q4) {                                                                                \
            p = dot_u8_s8(q4_block(w4 + b * 16), x);                                             \
        } else {                                                                                 \
            const __m256i w = _mm256_loadu_si256((const __m256i *)(w8 + b * QBLOCK));            \
            p = dot_u8_s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));                       \
        }                                                                                        \
        acc = _mm256_fmadd_ps(p, _mm256_permutevar8x32_ps(f, _mm256_set1_epi32(k)), acc);        \
    } while (0)
#endif

/* W[o] . x for one quantized input row x (row i of qr). Eight blocks at a time: their weight
   scales are converted and multiplied by the input's scales in one vector, the Q4 zero term
   sum_b zero[b] * d_x[b] * sum(q_x[b]) is one more multiply-add, and two accumulators take
   alternate blocks so that consecutive multiply-adds do not wait on each other. Rows of a
   batch each run this: the cost is integer arithmetic per row, which tiling rows does not
   reduce by much, and beyond a few rows a float32 GEMM wins anyway (DENSE_MIN_ROWS). */
static inline __attribute__((always_inline)) float quant_row(const Linear *L, int64_t o,
                                                             QuantRows qr, int64_t i,
                                                             const int Q4) {
    const int64_t in = L->in, blocks = in / QBLOCK;
    const int8_t *xq = qr.q + i * in;
    const float *xd = qr.d + i * blocks, *xs = qr.sum + i * blocks;
    const uint16_t *ws = L->scale + o * blocks, *wz = Q4 ? L->zero + o * blocks : NULL;
    const uint8_t *w4 = (const uint8_t *)L->weight + o * (in / 2);
    const int8_t *w8 = (const int8_t *)L->weight + o * in;
    float s = 0.0f;
    int64_t b0 = 0;
#ifdef QUANT_SIMD
    __m256 even = _mm256_setzero_ps(), odd = even;
    for (; b0 + 8 <= blocks; b0 += 8) {
        const __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ws + b0))),
                                       _mm256_loadu_ps(xd + b0));
        if (Q4)
            even = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wz + b0))),
                                   _mm256_loadu_ps(xs + b0), even);
        QUANT_BLOCK(0, even); QUANT_BLOCK(1, odd); QUANT_BLOCK(2, even); QUANT_BLOCK(3, odd);
        QUANT_BLOCK(4, even); QUANT_BLOCK(5, odd); QUANT_BLOCK(6, even); QUANT_BLOCK(7, odd);
    }
    for (; b0 < blocks; b0++) { /* blocks past the last eight */
        const __m256 f = _mm256_set1_ps(half_to_float(ws[b0]) * xd[b0]);
        QUANT_BLOCK(0, even);
        if (Q4) s += half_to_float(wz[b0]) * xs[b0];
    }
    s += hsum8(_mm256_add_ps(even, odd));
#endif
    for (; b0 < blocks; b0++) { /* without AVX2 */
        const int8_t *x = xq + b0 * QBLOCK;
        int total = 0;
        if (Q4) {
            const uint8_t *wq = w4 + b0 * 16;
            for (int j = 0; j < 16; j++) total += (wq[j] & 0x0F) * x[j] + (wq[j] >> 4) * x[j + 16];
            s += half_to_float(wz[b0]) * xs[b0];
        } else {
            const int8_t *wq = w8 + b0 * QBLOCK;
            for (int j = 0; j < QBLOCK; j++) total += wq[j] * x[j];
        }
        s += half_to_float(ws[b0]) * xd[b0] * (float)total;
    }
    return s;
}

/* W[o] . x for int8 weights and a float input row, without rounding the input: for the LM
   head, where the next token is often a near tie between logits, and rounding the final hidden
   state's outlier channels to int8 flips it (it turned the default model's answer to "What is
   the capital of France?" from Paris to nonsense). ~1.5x the cost of the int8 x int8 kernel. */
static float row_q8_float(const Linear *L, int64_t o, const float *x) {
    const int64_t in = L->in, blocks = in / QBLOCK;
    const int8_t *w = (const int8_t *)L->weight + o * in;
    const uint16_t *ws = L->scale + o * blocks;
    float s = 0.0f;
    int64_t b = 0;
#ifdef QUANT_SIMD
    __m256 even = _mm256_setzero_ps(), odd = even;
#define Q8F_PART(j) _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(                       \
                        _mm_loadl_epi64((const __m128i *)(wb + (j))))), _mm256_loadu_ps(xb + (j)))
    for (; b + 2 <= blocks; b += 2) {
        const int8_t *wb = w + b * QBLOCK;
        const float *xb = x + b * QBLOCK;
        const __m256 p0 = _mm256_add_ps(_mm256_add_ps(Q8F_PART(0), Q8F_PART(8)),
                                        _mm256_add_ps(Q8F_PART(16), Q8F_PART(24)));
        const __m256 p1 = _mm256_add_ps(_mm256_add_ps(Q8F_PART(32), Q8F_PART(40)),
                                        _mm256_add_ps(Q8F_PART(48), Q8F_PART(56)));
        even = _mm256_fmadd_ps(p0, _mm256_set1_ps(half_to_float(ws[b])), even);
        odd = _mm256_fmadd_ps(p1, _mm256_set1_ps(half_to_float(ws[b + 1])), odd);
    }
#undef Q8F_PART
    s = hsum8(_mm256_add_ps(even, odd));
#endif
    for (; b < blocks; b++) {
        float block = 0.0f;
        for (int j = 0; j < QBLOCK; j++) block += (float)w[b * QBLOCK + j] * x[b * QBLOCK + j];
        s += half_to_float(ws[b]) * block;
    }
    return s;
}

/* ---- Fixed-point GEMM for batches (LINEAR_I16) ------------------------------------------------
   Float32 weights rounded once to 14-bit integers per output row, inputs to 13-bit integers per
   64 values, multiplied with vpmaddwd: 16 products per instruction against an FMA's 8, and the
   weights take half the bytes. Integer sums stay exact: a 64-value block sums at most
   64 * 8191 * 4095 < 2^31 (the bit budget; the weights get the extra bit because one scale
   covers a whole row).
   Weight layout, panels of 16 output rows: [ceil(out / 16)][in / 2][16] int32, each int32 the
   pair (w[o][2t], w[o][2t + 1]) as int16, so one vector holds 8 outputs' next two weights.
   A tile is 6 input rows against one panel: 12 accumulators, 2 weight vectors, a broadcast and
   a product fill the 16 vector registers exactly; written in assembly because gcc spills that
   many named accumulators. A vpmaddwd and its vpaddd run about 1.5 times the products per cycle
   of float32 FMAs on Zen 3, so the tile beats MKL's float32 GEMM at every batch size once the
   weights and inputs are blocked for the caches (linear_i16). */
#define I16_BLOCK 64
#define I16_WMAX 8191.0f
#define I16_XMAX 4095.0f
#define I16_ROWS 6
#define I16_X_CHUNK (96 * 1024) /* bytes of rounded input rows per work item (with the weights, */
#define I16_W_CHUNK (144 * 1024) /* bytes of packed weights: both stay in a 512 KB L2) */

int64_t i16_packed_ints(int64_t out, int64_t in) { return (out + 15) / 16 * 16 * (in / 2); }

/* w [out, in] float32 -> packed (i16_packed_ints int32) and scale [round_up(out, 16)]. */
int pack_i16(const float *w, int64_t out, int64_t in, int32_t *packed, float *scale, int threads) {
    if (in % I16_BLOCK) return 1;
    const int64_t panels = (out + 15) / 16, pairs = in / 2;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && panels >= 8)
    for (int64_t p = 0; p < panels; p++) {
        int16_t *dst = (int16_t *)(packed + p * pairs * 16);
        for (int c = 0; c < 16; c++) {
            const int64_t o = p * 16 + c;
            float amax = 0.0f;
            for (int64_t j = 0; o < out && j < in; j++) amax = fmaxf(amax, fabsf(w[o * in + j]));
            scale[o] = amax / I16_WMAX;
            const float inv = amax > 0.0f ? I16_WMAX / amax : 0.0f;
            for (int64_t j = 0; j < in; j++)
                dst[((j / 2) * 16 + c) * 2 + (j & 1)] = o < out ? (int16_t)lrintf(w[o * in + j] * inv) : 0;
        }
    }
    return 0;
}

/* One 64-block of an input row: q = round(x / d), d = max|x| / 4095. */
static void quantize_block_i16(const float *x, int16_t *q, float *d) {
#ifdef __AVX2__
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[I16_BLOCK / 8], amax8 = _mm256_setzero_ps();
    for (int j = 0; j < I16_BLOCK / 8; j++) {
        v[j] = _mm256_loadu_ps(x + 8 * j);
        amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? I16_XMAX / amax : 0.0f);
    for (int j = 0; j < I16_BLOCK / 16; j++) {
        /* packs interleaves 128-bit lanes; the permute puts the 16 values back in order */
        const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * j], inv));
        const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * j + 1], inv));
        _mm256_storeu_si256((__m256i *)(q + 16 * j),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
    }
#else
    float amax = 0.0f;
    for (int j = 0; j < I16_BLOCK; j++) amax = fmaxf(amax, fabsf(x[j]));
    const float inv = amax > 0.0f ? I16_XMAX / amax : 0.0f;
    for (int j = 0; j < I16_BLOCK; j++) q[j] = (int16_t)lrintf(x[j] * inv);
#endif
    *d = amax / I16_XMAX;
}

/* ROW(address, a, b) for each of a tile's six input rows at byte offset xo, with its two
   accumulators: rows 0-2 from %[x0] and 3-5 from %[x3], %[xs] bytes apart (an x86 address
   takes a base, an index scaled by 1, 2, 4 or 8, and an offset). Both assembly tiles use it. */
#define TILE_ROWS(ROW, xo)                                                      \
    ROW(#xo "(%[x0])", 0, 1) ROW(#xo "(%[x0],%[xs],1)", 2, 3)                  \
    ROW(#xo "(%[x0],%[xs],2)", 4, 5) ROW(#xo "(%[x3])", 6, 7)                  \
    ROW(#xo "(%[x3],%[xs],1)", 8, 9) ROW(#xo "(%[x3],%[xs],2)", 10, 11)

/* sums[6][16] += the dot products of 6 rounded input rows (row r at x + r * x_stride int16,
   scales at d + r * d_stride) with one weight panel, each 64-block's integer sum times its
   input scale (the weight scale is applied by the caller). */
static void tile_i16(const int16_t *x, int64_t x_stride, const float *d, int64_t d_stride,
                     const int32_t *panel, int64_t blocks, float *sums) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__x86_64__)
    const char *x0 = (const char *)x, *x3 = x0 + 3 * 2 * x_stride;
    const char *d0 = (const char *)d, *d3 = d0 + 3 * 4 * d_stride;
    const int64_t xs = 2 * x_stride, ds = 4 * d_stride;
    int64_t steps;
/* row r's next pair times both weight vectors, into accumulators a and b */
#define I16_ROW(xaddr, a, b)                                                    \
    "vpbroadcastd " xaddr ", %%ymm14\n\t"                                      \
    "vpmaddwd %%ymm12, %%ymm14, %%ymm15\n\t"                                   \
    "vpaddd %%ymm15, %%ymm" #a ", %%ymm" #a "\n\t"                             \
    "vpmaddwd %%ymm13, %%ymm14, %%ymm15\n\t"                                   \
    "vpaddd %%ymm15, %%ymm" #b ", %%ymm" #b "\n\t"
#define I16_PAIR(xo, wo)                                                        \
    "vmovdqu " #wo "(%[w]), %%ymm12\n\t"                                       \
    "vmovdqu " #wo "+32(%[w]), %%ymm13\n\t"                                    \
    TILE_ROWS(I16_ROW, xo)
/* sums[r] += float(accumulators a, b) * d[r] */
#define I16_FLUSH(daddr, a, b, so)                                              \
    "vbroadcastss " daddr ", %%ymm14\n\t"                                      \
    "vcvtdq2ps %%ymm" #a ", %%ymm15\n\t"                                       \
    "vfmadd213ps " #so "(%[s]), %%ymm14, %%ymm15\n\t"                          \
    "vmovups %%ymm15, " #so "(%[s])\n\t"                                       \
    "vcvtdq2ps %%ymm" #b ", %%ymm15\n\t"                                       \
    "vfmadd213ps " #so "+32(%[s]), %%ymm14, %%ymm15\n\t"                       \
    "vmovups %%ymm15, " #so "+32(%[s])\n\t"
    __asm__ volatile(
        "1:\n\t"
        "vpxor %%xmm0, %%xmm0, %%xmm0\n\tvpxor %%xmm1, %%xmm1, %%xmm1\n\t"
        "vpxor %%xmm2, %%xmm2, %%xmm2\n\tvpxor %%xmm3, %%xmm3, %%xmm3\n\t"
        "vpxor %%xmm4, %%xmm4, %%xmm4\n\tvpxor %%xmm5, %%xmm5, %%xmm5\n\t"
        "vpxor %%xmm6, %%xmm6, %%xmm6\n\tvpxor %%xmm7, %%xmm7, %%xmm7\n\t"
        "vpxor %%xmm8, %%xmm8, %%xmm8\n\tvpxor %%xmm9, %%xmm9, %%xmm9\n\t"
        "vpxor %%xmm10, %%xmm10, %%xmm10\n\tvpxor %%xmm11, %%xmm11, %%xmm11\n\t"
        "movq $16, %[steps]\n\t" /* 32 pairs, two per step */
        "2:\n\t"
        I16_PAIR(0, 0) I16_PAIR(4, 64)
        "addq $128, %[w]\n\t"
        "addq $8, %[x0]\n\t"
        "addq $8, %[x3]\n\t"
        "decq %[steps]\n\t"
        "jnz 2b\n\t"
        I16_FLUSH("(%[d0])", 0, 1, 0) I16_FLUSH("(%[d0],%[ds],1)", 2, 3, 64)
        I16_FLUSH("(%[d0],%[ds],2)", 4, 5, 128) I16_FLUSH("(%[d3])", 6, 7, 192)
        I16_FLUSH("(%[d3],%[ds],1)", 8, 9, 256) I16_FLUSH("(%[d3],%[ds],2)", 10, 11, 320)
        "addq $4, %[d0]\n\t"
        "addq $4, %[d3]\n\t"
        "decq %[blocks]\n\t"
        "jnz 1b\n\t"
        : [w] "+r"(panel), [x0] "+r"(x0), [x3] "+r"(x3), [d0] "+r"(d0), [d3] "+r"(d3),
          [blocks] "+r"(blocks), [steps] "=&r"(steps)
        : [xs] "r"(xs), [ds] "r"(ds), [s] "r"(sums)
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
          "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "cc", "memory");
#undef I16_ROW
#undef I16_PAIR
#undef I16_FLUSH
#else
    for (int64_t b = 0; b < blocks; b++)
        for (int r = 0; r < I16_ROWS; r++)
            for (int c = 0; c < 16; c++) {
                int32_t acc = 0;
                for (int64_t j = b * I16_BLOCK; j < (b + 1) * I16_BLOCK; j += 2) {
                    const int16_t *wp = (const int16_t *)(panel + (j / 2) * 16 + c);
                    acc += (int32_t)x[r * x_stride + j] * wp[0] + (int32_t)x[r * x_stride + j + 1] * wp[1];
                }
                sums[r * 16 + c] += (float)acc * d[r * d_stride + b];
            }
#endif
}

/* ---- Int4 GEMM for batches (LINEAR_Q4_PANELS) --------------------------------------------------
   The LINEAR_Q4 blocks (w = scale * q + zero, q in 0..15 per 32 inputs) unpacked to one byte per
   weight in panels of 16 outputs, against inputs rounded to int8 per 32 as the LINEAR_Q4 kernel
   (and llama.cpp) rounds them, so every row count computes the same products. vpmaddubsw
   multiplies 32 unsigned weight bytes by 32 signed inputs and adds pairs into 16-bit lanes: a
   pair is at most 2 * 15 * 127 = 3810, so the eight steps of a block (32 inputs, 4 per step)
   sum exactly in 16 bits (30480 < 32767) before one vpmaddwd widens them. That is 32 products
   per instruction against vpmaddwd's 16, and 1.35-1.4x the LINEAR_I16 tile's speed in L1.
   Panel layout, per 32-block of inputs a 640-byte record: [8 steps][2 halves][8 outputs][4
   inputs] weight bytes (one vector holds 8 outputs' next 4 weights), then float32 scale[16] and
   zero[16]. Inputs: int8 rows, and per row and block the pair (d, d * sum(q)). */
#define Q4P_RECORD 640

int64_t q4_panel_bytes(int64_t out, int64_t in) { return (out + 15) / 16 * (in / QBLOCK) * Q4P_RECORD; }

/* A LINEAR_Q4 layer's blocks as LINEAR_Q4_PANELS reads them (see above). */
void pack_q4_panels(const Linear *L, uint8_t *packed, int threads) {
    const int64_t out = L->out, in = L->in, blocks = in / QBLOCK, panels = (out + 15) / 16;
    const uint8_t *w4 = (const uint8_t *)L->weight;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && panels >= 8)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *rec = packed + (p * blocks + b) * Q4P_RECORD;
            float *scale = (float *)(rec + 512), *zero = scale + 16;
            for (int c = 0; c < 16; c++) {
                const int64_t o = p * 16 + c;
                const uint8_t *nibbles = w4 + o * (in / 2) + b * (QBLOCK / 2);
                for (int e = 0; e < QBLOCK; e++) /* GGUF order: byte j holds elements j, j + 16 */
                    rec[(e / 4) * 64 + (c / 8) * 32 + (c % 8) * 4 + e % 4] =
                        o >= out ? 0 : e < 16 ? nibbles[e] & 15 : nibbles[e - 16] >> 4;
                scale[c] = o < out ? half_to_float(L->scale[o * blocks + b]) : 0.0f;
                zero[c] = o < out ? half_to_float(L->zero[o * blocks + b]) : 0.0f;
            }
        }
}

/* A tiled layer's input rounding: x [n, in] -> q [n_padded, in] and its scales; padding rows
   are zero. LINEAR_I16: int16 per 64 values, one scale each; LINEAR_Q4_PANELS: int8 per 32,
   the pair (d, d * sum(q)) each. */
static void round_rows(int q4, const float *x, int64_t x_stride, int64_t n, int64_t n_padded,
                       int64_t in, void *q, float *d, int threads) {
    const int64_t block = q4 ? QBLOCK : I16_BLOCK, blocks = in / block, scales = q4 ? 2 : 1;
    const int64_t row_bytes = q4 ? in : 2 * in;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n * in >= 65536)
    for (int64_t i = 0; i < n_padded; i++) {
        char *qi = (char *)q + i * row_bytes;
        float *di = d + i * blocks * scales;
        if (i >= n) {
            memset(qi, 0, (size_t)row_bytes);
            memset(di, 0, sizeof(float) * (size_t)(blocks * scales));
            continue;
        }
        for (int64_t b = 0; b < blocks; b++) {
            const float *xb = x + i * x_stride + b * block;
            if (q4)
                quantize_block_q8(xb, (int8_t *)qi + b * block, di + 2 * b, di + 2 * b + 1);
            else
                quantize_block_i16(xb, (int16_t *)qi + b * block, di + b);
        }
    }
}

/* sums[6][16] += 6 rounded input rows (row r at x + r * x_stride, its (d, s) pairs at
   ds + r * ds_stride) times one panel's records, block by block. */
static void tile_q4(const int8_t *x, int64_t x_stride, const float *ds, int64_t ds_stride,
                    const uint8_t *panel, int64_t blocks, float *sums) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__x86_64__)
    static const int16_t ones[16] __attribute__((aligned(32))) = {1, 1, 1, 1, 1, 1, 1, 1,
                                                                1, 1, 1, 1, 1, 1, 1, 1};
    const char *x0 = (const char *)x, *x3 = x0 + 3 * x_stride;
    const char *d0 = (const char *)ds, *d3 = d0 + 3 * 4 * ds_stride;
    const int64_t xs = x_stride, dst = 4 * ds_stride;
/* row r's next 4 inputs times both weight vectors: the block's first step sets the 16-bit
   accumulators a and b, later steps add to them */
#define Q4_FIRST(xaddr, a, b)                                                  \
    "vpbroadcastd " xaddr ", %%ymm14\n\t"                                      \
    "vpmaddubsw %%ymm14, %%ymm12, %%ymm" #a "\n\t"                             \
    "vpmaddubsw %%ymm14, %%ymm13, %%ymm" #b "\n\t"
#define Q4_NEXT(xaddr, a, b)                                                   \
    "vpbroadcastd " xaddr ", %%ymm14\n\t"                                      \
    "vpmaddubsw %%ymm14, %%ymm12, %%ymm15\n\t"                                 \
    "vpaddw %%ymm15, %%ymm" #a ", %%ymm" #a "\n\t"                             \
    "vpmaddubsw %%ymm14, %%ymm13, %%ymm15\n\t"                                 \
    "vpaddw %%ymm15, %%ymm" #b ", %%ymm" #b "\n\t"
#define Q4_STEP(ROW, xo, wo)                                                   \
    "vmovdqu " #wo "(%[w]), %%ymm12\n\t"                                       \
    "vmovdqu " #wo "+32(%[w]), %%ymm13\n\t"                                    \
    TILE_ROWS(ROW, xo)
/* sums[r][half] += float(acc) * scale * d + zero * s */
#define Q4_HALF(daddr, acc, ho, so)                                            \
    "vpmaddwd %[ones], %%ymm" #acc ", %%ymm15\n\t"                             \
    "vcvtdq2ps %%ymm15, %%ymm15\n\t"                                           \
    "vbroadcastss " daddr ", %%ymm14\n\t"                                      \
    "vmulps 512+" #ho "(%[w]), %%ymm14, %%ymm14\n\t"                           \
    "vfmadd213ps " #so "(%[s]), %%ymm14, %%ymm15\n\t"                          \
    "vbroadcastss 4" daddr ", %%ymm14\n\t"                                     \
    "vfmadd231ps 576+" #ho "(%[w]), %%ymm14, %%ymm15\n\t"                      \
    "vmovups %%ymm15, " #so "(%[s])\n\t"
#define Q4_FLUSH(daddr, a, b, so) Q4_HALF(daddr, a, 0, so) Q4_HALF(daddr, b, 32, so + 32)
    __asm__ volatile(
        "1:\n\t"
        Q4_STEP(Q4_FIRST, 0, 0) Q4_STEP(Q4_NEXT, 4, 64) Q4_STEP(Q4_NEXT, 8, 128)
        Q4_STEP(Q4_NEXT, 12, 192) Q4_STEP(Q4_NEXT, 16, 256) Q4_STEP(Q4_NEXT, 20, 320)
        Q4_STEP(Q4_NEXT, 24, 384) Q4_STEP(Q4_NEXT, 28, 448)
        Q4_FLUSH("(%[d0])", 0, 1, 0) Q4_FLUSH("(%[d0],%[dst],1)", 2, 3, 64)
        Q4_FLUSH("(%[d0],%[dst],2)", 4, 5, 128) Q4_FLUSH("(%[d3])", 6, 7, 192)
        Q4_FLUSH("(%[d3],%[dst],1)", 8, 9, 256) Q4_FLUSH("(%[d3],%[dst],2)", 10, 11, 320)
        "addq $640, %[w]\n\t"
        "addq $32, %[x0]\n\t"
        "addq $32, %[x3]\n\t"
        "addq $8, %[d0]\n\t"
        "addq $8, %[d3]\n\t"
        "decq %[blocks]\n\t"
        "jnz 1b\n\t"
        : [w] "+r"(panel), [x0] "+r"(x0), [x3] "+r"(x3), [d0] "+r"(d0), [d3] "+r"(d3),
          [blocks] "+r"(blocks)
        : [xs] "r"(xs), [dst] "r"(dst), [s] "r"(sums), [ones] "m"(ones)
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
          "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "cc", "memory");
#undef Q4_FIRST
#undef Q4_NEXT
#undef Q4_STEP
#undef Q4_HALF
#undef Q4_FLUSH
#else
    for (int64_t b = 0; b < blocks; b++, panel += Q4P_RECORD) {
        const float *scale = (const float *)(panel + 512), *zero = scale + 16;
        for (int r = 0; r < I16_ROWS; r++) {
            const int8_t *xr = x + r * x_stride + b * QBLOCK;
            const float d = ds[r * ds_stride + 2 * b], s = ds[r * ds_stride + 2 * b + 1];
            for (int c = 0; c < 16; c++) {
                int32_t acc = 0;
                for (int e = 0; e < QBLOCK; e++)
                    acc += (int32_t)panel[(e / 4) * 64 + (c / 8) * 32 + (c % 8) * 4 + e % 4] * xr[e];
                sums[r * 16 + c] += (float)acc * (scale[c] * d) + zero[c] * s;
            }
        }
    }
#endif
}

#undef TILE_ROWS

/* y rows [6 * t, 6 * t + 6) x panel p of a tiled layer (LINEAR_I16 or LINEAR_Q4_PANELS): one
   tile, then the weight scale (LINEAR_I16) and the bias. q and d: the rounded input rows and
   their scales as the layer's quantize step wrote them. */
static void tile_out(const Linear *L, int64_t p, int64_t t, const void *q, const float *d,
                     int64_t n, float *y, int64_t y_stride) {
    const int64_t in = L->in, o = p * 16, i0 = t * I16_ROWS;
    const int64_t width = L->out - o < 16 ? L->out - o : 16, rows = n - i0 < I16_ROWS ? n - i0 : I16_ROWS;
    float sums[I16_ROWS * 16] __attribute__((aligned(32))) = {0};
    if (L->kind == LINEAR_Q4_PANELS) {
        const int64_t blocks = in / QBLOCK;
        tile_q4((const int8_t *)q + i0 * in, in, d + i0 * blocks * 2, blocks * 2,
                (const uint8_t *)L->weight + p * blocks * Q4P_RECORD, blocks, sums);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < width; c++)
                y[(i0 + r) * y_stride + o + c] = sums[r * 16 + c] + (L->bias != NULL ? L->bias[o + c] : 0.0f);
        return;
    }
    const int64_t blocks = in / I16_BLOCK;
    tile_i16((const int16_t *)q + i0 * in, in, d + i0 * blocks, blocks,
             (const int32_t *)L->weight + p * (in / 2) * 16, blocks, sums);
    const float *scale = (const float *)L->scale + o;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < width; c++)
            y[(i0 + r) * y_stride + o + c] = sums[r * 16 + c] * scale[c] + (L->bias != NULL ? L->bias[o + c] : 0.0f);
}

/* LINEAR_I16 and LINEAR_Q4_PANELS: round the input rows, then run 6-row tiles against 16-output
   panels. */
static int linear_tiled(const Linear *L, const float *x, int64_t x_stride, int64_t n, float *y,
                        int64_t y_stride, int threads) {
    const int q4 = L->kind == LINEAR_Q4_PANELS;
    const int64_t in = L->in, tiles = (n + I16_ROWS - 1) / I16_ROWS, padded = tiles * I16_ROWS;
    const int64_t row_bytes = q4 ? in : 2 * in, panel_bytes = q4 ? in / QBLOCK * Q4P_RECORD : 32 * in;
    void *q = malloc((size_t)(padded * row_bytes));
    float *d = malloc(sizeof(float) * (size_t)(padded * (q4 ? in / QBLOCK * 2 : in / I16_BLOCK)));
    if (q == NULL || d == NULL) {
        free(q);
        free(d);
        return 1;
    }
    round_rows(q4, x, x_stride, n, padded, in, q, d, threads);
    /* Work items: a chunk of row tiles against a chunk of panels, small enough that both stay in
       one core's L2 while the tiles run (the row tile in L1, the panels streaming from L2), and
       at least four per thread so that the threads finish together. */
    const int64_t panels = (L->out + 15) / 16;
    int64_t tile_chunk = I16_X_CHUNK / (I16_ROWS * row_bytes), panel_chunk = I16_W_CHUNK / panel_bytes;
    tile_chunk = tile_chunk < 1 ? 1 : tile_chunk;
    const int64_t row_chunks = (tiles + tile_chunk - 1) / tile_chunk;
    const int64_t balanced = row_chunks * panels / (4 * (int64_t)threads);
    panel_chunk = panel_chunk > balanced ? balanced : panel_chunk;
    panel_chunk = panel_chunk < 1 ? 1 : panel_chunk;
    const int64_t items = row_chunks * ((panels + panel_chunk - 1) / panel_chunk);
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1 && items > 1 && n * L->out >= 16384)
    for (int64_t item = 0; item < items; item++) {
        const int64_t p0 = item / row_chunks * panel_chunk, t0 = item % row_chunks * tile_chunk;
        const int64_t p1 = p0 + panel_chunk < panels ? p0 + panel_chunk : panels;
        const int64_t t1 = t0 + tile_chunk < tiles ? t0 + tile_chunk : tiles;
        for (int64_t t = t0; t < t1; t++)
            for (int64_t p = p0; p < p1; p++) tile_out(L, p, t, q, d, n, y, y_stride);
    }
    free(q);
    free(d);
    return 0;
}

/* y [n, out] (row stride y_stride) = x [n, in] (row stride x_stride) W^T + b. Quantized kinds
   need in % 32 == 0, LINEAR_I16 in % 64 == 0. Returns nonzero if out of memory. */
int linear_f32(const Linear *L, const float *x, int64_t x_stride, int64_t n, float *y,
               int64_t y_stride, int threads) {
    if (L->kind == LINEAR_I16 || L->kind == LINEAR_Q4_PANELS)
        return linear_tiled(L, x, x_stride, n, y, y_stride, threads);
    QuantRows qr = {NULL, NULL, NULL};
    if (L->kind == LINEAR_Q8 || L->kind == LINEAR_Q4) {
        const int64_t blocks = L->in / QBLOCK;
        qr.q = malloc((size_t)(n * L->in));
        qr.d = malloc(sizeof(float) * (size_t)(2 * n * blocks));
        if (qr.q == NULL || qr.d == NULL) {
            free(qr.q);
            free(qr.d);
            return 1;
        }
        qr.sum = qr.d + n * blocks;
        quantize_rows(x, x_stride, n, L->in, qr);
    }
    const int64_t tiles = (L->out + 3) / 4;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tiles >= 32)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t o = 4 * t, width = L->out - o < 4 ? L->out - o : 4;
        if (L->kind == LINEAR_Q8_FLOAT_INPUT) {
            for (int64_t r = 0; r < width; r++)
                for (int64_t i = 0; i < n; i++) y[i * y_stride + o + r] = row_q8_float(L, o + r, x + i * x_stride);
        } else if (L->kind == LINEAR_Q4) {
            for (int64_t r = 0; r < width; r++)
                for (int64_t i = 0; i < n; i++) y[i * y_stride + o + r] = quant_row(L, o + r, qr, i, 1);
        } else if (L->kind == LINEAR_Q8) {
            for (int64_t r = 0; r < width; r++)
                for (int64_t i = 0; i < n; i++) y[i * y_stride + o + r] = quant_row(L, o + r, qr, i, 0);
        } else if (width == 4) {
            for (int64_t i = 0; i < n; i++) {
                float sums[4];
                rows4_f32(L, o, x + i * x_stride, sums);
                for (int r = 0; r < 4; r++) y[i * y_stride + o + r] = sums[r];
            }
        } else { /* the last rows of a layer whose size is not a multiple of 4 */
            for (int64_t r = 0; r < width; r++) {
                const float *w = (const float *)L->weight + (o + r) * L->in;
                for (int64_t i = 0; i < n; i++) {
                    float sum = 0.0f;
                    for (int64_t d = 0; d < L->in; d++) sum += w[d] * x[i * x_stride + d];
                    y[i * y_stride + o + r] = sum;
                }
            }
        }
        if (L->bias != NULL)
            for (int64_t i = 0; i < n; i++)
                for (int64_t r = 0; r < width; r++) y[i * y_stride + o + r] += L->bias[o + r];
    }
    free(qr.q);
    free(qr.d);
    return 0;
}

/* out[i] = W[rows[i]] as float32 (an embedding lookup, or a slice for a dense GEMM). */
void dequantize_rows_f32(const Linear *L, const int64_t *rows, int64_t n, float *out, int threads) {
    const int64_t in = L->in, blocks = in / QBLOCK;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n * in >= 65536)
    for (int64_t i = 0; i < n; i++) {
        const int64_t row = rows[i];
        float *o = out + i * in;
        if (L->kind == LINEAR_F32) {
            memcpy(o, (const float *)L->weight + row * in, sizeof(float) * in);
            continue;
        }
        for (int64_t b = 0; b < blocks; b++) {
            const float scale = half_to_float(L->scale[row * blocks + b]);
            float *ob = o + b * QBLOCK;
            if (L->kind == LINEAR_Q4) {
                const uint8_t *q = (const uint8_t *)L->weight + row * (in / 2) + b * 16;
                const float zero = half_to_float(L->zero[row * blocks + b]);
                for (int j = 0; j < 16; j++) {
                    ob[j] = scale * (float)(q[j] & 0x0F) + zero;
                    ob[j + 16] = scale * (float)(q[j] >> 4) + zero;
                }
            } else {
                const int8_t *q = (const int8_t *)L->weight + row * in + b * QBLOCK;
                for (int j = 0; j < QBLOCK; j++) ob[j] = scale * (float)q[j];
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------------
   A whole decode step of a Llama/Qwen2/Qwen3 decoder in one call: few rows, one token each.
   In torch a batch-1 step is ~300 small ops whose dispatch costs more than their arithmetic;
   here it is the weight reads plus a few microseconds per layer.
   ------------------------------------------------------------------------------------------ */

typedef struct {
    Linear qkv, o, gate_up, down;
    const float *input_norm, *post_norm;
    const float *q_norm, *k_norm; /* Qwen3's per-head norms, or NULL */
    void *k_cache, *v_cache;      /* [num_blocks, block_size, kv_heads, head_dim] */
} DecoderLayer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    const float *rope; /* [max_position, 2, head_dim], as rotary_f32 reads it */
    const float *final_norm;
    const DecoderLayer *layers;
    int64_t cache_half; /* the caches hold float16 */
} Decoder;

/* hidden [n, hidden]: the tokens' embeddings in, the final normed hidden states out. Token i
   is at positions[i], its K/V go to slots[i], and it attends to context_lens[i] positions
   through block_tables[i] (row width `width`). Returns nonzero if out of memory. */
int decode_step_f32(const Decoder *m, float *hidden, int64_t n, const int64_t *positions,
                    const int64_t *slots, const int64_t *block_tables, int64_t width,
                    const int64_t *context_lens, int threads) {
    const int64_t h = m->hidden, hd = m->head_dim, q_size = m->heads * hd;
    const int64_t kv_size = m->kv_heads * hd, qkv_size = q_size + 2 * kv_size;
    const int64_t inter = m->intermediate;
    const int64_t floats = n * (2 * h + qkv_size + q_size + 3 * inter);
    float *residual = malloc(sizeof(float) * (size_t)floats);
    if (residual == NULL) return 1;
    float *normed = residual + n * h, *qkv = normed + n * h, *attn = qkv + n * qkv_size;
    float *gate_up = attn + n * q_size, *act = gate_up + n * 2 * inter;
    int failed = 0;
    for (int64_t l = 0; l < m->num_layers && !failed; l++) {
        const DecoderLayer *layer = m->layers + l;
        if (l == 0) {
            memcpy(residual, hidden, sizeof(float) * (size_t)(n * h));
            rms_norm_f32(hidden, h, NULL, 0, layer->input_norm, n, 1, h, m->eps, normed, h, threads);
        } else {
            rms_norm_f32(hidden, h, residual, h, layer->input_norm, n, 1, h, m->eps, normed, h, threads);
        }
        failed |= linear_f32(&layer->qkv, normed, h, n, qkv, qkv_size, threads);
        if (layer->q_norm != NULL) {
            rms_norm_f32(qkv, qkv_size, NULL, 0, layer->q_norm, n * m->heads, m->heads, hd, m->eps,
                         qkv, qkv_size, threads);
            rms_norm_f32(qkv + q_size, qkv_size, NULL, 0, layer->k_norm, n * m->kv_heads,
                         m->kv_heads, hd, m->eps, qkv + q_size, qkv_size, threads);
        }
        rotary_f32(qkv, qkv_size, n, m->heads + m->kv_heads, hd, m->rope, positions, threads);
        store_kv_f32(qkv + q_size, qkv_size, qkv + q_size + kv_size, qkv_size, slots, n, kv_size,
                     layer->k_cache, layer->v_cache, (int)m->cache_half);
        failed |= paged_decode_f32(qkv, qkv_size, layer->k_cache, layer->v_cache, block_tables,
                                   context_lens, n, width, m->heads, m->kv_heads, hd,
                                   m->block_size, m->scale, attn, q_size, (int)m->cache_half,
                                   threads);
        failed |= linear_f32(&layer->o, attn, q_size, n, hidden, h, threads);
        rms_norm_f32(hidden, h, residual, h, layer->post_norm, n, 1, h, m->eps, normed, h, threads);
        failed |= linear_f32(&layer->gate_up, normed, h, n, gate_up, 2 * inter, threads);
        silu_mul_f32(gate_up, n, inter, act, threads);
        failed |= linear_f32(&layer->down, act, inter, n, hidden, h, threads);
    }
    rms_norm_f32(hidden, h, residual, h, m->final_norm, n, 1, h, m->eps, hidden, h, threads);
    free(residual);
    return failed;
}
