#include "common.h"

/* ---------------------------------------------------------------------------------------------
   The linear layers' entry points, y = x W^T + b, and LINEAR_F32: float32 weights [out][in] for
   a few rows (cpu/formats.py, FloatLinear), as float models' decode steps have.

   A decode step at batch 1 streams every weight once and does little arithmetic on it, so its
   speed is the bytes read per token plus whatever runs between the reads: four output rows at
   a time against one input row, two accumulators each. Batches of float32 rows go to torch's
   GEMM (see cpu/formats.py, F32_FUSED_MAX_ROWS); the packed formats (q4.c, q8.c) serve every
   row count themselves.
   ------------------------------------------------------------------------------------------ */

#ifdef __AVX2__
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#ifndef PF
#define PF 128
#endif
/* Four output rows o..o+3 of one input row: out[r] = W[o + r] . x (no bias). */
static inline __attribute__((always_inline)) void rows4_f32(const Linear *L, int64_t o,
                                                             const float *x, float out[4]) {
    const int64_t in = L->in;
    const float *w = (const float *)L->weight + o * in;
    int64_t d = 0;
    for (int r = 0; r < 4; r++) out[r] = 0.0f;
#ifdef __AVX2__
    __m256 a[4], b[4]; /* two chains per output row */
    for (int r = 0; r < 4; r++) a[r] = b[r] = _mm256_setzero_ps();
    for (; d + 16 <= in; d += 16) {
        for (int r = 0; r < 4; r++) _mm_prefetch((const char *)(w + r * in + d + PF), _MM_HINT_T0);
        const __m256 x0 = _mm256_loadu_ps(x + d), x1 = _mm256_loadu_ps(x + d + 8);
        for (int r = 0; r < 4; r++) a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * in + d), x0, a[r]);
        for (int r = 0; r < 4; r++) b[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * in + d + 8), x1, b[r]);
    }
    for (int r = 0; r < 4; r++) out[r] = hsum8(_mm256_add_ps(a[r], b[r]));
#endif
    for (; d < in; d++)
        for (int r = 0; r < 4; r++) out[r] += w[r * in + d] * x[d];
}

typedef struct {
    const Linear *L;
    const float *x;
    float *y;
    int64_t x_stride, y_stride, n;
} F32Job;

/* Outputs 4t..4t+3 for every row. */
static void f32_tile(void *arg, int64_t t) {
    const F32Job *j = arg;
    const Linear *L = j->L;
    const int64_t o = 4 * t, width = L->out - o < 4 ? L->out - o : 4, n = j->n;
    const float *x = j->x;
    float *y = j->y;
    if (width == 4) {
        for (int64_t i = 0; i < n; i++) {
            float sums[4];
            rows4_f32(L, o, x + i * j->x_stride, sums);
            for (int r = 0; r < 4; r++) y[i * j->y_stride + o + r] = sums[r];
        }
    } else { /* the last rows of a layer whose size is not a multiple of 4 */
        for (int64_t r = 0; r < width; r++) {
            const float *w = (const float *)L->weight + (o + r) * L->in;
            for (int64_t i = 0; i < n; i++) {
                float sum = 0.0f;
                for (int64_t d = 0; d < L->in; d++) sum += w[d] * x[i * j->x_stride + d];
                y[i * j->y_stride + o + r] = sum;
            }
        }
    }
    if (L->bias != NULL)
        for (int64_t i = 0; i < n; i++)
            for (int64_t r = 0; r < width; r++) y[i * j->y_stride + o + r] += L->bias[o + r];
}

/* y [n, out] (row stride y_stride) = x [n, in] (row stride x_stride) W^T + b. Packed kinds need
   in % 32 == 0. Returns nonzero if out of memory. */
int linear_f32(const Linear *L, const float *x, int64_t x_stride, int64_t n, float *y,
               int64_t y_stride, int exact_inputs, int threads) {
    if (L->kind == LINEAR_Q4P) return q4p_linear(L, x, x_stride, n, y, y_stride, exact_inputs, threads);
    if (L->kind == LINEAR_Q8P) return q8p_linear(L, x, x_stride, n, y, y_stride, threads);
    F32Job job = {L, x, y, x_stride, y_stride, n};
    const int64_t tiles = (L->out + 3) / 4;
    run_tasks(tiles, tiles >= 32 ? threads : 1, f32_tile, &job);
    return 0;
}

typedef struct {
    const Linear *L;
    const int64_t *rows;
    float *out;
} DequantizeJob;

static void dequantize_part(void *arg, int64_t begin, int64_t end) {
    const DequantizeJob *j = arg;
    const Linear *L = j->L;
    for (int64_t i = begin; i < end; i++) {
        float *out = j->out + i * L->in;
        if (L->kind == LINEAR_Q4P) q4p_dequantize_row(L, j->rows[i], out);
        else if (L->kind == LINEAR_Q8P) q8p_dequantize_row(L, j->rows[i], out);
        else memcpy(out, (const float *)L->weight + j->rows[i] * L->in, sizeof(float) * (size_t)L->in);
    }
}

/* out[i] = W[rows[i]] as float32 (an embedding lookup, or a slice for a dense GEMM). */
void dequantize_rows_f32(const Linear *L, const int64_t *rows, int64_t n, float *out, int threads) {
    DequantizeJob job = {L, rows, out};
    run_rows(n, n * L->in, threads, dequantize_part, &job);
}
