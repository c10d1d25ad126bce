/* The device forward pass's private interface between its files: forward_dev.c (the context,
 * the step tables, attention, the pass and its graphs) and forward_dev_ffn.c (the FFN
 * sub-layer: dense, and the MoE layer routed on the host or on the device). Nothing outside
 * engine/forward_dev*.c includes this; the public surface is engine/forward_dev.h. */
#ifndef MD_FORWARD_DEV_INT_H
#define MD_FORWARD_DEV_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/backend.h"
#include "engine/expert_src.h"
#include "engine/forward_dev.h"
#include "engine/rope.h"
#include "engine/router.h"

/* Batches of up to this many tokens route on the device when they can (fast_route) and run as
 * graphs: the decode and verification steps of up to 64 streams, whose step time a GPU's
 * throughput depends on. Larger batches (prompt chunks) route on the host, whose
 * synchronisation they amortise. */
#define FAST_MAX_TOK 64

/* The resident experts: a source over the device copies of the model's expert tensors. */
struct dev_src {
	struct md_expert_src base;
	struct md_fwd_dev *d;
};

struct md_fwd_dev {
	const struct md_model *m;
	struct md_backend *b;
	const struct md_backend_fwd *op;
	struct md_kv_cache *kv;
	int T;
	bool experts_resident;
	void **wdev;           /* (n_tensors) device copy of m->tensors[i], NULL: none */
	uint64_t w_bytes, kv_bytes, act_bytes;
	void *kc;              /* the KV mirror: K rows (n_layer, n_blocks * BLOCK, kv_dim) of
				* kv->k_bytes each (floats, or latent attention's halves) */
	float *vc;             /* V rows (n_layer, n_blocks * BLOCK, v_dim), NULL when v_dim 0 */
	size_t k_layer, v_layer; /* elements per layer */
	/* latent attention (deepseek2) */
	float *qa, *kva, *qn, *qabs, *qcat, *olat, *ov, *matt; /* attention_mla's buffers */
	const void **mla_tab;  /* device: (n_layer, 2 H) each layer's wk_b heads, then wv_b's */
	/* device activations */
	float *x, *xn, *q, *k, *v, *att, *tmp, *ge, *ue, *ye, *rl, *gsh;
	float *dlogits;
	size_t dlogits_rows;
	void *dtab;            /* per-step tables */
	size_t dtab_cap;
	void *drun;            /* per-run and per-layer tables */
	size_t drun_cap;
	/* host */
	void *pin;             /* staging of what goes up (tables, embeddings): pinned host memory,
				* handed out from pin_off on; reset once stream 0 has drained */
	size_t pin_cap, pin_off;
	struct md_router router, pre_router;
	int32_t *seq_tab;      /* (max_seqs) per pass: offset of the sequence's block table */
	int32_t *seq_last;     /* (max_seqs) per pass: its last position in the batch */
	struct md_expert_w *ex_got; /* (E) in get order */
	int32_t *ex_order, *ex_ntok; /* (E) get order (indices into the routing's active list),
				      * tokens of each active expert */
	uint8_t *ex_st;        /* (E) EX_* per get-order entry */
	uint8_t *allow;        /* (E) */
	struct md_expert_w *lay_w; /* (E) the layout (see the MoE section) */
	int32_t *lay_off;      /* (E + 1) */
	int lay_n;             /* entries in the layout */
	int32_t *ex_pos;       /* (T * k) routing slot -> layout slot, -1: failed expert */
	int32_t *lay_tok;      /* (T * k) token of each layout slot */
	int32_t *lay_eid;      /* (T * k) expert of each layout slot */
	int32_t *cmb_n;        /* (T) combine's per-token slot count */
	int n_x;               /* tokens of the current pass */
	struct md_backend *host; /* owned: the host executor (a simulated backend) */
	float *xn_h;           /* (T, N) the normed input, downloaded for host experts */
	float *ge_h, *ue_h, *ye_h; /* (T * k, F), (T * k, F), (T * k, N) */
	struct md_rope rope[2];
	struct dev_src res;    /* the resident source */
	bool xn_h_valid;       /* xn_h holds this layer's normed input */
	const struct md_routing *r_last; /* the host-routed layer's routing (its experts held) */
	/* routing on the device (moe_fast) */
	bool fast_ok;          /* resident experts, device ops for it, a plain routing function */
	void *lay;             /* device: one layer's layout tables (FAST_MAX_TOK tokens) */
	int32_t *rec_ids;      /* device: (n_layer, n, k) each layer's routing this pass */
	float *rec_w;
	int32_t *rec_ids_h;    /* host copies for the observers */
	float *rec_w_h;
	uint8_t *fast_layer;   /* (n_layer) routed on the device this pass */
	uint64_t n_fast, n_host; /* MoE layer passes routed on the device / on the host */
	/* graphs (backend_fwd.h capture): one per batch size up to FAST_MAX_TOK, captured the
	 * first time that size runs, again after a buffer it reads moved (gen) */
	void *graph[FAST_MAX_TOK + 1];
	uint64_t graph_gen[FAST_MAX_TOK + 1];
	uint64_t gen;          /* bumped when dtab or dlogits is reallocated */
	bool no_graphs;        /* a capture failed (or MOED_NO_GRAPHS): run op by op */
	bool no_fuse;          /* MOED_NO_FUSE: the unfused ops (mm then add ...), for A/B */
	uint64_t n_graph_launches, n_captures;
};

enum { EX_RUN, EX_FAILED };

/* Per-step tables on the device (int32 and float elements of one buffer). */
struct step_tab {
	const int32_t *pos, *wrow, *tab, *out_rows, *blocks;
	const int32_t *hoff;   /* (n_head + 1) h * n: latent attention's per-head groups */
	const float *cs[2];
	int n_out, max_pos;
};

/* The device copy of t (NULL for a tensor not uploaded or t NULL). */
static inline void *dptr(const struct md_fwd_dev *d, const struct md_tensor *t)
{
	return t ? d->wdev[t - d->m->tensors] : NULL;
}

/* Device view of a 2-D tensor, or of expert e's matrix of a 3-D one. */
static inline struct md_mat dmat(const struct md_fwd_dev *d, const struct md_tensor *t, int64_t e)
{
	struct md_mat w = md_mat_of(t, e);
	w.data = (const char *)dptr(d, t) + (size_t)e * t->nb2;
	return w;
}

/* Whether the pass uses a fused op of the backend (fn: mm_multi, mm_add, qkv_rows or
 * combine_add; backend_fwd.h): where the backend has it and MOED_NO_FUSE is unset. The results are those of the unfused sequence
 * (bit for bit on the simulated device). */
#define md_fwd_dev__fuse(d, fn) (!(d)->no_fuse && (d)->op->fn != NULL)

/* Products of two or three weights (c NULL: two) with the same input: mm_multi's one launch,
 * or mm of each. */
static inline int md_fwd_dev__mm3(struct md_fwd_dev *d, const struct md_mat *a,
				  const struct md_mat *b, const struct md_mat *c, const float *x,
				  int n, float *ya, float *yb, float *yc)
{
	if (md_fwd_dev__fuse(d, mm_multi)) {
		const struct md_mat *w[3] = { a, b, c };
		float *const y[3] = { ya, yb, yc };
		return d->op->mm_multi(d->b, c ? 3 : 2, w, x, n, y);
	}
	int rc = d->op->mm(d->b, a, x, n, ya);
	if (!rc)
		rc = d->op->mm(d->b, b, x, n, yb);
	if (!rc && c)
		rc = d->op->mm(d->b, c, x, n, yc);
	return rc;
}

/* Staging, copies and device buffers (forward_dev.c). */
void *md_fwd_dev__stage(struct md_fwd_dev *d, size_t n);
int md_fwd_dev__download(struct md_fwd_dev *d, void *dst, const void *src, size_t n);
int md_fwd_dev__upload(struct md_fwd_dev *d, void *dst, const void *staged, size_t n);
int md_fwd_dev__dgrow(struct md_fwd_dev *d, void **buf, size_t *cap, size_t n);

/* The FFN sub-layer of layer il on the residual stream x (forward_dev_ffn.c): RMSNorm, the
 * dense SwiGLU or the MoE layer, the residual add, pre-gating where asked. */
int md_fwd_dev__ffn(struct md_fwd_dev *d, const struct md_fwd_dev_pass *p,
		    struct md_expert_src *src, int n, uint32_t il, int32_t *tok_err);
/* Whether layer il (L) routes on the device in this pass (no host round trip). */
bool md_fwd_dev__fast_route(const struct md_fwd_dev *d, const struct md_fwd_dev_pass *p, int n,
			    const struct md_layer *L);
/* After the pass: the route observer for the layers routed on the device. */
int md_fwd_dev__observe_fast(struct md_fwd_dev *d, const struct md_fwd_dev_pass *p, int n);

#endif
