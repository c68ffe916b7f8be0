#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

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

/* k_cache[slots[i]] = k[i], v_cache[slots[i]] = v[i]; rows of `row` floats, token strides given. */
void store_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                  const int64_t *slots, int64_t n, int64_t row, float *k_cache, float *v_cache) {
    for (int64_t i = 0; i < n; i++) {
        memcpy(k_cache + slots[i] * row, k + i * k_stride, sizeof(float) * row);
        memcpy(v_cache + slots[i] * row, v + i * v_stride, sizeof(float) * row);
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

/* scores[t] = scale * (q . k_t), k_t = k + t * stride, t < m */
static void key_scores(const float *q, const float *k, int64_t stride, int64_t m, int64_t dim,
                       float scale, float *scores) {
    int64_t t = 0;
#ifdef __AVX2__
    if (dim % 8 == 0) {
        const __m256 vscale = _mm256_set1_ps(scale);
        for (; t + 8 <= m; t += 8) {
            const float *k0 = k + t * stride;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            __m256 a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (int64_t d = 0; d < dim; d += 8) {
                const __m256 qv = _mm256_loadu_ps(q + d);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + stride + d), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * stride + d), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * stride + d), a3);
                a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 4 * stride + d), a4);
                a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 5 * stride + d), a5);
                a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 6 * stride + d), a6);
                a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 7 * stride + d), a7);
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
        const float *kt = k + t * stride;
        float s = 0.0f;
        for (int64_t d = 0; d < dim; d++) s += q[d] * kt[d];
        scores[t] = s * scale;
    }
}

/* acc[d] += sum_t p[t] * v_t[d], v_t = v + t * stride, t < m */
static void weighted_values(const float *p, const float *v, int64_t stride, int64_t m,
                            int64_t dim, float *acc) {
    int64_t d0 = 0;
#ifdef __AVX2__
    for (; d0 + 64 <= dim; d0 += 64) {
        float *a = acc + d0;
        __m256 a0 = _mm256_loadu_ps(a), a1 = _mm256_loadu_ps(a + 8);
        __m256 a2 = _mm256_loadu_ps(a + 16), a3 = _mm256_loadu_ps(a + 24);
        __m256 a4 = _mm256_loadu_ps(a + 32), a5 = _mm256_loadu_ps(a + 40);
        __m256 a6 = _mm256_loadu_ps(a + 48), a7 = _mm256_loadu_ps(a + 56);
        for (int64_t t = 0; t < m; t++) {
            const float *vt = v + t * stride + d0;
            const __m256 pt = _mm256_set1_ps(p[t]);
            a0 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt), a0);
            a1 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 8), a1);
            a2 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 16), a2);
            a3 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 24), a3);
            a4 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 32), a4);
            a5 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 40), a5);
            a6 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 48), a6);
            a7 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 56), a7);
        }
        _mm256_storeu_ps(a, a0); _mm256_storeu_ps(a + 8, a1);
        _mm256_storeu_ps(a + 16, a2); _mm256_storeu_ps(a + 24, a3);
        _mm256_storeu_ps(a + 32, a4); _mm256_storeu_ps(a + 40, a5);
        _mm256_storeu_ps(a + 48, a6); _mm256_storeu_ps(a + 56, a7);
    }
#endif
    for (int64_t t = 0; t < m; t++) {
        const float *vt = v + t * stride;
        const float pt = p[t];
        for (int64_t d = d0; d < dim; d++) acc[d] += pt * vt[d];
    }
}

/* One query token per sequence: q [n, heads, dim] (token stride q_stride), caches
   [num_blocks, block_size, kv_heads, dim], block_tables [n, width], out [n, heads, dim]
   (token stride out_stride). Sequence i attends to its first context_lens[i] positions. */
int paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache,
                     const float *v_cache, const int64_t *block_tables,
                     const int64_t *context_lens, int64_t n, int64_t width, int64_t heads,
                     int64_t kv_heads, int64_t dim, int64_t block_size, float scale,
                     float *out, int64_t out_stride, int threads) {
    /* One work item per (sequence, KV head): the query heads sharing that KV head (GQA) take
       each cache block in turn while it is in cache, so K and V come from memory once per
       KV head, not once per query head. */
    const int64_t group = heads / kv_heads, slot = kv_heads * dim;
    int64_t max_len = 0;
    for (int64_t i = 0; i < n; i++) max_len = context_lens[i] > max_len ? context_lens[i] : max_len;
    const int64_t row = max_len + 8;
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (threads > 1 && n * kv_heads > 1)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * row));
        if (scores == NULL) {
            failed = 1;
        } else {
            #pragma omp for schedule(dynamic, 2)
            for (int64_t item = 0; item < n * kv_heads; item++) {
                const int64_t i = item / kv_heads, h = item % kv_heads;
                const int64_t len = context_lens[i];
                const int64_t *table = block_tables + i * width;
                const float *qi = q + i * q_stride + h * group * dim;
                float *oi = out + i * out_stride + h * group * dim;
                for (int64_t t0 = 0; t0 < len; t0 += block_size) {
                    const int64_t m = len - t0 < block_size ? len - t0 : block_size;
                    const float *k = k_cache + (table[t0 / block_size] * block_size * kv_heads + h) * dim;
                    for (int64_t g = 0; g < group; g++)
                        key_scores(qi + g * dim, k, slot, m, dim, scale, scores + g * row + t0);
                }
                float totals[group];
                for (int64_t g = 0; g < group; g++) {
                    float *sg = scores + g * row, top = -INFINITY, total = 0.0f;
                    for (int64_t t = 0; t < len; t++) top = sg[t] > top ? sg[t] : top;
                    #pragma omp simd reduction(+:total)
                    for (int64_t t = 0; t < len; t++) {
                        sg[t] = exp_clamped(sg[t] - top);
                        total += sg[t];
                    }
                    totals[g] = total;
                }
                memset(oi, 0, sizeof(float) * (size_t)(group * dim));
                for (int64_t t0 = 0; t0 < len; t0 += block_size) {
                    const int64_t m = len - t0 < block_size ? len - t0 : block_size;
                    const float *v = v_cache + (table[t0 / block_size] * block_size * kv_heads + h) * dim;
                    for (int64_t g = 0; g < group; g++)
                        weighted_values(scores + g * row + t0, v, slot, m, dim, oi + g * dim);
                }
                for (int64_t g = 0; g < group; g++) {
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
   so the inner loop is integer multiply-adds: 32 products per AVX2 instruction.
   ------------------------------------------------------------------------------------------ */

enum { LINEAR_F32 = 0, LINEAR_Q8 = 1, LINEAR_Q4 = 2, LINEAR_Q8_FLOAT_INPUT = 3 };
#define QBLOCK 32

typedef struct {
    int64_t kind, out, in;
    const void *weight;
    const uint16_t *scale; /* quantized: float16 [out][in / 32] */
    const uint16_t *zero;  /* LINEAR_Q4: float16 [out][in / 32] */
    const float *bias;  /* [out] or NULL */
} Linear;

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

/* Input rows quantized per 32-block: q = round(x / d), d = max|x| / 127; sum = d * sum(q). */
typedef struct {
    int8_t *q;
    float *d, *sum;
} QuantRows;

static void quantize_rows(const float *x, int64_t x_stride, int64_t n, int64_t in, QuantRows qr) {
    const int64_t blocks = in / QBLOCK;
    for (int64_t i = 0; i < n; i++) {
        for (int64_t b = 0; b < blocks; b++) {
            const float *xb = x + i * x_stride + b * QBLOCK;
            int8_t *qb = qr.q + i * in + b * QBLOCK;
            float amax = 0.0f;
            for (int j = 0; j < QBLOCK; j++) amax = fmaxf(amax, fabsf(xb[j]));
            const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
            int total = 0;
            for (int j = 0; j < QBLOCK; j++) {
                const int q = (int)nearbyintf(xb[j] * id);
                qb[j] = (int8_t)q;
                total += q;
            }
            qr.d[i * blocks + b] = d;
            qr.sum[i * blocks + b] = d * (float)total;
        }
    }
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

/* y [n, out] (row stride y_stride) = x [n, in] (row stride x_stride) W^T + b. Quantized kinds
   need in % 32 == 0. Returns nonzero if out of memory. */
int linear_f32(const Linear *L, const float *x, int64_t x_stride, int64_t n, float *y,
               int64_t y_stride, int threads) {
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
    float *k_cache, *v_cache;     /* [num_blocks, block_size, kv_heads, head_dim] */
} DecoderLayer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    const float *rope; /* [max_position, 2, head_dim], as rotary_f32 reads it */
    const float *final_norm;
    const DecoderLayer *layers;
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
                     layer->k_cache, layer->v_cache);
        failed |= paged_decode_f32(qkv, qkv_size, layer->k_cache, layer->v_cache, block_tables,
                                   context_lens, n, width, m->heads, m->kv_heads, hd,
                                   m->block_size, m->scale, attn, q_size, threads);
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
