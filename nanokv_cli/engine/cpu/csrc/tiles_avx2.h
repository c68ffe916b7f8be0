/* The AVX2 tiles' assembly, shared by q4.c and q8.c: R = 1..6 input rows against one panel of
   16 outputs. Row r keeps two int32 accumulators (ymm 2r and 2r + 1: outputs 0-7 and 8-15);
   ymm12 and ymm13 hold a step's two weight vectors, ymm14 a broadcast of inputs, ymm15 a
   product. Six rows fill the 16 vector registers, which gcc does not manage without spilling
   (the same tiles in intrinsics ran at 0.53-0.67x: scripts/BENCHMARKS.md), hence assembly.
   Every row count runs the same operations per row in the same order, so a row's result does
   not depend on its batch.
   Row r's inputs are read at x0 + r * xs (r < 3) or x3 + (r - 3) * xs, its scales at d0 or d3
   likewise (an x86 address takes a base, an index scaled by 1, 2, 4 or 8, and an offset). */
#ifndef NANOKV_TILES_AVX2_H
#define NANOKV_TILES_AVX2_H

/* TILE_ROWS_R(ROW, xo): rows 0..R-1 as ROW(address of the inputs at byte offset xo, a, b) */
#define TILE_ROWS_1(ROW, xo) ROW(#xo "(%[x0])", 0, 1)
#define TILE_ROWS_2(ROW, xo) TILE_ROWS_1(ROW, xo) ROW(#xo "(%[x0],%[xs],1)", 2, 3)
#define TILE_ROWS_3(ROW, xo) TILE_ROWS_2(ROW, xo) ROW(#xo "(%[x0],%[xs],2)", 4, 5)
#define TILE_ROWS_4(ROW, xo) TILE_ROWS_3(ROW, xo) ROW(#xo "(%[x3])", 6, 7)
#define TILE_ROWS_5(ROW, xo) TILE_ROWS_4(ROW, xo) ROW(#xo "(%[x3],%[xs],1)", 8, 9)
#define TILE_ROWS_6(ROW, xo) TILE_ROWS_5(ROW, xo) ROW(#xo "(%[x3],%[xs],2)", 10, 11)
/* TILE_LO_R(HALF) and TILE_HI_R(HALF): rows 0..R-1 as HALF(address of the row's scales,
   accumulator, sums) for outputs 0-7 and 8-15. The sums stay in memory (an offset into
   %[s]) for 4-6 rows, and in the registers the accumulators leave free for 1-3 rows: a
   block's chain of multiply-adds then does not wait on a store's forwarding to the next
   block's load. TILE_HALF_R(REG, MEM) picks the HALF that fits. */
#define TILE_LO_1(H) H("(%[d0])", 0, 2)
#define TILE_HI_1(H) H("(%[d0])", 1, 3)
#define TILE_LO_2(H) H("(%[d0])", 0, 4) H("(%[d0],%[dst],1)", 2, 6)
#define TILE_HI_2(H) H("(%[d0])", 1, 5) H("(%[d0],%[dst],1)", 3, 7)
#define TILE_LO_3(H) H("(%[d0])", 0, 6) H("(%[d0],%[dst],1)", 2, 8) H("(%[d0],%[dst],2)", 4, 10)
#define TILE_HI_3(H) H("(%[d0])", 1, 7) H("(%[d0],%[dst],1)", 3, 9) H("(%[d0],%[dst],2)", 5, 11)
#define TILE_LO_4(H) H("(%[d0])", 0, 0) H("(%[d0],%[dst],1)", 2, 64) H("(%[d0],%[dst],2)", 4, 128) \
                     H("(%[d3])", 6, 192)
#define TILE_HI_4(H) H("(%[d0])", 1, 32) H("(%[d0],%[dst],1)", 3, 96) H("(%[d0],%[dst],2)", 5, 160) \
                     H("(%[d3])", 7, 224)
#define TILE_LO_5(H) TILE_LO_4(H) H("(%[d3],%[dst],1)", 8, 256)
#define TILE_HI_5(H) TILE_HI_4(H) H("(%[d3],%[dst],1)", 9, 288)
#define TILE_LO_6(H) TILE_LO_5(H) H("(%[d3],%[dst],2)", 10, 320)
#define TILE_HI_6(H) TILE_HI_5(H) H("(%[d3],%[dst],2)", 11, 352)
#define TILE_HALF_1(REG, MEM) REG
#define TILE_HALF_2(REG, MEM) REG
#define TILE_HALF_3(REG, MEM) REG
#define TILE_HALF_4(REG, MEM) MEM
#define TILE_HALF_5(REG, MEM) MEM
#define TILE_HALF_6(REG, MEM) MEM
/* the sum registers of 1-3 rows: zeroed before the first block, stored after the last */
#define TILE_ZERO_1 "vpxor %%xmm2, %%xmm2, %%xmm2\n\tvpxor %%xmm3, %%xmm3, %%xmm3\n\t"
#define TILE_ZERO_2 "vpxor %%xmm4, %%xmm4, %%xmm4\n\tvpxor %%xmm5, %%xmm5, %%xmm5\n\t" \
                    "vpxor %%xmm6, %%xmm6, %%xmm6\n\tvpxor %%xmm7, %%xmm7, %%xmm7\n\t"
#define TILE_ZERO_3 "vpxor %%xmm6, %%xmm6, %%xmm6\n\tvpxor %%xmm7, %%xmm7, %%xmm7\n\t" \
                    "vpxor %%xmm8, %%xmm8, %%xmm8\n\tvpxor %%xmm9, %%xmm9, %%xmm9\n\t" \
                    "vpxor %%xmm10, %%xmm10, %%xmm10\n\tvpxor %%xmm11, %%xmm11, %%xmm11\n\t"
#define TILE_STORE_1 "vmovups %%ymm2, (%[s])\n\tvmovups %%ymm3, 32(%[s])\n\t"
#define TILE_STORE_2 "vmovups %%ymm4, (%[s])\n\tvmovups %%ymm5, 32(%[s])\n\t" \
                     "vmovups %%ymm6, 64(%[s])\n\tvmovups %%ymm7, 96(%[s])\n\t"
#define TILE_STORE_3 "vmovups %%ymm6, (%[s])\n\tvmovups %%ymm7, 32(%[s])\n\t" \
                     "vmovups %%ymm8, 64(%[s])\n\tvmovups %%ymm9, 96(%[s])\n\t"    \
                     "vmovups %%ymm10, 128(%[s])\n\tvmovups %%ymm11, 160(%[s])\n\t"
#define TILE_ZERO_4 ""
#define TILE_ZERO_5 ""
#define TILE_ZERO_6 ""
#define TILE_STORE_4 ""
#define TILE_STORE_5 ""
#define TILE_STORE_6 ""
/* The look-ahead of common.h's prefetch_ahead, at a block's start (%[w] at its record): the 5
   lines of a Q4P record, the 9 a Q8P record can touch */
#define TILE_PREFETCH_LINE(offset) "prefetcht1 " PACKED_AHEAD_ASM "+" #offset "(%[w])\n\t"
#define TILE_PREFETCH_5                                                         \
    TILE_PREFETCH_LINE(0) TILE_PREFETCH_LINE(64) TILE_PREFETCH_LINE(128)        \
    TILE_PREFETCH_LINE(192) TILE_PREFETCH_LINE(256)
#define TILE_PREFETCH_9                                                         \
    TILE_PREFETCH_5 TILE_PREFETCH_LINE(320) TILE_PREFETCH_LINE(384)             \
    TILE_PREFETCH_LINE(448) TILE_PREFETCH_LINE(512)
/* vpmaddwd: row r's next pair of int16 inputs, broadcast, times both weight vectors (int16
   pairs); a block's first step sets the accumulators a and b, later steps add to them */
#define TILE_MADDWD_FIRST(xaddr, a, b)                                         \
    "vpbroadcastd " xaddr ", %%ymm14\n\t"                                      \
    "vpmaddwd %%ymm12, %%ymm14, %%ymm" #a "\n\t"                               \
    "vpmaddwd %%ymm13, %%ymm14, %%ymm" #b "\n\t"
#define TILE_MADDWD_NEXT(xaddr, a, b)                                          \
    "vpbroadcastd " xaddr ", %%ymm14\n\t"                                      \
    "vpmaddwd %%ymm12, %%ymm14, %%ymm15\n\t"                                   \
    "vpaddd %%ymm15, %%ymm" #a ", %%ymm" #a "\n\t"                             \
    "vpmaddwd %%ymm13, %%ymm14, %%ymm15\n\t"                                   \
    "vpaddd %%ymm15, %%ymm" #b ", %%ymm" #b "\n\t"

#endif
