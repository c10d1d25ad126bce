/* Matrix products of quantized weights with float activations, split over the thread pool.
 *
 * This is the portable path: each thread dequantizes one weight row into its scratch buffer and
 * dots it with every token of the micro-batch, so a weight row is read from memory once per
 * step however many tokens use it. SIMD kernels over quantized activations plug in here. */
#include "engine/matmul.h"

#include <string.h>

struct md_mat md_mat_of(const struct md_tensor *t, int64_t expert)
{
	struct md_mat m = {
		.type = t->type,
		.n_in = t->ne[0],
		.n_out = t->ne[1],
		.nb1 = t->nb1,
		.data = (const uint8_t *)t->data + (size_t)expert * t->nb2,
	};
	return m;
}

static inline float dot_f32(const float *a, const float *b, int64_t n)
{
	float acc[8] = { 0 };
	int64_t i = 0;
	for (; i + 8 <= n; i += 8)
		for (int j = 0; j < 8; j++)
			acc[j] += a[i + j] * b[i + j];
	float s = 0;
	for (; i < n; i++)
		s += a[i] * b[i];
	return s + ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

struct mm_job {
	const struct md_mat *w;
	const float *x;
	int n_tok;
	float *y;
	float *scratch;
	size_t scratch_stride;
};

static void mm_worker(void *ctx, int ith, int nth)
{
	struct mm_job *j = ctx;
	const struct md_mat *w = j->w;
	int64_t per = (w->n_out + nth - 1) / nth;
	int64_t r0 = per * ith, r1 = r0 + per < w->n_out ? r0 + per : w->n_out;
	float *row = j->scratch + j->scratch_stride * (size_t)ith;
	for (int64_t r = r0; r < r1; r++) {
		const void *src = (const uint8_t *)w->data + (size_t)r * w->nb1;
		const float *wr;
		if (w->type == MD_DT_F32) {
			wr = src;
		} else {
			md_dequant_row(w->type, src, row, w->n_in);
			wr = row;
		}
		for (int t = 0; t < j->n_tok; t++)
			j->y[(size_t)t * w->n_out + r] = dot_f32(wr, j->x + (size_t)t * w->n_in, w->n_in);
	}
}

size_t md_matmul_scratch_floats(const struct md_pool *pool, int64_t n_in)
{
	/* Pad each thread's buffer to 64 bytes so threads never share a cache line. */
	size_t stride = ((size_t)n_in + 15) & ~(size_t)15;
	return stride * (size_t)md_pool_size(pool);
}

void md_matmul(struct md_pool *pool, const struct md_mat *w, const float *x, int n_tok, float *y,
	       float *scratch)
{
	struct mm_job j = {
		.w = w,
		.x = x,
		.n_tok = n_tok,
		.y = y,
		.scratch = scratch,
		.scratch_stride = ((size_t)w->n_in + 15) & ~(size_t)15,
	};
	if (n_tok <= 0)
		return;
	md_pool_run(pool, mm_worker, &j);
}
