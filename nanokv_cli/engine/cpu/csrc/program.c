#include "common.h"

/* ---------------------------------------------------------------------------------------------
   A recorded step replayed (cpu/kernels.py, StepProgram): the kernel calls the torch forward
   made for a decode step of n rows, in order, with their arguments. An argument is a number, a
   float's bits or a fixed pointer (FIXED), a multiple of one of the replay's scalars (threads,
   rows, the block tables' width), or an address in the step's arena or one of its inputs
   (bases[base] + value), so the same calls run on the next step's embeddings, positions, slots
   and block tables, of n rows or fewer. The decoder's layers are written once, in the torch
   model.
   ------------------------------------------------------------------------------------------ */

#define PROGRAM_ARGS 17
typedef struct {
    int64_t kernel, base[PROGRAM_ARGS], value[PROGRAM_ARGS];
} ProgramOp;

/* kernels.py's _PROGRAM_KERNELS, in its order */
enum { RMS_NORM, ROTARY, STORE_KV, ATTENTION, SILU_MUL, LINEAR };

#define FIXED (-1)

/* scalars: the replay's thread count, rows and block tables' width */
static inline int64_t arg(const ProgramOp *op, char *const *bases, const int64_t *scalars, int i) {
    const int64_t base = op->base[i], value = op->value[i];
    if (base == FIXED) return value;
    if (base < FIXED) return scalars[-2 - base] * value;
    return (int64_t)(intptr_t)(bases[base] + value);
}

static inline float arg_float(const ProgramOp *op, int i) {
    union { int32_t i; float f; } bits = {(int32_t)op->value[i]};
    return bits.f;
}

/* Returns nonzero if a kernel could not allocate its buffers (or an op is unknown). */
int run_program(const ProgramOp *ops, int64_t count, char *const *bases, const int64_t *scalars) {
#define P(i) ((void *)(intptr_t)arg(op, bases, scalars, i))
#define I(i) arg(op, bases, scalars, i)
#define F(i) arg_float(op, i)
    for (const ProgramOp *op = ops; op < ops + count; op++) {
        int failed = 0;
        switch (op->kernel) {
        case RMS_NORM:
            rms_norm_f32(P(0), I(1), P(2), I(3), P(4), I(5), I(6), I(7), F(8), P(9), I(10), (int)I(11));
            break;
        case ROTARY: rotary_f32(P(0), I(1), I(2), I(3), I(4), P(5), P(6), (int)I(7)); break;
        case STORE_KV:
            store_kv_f32(P(0), I(1), P(2), I(3), P(4), I(5), I(6), P(7), P(8), (int)I(9), (int)I(10));
            break;
        case ATTENTION:
            failed = paged_decode_f32(P(0), I(1), P(2), P(3), P(4), P(5), I(6), I(7), I(8), I(9), I(10),
                                      I(11), F(12), P(13), I(14), (int)I(15), (int)I(16));
            break;
        case SILU_MUL: silu_mul_f32(P(0), I(1), I(2), P(3), (int)I(4)); break;
        case LINEAR: failed = linear_f32(P(0), P(1), I(2), I(3), P(4), I(5), (int)I(6)); break;
        default: failed = 1;
        }
        if (failed) return 1;
    }
    return 0;
#undef P
#undef I
#undef F
}
