/* Interface between the CUDA backend's host code (C) and its kernels (CUDA C++); private to cuda/. */
#ifndef MD_CUDA_MATMUL_CUDA_H
#define MD_CUDA_MATMUL_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Launches y[t * n_out + r] = dot(row r of w, x + t * n_in) for t < n_tok on stream (with
 * accumulate: y[...] += the dot, as a residual add after the product), without waiting. type is a GGML type id (md_dtype); w, x and y are device pointers; rows of w are nb1
 * bytes apart. The caller has checked everything md_backend.matmul documents (supported type,
 * n_in a multiple of the block size, alignment of w and nb1, n_tok >= 1); x must be 16-byte
 * aligned (cudaMalloc's 256 is). Returns the launch status (cudaSuccess or the error).
 */
cudaError_t md_cuda__matmul(int type, const void *w, int64_t n_in, int64_t n_out, size_t nb1,
			    const float *x, int n_tok, float *y, int accumulate,
			    cudaStream_t stream);

/* The most products md_cuda__matmul_multi launches together. */
#define MD_CUDA_MM_MULTI 3

/*
 * Launches md_cuda__matmul's products of n (1 .. MD_CUDA_MM_MULTI) weights w[i] (n_out[i]
 * rows each, all of type, n_in and nb1) with the same input x into y[i], as one kernel.
 */
cudaError_t md_cuda__matmul_multi(int type, int n, const void *const *w, const int64_t *n_out,
				  float *const *y, int64_t n_in, size_t nb1, const float *x,
				  int n_tok, cudaStream_t stream);

/*
 * Launches the expert-grouped products of md_backend_fwd.mm_experts (engine/backend_fwd.h),
 * nw (1 or 2) weights per group in one launch: group g < ng owns slots off[g] .. off[g+1]-1
 * and reads weight i's wtab[i * ng + g] (a device array of device pointers; all of type, n_in,
 * n_out and nb1 as given); slot s reads input row src[s] of x (row s when src is NULL) and
 * writes y[i][s * n_out + r]. max_rows bounds off[g+1] - off[g] (checked only: a block loops
 * over its group's rows). Same checks and alignment as md_cuda__matmul.
 */
cudaError_t md_cuda__matmul_experts(int type, const void *const *wtab, int64_t n_in,
				    int64_t n_out, size_t nb1, int ng, int nw, const int32_t *off,
				    const int32_t *src, const float *x, int max_rows, float *y0,
				    float *y1, cudaStream_t stream);

/* cudaSuccess when this binary carries code the current device can run (checked once at
 * backend init, so an old GPU is refused early instead of failing every launch). */
cudaError_t md_cuda__kernels_loadable(void);

#ifdef __cplusplus
}
#endif

#endif
