/* A fixed pool of compute threads for data-parallel loops inside one engine step. */
#ifndef MD_THREADPOOL_H
#define MD_THREADPOOL_H

/* Work function: called once per thread with its index ith in [0, nth). */
typedef void (*md_pool_fn)(void *ctx, int ith, int nth);

struct md_pool; /* opaque */

/* Start n_threads - 1 workers (the caller is thread 0). Returns NULL on failure. Workers block
 * all signals. */
struct md_pool *md_pool_new(int n_threads);
void md_pool_free(struct md_pool *p);
int md_pool_size(const struct md_pool *p);

/* Run fn on every thread and wait for all of them. Not reentrant: one caller thread only.
 * p may be NULL (runs fn(ctx, 0, 1) inline). */
void md_pool_run(struct md_pool *p, md_pool_fn fn, void *ctx);

/* The CPU seconds each thread of the pool has run so far, for its first max threads: out[0] the
 * calling thread's (call it from the thread that runs md_pool_run), out[i] worker i's. Returns
 * how many were written. A thread's CPU clock stops while it sleeps or is preempted, so the
 * largest difference over a pass is the pass's critical path: its wall time less what other
 * processes took from it. */
int md_pool_thread_cpu(const struct md_pool *p, double *out, int max);

#endif
