#include "common.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

/* ---------------------------------------------------------------------------------------------
   The threads every parallel kernel runs on: run_tasks(items, threads, fn, ctx) calls
   fn(ctx, i) once for each i < items, on the calling thread and up to threads - 1 helpers.

   Why not OpenMP: a parallel region ends at a barrier that waits for every thread of the
   team, so on a shared machine one helper descheduled by another process stalls the caller
   for a scheduler time slice (milliseconds) per region, hundreds of times per token. Here the
   items go to whichever thread claims them first, and the caller waits only for items a
   helper has already started: a helper that never got a CPU costs nothing, and the caller,
   running alone, does the work at one thread's speed.

   Helpers poll a short while for the next job (a decode step issues one every ~20 us), then
   sleep on a condition variable. One job runs at a time; a second caller (another Python
   thread) runs its items on its own thread rather than wait.
   ------------------------------------------------------------------------------------------ */

#define POOL_MAX_HELPERS 63
/* Polling before a helper sleeps, or before the caller sleeps waiting for a started item:
   ~3 ms here, long enough to bridge the gap between two tokens (the engine's Python between
   two decode steps: with ~0.7 ms the helpers fell asleep there, and a quiet 2-thread decode
   lost ~8%). Every fourth poll yields the core: where no other thread wants it sched_yield
   returns at once, and where another process does, that process runs instead of a helper
   with nothing to do, so the caller keeps a core of its own (three busy threads on two cores
   would give it two thirds of one). */
#define POOL_SPINS 16384

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t wake, finished;
    pthread_mutex_t caller; /* held by the thread whose job is running */
    int started;            /* helper threads created */
    _Atomic int sleepers, waiting;
    /* the current job: its generation in the high 32 bits of `claim`, the next unclaimed item
       in the low 32 (CLOSED while the caller writes the fields below) */
    _Atomic uint64_t claim;
    _Atomic int64_t items, done;
    _Atomic int helpers; /* helpers this job may use: the first `threads - 1` */
    _Atomic(task_fn) fn;
    _Atomic(void *) ctx;
} Pool;

static Pool pool = {
    .lock = PTHREAD_MUTEX_INITIALIZER,
    .wake = PTHREAD_COND_INITIALIZER,
    .finished = PTHREAD_COND_INITIALIZER,
    .caller = PTHREAD_MUTEX_INITIALIZER,
};

static inline void poll_pause(int spin) {
    if (spin % 4 == 0) {
        sched_yield();
        return;
    }
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* A generation whose items cannot be claimed: the caller's state while it writes a job's
   fields, so that no helper claims an item of a job it has read half of. */
#define CLOSED 0xFFFFFFFFu

/* Claims and runs items of job `generation` until none is left. A claim succeeds only while
   that job is current, and the compare-and-swap checks the fields read before it as a
   seqlock's reader checks its sequence: a helper that wakes late, while the caller writes the
   next job, may read some of the new fields, but the caller closed `claim` for the new
   generation first, so that helper's claim fails. (Without the close, such a helper ran the
   new job's function on an item past the old job's end, before the new job was published,
   and counted it done: the caller returned while the item still ran on its stack frame.) */
static void work_on(uint32_t generation) {
    uint64_t seen = atomic_load_explicit(&pool.claim, memory_order_acquire);
    const task_fn fn = atomic_load_explicit(&pool.fn, memory_order_relaxed);
    void *ctx = atomic_load_explicit(&pool.ctx, memory_order_relaxed);
    const int64_t items = atomic_load_explicit(&pool.items, memory_order_relaxed);
    atomic_thread_fence(memory_order_acquire);
    for (;;) {
        const int64_t item = (int64_t)(seen & 0xFFFFFFFFu);
        if ((uint32_t)(seen >> 32) != generation || item >= items) return;
        if (!atomic_compare_exchange_weak_explicit(&pool.claim, &seen, seen + 1,
                                                   memory_order_acq_rel, memory_order_acquire))
            continue;
        fn(ctx, item);
        if (atomic_fetch_add(&pool.done, 1) + 1 == items && atomic_load(&pool.waiting)) {
            pthread_mutex_lock(&pool.lock);
            pthread_cond_broadcast(&pool.finished);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = atomic_load_explicit(&pool.claim, memory_order_acquire);
    }
}

static void *helper_main(void *arg) {
    const int index = (int)(intptr_t)arg;
    uint32_t seen = (uint32_t)(atomic_load(&pool.claim) >> 32);
    for (;;) {
        uint32_t generation = (uint32_t)(atomic_load(&pool.claim) >> 32);
        for (int spin = 0; generation == seen && spin < POOL_SPINS; spin++) {
            poll_pause(spin);
            generation = (uint32_t)(atomic_load_explicit(&pool.claim, memory_order_acquire) >> 32);
        }
        if (generation == seen) {
            pthread_mutex_lock(&pool.lock);
            atomic_fetch_add(&pool.sleepers, 1);
            while ((generation = (uint32_t)(atomic_load(&pool.claim) >> 32)) == seen)
                pthread_cond_wait(&pool.wake, &pool.lock);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = generation;
        /* a job being written is a few stores away: wait for it rather than skip it, yielding
           as other polls do, in case its caller lost the core mid-write */
        for (int spin = 1; atomic_load_explicit(&pool.claim, memory_order_acquire) ==
                           ((uint64_t)generation << 32 | CLOSED); spin++)
            poll_pause(spin);
        if (index < atomic_load_explicit(&pool.helpers, memory_order_relaxed)) work_on(generation);
    }
    return NULL;
}

/* A forked child has none of the parent's helpers (and maybe a lock held by a thread that
   no longer exists): it starts afresh. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pthread_mutex_init(&pool.caller, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.finished, NULL);
    pool.started = 0;
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.waiting, 0);
}

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
static void pool_init(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

/* Called with pool.caller held. Helpers that cannot be created are simply not there. */
static int ensure_helpers(int wanted) {
    wanted = wanted > POOL_MAX_HELPERS ? POOL_MAX_HELPERS : wanted;
    while (pool.started < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&thread, &attr, helper_main, (void *)(intptr_t)pool.started);
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.started++;
    }
    return pool.started < wanted ? pool.started : wanted;
}

void run_tasks(int64_t items, int threads, task_fn fn, void *ctx) {
    if (items <= 0) return;
    pthread_once(&pool_once, pool_init);
    if (threads <= 1 || items == 1 || items >= CLOSED || pthread_mutex_trylock(&pool.caller) != 0) {
        for (int64_t i = 0; i < items; i++) fn(ctx, i);
        return;
    }
    const int helpers = ensure_helpers(threads - 1);
    const uint32_t generation = (uint32_t)(atomic_load(&pool.claim) >> 32) + 1;
    atomic_store(&pool.claim, (uint64_t)generation << 32 | CLOSED);
    atomic_thread_fence(memory_order_release);
    atomic_store_explicit(&pool.helpers, helpers, memory_order_relaxed);
    atomic_store_explicit(&pool.fn, fn, memory_order_relaxed);
    atomic_store_explicit(&pool.ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&pool.items, items, memory_order_relaxed);
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    atomic_store(&pool.claim, (uint64_t)generation << 32);
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    work_on(generation);
    /* Every item is claimed; wait for those a helper is still running. */
    for (int spin = 0; atomic_load(&pool.done) < items && spin < POOL_SPINS; spin++) poll_pause(spin);
    if (atomic_load(&pool.done) < items) {
        pthread_mutex_lock(&pool.lock);
        atomic_store(&pool.waiting, 1);
        while (atomic_load(&pool.done) < items) pthread_cond_wait(&pool.finished, &pool.lock);
        atomic_store(&pool.waiting, 0);
        pthread_mutex_unlock(&pool.lock);
    }
    pthread_mutex_unlock(&pool.caller);
}

typedef struct {
    rows_fn fn;
    void *ctx;
    int64_t rows, parts;
} RowsJob;

static void rows_part(void *arg, int64_t part) {
    const RowsJob *j = arg;
    j->fn(j->ctx, j->rows * part / j->parts, j->rows * (part + 1) / j->parts);
}

void run_rows(int64_t rows, int64_t work, int threads, rows_fn fn, void *ctx) {
    if (rows <= 0) return;
    if (threads <= 1 || work < 65536 || rows == 1) {
        fn(ctx, 0, rows);
        return;
    }
    RowsJob job = {fn, ctx, rows, 4 * (int64_t)threads < rows ? 4 * (int64_t)threads : rows};
    run_tasks(job.parts, threads, rows_part, &job);
}
