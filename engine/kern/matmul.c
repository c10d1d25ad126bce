/* Matrix products of quantized weights with float activations, split over the thread pool.
 *
 * Kernel path (kern.h): the input rows are quantized once per call into the weight type's
 * activation format (8-bit blocks of 32 or 256), then each thread takes a contiguous range of
 * output rows (multiples of 16, so threads never write the same cache line of y) and, for
 * every group of up to MD_KERN_NT tokens, runs the type's tile kernel over its rows: a weight
 * block is decoded once into registers and dotted with every token of the group. Rows are
 * walked in chunks small enough to stay in L1/L2 while the token groups pass over them, so
 * each weight row comes from memory once per call however many tokens there are. Float
 * weights (f32, f16, bf16) go through the table's gemm instead, which tiles rows as well as
 * tokens in registers (kern.h md_gemm_fn).
 *
 * Reference path (MOED_KERNELS=ref): each thread dequantizes one weight row into its scratch
 * buffer and dots it in float with every token. */
#include "engine/kern/matmul.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "engine/kern/cpu.h"
#include "engine/kern/kern.h"

#define ROW_ALIGN 16  /* rows per thread range are a multiple of this */
#define ROW_CHUNK 32  /* rows walked per pass of the token groups */
#ifndef PF_BYTES
#define PF_BYTES 8192 /* software prefetch distance for single-pass rows */
#endif

static inline size_t pad64(size_t n)
{
	return (n + 63) & ~(size_t)63;
}

struct mm_job {
	const struct md_mat *w; /* (nw) */
	int nw;
	float *const *y;        /* (nw) outputs */
	int64_t rows;           /* sum of w[i].n_out */
	const float *x;
	int n_tok;
	/* kernel path */
	const struct md_kern *k;
	const uint8_t *act;     /* (n_tok) rows of act_stride bytes */
	size_t act_stride;
	const uint8_t *lanes;   /* (n_lanes) packed groups of MD_KERN_LANES tokens, or NULL */
	size_t lanes_stride;
	int n_lanes;
	int64_t ir;             /* rows per work item */
	int64_t items[MD_MATMUL_MAX_MULTI]; /* work items (row chunks) per weight */
	int64_t n_items;
	atomic_llong next;      /* next work item */
	/* reference path */
	float *scratch;
	size_t scratch_stride;
};

/* Maps a global row index to (weight, local row). */
static inline int which(const struct mm_job *j, int64_t *r)
{
	int i = 0;
	while (i + 1 < j->nw && *r >= j->w[i].n_out) {
		*r -= j->w[i].n_out;
		i++;
	}
	return i;
}

static void thread_range(const struct mm_job *j, int ith, int nth, int64_t *r0, int64_t *r1)
{
	int64_t per = (j->rows + nth - 1) / nth;
	per = (per + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN;
	*r0 = per * ith < j->rows ? per * ith : j->rows;
	*r1 = *r0 + per < j->rows ? *r0 + per : j->rows;
}

static void ref_worker(void *ctx, int ith, int nth)
{
	struct mm_job *j = ctx;
	int64_t g0, g1;
	thread_range(j, ith, nth, &g0, &g1);
	float *row = j->scratch + j->scratch_stride * (size_t)ith;
	for (int64_t g = g0; g < g1; g++) {
		int64_t r = g;
		const struct md_mat *w = &j->w[which(j, &r)];
		float *y = j->y[w - j->w];
		const void *src = (const uint8_t *)w->data + (size_t)r * w->nb1;
		const float *wr;
		if (w->type == MD_DT_F32) {
			wr = src;
		} else {
			md_dequant_row(w->type, src, row, w->n_in);
			wr = row;
		}
		for (int t = 0; t < j->n_tok; t++)
			y[(size_t)t * w->n_out + r] = md_kern_scalar.dot_f32(wr, j->x + (size_t)t * w->n_in, w->n_in);
	}
}

/* Rows per work item: small enough that a chunk's weights stay in L1/L2 while several token
 * groups pass over it. One token group (decode) needs no reuse: there each thread takes an
 * equal contiguous share of a matrix (the largest of the call, n_out rows), so it streams
 * long runs of memory, as long as the share stays between 128 and 512 rows: enough items
 * remain that a preempted thread (the machine is shared) delays only its current one.
 * Measured on f16 decode of the bench model (2 threads; expert matrices of 768 and 1024
 * rows): 31.1 tok/s against 30.6 with fixed 128-row items. Multiples of ROW_ALIGN. */
static int64_t item_rows(int max_tok, const struct md_mat *w, int nw, int nth)
{
	if (max_tok > MD_KERN_NT)
		return ROW_CHUNK;
	int64_t n_out = 0;
	for (int i = 0; i < nw; i++)
		n_out = w[i].n_out > n_out ? w[i].n_out : n_out;
	int64_t share = (n_out + nth - 1) / (nth > 0 ? nth : 1);
	share = (share + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN;
	return share < 4 * ROW_CHUNK ? 4 * ROW_CHUNK : share > 16 * ROW_CHUNK ? 16 * ROW_CHUNK : share;
}

/* Work items of ir rows per weight into items[]; returns their sum. */
static int64_t count_items(const struct md_mat *w, int nw, int64_t ir, int64_t *items)
{
	int64_t n = 0;
	for (int i = 0; i < nw; i++) {
		items[i] = (w[i].n_out + ir - 1) / ir;
		n += items[i];
	}
	return n;
}

/* Whether a single pass over the rows (decode) fetches each row PF_BYTES ahead in software:
 * $MOED_ROW_PREFETCH=1 or 0 where set, else the kernel table's row_pf (on with the AVX2
 * kernels, off with the others). It was added where the hardware prefetchers stopped at 4 KiB pages, a row or two
 * here. On this project's Zen 5 (AVX-512 kernels), with the model's mapping backed by huge
 * pages, the burst of prefetches per row costs more than it hides: default-1g (q8_0) decodes
 * 1.06-1.18x faster without it (moed-bench tg64, three alternating pairs; 1.02-1.09x at 4
 * sequences: bench/README.md, "Dot kernels per weight type"). On the Zen 3 (AVX2 kernels, no
 * huge pages behind the mapping) it pays: default-1g in q8_0 and q4_K_M decode 1.08x and 1.15x
 * faster with it (bench/README.md, "Row prefetch by kernel table"). The kernel table stands
 * for the machine here, on two machines' evidence. The variable is read once per process, as
 * cpu.c reads MOED_KERNELS. */
static int row_prefetch_env = -1; /* -1: unset */
static pthread_once_t row_prefetch_once = PTHREAD_ONCE_INIT;

static void row_prefetch_read(void)
{
	const char *s = getenv("MOED_ROW_PREFETCH");
	if (s && *s)
		row_prefetch_env = strcmp(s, "0") != 0;
}

static bool row_prefetch_on(const struct md_kern *k)
{
	pthread_once(&row_prefetch_once, row_prefetch_read);
	return row_prefetch_env >= 0 ? row_prefetch_env == 1 : k->row_pf;
}

/* Rows r0 .. r0+nr-1 of w for n_tok activation rows at act (stride as), into y (n_tok rows of
 * w->n_out floats). The first n_lanes * MD_KERN_LANES tokens (at most n_tok) may come packed
 * in lanes (kern.h) at lanes, groups lstride bytes apart: those go through the type's lanes
 * kernel, the rest through dot (the same bits either way). */
static void kern_rows(const struct md_kern *k, const struct md_mat *w, int64_t r0, int64_t nr,
		      const uint8_t *act, size_t as, int n_tok, float *y, const uint8_t *lanes,
		      size_t lstride, int n_lanes)
{
	const md_dot_fn dot = k->dot[w->type];
	const md_gemm_fn gemm = k->gemm[w->type];
	const uint8_t *wd = (const uint8_t *)w->data;
	const int64_t pf = (int64_t)((PF_BYTES + w->nb1 - 1) / w->nb1);
	if (gemm && (n_tok > k->gemm_nt || n_tok == 1)) {
		/* Several token tiles: the kernel walks them over this L2-sized chunk. Decode:
		 * it walks the rows, prefetching their streams itself (kern_avx2.c dec_rows);
		 * with a call per row the default model (rows of 192 elements) decoded 1.2-1.4x
		 * slower (bench/README.md, "Float weights: decode's bits are the batch's"). */
		gemm(w->n_in, wd + (size_t)r0 * w->nb1, w->nb1, (int)nr, act, as, n_tok, y + r0,
		     (size_t)w->n_out);
		return;
	}
	if (gemm) {
		/* One pass over the rows (small expert groups), row by row, each row fetched
		 * PF_BYTES ahead here (the hardware prefetchers stop at 4 KiB pages, a row or
		 * two). Interleaving rows (4 per gemm call) was measured slower on decode (21.5
		 * vs 24.8 tok/s, and again on 2026-12-06): the L2 streamer follows one sequential
		 * stream better. */
		for (int64_t r = r0; r < r0 + nr; r++) {
			if (r + pf < w->n_out) {
				const uint8_t *p = wd + (size_t)(r + pf) * w->nb1;
				for (size_t o = 0; o < w->nb1; o += 64)
					__builtin_prefetch(p + o, 0, 1);
			}
			gemm(w->n_in, wd + (size_t)r * w->nb1, w->nb1, 1, act, as, n_tok, y + r,
			     (size_t)w->n_out);
		}
		return;
	}
	const bool pf_on = !(n_tok == 1 && k->own_pf[w->type]) && row_prefetch_on(k);
	int t_lanes = 0;
	if (lanes && k->lanes[w->type]) {
		for (int g = 0; g < n_lanes; g++) {
			const int t0 = g * MD_KERN_LANES;
			const int nt = n_tok - t0 < MD_KERN_LANES ? n_tok - t0 : MD_KERN_LANES;
			k->lanes[w->type](w->n_in, wd + (size_t)r0 * w->nb1, w->nb1, (int)nr,
					  lanes + (size_t)g * lstride, nt, y + (size_t)t0 * w->n_out + r0,
					  (size_t)w->n_out);
		}
		t_lanes = n_lanes * MD_KERN_LANES < n_tok ? n_lanes * MD_KERN_LANES : n_tok;
	}
	for (int t0 = t_lanes; t0 < n_tok; t0 += MD_KERN_NT) {
		int nt = n_tok - t0 < MD_KERN_NT ? n_tok - t0 : MD_KERN_NT;
		const uint8_t *a = act + (size_t)t0 * as;
		float *yt = y + (size_t)t0 * w->n_out;
		for (int64_t r = r0; r < r0 + nr; r++) {
			if (pf_on && nt == n_tok && r + pf < w->n_out) {
				/* One pass over the rows (decode): fetch a row PF_BYTES ahead now so
				 * its DRAM latency overlaps this row's math (row_prefetch_on). */
				const uint8_t *p = wd + (size_t)(r + pf) * w->nb1;
				for (size_t o = 0; o < w->nb1; o += 64)
					__builtin_prefetch(p + o, 0, 1);
			}
			dot(w->n_in, wd + (size_t)r * w->nb1, a, as, nt, yt + r, (size_t)w->n_out);
		}
	}
}

/* Threads grab row chunks from a shared counter, so a thread that the OS preempts (the
 * machine is shared) delays only its current chunk, not a fixed share of the matrix. */
static void kern_worker(void *ctx, int ith, int nth)
{
	struct mm_job *j = ctx;
	(void)ith;
	(void)nth;
	const int64_t ir = j->ir;
	for (;;) {
		int64_t it = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
		if (it >= j->n_items)
			break;
		int i = 0;
		while (it >= j->items[i]) {
			it -= j->items[i];
			i++;
		}
		const struct md_mat *w = &j->w[i];
		int64_t r0 = it * ir;
		int64_t n = w->n_out - r0 < ir ? w->n_out - r0 : ir;
		kern_rows(j->k, w, r0, n, j->act, j->act_stride, j->n_tok, j->y[i], j->lanes,
			  j->lanes_stride, j->n_lanes);
	}
}

struct q_job {
	const struct md_kern *k;
	enum md_act_fmt fmt;
	const float *x;
	int64_t n_in;
	int n_tok;
	uint8_t *act;
	size_t act_stride;
};

static void quant_rows(const struct q_job *q, int t0, int t1)
{
	for (int t = t0; t < t1; t++) {
		const float *xr = q->x + (size_t)t * q->n_in;
		void *dst = q->act + (size_t)t * q->act_stride;
		if (q->fmt == MD_ACT_Q8B)
			q->k->quant_q8b(xr, dst, q->n_in);
		else
			q->k->quant_q8k(xr, dst, q->n_in);
	}
}

static void quant_worker(void *ctx, int ith, int nth)
{
	struct q_job *q = ctx;
	int per = (q->n_tok + nth - 1) / nth;
	int t0 = per * ith < q->n_tok ? per * ith : q->n_tok;
	int t1 = t0 + per < q->n_tok ? t0 + per : q->n_tok;
	quant_rows(q, t0, t1);
}

/* Quantizing is cheap next to the matmul: split it over the pool only for big batches. */
static void quantize_acts(struct md_pool *pool, struct q_job *q)
{
	if (q->n_tok >= 8)
		md_pool_run(pool, quant_worker, q);
	else
		quant_rows(q, 0, q->n_tok);
}

/* Lanes groups a product of n_tok tokens packs with table k (kern.h): whole groups, and the
 * last partial one when it has lanes_min tokens. */
static int lane_groups(const struct md_kern *k, int n_tok)
{
	if (!k || !k->pack_q8b_lanes || n_tok < k->lanes_min)
		return 0;
	int g = n_tok / MD_KERN_LANES;
	return g + (n_tok % MD_KERN_LANES >= k->lanes_min);
}

/* Bytes of packed lanes groups for products of up to n_tok tokens (any table). */
static size_t lanes_bytes(int64_t n_in, int n_tok)
{
	size_t groups = (size_t)(n_tok / MD_KERN_LANES + 1);
	return groups * pad64(md_kern_lanes_size((n_in + 31) / 32 * 32));
}

size_t md_matmul_scratch_floats(const struct md_pool *pool, int64_t n_in, int max_tok)
{
	/* Reference path: one dequantized row per thread, padded to 64 bytes so threads never
	 * share a cache line. Kernel path: max_tok quantized rows (at most 44 bytes per 32), then
	 * their lanes groups. */
	size_t ref = (((size_t)n_in + 15) & ~(size_t)15) * (size_t)md_pool_size(pool);
	size_t row = pad64(md_kern_act_row_size(MD_ACT_Q8B, (n_in + 31) / 32 * 32));
	size_t rowk = pad64(md_kern_act_row_size(MD_ACT_Q8K, (n_in + 255) / 256 * 256));
	if (rowk > row)
		row = rowk;
	const int nt = max_tok > 0 ? max_tok : 1;
	size_t kern = (row * (size_t)nt + lanes_bytes(n_in, nt) + 63) / sizeof(float);
	return ref > kern ? ref : kern;
}

/* Kernel-path block constraints: n_in a multiple of the activation block. */
static bool kern_ok(const struct md_kern *k, const struct md_mat *w, int nw, enum md_act_fmt *fmt)
{
	if (!k)
		return false;
	*fmt = md_kern_act_fmt(w[0].type);
	for (int i = 0; i < nw; i++) {
		if (md_kern_act_fmt(w[i].type) != *fmt || !k->dot[w[i].type] || w[i].n_in != w[0].n_in)
			return false;
	}
	if (*fmt == MD_ACT_NONE)
		return false;
	if (*fmt == MD_ACT_Q8B && w[0].n_in % 32)
		return false;
	if (*fmt == MD_ACT_Q8K && w[0].n_in % 256)
		return false;
	return true;
}

void md_matmul_multi(struct md_pool *pool, const struct md_mat *w, int nw, const float *x,
		     int n_tok, float *const *ys, float *scratch)
{
	if (n_tok <= 0 || nw <= 0)
		return;
	if (nw > MD_MATMUL_MAX_MULTI) {
		md_matmul_multi(pool, w, MD_MATMUL_MAX_MULTI, x, n_tok, ys, scratch);
		md_matmul_multi(pool, w + MD_MATMUL_MAX_MULTI, nw - MD_MATMUL_MAX_MULTI, x, n_tok,
				ys + MD_MATMUL_MAX_MULTI, scratch);
		return;
	}
	struct mm_job j = {
		.w = w,
		.nw = nw,
		.y = ys,
		.x = x,
		.n_tok = n_tok,
	};
	for (int i = 0; i < nw; i++)
		j.rows += w[i].n_out;
	const struct md_kern *k = md_kern_active();
	enum md_act_fmt fmt;
	if (!kern_ok(k, w, nw, &fmt)) {
		if (nw > 1 && k) {
			/* Mixed formats: one call per weight. */
			for (int i = 0; i < nw; i++)
				md_matmul_multi(pool, &w[i], 1, x, n_tok, &ys[i], scratch);
			return;
		}
		j.scratch = scratch;
		j.scratch_stride = ((size_t)w[0].n_in + 15) & ~(size_t)15;
		md_pool_run(pool, ref_worker, &j);
		return;
	}
	j.k = k;
	j.ir = item_rows(n_tok, w, nw, md_pool_size(pool));
	j.n_items = count_items(w, nw, j.ir, j.items);
	atomic_init(&j.next, 0);
	if (fmt == MD_ACT_F32) {
		j.act = (const uint8_t *)x;
		j.act_stride = (size_t)w[0].n_in * sizeof(float);
	} else {
		struct q_job q = {
			.k = k,
			.fmt = fmt,
			.x = x,
			.n_in = w[0].n_in,
			.n_tok = n_tok,
			.act = (uint8_t *)scratch,
			.act_stride = pad64(md_kern_act_row_size(fmt, w[0].n_in)),
		};
		quantize_acts(pool, &q);
		j.act = q.act;
		j.act_stride = q.act_stride;
		if (fmt == MD_ACT_Q8B && (j.n_lanes = lane_groups(k, n_tok)) > 0) {
			uint8_t *lp = q.act + q.act_stride * (size_t)n_tok;
			j.lanes_stride = pad64(md_kern_lanes_size(w[0].n_in));
			for (int g = 0; g < j.n_lanes; g++) {
				int t0 = g * MD_KERN_LANES;
				int nt = n_tok - t0 < MD_KERN_LANES ? n_tok - t0 : MD_KERN_LANES;
				k->pack_q8b_lanes(q.act + q.act_stride * (size_t)t0, q.act_stride, nt,
						  w[0].n_in, lp + j.lanes_stride * (size_t)g);
			}
			j.lanes = lp;
		}
	}
	md_pool_run(pool, kern_worker, &j);
}

void md_matmul(struct md_pool *pool, const struct md_mat *w, const float *x, int n_tok, float *y,
	       float *scratch)
{
	md_matmul_multi(pool, w, 1, x, n_tok, &y, scratch);
}

/* ---- expert-grouped products ---- */

struct ex_job {
	const struct md_kern *k;
	const struct md_mat *w; /* (ng * nw) */
	int nw, ng;
	const int32_t *off;     /* (ng + 1) */
	float *const *y;        /* (nw) */
	const uint8_t *act;     /* one row per slot */
	size_t act_stride;
	const uint8_t *lanes;   /* packed lanes groups of the groups with enough slots, or NULL */
	size_t lanes_stride;
	const int32_t *lane0;   /* (ng) first packed group of each group */
	int64_t ir;             /* rows per work item */
	int64_t items[MD_MATMUL_MAX_MULTI];
	int64_t per_group;
	int64_t n_items;
	atomic_llong next;
};

static void ex_worker(void *ctx, int ith, int nth)
{
	struct ex_job *j = ctx;
	(void)ith;
	(void)nth;
	for (;;) {
		int64_t it = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
		if (it >= j->n_items)
			break;
		const int g = (int)(it / j->per_group);
		it %= j->per_group;
		int i = 0;
		while (it >= j->items[i]) {
			it -= j->items[i];
			i++;
		}
		const struct md_mat *w = &j->w[(size_t)g * j->nw + i];
		const int32_t s0 = j->off[g], m = j->off[g + 1] - s0;
		int64_t r0 = it * j->ir;
		int64_t n = w->n_out - r0 < j->ir ? w->n_out - r0 : j->ir;
		const uint8_t *lp = j->lanes ? j->lanes + j->lanes_stride * (size_t)j->lane0[g] : NULL;
		kern_rows(j->k, w, r0, n, j->act + (size_t)s0 * j->act_stride, j->act_stride, m,
			  j->y[i] + (size_t)s0 * w->n_out, lp, j->lanes_stride,
			  lp ? j->lane0[g + 1] - j->lane0[g] : 0);
	}
}

bool md_matmul_experts_ok(const struct md_mat *w, int nw)
{
	enum md_act_fmt fmt;
	return nw <= MD_MATMUL_MAX_MULTI && kern_ok(md_kern_active(), w, nw, &fmt);
}

size_t md_matmul_experts_scratch_bytes(int64_t n_in, int n_x, int n_slots)
{
	size_t row = pad64(md_kern_act_row_size(MD_ACT_Q8B, (n_in + 31) / 32 * 32));
	size_t rowk = pad64(md_kern_act_row_size(MD_ACT_Q8K, (n_in + 255) / 256 * 256));
	size_t rowf = pad64((size_t)n_in * sizeof(float));
	if (rowk > row)
		row = rowk;
	if (rowf > row)
		row = rowf;
	/* Lanes groups: a group of m slots packs at most m / MD_KERN_LANES_MIN (lane_groups). */
	size_t lanes = (size_t)(n_slots / MD_KERN_LANES_MIN + 1) * pad64(md_kern_lanes_size((n_in + 31) / 32 * 32));
	return row * ((size_t)n_x + (size_t)n_slots) + lanes + pad64(sizeof(int32_t) * ((size_t)n_slots + 2)) + 64;
}

struct gather_job {
	const uint8_t *src;
	uint8_t *dst;
	size_t stride, bytes;
	const int32_t *idx;
	int n;
};

static void gather_worker(void *ctx, int ith, int nth)
{
	struct gather_job *g = ctx;
	int per = (g->n + nth - 1) / nth;
	int a = per * ith < g->n ? per * ith : g->n, z = a + per < g->n ? a + per : g->n;
	for (int s = a; s < z; s++)
		memcpy(g->dst + (size_t)s * g->stride, g->src + (size_t)g->idx[s] * g->stride, g->bytes);
}

void md_matmul_experts(struct md_pool *pool, const struct md_mat *w, int nw, int ng,
		       const int32_t *off, const float *x, int n_x, const int32_t *src,
		       float *const *ys, void *scratch)
{
	const int n_slots = ng > 0 ? off[ng] - off[0] : 0;
	if (n_slots <= 0 || nw <= 0)
		return;
	const struct md_kern *k = md_kern_active();
	enum md_act_fmt fmt;
	kern_ok(k, w, nw, &fmt);
	const int64_t n_in = w[0].n_in;
	struct ex_job j = {
		.k = k,
		.w = w,
		.nw = nw,
		.ng = ng,
		.off = off,
		.y = ys,
	};
	uint8_t *buf = (uint8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
	const int rows_in = src ? n_x : n_slots;
	size_t stride;
	const uint8_t *act;
	if (fmt == MD_ACT_F32) {
		stride = (size_t)n_in * sizeof(float);
		act = (const uint8_t *)x;
	} else {
		stride = pad64(md_kern_act_row_size(fmt, n_in));
		struct q_job q = {
			.k = k,
			.fmt = fmt,
			.x = x,
			.n_in = n_in,
			.n_tok = rows_in,
			.act = buf,
			.act_stride = stride,
		};
		quantize_acts(pool, &q);
		act = buf;
		buf += stride * (size_t)rows_in;
	}
	if (src) {
		/* Every slot gets its own copy of its token's row, so each group's rows are
		 * contiguous for the tile kernels (slot order is expert-major). */
		struct gather_job g = { act, buf, stride, stride, src, n_slots };
		if (n_slots >= 64)
			md_pool_run(pool, gather_worker, &g);
		else
			gather_worker(&g, 0, 1);
		act = buf;
		buf += stride * (size_t)n_slots;
	}
	j.act = act - (size_t)off[0] * stride;
	j.act_stride = stride;
	if (fmt == MD_ACT_Q8B && k->pack_q8b_lanes) {
		/* Pack the groups with enough slots; lane0 counts them, ng + 1 entries. */
		int32_t *lane0 = (int32_t *)buf;
		uint8_t *lp = buf + pad64(sizeof(int32_t) * ((size_t)n_slots + 2));
		const size_t ls = pad64(md_kern_lanes_size(n_in));
		int32_t total = 0;
		for (int g = 0; g < ng; g++) {
			lane0[g] = total;
			const int m = off[g + 1] - off[g], lg = lane_groups(k, m);
			for (int q = 0; q < lg; q++) {
				const int t0 = q * MD_KERN_LANES, nt = m - t0 < MD_KERN_LANES ? m - t0 : MD_KERN_LANES;
				k->pack_q8b_lanes(j.act + (size_t)(off[g] + t0) * stride, stride, nt, n_in,
						  lp + ls * (size_t)total++);
			}
		}
		lane0[ng] = total;
		if (total > 0) {
			j.lanes = lp;
			j.lanes_stride = ls;
			j.lane0 = lane0;
		}
	}
	int max_m = 0;
	for (int g = 0; g < ng; g++)
		max_m = off[g + 1] - off[g] > max_m ? off[g + 1] - off[g] : max_m;
	j.ir = item_rows(max_m, w, nw, md_pool_size(pool));
	j.per_group = count_items(w, nw, j.ir, j.items);
	j.n_items = j.per_group * ng;
	atomic_init(&j.next, 0);
	md_pool_run(pool, ex_worker, &j);
}

void md_rmsnorm(float *out, const float *in, const float *w, int64_t n, float eps)
{
	const struct md_kern *kn = md_kern_active();
	if (kn) {
		float s = (float)(1.0 / sqrt((double)kn->sumsq_f32(in, n) / (double)n + eps));
		kn->scale_mul_f32(out, in, s, w, n);
		return;
	}
	double ss = 0;
	for (int64_t i = 0; i < n; i++)
		ss += (double)in[i] * in[i];
	float s = (float)(1.0 / sqrt(ss / (double)n + eps));
	for (int64_t i = 0; i < n; i++)
		out[i] = in[i] * s * w[i];
}
