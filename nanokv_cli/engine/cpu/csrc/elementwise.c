/* Row-wise element kernels: RMSNorm (with the residual add), rotary, the K/V store, silu * up. */
#include "kernels.h"

int cache_half_supported(void) {
#ifdef __F16C__
    return 1;
#else
    return 0;
#endif
}

typedef struct {
    const float *x, *w;
    float *residual, *out;
    int64_t x_stride, residual_stride, out_stride, inner, dim;
    float eps;
} NormJob;

static void norm_rows(void *arg, int64_t begin, int64_t end) {
    const NormJob *j = arg;
    const int64_t dim = j->dim, inner = j->inner;
    for (int64_t r = begin; r < end; r++) {
        const float *xr = ROW(j->x, r, inner, j->x_stride, dim);
        float *orow = ROW(j->out, r, inner, j->out_stride, dim);
        const float *src = xr;
        if (j->residual != NULL) {
            float *res = ROW(j->residual, r, inner, j->residual_stride, dim);
            #pragma omp simd
            for (int64_t d = 0; d < dim; d++) res[d] = xr[d] + res[d];
            src = res;
        }
        float squares = 0.0f;
        #pragma omp simd reduction(+:squares)
        for (int64_t d = 0; d < dim; d++) squares += src[d] * src[d];
        const float inv = 1.0f / sqrtf(squares / (float)dim + j->eps);
        #pragma omp simd
        for (int64_t d = 0; d < dim; d++) orow[d] = j->w[d] * (src[d] * inv);
    }
}

/* RMSNorm over rows of dim, optionally after a residual add:
   with residual: residual[r] += x[r], out[r] = norm(residual[r]) * w; else out[r] = norm(x[r]) * w.
   Rows are addressed as [outer, inner, dim] (inner = heads for per-head norms, else 1);
   out may be x. Sum of squares in float32, as torch's mean. */
void rms_norm_f32(const float *x, int64_t x_stride, float *residual, int64_t residual_stride,
                  const float *w, int64_t rows, int64_t inner, int64_t dim, float eps,
                  float *out, int64_t out_stride, int threads) {
    NormJob job = {x, w, residual, out, x_stride, residual_stride, out_stride, inner, dim, eps};
    run_rows(rows, rows * dim, threads, norm_rows, &job);
}

typedef struct {
    float *x;
    const float *table;
    const int64_t *positions;
    int64_t x_stride, heads, dim;
} RotaryJob;

static void rotary_rows(void *arg, int64_t begin, int64_t end) {
    const RotaryJob *j = arg;
    const int64_t dim = j->dim, half = dim / 2;
    for (int64_t i = begin; i < end; i++) {
        const float *cs = j->table + j->positions[i] * 2 * dim, *sn = cs + dim;
        for (int64_t h = 0; h < j->heads; h++) {
            float *v = j->x + i * j->x_stride + h * dim;
            #pragma omp simd
            for (int64_t d = 0; d < half; d++) {
                const float x1 = v[d], x2 = v[d + half];
                v[d] = x1 * cs[d] + x2 * sn[d];
                v[d + half] = x2 * cs[d + half] + x1 * sn[d + half];
            }
        }
    }
}

/* Rotary embedding in place on x [n, heads, dim] (token stride x_stride, heads contiguous),
   half-split layout: table[pos] = [cos duplicated | sin with the first half negated]. */
void rotary_f32(float *x, int64_t x_stride, int64_t n, int64_t heads, int64_t dim,
                const float *table, const int64_t *positions, int threads) {
    RotaryJob job = {x, table, positions, x_stride, heads, dim};
    run_rows(n, n * heads * dim, threads, rotary_rows, &job);
}

typedef struct {
    const float *k, *v;
    int64_t k_stride, v_stride;
    const int64_t *slots;
    int64_t row;
    void *k_cache, *v_cache;
    int half;
} StoreJob;

#ifdef __F16C__
/* dst[d] = src[d] rounded to the nearest float16, d < row */
static void store_half(uint16_t *dst, const float *src, int64_t row) {
    int64_t d = 0;
    for (; d + 8 <= row; d += 8)
        _mm_storeu_si128((__m128i *)(dst + d), _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT));
    for (; d < row; d++) dst[d] = _cvtss_sh(src[d], _MM_FROUND_TO_NEAREST_INT);
}
#endif

static void store_rows(void *arg, int64_t begin, int64_t end) {
    const StoreJob *j = arg;
    const int64_t row = j->row;
    for (int64_t i = begin; i < end; i++) {
        const float *k = j->k + i * j->k_stride, *v = j->v + i * j->v_stride;
        if (!j->half) {
            memcpy((float *)j->k_cache + j->slots[i] * row, k, sizeof(float) * row);
            memcpy((float *)j->v_cache + j->slots[i] * row, v, sizeof(float) * row);
            continue;
        }
#ifdef __F16C__
        store_half((uint16_t *)j->k_cache + j->slots[i] * row, k, row);
        store_half((uint16_t *)j->v_cache + j->slots[i] * row, v, row);
#endif
    }
}

/* k_cache[slots[i]] = k[i], v_cache[slots[i]] = v[i]; rows of `row` floats, token strides given;
   a float16 cache (half != 0, F16C builds only) stores them rounded to nearest. */
void store_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                  const int64_t *slots, int64_t n, int64_t row, void *k_cache, void *v_cache,
                  int half, int threads) {
    StoreJob job = {k, v, k_stride, v_stride, slots, row, k_cache, v_cache, half};
    run_rows(n, n * row, threads, store_rows, &job);
}

typedef struct {
    const float *x;
    float *out;
    int64_t inter;
} SiluJob;

static void silu_rows(void *arg, int64_t begin, int64_t end) {
    const SiluJob *j = arg;
    const int64_t inter = j->inter;
    for (int64_t i = begin; i < end; i++) {
        const float *gate = j->x + i * 2 * inter, *up = gate + inter;
        float *o = j->out + i * inter;
        #pragma omp simd
        for (int64_t d = 0; d < inter; d++) o[d] = gate[d] / (1.0f + exp_any(-gate[d])) * up[d];
    }
}

/* out[i] = silu(x[i, :inter]) * x[i, inter:], x [n, 2 * inter] contiguous, out [n, inter]. */
void silu_mul_f32(const float *x, int64_t n, int64_t inter, float *out, int threads) {
    SiluJob job = {x, out, inter};
    run_rows(n, n * inter, threads, silu_rows, &job);
}
