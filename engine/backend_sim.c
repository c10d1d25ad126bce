/* The simulated device backend (backend_sim.h). */
#include "engine/backend_sim.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/ffn_act.h"
#include "engine/kern/kern.h"
#include "engine/kern/cpu.h"
#include "engine/kern/matmul.h"
#include "engine/kern/threadpool.h"
#include "engine/kv_cache.h"
#include "engine/rope.h"

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
	struct md_pool *pool;            /* the "device" compute threads: owned, or borrowed when
					  * pool_borrowed (md_backend_sim_set_pool) */
	bool pool_borrowed;
	void *scratch;                   /* owned */
	size_t scratch_bytes;
	float *att;                      /* owned: attention scores, att_cap floats per thread */
	size_t att_cap;
	struct md_mat *mats;             /* owned: mm_experts' weight views, mats_cap */
	size_t mats_cap;
	float *prod;                     /* owned: mm_add's product, combine_add's sum: prod_cap
					  * floats */
	size_t prod_cap;
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
	/* Fresh device memory holds whatever it held: NaN here, so that a reader of memory
	 * nobody wrote gets NaN rather than, by chance, the freed host memory of the same data. */
	memset(h + 1, 0xff, size);
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
static int scratch_need(struct sim *s, size_t need);

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
		if (scratch_need(s, md_matmul_experts_scratch_bytes(w->n_in, n_tok, n_tok)))
			return -ENOMEM;
		const int32_t off[2] = { 0, n_tok };
		float *const ys[1] = { y };
		md_matmul_experts(s->pool, w, 1, 1, off, x, n_tok, NULL, ys, s->scratch);
		return 0;
	}
	if (scratch_need(s, md_matmul_scratch_floats(s->pool, w->n_in, n_tok) * sizeof(float)))
		return -ENOMEM;
	md_matmul(s->pool, w, x, n_tok, y, s->scratch);
	return 0;
}

/* Grow the scratch to at least need bytes. */
static int scratch_need(struct sim *s, size_t need)
{
	if (need <= s->scratch_bytes)
		return 0;
	void *p = realloc(s->scratch, need);
	if (!p)
		return -ENOMEM;
	s->scratch = p;
	s->scratch_bytes = need;
	return 0;
}

/* ---- device-resident compute (engine/backend_fwd.h), on the host ----
 *
 * Device memory is host memory here, so every "device" table is read directly. Each op
 * computes what the CPU forward pass (engine/forward.c) computes at the same point, with the
 * same kernels and in the same order where the CPU pass fixes one, so a forward pass through
 * these ops gives the CPU pass's results (bit for bit where the op sequence is the same). */

static int fwd_mm(struct md_backend *b, const struct md_mat *w, const float *x, int n_tok,
		  float *y)
{
	struct sim *s = S(b);
	if (n_tok < 1 || !sim_supports(b, w->type))
		return -EINVAL;
	if (scratch_need(s, md_matmul_scratch_floats(s->pool, w->n_in, n_tok) * sizeof(float)))
		return -ENOMEM;
	md_matmul(s->pool, w, x, n_tok, y, s->scratch);
	return 0;
}

static int fwd_mm_experts(struct md_backend *b, const struct md_dev_experts *e)
{
	struct sim *s = S(b);
	if (e->nw < 1 || e->nw > 2 || e->ng < 1 || !sim_supports(b, e->type))
		return -EINVAL;
	size_t nm = (size_t)e->ng * (size_t)e->nw;
	if (nm > s->mats_cap) {
		struct md_mat *p = realloc(s->mats, nm * sizeof(*p));
		if (!p)
			return -ENOMEM;
		s->mats = p;
		s->mats_cap = nm;
	}
	/* md_matmul_experts wants group-major views: w[g * nw + i] */
	for (int g = 0; g < e->ng; g++)
		for (int i = 0; i < e->nw; i++)
			s->mats[(size_t)g * e->nw + i] = (struct md_mat){
				e->type, e->n_in, e->n_out, e->nb1, e->w[(size_t)i * e->ng + g] };
	if (md_matmul_experts_ok(s->mats, e->nw)) {
		if (scratch_need(s, md_matmul_experts_scratch_bytes(e->n_in, e->n_x, e->n_slots)))
			return -ENOMEM;
		float *const ys[2] = { e->y[0], e->y[1] };
		md_matmul_experts(s->pool, s->mats, e->nw, e->ng, e->off, e->x, e->n_x, e->src, ys,
				  s->scratch);
		return 0;
	}
	/* Per group (the CPU pass's moe_each): gather the rows, one product per weight. The
	 * gathered rows go after the product scratch. */
	size_t mm_bytes = md_matmul_scratch_floats(s->pool, e->n_in, e->max_rows) * sizeof(float);
	if (scratch_need(s, mm_bytes + (size_t)e->max_rows * (size_t)e->n_in * sizeof(float)))
		return -ENOMEM;
	float *xe = (float *)((char *)s->scratch + mm_bytes);
	for (int g = 0; g < e->ng; g++) {
		int a = e->off[g], m = e->off[g + 1] - a;
		if (m < 1)
			continue;
		for (int j = 0; j < m; j++) {
			int r = e->src ? e->src[a + j] : a + j;
			memcpy(xe + (size_t)j * e->n_in, e->x + (size_t)r * e->n_in,
			       (size_t)e->n_in * sizeof(float));
		}
		for (int i = 0; i < e->nw; i++)
			md_matmul(s->pool, &s->mats[(size_t)g * e->nw + i], xe, m,
				  e->y[i] + (size_t)a * e->n_out, s->scratch);
	}
	return 0;
}

static int fwd_rmsnorm(struct md_backend *b, float *y, const float *x, const float *w, int rows,
		       int n, int stride, float eps)
{
	(void)b;
	for (int r = 0; r < rows; r++)
		md_rmsnorm(y + (size_t)r * stride, x + (size_t)r * stride, w, n, eps);
	return 0;
}

static int fwd_add(struct md_backend *b, float *y, const float *x, size_t n)
{
	(void)b;
	for (size_t i = 0; i < n; i++)
		y[i] += x[i];
	return 0;
}

static int fwd_mm_multi(struct md_backend *b, int n, const struct md_mat *const *w,
			const float *x, int n_tok, float *const *y)
{
	if (n < 1 || n > MD_DEV_MM_MULTI)
		return -EINVAL;
	for (int i = 0; i < n; i++) {
		int rc = fwd_mm(b, w[i], x, n_tok, y[i]);
		if (rc)
			return rc;
	}
	return 0;
}

/* The fused ops' intermediate (what the unfused pass kept in a buffer of its own): n floats. */
static float *prod_need(struct sim *s, size_t n)
{
	if (n > s->prod_cap) {
		float *p = realloc(s->prod, n * sizeof(float));
		if (!p)
			return NULL;
		s->prod = p;
		s->prod_cap = n;
	}
	return s->prod;
}

/* The product into a buffer of its own, then the add: mm then add, bit for bit. */
static int fwd_mm_add(struct md_backend *b, const struct md_mat *w, const float *x, int n_tok,
		      float *y)
{
	size_t n = (size_t)(n_tok > 0 ? n_tok : 0) * (size_t)w->n_out;
	float *prod = prod_need(S(b), n);
	if (!prod)
		return -ENOMEM;
	int rc = fwd_mm(b, w, x, n_tok, prod);
	return rc ? rc : fwd_add(b, y, prod, n);
}

static int fwd_add_rows(struct md_backend *b, float *y, const float *bias, const int32_t *idx,
			int rows, int n)
{
	(void)b;
	for (int r = 0; r < rows; r++) {
		const float *bv = bias + (idx ? (size_t)idx[r] * (size_t)n : 0);
		for (int i = 0; i < n; i++)
			y[(size_t)r * n + i] += bv[i];
	}
	return 0;
}

static int fwd_rope(struct md_backend *b, float *x, int n_tok, int n_head, int head_dim,
		    int n_rot, bool neox, const float *cs)
{
	(void)b;
	struct md_rope r = { .n_rot = n_rot, .type = neox ? MD_ROPE_NEOX : MD_ROPE_NORM };
	for (int t = 0; t < n_tok; t++)
		for (int h = 0; h < n_head; h++)
			md_rope_apply(&r, cs + (size_t)t * n_rot,
				      x + ((size_t)t * n_head + h) * head_dim);
	return 0;
}

static int fwd_rows_store(struct md_backend *b, float *dst, const int32_t *rows, const float *src,
			  int n, int dim)
{
	(void)b;
	for (int i = 0; i < n; i++)
		memcpy(dst + (size_t)rows[i] * dim, src + (size_t)i * dim, (size_t)dim * sizeof(float));
	return 0;
}

static const struct md_backend_fwd sim_fwd;

/* The ops it fuses, in their order (the pass's unfused sequence, bit for bit). */
static int fwd_qkv_rows(struct md_backend *b, const struct md_dev_qkv *a)
{
	return md_dev_qkv_rows_ops(&sim_fwd, b, a);
}

static int fwd_rows_gather(struct md_backend *b, float *dst, const float *src, const int32_t *rows,
			   int n, int dim)
{
	(void)b;
	for (int i = 0; i < n; i++)
		memcpy(dst + (size_t)i * dim, src + (size_t)rows[i] * dim, (size_t)dim * sizeof(float));
	return 0;
}

struct sim_att_job {
	const struct md_dev_attn *a;
	float *sc;
	size_t cap;
};

/* One (token, head) per item, split over the pool: the CPU pass's att_worker over rows found
 * through the block table instead of the cache's accessors. */
static void sim_att_worker(void *ctx, int ith, int nth)
{
	const struct sim_att_job *j = ctx;
	const struct md_dev_attn *a = j->a;
	const int H = a->n_head, D = a->head_dim, KD = a->n_head_kv * a->head_dim;
	const int group = a->n_head / a->n_head_kv;
	const struct md_kern *kn = md_kern_active();
	float *sc = j->sc + j->cap * (size_t)ith;
	int total = a->n_tok * H;
	int per = (total + nth - 1) / nth;
	int i0 = per * ith, i1 = i0 + per < total ? i0 + per : total;
	for (int i = i0; i < i1; i++) {
		int t = i / H, h = i % H, kvh = h / group, pos = a->pos[t];
		const int32_t *tab = a->blocks + a->tab[t];
		const float *q = a->q + ((size_t)t * H + h) * D;
		const int p0 = a->swa && pos >= a->swa ? pos - a->swa + 1 : 0;
		float mx = -INFINITY;
		for (int p = p0; p <= pos; p++) {
			size_t row = (size_t)tab[p / MD_KV_BLOCK_TOKENS] * MD_KV_BLOCK_TOKENS +
				     (size_t)(p % MD_KV_BLOCK_TOKENS);
			const float *kr = a->k + row * KD + (size_t)kvh * D;
			float sv;
			if (kn) {
				sv = kn->dot_f32(q, kr, D);
			} else {
				sv = 0;
				for (int d = 0; d < D; d++)
					sv += q[d] * kr[d];
			}
			sv *= a->scale;
			sc[p] = sv;
			if (sv > mx)
				mx = sv;
		}
		if (a->sinks && a->sinks[h] > mx)
			mx = a->sinks[h];
		double sum = a->sinks ? (double)expf(a->sinks[h] - mx) : 0.0;
		for (int p = p0; p <= pos; p++) {
			sc[p] = expf(sc[p] - mx);
			sum += sc[p];
		}
		float inv = (float)(1.0 / sum);
		float *o = a->out + ((size_t)t * H + h) * D;
		memset(o, 0, (size_t)D * sizeof(float));
		for (int p = p0; p <= pos; p++) {
			size_t row = (size_t)tab[p / MD_KV_BLOCK_TOKENS] * MD_KV_BLOCK_TOKENS +
				     (size_t)(p % MD_KV_BLOCK_TOKENS);
			const float *vr = a->v + row * KD + (size_t)kvh * D;
			float w = sc[p] * inv;
			if (kn) {
				kn->axpy_f32(o, w, vr, D);
				continue;
			}
			for (int d = 0; d < D; d++)
				o[d] += w * vr[d];
		}
	}
}

static int fwd_attention(struct md_backend *b, const struct md_dev_attn *a)
{
	struct sim *s = S(b);
	if (a->n_head_kv < 1 || a->n_head % a->n_head_kv)
		return -EINVAL;
	size_t need = ((size_t)a->max_pos + 16) & ~(size_t)15;
	if (need > s->att_cap) {
		float *p = realloc(s->att, need * (size_t)md_pool_size(s->pool) * sizeof(float));
		if (!p)
			return -ENOMEM;
		s->att = p;
		s->att_cap = need;
	}
	struct sim_att_job j = { a, s->att, s->att_cap };
	md_pool_run(s->pool, sim_att_worker, &j);
	return 0;
}

struct sim_mla_job {
	const struct md_dev_mla_attn *a;
	float *sc;
	size_t cap;
};

/* The CPU pass's score_worker (engine/attn_mla.c) over rows found through the block table. */
static void sim_mla_worker(void *ctx, int ith, int nth)
{
	const struct sim_mla_job *j = ctx;
	const struct md_dev_mla_attn *a = j->a;
	const int H = a->n_head, W = a->w, C = a->c;
	const struct md_kern *kn = md_kern_active();
	float *sc = j->sc + j->cap * (size_t)ith;
	int total = a->n_tok * H;
	int per = (total + nth - 1) / nth;
	int i0 = per * ith, i1 = i0 + per < total ? i0 + per : total;
	for (int i = i0; i < i1; i++) {
		int t = i / H, h = i % H, pos = a->pos[t];
		const int32_t *tab = a->blocks + a->tab[t];
		const float *q = a->q + ((size_t)t * H + h) * W;
		float mx = -INFINITY;
		for (int p = 0; p <= pos; p++) {
			size_t row = (size_t)tab[p / MD_KV_BLOCK_TOKENS] * MD_KV_BLOCK_TOKENS +
				     (size_t)(p % MD_KV_BLOCK_TOKENS);
			float s = 0;
			if (a->half) {
				const uint16_t *r = (const uint16_t *)a->rows + row * W;
				if (kn)
					s = kn->dot_f32_f16(q, r, W);
				else
					for (int d = 0; d < W; d++)
						s += q[d] * md_f16_to_f32(r[d]);
			} else {
				const float *r = (const float *)a->rows + row * W;
				if (kn)
					s = kn->dot_f32(q, r, W);
				else
					for (int d = 0; d < W; d++)
						s += q[d] * r[d];
			}
			s *= a->scale;
			sc[p] = s;
			if (s > mx)
				mx = s;
		}
		double sum = 0;
		for (int p = 0; p <= pos; p++) {
			sc[p] = expf(sc[p] - mx);
			sum += sc[p];
		}
		float inv = (float)(1.0 / sum);
		float *o = a->out + ((size_t)h * a->n_tok + t) * C;
		memset(o, 0, (size_t)C * sizeof(float));
		for (int p = 0; p <= pos; p++) {
			size_t row = (size_t)tab[p / MD_KV_BLOCK_TOKENS] * MD_KV_BLOCK_TOKENS +
				     (size_t)(p % MD_KV_BLOCK_TOKENS);
			float w = sc[p] * inv;
			if (a->half) {
				const uint16_t *r = (const uint16_t *)a->rows + row * W;
				if (kn)
					kn->axpy_f16(o, w, r, C);
				else
					for (int d = 0; d < C; d++)
						o[d] += w * md_f16_to_f32(r[d]);
			} else {
				const float *r = (const float *)a->rows + row * W;
				if (kn)
					kn->axpy_f32(o, w, r, C);
				else
					for (int d = 0; d < C; d++)
						o[d] += w * r[d];
			}
		}
	}
}

static int fwd_attention_mla(struct md_backend *b, const struct md_dev_mla_attn *a)
{
	struct sim *s = S(b);
	if (a->c > a->w)
		return -EINVAL;
	size_t need = ((size_t)a->max_pos + 16) & ~(size_t)15;
	if (need > s->att_cap) {
		float *p = realloc(s->att, need * (size_t)md_pool_size(s->pool) * sizeof(float));
		if (!p)
			return -ENOMEM;
		s->att = p;
		s->att_cap = need;
	}
	struct sim_mla_job j = { a, s->att, s->att_cap };
	md_pool_run(s->pool, sim_mla_worker, &j);
	return 0;
}

static int fwd_copy2d(struct md_backend *b, float *dst, size_t ds0, size_t ds1, const float *src,
		      size_t ss0, size_t ss1, int n0, int n1, int w)
{
	(void)b;
	for (int i = 0; i < n0; i++)
		for (int j = 0; j < n1; j++)
			memcpy(dst + i * ds0 + j * ds1, src + i * ss0 + j * ss1,
			       (size_t)w * sizeof(float));
	return 0;
}

static int fwd_rows_store_f16(struct md_backend *b, uint16_t *dst, const int32_t *rows,
			      const float *src, int n, int dim)
{
	(void)b;
	for (int i = 0; i < n; i++)
		for (int e = 0; e < dim; e++)
			dst[(size_t)rows[i] * dim + e] = md_f32_to_f16(src[(size_t)i * dim + e]);
	return 0;
}

static int fwd_glu(struct md_backend *b, float *g, const float *u, size_t n, enum md_ffn_act act)
{
	(void)b;
	for (size_t i = 0; i < n; i++)
		g[i] = md_glu(act, g[i], u[i]);
	return 0;
}

static int fwd_combine(struct md_backend *b, float *out, const float *ye, const int32_t *slot,
		       const float *w, int n_tok, int k, int n)
{
	(void)b;
	memset(out, 0, (size_t)n_tok * (size_t)n * sizeof(float));
	for (int t = 0; t < n_tok; t++) {
		float *dst = out + (size_t)t * n;
		for (int j = 0; j < k; j++) {
			int32_t sl = slot[(size_t)t * k + j];
			if (sl < 0)
				continue;
			float wt = w[(size_t)t * k + j];
			const float *src = ye + (size_t)sl * n;
			for (int i = 0; i < n; i++)
				dst[i] += wt * src[i];
		}
	}
	return 0;
}

/* combine into a buffer of its own, then the add: bit for bit the unfused pair. */
static int fwd_combine_add(struct md_backend *b, float *out, const float *ye, const int32_t *slot,
			   const float *w, int n_tok, int k, int n)
{
	size_t m = (size_t)(n_tok > 0 ? n_tok : 0) * (size_t)n;
	float *prod = prod_need(S(b), m);
	if (!prod)
		return -ENOMEM;
	fwd_combine(b, prod, ye, slot, w, n_tok, k, n);
	return fwd_add(b, out, prod, m);
}

static int fwd_gate_add(struct md_backend *b, float *y, const float *x, const float *gate,
			int n_tok, int n)
{
	(void)b;
	for (int t = 0; t < n_tok; t++) {
		float g = gate ? (float)(1.0 / (1.0 + exp(-(double)gate[t]))) : 1.0f;
		for (int i = 0; i < n; i++)
			y[(size_t)t * n + i] += g * x[(size_t)t * n + i];
	}
	return 0;
}

static int fwd_copy(struct md_backend *b, void *dst, const void *src, size_t size)
{
	(void)b;
	memcpy(dst, src, size);
	return 0;
}

static int fwd_sync(struct md_backend *b)
{
	(void)b;
	return 0;
}

/* Each row through the host router's own selection (md_route_select). */
static int fwd_route(struct md_backend *b, const struct md_dev_route *r)
{
	struct sim *s = S(b);
	const int E = r->p.E, K = r->p.K;
	if (K < 1 || K > E || E > MD_DEV_ROUTE_EMAX || (unsigned)r->p.fn >= MD_ROUTE_FN_COUNT)
		return -EINVAL;
	if (scratch_need(s, (size_t)E * (2 * sizeof(float) + 1)))
		return -ENOMEM;
	float *p = s->scratch, *sel = p + E;
	uint8_t *taken = (uint8_t *)(sel + E);
	for (int t = 0; t < r->n; t++) {
		memcpy(p, r->logits + (size_t)t * E, (size_t)E * sizeof(float));
		md_route_select(&r->p, r->bias, p, sel, taken, r->ids + (size_t)t * K,
				r->w + (size_t)t * K);
	}
	return 0;
}

/* router.c's grouping (a stable counting sort by expert), over the active experts. */
static int fwd_moe_layout(struct md_backend *b, const struct md_dev_layout *l)
{
	struct sim *s = S(b);
	const int E = l->E, NK = l->n * l->K;
	if (l->G < 1 || l->G > E || l->G > NK || E > MD_DEV_ROUTE_EMAX)
		return -EINVAL;
	if (scratch_need(s, (size_t)(2 * E + 1) * sizeof(int32_t) + (size_t)l->n * sizeof(int32_t)))
		return -ENOMEM;
	int32_t *start = s->scratch, *cur = start + E + 1, *fill = cur + E;
	memset(start, 0, (size_t)(E + 1) * sizeof(int32_t));
	for (int i = 0; i < NK; i++)
		start[l->ids[i] + 1]++;
	int g = 0;
	for (int e = 0; e < E; e++) {
		if (start[e + 1]) {
			l->off[g] = start[e];
			l->wtab[g] = (const char *)l->base[0] + (size_t)e * l->nb2[0];
			l->wtab[l->G + g] = (const char *)l->base[1] + (size_t)e * l->nb2[1];
			l->wtab[2 * l->G + g] = (const char *)l->base[2] + (size_t)e * l->nb2[2];
			g++;
		}
		start[e + 1] += start[e];
	}
	for (; g <= l->G; g++) {
		l->off[g] = NK;
		if (g < l->G)
			for (int i = 0; i < 3; i++)
				l->wtab[i * l->G + g] = l->base[i];
	}
	memcpy(cur, start, (size_t)E * sizeof(int32_t));
	for (int t = 0; t < l->n; t++)
		for (int k = 0; k < l->K; k++) {
			int e = l->ids[t * l->K + k];
			int32_t slot = cur[e]++;
			l->tok[slot] = t;
			l->eid[slot] = e;
		}
	/* combine: each token's slots ascending (the slots of a token run expert by expert) */
	memset(fill, 0, (size_t)l->n * sizeof(int32_t));
	for (int sl = 0; sl < NK; sl++) {
		int t = l->tok[sl];
		l->cslot[t * l->K + fill[t]] = sl;
		fill[t]++;
	}
	for (int t = 0; t < l->n; t++)
		for (int k = 0; k < l->K; k++) {
			int sl = l->cslot[t * l->K + k];
			/* the weight of token t's routing to eid[sl] */
			for (int j = 0; j < l->K; j++)
				if (l->ids[t * l->K + j] == l->eid[sl]) {
					l->cw[t * l->K + k] = l->w[t * l->K + j];
					break;
				}
		}
	return 0;
}

static const struct md_backend_fwd sim_fwd = {
	.mm = fwd_mm,
	.mm_experts = fwd_mm_experts,
	.mm_multi = fwd_mm_multi,
	.mm_add = fwd_mm_add,
	.rmsnorm = fwd_rmsnorm,
	.add = fwd_add,
	.add_rows = fwd_add_rows,
	.rope = fwd_rope,
	.qkv_rows = fwd_qkv_rows,
	.rows_store = fwd_rows_store,
	.rows_gather = fwd_rows_gather,
	.attention = fwd_attention,
	.attention_mla = fwd_attention_mla,
	.copy2d = fwd_copy2d,
	.rows_store_f16 = fwd_rows_store_f16,
	.glu = fwd_glu,
	.combine = fwd_combine,
	.combine_add = fwd_combine_add,
	.gate_add = fwd_gate_add,
	.copy = fwd_copy,
	.sync = fwd_sync,
	.route = fwd_route,
	.moe_layout = fwd_moe_layout,
};

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
	b->fwd = &sim_fwd;
	b->_ctx = s;
	return b;
}

void md_backend_sim_free(struct md_backend *b)
{
	if (!b)
		return;
	struct sim *s = S(b);
	if (!s->pool_borrowed)
		md_pool_free(s->pool);
	free(s->scratch);
	free(s->att);
	free(s->mats);
	free(s->prod);
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

void md_backend_sim_set_pool(struct md_backend *b, struct md_pool *pool)
{
	struct sim *s = S(b);
	if (!s->pool_borrowed)
		md_pool_free(s->pool);
	s->pool = pool;
	s->pool_borrowed = true;
}
