/*
 * bench_dev_ops: what each device op of a decode step costs on the device, in microseconds per
 * launch and in GB/s of weights read, against the device's own copy bandwidth.
 *
 * DESIGN
 * A batch-1 decode step on a GPU is a chain of a few hundred small launches: products of one
 * token with each weight matrix, and a dozen small ops per layer between them. Whole-step tok/s
 * (moed-bench -D cuda) says how far the chain is from the bandwidth bound, not which link
 * lags. This program times the links one by one, on shapes a decode step has:
 *   - an empty-ish op (add of 256 floats): the cost of a launch, plain and inside a graph;
 *   - mm of one token (and of 8) with a matrix of each weight type and shape: GB/s of weights;
 *   - mm_multi (Q, K and V in one launch) and mm_experts (8 experts' gate and up, then down).
 * Each figure is R launches enqueued back to back (or captured once into a graph of R launches,
 * then that graph launched), then a sync: the time per launch, the median of S samples. Weights
 * cycle through a buffer larger than the device's last-level cache, so every launch reads its
 * weights from device memory as a decode step does. A product's GB/s over the device's
 * measured copy bandwidth (a device-to-device copy, as moed-bench's bound) is the share of the
 * bound that product reaches; a launch's time is what a graph of N launches costs on top.
 * Run on a GPU by tests/gpu/run.sh; -D sim runs the simulated device (the figures are the
 * host's) and -q small shapes, which CI uses to keep the program working.
 *
 * Output: a Markdown table (op, type, shape, tokens, us per launch, GB/s, share of the copy
 * bandwidth) after one line naming the device and its copy bandwidth.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/dev_copy_bw.h"
#include "engine/backend.h"
#include "engine/backend_sim.h"
#include "engine/quant.h"

struct run {
	struct md_backend *b;
	const struct md_backend_fwd *op;
	int reps, samples;
	bool graphs; /* time inside graphs (when the backend has them) */
	double copy_bw; /* bytes per second, 0 when not measured */
	void *wbuf;     /* device: the weight buffer launches cycle through */
	size_t wbuf_bytes;
};

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

/* One launch of the op under test, the i-th of a run (so that it may pick its weights). */
typedef int (*launch_fn)(struct run *r, void *arg, int i);

/* Seconds per launch: the median over samples of (R launches, then a sync) / R, in a graph when
 * graphs is set and the backend has them. Negative errno on a failed launch. */
static double time_op(struct run *r, launch_fn fn, void *arg, bool graph)
{
	double t[64];
	int ns = r->samples < 64 ? r->samples : 64;
	void *g = NULL;
	if (graph) {
		if (r->op->capture_begin(r->b))
			return -EIO;
		for (int i = 0; i < r->reps; i++)
			if (fn(r, arg, i)) {
				r->op->capture_end(r->b, &g);
				r->op->graph_free(r->b, g);
				return -EIO;
			}
		if (r->op->capture_end(r->b, &g))
			return -EIO;
	}
	for (int s = -1; s < ns; s++) { /* sample -1: warm-up */
		double t0 = now_s();
		int rc = 0;
		if (graph)
			rc = r->op->graph_launch(r->b, g);
		for (int i = 0; !graph && !rc && i < r->reps; i++)
			rc = fn(r, arg, i);
		if (rc || r->op->sync(r->b)) {
			if (g)
				r->op->graph_free(r->b, g);
			return -EIO;
		}
		if (s >= 0)
			t[s] = (now_s() - t0) / r->reps;
	}
	if (g)
		r->op->graph_free(r->b, g);
	qsort(t, (size_t)ns, sizeof(double), cmp_d);
	return t[ns / 2];
}

/* ---- the ops ---- */

struct add_arg {
	float *y, *x;
};

static int launch_add(struct run *r, void *arg, int i)
{
	struct add_arg *a = arg;
	(void)i;
	return r->op->add(r->b, a->y, a->x, 256);
}

/* Products: nw matrices of one shape (nw > 1: mm_multi), k copies of each laid out in the
 * weight buffer; launch i reads copy i % k. */
struct mm_arg {
	struct md_mat w;   /* data: copy 0 */
	size_t stride;     /* bytes between copies */
	int k, nw, n_tok;
	float *x, *y[3];
};

static int launch_mm(struct run *r, void *arg, int i)
{
	struct mm_arg *a = arg;
	struct md_mat w[3];
	const struct md_mat *wp[3];
	for (int j = 0; j < a->nw; j++) {
		w[j] = a->w;
		w[j].data = (const uint8_t *)a->w.data + (size_t)((i * a->nw + j) % a->k) * a->stride;
		wp[j] = &w[j];
	}
	if (a->nw == 1)
		return r->op->mm(r->b, &w[0], a->x, a->n_tok, a->y[0]);
	return r->op->mm_multi(r->b, a->nw, wp, a->x, a->n_tok, a->y);
}

/* Grouped experts: ng experts of one token each, nw weights per expert; tables[i % nt] names
 * the weights of launch i. */
struct ex_arg {
	struct md_dev_experts e;
	const void **tabs; /* device: nt tables of nw * ng pointers */
	int nt;
};

static int launch_ex(struct run *r, void *arg, int i)
{
	struct ex_arg *a = arg;
	struct md_dev_experts e = a->e;
	e.w = (const void *const *)(a->tabs + (size_t)(i % a->nt) * e.nw * e.ng);
	return r->op->mm_experts(r->b, &e);
}

/* Fill the weight buffer with rows of type t and n_in elements quantized from pseudo-random
 * floats, back to back from its start: every offset that is a multiple of the type's block
 * bytes then starts a valid block (no NaN or inf scales for the kernels to meet), whatever
 * row length a product reads it as. */
static int fill_weights(struct run *r, enum md_dtype t, int64_t n_in)
{
	size_t rb = md_dtype_row_size(t, n_in);
	size_t chunk = ((size_t)8 << 20) / rb * rb;
	uint8_t *host = malloc(chunk);
	float *row = malloc((size_t)n_in * sizeof(float));
	if (!host || !row || !chunk) {
		free(host);
		free(row);
		return -ENOMEM;
	}
	uint32_t s = 12345;
	for (size_t used = 0; used < chunk; used += rb) {
		for (int64_t j = 0; j < n_in; j++) {
			s = s * 1664525u + 1013904223u;
			row[j] = ((float)(s >> 8) / 16777216.0f - 0.5f) * 0.2f;
		}
		md_quantize_row(t, row, host + used, n_in);
	}
	int rc = 0;
	for (size_t off = 0; !rc && off < r->wbuf_bytes; off += chunk) {
		size_t n = r->wbuf_bytes - off < chunk ? r->wbuf_bytes - off : chunk;
		rc = r->b->upload(r->b, (uint8_t *)r->wbuf + off, host, n);
	}
	free(host);
	free(row);
	return rc;
}

/* Bytes between the copies of a matrix of mbytes in the weight buffer: 256-byte aligned, and
 * a whole number of t's blocks. */
static size_t copy_stride(enum md_dtype t, size_t mbytes)
{
	size_t g = 256 * md_dtype_info(t)->type_size;
	return (mbytes + g - 1) / g * g;
}

static void row_out(const struct run *r, const char *op, enum md_dtype t, const char *shape,
		    int n_tok, double sec, double bytes)
{
	if (sec < 0) {
		printf("| %s | %s | %s | %d | failed | - | - |\n", op, md_dtype_info(t)->name, shape,
		       n_tok);
		return;
	}
	double gbs = bytes / sec / 1e9;
	char share[32] = "-";
	if (r->copy_bw > 0 && bytes > 0)
		snprintf(share, sizeof(share), "%.0f%%", 100.0 * bytes / sec / r->copy_bw);
	if (bytes > 0)
		printf("| %s | %s | %s | %d | %.2f | %.0f | %s |\n", op, md_dtype_info(t)->name, shape,
		       n_tok, sec * 1e6, gbs, share);
	else
		printf("| %s | - | %s | %d | %.2f | - | - |\n", op, shape, n_tok, sec * 1e6);
}

/* Products of one type: mm of each shape at each token count, then mm_multi and mm_experts
 * where the backend has them. */
static int bench_type(struct run *r, enum md_dtype t, float *x, float *const *y, bool quick,
		      bool graph)
{
	static const int64_t shapes_full[][2] = { /* n_out, n_in */
		{ 1024, 1024 }, { 4096, 1024 }, { 1024, 4096 }, { 4096, 4096 }, { 32000, 1024 },
	};
	static const int64_t shapes_quick[][2] = { { 64, 256 }, { 256, 256 } };
	const int64_t(*shapes)[2] = quick ? shapes_quick : shapes_full;
	int n_shapes = quick ? 2 : 5;
	static const int toks[] = { 1, 8 };
	int rc = fill_weights(r, t, 256);
	for (int si = 0; !rc && si < n_shapes; si++) {
		int64_t n_out = shapes[si][0], n_in = shapes[si][1];
		size_t rb = md_dtype_row_size(t, n_in);
		size_t mbytes = rb * (size_t)n_out;
		size_t stride = copy_stride(t, mbytes);
		struct mm_arg a = { .w = { t, n_in, n_out, rb, r->wbuf }, .stride = stride,
				    .k = (int)(r->wbuf_bytes / stride), .x = x,
				    .y = { y[0], y[1], y[2] } };
		if (a.k < 1)
			continue;
		char shape[64];
		snprintf(shape, sizeof(shape), "%lldx%lld", (long long)n_out, (long long)n_in);
		for (size_t ti = 0; ti < sizeof(toks) / sizeof(toks[0]); ti++) {
			a.nw = 1;
			a.n_tok = toks[ti];
			row_out(r, "mm", t, shape, a.n_tok, time_op(r, launch_mm, &a, graph),
				(double)mbytes);
		}
		if (r->op->mm_multi && si == 0 && a.k >= 3) {
			a.nw = 3;
			a.n_tok = 1;
			row_out(r, "mm_multi x3", t, shape, 1, time_op(r, launch_mm, &a, graph),
				3.0 * (double)mbytes);
		}
	}
	if (rc || !r->op->mm_experts)
		return rc;
	/* An MoE layer of a decode step: 8 experts, gate and up (nw 2) of ff x n_embd, then down
	 * (nw 1) of n_embd x ff; one token routed to each. */
	const int ng = 8;
	const int64_t ne = quick ? 256 : 1024, ff = quick ? 256 : 768;
	for (int pass = 0; !rc && pass < 2; pass++) {
		int nw = pass == 0 ? 2 : 1;
		int64_t n_in = pass == 0 ? ne : ff, n_out = pass == 0 ? ff : ne;
		size_t rb = md_dtype_row_size(t, n_in), mbytes = rb * (size_t)n_out;
		size_t stride = copy_stride(t, mbytes);
		int k = (int)(r->wbuf_bytes / stride);
		int per = nw * ng, nt = k / per;
		if (nt < 1)
			continue;
		if (nt > 64)
			nt = 64;
		const void **tabs = malloc((size_t)nt * per * sizeof(void *));
		int32_t off[9], src[8];
		void *dtabs = NULL, *doff = NULL, *dsrc = NULL;
		if (!tabs)
			return -ENOMEM;
		for (int i = 0; i < nt * per; i++)
			tabs[i] = (const uint8_t *)r->wbuf + (size_t)i * stride;
		for (int g = 0; g <= ng; g++)
			off[g] = g;
		for (int g = 0; g < ng; g++)
			src[g] = 0;
		rc = r->b->alloc(r->b, (size_t)nt * per * sizeof(void *), &dtabs);
		rc = rc ? rc : r->b->alloc(r->b, sizeof(off), &doff);
		rc = rc ? rc : r->b->alloc(r->b, sizeof(src), &dsrc);
		rc = rc ? rc : r->b->upload(r->b, dtabs, tabs, (size_t)nt * per * sizeof(void *));
		rc = rc ? rc : r->b->upload(r->b, doff, off, sizeof(off));
		rc = rc ? rc : r->b->upload(r->b, dsrc, src, sizeof(src));
		if (!rc) {
			struct ex_arg a = { .e = { .type = t, .n_in = n_in, .n_out = n_out, .nb1 = rb,
						   .nw = nw, .ng = ng, .off = doff, .src = dsrc,
						   .x = x, .n_x = 1, .y = { y[0], y[1] },
						   .n_slots = ng, .max_rows = 1 },
					    .tabs = (const void **)dtabs, .nt = nt };
			char shape[64];
			snprintf(shape, sizeof(shape), "8 x %s%lldx%lld", nw == 2 ? "2 x " : "",
				 (long long)n_out, (long long)n_in);
			row_out(r, "mm_experts", t, shape, 1, time_op(r, launch_ex, &a, graph),
				(double)mbytes * per);
		}
		r->b->free(r->b, dtabs);
		r->b->free(r->b, doff);
		r->b->free(r->b, dsrc);
		free(tabs);
	}
	return rc;
}

static void usage(void)
{
	fprintf(stderr, "usage: bench_dev_ops [-D cuda|sim] [-r LAUNCHES] [-s SAMPLES] [-q] "
		"[-t TYPE,TYPE..]\n"
		"  -D  the device (default cuda; sim: the simulated device, host figures)\n"
		"  -r  launches per sample (default 200)   -s  samples, the median quoted (default 5)\n"
		"  -q  small shapes and a small weight buffer (a check that it runs)\n"
		"  -t  weight types (default q8_0,q4_0,q4_K,q6_K,f16)\n"
		"  -g  0: plain launches only (default: in graphs too, where the backend has them)\n");
}

int main(int argc, char **argv)
{
	const char *dev = "cuda", *types = "q8_0,q4_0,q4_K,q6_K,f16";
	struct run r = { .reps = 200, .samples = 5, .graphs = true };
	bool quick = false;
	for (int i = 1; i < argc; i++) {
		const char *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!strcmp(argv[i], "-q")) {
			quick = true;
		} else if (!strcmp(argv[i], "-D") && v) {
			dev = argv[++i];
		} else if (!strcmp(argv[i], "-r") && v) {
			r.reps = atoi(argv[++i]);
		} else if (!strcmp(argv[i], "-s") && v) {
			r.samples = atoi(argv[++i]);
		} else if (!strcmp(argv[i], "-t") && v) {
			types = argv[++i];
		} else if (!strcmp(argv[i], "-g") && v) {
			r.graphs = atoi(argv[++i]) != 0;
		} else {
			usage();
			return 2;
		}
	}
	if (r.reps < 1 || r.samples < 1) {
		usage();
		return 2;
	}
	bool owned = false;
	if (!strcmp(dev, "cuda")) {
		r.b = md_backend_cuda();
		if (!r.b) {
			fprintf(stderr, "bench_dev_ops: no CUDA device: %s\n", md_backend_cuda_error());
			return 77;
		}
	} else if (!strcmp(dev, "sim")) {
		r.b = md_backend_sim_new((size_t)4 << 30, 0);
		owned = true;
	} else {
		usage();
		return 2;
	}
	if (!r.b || !r.b->fwd) {
		fprintf(stderr, "bench_dev_ops: the device has no forward-pass ops\n");
		return 1;
	}
	r.op = r.b->fwd;
	struct md_backend_device info;
	if (r.b->device_info(r.b, 0, &info))
		snprintf(info.name, sizeof(info.name), "%s", r.b->name);
	r.copy_bw = md_bench_dev_copy_bw(r.b, quick ? (size_t)16 << 20 : (size_t)512 << 20);
	/* Larger than any last-level cache (H100: 50 MiB, H200 the same). */
	r.wbuf_bytes = quick ? (size_t)8 << 20 : (size_t)512 << 20;
	float *x = NULL, *y[3] = { NULL, NULL, NULL };
	int rc = r.b->alloc(r.b, r.wbuf_bytes, &r.wbuf);
	rc = rc ? rc : r.b->alloc(r.b, (size_t)8 * 4096 * sizeof(float), (void **)&x);
	for (int j = 0; !rc && j < 3; j++)
		rc = r.b->alloc(r.b, (size_t)8 * 32000 * sizeof(float), (void **)&y[j]);
	if (rc) {
		fprintf(stderr, "bench_dev_ops: device memory: %s\n", strerror(-rc));
		return 1;
	}
	{ /* inputs: small values, uploaded once */
		float *h = malloc((size_t)8 * 4096 * sizeof(float));
		if (!h)
			return 1;
		for (int i = 0; i < 8 * 4096; i++)
			h[i] = (float)((i * 37) % 101 - 50) / 100.0f;
		rc = r.b->upload(r.b, x, h, (size_t)8 * 4096 * sizeof(float));
		free(h);
	}
	bool have_graphs = r.op->capture_begin && r.op->capture_end && r.op->graph_launch;
	printf("device: %s; copy bandwidth %.0f GB/s; %d launches per sample, median of %d%s\n\n",
	       info.name, r.copy_bw / 1e9, r.reps, r.samples,
	       have_graphs ? "" : "; no graphs on this device");
	printf("| op | type | shape (out x in) | tokens | us per launch | GB/s | of copy bw |\n");
	printf("| --- | --- | --- | ---: | ---: | ---: | ---: |\n");
	for (int gi = 0; !rc && gi < 2; gi++) {
		bool graph = gi == 1;
		if (graph && (!have_graphs || !r.graphs))
			break;
		struct add_arg aa = { y[0], y[1] };
		row_out(&r, graph ? "add (launch), in a graph" : "add (launch)", MD_DT_F32, "256", 1,
			time_op(&r, launch_add, &aa, graph), 0);
		char list[256];
		snprintf(list, sizeof(list), "%s", types);
		for (char *sv = NULL, *tn = strtok_r(list, ",", &sv); !rc && tn;
		     tn = strtok_r(NULL, ",", &sv)) {
			int id = -1;
			for (uint32_t i = 0; i < 64 && id < 0; i++) {
				const struct md_dtype_info *d = md_dtype_info(i);
				if (d && d->supported && d->name && !strcmp(d->name, tn))
					id = (int)i;
			}
			if (id < 0) {
				fprintf(stderr, "bench_dev_ops: unknown type '%s'\n", tn);
				rc = -EINVAL;
				break;
			}
			enum md_dtype t = (enum md_dtype)id;
			if (!r.b->supports(r.b, t)) {
				printf("| mm | %s | - | - | not supported | - | - |\n", tn);
				continue;
			}
			rc = bench_type(&r, t, x, y, quick, graph);
		}
	}
	r.b->free(r.b, r.wbuf);
	r.b->free(r.b, x);
	for (int j = 0; j < 3; j++)
		r.b->free(r.b, y[j]);
	if (owned)
		md_backend_sim_free(r.b);
	if (rc)
		fprintf(stderr, "bench_dev_ops: %s\n", strerror(-rc));
	return rc ? 1 : 0;
}
