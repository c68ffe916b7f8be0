/* The machine's read bandwidth, for the benchmarks' rooflines (scripts/common.py): one pass
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

/* Lanes folded side by side: 32 words (256 bytes, four cache lines) a turn, so that the vector
   XORs of a turn do not wait on one another. With one fold (a single chain of XORs) and no
   look-ahead, this probe read 6.5-7.0 GB/s at one thread on a Xeon where it now reads 12-13
   (and the Q4 kernels 10-11): a probe that reads slower than the kernels bounds nothing. */
#define PROBE_LANES 32
/* Bytes ahead of the loads that a turn asks the cache for: a core's own streams of misses, not
   only the hardware prefetcher's, keep more lines in flight. */
#define PROBE_AHEAD 1024

static void read_chunk(void *arg, int64_t item) {
    const ReadJob *j = arg;
    const int64_t begin = item * j->chunk;
    const int64_t end = begin + j->chunk < j->count ? begin + j->chunk : j->count;
    uint64_t lanes[PROBE_LANES] = {0};
    int64_t i = begin;
    for (; i + PROBE_LANES <= end; i += PROBE_LANES) {
        for (int line = 0; line < PROBE_LANES * 8; line += 64)
            __builtin_prefetch((const char *)(j->words + i) + PROBE_AHEAD + line, 0, 3);
        #pragma omp simd
        for (int k = 0; k < PROBE_LANES; k++) lanes[k] ^= j->words[i + k];
    }
    uint64_t fold = 0;
    for (; i < end; i++) fold ^= j->words[i];
    for (int k = 0; k < PROBE_LANES; k++) fold ^= lanes[k];
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
