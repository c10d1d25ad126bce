/* A fixed pool of compute threads for data-parallel loops inside one engine step.
 *
 * DESIGN: a decode step issues about a hundred short jobs (one per matmul, attention, norm),
 * microseconds apart, so dispatch must cost far less than a futex round trip. The caller
 * publishes (fn, ctx) and bumps a generation counter; workers spin on the counter (with a
 * pause instruction) for up to SPIN_NS after their last job and only then sleep on a condvar.
 * The caller wakes sleepers only when some are asleep, and waits for the last worker the same
 * way: spin first, sleep after. Idle, the pool sleeps: the spin is bounded in time, not in
 * iterations, so it means the same on fast and slow machines.
 *
 * Lost wake-ups cannot happen: a sleeper registers (sleepers++, seq_cst) and then re-reads
 * the generation under the mutex; the caller bumps the generation (seq_cst) and then reads
 * sleepers. One of the two sees the other's write. The done side pairs pending and
 * caller_waiting the same way. */
#include "engine/kern/threadpool.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

/* How long a thread spins for the next job (or the caller for the last worker) before it
 * sleeps. The jobs of one step come microseconds apart; between steps the engine thread
 * samples and posts events (tens of microseconds on a small vocabulary, ~0.4 ms on 150 k).
 * Measured with bench/bench_ttft_load.py (default model, 4 streams plus TTFT probes, 2
 * threads on 2 cores, alternated runs): on a quiet machine 100 us and 2 ms gave the same
 * tokens/s (1.10x for 100 us) and TTFT (2.0 vs 1.5 ms), both ahead of no spin (2 ms vs none:
 * 1.35x tokens/s); with other CPU-bound processes on the machine a 2 ms spin fell to 1/5-1/70
 * of the tokens/s of the others and TTFT rose to 20-200 ms, while 100 us lost 2-4x to no spin
 * there. Yielding between spin rounds and shrinking the spin on detected preemption were
 * tried and helped less. 100 us keeps the quiet-machine speed and bounds the damage when
 * the cores are oversubscribed. Single-stream decode of a 1 GB Q8_0 model (moed-bench -t 2
 * -n 32, alternated): 182-192 tok/s at 100 us, 116-184 at 2 ms. (An older note: 20 k iterations without pause, ~30 us, let
 * workers fall asleep between jobs and cost ~10% of decode tokens/s.) */
#define SPIN_NS 100000LL

/* MOED_POOL_SPIN_US overrides SPIN_NS for measurements (read once per pool). */
static int64_t spin_ns = SPIN_NS;

struct md_pool {
	int n;
	pthread_t *threads; /* owned (n - 1) */
	clockid_t *clocks;  /* owned (n - 1): the workers' CPU-time clocks */
	pthread_mutex_t mu;
	pthread_cond_t cv_work;
	pthread_cond_t cv_done;
	md_pool_fn fn;      /* written before gen is bumped, read after it is seen */
	void *ctx;
	atomic_uint gen;
	atomic_int pending;  /* workers still running the current job */
	atomic_int sleepers; /* workers asleep (or about to sleep) on cv_work */
	atomic_bool caller_waiting;
	atomic_bool stop;
};

struct worker_arg {
	struct md_pool *p;
	int ith;
};

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* A time-bounded spin: call spin_expired() once per turn of a wait loop; it pauses the CPU
 * and, every 256 turns, says whether SPIN_NS have passed since the first turn. */
struct spin {
	unsigned i;
	int64_t t0;
};

static bool spin_expired(struct spin *s)
{
	cpu_relax();
	if ((s->i++ & 255) != 0)
		return false;
	int64_t t = now_ns();
	if (!s->t0)
		s->t0 = t;
	return t - s->t0 > spin_ns;
}

/* Spin until gen differs from seen or stop is set, for at most SPIN_NS. True when it did. */
static bool spin_for_job(struct md_pool *p, unsigned seen)
{
	struct spin s = { 0, 0 };
	while (atomic_load_explicit(&p->gen, memory_order_acquire) == seen &&
	       !atomic_load_explicit(&p->stop, memory_order_relaxed))
		if (spin_expired(&s))
			return false;
	return true;
}

static void *worker_main(void *arg)
{
	struct worker_arg wa = *(struct worker_arg *)arg;
	free(arg);
	struct md_pool *p = wa.p;
	unsigned seen = 0;
	for (;;) {
		if (!spin_for_job(p, seen)) {
			pthread_mutex_lock(&p->mu);
			atomic_fetch_add(&p->sleepers, 1);
			while (atomic_load(&p->gen) == seen && !atomic_load(&p->stop))
				pthread_cond_wait(&p->cv_work, &p->mu);
			atomic_fetch_sub(&p->sleepers, 1);
			pthread_mutex_unlock(&p->mu);
		}
		if (atomic_load(&p->stop))
			return NULL;
		seen = atomic_load_explicit(&p->gen, memory_order_acquire);
		p->fn(p->ctx, wa.ith, p->n);

		if (atomic_fetch_sub(&p->pending, 1) == 1 && atomic_load(&p->caller_waiting)) {
			pthread_mutex_lock(&p->mu);
			pthread_cond_signal(&p->cv_done);
			pthread_mutex_unlock(&p->mu);
		}
	}
}

struct md_pool *md_pool_new(int n_threads)
{
	const char *env = getenv("MOED_POOL_SPIN_US");
	if (env && *env)
		spin_ns = strtoll(env, NULL, 10) * 1000;
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
	atomic_init(&p->sleepers, 0);
	atomic_init(&p->caller_waiting, false);
	atomic_init(&p->stop, false);
	p->threads = calloc((size_t)n_threads, sizeof(pthread_t));
	p->clocks = calloc((size_t)n_threads, sizeof(clockid_t));
	if (!p->threads || !p->clocks) {
		free(p->threads);
		free(p->clocks);
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
		if (pthread_getcpuclockid(p->threads[i - 1], &p->clocks[i - 1]) != 0)
			p->clocks[i - 1] = (clockid_t)-1;
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
	atomic_store(&p->stop, true);
	pthread_cond_broadcast(&p->cv_work);
	pthread_mutex_unlock(&p->mu);
	for (int i = 1; i < p->n; i++)
		pthread_join(p->threads[i - 1], NULL);
	pthread_mutex_destroy(&p->mu);
	pthread_cond_destroy(&p->cv_work);
	pthread_cond_destroy(&p->cv_done);
	free(p->threads);
	free(p->clocks);
	free(p);
}

static double seconds(clockid_t id)
{
	struct timespec ts;
	if (id == (clockid_t)-1 || clock_gettime(id, &ts) != 0)
		return 0;
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

int md_pool_thread_cpu(const struct md_pool *p, double *out, int max)
{
	int n = md_pool_size(p) < max ? md_pool_size(p) : max;
	if (n > 0)
		out[0] = seconds(CLOCK_THREAD_CPUTIME_ID);
	for (int i = 1; i < n; i++)
		out[i] = seconds(p->clocks[i - 1]);
	return n;
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
	p->fn = fn;
	p->ctx = ctx;
	atomic_store(&p->pending, p->n - 1);
	atomic_fetch_add(&p->gen, 1); /* seq_cst: publishes fn/ctx, ordered before sleepers */
	if (atomic_load(&p->sleepers) > 0) {
		pthread_mutex_lock(&p->mu);
		pthread_cond_broadcast(&p->cv_work);
		pthread_mutex_unlock(&p->mu);
	}

	fn(ctx, 0, p->n);

	struct spin s = { 0, 0 };
	while (atomic_load_explicit(&p->pending, memory_order_acquire) > 0) {
		if (!spin_expired(&s))
			continue;
		pthread_mutex_lock(&p->mu);
		atomic_store(&p->caller_waiting, true);
		while (atomic_load(&p->pending) > 0)
			pthread_cond_wait(&p->cv_done, &p->mu);
		atomic_store(&p->caller_waiting, false);
		pthread_mutex_unlock(&p->mu);
		break;
	}
}
