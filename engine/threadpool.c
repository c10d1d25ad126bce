/* A fixed pool of compute threads for data-parallel loops inside one engine step.
 *
 * DESIGN: the engine thread publishes a job (fn, ctx) and bumps a generation counter under the
 * mutex; workers wake on the condvar, run their share, and the last one to finish signals the
 * caller. Short spinning before sleeping keeps per-matmul dispatch cheap during decode, where
 * a step issues hundreds of small jobs. */
#include "engine/threadpool.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>

struct md_pool {
	int n;
	pthread_t *threads; /* owned (n - 1) */
	pthread_mutex_t mu;
	pthread_cond_t cv_work;
	pthread_cond_t cv_done;
	md_pool_fn fn;
	void *ctx;
	atomic_uint gen;
	atomic_int pending;
	bool stop;
};

struct worker_arg {
	struct md_pool *p;
	int ith;
};

static void *worker_main(void *arg)
{
	struct worker_arg wa = *(struct worker_arg *)arg;
	free(arg);
	struct md_pool *p = wa.p;
	unsigned seen = 0;
	for (;;) {
		/* Spin briefly: consecutive jobs of one step arrive microseconds apart. */
		for (int i = 0; i < 20000 && atomic_load_explicit(&p->gen, memory_order_acquire) == seen; i++)
			;
		pthread_mutex_lock(&p->mu);
		while (atomic_load(&p->gen) == seen && !p->stop)
			pthread_cond_wait(&p->cv_work, &p->mu);
		if (p->stop) {
			pthread_mutex_unlock(&p->mu);
			return NULL;
		}
		seen = atomic_load(&p->gen);
		md_pool_fn fn = p->fn;
		void *ctx = p->ctx;
		pthread_mutex_unlock(&p->mu);

		fn(ctx, wa.ith, p->n);

		if (atomic_fetch_sub(&p->pending, 1) == 1) {
			pthread_mutex_lock(&p->mu);
			pthread_cond_signal(&p->cv_done);
			pthread_mutex_unlock(&p->mu);
		}
	}
}

struct md_pool *md_pool_new(int n_threads)
{
	if (n_threads < 1)
		n_threads = 1;
	struct md_pool *p = calloc(1, sizeof(*p));
	if (!p)
		return NULL;
	p->n = n_threads;
	pthread_mutex_init(&p->mu, NULL);
	pthread_cond_init(&p->cv_work, NULL);
	pthread_cond_init(&p->cv_done, NULL);
	atomic_init(&p->gen, 0);
	atomic_init(&p->pending, 0);
	p->threads = calloc((size_t)n_threads, sizeof(pthread_t));
	if (!p->threads) {
		free(p);
		return NULL;
	}
	sigset_t all, old;
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old);
	int started = 0;
	for (int i = 1; i < n_threads; i++) {
		struct worker_arg *wa = malloc(sizeof(*wa));
		if (!wa)
			break;
		wa->p = p;
		wa->ith = i;
		if (pthread_create(&p->threads[i - 1], NULL, worker_main, wa) != 0) {
			free(wa);
			break;
		}
		started++;
	}
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (started != n_threads - 1) {
		p->n = started + 1;
		md_pool_free(p);
		return NULL;
	}
	return p;
}

void md_pool_free(struct md_pool *p)
{
	if (!p)
		return;
	pthread_mutex_lock(&p->mu);
	p->stop = true;
	pthread_cond_broadcast(&p->cv_work);
	pthread_mutex_unlock(&p->mu);
	for (int i = 1; i < p->n; i++)
		pthread_join(p->threads[i - 1], NULL);
	pthread_mutex_destroy(&p->mu);
	pthread_cond_destroy(&p->cv_work);
	pthread_cond_destroy(&p->cv_done);
	free(p->threads);
	free(p);
}

int md_pool_size(const struct md_pool *p)
{
	return p ? p->n : 1;
}

void md_pool_run(struct md_pool *p, md_pool_fn fn, void *ctx)
{
	if (!p || p->n == 1) {
		fn(ctx, 0, 1);
		return;
	}
	pthread_mutex_lock(&p->mu);
	p->fn = fn;
	p->ctx = ctx;
	atomic_store(&p->pending, p->n - 1);
	atomic_fetch_add_explicit(&p->gen, 1, memory_order_release);
	pthread_cond_broadcast(&p->cv_work);
	pthread_mutex_unlock(&p->mu);

	fn(ctx, 0, p->n);

	for (int i = 0; i < 20000 && atomic_load(&p->pending) > 0; i++)
		;
	if (atomic_load(&p->pending) > 0) {
		pthread_mutex_lock(&p->mu);
		while (atomic_load(&p->pending) > 0)
			pthread_cond_wait(&p->cv_done, &p->mu);
		pthread_mutex_unlock(&p->mu);
	}
}
