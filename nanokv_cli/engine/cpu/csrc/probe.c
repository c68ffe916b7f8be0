/* The machine's read bandwidth, for the benchmarks' rooflines (scripts/roofline.py): one pass
   over a buffer well past the last-level cache, as a decode step streams its weights. Each
   thread folds its chunks' 64-bit words together (an XOR the compiler vectorises, so the loop
   waits on memory, not on arithmetic) and the result is returned, so no read can be dropped. */
#include "kernels.h"

/* Chunks per thread: a thread held up by another process delays only a part of the pass. */
#define PROBE_CHUNKS_PER_THREAD 8

typedef struct {
    const uint64_t *words;
    int64_t count, chunk;
    uint64_t *folds;
} ReadJob;

static void read_chunk(void *arg, int64_t item) {
    const ReadJob *j = arg;
    const int64_t begin = item * j->chunk;
    const int64_t end = begin + j->chunk < j->count ? begin + j->chunk : j->count;
    uint64_t fold = 0;
    #pragma omp simd reduction(^:fold)
    for (int64_t i = begin; i < end; i++) fold ^= j->words[i];
    j->folds[item] = fold;
}

uint64_t read_probe(const uint8_t *buf, int64_t bytes, int threads) {
    const int64_t items = (int64_t)(threads > 0 ? threads : 1) * PROBE_CHUNKS_PER_THREAD;
    uint64_t folds[items];
    ReadJob job = {(const uint64_t *)buf, bytes / 8, (bytes / 8 + items - 1) / items, folds};
    run_tasks(items, threads, read_chunk, &job);
    uint64_t fold = 0;
    for (int64_t i = 0; i < items; i++) fold ^= folds[i];
    return fold;
}
