/* Back-to-back jobs on csrc/pool.c, as a replayed step issues them (no Python between two):
   each job's items must run exactly once, on that job, before run_tasks returns. Jobs
   alternate in size and function, and each lives on the caller's stack, which the next job
   reuses; a helper that wakes late for one job and runs an item of the next, or finishes an
   item after its caller returned, shows as a count that is not 1.
   Usage: pool_stress ROUNDS THREADS; prints the bad counts and exits nonzero if any. */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef void (*task_fn)(void *ctx, int64_t item);
void run_tasks(int64_t items, int threads, task_fn fn, void *ctx);

#define MAX_ITEMS 64
typedef struct {
    int64_t items;
    _Atomic int runs[MAX_ITEMS];
} Job;

static _Atomic long bad;

static void count(void *ctx, int64_t item) {
    Job *job = ctx;
    if (item < 0 || item >= job->items)
        atomic_fetch_add(&bad, 1);
    else
        atomic_fetch_add(&job->runs[item], 1);
    for (volatile int spin = 0; spin < item * 37 % 200; spin++) {
    }
}

static void count_too(void *ctx, int64_t item) { count(ctx, item); }

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    const long rounds = atol(argv[1]);
    const int threads = atoi(argv[2]);
    for (long r = 0; r < rounds; r++) {
        Job job = {.items = 2 + r * 7 % (MAX_ITEMS - 2)};
        for (int i = 0; i < MAX_ITEMS; i++) atomic_store(&job.runs[i], 0);
        run_tasks(job.items, threads, r % 2 ? count : count_too, &job);
        for (int i = 0; i < MAX_ITEMS; i++)
            if (atomic_load(&job.runs[i]) != (i < job.items)) atomic_fetch_add(&bad, 1);
        /* what the caller's next stack frame would write over this one */
        job.items = 0;
        for (int i = 0; i < MAX_ITEMS; i++) atomic_store(&job.runs[i], 1000);
    }
    printf("%ld bad counts in %ld jobs\n", (long)atomic_load(&bad), rounds);
    return atomic_load(&bad) != 0;
}
