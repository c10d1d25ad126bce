/* Unit tests for the CPU kernels: every SIMD table against the scalar kernels, the scalar
 * kernels against the reference dot in quant.c (within the activation-quantization bound),
 * and the threaded kernel matmul against single-row kernel calls. */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/kern/cpu.h"
#include "engine/kern/kern.h"
#include "engine/kern/matmul.h"
#include "engine/quant.h"
#include "engine/kern/threadpool.h"

#include "tests/check.h"
#include "frand.h"

static const enum md_dtype types[] = { MD_DT_F32, MD_DT_F16, MD_DT_BF16, MD_DT_Q8_0,
				       MD_DT_Q4_0, MD_DT_Q4_K, MD_DT_Q5_K, MD_DT_Q6_K,
				       MD_DT_Q4_1, MD_DT_Q5_0, MD_DT_Q5_1, MD_DT_Q2_K,
				       MD_DT_Q3_K, MD_DT_IQ4_NL, MD_DT_IQ4_XS, MD_DT_MXFP4 };
#define N_TYPES (sizeof(types) / sizeof(types[0]))

/* Activation rows for weight type t: quantized with kernel table k into buf. */
static void make_act(const struct md_kern *k, enum md_dtype t, const float *x, int64_t n, int nt,
		     uint8_t *buf, size_t *stride)
{
	enum md_act_fmt f = md_kern_act_fmt(t);
	*stride = md_kern_act_row_size(f, n);
	for (int i = 0; i < nt; i++) {
		if (f == MD_ACT_F32)
			memcpy(buf + i * *stride, x + i * n, (size_t)n * sizeof(float));
		else if (f == MD_ACT_Q8B)
			k->quant_q8b(x + i * n, (struct md_q8b *)(buf + i * *stride), n);
		else
			k->quant_q8k(x + i * n, (struct md_q8k *)(buf + i * *stride), n);
	}
}

/* Bound on |dot(w, x) - dot(w, xq)| from rounding x to blocks of size bl: sum |w_i| * d_b / 2. */
static double quant_bound(enum md_dtype t, const void *w, const float *x, int64_t n)
{
	enum md_act_fmt f = md_kern_act_fmt(t);
	if (f == MD_ACT_F32)
		return 0;
	int bl = f == MD_ACT_Q8B ? 32 : 256;
	float *wd = malloc(sizeof(float) * n);
	md_dequant_row(t, w, wd, n);
	double b = 0;
	for (int64_t i0 = 0; i0 < n; i0 += bl) {
		float amax = 0;
		for (int i = 0; i < bl; i++)
			amax = fmaxf(amax, fabsf(x[i0 + i]));
		for (int i = 0; i < bl; i++)
			b += fabs(wd[i0 + i]) * amax / 127.0 * 0.5;
	}
	free(wd);
	return b;
}

/* sum_i |w_i x_i| over the dequantized row: the scale of float32 summation-order error. */
static double abs_dot(enum md_dtype t, const void *w, const float *x, int64_t n)
{
	float *wd = malloc(sizeof(float) * n);
	md_dequant_row(t, w, wd, n);
	double s = 0;
	for (int64_t i = 0; i < n; i++)
		s += fabs((double)wd[i] * x[i]);
	free(wd);
	return s;
}

/*
 * Row 1 of each quantized type: random bytes (every scale, min, sign and high-bit pattern,
 * including ones no quantizer writes), each block redrawn until it decodes to finite values
 * below 1e12 (random f16 / E8M0 scale fields can give inf, NaN or 2^127). Returns the number
 * of blocks that kept their quantized bytes (none in practice: a draw passes with
 * probability 0.6 or more).
 */
static int random_blocks(enum md_dtype t, uint8_t *row, int64_t n)
{
	const struct md_dtype_info *ti = md_dtype_info(t);
	uint8_t tmp[512];
	float y[256];
	int kept = 0;
	for (int64_t b = 0; b < n / ti->blck; b++) {
		bool ok = false;
		for (int attempt = 0; attempt < 64 && !ok; attempt++) {
			for (size_t i = 0; i < ti->type_size; i++)
				tmp[i] = (uint8_t)((frand() + 1.0f) * 128.0f);
			md_dequant_row(t, tmp, y, ti->blck);
			ok = true;
			for (int64_t i = 0; i < ti->blck && ok; i++)
				ok = isfinite(y[i]) && fabsf(y[i]) < 1e12f;
		}
		if (ok)
			memcpy(row + (size_t)b * ti->type_size, tmp, ti->type_size);
		else
			kept++;
	}
	return kept;
}

static void test_type(const struct md_kern *k, enum md_dtype t, int64_t n, float xscale)
{
	const char *tn = md_dtype_info(t)->name;
	const int nrow = 3, nt = MD_KERN_NT;
	size_t rb = md_dtype_row_size(t, n);
	uint8_t *w = malloc(rb * nrow);
	float *src = malloc(sizeof(float) * n), *x = malloc(sizeof(float) * n * nt);
	for (int r = 0; r < nrow; r++) {
		for (int64_t i = 0; i < n; i++)
			src[i] = frand() * (r == 2 ? 100.0f : 1.0f);
		md_quantize_row(t, src, w + rb * r, n);
	}
	if (t == MD_DT_Q8_0) /* quantize_row never writes -128; kernels must still take it */
		for (int i = 0; i < 32; i++)
			((int8_t *)(w + 2))[i] = i % 3 ? -128 : 127;
	if (md_dtype_info(t)->blck > 1)
		CHECK_MSG(random_blocks(t, w + rb, n) == 0, "%s: random blocks not drawn", tn);
	for (int64_t i = 0; i < n * nt; i++)
		x[i] = frand() * xscale;
	for (int64_t i = 0; i < n; i++) /* token 3: all zero (block scale 0) */
		x[3 * n + i] = 0;
	uint8_t *aq = malloc(n * nt * 4 + 64), *as = malloc(n * nt * 4 + 64);
	size_t stride;
	make_act(k, t, x, n, nt, aq, &stride);
	make_act(&md_kern_scalar, t, x, n, nt, as, &stride);
	CHECK_MSG(memcmp(aq, as, stride * nt) == 0, "%s %s: quantized activations differ from scalar",
	      k->name, tn);
	for (int r = 0; r < nrow; r++) {
		const uint8_t *wr = w + rb * r;
		for (int cnt = 1; cnt <= nt; cnt++) {
			float y[MD_KERN_NT * 2], ys[MD_KERN_NT];
			for (int i = 0; i < 2 * MD_KERN_NT; i++)
				y[i] = NAN;
			k->dot[t](n, wr, aq, stride, cnt, y, 2);
			md_kern_scalar.dot[t](n, wr, as, stride, cnt, ys, 1);
			for (int i = 0; i < cnt; i++) {
				double ref = md_vec_dot_ref(t, wr, x + i * n, n);
				double bound = quant_bound(t, wr, x + i * n, n);
				/* Float32 summation-order error scales with sum |w x| (row 2 is big
				 * and cancels), not with |result|. */
				double sabs = abs_dot(t, wr, x + i * n, n);
				double mag = fabs(ref) + bound + 1e-6;
				CHECK_MSG(fabs(y[2 * i] - ys[i]) <= 2e-5 * mag + 1e-6 * sabs,
				      "%s %s row %d nt %d tok %d: simd %.9g scalar %.9g", k->name, tn, r, cnt,
				      i, y[2 * i], ys[i]);
				CHECK_MSG(fabs(ys[i] - ref) <= bound * 1.001 + 1e-5 * (fabs(ref) + 1) + 1e-6 * sabs,
				      "%s row %d tok %d: scalar kernel %.9g ref %.9g bound %.3g", tn, r, i,
				      ys[i], ref, bound);
				CHECK_MSG(isnan(y[2 * i + 1]), "%s %s: wrote outside its y stride", k->name, tn);
				if (i == 3)
					CHECK_MSG(y[2 * i] == 0, "%s %s: zero activations give %g", k->name, tn,
					      y[2 * i]);
			}
			/* A tile equals its single-token calls exactly, and a 2-token call on the
			 * same row twice (stride 0): kernels form a token's sum in one order whatever
			 * nt is, nt == 1 included. */
			for (int i = 0; i < cnt; i++) {
				float one[2];
				k->dot[t](n, wr, aq + i * stride, 0, 2, one, 1);
				CHECK_MSG(one[0] == y[2 * i], "%s %s nt %d: tile %g != pair %g", k->name, tn, cnt,
				      y[2 * i], one[0]);
				CHECK_MSG(one[1] == y[2 * i], "%s %s nt %d: tile %g != pair's second %g", k->name,
				      tn, cnt, y[2 * i], one[1]);
				k->dot[t](n, wr, aq + i * stride, 0, 1, one, 1);
				CHECK_MSG(one[0] == y[2 * i], "%s %s nt %d: tile %g != nt 1 %g", k->name, tn,
				      cnt, y[2 * i], one[0]);
			}
		}
	}
	free(w);
	free(src);
	free(x);
	free(aq);
	free(as);
}

static void test_helpers(const struct md_kern *k)
{
	const int n = 77;
	float a[77], b[77], y1[77], y2[77], w[77];
	for (int i = 0; i < n; i++) {
		a[i] = frand();
		b[i] = frand();
		w[i] = frand();
		y1[i] = y2[i] = frand();
	}
	float d1 = k->dot_f32(a, b, n), d2 = md_kern_scalar.dot_f32(a, b, n);
	CHECK_MSG(fabsf(d1 - d2) <= 1e-5f * (1 + fabsf(d2)), "%s dot_f32 %g vs %g", k->name, d1, d2);
	d1 = k->sumsq_f32(a, n);
	d2 = md_kern_scalar.sumsq_f32(a, n);
	CHECK_MSG(fabsf(d1 - d2) <= 1e-5f * (1 + fabsf(d2)), "%s sumsq %g vs %g", k->name, d1, d2);
	k->axpy_f32(y1, 0.37f, a, n);
	md_kern_scalar.axpy_f32(y2, 0.37f, a, n);
	for (int i = 0; i < n; i++)
		CHECK_MSG(fabsf(y1[i] - y2[i]) <= 1e-6f, "%s axpy[%d] %g vs %g", k->name, i, y1[i], y2[i]);
	k->scale_mul_f32(y1, a, 1.7f, w, n);
	md_kern_scalar.scale_mul_f32(y2, a, 1.7f, w, n);
	for (int i = 0; i < n; i++)
		CHECK_MSG(y1[i] == y2[i], "%s scale_mul[%d] %g vs %g", k->name, i, y1[i], y2[i]);

	/* Half rows (latent attention's cache): against the sums in double of the decoded halves. */
	uint16_t h[77];
	double ref = 0;
	for (int i = 0; i < n; i++) {
		h[i] = md_f32_to_f16(b[i]);
		ref += (double)a[i] * md_f16_to_f32(h[i]);
		y1[i] = y2[i] = w[i];
	}
	d1 = k->dot_f32_f16(a, h, n);
	CHECK_MSG(fabs(d1 - ref) <= 1e-5 * (1 + fabs(ref)), "%s dot_f32_f16 %g vs %g", k->name, d1, ref);
	k->axpy_f16(y1, -0.61f, h, n);
	for (int i = 0; i < n; i++) {
		double want = w[i] + -0.61 * md_f16_to_f32(h[i]);
		CHECK_MSG(fabs(y1[i] - want) <= 1e-6 * (1 + fabs(want)), "%s axpy_f16[%d] %g vs %g",
			  k->name, i, y1[i], want);
	}
}

/*
 * Register-tiled gemm (float weights) over many shapes, edges included (rows and tokens not
 * multiples of the tile, n not a multiple of the vector width, bands of converted rows): every
 * output must equal the same table's dot call for that token alone bit for bit (kern.h: any
 * grouping of tokens and rows gives the same bits, nt == 1 included), and the scalar kernel within
 * float32 accumulation-order error:
 * |gemm - scalar| <= 1e-6 * sum_i |w_i x_i| + 1e-30.
 */
static void test_gemm(const struct md_kern *k)
{
	static const enum md_dtype ft[] = { MD_DT_F32, MD_DT_F16, MD_DT_BF16 };
	static const int64_t ns[] = { 16, 48, 77, 768, 1029 };
	static const int nrs[] = { 1, 2, 3, 4, 5, 7, 8, 9, 13, 32 };
	const int max_nt = 17, max_nr = 32;
	for (size_t ti = 0; ti < 3; ti++) {
		const enum md_dtype t = ft[ti];
		const char *tn = md_dtype_info(t)->name;
		if (!k->gemm[t])
			continue;
		for (size_t ni = 0; ni < sizeof(ns) / sizeof(ns[0]); ni++) {
			const int64_t n = ns[ni];
			const size_t rb = md_dtype_row_size(t, n) + 6; /* odd stride on purpose */
			uint8_t *w = malloc(rb * max_nr);
			float *src = malloc(sizeof(float) * n), *x = malloc(sizeof(float) * n * max_nt);
			float *wd = malloc(sizeof(float) * n);
			for (int r = 0; r < max_nr; r++) {
				for (int64_t i = 0; i < n; i++)
					src[i] = frand() * (r % 5 == 4 ? 50.0f : 1.0f);
				md_quantize_row(t, src, w + rb * r, n);
			}
			for (int64_t i = 0; i < n * max_nt; i++)
				x[i] = frand();
			const size_t ys = max_nr + 3;
			float *y = malloc(sizeof(float) * ys * max_nt);
			for (size_t ri = 0; ri < sizeof(nrs) / sizeof(nrs[0]); ri++) {
				const int nr = nrs[ri];
				for (int nt = 1; nt <= max_nt; nt++) {
					for (size_t i = 0; i < ys * max_nt; i++)
						y[i] = NAN;
					k->gemm[t](n, w, rb, nr, x, sizeof(float) * n, nt, y, ys);
					for (int tok = 0; tok < max_nt; tok++)
						for (size_t r = 0; r < ys; r++) {
							float got = y[tok * ys + r];
							if (tok >= nt || (int)r >= nr) {
								CHECK_MSG(isnan(got), "%s gemm %s n %d nr %d nt %d: wrote (%d, %d)",
								      k->name, tn, (int)n, nr, nt, tok, (int)r);
								continue;
							}
							const uint8_t *wr = w + rb * r;
							const float *xt = x + n * tok;
							float one[2], sc;
							k->dot[t](n, wr, xt, 0, 1, one, 1);
							md_kern_scalar.dot[t](n, wr, xt, sizeof(float) * n, 1, &sc, 1);
							md_dequant_row(t, wr, wd, n);
							double mag = 0;
							for (int64_t i = 0; i < n; i++)
								mag += fabs((double)wd[i] * xt[i]);
							CHECK_MSG(memcmp(&got, &one[0], sizeof(float)) == 0,
							      "%s gemm %s n %d nr %d nt %d (%d, %d): %.9g != dot %.9g",
							      k->name, tn, (int)n, nr, nt, tok, (int)r, got, one[0]);
							CHECK_MSG(fabs(got - sc) <= 1e-6 * mag + 1e-30,
							      "%s gemm %s n %d nr %d nt %d (%d, %d): %.9g scalar %.9g",
							      k->name, tn, (int)n, nr, nt, tok, (int)r, got, sc);
						}
				}
			}
			free(w);
			free(src);
			free(x);
			free(wd);
			free(y);
		}
	}
}

/*
 * Tokens in lanes (kern.h): for every type with a lanes kernel, rows whose block count is and
 * is not a multiple of 8, 1..MD_KERN_LANES tokens and several row counts, every output equals
 * the table's dot for that token alone, bit for bit, and the slots past nt are not written;
 * dot itself gives those bits at every nt (the tails of the 8-block loop included).
 */
static void test_lanes(const struct md_kern *k)
{
	static const int64_t ns[] = { 32, 224, 256, 800, 1088 };
	const int max_nr = 5, nt_max = MD_KERN_LANES;
	if (!k->pack_q8b_lanes)
		return;
	for (size_t ti = 0; ti < N_TYPES; ti++) {
		const enum md_dtype t = types[ti];
		if (!k->lanes[t])
			continue;
		CHECK_MSG(md_kern_act_fmt(t) == MD_ACT_Q8B && k->lanes_min >= MD_KERN_LANES_MIN,
			  "%s %s: lanes kernel for a type not on md_q8b", k->name, md_dtype_info(t)->name);
		for (size_t ni = 0; ni < sizeof(ns) / sizeof(ns[0]); ni++) {
			const int64_t n = ns[ni];
			const size_t rb = md_dtype_row_size(t, n) + 2; /* odd stride on purpose */
			uint8_t *w = malloc(rb * max_nr);
			float *x = malloc(sizeof(float) * n * nt_max), *src = malloc(sizeof(float) * n);
			for (int r = 0; r < max_nr; r++) {
				for (int64_t i = 0; i < n; i++)
					src[i] = frand() * (r == 3 ? 40.0f : 1.0f);
				md_quantize_row(t, src, w + rb * r, n);
			}
			for (int64_t i = 0; i < n * nt_max; i++)
				x[i] = frand() * (i / n == 5 ? 1e-3f : 1.0f);
			size_t as;
			uint8_t *a = malloc(md_kern_act_row_size(MD_ACT_Q8B, n) * nt_max + 64);
			uint8_t *p = malloc(md_kern_lanes_size(n) + 64);
			make_act(k, t, x, n, nt_max, a, &as);
			const size_t ys = max_nr + 1;
			float y[(5 + 1) * MD_KERN_LANES], one[MD_KERN_NT];
			for (int nt = 1; nt <= nt_max; nt++) {
				k->pack_q8b_lanes(a, as, nt, n, p);
				for (int nr = 1; nr <= max_nr; nr += 2) {
					for (size_t i = 0; i < sizeof(y) / sizeof(y[0]); i++)
						y[i] = NAN;
					k->lanes[t](n, w, rb, nr, p, nt, y, ys);
					for (int tok = 0; tok < nt_max; tok++)
						for (int r = 0; r < (int)ys; r++) {
							float got = y[tok * ys + r];
							if (tok >= nt || r >= nr) {
								CHECK_MSG(isnan(got), "%s lanes %s n %d nr %d nt %d: wrote (%d, %d)",
									  k->name, md_dtype_info(t)->name, (int)n, nr, nt, tok, r);
								continue;
							}
							k->dot[t](n, w + rb * r, a + as * tok, as, 1, one, 1);
							CHECK_MSG(memcmp(&got, &one[0], sizeof(float)) == 0,
								  "%s lanes %s n %d nr %d nt %d (%d, %d): %.9g != dot %.9g",
								  k->name, md_dtype_info(t)->name, (int)n, nr, nt, tok, r,
								  got, one[0]);
						}
				}
				/* dot with nt tokens equals dot with one. */
				for (int r = 0; r < max_nr; r++) {
					float yt[MD_KERN_NT];
					k->dot[t](n, w + rb * r, a, as, nt, yt, 1);
					for (int tok = 0; tok < nt; tok++) {
						k->dot[t](n, w + rb * r, a + as * tok, as, 1, one, 1);
						CHECK_MSG(memcmp(&yt[tok], &one[0], sizeof(float)) == 0,
							  "%s dot %s n %d nt %d row %d tok %d: %.9g != single %.9g",
							  k->name, md_dtype_info(t)->name, (int)n, nt, r, tok, yt[tok],
							  one[0]);
					}
				}
			}
			free(w);
			free(x);
			free(src);
			free(a);
			free(p);
		}
	}
}

/* Threaded kernel matmul (single and multi) against direct kernel calls, many token counts. */
static void test_matmul(const struct md_kern *k)
{
	md_kern_set_active(k);
	const int64_t n_in = 512;
	const int n_out[2] = { 45, 70 };
	const int max_tok = 14; /* n_tok 1..13 step 3: one and several gemm token tiles */
	for (size_t ti = 0; ti < N_TYPES; ti++) {
		enum md_dtype t = types[ti];
		size_t rb = md_dtype_row_size(t, n_in);
		uint8_t *w[2];
		float *src = malloc(sizeof(float) * n_in);
		for (int m = 0; m < 2; m++) {
			w[m] = malloc(rb * n_out[m]);
			for (int r = 0; r < n_out[m]; r++) {
				for (int i = 0; i < n_in; i++)
					src[i] = frand();
				md_quantize_row(t, src, w[m] + rb * r, n_in);
			}
		}
		float *x = malloc(sizeof(float) * n_in * max_tok);
		for (int i = 0; i < n_in * max_tok; i++)
			x[i] = frand();
		uint8_t *act = malloc(n_in * max_tok * 4 + 64);
		size_t stride;
		make_act(k, t, x, n_in, max_tok, act, &stride);
		for (int threads = 1; threads <= 3; threads++) {
			struct md_pool *pool = md_pool_new(threads);
			float *scratch = malloc(sizeof(float) * md_matmul_scratch_floats(pool, n_in, max_tok));
			for (int n_tok = 1; n_tok <= max_tok; n_tok += 3) {
				struct md_mat mm[2] = { { t, n_in, n_out[0], rb, w[0] },
							{ t, n_in, n_out[1], rb, w[1] } };
				float *y0 = malloc(sizeof(float) * n_out[1] * n_tok); /* reused for w[1] below */
				float *y1 = malloc(sizeof(float) * n_out[1] * n_tok);
				float *const ys[2] = { y0, y1 };
				md_matmul_multi(pool, mm, 2, x, n_tok, ys, scratch);
				for (int m = 0; m < 2; m++)
					for (int tok = 0; tok < n_tok; tok++)
						for (int r = 0; r < n_out[m]; r++) {
							/* Batched products match a 2-token dot, decode a 1-token
							 * one (kern.h). */
							float want[2];
							k->dot[t](n_in, w[m] + rb * r, act + tok * stride, 0,
								  n_tok > 1 ? 2 : 1, want, 1);
							float got = ys[m][tok * n_out[m] + r];
							CHECK_MSG(got == want[0],
							      "%s matmul %s threads %d n_tok %d w %d tok %d row %d: %g want %g",
							      k->name, md_dtype_info(t)->name, threads, n_tok, m, tok,
							      r, got, want[0]);
						}
				md_matmul(pool, &mm[1], x, n_tok, y0, scratch);
				CHECK_MSG(memcmp(y0, y1, sizeof(float) * n_out[1] * n_tok) == 0,
				      "%s matmul %s: single and multi differ", k->name, md_dtype_info(t)->name);
				free(y0);
				free(y1);
			}
			free(scratch);
			md_pool_free(pool);
		}
		free(src);
		free(w[0]);
		free(w[1]);
		free(x);
		free(act);
	}
}

int main(void)
{
	frand_seed(0x9e3779b97f4a7c15ull);
	const char *levels[] = { "scalar", "avx2", "avx512" };
	int tested = 0;
	for (int l = 0; l < 3; l++) {
		const struct md_kern *k = md_kern_by_name(levels[l]);
		if (!k) {
			printf("kernels: %s not available on this CPU/build, skipped\n", levels[l]);
			continue;
		}
		tested++;
		for (size_t ti = 0; ti < N_TYPES; ti++) {
			test_type(k, types[ti], 768, 1.0f);
			test_type(k, types[ti], 256, 1e-3f);
		}
		/* 32-element block types on rows of 1, 2, 3, 5, 6 and 25 blocks: kernels that take
		 * two (or four) blocks per step end on an odd block or a short step. */
		static const int nbs[] = { 1, 2, 3, 5, 6, 25 };
		for (size_t ti = 0; ti < N_TYPES; ti++)
			if (md_kern_act_fmt(types[ti]) == MD_ACT_Q8B)
				for (size_t i = 0; i < sizeof(nbs) / sizeof(nbs[0]); i++)
					test_type(k, types[ti], 32 * nbs[i], 1.0f);
		test_helpers(k);
		test_gemm(k);
		test_lanes(k);
		test_matmul(k);
		printf("kernels: %s checked\n", k->name);
	}
	if (failures) {
		fprintf(stderr, "kernels: %d failures\n", failures);
		return 1;
	}
	printf("kernels: ok (%d tables)\n", tested);
	return 0;
}
