#include "kernels.h"

/* ---------------------------------------------------------------------------------------------
   LINEAR_Q8P: GGUF's Q8_0 blocks (w = scale * q, q int8, float16 scale per 32 inputs) in panels
   of 16 outputs, one layout that serves every row count. It holds the LM head, whose inputs must
   not be rounded to int8: the next token is often a near tie between logits, and int8 rounding of
   the final hidden state's outlier channels flipped the default model's answer to "What is the
   capital of France?". So inputs are rounded to int16 per 32 (d = max|x| / 32767: an output
   row is off the float product by ~2e-5 of its norm, ~5e-5 with outlier channels, where int8
   inputs are off by ~1e-2) and multiplied with vpmaddwd on the weights sign-extended to 16
   bits. A block's 32 products sum exactly in int32 (32 * 128 * 32767 < 2^31);
   then sum = fma(float(acc), scale * d, sum) in float32, the same for every tile, so a row's
   result does not depend on its batch, and the same bits in every build with a hardware FMA
   (see q4.c). Tiles and the batch's split into them: panels.c (panel_linear), as for q4.c.

   Panels follow one another, a panel's records (one per 32-block) too. A record is 544 bytes
   (1.0625 bytes per weight, the file's own size):
     [16 steps t][16 outputs c][2 inputs e] int8: q of output 16p + c at input 32b + 2t + e
     float16 scale[16]
   so vpmovsxbw of a step's first (last) 16 bytes gives outputs 0-7 (8-15) as int16 pairs, each
   lane multiplying a broadcast pair of inputs.
   ------------------------------------------------------------------------------------------ */

#define Q8P_RECORD 544
#define Q8P_SCALES 512 /* byte offset in a record */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q8P_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__x86_64__)
#define Q8P_AVX2 1
#endif

int64_t q8p_bytes(int64_t out, int64_t in) { return (out + 15) / 16 * (in / QBLOCK) * Q8P_RECORD; }

/* q int8 [out][in], scale float16 [out][in / 32] -> packed (q8p_bytes); outputs past `out` are
   zero. */
typedef struct {
    const int8_t *q;
    const uint16_t *scale;
    int64_t out, in;
    uint8_t *packed;
} Q8PackJob;

static void q8p_pack_panel(void *arg, int64_t p) {
    const Q8PackJob *j = arg;
    const int64_t in = j->in, blocks = in / QBLOCK;
    for (int64_t b = 0; b < blocks; b++) {
        uint8_t *rec = j->packed + (p * blocks + b) * Q8P_RECORD;
        uint16_t *rec_scale = (uint16_t *)(rec + Q8P_SCALES);
        for (int c = 0; c < 16; c++) {
            const int64_t o = p * 16 + c;
            rec_scale[c] = o < j->out ? j->scale[o * blocks + b] : 0;
            for (int k = 0; k < QBLOCK; k++)
                rec[(k / 2) * 32 + c * 2 + k % 2] = o < j->out ? (uint8_t)j->q[o * in + b * QBLOCK + k] : 0;
        }
    }
}

void q8p_pack(const int8_t *q, const uint16_t *scale, int64_t out, int64_t in, uint8_t *packed,
              int threads) {
    Q8PackJob job = {q, scale, out, in, packed};
    run_tasks((out + 15) / 16, threads, q8p_pack_panel, &job);
}

/* out = W[row] as float32: scale * q, the weights the kernels multiply. */
void q8p_dequantize_row(const Linear *L, int64_t row, float *out) {
    const int64_t blocks = L->in / QBLOCK, p = row / 16;
    const int c = (int)(row % 16);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *rec = (const uint8_t *)L->weight + (p * blocks + b) * Q8P_RECORD;
        const float scale = half_to_float(((const uint16_t *)(rec + Q8P_SCALES))[c]);
        for (int k = 0; k < QBLOCK; k++) out[b * QBLOCK + k] = scale * (float)(int8_t)rec[(k / 2) * 32 + c * 2 + k % 2];
    }
}

/* ---- Input rounding: int16 per 32 (panels.c) ------------------------------------------ */

static void q8p_round_row(const float *x, int64_t in, void *q, float *d) {
    for (int64_t b = 0; b < in / QBLOCK; b++)
        (void)round_block_i16(x + b * QBLOCK, (int16_t *)q + b * QBLOCK, d + b);
}

/* ---- Tiles: sums[rows][16] (zeroed) += `rows` rounded input rows x one panel -----------------
   Row r's int16 values at x + r * x_stride (elements), its scales at d + r * d_stride. */

#if !defined(Q8P_AVX2) && !defined(Q8P_VNNI)
static void q8p_tile_generic(const int16_t *x, int64_t x_stride, const float *d, int64_t d_stride,
                             const uint8_t *panel, int64_t blocks, int rows, float *sums) {
    for (int64_t b = 0; b < blocks; b++, panel += Q8P_RECORD) {
        prefetch_ahead(panel, Q8P_RECORD);
        const int8_t *w = (const int8_t *)panel; /* [16 steps][16 outputs][2] */
        float scale[16];
        for (int c = 0; c < 16; c++) scale[c] = half_to_float(((const uint16_t *)(panel + Q8P_SCALES))[c]);
        for (int r = 0; r < rows; r++) {
            const int16_t *xr = x + r * x_stride + b * QBLOCK;
            const float dr = d[r * d_stride + b];
            int32_t acc[16] = {0};
            for (int t = 0; t < QBLOCK / 2; t++)
                for (int c = 0; c < 16; c++)
                    acc[c] += (int32_t)w[t * 32 + 2 * c] * xr[2 * t] + (int32_t)w[t * 32 + 2 * c + 1] * xr[2 * t + 1];
            for (int c = 0; c < 16; c++)
#ifdef __FP_FAST_FMAF /* a hardware FMA (not x86-64 without AVX2): the vector tiles' bits */
                sums[r * 16 + c] = fmaf((float)acc[c], scale[c] * dr, sums[r * 16 + c]);
#else
                sums[r * 16 + c] += (float)acc[c] * (scale[c] * dr);
#endif
        }
    }
}
#endif

#ifdef Q8P_AVX2
#include "tiles_avx2.h"
/* AVX2, for R = 1..6 rows, in the registers and assembly of tiles_avx2.h: vpmaddwd of int16
   input pairs with the weights sign-extended to int16. A row's scales are its d. */
#define Q8P_STEP(ROWS, ROW, xo, wo)                                            \
    "vpmovsxbw " #wo "(%[w]), %%ymm12\n\t"                                     \
    "vpmovsxbw " #wo "+16(%[w]), %%ymm13\n\t"                                  \
    ROWS(ROW, xo)
/* sums[r][half] = fma(float(acc), scale * d, sums[r][half]), the half's scale in ymm12; the
   sums at byte offset so of %[s], or in register sr */
#define Q8P_HALF_MEM(daddr, acc, so)                                           \
    "vcvtdq2ps %%ymm" #acc ", %%ymm15\n\t"                                     \
    "vbroadcastss " daddr ", %%ymm14\n\t"                                      \
    "vmulps %%ymm12, %%ymm14, %%ymm14\n\t"                                     \
    "vfmadd213ps " #so "(%[s]), %%ymm14, %%ymm15\n\t"                          \
    "vmovups %%ymm15, " #so "(%[s])\n\t"
#define Q8P_HALF_REG(daddr, acc, sr)                                           \
    "vcvtdq2ps %%ymm" #acc ", %%ymm15\n\t"                                     \
    "vbroadcastss " daddr ", %%ymm14\n\t"                                      \
    "vmulps %%ymm12, %%ymm14, %%ymm14\n\t"                                     \
    "vfmadd231ps %%ymm14, %%ymm15, %%ymm" #sr "\n\t"
/* sums[R][16] (zeroed) += R rows x one panel. A block is a first step, then three turns of
   five: */
#define Q8P_FIVE(R)                                                                             \
    Q8P_STEP(TILE_ROWS_##R, TILE_MADDWD_NEXT, 0, 0)                                             \
    Q8P_STEP(TILE_ROWS_##R, TILE_MADDWD_NEXT, 4, 32)                                            \
    Q8P_STEP(TILE_ROWS_##R, TILE_MADDWD_NEXT, 8, 64)                                            \
    Q8P_STEP(TILE_ROWS_##R, TILE_MADDWD_NEXT, 12, 96)                                           \
    Q8P_STEP(TILE_ROWS_##R, TILE_MADDWD_NEXT, 16, 128)
#define Q8P_TILE_AVX2(R)                                                                         \
    static void q8p_tile_avx2_##R(const int16_t *x, int64_t x_stride, const float *d,            \
                                  int64_t d_stride, const uint8_t *panel, int64_t blocks,        \
                                  float *sums) {                                                 \
        /* rows 3-5 through x3 and d3 (for fewer rows these are never read) */                  \
        uintptr_t x0 = (uintptr_t)x, x3 = x0 + 3 * 2 * (uintptr_t)x_stride;                      \
        uintptr_t d0 = (uintptr_t)d, d3 = d0 + 3 * 4 * (uintptr_t)d_stride;                      \
        const int64_t xs = 2 * x_stride, dst = 4 * d_stride;                                     \
        int64_t turns;                                                                           \
        __asm__ volatile(                                                                        \
            TILE_ZERO_##R                                                                        \
            "1:\n\t"                                                                             \
            TILE_PREFETCH_9                                                                      \
            Q8P_STEP(TILE_ROWS_##R, TILE_MADDWD_FIRST, 0, 0)                                     \
            "addq $32, %[w]\n\t"                                                                 \
            "addq $4, %[x0]\n\t"                                                                 \
            "addq $4, %[x3]\n\t"                                                                 \
            "movq $3, %[turns]\n\t"                                                              \
            "2:\n\t"                                                                             \
            Q8P_FIVE(R)                                                                          \
            "addq $160, %[w]\n\t"                                                                \
            "addq $20, %[x0]\n\t"                                                                \
            "addq $20, %[x3]\n\t"                                                                \
            "decq %[turns]\n\t"                                                                  \
            "jnz 2b\n\t"                                                                         \
            /* %[w] is at the record's scales, %[x0] and %[x3] at the next block */             \
            "vcvtph2ps (%[w]), %%ymm12\n\t"                                                      \
            TILE_LO_##R(TILE_HALF_##R(Q8P_HALF_REG, Q8P_HALF_MEM))                               \
            "vcvtph2ps 16(%[w]), %%ymm12\n\t"                                                    \
            TILE_HI_##R(TILE_HALF_##R(Q8P_HALF_REG, Q8P_HALF_MEM))                               \
            "addq $32, %[w]\n\t"                                                                 \
            "addq $4, %[d0]\n\t"                                                                 \
            "addq $4, %[d3]\n\t"                                                                 \
            "decq %[blocks]\n\t"                                                                 \
            "jnz 1b\n\t"                                                                         \
            TILE_STORE_##R                                                                       \
            : [w] "+r"(panel), [x0] "+r"(x0), [x3] "+r"(x3), [d0] "+r"(d0), [d3] "+r"(d3),      \
              [blocks] "+r"(blocks), [turns] "=&r"(turns)                                        \
            : [xs] "r"(xs), [dst] "r"(dst), [s] "r"(sums)                                        \
            : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",     \
              "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "cc", "memory");             \
    }
Q8P_TILE_AVX2(1)
Q8P_TILE_AVX2(2)
Q8P_TILE_AVX2(3)
Q8P_TILE_AVX2(4)
Q8P_TILE_AVX2(5)
Q8P_TILE_AVX2(6)
#endif

#ifdef Q8P_VNNI
/* Any rows (R = 1..6), AVX-512 VNNI: a step's 32 weight bytes sign-extend to one zmm, the 16
   outputs' next 2 weights, and one vpdpwssd per row adds their products with a broadcast of
   the row's next 2 inputs into 16 int32 sums. One function for every row count; the float
   steps are the AVX2 tiles', so the results are the same bits as the AVX2 build's. */
static inline __attribute__((always_inline)) void q8p_rows_vnni(const int16_t *x, int64_t x_stride,
                                                                const float *d, int64_t d_stride,
                                                                const uint8_t *panel, int64_t blocks,
                                                                float *sums, const int R) {
    __m512 sum[PANEL_TILE_ROWS];
    for (int r = 0; r < R; r++) sum[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++, panel += Q8P_RECORD) {
        prefetch_ahead(panel, Q8P_RECORD);
        /* even and odd steps in two chains for up to 3 rows (see q4.c) */
        __m512i acc[PANEL_TILE_ROWS], odd[PANEL_TILE_ROWS];
        for (int r = 0; r < R; r++) acc[r] = odd[r] = _mm512_setzero_si512();
        _Pragma("GCC unroll 16") for (int t = 0; t < QBLOCK / 2; t++) {
            const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(panel + 32 * t)));
            for (int r = 0; r < R; r++) {
                int32_t pair;
                memcpy(&pair, x + r * x_stride + b * QBLOCK + 2 * t, 4);
                if (R <= 3 && t % 2)
                    odd[r] = _mm512_dpwssd_epi32(odd[r], w, _mm512_set1_epi32(pair));
                else
                    acc[r] = _mm512_dpwssd_epi32(acc[r], w, _mm512_set1_epi32(pair));
            }
        }
        for (int r = 0; R <= 3 && r < R; r++) acc[r] = _mm512_add_epi32(acc[r], odd[r]);
        const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(panel + Q8P_SCALES)));
        for (int r = 0; r < R; r++) {
            const __m512 dr = _mm512_set1_ps(d[r * d_stride + b]);
            sum[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(scale, dr), sum[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(sums + 16 * r, sum[r]);
}
#endif

static void q8p_tile(const void *q, int64_t q_stride, const float *d, int64_t d_stride,
                     const uint8_t *panel, int64_t blocks, int rows, float *sums) {
    const int16_t *x = (const int16_t *)q;
    const int64_t xs = q_stride / 2;
#if defined(Q8P_VNNI)
    switch (rows) {
    case 1: q8p_rows_vnni(x, xs, d, d_stride, panel, blocks, sums, 1); break;
    case 2: q8p_rows_vnni(x, xs, d, d_stride, panel, blocks, sums, 2); break;
    case 3: q8p_rows_vnni(x, xs, d, d_stride, panel, blocks, sums, 3); break;
    case 4: q8p_rows_vnni(x, xs, d, d_stride, panel, blocks, sums, 4); break;
    case 5: q8p_rows_vnni(x, xs, d, d_stride, panel, blocks, sums, 5); break;
    default: q8p_rows_vnni(x, xs, d, d_stride, panel, blocks, sums, 6);
    }
#elif defined(Q8P_AVX2)
    static void (*const tiles[PANEL_TILE_ROWS])(const int16_t *, int64_t, const float *, int64_t,
                                                const uint8_t *, int64_t, float *) = {
        q8p_tile_avx2_1, q8p_tile_avx2_2, q8p_tile_avx2_3, q8p_tile_avx2_4, q8p_tile_avx2_5,
        q8p_tile_avx2_6};
    tiles[rows - 1](x, xs, d, d_stride, panel, blocks, sums);
#else
    q8p_tile_generic(x, xs, d, d_stride, panel, blocks, rows, sums);
#endif
}

/* y [n, out] = x [n, in] W^T + b for a LINEAR_Q8P layer (in % 32 == 0). */
int q8p_linear(const Linear *L, const float *x, int64_t x_stride, int64_t n, float *y,
               int64_t y_stride, int threads) {
    const PanelFormat format = {Q8P_RECORD, 2 * L->in, L->in / QBLOCK, q8p_round_row, q8p_tile};
    return panel_linear(&format, L, x, x_stride, n, y, y_stride, threads);
}
