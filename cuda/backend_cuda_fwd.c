/* The CUDA backend's device forward ops (engine/backend_fwd.h): argument checks and launches
 * on stream 0, nothing waited for except by sync. The kernels are fwd.cu's and matmul.cu's. */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "cuda/cuda_ctx.h"
#include "cuda/fwd_cuda.h"
#include "cuda/matmul_cuda.h"

_Static_assert(MD_CUDA_ROUTE_EMAX == MD_DEV_ROUTE_EMAX, "fwd_cuda.h mirrors backend_fwd.h");
_Static_assert(MD_CUDA_MM_MULTI == MD_DEV_MM_MULTI, "matmul_cuda.h mirrors backend_fwd.h");
_Static_assert(MD_QK_NORM_NONE == 0 && MD_QK_NORM_HEAD == 1 && MD_QK_NORM_FULL == 2,
	       "fwd.cu's qkv_rows_kernel reads the norm as 0, 1, 2");

static cudaStream_t st0(const struct md_backend *b)
{
	const struct cuda_ctx *c = b->_ctx;

	return c->stream[MD_BACKEND_STREAM_COMPUTE];
}

/* Whether weights of type t, n_in and nb1 at data suit the kernels (backend.h's matmul). */
static bool weights_ok(enum md_dtype t, int64_t n_in, size_t nb1, const void *data)
{
	int64_t blck;
	size_t bytes, align;

	md_cuda__type_layout(t, &blck, &bytes, &align);
	return blck != 0 && n_in > 0 && n_in % blck == 0 && nb1 >= (size_t)(n_in / blck) * bytes &&
	       nb1 % align == 0 && (data == NULL || (uintptr_t)data % align == 0);
}

/* Whether the products kernels take w for n_tok tokens. */
static bool mat_ok(const struct md_mat *w, int n_tok)
{
	return n_tok >= 1 && w->n_out >= 1 && w->data != NULL &&
	       weights_ok(w->type, w->n_in, w->nb1, w->data);
}

/* mm (accumulate 0) or mm_add (1). */
static int mm_launch(struct md_backend *b, const struct md_mat *w, const float *x, int n_tok,
		     float *y, int accumulate)
{
	if (!mat_ok(w, n_tok))
		return -EINVAL;
	return md_cuda__errno(md_cuda__matmul((int)w->type, w->data, w->n_in, w->n_out, w->nb1, x,
					      n_tok, y, accumulate, st0(b)));
}

static int fwd_mm(struct md_backend *b, const struct md_mat *w, const float *x, int n_tok,
		  float *y)
{
	return mm_launch(b, w, x, n_tok, y, 0);
}

/* One launch where the weights share type, n_in and nb1 (MOED_NO_FUSE: one each). */
static int fwd_mm_multi(struct md_backend *b, int n, const struct md_mat *const *w,
			const float *x, int n_tok, float *const *y)
{
	const struct cuda_ctx *c = b->_ctx;
	const void *wd[MD_DEV_MM_MULTI];
	int64_t rows[MD_DEV_MM_MULTI];
	bool same = !c->no_fuse;

	if (n < 1 || n > MD_DEV_MM_MULTI)
		return -EINVAL;
	for (int i = 0; i < n; i++) {
		if (!mat_ok(w[i], n_tok))
			return -EINVAL;
		same = same && w[i]->type == w[0]->type && w[i]->n_in == w[0]->n_in &&
		       w[i]->nb1 == w[0]->nb1;
		wd[i] = w[i]->data;
		rows[i] = w[i]->n_out;
	}
	if (same)
		return md_cuda__errno(md_cuda__matmul_multi((int)w[0]->type, n, wd, rows, y,
							    w[0]->n_in, w[0]->nb1, x, n_tok,
							    st0(b)));
	for (int i = 0; i < n; i++) {
		int rc = fwd_mm(b, w[i], x, n_tok, y[i]);
		if (rc)
			return rc;
	}
	return 0;
}

static int fwd_mm_add(struct md_backend *b, const struct md_mat *w, const float *x, int n_tok,
		      float *y)
{
	return mm_launch(b, w, x, n_tok, y, 1);
}

static int fwd_mm_experts(struct md_backend *b, const struct md_dev_experts *e)
{
	if (e->nw < 1 || e->nw > 2 || e->ng < 1 || e->n_slots < 1 || e->max_rows < 1 ||
	    !weights_ok(e->type, e->n_in, e->nb1, NULL))
		return -EINVAL;
	/* Both weights in one launch; MOED_NO_FUSE=1 launches them one after the other, as
	 * before (for an A/B of the launches saved). */
	const struct cuda_ctx *c = b->_ctx;
	if (!c->no_fuse || e->nw == 1)
		return md_cuda__errno(md_cuda__matmul_experts((int)e->type, e->w, e->n_in, e->n_out,
							      e->nb1, e->ng, e->nw, e->off, e->src,
							      e->x, e->max_rows, e->y[0],
							      e->y[1], st0(b)));
	for (int i = 0; i < e->nw; i++) {
		cudaError_t r = md_cuda__matmul_experts((int)e->type, e->w + (size_t)i * e->ng, e->n_in,
							e->n_out, e->nb1, e->ng, 1, e->off, e->src,
							e->x, e->max_rows, e->y[i], NULL, st0(b));
		if (r != cudaSuccess)
			return md_cuda__errno(r);
	}
	return 0;
}

static int fwd_rmsnorm(struct md_backend *b, float *y, const float *x, const float *w, int rows,
		       int n, int stride, float eps)
{
	return md_cuda__errno(md_cuda__rmsnorm(y, x, w, rows, n, stride, eps, st0(b)));
}

static int fwd_add(struct md_backend *b, float *y, const float *x, size_t n)
{
	return md_cuda__errno(md_cuda__add(y, x, n, st0(b)));
}

static int fwd_add_rows(struct md_backend *b, float *y, const float *bias, const int32_t *idx,
			int rows, int n)
{
	return md_cuda__errno(md_cuda__add_rows(y, bias, idx, rows, n, st0(b)));
}

static int fwd_rope(struct md_backend *b, float *x, int n_tok, int n_head, int head_dim,
		    int n_rot, bool neox, const float *cs)
{
	if (n_rot % 2 || n_rot > head_dim)
		return -EINVAL;
	return md_cuda__errno(md_cuda__rope(x, n_tok, n_head, head_dim, n_rot, neox, cs, st0(b)));
}

static int fwd_qkv_rows(struct md_backend *b, const struct md_dev_qkv *a)
{
	if (a->n_rot % 2 || a->n_rot > a->head_dim || a->head_dim < 1 || a->n < 0 ||
	    (a->norm != MD_QK_NORM_NONE && a->norm != MD_QK_NORM_HEAD && a->norm != MD_QK_NORM_FULL))
		return -EINVAL;
	return md_cuda__errno(md_cuda__qkv_rows(a->q, a->k, a->v, a->kc, a->vc, a->wrow, a->q_norm,
						a->k_norm, a->norm, a->eps, a->n, a->n_head,
						a->n_head_kv, a->head_dim, a->n_rot, a->neox,
						a->cs, st0(b)));
}

static int fwd_rows_store(struct md_backend *b, float *dst, const int32_t *rows, const float *src,
			  int n, int dim)
{
	return md_cuda__errno(md_cuda__rows(dst, src, rows, n, dim, 0, st0(b)));
}

static int fwd_rows_gather(struct md_backend *b, float *dst, const float *src, const int32_t *rows,
			   int n, int dim)
{
	return md_cuda__errno(md_cuda__rows(dst, src, rows, n, dim, 1, st0(b)));
}

static int fwd_attention(struct md_backend *b, const struct md_dev_attn *a)
{
	return md_cuda__errno(md_cuda__attention(a->out, a->q, a->k, a->v, a->pos, a->tab, a->blocks,
						 a->sinks, a->n_tok, a->n_head, a->n_head_kv,
						 a->head_dim, a->swa, a->scale, st0(b)));
}

static int fwd_attention_mla(struct md_backend *b, const struct md_dev_mla_attn *a)
{
	return md_cuda__errno(md_cuda__attention_mla(a->out, a->q, a->rows, a->half, a->pos, a->tab,
						     a->blocks, a->n_tok, a->n_head, a->w, a->c,
						     a->scale, st0(b)));
}

static int fwd_copy2d(struct md_backend *b, float *dst, size_t ds0, size_t ds1, const float *src,
		      size_t ss0, size_t ss1, int n0, int n1, int w)
{
	return md_cuda__errno(md_cuda__copy2d(dst, ds0, ds1, src, ss0, ss1, n0, n1, w, st0(b)));
}

static int fwd_rows_store_f16(struct md_backend *b, uint16_t *dst, const int32_t *rows,
			      const float *src, int n, int dim)
{
	return md_cuda__errno(md_cuda__rows_store_f16(dst, rows, src, n, dim, st0(b)));
}

static int fwd_glu(struct md_backend *b, float *g, const float *u, size_t n, enum md_ffn_act act)
{
	return md_cuda__errno(md_cuda__glu(g, u, n, act == MD_ACT_SWIGLU_OAI, st0(b)));
}

static int fwd_combine(struct md_backend *b, float *out, const float *ye, const int32_t *slot,
		       const float *w, int n_tok, int k, int n)
{
	return md_cuda__errno(md_cuda__combine(out, ye, slot, w, n_tok, k, n, 0, st0(b)));
}

static int fwd_combine_add(struct md_backend *b, float *out, const float *ye,
			   const int32_t *slot, const float *w, int n_tok, int k, int n)
{
	return md_cuda__errno(md_cuda__combine(out, ye, slot, w, n_tok, k, n, 1, st0(b)));
}

static int fwd_gate_add(struct md_backend *b, float *y, const float *x, const float *gate,
			int n_tok, int n)
{
	return md_cuda__errno(md_cuda__gate_add(y, x, gate, n_tok, n, st0(b)));
}

static int fwd_copy(struct md_backend *b, void *dst, const void *src, size_t size)
{
	if (size == 0)
		return 0;
	return md_cuda__errno(cudaMemcpyAsync(dst, src, size, cudaMemcpyDeviceToDevice, st0(b)));
}

static int fwd_sync(struct md_backend *b)
{
	return md_cuda__errno(cudaStreamSynchronize(st0(b)));
}

static int fwd_route(struct md_backend *b, const struct md_dev_route *r)
{
	const struct md_route_params *p = &r->p;
	int fn = p->fn == MD_ROUTE_SOFTMAX_TOPK ? 0 : p->fn == MD_ROUTE_SOFTMAX_WEIGHT ? 1
	       : p->fn == MD_ROUTE_SCORED_TOPK ? 2 : -1;

	if (fn < 0)
		return -EINVAL;
	return md_cuda__errno(md_cuda__route(r->logits, r->n, p->E, p->K, fn, p->norm_topk,
					     p->gating == MD_GATING_SIGMOID, p->w_scale, p->n_groups,
					     p->n_group_used, r->bias, r->ids, r->w, st0(b)));
}

static int fwd_moe_layout(struct md_backend *b, const struct md_dev_layout *l)
{
	return md_cuda__errno(md_cuda__moe_layout(l->ids, l->w, l->n, l->K, l->E, l->G, l->base,
						  l->nb2, l->off, l->tok, l->eid, l->cslot, l->cw,
						  l->wtab, st0(b)));
}

/* Graphs: stream 0 captured in thread-local mode (other threads, the expert store's copies
 * say, may go on using CUDA meanwhile), instantiated once, launched on stream 0. */
static int fwd_capture_begin(struct md_backend *b)
{
	return md_cuda__errno(cudaStreamBeginCapture(st0(b), cudaStreamCaptureModeThreadLocal));
}

static int fwd_capture_end(struct md_backend *b, void **graph)
{
	cudaGraph_t g = NULL;
	cudaGraphExec_t x = NULL;
	cudaError_t e = cudaStreamEndCapture(st0(b), &g);

	*graph = NULL;
	if (e == cudaSuccess)
		e = cudaGraphInstantiate(&x, g, 0);
	if (g != NULL)
		cudaGraphDestroy(g);
	if (e != cudaSuccess) {
		cudaGetLastError(); /* a failed capture is not sticky */
		return md_cuda__errno(e);
	}
	*graph = x;
	return 0;
}

static int fwd_graph_launch(struct md_backend *b, void *graph)
{
	return md_cuda__errno(cudaGraphLaunch((cudaGraphExec_t)graph, st0(b)));
}

static void fwd_graph_free(struct md_backend *b, void *graph)
{
	(void)b;
	if (graph != NULL)
		cudaGraphExecDestroy((cudaGraphExec_t)graph);
}

const struct md_backend_fwd md_cuda__fwd_ops = {
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
	.capture_begin = fwd_capture_begin,
	.capture_end = fwd_capture_end,
	.graph_launch = fwd_graph_launch,
	.graph_free = fwd_graph_free,
};
