/* The batched forward pass: a micro-batch of tokens from many sequences at their positions.
 *
 * Pipeline (DESIGN §4) for a batch of n tokens:
 *   Batch: the tokens are checked against the vocabulary and the batch against the KV cache
 *   (md_kv_batch_begin: live sequences, contiguous reserved positions; shared blocks about
 *   to be written are copied), then embedded into x.
 *   Per layer:
 *     Attention: RMSNorm -> Q/K/V projections for all tokens -> QK-norm and RoPE -> K/V rows
 *     written where the cache says (md_kv_write_rows) -> causal attention per (token, head)
 *     over the sequence's rows -> output projection -> residual add.
 *     FFN: RMSNorm, then one SwiGLU for a dense model, or the MoE layer:
 *       1. route: router logits (one matmul), then per-token top-k experts and weights by
 *          the model's routing function (engine/router.c); the route observer sees them;
 *       2. group the routings expert-major (router.c), so each active expert's weights are
 *          read once for all the tokens routed to it;
 *       3. get the active experts' weights from the expert source (plan, then get each; the
 *          default source is the model's tensors, engine/expert_src.c) and run them: one grouped
 *          pass over the pool for gate/up, silu * up, one for down (per expert instead where
 *          the kernels can't take the weights); release them. The source orders the gets and
 *          may say that the first ones are resident: those run first, as one wave, while it
 *          fetches the others, which run as a second wave. Each wave's experts are laid out
 *          in get order (ex_off, ex_tok), and ex_pos maps the routing's slots to that layout;
 *          with one wave in ascending order it is the routing's own layout. Experts the
 *          source returns in device memory (md_expert_w.dev) run one by one through that
 *          backend's matmul.
 *          In a batch with tok_err, an expert whose get fails (a read error) is skipped:
 *          its tokens are marked and get zero from it, the others are exact (expert_failed);
 *       4. scatter-add the weighted outputs back in slot order, plus the shared expert with
 *          its sigmoid gate where the architecture has one; residual add;
 *       5. a source that prefetches is told the experts layer l+1's router picks on the
 *          residual leaving this layer (pre-gating, prefetch_next).
 *   gpt-oss adds (all from the model's tensors and hyper-parameters, nothing per arch here):
 *   YaRN-scaled rope (engine/rope.c; sliding layers with their own base), a bias on the
 *   output projection, a per-head sink logit in the softmax, a sliding window on alternate
 *   layers (positions outside it are skipped, not masked: the KV cache still holds them), a
 *   router bias, per-expert biases on gate, up and down, and its clamped SwiGLU (md_glu, engine/ffn_act.h).
 *   deepseek2 attends through its latent (engine/attn_mla.c, over a cache of one compressed
 *   row per token and layer) instead of the Q/K/V path; it and glm4moe route by scored top-k
 *   with a selection bias and expert groups (router.c), run leading layers dense, and add
 *   their shared experts ungated. Every arch's rope, YaRN included, is engine/rope.c's.
 *   Commit: each sequence's new length (md_kv_commit) once every layer ran; then the final
 *   RMSNorm and logits for the rows the caller asks for only.
 *
 * Shapes below: T = max_tokens, N = n_embd, H / K = query / KV heads, D = head_dim,
 * E = n_expert, k = n_expert_used, Fmax = the widest FFN. */
#include "engine/forward.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/assert.h"
#include "engine/attn_mla.h"
#include "engine/ffn_act.h"
#include "engine/forward_dev.h"
#include "engine/kern/cpu.h"
#include "engine/kern/matmul.h"
#include "engine/kern/threadpool.h"
#include "engine/rope.h"

struct md_forward_ctx {
	const struct md_model *m; /* borrowed: outlives the context */
	struct md_pool *pool;     /* owned, or borrowed when pool_shared (md_forward_share_pool) */
	bool pool_shared;
	int max_tokens;
	float *x;     /* (T, N) residual stream */
	float *xn;    /* (T, N) normed input of the current sub-layer */
	float *q;     /* (T, H*D) */
	float *k;     /* (T, K*D) */
	float *v;     /* (T, K*D) */
	float *att;   /* (T, H*D) attention output before Wo */
	float *tmp;   /* (T, N) sub-layer output */
	struct md_router router; /* owned (MoE only): logits (T, E), routing of the current layer */
	struct md_router pre_router; /* owned (MoE only): the next layer's predicted routing */
	float *pre_x; /* (T, N) the residual stream normed with the next layer's FFN norm */
	float *xe;    /* (T, N) gathered inputs of one expert */
	float *ge;    /* (T * k, Fmax) gate activations, one row per routing slot */
	float *ue;    /* (T * k, Fmax) up activations */
	float *ye;    /* (T * k, N) expert outputs, one row per routing slot */
	float *mm_scratch; /* per-thread dequantized rows */
	void *ex_scratch;  /* quantized expert inputs (md_matmul_experts) */
	struct md_expert_w *ex_got; /* (E) the current layer's active experts in get order; views
				     * borrowed from src between its get and release */
	struct md_mat *ex_w; /* (3 * E) gate, up of the active experts, then their down */
	int32_t *ex_order;   /* (E) get order: indices into the routing's active list */
	int32_t *ex_off;     /* (E + 1) slot offsets of the active experts, in get order */
	int32_t *ex_tok;     /* (T * k) token of each slot of that layout */
	int32_t *ex_pos;     /* (T * k) routing slot -> slot of that layout */
	uint8_t *ex_st;      /* (E) per get-order entry: EX_RUN, EX_FAILED (its get failed, tok_err
			      * batches only) or EX_DONE (a device expert run as it arrived) */
	int32_t *ex_ntok;    /* (E) tokens routed to each active expert, in the routing's order */
	int32_t *tok_err;    /* borrowed: the current batch's md_batch.tok_err, or NULL */
	struct md_expert_src_map map_src; /* the default expert source */
	struct md_expert_src *src;        /* borrowed: &map_src or the caller's (set_expert_src) */
	const struct md_forward_draft *draft; /* borrowed, NULL: exact passes */
	uint8_t *allow;      /* (E) experts a draft pass may route to */
	md_forward_route_cb route_cb;     /* NULL: no observer */
	void *route_ud;                   /* borrowed: passed to route_cb */
	md_forward_route_cb pregate_cb;   /* NULL: no observer of pre-gating */
	void *pregate_ud;                 /* borrowed: passed to pregate_cb */
	float *att_scratch; /* per-thread attention scores (att_cap each) */
	size_t att_cap;
	float *rope_cs; /* (n_rot) cos, sin pairs of the current token's position (md_rope_table) */
	struct md_rope rope[2]; /* full-attention layers' rope, sliding-window layers' */
	int32_t *ex_id;      /* (E) expert id of each group of the get-order layout */
	const struct md_layer *ex_L; /* borrowed: the layer whose experts run (their biases) */
	struct md_mla *mla; /* owned: latent attention's scratch (deepseek2), else NULL */
	struct md_fwd_dev *dev; /* borrowed: run batches on this device, NULL: on the CPU */
};

static void *xalloc(size_t n, int *fail)
{
	void *p = malloc(n ? n : 1);
	if (!p)
		*fail = 1;
	return p;
}

void md_forward_share_pool(struct md_forward_ctx *f, struct md_forward_ctx *owner)
{
	MD_ASSERT(md_pool_size(f->pool) == md_pool_size(owner->pool));
	if (!f->pool_shared)
		md_pool_free(f->pool);
	f->pool = owner->pool;
	f->pool_shared = true;
}

const struct md_pool *md_forward_pool(const struct md_forward_ctx *f)
{
	return f->pool;
}

void md_forward_free(struct md_forward_ctx *f)
{
	if (!f)
		return;
	if (!f->pool_shared)
		md_pool_free(f->pool);
	free(f->x);
	free(f->xn);
	free(f->q);
	free(f->k);
	free(f->v);
	free(f->att);
	free(f->tmp);
	md_router_release(&f->router);
	md_router_release(&f->pre_router);
	free(f->pre_x);
	free(f->xe);
	free(f->ge);
	free(f->ue);
	free(f->ye);
	free(f->mm_scratch);
	free(f->ex_scratch);
	free(f->ex_got);
	free(f->ex_w);
	free(f->ex_off);
	free(f->ex_order);
	free(f->ex_tok);
	free(f->ex_pos);
	free(f->ex_st);
	free(f->ex_ntok);
	free(f->allow);
	free(f->att_scratch);
	free(f->rope_cs);
	free(f->ex_id);
	md_mla_free(f->mla);
	free(f);
}

struct md_forward_ctx *md_forward_new(const struct md_model *m, int n_threads, int max_tokens)
{
	if (max_tokens < 1)
		return NULL;
	struct md_forward_ctx *f = calloc(1, sizeof(*f));
	if (!f)
		return NULL;
	const struct md_hparams *hp = &m->hp;
	f->m = m;
	f->max_tokens = max_tokens;
	md_expert_src_map_init(&f->map_src, m);
	f->src = &f->map_src.base;
	f->pool = md_pool_new(n_threads);
	if (!f->pool) {
		free(f);
		return NULL;
	}
	size_t T = (size_t)max_tokens, N = hp->n_embd;
	size_t QD = (size_t)hp->n_head * hp->head_dim;
	size_t KD = (size_t)hp->n_head_kv * hp->head_dim;
	size_t E = hp->n_expert ? hp->n_expert : 1, K = hp->n_expert_used ? hp->n_expert_used : 1;
	size_t F = hp->n_ff_exp;
	if (hp->n_ff_shexp > F)
		F = hp->n_ff_shexp;
	if ((!hp->n_expert || hp->n_layer_dense_lead) && hp->n_ff > F)
		F = hp->n_ff; /* dense layers: all of them, or the leading ones of an MoE model */
	size_t in_max = N > QD ? N : QD;
	if (F > in_max)
		in_max = F;
	int fail = 0;
	f->x = xalloc(T * N * sizeof(float), &fail);
	f->xn = xalloc(T * N * sizeof(float), &fail);
	f->q = xalloc(T * QD * sizeof(float), &fail);
	f->k = xalloc(T * KD * sizeof(float), &fail);
	f->v = xalloc(T * KD * sizeof(float), &fail);
	f->att = xalloc(T * QD * sizeof(float), &fail);
	f->tmp = xalloc(T * N * sizeof(float), &fail);
	f->xe = xalloc(T * N * sizeof(float), &fail);
	/* Expert buffers hold one row per routing (T * K), the shared expert's one per token. */
	f->ge = xalloc(T * K * F * sizeof(float), &fail);
	f->ue = xalloc(T * K * F * sizeof(float), &fail);
	f->ye = xalloc(T * K * N * sizeof(float), &fail);
	if (hp->n_expert) {
		size_t in_ex = N > F ? N : F;
		if (md_router_init(&f->router, hp, (int)T) ||
		    md_router_init(&f->pre_router, hp, (int)T))
			fail = 1;
		f->pre_x = xalloc(T * N * sizeof(float), &fail);
		f->ex_scratch = xalloc(md_matmul_experts_scratch_bytes((int64_t)in_ex, (int)T, (int)(T * K)), &fail);
		f->ex_got = xalloc(E * sizeof(struct md_expert_w), &fail);
		f->ex_w = xalloc(3 * E * sizeof(struct md_mat), &fail);
		f->ex_off = xalloc((E + 1) * sizeof(int32_t), &fail);
		f->ex_order = xalloc(E * sizeof(int32_t), &fail);
		f->ex_tok = xalloc(T * K * sizeof(int32_t), &fail);
		f->ex_pos = xalloc(T * K * sizeof(int32_t), &fail);
		f->ex_id = xalloc(E * sizeof(int32_t), &fail);
		f->ex_st = xalloc(E, &fail);
		f->ex_ntok = xalloc(E * sizeof(int32_t), &fail);
		f->allow = xalloc(E, &fail);
	}
	f->mm_scratch = xalloc(md_matmul_scratch_floats(f->pool, (int64_t)in_max, (int)T) * sizeof(float), &fail);
	f->rope_cs = xalloc((size_t)hp->n_rot * sizeof(float), &fail);
	md_rope_init(&f->rope[0], hp, false);
	md_rope_init(&f->rope[1], hp, true);
	if (hp->kv_lora_rank && !fail && !(f->mla = md_mla_new(m, f->pool, max_tokens)))
		fail = 1;
	if (fail) {
		md_forward_free(f);
		return NULL;
	}
	return f;
}

void md_forward_set_expert_src(struct md_forward_ctx *f, struct md_expert_src *src)
{
	f->src = src ? src : &f->map_src.base;
}

void md_forward_set_draft(struct md_forward_ctx *f, const struct md_forward_draft *d)
{
	f->draft = d;
	if (f->m->hp.n_expert)
		md_router_set_draft(&f->router, 0, NULL);
}

void md_forward_set_device(struct md_forward_ctx *f, struct md_fwd_dev *dev)
{
	f->dev = dev;
}

void md_forward_set_route_cb(struct md_forward_ctx *f, md_forward_route_cb cb, void *ud)
{
	f->route_cb = cb;
	f->route_ud = ud;
}

void md_forward_set_pregate_cb(struct md_forward_ctx *f, md_forward_route_cb cb, void *ud)
{
	f->pregate_cb = cb;
	f->pregate_ud = ud;
}

enum { EX_RUN, EX_FAILED, EX_DONE };

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* y (rows, n) += the bias row b (n) in every row; b NULL: nothing. */
static void add_rows(float *y, const float *b, size_t rows, size_t n)
{
	if (!b)
		return;
	for (size_t r = 0; r < rows; r++)
		for (size_t i = 0; i < n; i++)
			y[r * n + i] += b[i];
}

/* Expert e's row of a per-expert bias (ne[0], n_expert), or NULL without one. */
static const float *bias_row(const struct md_tensor *t, int32_t e)
{
	return t ? (const float *)t->data + (size_t)e * (size_t)t->ne[0] : NULL;
}

struct att_job {
	struct md_forward_ctx *f;
	struct md_kv_cache *kv;
	const struct md_batch *b;
	uint32_t layer;
};

static void att_worker(void *ctx, int ith, int nth)
{
	struct att_job *j = ctx;
	struct md_forward_ctx *f = j->f;
	const struct md_hparams *hp = &f->m->hp;
	const int H = (int)hp->n_head, D = (int)hp->head_dim;
	const int group = (int)(hp->n_head / hp->n_head_kv);
	const float scale = hp->attn_scale;
	const struct md_kern *kn = md_kern_active(); /* NULL: portable loops */
	/* gpt-oss: a sliding-window layer sees the n_swa positions ending at the token's own
	 * (llama.cpp's LLAMA_SWA_TYPE_STANDARD masks p when pos - p >= n_swa); a sink logit per
	 * head joins the softmax's denominator, unscaled, and weighs no value row. */
	const struct md_layer *L = &f->m->layers[j->layer];
	const int swa = md_layer_is_swa(hp, j->layer) ? (int)hp->n_swa : 0;
	const float *sinks = L->attn_sinks ? L->attn_sinks->data : NULL;
	float *sc = f->att_scratch + f->att_cap * (size_t)ith;
	int total = j->b->n_tokens * H;
	int per = (total + nth - 1) / nth;
	int i0 = per * ith, i1 = i0 + per < total ? i0 + per : total;
	for (int i = i0; i < i1; i++) {
		int t = i / H, h = i % H, kvh = h / group;
		int seq = j->b->seq[t], pos = j->b->pos[t];
		const float *q = f->q + ((size_t)t * H + h) * D;
		const int p0 = swa && pos >= swa ? pos - swa + 1 : 0;
		float mx = -INFINITY;
		for (int p = p0; p <= pos; p++) {
			const float *kr = md_kv_k(j->kv, j->layer, seq, (uint32_t)p) + (size_t)kvh * D;
			float s;
			if (kn) {
				s = kn->dot_f32(q, kr, D);
			} else {
				s = 0;
				for (int d = 0; d < D; d++)
					s += q[d] * kr[d];
			}
			s *= scale;
			sc[p] = s;
			if (s > mx)
				mx = s;
		}
		if (sinks && sinks[h] > mx)
			mx = sinks[h];
		double sum = sinks ? (double)expf(sinks[h] - mx) : 0.0;
		for (int p = p0; p <= pos; p++) {
			sc[p] = expf(sc[p] - mx);
			sum += sc[p];
		}
		float inv = (float)(1.0 / sum);
		float *o = f->att + ((size_t)t * H + h) * D;
		memset(o, 0, (size_t)D * sizeof(float));
		for (int p = p0; p <= pos; p++) {
			const float *vr = md_kv_v(j->kv, j->layer, seq, (uint32_t)p) + (size_t)kvh * D;
			float w = sc[p] * inv;
			if (kn) {
				kn->axpy_f32(o, w, vr, D);
				continue;
			}
			for (int d = 0; d < D; d++)
				o[d] += w * vr[d];
		}
	}
}

static void add_bias(float *y, const struct md_tensor *bias, int n_tok, int64_t n)
{
	if (!bias)
		return;
	const float *bv = bias->data;
	for (int t = 0; t < n_tok; t++)
		for (int64_t i = 0; i < n; i++)
			y[(size_t)t * n + i] += bv[i];
}

static void attention(struct md_forward_ctx *f, struct md_kv_cache *kv, const struct md_batch *b,
		      uint32_t il)
{
	const struct md_hparams *hp = &f->m->hp;
	const struct md_layer *L = &f->m->layers[il];
	const int n = b->n_tokens;
	const int64_t N = hp->n_embd, H = hp->n_head, K = hp->n_head_kv, D = hp->head_dim;
	const float eps = hp->rms_eps;

	for (int t = 0; t < n; t++)
		md_rmsnorm(f->xn + (size_t)t * N, f->x + (size_t)t * N, L->attn_norm->data, N, eps);
	if (f->mla) { /* latent attention (engine/attn_mla.h) */
		md_mla_attention(f->mla, f->pool, kv, b, il, f->xn, f->tmp, f->att_scratch, f->att_cap);
		for (size_t i = 0; i < (size_t)n * N; i++)
			f->x[i] += f->tmp[i];
		return;
	}

	struct md_mat wq = md_mat_of(L->wq, 0), wk = md_mat_of(L->wk, 0), wv = md_mat_of(L->wv, 0);
	const struct md_mat wqkv[3] = { wq, wk, wv };
	float *const yqkv[3] = { f->q, f->k, f->v };
	md_matmul_multi(f->pool, wqkv, 3, f->xn, n, yqkv, f->mm_scratch);
	add_bias(f->q, L->bq, n, H * D);
	add_bias(f->k, L->bk, n, K * D);
	add_bias(f->v, L->bv, n, K * D);

	for (int t = 0; t < n; t++) {
		float *q = f->q + (size_t)t * H * D, *k = f->k + (size_t)t * K * D;
		if (hp->qk_norm == MD_QK_NORM_FULL) {
			md_rmsnorm(q, q, L->q_norm->data, H * D, eps);
			md_rmsnorm(k, k, L->k_norm->data, K * D, eps);
		} else if (hp->qk_norm == MD_QK_NORM_HEAD) {
			for (int64_t h = 0; h < H; h++)
				md_rmsnorm(q + h * D, q + h * D, L->q_norm->data, D, eps);
			for (int64_t h = 0; h < K; h++)
				md_rmsnorm(k + h * D, k + h * D, L->k_norm->data, D, eps);
		}
		const struct md_rope *rope = &f->rope[md_layer_is_swa(hp, il)];
		if (t == 0 || b->pos[t] != b->pos[t - 1])
			md_rope_table(rope, b->pos[t], f->rope_cs);
		for (int64_t h = 0; h < H; h++)
			md_rope_apply(rope, f->rope_cs, q + h * D);
		for (int64_t h = 0; h < K; h++)
			md_rope_apply(rope, f->rope_cs, k + h * D);
		float *kr, *vr;
		md_kv_write_rows(kv, il, b->seq[t], (uint32_t)b->pos[t], &kr, &vr);
		memcpy(kr, k, (size_t)(K * D) * sizeof(float));
		memcpy(vr, f->v + (size_t)t * K * D, (size_t)(K * D) * sizeof(float));
	}

	struct att_job aj = { f, kv, b, il };
	md_pool_run(f->pool, att_worker, &aj);

	struct md_mat wo = md_mat_of(L->wo, 0);
	md_matmul(f->pool, &wo, f->att, n, f->tmp, f->mm_scratch);
	add_bias(f->tmp, L->bo, n, N);
	for (size_t i = 0; i < (size_t)n * N; i++)
		f->x[i] += f->tmp[i];
}

/* out (n, N) = Wdown act(Wgate x + bg, Wup x + bu) + bd for x (n, N), act the model's
 * (silu(g) * u, or gpt-oss's clamped variant); bias rows NULL where there are none. */
static void swiglu_b(struct md_forward_ctx *f, const struct md_mat *gate, const struct md_mat *up,
		     const struct md_mat *down, const float *bg, const float *bu, const float *bd,
		     const float *x, int n, float *out)
{
	const enum md_ffn_act act = f->m->hp.ffn_act;
	const struct md_mat wgu[2] = { *gate, *up };
	float *const ygu[2] = { f->ge, f->ue };
	md_matmul_multi(f->pool, wgu, 2, x, n, ygu, f->mm_scratch);
	add_rows(f->ge, bg, (size_t)n, (size_t)gate->n_out);
	add_rows(f->ue, bu, (size_t)n, (size_t)gate->n_out);
	size_t m = (size_t)n * gate->n_out;
	for (size_t i = 0; i < m; i++)
		f->ge[i] = md_glu(act, f->ge[i], f->ue[i]);
	md_matmul(f->pool, down, f->ge, n, out, f->mm_scratch);
	add_rows(out, bd, (size_t)n, (size_t)down->n_out);
}

static void swiglu(struct md_forward_ctx *f, const struct md_mat *gate, const struct md_mat *up,
		   const struct md_mat *down, const float *x, int n, float *out)
{
	swiglu_b(f, gate, up, down, NULL, NULL, NULL, x, n, out);
}

struct glu_job {
	float *g;        /* (rows, F) gate in, act(gate, up) out */
	const float *u;  /* (rows, F) */
	size_t rows, F;
	enum md_ffn_act act;
};

static void glu_worker(void *ctx, int ith, int nth)
{
	struct glu_job *j = ctx;
	size_t per = (j->rows + (size_t)nth - 1) / (size_t)nth;
	size_t a = per * (size_t)ith < j->rows ? per * (size_t)ith : j->rows;
	size_t z = a + per < j->rows ? a + per : j->rows;
	for (size_t i = a * j->F; i < z * j->F; i++)
		j->g[i] = md_glu(j->act, j->g[i], j->u[i]);
}

/* Step 3 for the experts of groups g0 .. g1-1 of the get-order layout at once: one pool pass
 * for all their gate/up rows (the normed input quantized once), one for silu * up, one for
 * all down rows. Fills their slots of f->ye. Returns false (nothing done) where the kernels
 * can't take the weights, or the experts differ in type or shape; moe_each runs then. */
static bool moe_grouped(struct md_forward_ctx *f, int n, int g0, int g1)
{
	const int E = (int)f->m->hp.n_expert;
	const struct md_expert_w *x0 = &f->ex_got[g0];
	struct md_mat gu[2] = { x0->gate, x0->up };
	if (!md_matmul_experts_ok(gu, 2) || !md_matmul_experts_ok(&x0->down, 1))
		return false;
	struct md_mat *wgu = f->ex_w, *wd = f->ex_w + 2 * E;
	for (int g = g0; g < g1; g++) {
		const struct md_expert_w *x = &f->ex_got[g];
		if (x->gate.type != x0->gate.type || x->up.type != x0->up.type ||
		    x->down.type != x0->down.type || x->gate.n_in != x0->gate.n_in ||
		    x->gate.n_out != x0->gate.n_out || x->up.n_out != x0->up.n_out ||
		    x->down.n_in != x0->down.n_in || x->down.n_out != x0->down.n_out)
			return false;
		wgu[2 * (g - g0)] = x->gate;
		wgu[2 * (g - g0) + 1] = x->up;
		wd[g - g0] = x->down;
	}
	const int base = f->ex_off[g0], rows = f->ex_off[g1] - base;
	const size_t F = (size_t)x0->gate.n_out;
	float *const ygu[2] = { f->ge, f->ue };
	md_matmul_experts(f->pool, wgu, 2, g1 - g0, f->ex_off + g0, f->xn, n, f->ex_tok + base, ygu,
			  f->ex_scratch);
	const struct md_layer *L = f->ex_L;
	for (int g = g0; g < g1 && L->gate_exps_b; g++) {
		size_t a = (size_t)f->ex_off[g], m = (size_t)(f->ex_off[g + 1] - f->ex_off[g]);
		add_rows(f->ge + a * F, bias_row(L->gate_exps_b, f->ex_id[g]), m, F);
		add_rows(f->ue + a * F, bias_row(L->up_exps_b, f->ex_id[g]), m, F);
	}
	struct glu_job gj = { f->ge + (size_t)base * F, f->ue + (size_t)base * F, (size_t)rows, F,
			      f->m->hp.ffn_act };
	if (rows >= 16)
		md_pool_run(f->pool, glu_worker, &gj);
	else
		glu_worker(&gj, 0, 1);
	float *const yd[1] = { f->ye };
	md_matmul_experts(f->pool, wd, 1, g1 - g0, f->ex_off + g0, f->ge + (size_t)base * F, rows,
			  NULL, yd, f->ex_scratch);
	const size_t N = (size_t)x0->down.n_out;
	for (int g = g0; g < g1 && L->down_exps_b; g++)
		add_rows(f->ye + (size_t)f->ex_off[g] * N, bias_row(L->down_exps_b, f->ex_id[g]),
			 (size_t)(f->ex_off[g + 1] - f->ex_off[g]), N);
	return true;
}

/* Step 3 for groups g0 .. g1-1, one expert at a time (any weight types). */
static void moe_each(struct md_forward_ctx *f, int g0, int g1)
{
	const int64_t N = f->m->hp.n_embd;
	for (int g = g0; g < g1; g++) {
		int32_t a = f->ex_off[g], m = f->ex_off[g + 1] - a;
		for (int j = 0; j < m; j++)
			memcpy(f->xe + (size_t)j * N, f->xn + (size_t)f->ex_tok[a + j] * N,
			       (size_t)N * sizeof(float));
		const struct md_expert_w *x = &f->ex_got[g];
		const struct md_layer *L = f->ex_L;
		swiglu_b(f, &x->gate, &x->up, &x->down, bias_row(L->gate_exps_b, f->ex_id[g]),
			 bias_row(L->up_exps_b, f->ex_id[g]), bias_row(L->down_exps_b, f->ex_id[g]),
			 f->xe, m, f->ye + (size_t)a * N);
	}
}

/* Step 3 for group g on the device that holds its weights: the gathered rows, gate and up,
 * silu * up on the host, down, each product by the backend. Returns 0 or its error. */
static int moe_dev(struct md_forward_ctx *f, int g)
{
	const int64_t N = f->m->hp.n_embd;
	const struct md_expert_w *x = &f->ex_got[g];
	struct md_backend *d = x->dev;
	int32_t a = f->ex_off[g], m = f->ex_off[g + 1] - a;
	for (int j = 0; j < m; j++)
		memcpy(f->xe + (size_t)j * N, f->xn + (size_t)f->ex_tok[a + j] * N,
		       (size_t)N * sizeof(float));
	int rc = d->matmul(d, &x->gate, f->xe, m, f->ge);
	if (!rc)
		rc = d->matmul(d, &x->up, f->xe, m, f->ue);
	if (rc)
		return rc;
	const struct md_layer *L = f->ex_L;
	const size_t F = (size_t)x->gate.n_out;
	add_rows(f->ge, bias_row(L->gate_exps_b, f->ex_id[g]), (size_t)m, F);
	add_rows(f->ue, bias_row(L->up_exps_b, f->ex_id[g]), (size_t)m, F);
	struct glu_job gj = { f->ge, f->ue, (size_t)m, F, f->m->hp.ffn_act };
	glu_worker(&gj, 0, 1);
	rc = d->matmul(d, &x->down, f->ge, m, f->ye + (size_t)a * N);
	if (!rc)
		add_rows(f->ye + (size_t)a * N, bias_row(L->down_exps_b, f->ex_id[g]), (size_t)m,
			 (size_t)N);
	return rc;
}

/* Weight bytes of groups g0 .. g1-1 and the sum of each one's bytes times its tokens (what a
 * source's observe op is told). */
static void groups_bytes(const struct md_forward_ctx *f, int g0, int g1, uint64_t *bytes,
			 uint64_t *tok_bytes)
{
	*bytes = *tok_bytes = 0;
	for (int g = g0; g < g1; g++) {
		uint64_t b = md_expert_w_bytes(&f->ex_got[g]);
		*bytes += b;
		*tok_bytes += b * (uint64_t)(f->ex_off[g + 1] - f->ex_off[g]);
	}
}

/* moe_dev, timed for a source that observes. */
static int moe_dev_timed(struct md_forward_ctx *f, int g)
{
	if (!f->src->ops->observe)
		return moe_dev(f, g);
	double t0 = now_s();
	int rc = moe_dev(f, g);
	uint64_t b, tb;
	groups_bytes(f, g, g + 1, &b, &tb);
	f->src->ops->observe(f->src, true, b, tb, now_s() - t0);
	return rc;
}

/* Step 3 for groups g0 .. g1-1: device experts one by one, each run of host experts grouped
 * (or one by one where the kernels can't group them); failed and done ones skipped. Returns 0
 * or a device error. */
static int moe_wave(struct md_forward_ctx *f, int n, int g0, int g1)
{
	for (int g = g0; g < g1;) {
		if (f->ex_st[g] != EX_RUN) { /* failed: its rows stay zero (expert_failed) */
			g++;
			continue;
		}
		if (f->ex_got[g].dev) {
			int rc = moe_dev_timed(f, g++);
			if (rc)
				return rc;
			continue;
		}
		int h = g;
		while (h < g1 && !f->ex_got[h].dev && f->ex_st[h] == EX_RUN)
			h++;
		double t0 = f->src->ops->observe ? now_s() : 0;
		if (!moe_grouped(f, n, g, h))
			moe_each(f, g, h);
		if (f->src->ops->observe) {
			uint64_t b, tb;
			groups_bytes(f, g, h, &b, &tb);
			f->src->ops->observe(f->src, false, b, tb, now_s() - t0);
		}
		g = h;
	}
	return 0;
}

/* Release the first n_got experts of the get order (those whose get succeeded). */
static void experts_release(struct md_forward_ctx *f, uint32_t il, const struct md_routing *r,
			    int n_got)
{
	for (int i = 0; i < n_got; i++)
		if (f->ex_st[i] != EX_FAILED)
			md_expert_src_release(f->src, il, r->active[f->ex_order[i]]);
}

/* The get of get-order entry g failed with rc in a batch with tok_err: its tokens are marked
 * (the first error a token gets stays), its output rows are zero, and it is neither computed
 * nor released. */
static void expert_failed(struct md_forward_ctx *f, int g, int rc)
{
	const int64_t N = f->m->hp.n_embd;
	f->ex_st[g] = EX_FAILED;
	for (int32_t a = f->ex_off[g]; a < f->ex_off[g + 1]; a++) {
		int32_t t = f->ex_tok[a];
		if (!f->tok_err[t])
			f->tok_err[t] = rc;
		memset(f->ye + (size_t)a * N, 0, (size_t)N * sizeof(float));
	}
}

/* The get-order layout (see the header comment) from f->ex_order. */
static void experts_layout(struct md_forward_ctx *f, const struct md_routing *r)
{
	int32_t p = 0;
	for (int g = 0; g < r->n_active; g++) {
		int32_t e = r->active[f->ex_order[g]];
		f->ex_id[g] = e;
		f->ex_off[g] = p;
		for (int32_t s = r->off[e]; s < r->off[e + 1]; s++, p++) {
			f->ex_tok[p] = r->tok[s];
			f->ex_pos[s] = p;
		}
	}
	f->ex_off[r->n_active] = p;
}


/* Pre-gating, for sources that prefetch: layer il+1's router applied to the residual stream
 * leaving layer il (normed with layer il+1's FFN norm, as if layer il+1's attention changed
 * little) predicts layer il+1's experts; the source may read them while layer il+1's attention
 * and resident experts compute. The cost is one router matmul: n * n_embd * n_expert.
 * Measured on the trained moe64 (6 layers, top-4 of 64; 240 decode steps of KJV text, the
 * numpy reference): of the experts a token uses at layer l+1 this names 75% (top-4); from the
 * residual entering layer il's FFN instead (earlier, so more time to read) 61%, and 70% only
 * with the top 6 (50% more reads); the token's own experts of the step before at l+1 name 11%
 * (uniform: 6%), and adding them to the top-4 gains 4 points for 85% more guesses. Rejected:
 * the earlier input (more wasted reads, which cost disk time in the I/O-bound regime the store
 * is for, than the earlier start gains) and recent routing (this router barely repeats).
 * Through the server on moe64-2g at half its file (bench/README.md), both sets together (the
 * earlier one issued right after layer il's plan) read 107 MiB per decoded token against 91
 * for this one alone (76 with no prefetch), and were no faster. */
static void prefetch_next(struct md_forward_ctx *f, uint32_t il, int n)
{
	const struct md_hparams *hp = &f->m->hp;
	bool observe = f->pregate_cb && !f->draft;
	if ((!f->src->ops->prefetch && !observe) || il + 1 >= hp->n_layer)
		return;
	const struct md_layer *L = &f->m->layers[il + 1];
	const int64_t N = hp->n_embd;
	if (!L->gate_inp)
		return;
	for (int t = 0; t < n; t++)
		md_rmsnorm(f->pre_x + (size_t)t * N, f->x + (size_t)t * N, L->ffn_norm->data, N,
			hp->rms_eps);
	struct md_mat wr = md_mat_of(L->gate_inp, 0);
	md_matmul(f->pool, &wr, f->pre_x, n, f->pre_router.logits, f->mm_scratch);
	add_bias(f->pre_router.logits, L->gate_inp_b, n, hp->n_expert);
	const struct md_routing *p = md_router_route_bias(&f->pre_router, n,
							  L->exp_probs_b ? L->exp_probs_b->data : NULL);
	if (observe)
		f->pregate_cb(f->pregate_ud, il + 1, p);
	if (f->src->ops->prefetch)
		md_expert_src_prefetch(f->src, il + 1, p->active, p->n_active);
}

/* Step 3: plan, then per wave get its experts and run them; in the second wave a device
 * expert runs as soon as its get returns (its copy has landed), the host ones together at the
 * end. Release all. Returns 0, or the source's error with nothing held. */
static int moe_experts(struct md_forward_ctx *f, uint32_t il, const struct md_routing *r, int n)
{
	const int na = r->n_active;
	for (int i = 0; i < na; i++)
		f->ex_ntok[i] = r->off[r->active[i] + 1] - r->off[r->active[i]];
	int n_ready = md_expert_src_plan(f->src, il, r->active, f->ex_ntok, na, f->ex_order);
	if (n_ready < 0)
		return n_ready;
	if (n_ready == 0 || n_ready > na)
		n_ready = na;
	experts_layout(f, r);
	memset(f->ex_st, EX_RUN, (size_t)na);
	int got = 0;
	for (int g0 = 0; g0 < na;) {
		int g1 = g0 == 0 ? n_ready : na;
		for (; got < g1; got++) {
			int rc = md_expert_src_get(f->src, il, r->active[f->ex_order[got]],
						   &f->ex_got[got]);
			if (rc && f->tok_err) {
				expert_failed(f, got, rc);
			} else if (rc) {
				experts_release(f, il, r, got);
				return rc;
			} else if (g0 > 0 && f->ex_got[got].dev) {
				f->ex_st[got] = EX_DONE;
				if ((rc = moe_dev_timed(f, got))) {
					experts_release(f, il, r, got + 1);
					return rc;
				}
			}
		}
		int rc = moe_wave(f, n, g0, g1);
		if (rc) {
			experts_release(f, il, r, got);
			return rc;
		}
		g0 = g1;
	}
	experts_release(f, il, r, na);
	return 0;
}

/* The MoE FFN of layer il on f->xn (n, N); output in f->tmp (n, N). Returns 0 or an expert
 * source's error. */
static int moe(struct md_forward_ctx *f, int n, uint32_t il)
{
	const struct md_hparams *hp = &f->m->hp;
	const struct md_layer *L = &f->m->layers[il];
	const int64_t N = hp->n_embd;

	/* 1-2. Route and group (router.c); the observer sees the result. A draft pass routes to
	 * fewer (or only resident) experts and notes the exact pass's likely choice. */
	struct md_mat wr = md_mat_of(L->gate_inp, 0);
	md_matmul(f->pool, &wr, f->xn, n, f->router.logits, f->mm_scratch);
	add_bias(f->router.logits, L->gate_inp_b, n, hp->n_expert);
	const struct md_forward_draft *dp = f->draft;
	if (dp) {
		const uint8_t *allow = NULL;
		if (dp->resident_only && f->src->ops->resident) {
			for (uint32_t e = 0; e < hp->n_expert; e++)
				f->allow[e] = md_expert_src_resident(f->src, il, (int32_t)e);
			allow = f->allow;
		}
		md_router_set_draft(&f->router, (int)dp->n_used, allow);
	}
	const struct md_routing *r = md_router_route_bias(&f->router, n,
							  L->exp_probs_b ? L->exp_probs_b->data : NULL);
	if (dp && dp->predict)
		md_router_note_topk(&f->router, n, f->allow, dp->predict + (size_t)il * hp->n_expert);
	if (f->route_cb && !dp)
		f->route_cb(f->route_ud, il, r);

	/* 3. Get the active experts' weights and run each once over all its tokens. */
	f->ex_L = L;
	int rc = moe_experts(f, il, r, n);
	if (rc)
		return rc;

	/* 4. Scatter-add in routing slot order (the same sums whichever path or wave computed
	 * the experts). */
	memset(f->tmp, 0, (size_t)n * N * sizeof(float));
	for (int s = 0; s < r->off[r->n_expert]; s++) {
		float w = r->tok_w[s];
		float *dst = f->tmp + (size_t)r->tok[s] * N;
		const float *src = f->ye + (size_t)f->ex_pos[s] * N;
		for (int64_t j = 0; j < N; j++)
			dst[j] += w * src[j];
	}

	/* The shared expert: with its sigmoid gate (Qwen2-MoE), or ungated (DeepSeek, GLM). */
	if (L->gate_shexp) {
		struct md_mat g = md_mat_of(L->gate_shexp, 0), u = md_mat_of(L->up_shexp, 0);
		struct md_mat d = md_mat_of(L->down_shexp, 0);
		swiglu(f, &g, &u, &d, f->xn, n, f->ye);
		const float *gw = L->gate_inp_shexp ? L->gate_inp_shexp->data : NULL;
		for (int t = 0; t < n; t++) {
			const float *xr = f->xn + (size_t)t * N;
			double s = 0;
			for (int64_t j = 0; gw && j < N; j++)
				s += (double)gw[j] * xr[j];
			float gate = gw ? (float)(1.0 / (1.0 + exp(-s))) : 1.0f;
			float *dst = f->tmp + (size_t)t * N;
			const float *src = f->ye + (size_t)t * N;
			for (int64_t j = 0; j < N; j++)
				dst[j] += gate * src[j];
		}
	}
	return 0;
}

/* The FFN sub-layer of layer il. Returns 0 or an expert source's error. */
static int ffn(struct md_forward_ctx *f, int n, uint32_t il)
{
	const struct md_hparams *hp = &f->m->hp;
	const struct md_layer *L = &f->m->layers[il];
	const int64_t N = hp->n_embd;
	for (int t = 0; t < n; t++)
		md_rmsnorm(f->xn + (size_t)t * N, f->x + (size_t)t * N, L->ffn_norm->data, N,
			   hp->rms_eps);
	if (L->gate_inp) { /* routed experts; dense FFN in dense models and leading layers */
		int rc = moe(f, n, il);
		if (rc)
			return rc;
	} else {
		struct md_mat g = md_mat_of(L->ffn_gate, 0), u = md_mat_of(L->ffn_up, 0);
		struct md_mat d = md_mat_of(L->ffn_down, 0);
		swiglu(f, &g, &u, &d, f->xn, n, f->tmp);
	}
	for (size_t i = 0; i < (size_t)n * N; i++)
		f->x[i] += f->tmp[i];
	if (hp->n_expert)
		prefetch_next(f, il, n);
	return 0;
}

int md_forward(struct md_forward_ctx *f, struct md_kv_cache *kv, const struct md_batch *b,
	       float *logits)
{
	const struct md_model *m = f->m;
	const struct md_hparams *hp = &m->hp;
	const int n = b->n_tokens;
	const int64_t N = hp->n_embd;

	if (f->dev) {
		const struct md_fwd_dev_pass p = {
			.pool = f->pool, .src = f->src,
			.draft = f->draft, .route_cb = f->route_cb, .route_ud = f->route_ud,
			.pregate_cb = f->pregate_cb, .pregate_ud = f->pregate_ud,
		};
		return md_fwd_dev_forward(f->dev, &p, kv, b, logits);
	}

	/* The batch's own checks, then the cache's (sequences, positions, reservations). */
	if (n < 1 || n > f->max_tokens)
		return -EINVAL;
	for (int t = 0; t < n; t++)
		if (b->tokens[t] < 0 || (uint32_t)b->tokens[t] >= hp->n_vocab)
			return -EINVAL;
	int rc = md_kv_batch_begin(kv, n, b->seq, b->pos);
	if (rc)
		return rc;
	f->tok_err = b->tok_err;
	if (b->tok_err)
		memset(b->tok_err, 0, (size_t)n * sizeof(*b->tok_err));

	int32_t max_pos = 0;
	for (int t = 0; t < n; t++)
		max_pos = b->pos[t] > max_pos ? b->pos[t] : max_pos;
	size_t need = ((size_t)max_pos + 16) & ~(size_t)15;
	if (need > f->att_cap) {
		float *p = realloc(f->att_scratch, need * (size_t)md_pool_size(f->pool) * sizeof(float));
		if (!p)
			return -ENOMEM;
		f->att_scratch = p;
		f->att_cap = need;
	}

	for (int t = 0; t < n; t++)
		md_dequant_row(m->tok_embd->type, (const uint8_t *)m->tok_embd->data + (size_t)b->tokens[t] * m->tok_embd->nb1,
			       f->x + (size_t)t * N, N);

	for (uint32_t il = 0; il < hp->n_layer; il++) {
		if (f->draft && f->draft->skip && f->draft->skip[il])
			continue;
		attention(f, kv, b, il);
		rc = ffn(f, n, il);
		if (rc)
			return rc;
	}

	/* Every layer's rows are written: commit. A sequence's positions rise through the
	 * batch, so committing each token's pos + 1 in order ends at its last one. */
	for (int t = 0; t < n; t++) {
		rc = md_kv_commit(kv, b->seq[t], (uint32_t)b->pos[t] + 1);
		MD_ASSERT(rc == 0);
	}

	/* Final norm and logits for the wanted rows only. */
	int n_out = 0;
	for (int t = 0; t < n; t++) {
		bool want;
		if (b->want_logits) {
			want = b->want_logits[t];
		} else {
			want = true; /* default: the last token of each sequence in the batch */
			for (int u = t + 1; u < n; u++)
				want &= b->seq[u] != b->seq[t];
		}
		if (want) {
			md_rmsnorm(f->xn + (size_t)n_out * N, f->x + (size_t)t * N, m->output_norm->data,
				   N, hp->rms_eps);
			n_out++;
		}
	}
	struct md_mat wout = md_mat_of(m->output, 0);
	md_matmul(f->pool, &wout, f->xn, n_out, logits, f->mm_scratch);
	return n_out;
}
