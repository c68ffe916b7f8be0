#include "kernels.h"

/* ---------------------------------------------------------------------------------------------
   A recorded step replayed (cpu/program.py, StepProgram): the kernel calls the torch forward
   made for a decode step of n rows, in order, with their arguments. An argument is a number, a
   float's bits or a fixed pointer (PROGRAM_FIXED), a multiple of one of the replay's scalars
   (threads, rows, the block tables' width), or an address in the step's arena or one of its
   inputs (bases[base] + value), so the same calls run on the next step's embeddings, positions,
   slots and block tables, of n rows or fewer. The decoder's layers are written once, in the
   torch model; the kernels' ids, argument layouts and this dispatch once, in cpu/contract.py
   (contract.h's PROGRAM_DISPATCH).
   ------------------------------------------------------------------------------------------ */

static inline int64_t arg(const ProgramOp *op, char *const *bases, const int64_t *scalars, int i) {
    const int64_t base = op->base[i], value = op->value[i];
    if (base == PROGRAM_FIXED) return value;
    if (base < PROGRAM_FIXED) return scalars[-2 - base] * value;
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
        PROGRAM_DISPATCH
        default: failed = 1;
        }
        if (failed) return 1;
    }
    return 0;
#undef P
#undef I
#undef F
}

/* The contract this library was built from (contract.py's contract_id): checked at load, so a
   library built from another table is never called. */
const char *nanokv_contract(void) { return NANOKV_CONTRACT_ID; }
