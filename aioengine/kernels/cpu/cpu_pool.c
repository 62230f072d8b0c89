/* How the C kernels split a call's units of work between OpenMP threads: each thread takes units from the
 * front of its own contiguous range, and a thread done with its range takes the others' from the back.
 *
 * Why not OpenMP's static split: on a machine the event loop and the HTTP server share with the worker, the
 * OS preempts one of a kernel's threads for a few ms at a time, and a static split waits for that thread's
 * whole share; here the others take what it has not started. (The region's join still waits for it to
 * check in. A pool of threads of our own, which would not, ran a decode step 1.5x slower: torch's OpenMP
 * threads spin beside it after every torch op; docs/benchmarks.md.) The contiguous ranges keep what a
 * static split gives: each thread streams its own part of a weight, and can prefetch its next panel.
 * Which thread computes a unit never changes its bits. */
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>

#include "cpu_kernels.h"

typedef struct {
    _Alignas(64) _Atomic uint64_t word; /* the range's next unit in the high 32 bits, its end in the low 32 */
} pool_range;

static _Atomic int held = -1; /* the tests' stand-in for a thread the OS does not run: it claims nothing */

/* One unit from range r: its front, or its back; -1 when it has none. */
static int64_t take(pool_range *r, int back) {
    uint64_t w = atomic_load_explicit(&r->word, memory_order_relaxed);
    for (;;) {
        const uint64_t front = w >> 32, end = w & 0xffffffffu;
        if (front >= end) return -1;
        const uint64_t next = back ? (front << 32 | (end - 1)) : ((front + 1) << 32 | end);
        if (atomic_compare_exchange_weak_explicit(&r->word, &w, next, memory_order_relaxed, memory_order_relaxed))
            return (int64_t)(back ? end - 1 : front);
    }
}

void pool_run(pool_body body, void *ctx, int64_t units, int threads) {
    if (units <= 0) return;
    if (threads <= 1 || units == 1 || omp_in_parallel()) {
        for (int64_t u = 0; u < units; u++) body(ctx, u, 0, 0);
        return;
    }
    threads = threads > 256 ? 256 : threads;
    /* range units of `group` units each, so that a range's bounds fit in 32 bits */
    const int64_t group = units / 0x7fffffff + 1, range_units = (units + group - 1) / group;
    pool_range ranges[threads];
    for (int t = 0; t < threads; t++)
        atomic_init(&ranges[t].word, (uint64_t)(range_units * t / threads) << 32 |
                                         (uint64_t)(range_units * (t + 1) / threads));
#pragma omp parallel num_threads(threads)
    {
        const int slot = omp_get_thread_num(); /* a smaller team than asked for takes the rest's ranges too */
        for (int i = 0; slot != atomic_load_explicit(&held, memory_order_relaxed) && i < threads; i++) {
            const int r = (slot + i) % threads, stolen = i > 0;
            for (int64_t u; (u = take(&ranges[r], stolen)) >= 0;) {
                const int64_t v1 = (u + 1) * group < units ? (u + 1) * group : units;
                for (int64_t v = u * group; v < v1; v++) body(ctx, v, slot, stolen);
            }
        }
    }
}

int64_t pool_static_end(int64_t units, int threads, int slot) { return units * (slot + 1) / threads; }

/* For the tests: OpenMP thread `slot` (>= 1) stops claiming units; -1 lets it again. */
void pool_hold(int slot) { atomic_store(&held, slot); }

typedef struct {
    _Atomic int32_t *counts;
    int32_t *slots, *stolen;
} count_job;

static void count_unit(void *arg, int64_t u, int slot, int stolen) {
    const count_job *a = arg;
    atomic_fetch_add_explicit(&a->counts[u], 1, memory_order_relaxed);
    a->slots[u] = slot, a->stolen[u] = stolen;
}

/* For the tests: one call over `units` units that records, per unit, how many times it ran, on which
 * thread, and whether it was stolen. */
void pool_count(int64_t units, int threads, int32_t *counts, int32_t *slots, int32_t *stolen) {
    count_job a = {(_Atomic int32_t *)counts, slots, stolen};
    pool_run(count_unit, &a, units, threads);
}
