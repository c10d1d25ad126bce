/* bench_kernels: dot-kernel throughput per weight type (GB/s of weights), one thread, against
 * q8_0 and q4_K measured in the same run.
 *
 * For each type a weight matrix of about -m MiB is built (a few quantized rows of N(0,1) data
 * repeated: the content does not change the work, and quantizing hundreds of MiB with the
 * searching quantizers would take minutes), then the table's dot kernel walks every row with
 * 1 token (decode: each weight byte streams from memory once) and with 8 tokens (a batch:
 * each weight block is decoded once for 8 activation rows, so the decode cost shows). Types
 * are measured round-robin, one pass of each per repetition, so load changes on a shared
 * machine spread over all of them; the table gives the median and the spread over the
 * repetitions, and each median's ratio to q8_0's and q4_K's.
 *
 * -c times each pass by the thread's CPU time (CLOCK_THREAD_CPUTIME_ID) instead of the wall
 * clock: on a shared machine whose CPUs are oversubscribed, a pass that the OS preempts then
 * counts only the time it ran (caches still see the other tenants).
 *
 * -t TOKENS sets the batch's token count (2..8, default 8): a verification step of speculative
 * decoding is 2-9 tokens.
 *
 * -l runs the batch through the type's lanes kernel (kern.h: tokens packed once per product)
 * where the table has one, as products do from the table's lanes_min tokens on; else dot.
 *
 * -n N_IN is the row length: a multiple of 256, or of 32 for the 32-element types only (short
 * rows such as deepseek2's attn_k_b of 128, which are all tail in the lanes kernels); the q4_K
 * baseline is then left out.
 *
 * usage: bench_kernels [-c] [-l] [-k scalar|avx2|avx512] [-n N_IN] [-m MIB] [-r REPS] [-t TOKENS]
 *                      [TYPE...]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/kern/cpu.h"
#include "engine/kern/kern.h"
#include "engine/quant.h"

#define MAX_TYPES 24
#define MAX_REPS 64
#define SEED_ROWS 64
#define LANES_ROWS 16 /* rows per lanes call under -l */

struct bt {
	enum md_dtype t;
	const char *name;
	uint8_t *w;          /* owned: rows x row_bytes */
	size_t row_bytes;
	int64_t rows;
	uint8_t *act;        /* owned: 8 activation rows */
	size_t act_stride;
	double gbs[2][MAX_REPS]; /* [1 token, -t tokens][rep] */
};

static int cpu_clock; /* -c: thread CPU time instead of the wall clock */
static int use_lanes; /* -l: the batch through the type's lanes kernel where it has one */
static uint8_t *lanes_buf; /* packed tokens for -l */

static double now(void)
{
	struct timespec ts;
	clock_gettime(cpu_clock ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static float frand_normal(void)
{
	/* Sum of 4 uniforms, centred: close enough to N(0, 1/3) for weights that only need
	 * realistic block scales. */
	float s = 0;
	for (int i = 0; i < 4; i++) {
		rng ^= rng >> 12;
		rng ^= rng << 25;
		rng ^= rng >> 27;
		s += (float)((rng * 0x2545f4914f6cdd1dull) >> 40) / (float)(1 << 24);
	}
	return s - 2.0f;
}

static enum md_dtype type_by_name(const char *s)
{
	for (uint32_t t = 0; t < MD_DT_COUNT; t++) {
		const struct md_dtype_info *i = md_dtype_info(t);
		if (i && i->supported && strcasecmp(i->name, s) == 0)
			return (enum md_dtype)t;
	}
	return MD_DT_COUNT;
}

static int setup(struct bt *b, const struct md_kern *k, int64_t n, size_t bytes)
{
	b->name = md_dtype_info(b->t)->name;
	b->row_bytes = md_dtype_row_size(b->t, n);
	b->rows = (int64_t)(bytes / b->row_bytes);
	if (b->rows < SEED_ROWS)
		b->rows = SEED_ROWS;
	b->w = malloc(b->row_bytes * (size_t)b->rows);
	float *x = malloc(sizeof(float) * (size_t)n * 8);
	enum md_act_fmt f = md_kern_act_fmt(b->t);
	b->act_stride = md_kern_act_row_size(f, n);
	b->act = malloc(b->act_stride * 8);
	if (!b->w || !x || !b->act)
		return -1;
	for (int r = 0; r < SEED_ROWS; r++) {
		for (int64_t i = 0; i < n; i++)
			x[i] = frand_normal();
		md_quantize_row(b->t, x, b->w + b->row_bytes * (size_t)r, n);
	}
	for (int64_t r = SEED_ROWS; r < b->rows; r++)
		memcpy(b->w + b->row_bytes * (size_t)r, b->w + b->row_bytes * (size_t)(r % SEED_ROWS),
		       b->row_bytes);
	for (int64_t i = 0; i < n * 8; i++)
		x[i] = frand_normal();
	for (int t = 0; t < 8; t++) {
		if (f == MD_ACT_Q8B)
			k->quant_q8b(x + n * t, (struct md_q8b *)(b->act + b->act_stride * (size_t)t), n);
		else if (f == MD_ACT_Q8K)
			k->quant_q8k(x + n * t, (struct md_q8k *)(b->act + b->act_stride * (size_t)t), n);
		else
			memcpy(b->act + b->act_stride * (size_t)t, x + n * t, sizeof(float) * (size_t)n);
	}
	free(x);
	return 0;
}

static volatile float sink;

/* One pass over every row with nt tokens; returns GB/s of weight bytes. */
static double pass(const struct md_kern *k, struct bt *b, int64_t n, int nt)
{
	float y[8 * LANES_ROWS];
	double t0 = now();
	if (nt > 1 && use_lanes && k->lanes[b->t]) {
		/* As a product does it (engine/kern/matmul.c): the tokens packed once, then
		 * the rows in chunks. */
		k->pack_q8b_lanes(b->act, b->act_stride, nt, n, lanes_buf);
		for (int64_t r = 0; r < b->rows; r += LANES_ROWS) {
			const int nr = b->rows - r < LANES_ROWS ? (int)(b->rows - r) : LANES_ROWS;
			k->lanes[b->t](n, b->w + b->row_bytes * (size_t)r, b->row_bytes, nr, lanes_buf,
				       nt, y, LANES_ROWS);
			sink += y[0];
		}
		double dt = now() - t0;
		return (double)b->row_bytes * (double)b->rows / dt / 1e9;
	}
	for (int64_t r = 0; r < b->rows; r++) {
		k->dot[b->t](n, b->w + b->row_bytes * (size_t)r, b->act, b->act_stride, nt, y, 1);
		sink += y[0];
	}
	double dt = now() - t0;
	return (double)b->row_bytes * (double)b->rows / dt / 1e9;
}

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static double median(const double *v, int n, double *lo, double *hi)
{
	double s[MAX_REPS];
	memcpy(s, v, sizeof(double) * (size_t)n);
	qsort(s, (size_t)n, sizeof(double), cmp_d);
	*lo = s[0];
	*hi = s[n - 1];
	return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}

int main(int argc, char **argv)
{
	const char *kname = NULL;
	int64_t n = 4096;
	double mib = 64;
	int reps = 7, many = 8;
	struct bt bts[MAX_TYPES];
	int nb = 0;
	static const enum md_dtype defaults[] = { MD_DT_Q8_0, MD_DT_Q4_K, MD_DT_Q4_0, MD_DT_Q4_1,
						  MD_DT_Q5_0, MD_DT_Q5_1, MD_DT_Q2_K, MD_DT_Q3_K,
						  MD_DT_IQ4_NL, MD_DT_IQ4_XS, MD_DT_MXFP4 };

	memset(bts, 0, sizeof(bts));
	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "-c") == 0) {
			cpu_clock = 1;
		} else if (strcmp(argv[i], "-l") == 0) {
			use_lanes = 1;
		} else if (strcmp(argv[i], "-k") == 0 && i + 1 < argc) {
			kname = argv[++i];
		} else if (strcmp(argv[i], "-n") == 0 && i + 1 < argc) {
			n = atoll(argv[++i]);
		} else if (strcmp(argv[i], "-m") == 0 && i + 1 < argc) {
			mib = atof(argv[++i]);
		} else if (strcmp(argv[i], "-r") == 0 && i + 1 < argc) {
			reps = atoi(argv[++i]);
		} else if (strcmp(argv[i], "-t") == 0 && i + 1 < argc) {
			many = atoi(argv[++i]);
		} else if (argv[i][0] == '-') {
			fprintf(stderr, "usage: bench_kernels [-c] [-l] [-k scalar|avx2|avx512] [-n N_IN] [-m MIB] "
				"[-r REPS] [-t TOKENS] [TYPE...]\n");
			return 2;
		} else {
			enum md_dtype t = type_by_name(argv[i]);
			if (t == MD_DT_COUNT || nb >= MAX_TYPES - 2) {
				fprintf(stderr, "bench_kernels: unknown or unsupported type '%s'\n", argv[i]);
				return 2;
			}
			bts[nb++].t = t;
		}
	}
	if (n <= 0 || n % 32 || mib <= 0 || reps < 1 || reps > MAX_REPS || many < 2 || many > 8) {
		fprintf(stderr, "bench_kernels: -n must be a positive multiple of 32, -r 1..%d, "
			"-t 2..8\n", MAX_REPS);
		return 2;
	}
	for (int i = 0; i < nb; i++)
		if (n % md_dtype_info(bts[i].t)->blck) {
			fprintf(stderr, "bench_kernels: -n %lld is not a whole number of %s blocks\n",
				(long long)n, md_dtype_info(bts[i].t)->name);
			return 2;
		}
	if (nb == 0) {
		for (size_t i = 0; i < sizeof(defaults) / sizeof(defaults[0]); i++)
			bts[nb++].t = defaults[i];
	}
	/* The baselines are always measured in the same run. */
	int has_q8 = 0, has_q4k = 0;
	for (int i = 0; i < nb; i++) {
		has_q8 |= bts[i].t == MD_DT_Q8_0;
		has_q4k |= bts[i].t == MD_DT_Q4_K;
	}
	if (!has_q8)
		bts[nb++].t = MD_DT_Q8_0;
	if (!has_q4k && n % 256 == 0) /* else no q4_K row of that length */
		bts[nb++].t = MD_DT_Q4_K;

	const struct md_kern *k = kname ? md_kern_by_name(kname) : md_kern_active();
	if (!k) {
		fprintf(stderr, "bench_kernels: kernels '%s' not available here\n",
			kname ? kname : "ref");
		return 2;
	}
	for (int i = 0; i < nb; i++) {
		if (!k->dot[bts[i].t]) {
			fprintf(stderr, "bench_kernels: %s has no %s kernel\n", k->name,
				md_dtype_info(bts[i].t)->name);
			return 2;
		}
		if (setup(&bts[i], k, n, (size_t)(mib * 1048576.0))) {
			fprintf(stderr, "bench_kernels: out of memory\n");
			return 1;
		}
	}
	lanes_buf = malloc(md_kern_lanes_size(n) + 64);
	if (!lanes_buf)
		return 1;
	for (int i = 0; i < nb; i++) /* warm: fault the pages in, settle the clocks */
		pass(k, &bts[i], n, 1);
	for (int r = 0; r < reps; r++)
		for (int i = 0; i < nb; i++)
			for (int nt = 0; nt < 2; nt++)
				bts[i].gbs[nt][r] = pass(k, &bts[i], n, nt ? many : 1);

	/* Baselines: [q8_0, q4_K][tokens][median, best]. */
	double base[2][2][2] = { { { 0 } } };
	double lo, hi;
	for (int i = 0; i < nb; i++)
		for (int nt = 0; nt < 2; nt++) {
			double m = median(bts[i].gbs[nt], reps, &lo, &hi);
			int which = bts[i].t == MD_DT_Q8_0 ? 0 : bts[i].t == MD_DT_Q4_K ? 1 : -1;
			if (which >= 0) {
				base[which][nt][0] = m;
				base[which][nt][1] = hi;
			}
		}
	printf("dot kernels '%s'%s, 1 thread, n_in %lld, ~%g MiB of weights per type, %d reps, %s "
	       "time; GB/s of weight bytes: median, best (max) and spread; ratios of medians (of "
	       "bests)\n\n", k->name, use_lanes ? " (batch through lanes kernels where a type has one)" : "",
	       (long long)n, mib, reps, cpu_clock ? "CPU" : "wall");
	printf("| type | bits/w | tokens | GB/s median | best | spread | Gweights/s median | "
	       "vs q8_0 | vs q4_K |\n");
	printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
	for (int nt = 0; nt < 2; nt++) {
		for (int i = 0; i < nb; i++) {
			struct bt *b = &bts[i];
			double m = median(b->gbs[nt], reps, &lo, &hi);
			double bpw = 8.0 * (double)b->row_bytes / (double)n;
			char vs_q4k[48] = "-";
			if (base[1][nt][0] > 0)
				snprintf(vs_q4k, sizeof(vs_q4k), "%.2fx (%.2fx)", m / base[1][nt][0],
					 hi / base[1][nt][1]);
			printf("| %s | %.2f | %d | %.2f | %.2f | %.2f..%.2f | %.2f | %.2fx (%.2fx) | "
			       "%s |\n", b->name, bpw, nt ? many : 1, m, hi, lo, hi, m * 8.0 / bpw,
			       m / base[0][nt][0], hi / base[0][nt][1], vs_q4k);
		}
	}
	for (int i = 0; i < nb; i++) {
		free(bts[i].w);
		free(bts[i].act);
	}
	return 0;
}
