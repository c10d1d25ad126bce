/* The simulated device backend (backend_sim.h). */
#include "engine/backend_sim.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/kern/matmul.h"
#include "engine/kern/threadpool.h"

#define MAX_FENCES 4096 /* ring of fence times; older ids count as passed */

struct alloc_hdr {
	size_t size;
	size_t pad[7]; /* keeps the data 64-byte aligned after the header */
};

struct sim {
	size_t capacity, used;
	double bps;                      /* copies, bytes per second (0: instant) */
	double compute_bps;              /* matmul, weight bytes per second (0: as fast as the
					  * host computes it) */
	double busy[MD_BACKEND_STREAMS]; /* clock time each stream's queue drains */
	double fence_t[MAX_FENCES];      /* fence id % MAX_FENCES -> its completion time */
	uint64_t next_fence;             /* last id handed out */
	unsigned long copies;
	struct md_pool *pool;            /* owned: the "device" compute threads */
	void *scratch;                   /* owned */
	size_t scratch_bytes;
};

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static struct sim *S(const struct md_backend *b)
{
	return b->_ctx;
}

static int sim_device_count(const struct md_backend *b)
{
	(void)b;
	return 1;
}

static int sim_device_info(const struct md_backend *b, int dev, struct md_backend_device *out)
{
	if (dev != 0)
		return -ENODEV;
	memset(out, 0, sizeof(*out));
	strcpy(out->name, "simulated device (host memory)");
	out->n_sm = 1;
	out->mem_total = S(b)->capacity;
	out->mem_free = S(b)->capacity - S(b)->used;
	return 0;
}

static int sim_alloc(struct md_backend *b, size_t size, void **dptr)
{
	struct sim *s = S(b);
	*dptr = NULL;
	if (size == 0)
		return -EINVAL;
	if (size > s->capacity - s->used)
		return -ENOMEM;
	struct alloc_hdr *h;
	if (posix_memalign((void **)&h, 4096, sizeof(*h) + size))
		return -ENOMEM;
	h->size = size;
	s->used += size;
	*dptr = h + 1;
	return 0;
}

static void sim_free(struct md_backend *b, void *dptr)
{
	if (!dptr)
		return;
	struct alloc_hdr *h = (struct alloc_hdr *)dptr - 1;
	S(b)->used -= h->size;
	free(h);
}

/* Queue a copy of size bytes on stream: done at once, complete at the stream's new time. */
static void copy_on(struct sim *s, void *dst, const void *src, size_t size, int stream)
{
	memcpy(dst, src, size);
	double t = now_s();
	if (s->busy[stream] < t)
		s->busy[stream] = t;
	if (s->bps > 0)
		s->busy[stream] += (double)size / s->bps;
	s->copies++;
}

static void sleep_until(double t)
{
	double d = t - now_s();
	if (d <= 0)
		return;
	struct timespec ts = { (time_t)d, (long)((d - (double)(time_t)d) * 1e9) };
	while (nanosleep(&ts, &ts) && errno == EINTR)
		;
}

static int sim_upload(struct md_backend *b, void *dst, const void *src, size_t size)
{
	copy_on(S(b), dst, src, size, MD_BACKEND_STREAM_COMPUTE);
	sleep_until(S(b)->busy[MD_BACKEND_STREAM_COMPUTE]);
	return 0;
}

static int sim_download(struct md_backend *b, void *dst, const void *src, size_t size)
{
	return sim_upload(b, dst, src, size);
}

static int sim_host_alloc(struct md_backend *b, size_t size, void **hptr)
{
	(void)b;
	*hptr = NULL;
	if (size == 0)
		return -EINVAL;
	return posix_memalign(hptr, 4096, size) ? -ENOMEM : 0;
}

static void sim_host_free(struct md_backend *b, void *hptr)
{
	(void)b;
	free(hptr);
}

static int sim_upload_async(struct md_backend *b, void *dst, const void *src, size_t size,
			    int stream)
{
	if (stream < 0 || stream >= MD_BACKEND_STREAMS)
		return -EINVAL;
	if (size)
		copy_on(S(b), dst, src, size, stream);
	return 0;
}

static int sim_fence_record(struct md_backend *b, int stream, uint64_t *fence)
{
	struct sim *s = S(b);
	if (stream < 0 || stream >= MD_BACKEND_STREAMS)
		return -EINVAL;
	uint64_t id = ++s->next_fence;
	s->fence_t[id % MAX_FENCES] = s->busy[stream];
	*fence = id;
	return 0;
}

/* The fence's time, 0 when long passed, -1 for an id never returned. */
static double fence_time(const struct sim *s, uint64_t fence)
{
	if (fence == 0 || fence > s->next_fence)
		return -1;
	if (s->next_fence - fence >= MAX_FENCES)
		return 0;
	return s->fence_t[fence % MAX_FENCES];
}

static int sim_fence_wait(struct md_backend *b, uint64_t fence)
{
	double t = fence_time(S(b), fence);
	if (t < 0)
		return -EINVAL;
	sleep_until(t);
	return 0;
}

static int sim_fence_done(struct md_backend *b, uint64_t fence)
{
	double t = fence_time(S(b), fence);
	if (t < 0)
		return -EINVAL;
	return now_s() >= t;
}

static bool sim_supports(const struct md_backend *b, enum md_dtype t)
{
	(void)b;
	const struct md_dtype_info *i = md_dtype_info(t);
	return i && i->supported;
}

static int sim_matmul_now(struct md_backend *b, const struct md_mat *w, const float *x,
			  int n_tok, float *y);

/* A matmul takes at least its weight bytes at the compute rate: a device reading its memory
 * at that speed (the math itself is the host's, so the outputs are the host's bit for bit). */
static int sim_matmul(struct md_backend *b, const struct md_mat *w, const float *x, int n_tok,
		      float *y)
{
	struct sim *s = S(b);
	double t0 = now_s();
	int rc = sim_matmul_now(b, w, x, n_tok, y);
	if (!rc && s->compute_bps > 0)
		sleep_until(t0 + (double)w->nb1 * (double)w->n_out / s->compute_bps);
	return rc;
}

static int sim_matmul_now(struct md_backend *b, const struct md_mat *w, const float *x,
			  int n_tok, float *y)
{
	struct sim *s = S(b);
	if (n_tok < 1 || !sim_supports(b, w->type))
		return -EINVAL;
	if (md_matmul_experts_ok(w, 1)) {
		size_t need = md_matmul_experts_scratch_bytes(w->n_in, n_tok, n_tok);
		if (need > s->scratch_bytes) {
			void *p = realloc(s->scratch, need);
			if (!p)
				return -ENOMEM;
			s->scratch = p;
			s->scratch_bytes = need;
		}
		const int32_t off[2] = { 0, n_tok };
		float *const ys[1] = { y };
		md_matmul_experts(s->pool, w, 1, 1, off, x, n_tok, NULL, ys, s->scratch);
		return 0;
	}
	size_t need = md_matmul_scratch_floats(s->pool, w->n_in, n_tok) * sizeof(float);
	if (need > s->scratch_bytes) {
		void *p = realloc(s->scratch, need);
		if (!p)
			return -ENOMEM;
		s->scratch = p;
		s->scratch_bytes = need;
	}
	md_matmul(s->pool, w, x, n_tok, y, s->scratch);
	return 0;
}

struct md_backend *md_backend_sim_new(size_t capacity, double bytes_per_s)
{
	struct md_backend *b = calloc(1, sizeof(*b));
	struct sim *s = calloc(1, sizeof(*s));
	if (!b || !s || !(s->pool = md_pool_new(1))) {
		free(b);
		free(s);
		return NULL;
	}
	s->capacity = capacity;
	s->bps = bytes_per_s;
	b->name = "sim";
	b->device_count = sim_device_count;
	b->device_info = sim_device_info;
	b->alloc = sim_alloc;
	b->free = sim_free;
	b->upload = sim_upload;
	b->download = sim_download;
	b->host_alloc = sim_host_alloc;
	b->host_free = sim_host_free;
	b->upload_async = sim_upload_async;
	b->fence_record = sim_fence_record;
	b->fence_wait = sim_fence_wait;
	b->fence_done = sim_fence_done;
	b->supports = sim_supports;
	b->matmul = sim_matmul;
	b->_ctx = s;
	return b;
}

void md_backend_sim_free(struct md_backend *b)
{
	if (!b)
		return;
	struct sim *s = S(b);
	md_pool_free(s->pool);
	free(s->scratch);
	free(s);
	free(b);
}

void md_backend_sim_set_rates(struct md_backend *b, double copy_bps, double compute_bps)
{
	S(b)->bps = copy_bps > 0 ? copy_bps : 0;
	S(b)->compute_bps = compute_bps > 0 ? compute_bps : 0;
}

size_t md_backend_sim_used(const struct md_backend *b)
{
	return S(b)->used;
}

unsigned long md_backend_sim_copies(const struct md_backend *b)
{
	return S(b)->copies;
}
