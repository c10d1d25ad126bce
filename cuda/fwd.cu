/* CUDA kernels of the device forward pass's ops (engine/backend_fwd.h), other than the
 * products (matmul.cu). Each mirrors its reference in engine/backend_sim.c; where the
 * reference fixes a summation order (combine: slots in order) the kernel keeps it. */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "cuda/launch.cuh"
#include "cuda/fwd_cuda.h"

#define KV_BLOCK 16 /* MD_KV_BLOCK_TOKENS (engine/kv_cache.h) */

static unsigned blocks_for(size_t n, unsigned per)
{
	size_t b = (n + per - 1) / per;
	return b > 0x7fffffffu ? 0x7fffffffu : (unsigned)b;
}

/* ---- RMSNorm: one block of 256 threads per row ---- */

/* The sum of v (every thread's share) over a block of at most 256 threads, returned to every
 * thread: each warp's shuffle tree, then the warps' sums by one more (part: 8 floats of
 * shared memory, free again on return). */
__device__ float block_sum(float v, float *part)
{
	for (int o = 16; o > 0; o >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, o);
	if ((threadIdx.x & 31) == 0)
		part[threadIdx.x >> 5] = v;
	__syncthreads();
	if (threadIdx.x < 32) {
		v = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.0f;
		for (int o = 16; o > 0; o >>= 1)
			v += __shfl_xor_sync(0xffffffffu, v, o);
		if (threadIdx.x == 0)
			part[0] = v;
	}
	__syncthreads();
	v = part[0];
	__syncthreads();
	return v;
}

__global__ void rmsnorm_kernel(float *y, const float *x, const float *w, int n, int stride,
			       float eps)
{
	md_pdl_enter();
	__shared__ float part[8];
	const float *xr = x + (int64_t)blockIdx.x * stride;
	float *yr = y + (int64_t)blockIdx.x * stride;
	float s = 0.0f;

	for (int i = threadIdx.x; i < n; i += blockDim.x)
		s += xr[i] * xr[i];
	const float scale = 1.0f / sqrtf(block_sum(s, part) / (float)n + eps);

	for (int i = threadIdx.x; i < n; i += blockDim.x)
		yr[i] = xr[i] * scale * w[i];
}

extern "C" cudaError_t md_cuda__rmsnorm(float *y, const float *x, const float *w, int rows, int n,
					int stride, float eps, cudaStream_t st)
{
	if (rows <= 0)
		return cudaSuccess;
	md_launch(rmsnorm_kernel, rows, 256, 0, st, y, x, w, n, stride, eps);
	return cudaGetLastError();
}

/* ---- elementwise ---- */

__global__ void add_kernel(float *y, const float *x, size_t n)
{
	md_pdl_enter();
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x)
		y[i] += x[i];
}

extern "C" cudaError_t md_cuda__add(float *y, const float *x, size_t n, cudaStream_t st)
{
	if (n == 0)
		return cudaSuccess;
	md_launch(add_kernel, blocks_for(n, 256), 256, 0, st, y, x, n);
	return cudaGetLastError();
}

__global__ void add_rows_kernel(float *y, const float *bias, const int32_t *idx, int rows, int n)
{
	md_pdl_enter();
	const size_t total = (size_t)rows * n;

	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
	     i += (size_t)gridDim.x * blockDim.x) {
		const int r = (int)(i / n), c = (int)(i % n);

		y[i] += bias[(idx != NULL ? (size_t)idx[r] * n : 0) + c];
	}
}

extern "C" cudaError_t md_cuda__add_rows(float *y, const float *bias, const int32_t *idx, int rows,
					 int n, cudaStream_t st)
{
	if (rows <= 0 || n <= 0)
		return cudaSuccess;
	md_launch(add_rows_kernel, blocks_for((size_t)rows * n, 256), 256, 0, st, y, bias, idx,
		  rows, n);
	return cudaGetLastError();
}

/* One thread per (token, head, pair). */
__global__ void rope_kernel(float *x, int n_tok, int n_head, int head_dim, int n_rot, int neox,
			    const float *cs)
{
	md_pdl_enter();
	const int half = n_rot / 2;
	const size_t total = (size_t)n_tok * n_head * half;

	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
	     i += (size_t)gridDim.x * blockDim.x) {
		const int p = (int)(i % half);
		const size_t th = i / half; /* token * n_head + head */
		const int t = (int)(th / n_head);
		const float c = cs[(size_t)t * n_rot + 2 * p], s = cs[(size_t)t * n_rot + 2 * p + 1];
		float *h = x + th * head_dim;
		const int a = neox ? p : 2 * p, b = neox ? p + half : 2 * p + 1;
		const float x0 = h[a], x1 = h[b];

		h[a] = x0 * c - x1 * s;
		h[b] = x0 * s + x1 * c;
	}
}

extern "C" cudaError_t md_cuda__rope(float *x, int n_tok, int n_head, int head_dim, int n_rot,
				     int neox, const float *cs, cudaStream_t st)
{
	const size_t total = (size_t)n_tok * n_head * (n_rot / 2);

	if (total == 0)
		return cudaSuccess;
	md_launch(rope_kernel, blocks_for(total, 256), 256, 0, st, x, n_tok, n_head, head_dim,
		  n_rot, neox, cs);
	return cudaGetLastError();
}

/* ---- attention's rows (md_backend_fwd.qkv_rows): one block of 256 threads per token ----
 *
 * The norms, rope and cache stores of one token in one launch where the unfused pass took six.
 * Each part computes what its own kernel does, in the same order: a whole row's norm is
 * rmsnorm_kernel's block reduction; a head's norm is done by one warp that replays that
 * reduction's tree (thread c * 32 + lane's strided sum, a shuffle tree per group of 32, then
 * the groups' tree), so the results equal the unfused kernels' bit for bit. */
#define QKV_THREADS 256

/* The sum of squares of a row of n floats at x by one warp: the value rmsnorm_kernel's block
 * of QKV_THREADS threads gets from block_sum for that row. */
__device__ float qkv_warp_sumsq(const float *x, int n, int lane)
{
	float tot = 0.0f;

	for (int c = 0; c < QKV_THREADS / 32; c++) {
		float v = 0.0f;

		for (int i = c * 32 + lane; i < n; i += QKV_THREADS)
			v += x[i] * x[i];
		for (int o = 16; o > 0; o >>= 1)
			v += __shfl_xor_sync(0xffffffffu, v, o);
		if (lane == c)
			tot = v;
	}
	for (int o = 16; o > 0; o >>= 1)
		tot += __shfl_xor_sync(0xffffffffu, tot, o);
	return tot;
}

/* rope_kernel's rotation of pair p of head h (heads of head_dim at x). */
__device__ __forceinline__ void qkv_rotate(float *x, int h, int p, int head_dim, int n_rot,
					   int neox, const float *cs)
{
	const int half = n_rot / 2;
	const float c = cs[2 * p], s = cs[2 * p + 1];
	float *hd = x + (size_t)h * head_dim;
	const int a = neox ? p : 2 * p, b = neox ? p + half : 2 * p + 1;
	const float x0 = hd[a], x1 = hd[b];

	hd[a] = x0 * c - x1 * s;
	hd[b] = x0 * s + x1 * c;
}

__global__ void __launch_bounds__(QKV_THREADS)
qkv_rows_kernel(float *q, float *k, const float *v, float *kc, float *vc, const int32_t *wrow,
		const float *q_norm, const float *k_norm, int norm, float eps, int n_head,
		int n_head_kv, int head_dim, int n_rot, int neox, const float *cs)
{
	md_pdl_enter();
	__shared__ float part[QKV_THREADS / 32];
	const int t = (int)blockIdx.x, QD = n_head * head_dim, KD = n_head_kv * head_dim;
	const int lane = (int)(threadIdx.x & 31), warp = (int)(threadIdx.x >> 5);
	float *qr = q + (size_t)t * QD, *kr = k + (size_t)t * KD;
	const float *vr = v + (size_t)t * KD;

	if (norm == 2) { /* MD_QK_NORM_FULL: each whole row, the block at a time */
		float sq = 0.0f, sk = 0.0f;

		for (int i = threadIdx.x; i < QD; i += QKV_THREADS)
			sq += qr[i] * qr[i];
		sq = block_sum(sq, part);
		for (int i = threadIdx.x; i < KD; i += QKV_THREADS)
			sk += kr[i] * kr[i];
		sk = block_sum(sk, part);
		const float cq = 1.0f / sqrtf(sq / (float)QD + eps);
		const float ck = 1.0f / sqrtf(sk / (float)KD + eps);

		for (int i = threadIdx.x; i < QD; i += QKV_THREADS)
			qr[i] = qr[i] * cq * q_norm[i];
		for (int i = threadIdx.x; i < KD; i += QKV_THREADS)
			kr[i] = kr[i] * ck * k_norm[i];
		__syncthreads();
	} else if (norm == 1) { /* MD_QK_NORM_HEAD: each head, a warp at a time */
		for (int h = warp; h < n_head + n_head_kv; h += QKV_THREADS / 32) {
			float *x = h < n_head ? qr + (size_t)h * head_dim
					      : kr + (size_t)(h - n_head) * head_dim;
			const float *w = h < n_head ? q_norm : k_norm;
			const float sc = 1.0f / sqrtf(qkv_warp_sumsq(x, head_dim, lane) /
						      (float)head_dim + eps);

			for (int i = lane; i < head_dim; i += 32)
				x[i] = x[i] * sc * w[i];
		}
		__syncthreads();
	}
	if (n_rot > 0) {
		const int half = n_rot / 2;
		const float *ct = cs + (size_t)t * n_rot;

		for (int i = threadIdx.x; i < (n_head + n_head_kv) * half; i += QKV_THREADS) {
			const int h = i / half, p = i % half;

			if (h < n_head)
				qkv_rotate(qr, h, p, head_dim, n_rot, neox, ct);
			else
				qkv_rotate(kr, h - n_head, p, head_dim, n_rot, neox, ct);
		}
		__syncthreads();
	}
	float *kd = kc + (size_t)wrow[t] * KD, *vd = vc + (size_t)wrow[t] * KD;

	for (int i = threadIdx.x; i < KD; i += QKV_THREADS) {
		kd[i] = kr[i];
		vd[i] = vr[i];
	}
}

extern "C" cudaError_t md_cuda__qkv_rows(float *q, float *k, const float *v, float *kc,
					 float *vc, const int32_t *wrow, const float *q_norm,
					 const float *k_norm, int norm, float eps, int n, int n_head,
					 int n_head_kv, int head_dim, int n_rot, int neox,
					 const float *cs, cudaStream_t st)
{
	if (n <= 0)
		return cudaSuccess;
	md_launch(qkv_rows_kernel, (unsigned)n, QKV_THREADS, 0, st, q, k, v, kc, vc, wrow, q_norm,
		  k_norm, norm, eps, n_head, n_head_kv, head_dim, n_rot, neox, cs);
	return cudaGetLastError();
}

/* dst row rows[i] = src row i (store), or dst row i = src row rows[i] (gather). */
__global__ void rows_kernel(float *dst, const float *src, const int32_t *rows, int n, int dim,
			    int gather)
{
	md_pdl_enter();
	const size_t total = (size_t)n * dim;

	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
	     i += (size_t)gridDim.x * blockDim.x) {
		const int r = (int)(i / dim), c = (int)(i % dim);

		if (gather)
			dst[i] = src[(size_t)rows[r] * dim + c];
		else
			dst[(size_t)rows[r] * dim + c] = src[i];
	}
}

extern "C" cudaError_t md_cuda__rows(float *dst, const float *src, const int32_t *rows, int n,
				     int dim, int gather, cudaStream_t st)
{
	if (n <= 0 || dim <= 0)
		return cudaSuccess;
	md_launch(rows_kernel, blocks_for((size_t)n * dim, 256), 256, 0, st, dst, src, rows, n,
		  dim, gather);
	return cudaGetLastError();
}

/* g = act(g, u): silu(g) u, or gpt-oss's clamped variant (engine/ffn_act.h). */
__global__ void glu_kernel(float *g, const float *u, size_t n, int oai)
{
	md_pdl_enter();
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x) {
		const float gv = g[i], uv = u[i];

		if (oai) {
			const float x = fminf(gv, 7.0f), y = fminf(fmaxf(uv, -7.0f), 7.0f);

			g[i] = x / (1.0f + expf(1.702f * -x)) * (y + 1.0f);
		} else {
			g[i] = gv / (1.0f + expf(-gv)) * uv;
		}
	}
}

extern "C" cudaError_t md_cuda__glu(float *g, const float *u, size_t n, int oai, cudaStream_t st)
{
	if (n == 0)
		return cudaSuccess;
	md_launch(glu_kernel, blocks_for(n, 256), 256, 0, st, g, u, n, oai);
	return cudaGetLastError();
}

/* out[t][i] = sum over j < k in order of w[t k + j] ye[slot[t k + j]][i] (accumulate: out +=
 * that sum, the residual add after an MoE layer). */
__global__ void combine_kernel(float *out, const float *ye, const int32_t *slot, const float *w,
			       int n_tok, int k, int n, int accumulate)
{
	md_pdl_enter();
	const size_t total = (size_t)n_tok * n;

	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
	     i += (size_t)gridDim.x * blockDim.x) {
		const int t = (int)(i / n), c = (int)(i % n);
		float acc = 0.0f;

		for (int j = 0; j < k; j++) {
			const int32_t s = slot[t * k + j];

			if (s >= 0)
				acc += w[t * k + j] * ye[(size_t)s * n + c];
		}
		out[i] = accumulate ? out[i] + acc : acc;
	}
}

extern "C" cudaError_t md_cuda__combine(float *out, const float *ye, const int32_t *slot,
					const float *w, int n_tok, int k, int n, int accumulate,
					cudaStream_t st)
{
	if (n_tok <= 0 || n <= 0)
		return cudaSuccess;
	md_launch(combine_kernel, blocks_for((size_t)n_tok * n, 256), 256, 0, st, out, ye, slot, w,
		  n_tok, k, n, accumulate);
	return cudaGetLastError();
}

__global__ void gate_add_kernel(float *y, const float *x, const float *gate, int n_tok, int n)
{
	md_pdl_enter();
	const size_t total = (size_t)n_tok * n;

	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
	     i += (size_t)gridDim.x * blockDim.x) {
		const int t = (int)(i / n);
		const float g = gate != NULL ? 1.0f / (1.0f + expf(-gate[t])) : 1.0f;

		y[i] += g * x[i];
	}
}

extern "C" cudaError_t md_cuda__gate_add(float *y, const float *x, const float *gate, int n_tok,
					 int n, cudaStream_t st)
{
	if (n_tok <= 0 || n <= 0)
		return cudaSuccess;
	md_launch(gate_add_kernel, blocks_for((size_t)n_tok * n, 256), 256, 0, st, y, x, gate,
		  n_tok, n);
	return cudaGetLastError();
}

/* ---- attention ----
 *
 * One block of ATT_WARPS warps per (head, token). Warp w takes the runs of ATT_RUN positions
 * starting at p0 + ATT_RUN w, p0 + ATT_RUN (w + ATT_WARPS), ...; lane l holds dims l, l + 32,
 * ... (up to ATT_DMAX / 32 of them) of the query and of its running output. A run's key and
 * value rows are all loaded before any of its arithmetic, so a warp waits on memory once per
 * run, not once per position: a decode step is one block per head, and its positions are
 * what keeps the memory busy. Each warp keeps an online softmax (running max m, sum l, output
 * scaled to m); the sink logit, when there is one, starts warp 0 at m = sink, l = 1. At the
 * end the warps' states are merged through shared memory. Positions are read through the
 * token's block table, rows of n_head_kv * head_dim floats. */
#define ATT_WARPS 16
#define ATT_RUN 4
#define ATT_DMAX 256

/* The end of an online softmax split over NW warps: every warp's running max m, sum l and
 * output acc (lane's dims lane + 32 j, j < DMAX / 32, below D) merged through shared memory;
 * out[d] = sum over warps of acc[d] e^(m - M) / sum of l e^(m - M), M the largest m. Every
 * thread of the block calls it. */
template <int DMAX, int NW>
__device__ void merge_warps(float m, float l, const float acc[DMAX / 32], int D, float *out)
{
	__shared__ float sm_m[NW], sm_l[NW];
	__shared__ float sm_acc[NW][DMAX];
	const int lane = (int)(threadIdx.x & 31), warp = (int)(threadIdx.x >> 5);

	if (lane == 0) {
		sm_m[warp] = m;
		sm_l[warp] = l;
	}
#pragma unroll
	for (int j = 0; j < DMAX / 32; j++) {
		const int d = lane + 32 * j;

		if (d < D)
			sm_acc[warp][d] = acc[j];
	}
	__syncthreads();
	float M = -INFINITY;

	for (int w = 0; w < NW; w++)
		M = fmaxf(M, sm_m[w]);
	float L = 0.0f, f[NW];

	for (int w = 0; w < NW; w++) {
		f[w] = sm_m[w] == -INFINITY ? 0.0f : expf(sm_m[w] - M);
		L += sm_l[w] * f[w];
	}
	for (int d = threadIdx.x; d < D; d += NW * 32) {
		float o = 0.0f;

		for (int w = 0; w < NW; w++)
			o += sm_acc[w][d] * f[w];
		out[d] = o / L;
	}
}

__global__ void __launch_bounds__(ATT_WARPS * 32)
attention_kernel(float *out, const float *q, const float *kc, const float *vc, const int32_t *pos,
		 const int32_t *tab, const int32_t *blocks, const float *sinks, int n_head,
		 int n_head_kv, int D, int swa, float scale)
{
	md_pdl_enter();
	const int h = (int)blockIdx.x, t = (int)blockIdx.y;
	const int lane = (int)(threadIdx.x & 31), warp = (int)(threadIdx.x >> 5);
	const int kvh = h / (n_head / n_head_kv), KD = n_head_kv * D, nd = (D + 31) / 32;
	const int P = pos[t], p0 = swa > 0 && P >= swa ? P - swa + 1 : 0;
	const int32_t *bt = blocks + tab[t];
	const float *qh = q + ((size_t)t * n_head + h) * D;
	float qr[ATT_DMAX / 32], acc[ATT_DMAX / 32];
	float m = -INFINITY, l = 0.0f;

#pragma unroll
	for (int j = 0; j < ATT_DMAX / 32; j++) {
		const int d = lane + 32 * j;

		qr[j] = j < nd && d < D ? qh[d] : 0.0f;
		acc[j] = 0.0f;
	}
	if (warp == 0 && sinks != NULL) {
		m = sinks[h];
		l = 1.0f;
	}
	for (int pr = p0 + ATT_RUN * warp; pr <= P; pr += ATT_RUN * ATT_WARPS) {
		const int nr = P - pr + 1 < ATT_RUN ? P - pr + 1 : ATT_RUN; /* warp-uniform */
		float kv[ATT_RUN][ATT_DMAX / 32], vv[ATT_RUN][ATT_DMAX / 32], s[ATT_RUN];

#pragma unroll
		for (int u = 0; u < ATT_RUN; u++) {
			const int p = pr + (u < nr ? u : 0);
			const size_t row = (size_t)bt[p / KV_BLOCK] * KV_BLOCK + (size_t)(p % KV_BLOCK);
			const float *kr = kc + row * KD + (size_t)kvh * D;
			const float *vr = vc + row * KD + (size_t)kvh * D;

#pragma unroll
			for (int j = 0; j < ATT_DMAX / 32; j++) {
				const int d = lane + 32 * j;
				const bool in = j < nd && d < D;

				kv[u][j] = in ? kr[d] : 0.0f;
				vv[u][j] = in ? vr[d] : 0.0f;
			}
		}
#pragma unroll
		for (int u = 0; u < ATT_RUN; u++) {
			s[u] = 0.0f;
#pragma unroll
			for (int j = 0; j < ATT_DMAX / 32; j++)
				s[u] += qr[j] * kv[u][j];
		}
#pragma unroll
		for (int o = 16; o > 0; o >>= 1)
#pragma unroll
			for (int u = 0; u < ATT_RUN; u++)
				s[u] += __shfl_xor_sync(0xffffffffu, s[u], o);
#pragma unroll
		for (int u = 0; u < ATT_RUN; u++) {
			if (u >= nr)
				break;
			const float su = s[u] * scale;
			const float mn = fmaxf(m, su);
			const float corr = m == -INFINITY ? 0.0f : expf(m - mn);
			const float e = expf(su - mn);

			l = l * corr + e;
#pragma unroll
			for (int j = 0; j < ATT_DMAX / 32; j++)
				acc[j] = acc[j] * corr + e * vv[u][j];
			m = mn;
		}
	}
	merge_warps<ATT_DMAX, ATT_WARPS>(m, l, acc, D, out + ((size_t)t * n_head + h) * D);
}

extern "C" cudaError_t md_cuda__attention(float *out, const float *q, const float *k,
					  const float *v, const int32_t *pos, const int32_t *tab,
					  const int32_t *blocks, const float *sinks, int n_tok,
					  int n_head, int n_head_kv, int head_dim, int swa,
					  float scale, cudaStream_t st)
{
	if (head_dim <= 0 || head_dim > ATT_DMAX || n_head_kv <= 0 || n_head % n_head_kv != 0 ||
	    n_tok > 65535)
		return cudaErrorInvalidValue;
	if (n_tok <= 0)
		return cudaSuccess;
	const dim3 grid((unsigned)n_head, (unsigned)n_tok);

	md_launch(attention_kernel, grid, ATT_WARPS * 32, 0, st, out, q, k, v, pos, tab, blocks,
		  sinks, n_head, n_head_kv, head_dim, swa, scale);
	return cudaGetLastError();
}

/* ---- routing on the device ----
 *
 * route: one warp per token, with engine/router.c's arithmetic (float exp, double sums taken
 * in expert order, repeated arg-max with ties to the lower id): the lanes share the per-expert
 * work and each arg-max is a warp reduction, so a decode step's routing costs a few
 * microseconds, not the tens a single thread took over 128 experts. layout: one block for the
 * whole batch: counts by expert with shared-memory atomics, a block scan for each expert's
 * first slot and group, and each slot placed by its rank among its expert's entries (the
 * entries before it with the same expert), which is router.c's stable counting sort. */
#define ROUTE_EMAX MD_CUDA_ROUTE_EMAX

/* The better of two (value, id) candidates: the greater value, ties to the lower id; id < 0
 * is no candidate. */
__device__ __forceinline__ bool cand_better(float v, int i, float bv, int bi)
{
	return i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi));
}

/* The k largest of v (n, shared) not yet taken, into ids[0, k) (global; lane 0 writes), as
 * router.c's topk: each round the lanes scan their experts in ascending order, keeping the
 * first of equal maxima, then the warp keeps the better across lanes. taken (shared, n) is
 * cleared here. One warp; block = that warp. */
__device__ void warp_topk(const float *v, uint8_t *taken, int n, int k, int32_t *ids, int lane)
{
	for (int e = lane; e < n; e += 32)
		taken[e] = 0;
	__syncthreads();
	for (int j = 0; j < k; j++) {
		float bv = 0.0f;
		int bi = -1;

		for (int e = lane; e < n; e += 32)
			if (!taken[e] && (bi < 0 || v[e] > bv)) {
				bv = v[e];
				bi = e;
			}
		for (int o = 16; o > 0; o >>= 1) {
			const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
			const int oi = __shfl_xor_sync(0xffffffffu, bi, o);

			if (cand_better(ov, oi, bv, bi)) {
				bv = ov;
				bi = oi;
			}
		}
		if (lane == 0) {
			ids[j] = bi;
			taken[bi] = 1;
		}
		__syncthreads();
	}
}

/* Largest of the row's logits, every lane holding it. */
__device__ float warp_row_max(const float *l, int E, int lane)
{
	float mx = l[0];

	for (int e = lane; e < E; e += 32)
		mx = l[e] > mx ? l[e] : mx;
	for (int o = 16; o > 0; o >>= 1) {
		const float om = __shfl_xor_sync(0xffffffffu, mx, o);

		mx = om > mx ? om : mx;
	}
	return mx;
}

/* p (shared, E) = the row's softmax as router.c rounds it: float exp(l - max), their double
 * sum in expert order (lane 0: the order is what makes it router.c's), each quotient rounded
 * to float. */
__device__ void warp_softmax(const float *l, int E, float *p, int lane)
{
	__shared__ double s_sum;
	const float mx = warp_row_max(l, E, lane);

	for (int e = lane; e < E; e += 32)
		p[e] = expf(l[e] - mx);
	__syncthreads();
	if (lane == 0) {
		double sum = 0;

		for (int e = 0; e < E; e++)
			sum += p[e];
		s_sum = sum;
	}
	__syncthreads();
	const double sum = s_sum;

	for (int e = lane; e < E; e += 32)
		p[e] = (float)((double)p[e] / sum);
	__syncthreads();
}

/* fn: 0 softmax top-k, 1 softmax over the top-k, 2 scored top-k (sigmoid: its gating).
 * Block: one warp, for token blockIdx.x. */
__global__ void __launch_bounds__(32)
route_kernel(const float *logits, int E, int K, int fn, int norm, int sigmoid, float w_scale,
	     int n_groups, int n_group_used, const float *bias, int32_t *ids_out, float *w_out)
{
	md_pdl_enter();
	__shared__ float p[ROUTE_EMAX], sel[ROUTE_EMAX], gs[64];
	__shared__ uint8_t taken[ROUTE_EMAX];
	__shared__ int32_t gid[64];
	const int t = (int)blockIdx.x, lane = (int)threadIdx.x;
	const float *l = logits + (size_t)t * E;
	int32_t *ids = ids_out + (size_t)t * K;
	float *w = w_out + (size_t)t * K;

	if (fn == 1) { /* top-k of the logits, then a softmax over those k */
		for (int e = lane; e < E; e += 32)
			sel[e] = l[e];
		__syncthreads();
		warp_topk(sel, taken, E, K, ids, lane);
		if (lane == 0) {
			const float mx = sel[ids[0]];
			double sum = 0;

			for (int k = 0; k < K; k++) {
				w[k] = expf(sel[ids[k]] - mx);
				sum += w[k];
			}
			for (int k = 0; k < K; k++)
				w[k] = (float)(w[k] / sum);
		}
		return;
	}
	if (fn == 0) {
		warp_softmax(l, E, p, lane);
		warp_topk(p, taken, E, K, ids, lane);
		if (lane == 0) {
			double wsum = 0;

			for (int k = 0; k < K; k++) {
				w[k] = p[ids[k]];
				wsum += w[k];
			}
			if (norm)
				for (int k = 0; k < K; k++)
					w[k] = (float)(w[k] / wsum);
		}
		return;
	}
	/* scored top-k: scores, the biased selection within the best groups, weights from the
	 * unbiased scores (router.c select_scored_topk) */
	if (sigmoid) {
		for (int e = lane; e < E; e += 32)
			p[e] = 1.0f / (1.0f + expf(-l[e]));
		__syncthreads();
	} else {
		warp_softmax(l, E, p, lane);
	}
	for (int e = lane; e < E; e += 32)
		sel[e] = bias != NULL ? p[e] + bias[e] : p[e];
	__syncthreads();
	if (n_groups > 1) {
		const int per = E / n_groups, two = per < 2 ? per : 2;

		/* each group's score: the sum of its two best selection values, in rank order */
		for (int g = lane; g < n_groups; g += 32) {
			const float *sg = sel + g * per;
			int b0 = -1, b1 = -1;

			for (int e = 0; e < per; e++)
				if (b0 < 0 || sg[e] > sg[b0])
					b0 = e;
			for (int e = 0; e < per && two > 1; e++)
				if (e != b0 && (b1 < 0 || sg[e] > sg[b1]))
					b1 = e;
			gs[g] = 0.0f + sg[b0];
			if (two > 1)
				gs[g] += sg[b1];
		}
		__syncthreads();
		warp_topk(gs, taken, n_groups, n_group_used, gid, lane);
		for (int e = lane; e < E; e += 32) {
			bool kept = false;

			for (int j = 0; j < n_group_used; j++)
				kept |= gid[j] == e / per;
			if (!kept)
				sel[e] = -INFINITY;
		}
		__syncthreads();
	}
	warp_topk(sel, taken, E, K, ids, lane);
	if (lane != 0)
		return;
	float wsum = 0.0f;

	for (int k = 0; k < K; k++) {
		w[k] = p[ids[k]];
		wsum += w[k];
	}
	if (norm) {
		if (wsum < 6.103515625e-5f)
			wsum = 6.103515625e-5f;
		for (int k = 0; k < K; k++)
			w[k] /= wsum;
	}
	if (w_scale != 1.0f)
		for (int k = 0; k < K; k++)
			w[k] *= w_scale;
}

extern "C" cudaError_t md_cuda__route(const float *logits, int n, int E, int K, int fn, int norm,
				      int sigmoid, float w_scale, int n_groups, int n_group_used,
				      const float *bias, int32_t *ids, float *w, cudaStream_t st)
{
	if (n <= 0 || E <= 0 || E > ROUTE_EMAX || K <= 0 || K > E || fn < 0 || fn > 2 ||
	    (fn == 2 && (n_groups > 64 ||
			 (n_groups > 1 && (E % n_groups || n_group_used < 1 ||
					   n_group_used > n_groups)))))
		return cudaErrorInvalidValue;
	md_launch(route_kernel, (unsigned)n, 32, 0, st, logits, E, K, fn, norm, sigmoid, w_scale,
		  n_groups, n_group_used, bias, ids, w);
	return cudaGetLastError();
}

#define LAYOUT_THREADS 256
#define LAYOUT_PER (MD_CUDA_ROUTE_EMAX / LAYOUT_THREADS) /* experts a thread scans */

__global__ void __launch_bounds__(LAYOUT_THREADS)
layout_kernel(const int32_t *ids, const float *w, int n, int K, int E, int G, const uint8_t *b0,
	      const uint8_t *b1, const uint8_t *b2, size_t s0, size_t s1, size_t s2, int32_t *off,
	      int32_t *tok, int32_t *eid, int32_t *cslot, float *cw, const void **wtab)
{
	md_pdl_enter();
	/* cnt: each expert's entries, then its first slot; sc, sg: the block scan's partial sums
	 * of the threads' shares (entries, and active experts) */
	__shared__ int32_t cnt[MD_CUDA_ROUTE_EMAX];
	__shared__ int32_t sc[2][LAYOUT_THREADS], sg[2][LAYOUT_THREADS];
	const int tid = (int)threadIdx.x, NK = n * K;

	for (int e = tid; e < E; e += LAYOUT_THREADS)
		cnt[e] = 0;
	__syncthreads();
	for (int i = tid; i < NK; i += LAYOUT_THREADS)
		atomicAdd(&cnt[ids[i]], 1);
	__syncthreads();
	/* inclusive scan of the threads' shares (experts [tid LAYOUT_PER, + LAYOUT_PER)) */
	const int e0 = tid * LAYOUT_PER;
	int c = 0, a = 0;

	for (int e = e0; e < e0 + LAYOUT_PER && e < E; e++) {
		c += cnt[e];
		a += cnt[e] != 0;
	}
	int cur = 0;

	sc[0][tid] = c;
	sg[0][tid] = a;
	__syncthreads();
	for (int d = 1; d < LAYOUT_THREADS; d <<= 1) {
		int vc = sc[cur][tid], vg = sg[cur][tid];

		if (tid >= d) {
			vc += sc[cur][tid - d];
			vg += sg[cur][tid - d];
		}
		sc[cur ^ 1][tid] = vc;
		sg[cur ^ 1][tid] = vg;
		cur ^= 1;
		__syncthreads();
	}
	const int n_act = sg[cur][LAYOUT_THREADS - 1];

	c = sc[cur][tid] - c; /* exclusive: slots before the share */
	a = sg[cur][tid] - a;
	for (int e = e0; e < e0 + LAYOUT_PER && e < E; e++) {
		const int k = cnt[e];

		if (k) {
			off[a] = c;
			wtab[a] = b0 + (size_t)e * s0;
			wtab[G + a] = b1 + (size_t)e * s1;
			wtab[2 * G + a] = b2 + (size_t)e * s2;
		}
		cnt[e] = c;
		c += k;
		a += k != 0;
	}
	for (int g = n_act + tid; g <= G; g += LAYOUT_THREADS) {
		off[g] = NK;
		if (g < G) {
			wtab[g] = b0;
			wtab[G + g] = b1;
			wtab[2 * G + g] = b2;
		}
	}
	__syncthreads();
	/* entry i = (token t, choice j): its slot is its expert's first plus the entries before
	 * it with the same expert; token t's combine row lists its slots ascending, and a
	 * token's experts are distinct, so the position is the number of its experts below e */
	for (int i = tid; i < NK; i += LAYOUT_THREADS) {
		const int e = ids[i], t = i / K;
		int r = 0, pos = 0;

		for (int j = 0; j < i; j++)
			r += ids[j] == e;
		for (int j = t * K; j < t * K + K; j++)
			pos += ids[j] < e;
		const int sl = cnt[e] + r;

		tok[sl] = t;
		eid[sl] = e;
		cslot[t * K + pos] = sl;
		cw[t * K + pos] = w[i];
	}
}

extern "C" cudaError_t md_cuda__moe_layout(const int32_t *ids, const float *w, int n, int K, int E,
					   int G, const void *const base[3], const size_t nb2[3],
					   int32_t *off, int32_t *tok, int32_t *eid, int32_t *cslot,
					   float *cw, const void **wtab, cudaStream_t st)
{
	if (n <= 0 || K <= 0 || E <= 0 || E > MD_CUDA_ROUTE_EMAX || G < 1 || G > E || G > n * K)
		return cudaErrorInvalidValue;
	md_launch(layout_kernel, 1, LAYOUT_THREADS, 0, st, ids, w, n, K, E, G,
		  (const uint8_t *)base[0], (const uint8_t *)base[1], (const uint8_t *)base[2],
		  nb2[0], nb2[1], nb2[2], off, tok, eid, cslot, cw, wtab);
	return cudaGetLastError();
}

/* ---- latent attention (deepseek2) ----
 *
 * As attention_kernel: one block of MLA_WARPS warps per (head, token), each warp an online
 * softmax over every MLA_WARPS-th position (one at a time: a latent row is already W = C + R
 * values, 18 a lane for DeepSeek's 576, so a position keeps 18 loads in flight), merged at the
 * end; here every head reads the same cache rows (w = C + R halves or floats: scores over all
 * w, values the first c), and the output is head-major. */
#define MLA_WMAX 1024
#define MLA_CMAX 512 /* the latent rank (DeepSeek-V2/V3, Kimi-K2: 512) */
#define MLA_WARPS 16

__device__ __forceinline__ float row_at(const void *rows, int half, size_t i)
{
	return half ? __half2float(__ushort_as_half(((const unsigned short *)rows)[i]))
		    : ((const float *)rows)[i];
}

__global__ void __launch_bounds__(MLA_WARPS * 32)
attention_mla_kernel(float *out, const float *q, const void *rows, int half, const int32_t *pos,
		     const int32_t *tab, const int32_t *blocks, int n_tok, int n_head, int W, int C,
		     float scale)
{
	md_pdl_enter();
	const int h = (int)blockIdx.x, t = (int)blockIdx.y;
	const int lane = (int)(threadIdx.x & 31), warp = (int)(threadIdx.x >> 5);
	const int nw = (W + 31) / 32, nc = (C + 31) / 32;
	const int P = pos[t];
	const int32_t *bt = blocks + tab[t];
	const float *qh = q + ((size_t)t * n_head + h) * W;
	float qr[MLA_WMAX / 32], acc[MLA_CMAX / 32];
	float m = -INFINITY, l = 0.0f;

#pragma unroll
	for (int j = 0; j < MLA_WMAX / 32; j++) {
		const int d = lane + 32 * j;

		qr[j] = j < nw && d < W ? qh[d] : 0.0f;
	}
#pragma unroll
	for (int j = 0; j < MLA_CMAX / 32; j++)
		acc[j] = 0.0f;
	for (int p = warp; p <= P; p += MLA_WARPS) {
		const size_t row = ((size_t)bt[p / KV_BLOCK] * KV_BLOCK + (size_t)(p % KV_BLOCK)) * W;
		float s = 0.0f;

#pragma unroll
		for (int j = 0; j < MLA_WMAX / 32; j++) {
			const int d = lane + 32 * j;

			if (j < nw && d < W)
				s += qr[j] * row_at(rows, half, row + d);
		}
		for (int o = 16; o > 0; o >>= 1)
			s += __shfl_xor_sync(0xffffffffu, s, o);
		s *= scale;
		const float mn = fmaxf(m, s);
		const float corr = m == -INFINITY ? 0.0f : expf(m - mn);
		const float e = expf(s - mn);

		l = l * corr + e;
#pragma unroll
		for (int j = 0; j < MLA_CMAX / 32; j++) {
			const int d = lane + 32 * j;

			if (j < nc && d < C)
				acc[j] = acc[j] * corr + e * row_at(rows, half, row + d);
		}
		m = mn;
	}
	merge_warps<MLA_CMAX, MLA_WARPS>(m, l, acc, C, out + ((size_t)h * n_tok + t) * C);
}

extern "C" cudaError_t md_cuda__attention_mla(float *out, const float *q, const void *rows,
					      int half, const int32_t *pos, const int32_t *tab,
					      const int32_t *blocks, int n_tok, int n_head, int w,
					      int c, float scale, cudaStream_t st)
{
	if (w <= 0 || w > MLA_WMAX || c <= 0 || c > w || c > MLA_CMAX || n_head <= 0 ||
	    n_tok > 65535)
		return cudaErrorInvalidValue;
	if (n_tok <= 0)
		return cudaSuccess;
	const dim3 grid((unsigned)n_head, (unsigned)n_tok);

	md_launch(attention_mla_kernel, grid, MLA_WARPS * 32, 0, st, out, q, rows, half, pos, tab,
		  blocks, n_tok, n_head, w, c, scale);
	return cudaGetLastError();
}

__global__ void copy2d_kernel(float *dst, size_t ds0, size_t ds1, const float *src, size_t ss0,
			      size_t ss1, int n1, int w, size_t total)
{
	md_pdl_enter();
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
	     i += (size_t)gridDim.x * blockDim.x) {
		const size_t e = i % (size_t)w, ij = i / (size_t)w;
		const size_t j = ij % (size_t)n1, a = ij / (size_t)n1;

		dst[a * ds0 + j * ds1 + e] = src[a * ss0 + j * ss1 + e];
	}
}

extern "C" cudaError_t md_cuda__copy2d(float *dst, size_t ds0, size_t ds1, const float *src,
				       size_t ss0, size_t ss1, int n0, int n1, int w,
				       cudaStream_t st)
{
	const size_t total = (size_t)n0 * (size_t)n1 * (size_t)w;

	if (n0 <= 0 || n1 <= 0 || w <= 0)
		return cudaSuccess;
	md_launch(copy2d_kernel, blocks_for(total, 256), 256, 0, st, dst, ds0, ds1, src, ss0, ss1,
		  n1, w, total);
	return cudaGetLastError();
}

__global__ void rows_f16_kernel(unsigned short *dst, const int32_t *rows, const float *src, int n,
				int dim)
{
	md_pdl_enter();
	const size_t total = (size_t)n * dim;

	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
	     i += (size_t)gridDim.x * blockDim.x) {
		const int r = (int)(i / dim), c = (int)(i % dim);

		dst[(size_t)rows[r] * dim + c] = __half_as_ushort(__float2half_rn(src[i]));
	}
}

extern "C" cudaError_t md_cuda__rows_store_f16(unsigned short *dst, const int32_t *rows,
					       const float *src, int n, int dim, cudaStream_t st)
{
	if (n <= 0 || dim <= 0)
		return cudaSuccess;
	md_launch(rows_f16_kernel, blocks_for((size_t)n * dim, 256), 256, 0, st, dst, rows, src, n,
		  dim);
	return cudaGetLastError();
}
