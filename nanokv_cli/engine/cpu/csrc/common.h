/* Shared by every C file: includes, float16 conversion, the KV cache's element loads, the exp
   used by silu and softmax, and the thread pool's interface (kernels.h adds the kernels'; the
   pool builds without them). Each file is compiled once per instruction-set variant (see
   cpu/build.py); ISA-specific code sits behind the compiler's feature macros (__AVX2__,
   __AVX512F__, ...), generic C everywhere else. */
#ifndef NANOKV_COMMON_H
#define NANOKV_COMMON_H
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
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
#ifdef __AVX512F__
static inline __attribute__((always_inline)) __m512 cache_load16(const void *base, int64_t index, int half) {
    if (half) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index)));
    return _mm512_loadu_ps((const float *)base + index);
}
#endif


#ifdef __AVX2__
/* The 32 floats of an input block loaded into v[0..3], and their largest magnitude: the first
   step of every input rounding (q4.c's int8, panels.c's int16). */
static inline __attribute__((always_inline)) float load32_amax(const float *x, __m256 v[4]) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax8 = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(x + 8 * j);
        amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}
#endif

/* A packed layer is read front to back, once per step (a 1-row product is one stream through
   it), and the hardware prefetcher alone keeps too few of its lines in flight: a 283 MB Q4
   product read 7.9-9.0 GB/s at one thread on a Xeon whose core reads 12-15 GB/s, 10-11.6 with
   a look-ahead of 2 KB and 11.7-13.8 with 4 KB (8 KB: no better; scripts/BENCHMARKS.md). Each
   tile asks for the lines PACKED_AHEAD bytes past the record it starts; past a panel's end
   that is the next panel, the next one it reads. Into L2, not L1: asked into L1, the
   look-ahead made a 1.47 MB layer already in L2 take 1.6x as long (109 against 68 us), its
   requests holding the fill buffers the loads need. A prefetch never faults: the look-ahead
   past a layer's end is harmless. */
#define PACKED_AHEAD 4096
#define PACKED_STRINGIFY(x) #x
#define PACKED_STRING(x) PACKED_STRINGIFY(x)
#define PACKED_AHEAD_ASM PACKED_STRING(PACKED_AHEAD) /* the same, for the AVX2 tiles' assembly */
static inline __attribute__((always_inline)) void prefetch_ahead(const void *record, int bytes) {
    for (int line = 0; line < bytes; line += 64) __builtin_prefetch((const char *)record + PACKED_AHEAD + line, 0, 2);
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

/* The thread pool (pool.c): fn(ctx, i) for each i < items, on the caller and up to threads - 1
   helpers, whichever claims i first; returns when all have run. */
typedef void (*task_fn)(void *ctx, int64_t item);
void run_tasks(int64_t items, int threads, task_fn fn, void *ctx);

/* Row loops (pool.c): fn(ctx, begin, end) over ranges that cover rows [0, rows). One range (the
   caller alone) below ~64k elements of work, where a job costs more than it saves; else four
   per thread, so that a thread held up by another process delays only a part. */
typedef void (*rows_fn)(void *ctx, int64_t begin, int64_t end);
void run_rows(int64_t rows, int64_t work, int threads, rows_fn fn, void *ctx);

#endif
