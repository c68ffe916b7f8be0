#include "kernels.h"

/* ---------------------------------------------------------------------------------------------
   The tiled product both packed formats run (LINEAR_Q4P in q4.c, LINEAR_Q8P in q8.c), and the
   16-bit input rounding they share.

   Input rows are rounded once, then tiles of PANEL_TILE_ROWS rows (the last one shorter) run
   against panels, each over the whole input: splitting the input would change a row's sum
   order, and with it the bits of its result. Work items are a chunk of row tiles against a
   chunk of panels, small enough that both stay in one core's L2 while the tiles run (the row
   tile in L1, the panels streaming from L2), and at least four per thread so that the threads
   finish together. A 1-row product is one tile against every panel: the threads split the
   panels, each streaming its part of the layer.
   ------------------------------------------------------------------------------------------ */

#define PANEL_X_CHUNK (96 * 1024)
#define PANEL_W_CHUNK (144 * 1024)
/* below this many multiply-adds a product runs on one thread (a parallel region costs ~2 us) */
#define PANEL_PARALLEL_WORK (1 << 18)

/* One 32-block of an input row: q = round(x * (32767 / max|x|)), *d = max|x| / 32767; returns
   sum(q). ~2e-5 of a row's norm (see q8.c): the rounding the LM head needs, and the one every
   Q4P layer takes for every row (q4.c). */
int round_block_i16(const float *x, int16_t *q, float *d) {
    int total = 0;
#ifdef __AVX2__
    __m256 v[4];
    const float amax = load32_amax(x, v);
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? X16_MAX / amax : 0.0f);
    __m256i s8 = _mm256_setzero_si256();
    for (int j = 0; j < 2; j++) {
        /* packs interleaves 128-bit lanes; the permute puts the 16 values back in order (and
           saturates nothing: |x| * (32767 / max|x|) rounds to at most 32767) */
        const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * j], inv));
        const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * j + 1], inv));
        _mm256_storeu_si256((__m256i *)(q + 16 * j), _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
        s8 = _mm256_add_epi32(s8, _mm256_add_epi32(lo, hi));
    }
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    total = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
#else
    float amax = 0.0f;
    for (int j = 0; j < QBLOCK; j++) amax = fmaxf(amax, fabsf(x[j]));
    const float inv = amax > 0.0f ? X16_MAX / amax : 0.0f;
    for (int j = 0; j < QBLOCK; j++) {
        q[j] = (int16_t)lrintf(x[j] * inv);
        total += q[j];
    }
#endif
    *d = amax / X16_MAX;
    return total;
}

typedef struct {
    const PanelFormat *f;
    const Linear *L;
    const float *x;
    float *y;
    char *q;
    float *d;
    int64_t x_stride, y_stride, n;
    int64_t tiles, panels, tile_chunk, panel_chunk, row_chunks;
} PanelJob;

static void round_rows(void *arg, int64_t begin, int64_t end) {
    const PanelJob *j = arg;
    const PanelFormat *f = j->f;
    for (int64_t i = begin; i < end; i++)
        f->round_row(j->x + i * j->x_stride, j->L->in, j->q + i * f->row_bytes, j->d + i * f->row_scales);
}

/* Rows t * PANEL_TILE_ROWS.. (one tile) times panel p: y's 16 outputs there, plus the bias. */
static void panel_tile_out(const PanelJob *j, int64_t p, int64_t t) {
    const PanelFormat *f = j->f;
    const Linear *L = j->L;
    const int64_t blocks = L->in / QBLOCK, o = p * 16, i0 = t * PANEL_TILE_ROWS;
    const int64_t width = L->out - o < 16 ? L->out - o : 16;
    const int rows = (int)(j->n - i0 < PANEL_TILE_ROWS ? j->n - i0 : PANEL_TILE_ROWS);
    float sums[PANEL_TILE_ROWS * 16] __attribute__((aligned(32))) = {0};
    f->tile(j->q + i0 * f->row_bytes, f->row_bytes, j->d + i0 * f->row_scales, f->row_scales,
            (const uint8_t *)L->weight + p * blocks * f->record_bytes, blocks, rows, sums);
    for (int r = 0; r < rows; r++)
        for (int64_t c = 0; c < width; c++)
            j->y[(i0 + r) * j->y_stride + o + c] = sums[r * 16 + c] + (L->bias != NULL ? L->bias[o + c] : 0.0f);
}

/* One work item: a chunk of row tiles against a chunk of panels. */
static void panel_item(void *arg, int64_t item) {
    const PanelJob *j = arg;
    const int64_t p0 = item / j->row_chunks * j->panel_chunk, t0 = item % j->row_chunks * j->tile_chunk;
    const int64_t p1 = p0 + j->panel_chunk < j->panels ? p0 + j->panel_chunk : j->panels;
    const int64_t t1 = t0 + j->tile_chunk < j->tiles ? t0 + j->tile_chunk : j->tiles;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t p = p0; p < p1; p++) panel_tile_out(j, p, t);
}

int panel_linear(const PanelFormat *f, const Linear *L, const float *x, int64_t x_stride,
                 int64_t n, float *y, int64_t y_stride, int threads) {
    if (n <= 0) return 0;
    const int64_t in = L->in;
    PanelJob j = {f, L, x, y, malloc((size_t)(n * f->row_bytes)),
                  malloc(sizeof(float) * (size_t)(n * f->row_scales)), x_stride, y_stride, n};
    if (j.q == NULL || j.d == NULL) {
        free(j.q);
        free(j.d);
        return 1;
    }
    run_rows(n, n * in, threads, round_rows, &j);
    j.tiles = (n + PANEL_TILE_ROWS - 1) / PANEL_TILE_ROWS;
    j.panels = (L->out + 15) / 16;
    const int64_t panel_bytes = in / QBLOCK * f->record_bytes;
    j.tile_chunk = PANEL_X_CHUNK / (PANEL_TILE_ROWS * f->row_bytes);
    j.tile_chunk = j.tile_chunk < 1 ? 1 : j.tile_chunk;
    j.row_chunks = (j.tiles + j.tile_chunk - 1) / j.tile_chunk;
    const int64_t balanced = j.row_chunks * j.panels / (4 * (int64_t)threads);
    j.panel_chunk = PANEL_W_CHUNK / panel_bytes;
    j.panel_chunk = j.panel_chunk > balanced ? balanced : j.panel_chunk;
    j.panel_chunk = j.panel_chunk < 1 ? 1 : j.panel_chunk;
    const int64_t items = j.row_chunks * ((j.panels + j.panel_chunk - 1) / j.panel_chunk);
    run_tasks(items, n * L->out * in >= PANEL_PARALLEL_WORK ? threads : 1, panel_item, &j);
    free(j.q);
    free(j.d);
    return 0;
}
