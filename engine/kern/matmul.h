/* Matrix products of quantized weights with float activations, split over the thread pool. */
#ifndef MD_MATMUL_H
#define MD_MATMUL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/quant.h"
#include "engine/kern/threadpool.h"

/* A 2-D weight view: n_out rows of n_in elements, row r at data + r * nb1. */
struct md_mat {
	enum md_dtype type;
	int64_t n_in, n_out;
	size_t nb1;
	const void *data; /* borrowed */
};

/*
 * y[t][r] = dot(row r of w, x[t]) for t < n_tok; x is (n_tok, n_in), y is (n_tok, n_out), both
 * contiguous. Each weight row is read once for all n_tok tokens. Rows are split over the pool's
 * threads. With SIMD kernels (md_kern_active() != NULL) x is quantized once per call into
 * 8-bit blocks shared by all threads; with MOED_KERNELS=ref each thread dequantizes a row and
 * dots it in float. scratch: at least md_matmul_scratch_floats(pool, n_in, n_tok) floats.
 */
void md_matmul(struct md_pool *pool, const struct md_mat *w, const float *x, int n_tok, float *y,
	       float *scratch);

/* Several weights over the same input (Q/K/V, expert gate/up): ys[i] gets w[i] x, all in one
 * pass over the pool, the input quantized once when the weights pair with one activation
 * format. All w[i].n_in must be equal; nw <= MD_MATMUL_MAX_MULTI. */
#define MD_MATMUL_MAX_MULTI 4
void md_matmul_multi(struct md_pool *pool, const struct md_mat *w, int nw, const float *x,
		     int n_tok, float *const *ys, float *scratch);


/*
 * Expert-grouped products of a MoE layer in one pass over the pool (kernel path only: check
 * md_matmul_experts_ok first). Group g < ng owns slots off[g] .. off[g+1]-1 (off[0] is
 * normally 0); w holds nw weights per group, w[g * nw + i]. Slot s reads input row src[s - off[0]] of
 * x (x has n_x rows of w[0].n_in floats), or row s - off[0] of x when src is NULL, and gets
 * ys[i][s * w[i].n_out + r] = dot(row r of w[g * nw + i], input). The input rows are
 * quantized once, however many groups use them. Work items are row chunks of one group's
 * weight, taken dynamically by the threads. All weights share type and n_in, and w[g*nw+i]
 * the n_out of w[i]. scratch: md_matmul_experts_scratch_bytes(n_in, n_x, n_slots) bytes.
 */
bool md_matmul_experts_ok(const struct md_mat *w, int nw);
void md_matmul_experts(struct md_pool *pool, const struct md_mat *w, int nw, int ng,
		       const int32_t *off, const float *x, int n_x, const int32_t *src,
		       float *const *ys, void *scratch);
size_t md_matmul_experts_scratch_bytes(int64_t n_in, int n_x, int n_slots);

/* out (n) = in * w / sqrt(mean(in^2) + eps): one row's RMSNorm, with the active kernels' sum
 * of squares and scaled product (the portable loops without them). out may be in. */
void md_rmsnorm(float *out, const float *in, const float *w, int64_t n, float eps);

/* Floats of scratch md_matmul needs for rows of n_in elements and up to max_tok tokens. */
size_t md_matmul_scratch_floats(const struct md_pool *pool, int64_t n_in, int max_tok);

#endif
