/* What the kernel files declare to one another. The entry points Python calls (and program.c
   replays), the Linear struct and the recorded step's ProgramOp are declared once, in
   cpu/contract.py: the build generates contract.h from it beside these sources, so each
   definition below csrc/ is checked by the compiler against the table ctypes is given. */
#ifndef NANOKV_KERNELS_H
#define NANOKV_KERNELS_H
#include "common.h"
#include "contract.h"

#define QBLOCK 32

/* The packed kinds (Linear.kind, contract.py's LINEAR_KINDS) round their inputs to int16 per
   32, every row alike; LINEAR_F32 does not round. */
int q4p_linear(const Linear *L, const float *x, int64_t x_stride, int64_t n, float *y,
               int64_t y_stride, int threads);
void q4p_dequantize_row(const Linear *L, int64_t row, float *out);
int q8p_linear(const Linear *L, const float *x, int64_t x_stride, int64_t n, float *y,
               int64_t y_stride, int threads);
void q8p_dequantize_row(const Linear *L, int64_t row, float *out);

/* The tiled product both packed formats run (panels.c): each input row rounded once (round_row:
   row_bytes of values and row_scales floats), then tiles of up to PANEL_TILE_ROWS rows against
   panels of 16 outputs, a panel being in / 32 records of record_bytes. tile: sums[rows][16]
   (zeroed) += `rows` rounded rows (q_stride bytes and d_stride floats apart) x one panel. */
#define PANEL_TILE_ROWS 6
typedef struct {
    int64_t record_bytes, row_bytes, row_scales;
    void (*round_row)(const float *x, int64_t in, void *q, float *d);
    void (*tile)(const void *q, int64_t q_stride, const float *d, int64_t d_stride,
                 const uint8_t *panel, int64_t blocks, int rows, float *sums);
} PanelFormat;
int panel_linear(const PanelFormat *f, const Linear *L, const float *x, int64_t x_stride,
                 int64_t n, float *y, int64_t y_stride, int threads);
/* The input rounding (panels.c): one 32-block rounded to int16, q = round(x * (X16_MAX / max|x|)),
   *d = max|x| / X16_MAX; returns sum(q). */
#define X16_MAX 32767.0f
int round_block_i16(const float *x, int16_t *q, float *d);

#endif
