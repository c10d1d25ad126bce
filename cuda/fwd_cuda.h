/* Interface between the CUDA backend's device-forward ops (backend_cuda_fwd.c) and their
 * kernels (fwd.cu); private to cuda/. Each launcher enqueues on st and returns the launch
 * status without waiting; pointers are device memory. Semantics: engine/backend_fwd.h. */
#ifndef MD_CUDA_FWD_CUDA_H
#define MD_CUDA_FWD_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

/* Experts route and moe_layout take at most: MD_DEV_ROUTE_EMAX (engine/backend_fwd.h). */
#define MD_CUDA_ROUTE_EMAX 1024

#ifdef __cplusplus
extern "C" {
#endif

cudaError_t md_cuda__rmsnorm(float *y, const float *x, const float *w, int rows, int n, int stride,
			     float eps, cudaStream_t st);
cudaError_t md_cuda__add(float *y, const float *x, size_t n, cudaStream_t st);
cudaError_t md_cuda__add_rows(float *y, const float *bias, const int32_t *idx, int rows, int n,
			      cudaStream_t st);
cudaError_t md_cuda__rope(float *x, int n_tok, int n_head, int head_dim, int n_rot, int neox,
			  const float *cs, cudaStream_t st);
/* md_backend_fwd.qkv_rows (norm: 0 none, 1 per head, 2 whole rows: enum md_qk_norm). */
cudaError_t md_cuda__qkv_rows(float *q, float *k, const float *v, float *kc, float *vc,
			      const int32_t *wrow, const float *q_norm, const float *k_norm,
			      int norm, float eps, int n, int n_head, int n_head_kv, int head_dim,
			      int n_rot, int neox, const float *cs, cudaStream_t st);
/* gather 0: dst row rows[i] = src row i; 1: dst row i = src row rows[i]. */
cudaError_t md_cuda__rows(float *dst, const float *src, const int32_t *rows, int n, int dim,
			  int gather, cudaStream_t st);
cudaError_t md_cuda__glu(float *g, const float *u, size_t n, int oai, cudaStream_t st);
cudaError_t md_cuda__combine(float *out, const float *ye, const int32_t *slot, const float *w,
			     int n_tok, int k, int n, int accumulate, cudaStream_t st);
cudaError_t md_cuda__gate_add(float *y, const float *x, const float *gate, int n_tok, int n,
			      cudaStream_t st);
/* head_dim up to 256; n_tok up to 65535. */
cudaError_t md_cuda__attention(float *out, const float *q, const float *k, const float *v,
			       const int32_t *pos, const int32_t *tab, const int32_t *blocks,
			       const float *sinks, int n_tok, int n_head, int n_head_kv,
			       int head_dim, int swa, float scale, cudaStream_t st);

/* Latent attention (md_dev_mla_attn): rows of w halves (half) or floats, w up to 1024. */
cudaError_t md_cuda__attention_mla(float *out, const float *q, const void *rows, int half,
				   const int32_t *pos, const int32_t *tab, const int32_t *blocks,
				   int n_tok, int n_head, int w, int c, float scale,
				   cudaStream_t st);
cudaError_t md_cuda__copy2d(float *dst, size_t ds0, size_t ds1, const float *src, size_t ss0,
			    size_t ss1, int n0, int n1, int w, cudaStream_t st);
cudaError_t md_cuda__rows_store_f16(unsigned short *dst, const int32_t *rows, const float *src,
				    int n, int dim, cudaStream_t st);
/* Routing (engine/backend_fwd.h md_dev_route): fn 0 softmax top-k, 1 softmax over the top-k,
 * 2 scored top-k (sigmoid or softmax scores, bias NULL or E floats, n_groups > 1: group
 * limited; E up to 512); norm: renormalise. */
cudaError_t md_cuda__route(const float *logits, int n, int E, int K, int fn, int norm, int sigmoid,
			   float w_scale, int n_groups, int n_group_used, const float *bias,
			   int32_t *ids, float *w, cudaStream_t st);
/* The expert layout (md_dev_layout); E and n up to 1024. */
cudaError_t md_cuda__moe_layout(const int32_t *ids, const float *w, int n, int K, int E, int G,
				const void *const base[3], const size_t nb2[3], int32_t *off,
				int32_t *tok, int32_t *eid, int32_t *cslot, float *cw,
				const void **wtab, cudaStream_t st);

#ifdef __cplusplus
}
#endif

#endif
