#include "kernels.h"

/* ---------------------------------------------------------------------------------------------
   LINEAR_Q4P: GGUF's 4-bit blocks (Q4_0, Q4_1) in panels of 16 outputs, one layout that serves
   every row count, from a 1-row decode step to a prefill.

   w = scale * q + zero, q in 0..15, float16 scale and zero per 32 inputs (Q4_0: zero = -8 scale).
   A panel holds outputs 16p..16p+15; its records, one per 32-block of inputs, follow one
   another, and the panels follow one another, so a 1-row product reads the layer front to back
   in one stream. A record is 320 bytes (0.625 bytes per weight, the GGUF file's own size):
     [8 steps s][8 lanes c][4 inputs e] bytes: the low nibble is q of output 16p + c at input
         32b + 4s + e, the high nibble the same for output 16p + 8 + c
     float16 scale[16], float16 zero[16]
   A 32-byte load and an and (or a shift and an and) give a step's weights as the int16 pairs
   vpmaddwd takes: inputs 0 and 2, 1 and 3. The scales stay float16 (exact, and converted once
   per record) so that the layer takes no more bytes than the file.

   Arithmetic: each input row is rounded to int16 per 32, exactly as LINEAR_Q8P rounds them
   (d = max|x| / 32767, s = d * sum(q)); per block and output the integer sum acc = sum q_w q_x
   is exact, then sum = fma(zero, s, fma(float(acc), scale * d, sum)) in float32, block after
   block. Every row of every step, decode or prompt: a token's K/V and logits are then the same
   bits whether it is decoded, computed in a prompt chunk, or recomputed after a preemption, so
   what shares its step (a prefix-cache hit changes that) cannot change an answer. llama.cpp
   rounds these inputs to int8 (vpmaddubsw, half the multiply-adds): on prompt rows that flipped
   the default model's answer to "What is the capital of France?", and on decode rows alone it
   made a row's bits depend on its step. 16 bits cost little at one row (memory-bound: a decode
   step of one sequence took 2-5% longer here), ~25% per step at 16-64 rows (AVX-512 VNNI).
   Every tile does exactly that per row, so a row's result does not depend on the rows it
   shares a batch with; and as the integer sums are exact, the AVX2 and AVX-512 builds (and
   plain C where the FMA is hardware) give the same bits. Plain C on x86-64 without FMA
   multiplies and adds instead (a software fmaf would cost more than the products).

   Tiles: up to PANEL_TILE_ROWS (6) rows against one panel, over the whole input; a batch is
   6-row tiles and one of the rest (panels.c, panel_linear, which LINEAR_Q8P shares).
   ------------------------------------------------------------------------------------------ */

#define Q4P_RECORD 320
#define Q4P_SCALES 256 /* byte offsets in a record */
#define Q4P_ZEROS 288

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q4P_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__x86_64__)
#define Q4P_AVX2 1
#endif

int64_t q4p_bytes(int64_t out, int64_t in) { return (out + 15) / 16 * (in / QBLOCK) * Q4P_RECORD; }

/* nibbles [out][in / 2] in GGUF order (byte j of a 32-block holds elements j and j + 16), scale
   and zero float16 [out][in / 32] -> packed (q4p_bytes); outputs past `out` are zero. */
typedef struct {
    const uint8_t *nibbles;
    const uint16_t *scale, *zero;
    int64_t out, in;
    uint8_t *packed;
} Q4PackJob;

static void q4p_pack_panel(void *arg, int64_t p) {
    const Q4PackJob *j = arg;
    const int64_t in = j->in, blocks = in / QBLOCK;
    for (int64_t b = 0; b < blocks; b++) {
        uint8_t *rec = j->packed + (p * blocks + b) * Q4P_RECORD;
        uint16_t *rec_scale = (uint16_t *)(rec + Q4P_SCALES), *rec_zero = (uint16_t *)(rec + Q4P_ZEROS);
        memset(rec, 0, Q4P_SCALES);
        for (int c = 0; c < 16; c++) {
            const int64_t o = p * 16 + c;
            rec_scale[c] = o < j->out ? j->scale[o * blocks + b] : 0;
            rec_zero[c] = o < j->out ? j->zero[o * blocks + b] : 0;
            if (o >= j->out) continue;
            const uint8_t *src = j->nibbles + o * (in / 2) + b * (QBLOCK / 2);
            for (int k = 0; k < QBLOCK; k++) {
                const int q = k < 16 ? src[k] & 15 : src[k - 16] >> 4;
                rec[(k / 4) * 32 + (c % 8) * 4 + k % 4] |= (uint8_t)(c < 8 ? q : q << 4);
            }
        }
    }
}

void q4p_pack(const uint8_t *nibbles, const uint16_t *scale, const uint16_t *zero, int64_t out,
              int64_t in, uint8_t *packed, int threads) {
    Q4PackJob job = {nibbles, scale, zero, out, in, packed};
    run_tasks((out + 15) / 16, threads, q4p_pack_panel, &job);
}

/* q of output c (0..15) at input k (0..31) of a record. */
static inline int q4p_weight(const uint8_t *rec, int c, int k) {
    const uint8_t byte = rec[(k / 4) * 32 + (c % 8) * 4 + k % 4];
    return c < 8 ? byte & 15 : byte >> 4;
}

/* out = W[row] as float32: scale * q + zero, the weights the kernels multiply. */
void q4p_dequantize_row(const Linear *L, int64_t row, float *out) {
    const int64_t blocks = L->in / QBLOCK, p = row / 16;
    const int c = (int)(row % 16);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *rec = (const uint8_t *)L->weight + (p * blocks + b) * Q4P_RECORD;
        const float scale = half_to_float(((const uint16_t *)(rec + Q4P_SCALES))[c]);
        const float zero = half_to_float(((const uint16_t *)(rec + Q4P_ZEROS))[c]);
        for (int k = 0; k < QBLOCK; k++) out[b * QBLOCK + k] = scale * (float)q4p_weight(rec, c, k) + zero;
    }
}

/* ---- Input rounding ------------------------------------------------------------------------ */

/* int16 per 32, LINEAR_Q8P's rounding (panels.c), with (d, s) pairs, each 4 inputs of a step
   stored in the order 0, 2, 1, 3: the pairs (0, 2) and (1, 3) are those a record's bytes give as
   int16 with an and and a shift (see the tiles). */
#define Q4P_X16_SLOT(k) (((k) & ~3) | ((k) & 1) << 1 | ((k) & 2) >> 1)
static void q4p_round_row(const float *x, int64_t in, void *q, float *ds) {
    for (int64_t b = 0; b < in / QBLOCK; b++) {
        int16_t *out = (int16_t *)q + b * QBLOCK;
        const int total = round_block_i16(x + b * QBLOCK, out, ds + 2 * b);
        ds[2 * b + 1] = ds[2 * b] * (float)total;
#ifdef __AVX2__
        const __m256i order = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15,
                                               0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
        for (int j = 0; j < QBLOCK; j += 16) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(out + j));
            _mm256_storeu_si256((__m256i *)(out + j), _mm256_shuffle_epi8(v, order));
        }
#else
        int16_t rounded[QBLOCK];
        memcpy(rounded, out, sizeof rounded);
        for (int k = 0; k < QBLOCK; k++) out[Q4P_X16_SLOT(k)] = rounded[k];
#endif
    }
}

/* ---- Tiles: sums[rows][16] (zeroed) += `rows` rounded input rows x one panel -----------------
   Row r's int16 values at byte offset r * x_stride of x, its (d, s) pairs at ds + r * ds_stride. */

#if !defined(Q4P_AVX2) && !defined(Q4P_VNNI)
static void q4p_tile_generic(const void *x, int64_t x_stride, const float *ds, int64_t ds_stride,
                             const uint8_t *panel, int64_t blocks, int rows, float *sums) {
    /* a record's weights input-major (one row: the output loop vectorises), or per output in the
       rows' slot order (more rows: each output's sum is a dot product of two int16 runs, which
       compilers vectorise, SSE2's pmaddwd); the integer sums are exact either way */
    int16_t w[QBLOCK * 16];
    for (int64_t b = 0; b < blocks; b++, panel += Q4P_RECORD) {
        prefetch_ahead(panel, Q4P_RECORD);
        float scale[16], zero[16];
        for (int c = 0; c < 16; c++) {
            scale[c] = half_to_float(((const uint16_t *)(panel + Q4P_SCALES))[c]);
            zero[c] = half_to_float(((const uint16_t *)(panel + Q4P_ZEROS))[c]);
            for (int k = 0; k < QBLOCK; k++) {
                const int16_t q = (int16_t)q4p_weight(panel, c, k);
                if (rows == 1) w[k * 16 + c] = q;
                else w[c * QBLOCK + Q4P_X16_SLOT(k)] = q;
            }
        }
        for (int r = 0; r < rows; r++) {
            const int16_t *xb = (const int16_t *)((const char *)x + r * x_stride) + b * QBLOCK;
            const float d = ds[r * ds_stride + 2 * b], s = ds[r * ds_stride + 2 * b + 1];
            int32_t acc[16] = {0};
            if (rows == 1) {
                for (int k = 0; k < QBLOCK; k++) {
                    const int32_t xk = xb[Q4P_X16_SLOT(k)];
                    for (int c = 0; c < 16; c++) acc[c] += (int32_t)w[k * 16 + c] * xk;
                }
            } else {
                for (int c = 0; c < 16; c++)
                    for (int j = 0; j < QBLOCK; j++) acc[c] += (int32_t)w[c * QBLOCK + j] * xb[j];
            }
            for (int c = 0; c < 16; c++) {
#ifdef __FP_FAST_FMAF /* a hardware FMA (not x86-64 without AVX2): the vector tiles' bits */
                sums[r * 16 + c] = fmaf(zero[c], s, fmaf((float)acc[c], scale[c] * d, sums[r * 16 + c]));
#else
                const float sum = sums[r * 16 + c] + (float)acc[c] * (scale[c] * d);
                sums[r * 16 + c] = sum + zero[c] * s;
#endif
            }
        }
    }
}
#endif

#ifdef Q4P_AVX2
#include "tiles_avx2.h"
/* AVX2, for R = 1..6 rows, in the registers and assembly of tiles_avx2.h.
   A step is two halves of 2 inputs, (0, 2) and (1, 3) (the rows hold them in that order), for
   vpmaddwd: the 32 bytes as int16 are (byte 0 | byte 1 << 8, byte 2 |
   byte 3 << 8) per output, so an and with 0x00FF (a shift by 8) gives bytes 0 and 2 (1 and 3)
   as int16 pairs, L + 16 H with L the low nibble (outputs 0-7) and H the high one (8-15), and
   an and with 0x000F gives L alone. Row r sums (L x) into ymm 2r and ((L + 16 H) x) into
   ymm 2r + 1, which a block's end turns into (H x) = (that - (L x)) / 16: one and per half
   step fewer than unpacking L and H, and no shuffle. All exact in int32 (32 * 255 * 32767 <
   2^31). A row's scales are its (d, s) pairs. */
/* ymm13 = L + 16 H, ymm12 = L of the step's inputs 0 and 2 (EVEN), or 1 and 3 (ODD) */
#define Q4P_EVEN16(ROWS, ROW, xo, wo)                                          \
    "vmovdqu " #wo "(%[w]), %%ymm13\n\t"                                       \
    "vpand %[nibble16], %%ymm13, %%ymm12\n\t"                                  \
    "vpand %[byte16], %%ymm13, %%ymm13\n\t"                                    \
    ROWS(ROW, xo)
#define Q4P_ODD16(ROWS, ROW, xo, wo)                                           \
    "vmovdqu " #wo "(%[w]), %%ymm13\n\t"                                       \
    "vpsrlw $8, %%ymm13, %%ymm13\n\t"                                          \
    "vpand %[nibble16], %%ymm13, %%ymm12\n\t"                                  \
    ROWS(ROW, xo)
#define Q4P_STEP16(R, ROW, xo, xo2, wo)                                        \
    Q4P_EVEN16(TILE_ROWS_##R, ROW, xo, wo)                                     \
    Q4P_ODD16(TILE_ROWS_##R, TILE_MADDWD_NEXT, xo2, wo)
/* accumulator b: (L + 16 H) x -> H x */
#define Q4P_HIGH16(xaddr, a, b)                                                \
    "vpsubd %%ymm" #a ", %%ymm" #b ", %%ymm" #b "\n\t"                         \
    "vpsrad $4, %%ymm" #b ", %%ymm" #b "\n\t"
#define Q4P_BLOCK16(R)                                                                           \
    Q4P_STEP16(R, TILE_MADDWD_FIRST, 0, 4, 0) Q4P_STEP16(R, TILE_MADDWD_NEXT, 8, 12, 32)         \
    Q4P_STEP16(R, TILE_MADDWD_NEXT, 16, 20, 64) Q4P_STEP16(R, TILE_MADDWD_NEXT, 24, 28, 96)      \
    Q4P_STEP16(R, TILE_MADDWD_NEXT, 32, 36, 128) Q4P_STEP16(R, TILE_MADDWD_NEXT, 40, 44, 160)    \
    Q4P_STEP16(R, TILE_MADDWD_NEXT, 48, 52, 192) Q4P_STEP16(R, TILE_MADDWD_NEXT, 56, 60, 224)    \
    TILE_ROWS_##R(Q4P_HIGH16, 0)
/* sums[r][half] = fma(zero, s, fma(float(acc), scale * d, sums[r][half])), the half's scale in
   ymm12 and zero in ymm13; the sums at byte offset so of %[s], or in register sr */
#define Q4P_HALF_MEM(daddr, acc, so)                                           \
    "vcvtdq2ps %%ymm" #acc ", %%ymm15\n\t"                                     \
    "vbroadcastss " daddr ", %%ymm14\n\t"                                      \
    "vmulps %%ymm12, %%ymm14, %%ymm14\n\t"                                     \
    "vfmadd213ps " #so "(%[s]), %%ymm14, %%ymm15\n\t"                          \
    "vbroadcastss 4" daddr ", %%ymm14\n\t"                                     \
    "vfmadd231ps %%ymm13, %%ymm14, %%ymm15\n\t"                                \
    "vmovups %%ymm15, " #so "(%[s])\n\t"
#define Q4P_HALF_REG(daddr, acc, sr)                                           \
    "vcvtdq2ps %%ymm" #acc ", %%ymm15\n\t"                                     \
    "vbroadcastss " daddr ", %%ymm14\n\t"                                      \
    "vmulps %%ymm12, %%ymm14, %%ymm14\n\t"                                     \
    "vfmadd231ps %%ymm14, %%ymm15, %%ymm" #sr "\n\t"                           \
    "vbroadcastss 4" daddr ", %%ymm14\n\t"                                     \
    "vfmadd231ps %%ymm13, %%ymm14, %%ymm" #sr "\n\t"
static const uint16_t q4p_nibble16[16] __attribute__((aligned(32))) = {
    15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15};
static const uint16_t q4p_byte16[16] __attribute__((aligned(32))) = {
    255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255};
/* sums[R][16] (zeroed) += R rows x one panel (a block: 64 bytes of each input row) */
#define Q4P_TILE_AVX2(R)                                                                         \
    static void q4p_tile_avx2_##R(const void *x, int64_t x_stride, const float *ds,              \
                                  int64_t ds_stride, const uint8_t *panel, int64_t blocks,       \
                                  float *sums) {                                                 \
        /* rows 3-5 through x3 and d3 (for fewer rows these are never read) */                  \
        uintptr_t x0 = (uintptr_t)x, x3 = x0 + 3 * (uintptr_t)x_stride;                          \
        uintptr_t d0 = (uintptr_t)ds, d3 = d0 + 3 * 4 * (uintptr_t)ds_stride;                    \
        const int64_t xs = x_stride, dst = 4 * ds_stride;                                        \
        __asm__ volatile(                                                                        \
            TILE_ZERO_##R                                                                        \
            "1:\n\t"                                                                             \
            TILE_PREFETCH_5                                                                      \
            Q4P_BLOCK16(R)                                                                       \
            "vcvtph2ps 256(%[w]), %%ymm12\n\t"                                                   \
            "vcvtph2ps 288(%[w]), %%ymm13\n\t"                                                   \
            TILE_LO_##R(TILE_HALF_##R(Q4P_HALF_REG, Q4P_HALF_MEM))                               \
            "vcvtph2ps 272(%[w]), %%ymm12\n\t"                                                   \
            "vcvtph2ps 304(%[w]), %%ymm13\n\t"                                                   \
            TILE_HI_##R(TILE_HALF_##R(Q4P_HALF_REG, Q4P_HALF_MEM))                               \
            "addq $320, %[w]\n\t"                                                                \
            "addq $64, %[x0]\n\t"                                                                \
            "addq $64, %[x3]\n\t"                                                                \
            "addq $8, %[d0]\n\t"                                                                 \
            "addq $8, %[d3]\n\t"                                                                 \
            "decq %[blocks]\n\t"                                                                 \
            "jnz 1b\n\t"                                                                         \
            TILE_STORE_##R                                                                       \
            : [w] "+r"(panel), [x0] "+r"(x0), [x3] "+r"(x3), [d0] "+r"(d0), [d3] "+r"(d3),       \
              [blocks] "+r"(blocks)                                                              \
            : [xs] "r"(xs), [dst] "r"(dst), [s] "r"(sums), [nibble16] "m"(q4p_nibble16),         \
              [byte16] "m"(q4p_byte16)                                                           \
            : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",     \
              "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "cc", "memory");             \
    }
Q4P_TILE_AVX2(1)
Q4P_TILE_AVX2(2)
Q4P_TILE_AVX2(3)
Q4P_TILE_AVX2(4)
Q4P_TILE_AVX2(5)
Q4P_TILE_AVX2(6)
#endif

#ifdef Q4P_VNNI
/* Any rows (R = 1..6), AVX-512 VNNI: a step's 32 nibble bytes, loaded into both halves of a
   zmm and shifted by 0 (low half) and 4 (high half), are the 16 outputs' next 4 weights; an
   and and a shift make them int16 pairs (inputs 0 and 2, 1 and 3, as the rows hold them), and
   two vpdpwssd per row add their products with broadcasts of the row's input pairs. The same
   function serves every row count, so a row's operations do not depend on its batch; the float steps are those of the AVX2 tiles, and the
   integer sums are exact, so the results are the same bits as the AVX2 build's. */
/* acc + the products of w's int16 pairs with the pair at p, broadcast: vpdpwssd with an
   embedded broadcast, one instruction where gcc emits a broadcast and a vpdpwssd. */
static inline __attribute__((always_inline)) __m512i q4p_dpwssd_broadcast(__m512i acc, __m512i w,
                                                                          const void *p) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}

static inline __attribute__((always_inline)) void q4p_rows_vnni(const char *x, int64_t x_stride,
                                                                const float *ds, int64_t ds_stride,
                                                                const uint8_t *panel, int64_t blocks,
                                                                float *sums, const int R) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    const __m512i byte16 = _mm512_set1_epi16(0x00FF);
    __m512 sum[PANEL_TILE_ROWS];
    for (int r = 0; r < R; r++) sum[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++, panel += Q4P_RECORD) {
        /* two chains per row, each step's two pairs: the integer sums are exact in either order */
        __m512i acc[PANEL_TILE_ROWS], odd[PANEL_TILE_ROWS];
        for (int r = 0; r < R; r++) acc[r] = odd[r] = _mm512_setzero_si512();
        const char *xb = x + b * 2 * QBLOCK;
        prefetch_ahead(panel, Q4P_RECORD);
        _Pragma("GCC unroll 8") for (int step = 0; step < 8; step++) {
            const __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(panel + 32 * step)));
            const __m512i w = _mm512_and_si512(_mm512_srlv_epi16(raw, shift), low);
            const __m512i w0 = _mm512_and_si512(w, byte16), w1 = _mm512_srli_epi16(w, 8);
            for (int r = 0; r < R; r++) {
                acc[r] = q4p_dpwssd_broadcast(acc[r], w0, xb + r * x_stride + 8 * step);
                odd[r] = q4p_dpwssd_broadcast(odd[r], w1, xb + r * x_stride + 8 * step + 4);
            }
        }
        for (int r = 0; r < R; r++) acc[r] = _mm512_add_epi32(acc[r], odd[r]);
        const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(panel + Q4P_SCALES)));
        const __m512 zero = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(panel + Q4P_ZEROS)));
        for (int r = 0; r < R; r++) {
            const __m512 d = _mm512_set1_ps(ds[r * ds_stride + 2 * b]);
            const __m512 s = _mm512_set1_ps(ds[r * ds_stride + 2 * b + 1]);
            sum[r] = _mm512_fmadd_ps(zero, s, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(scale, d), sum[r]));
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(sums + 16 * r, sum[r]);
}
#endif

static void q4p_tile(const void *q, int64_t q_stride, const float *ds, int64_t ds_stride,
                     const uint8_t *panel, int64_t blocks, int rows, float *sums) {
#if defined(Q4P_VNNI)
    const char *x = (const char *)q;
    switch (rows) {
    case 1: q4p_rows_vnni(x, q_stride, ds, ds_stride, panel, blocks, sums, 1); break;
    case 2: q4p_rows_vnni(x, q_stride, ds, ds_stride, panel, blocks, sums, 2); break;
    case 3: q4p_rows_vnni(x, q_stride, ds, ds_stride, panel, blocks, sums, 3); break;
    case 4: q4p_rows_vnni(x, q_stride, ds, ds_stride, panel, blocks, sums, 4); break;
    case 5: q4p_rows_vnni(x, q_stride, ds, ds_stride, panel, blocks, sums, 5); break;
    default: q4p_rows_vnni(x, q_stride, ds, ds_stride, panel, blocks, sums, 6);
    }
#elif defined(Q4P_AVX2)
    typedef void (*Tile)(const void *, int64_t, const float *, int64_t, const uint8_t *, int64_t, float *);
    static const Tile tiles[PANEL_TILE_ROWS] = {q4p_tile_avx2_1, q4p_tile_avx2_2, q4p_tile_avx2_3,
                                                q4p_tile_avx2_4, q4p_tile_avx2_5, q4p_tile_avx2_6};
    tiles[rows - 1](q, q_stride, ds, ds_stride, panel, blocks, sums);
#else
    q4p_tile_generic(q, q_stride, ds, ds_stride, panel, blocks, rows, sums);
#endif
}

/* y [n, out] = x [n, in] W^T + b for a LINEAR_Q4P layer (in % 32 == 0). */
int q4p_linear(const Linear *L, const float *x, int64_t x_stride, int64_t n, float *y,
               int64_t y_stride, int threads) {
    const PanelFormat format = {Q4P_RECORD, 2 * L->in, 2 * (L->in / QBLOCK), q4p_round_row, q4p_tile};
    return panel_linear(&format, L, x, x_stride, n, y, y_stride, threads);
}
