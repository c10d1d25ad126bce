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

#endif
