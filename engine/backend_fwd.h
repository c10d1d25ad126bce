/* Device-resident compute: the ops a backend offers so that a whole forward pass runs on the
 * device (engine/forward_dev.h), activations and KV cache included.
 *
 * DESIGN
 * engine/backend.h's ops table moves bytes and runs one matmul with host activations. A
 * forward pass on the device keeps its activations in device memory from the embeddings to
 * the logits; these ops are its vocabulary. Every pointer below is device memory of the same
 * backend unless it says host; a device pointer plus a byte offset is one. Every op is
 * enqueued on stream 0 (MD_BACKEND_STREAM_COMPUTE) and returns without waiting: ops run in the
 * order they were enqueued, after every upload and download made on stream 0 before them, and
 * the host sees their results through download (which waits for stream 0) or sync. Returns
 * are 0 or a negative errno-style code as in backend.h: -EINVAL for an argument the op does
 * not take (a weight type it cannot read, a head_dim it has no kernel for), -EIO for a device
 * failure (sticky: the backend is then unusable).
 *
 * The ops are coarse enough that a decode step is a few dozen launches per layer and fine
 * enough that each has a one-loop reference in the simulated backend (engine/backend_sim.c,
 * whose device memory is host memory, so it reads every table where the op says device),
 * which computes them on the host with the same kernels and in the same order as the CPU
 * forward pass (engine/forward.c): that is what lets CI check the device forward pass's
 * orchestration (weights, KV mirror, block tables, expert layouts) against the CPU pass, and a
 * GPU run check each CUDA kernel against the simulated op (tests/gpu/).
 *
 * Routing: with resident experts, route and moe_layout do it on the device (every routing
 * function: softmax top-k, gpt-oss's softmax over the top-k, DeepSeek's and GLM's scored
 * top-k with selection bias and expert groups), so a decode step runs from the embeddings to
 * the logits without waiting for the host; otherwise (experts got from a source, draft
 * restrictions) the forward pass downloads each MoE layer's router logits, routes on the host
 * (engine/router.c) and uploads the expert layout: one synchronisation per MoE layer.
 */
#ifndef MD_BACKEND_FWD_H
#define MD_BACKEND_FWD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/kern/matmul.h"
#include "engine/model.h"
#include "engine/quant.h"
#include "engine/router.h"

struct md_backend;

/* Expert-grouped products of one MoE layer in one launch (md_matmul_experts' contract, with
 * weights found through a device table of pointers). Group g < ng owns output slots off[g] ..
 * off[g+1]-1; slot s reads input row src[s] of x (row s when src is NULL) and gets
 * y[i][s * n_out + r] = dot(row r of weight w[i * ng + g], that row). Every weight has type,
 * n_in, n_out and nb1 as given (rows nb1 bytes apart, the alignment backend.h's matmul asks). */
struct md_dev_experts {
	enum md_dtype type;
	int64_t n_in, n_out;
	size_t nb1;
	int nw;               /* weights per group: 1 or 2 */
	int ng;               /* groups, >= 1 */
	const void *const *w; /* device: (nw * ng) device pointers to the weights */
	const int32_t *off;   /* device: (ng + 1) slot offsets, off[0] = 0 */
	const int32_t *src;   /* device: (n_slots) input row of each slot, or NULL */
	const float *x;       /* device: input rows of n_in floats */
	int n_x;              /* rows of x */
	float *y[2];          /* device: (n_slots, n_out) per weight */
	int n_slots;          /* off[ng] */
	int max_rows;         /* the largest off[g + 1] - off[g] */
};

/* Causal attention of n_tok query tokens over a paged cache of one layer: token t at position
 * pos[t], head h (of n_head; KV head h / (n_head / n_head_kv)) attends to positions p0 .. pos[t]
 * (p0 = pos[t] - swa + 1 when swa > 0 and that is > 0, else 0), position p's rows in cache row
 * blocks[tab[t] + p / MD_KV_BLOCK_TOKENS] * MD_KV_BLOCK_TOKENS + p % MD_KV_BLOCK_TOKENS (rows of
 * n_head_kv * head_dim floats at k and v); softmax of scale * q.k, with sinks[h] joining the
 * denominator when sinks is not NULL; out = the weighted sum of the value rows. */
struct md_dev_attn {
	float *out;            /* (n_tok, n_head * head_dim) */
	const float *q;        /* (n_tok, n_head * head_dim) */
	const float *k, *v;    /* the layer's cache rows */
	const int32_t *pos;    /* (n_tok) */
	const int32_t *tab;    /* (n_tok) */
	const int32_t *blocks;
	const float *sinks;    /* (n_head) or NULL */
	int n_tok, n_head, n_head_kv, head_dim;
	int swa;
	float scale;
	int max_pos;           /* the largest pos[t] (bounds scratch) */
};

/* Latent attention (engine/attn_mla.h) over a paged cache of one layer whose rows (one per
 * position, found as md_dev_attn finds them) are w = C + R elements, IEEE halves (half) or
 * floats: for token t and head h, the scores scale * q[t][h] . row (q (n_tok, n_head, w)), their
 * softmax, and out[h][t] = the weighted sum of the rows' first c elements (out head-major,
 * (n_head, n_tok, c)). */
struct md_dev_mla_attn {
	float *out;
	const float *q;
	const void *rows;
	bool half;
	const int32_t *pos, *tab, *blocks;
	int n_tok, n_head, w, c;
	float scale;
	int max_pos;
};

/* The rows a step's attention reads, made in one launch where they took six: for each token
 * t < n, the rows of Q (n_head * head_dim floats) and K (n_head_kv * head_dim) normed with
 * q_norm / k_norm (norm MD_QK_NORM_FULL: the whole row; MD_QK_NORM_HEAD: each head's head_dim
 * floats; MD_QK_NORM_NONE: not at all, the weights unused), then rotated (n_rot > 0: as rope,
 * by token t's table cs + t * n_rot), in place; then K's and V's rows stored into cache rows
 * wrow[t] of kc and vc. The results of rmsnorm, rope and rows_store in that order. */
struct md_dev_qkv {
	float *q, *k;
	const float *v;
	float *kc, *vc;
	const int32_t *wrow;
	const float *q_norm, *k_norm;
	int norm; /* enum md_qk_norm */
	float eps;
	int n, n_head, n_head_kv, head_dim, n_rot;
	bool neox;
	const float *cs;
};

/* The most weights mm_multi takes. */
#define MD_DEV_MM_MULTI 3

/* The most experts route and moe_layout take; the forward pass routes larger models on the
 * host. */
#define MD_DEV_ROUTE_EMAX 1024

/* Routing on the device: ids and w (n, K) of each row of router logits (n, E), as
 * md_route_select computes them on the host for every routing function (softmax top-k,
 * softmax over the top-k, scored top-k with a selection bias and expert groups; ties to the
 * lower id). bias: the selection bias (E floats, device) or NULL. */
struct md_dev_route {
	const float *logits;
	int n;
	struct md_route_params p;
	const float *bias;
	int32_t *ids;
	float *w;
};

/* The expert layout of a routing, on the device: what mm_experts and combine read, as
 * engine/router.c groups a routing. Slots are expert-major (experts ascending, each one's
 * tokens ascending); group g < G (G = min(E, n * K), the most experts n tokens can use) is the
 * g-th active expert, and groups past the active ones are empty, at the end (off[g] =
 * off[g + 1] = n * K). Out: off (G + 1); per slot its token (tok) and expert (eid); wtab (3 G):
 * each group's gate, then up, then down weights, expert e's at base[i] + e * nb2[i] (an empty
 * group points at expert 0's); the combine table cslot, cw (n, K): token t's slots in
 * ascending order with their weights. */
struct md_dev_layout {
	const int32_t *ids;
	const float *w;
	int n, K, E, G;
	const void *base[3];
	size_t nb2[3];
	int32_t *off, *tok, *eid, *cslot;
	float *cw;
	const void **wtab;
};

/* The forward pass's ops. All enqueued on stream 0; see the DESIGN note above. */
struct md_backend_fwd {
	/* y (n_tok, w->n_out) = w x for x (n_tok, w->n_in), as backend.h's matmul but with x and
	 * y in device memory and without waiting. */
	int (*mm)(struct md_backend *b, const struct md_mat *w, const float *x, int n_tok, float *y);
	/* The grouped expert products above. */
	int (*mm_experts)(struct md_backend *b, const struct md_dev_experts *e);
	/* y[i] (n_tok, w[i]->n_out) = w[i] x for n (1 .. MD_DEV_MM_MULTI) weights with the same
	 * input (Q, K and V; an FFN's gate and up): what mm of each gives, in one launch where
	 * the weights share type, n_in and nb1; NULL where the backend has no such op. */
	int (*mm_multi)(struct md_backend *b, int n, const struct md_mat *const *w, const float *x,
			int n_tok, float *const *y);
	/* y += w x: mm and add in one (a residual after a projection); NULL where the backend
	 * has no such op (the pass then runs mm and add). */
	int (*mm_add)(struct md_backend *b, const struct md_mat *w, const float *x, int n_tok,
		      float *y);
	/* y[r] = rmsnorm(x[r]) * w for rows of n floats, stride floats apart in x and y (y may
	 * be x; the floats between rows are left alone). */
	int (*rmsnorm)(struct md_backend *b, float *y, const float *x, const float *w, int rows,
		       int n, int stride, float eps);
	/* y[i] += x[i] for i < n. */
	int (*add)(struct md_backend *b, float *y, const float *x, size_t n);
	/* y[r][i] += bias[idx[r] * n + i] for r < rows, i < n; idx NULL: bias[i] (one row). */
	int (*add_rows)(struct md_backend *b, float *y, const float *bias, const int32_t *idx,
			int rows, int n);
	/* Rotate the first n_rot dims of each of n_head heads of head_dim floats in each of n_tok
	 * rows of x by token t's table cs + t * n_rot (cos, sin pairs: engine/rope.h's
	 * md_rope_table), pairs (2i, 2i+1), or (i, i + n_rot/2) when neox. */
	int (*rope)(struct md_backend *b, float *x, int n_tok, int n_head, int head_dim, int n_rot,
		    bool neox, const float *cs);
	/* md_dev_qkv above; NULL where the backend has no such op (the pass then runs rmsnorm,
	 * rope and rows_store: md_dev_qkv_rows_ops). */
	int (*qkv_rows)(struct md_backend *b, const struct md_dev_qkv *a);
	/* dst row rows[i] = src row i, rows of dim floats, i < n. */
	int (*rows_store)(struct md_backend *b, float *dst, const int32_t *rows, const float *src,
			  int n, int dim);
	/* dst row i = src row rows[i], i < n. */
	int (*rows_gather)(struct md_backend *b, float *dst, const float *src, const int32_t *rows,
			   int n, int dim);
	int (*attention)(struct md_backend *b, const struct md_dev_attn *a);
	int (*attention_mla)(struct md_backend *b, const struct md_dev_mla_attn *a);
	/* dst[i ds0 + j ds1 + e] = src[i ss0 + j ss1 + e] for i < n0, j < n1, e < w (floats, the
	 * strides in floats; dst and src do not overlap): heads between token-major and
	 * head-major layouts. */
	int (*copy2d)(struct md_backend *b, float *dst, size_t ds0, size_t ds1, const float *src,
		      size_t ss0, size_t ss1, int n0, int n1, int w);
	/* dst row rows[i] = src row i rounded to IEEE half (to nearest even, as md_f32_to_f16),
	 * rows of dim elements. */
	int (*rows_store_f16)(struct md_backend *b, uint16_t *dst, const int32_t *rows,
			      const float *src, int n, int dim);
	/* g[i] = act(g[i], u[i]) for i < n (engine/forward.c glu: silu(g) u, or gpt-oss's). */
	int (*glu)(struct md_backend *b, float *g, const float *u, size_t n, enum md_ffn_act act);
	/* out[t] = sum over j < k, in order, of w[t * k + j] * ye[slot[t * k + j]] (rows of n
	 * floats), slot < 0 adding nothing; out[t] is all zeros when every slot is < 0. */
	int (*combine)(struct md_backend *b, float *out, const float *ye, const int32_t *slot,
		       const float *w, int n_tok, int k, int n);
	/* out[t] += that sum (an MoE layer's output and the residual add in one launch); NULL
	 * where the backend has no such op. */
	int (*combine_add)(struct md_backend *b, float *out, const float *ye, const int32_t *slot,
			   const float *w, int n_tok, int k, int n);
	/* y[t] += sigmoid(gate[t]) * x[t] (rows of n floats); gate NULL: y[t] += x[t]. */
	int (*gate_add)(struct md_backend *b, float *y, const float *x, const float *gate,
			int n_tok, int n);
	/* size bytes device to device (may not overlap). */
	int (*copy)(struct md_backend *b, void *dst, const void *src, size_t size);
	/* Wait until everything enqueued on stream 0 is done. */
	int (*sync)(struct md_backend *b);
	/* Routing and its layout on the device (see above); NULL where a backend has none, and
	 * the forward pass routes on the host. */
	int (*route)(struct md_backend *b, const struct md_dev_route *r);
	int (*moe_layout)(struct md_backend *b, const struct md_dev_layout *l);
	/* Graphs (CUDA Graphs): between capture_begin and capture_end the ops above are recorded,
	 * not run, into a graph that graph_launch enqueues on stream 0 as one unit, as often as
	 * wanted, with the arguments captured (pointers and sizes: whatever changes between
	 * launches must be in device memory the graph reads). Nothing may wait for stream 0
	 * during a capture (no download, no sync). NULL where a backend has no graphs. */
	int (*capture_begin)(struct md_backend *b);
	int (*capture_end)(struct md_backend *b, void **graph);
	int (*graph_launch)(struct md_backend *b, void *graph);
	void (*graph_free)(struct md_backend *b, void *graph);
};

/* md_dev_qkv's work as the ops it fuses, each on its own through op (rmsnorm, rope, rows_store
 * in that order): the simulated device's qkv_rows, and the pass's for a backend without one. */
int md_dev_qkv_rows_ops(const struct md_backend_fwd *op, struct md_backend *b,
			const struct md_dev_qkv *a);

#endif
