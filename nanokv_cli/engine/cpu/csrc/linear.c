#include "kernels.h"

/* ---------------------------------------------------------------------------------------------
   The linear layers' entry points, y = x W^T + b, and LINEAR_F32: float32 weights [out][in]
   (cpu/formats.py, FloatLinear), for every row count, from a decode step's one row to a prompt.

   One arithmetic per output, whatever the batch: F32_LANES partial sums over the inputs (lane l
   takes inputs l, l + F32_LANES, ...), each a chain of multiply-adds in input order, then one
   fixed tree over the lanes (lane_sum), then the inputs past the last full vector one by one,
   then the bias. Tiles of up to F32_TILE_ROWS rows by F32_TILE_OUTS outputs run that for each
   of their (row, output) pairs, so a row's result does not depend on the rows it shares a
   batch with, nor on where the tiles fall: a token gets the same bits in a decode step, in a
   prompt chunk or in a recompute after preemption, as the packed formats do (q4.c, q8.c).
   torch's GEMM (MKL) gave other bits for 1-3 rows than for more, and the C product of a few
   rows other bits again.

   A tile loads each of its rows' next vector once for all its outputs and each output's once
   for all its rows. 1-row products (decode at batch 1) stream the layer from memory, so they
   prefetch each output's row a few lines ahead. Work items are a chunk of row tiles against a
   chunk of outputs whose weights stay in L2 while the row tiles pass.
   ------------------------------------------------------------------------------------------ */

#if defined(__AVX512F__)
#define F32_LANES 16
#define F32_TILE_ROWS 4
#define F32_TILE_OUTS 6
typedef __m512 f32_vec;
#define F32_ZERO() _mm512_setzero_ps()
#define F32_LOAD(p) _mm512_loadu_ps(p)
#define F32_FMA(w, x, acc) _mm512_fmadd_ps(w, x, acc)
#elif defined(__AVX2__) && defined(__FMA__)
#define F32_LANES 8
#define F32_TILE_ROWS 3
#define F32_TILE_OUTS 4
typedef __m256 f32_vec;
#define F32_ZERO() _mm256_setzero_ps()
#define F32_LOAD(p) _mm256_loadu_ps(p)
#define F32_FMA(w, x, acc) _mm256_fmadd_ps(w, x, acc)
#else /* plain C: four lanes in the compiler's vectors (SSE2 on x86-64), multiplied and added */
#define F32_LANES 4
#define F32_TILE_ROWS 3
#define F32_TILE_OUTS 4
typedef float f32_vec __attribute__((vector_size(16)));
static inline f32_vec F32_ZERO(void) { return (f32_vec){0}; }
static inline f32_vec F32_LOAD(const float *p) {
    f32_vec a;
    memcpy(&a, p, sizeof a);
    return a;
}
#define F32_FMA(w, x, acc) ((acc) + (w) * (x))
#endif

/* The lanes' sum, in one fixed order: halves added until one lane is left. */
static inline float lane_sum(f32_vec a) {
#if defined(__AVX512F__)
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 h = a;
#endif
#if defined(__AVX2__) && defined(__FMA__)
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
#else
    return (a[0] + a[2]) + (a[1] + a[3]);
#endif
}

#ifndef PF
#define PF 128 /* floats ahead that a 1-row product prefetches (512 bytes) */
#endif
/* y rows 0..R-1, outputs o..o+O-1 = x rows 0..R-1 (x_stride apart) W^T + b. R and O are
   constants where it is inlined. */
static inline __attribute__((always_inline)) void f32_tile(const Linear *L, const float *x,
        int64_t x_stride, int R, int64_t o, int O, float *y, int64_t y_stride) {
    const int64_t in = L->in, full = in - in % F32_LANES;
    const float *w = (const float *)L->weight + o * in;
    f32_vec acc[F32_TILE_ROWS][F32_TILE_OUTS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < O; c++) acc[r][c] = F32_ZERO();
    for (int64_t d = 0; d < full; d += F32_LANES) {
        f32_vec xv[F32_TILE_ROWS];
        for (int r = 0; r < R; r++) xv[r] = F32_LOAD(x + r * x_stride + d);
        for (int c = 0; c < O; c++) {
#ifdef __AVX2__
            if (R == 1 && d % 16 == 0) _mm_prefetch((const char *)(w + c * in + d + PF), _MM_HINT_T0);
#endif
            const f32_vec wv = F32_LOAD(w + c * in + d);
            for (int r = 0; r < R; r++) acc[r][c] = F32_FMA(wv, xv[r], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < O; c++) {
            float sum = lane_sum(acc[r][c]);
            for (int64_t d = full; d < in; d++) sum += w[c * in + d] * x[r * x_stride + d];
            if (L->bias != NULL) sum += L->bias[o + c];
            y[r * y_stride + o + c] = sum;
        }
}

/* Rows i..i+R-1 (R <= F32_TILE_ROWS) times outputs o..o+O-1 (O <= F32_TILE_OUTS). */
static void f32_tile_any(const Linear *L, const float *x, int64_t x_stride, int R, int64_t o,
                         int O, float *y, int64_t y_stride) {
#define F32_CASE(RR, OO) \
    case (RR) * 16 + (OO): f32_tile(L, x, x_stride, RR, o, OO, y, y_stride); break;
#define F32_ROW_CASES(RR) F32_CASE(RR, 1) F32_CASE(RR, 2) F32_CASE(RR, 3) F32_CASE(RR, 4) F32_OUTS_56(RR)
#if F32_TILE_OUTS == 6
#define F32_OUTS_56(RR) F32_CASE(RR, 5) F32_CASE(RR, 6)
#else
#define F32_OUTS_56(RR)
#endif
    switch (R * 16 + O) {
    F32_ROW_CASES(1)
    F32_ROW_CASES(2)
    F32_ROW_CASES(3)
#if F32_TILE_ROWS == 4
    F32_ROW_CASES(4)
#endif
    default: break;
    }
#undef F32_CASE
#undef F32_ROW_CASES
#undef F32_OUTS_56
}

typedef struct {
    const Linear *L;
    const float *x;
    float *y;
    int64_t x_stride, y_stride, n;
    int64_t out_chunk, row_chunk, out_chunks; /* an item: row_chunk rows x out_chunk outputs */
} F32Job;

#define F32_W_CHUNK (128 * 1024) /* bytes of weights an item keeps in L2 */
#define F32_X_CHUNK (64 * 1024)  /* bytes of input rows an item passes over them */

static void f32_item(void *arg, int64_t item) {
    const F32Job *j = arg;
    const Linear *L = j->L;
    const int64_t o0 = item % j->out_chunks * j->out_chunk, i0 = item / j->out_chunks * j->row_chunk;
    const int64_t o1 = o0 + j->out_chunk < L->out ? o0 + j->out_chunk : L->out;
    const int64_t i1 = i0 + j->row_chunk < j->n ? i0 + j->row_chunk : j->n;
    for (int64_t o = o0; o < o1; o += F32_TILE_OUTS) {
        const int O = (int)(o1 - o < F32_TILE_OUTS ? o1 - o : F32_TILE_OUTS);
        for (int64_t i = i0; i < i1; i += F32_TILE_ROWS) {
            const int R = (int)(i1 - i < F32_TILE_ROWS ? i1 - i : F32_TILE_ROWS);
            f32_tile_any(L, j->x + i * j->x_stride, j->x_stride, R, o, O, j->y + i * j->y_stride, j->y_stride);
        }
    }
}

static void linear_f32_rows(const Linear *L, const float *x, int64_t x_stride, int64_t n, float *y,
                            int64_t y_stride, int threads) {
    const int64_t row_bytes = 4 * L->in;
    int64_t out_chunk = F32_W_CHUNK / row_bytes / F32_TILE_OUTS * F32_TILE_OUTS;
    int64_t row_chunk = F32_X_CHUNK / row_bytes / F32_TILE_ROWS * F32_TILE_ROWS;
    out_chunk = out_chunk < F32_TILE_OUTS ? F32_TILE_OUTS : out_chunk;
    row_chunk = row_chunk < F32_TILE_ROWS ? F32_TILE_ROWS : row_chunk;
    const int64_t row_chunks = (n + row_chunk - 1) / row_chunk;
    /* at least four items per thread where the outputs allow it, so the threads end together */
    const int64_t balanced = (L->out * row_chunks / (4 * (int64_t)threads)) / F32_TILE_OUTS * F32_TILE_OUTS;
    if (out_chunk > balanced) out_chunk = balanced < F32_TILE_OUTS ? F32_TILE_OUTS : balanced;
    const int64_t out_chunks = (L->out + out_chunk - 1) / out_chunk;
    F32Job job = {L, x, y, x_stride, y_stride, n, out_chunk, row_chunk, out_chunks};
    const int parallel = n * L->out * L->in >= (1 << 18) ? threads : 1;
    run_tasks(row_chunks * out_chunks, parallel, f32_item, &job);
}

/* y [n, out] (row stride y_stride) = x [n, in] (row stride x_stride) W^T + b. Packed kinds need
   in % 32 == 0. Returns nonzero if out of memory. */
int linear_f32(const Linear *L, const float *x, int64_t x_stride, int64_t n, float *y,
               int64_t y_stride, int threads) {
    if (L->kind == LINEAR_Q4P) return q4p_linear(L, x, x_stride, n, y, y_stride, threads);
    if (L->kind == LINEAR_Q8P) return q8p_linear(L, x, x_stride, n, y, y_stride, threads);
    linear_f32_rows(L, x, x_stride, n, y, y_stride, threads);
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
