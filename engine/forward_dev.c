/* The forward pass on a device (forward_dev.h): the context, the step tables, attention, the
 * pass and its graphs; the FFN sub-layer is forward_dev_ffn.c's (forward_dev_int.h between).
 *
 * One pass, for a batch of n tokens (T = max_tokens, N = n_embd, H / K = query / KV heads,
 * D = head_dim, E = n_expert, k = n_expert_used, F = the widest FFN):
 *   step tables: each token's position, the cache row its K/V go to, an offset into the
 *     batch's block tables, the rope tables and the rows whose logits are wanted, packed into
 *     one host buffer and uploaded once;
 *   embeddings: dequantized on the host, uploaded into x;
 *   per layer, on the device: RMSNorm, Q/K/V (+ biases, QK-norm, rope), K/V rows stored into
 *     the layer's mirror rows, attention over the block tables, output projection, residual;
 *     RMSNorm, then a dense SwiGLU, or the MoE FFN: router logits downloaded and routed on
 *     the host (the one synchronisation of a layer), the routing's experts got from the
 *     source in its order and laid out in runs: a run of device experts of one type is one
 *     grouped launch for gate and up, the activation and one for down; a run of host
 *     experts is computed on the CPU by the host executor (the simulated backend's ops on
 *     this pass's threads: the CPU forward pass's kernels) from the downloaded normed input,
 *     its rows uploaded; then one combine per token in the routing's slot order (the CPU
 *     pass's scatter-add order), the shared expert, residual; pre-gating for a source that
 *     prefetches or an observer;
 *   logits: the wanted rows gathered, normed, projected and downloaded.
 * The sequence of operations is the CPU pass's (engine/forward.c), op for op, so on the
 * simulated device the two agree to the last bit except where the CPU pass sums in double
 * (the shared expert's gate).
 */
#include "engine/forward_dev.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/assert.h"
#include "common/log.h"
#include "engine/backend_sim.h"
#include "engine/forward_dev_int.h"
#include "engine/rope.h"





/* Bytes of a tensor's data as laid out (3-D: matrices nb2 apart). */
static size_t tensor_bytes(const struct md_tensor *t)
{
	size_t mat = (size_t)t->ne[1] * t->nb1;
	return t->ne[2] > 1 ? (size_t)(t->ne[2] - 1) * t->nb2 + mat : mat;
}

static bool is_expert_tensor(const struct md_layer *L, const struct md_tensor *t)
{
	return t == L->gate_exps || t == L->up_exps || t == L->down_exps;
}

/* Calls fn for every tensor a device pass reads from device memory: the layers' attention,
 * norms, dense FFN, router, shared expert, expert biases (and, with experts, the routed expert
 * tensors), the output norm and head. Not the token embedding (unless tied to the output). */
static void each_tensor(const struct md_model *m, bool experts,
			void (*fn)(void *ud, const struct md_tensor *t), void *ud)
{
	for (uint32_t il = 0; il < m->hp.n_layer; il++) {
		const struct md_layer *L = &m->layers[il];
		const struct md_tensor *ts[] = {
			L->attn_norm, L->wq, L->wk, L->wv, L->bq, L->bk, L->bv, L->wo, L->bo,
			L->attn_sinks, L->q_norm, L->k_norm, L->ffn_norm, L->ffn_gate, L->ffn_up,
			L->ffn_down, L->gate_inp, L->gate_inp_b, L->gate_exps_b, L->up_exps_b,
			L->down_exps_b, L->gate_inp_shexp, L->gate_shexp, L->up_shexp,
			L->down_shexp, L->gate_exps, L->up_exps, L->down_exps,
			L->wq_a, L->q_a_norm, L->wq_b, L->wkv_a_mqa, L->kv_a_norm, L->wk_b, L->wv_b,
			L->exp_probs_b,
		};
		for (size_t i = 0; i < sizeof(ts) / sizeof(ts[0]); i++)
			if (ts[i] && (experts || !is_expert_tensor(L, ts[i])))
				fn(ud, ts[i]);
	}
	fn(ud, m->output_norm);
	fn(ud, m->output);
}

struct sum_ud {
	uint64_t bytes;
};

static void sum_tensor(void *ud, const struct md_tensor *t)
{
	((struct sum_ud *)ud)->bytes += (tensor_bytes(t) + 255) & ~(size_t)255;
}

/* Activation floats for max_tokens tokens (the device buffers of md_fwd_dev_new). */
static uint64_t act_floats(const struct md_hparams *hp, int max_tokens, size_t *F_out)
{
	size_t T = (size_t)max_tokens, N = hp->n_embd, QD = (size_t)hp->n_head * hp->head_dim;
	size_t KD = (size_t)hp->n_head_kv * hp->head_dim;
	size_t E = hp->n_expert ? hp->n_expert : 1, K = hp->n_expert_used ? hp->n_expert_used : 1;
	size_t F = hp->n_ff_exp;
	if (hp->n_ff_shexp > F)
		F = hp->n_ff_shexp;
	if ((!hp->n_expert || hp->n_layer_dense_lead) && hp->n_ff > F)
		F = hp->n_ff;
	if (F_out)
		*F_out = F;
	uint64_t mla = 0;
	if (hp->kv_lora_rank) { /* attention_mla's buffers */
		size_t H = hp->n_head, C = hp->kv_lora_rank, W = C + hp->n_rot;
		mla = T * (hp->q_lora_rank + W + H * (hp->head_dim_nope + 2 * C + W +
						      2 * (size_t)hp->head_dim_v));
	}
	return 3 * T * N + 2 * T * QD + 2 * T * KD + 2 * T * K * F + T * K * N + T * E + T +
	       T * N /* xn */ + mla;
}

uint64_t md_fwd_dev_need(const struct md_model *m, bool with_experts, uint64_t kv_bytes,
			 int max_tokens)
{
	struct sum_ud s = { 0 };
	each_tensor(m, with_experts, sum_tensor, &s);
	/* logits of a full batch of rows, as the largest the pass grows to */
	uint64_t act = act_floats(&m->hp, max_tokens, NULL) * sizeof(float) +
		       (uint64_t)max_tokens * m->hp.n_vocab * sizeof(float);
	return s.bytes + kv_bytes + act;
}

struct up_ud {
	struct md_fwd_dev *d;
	int rc;
	const struct md_tensor *bad;
};

static void upload_tensor(void *ud, const struct md_tensor *t)
{
	struct up_ud *u = ud;
	struct md_fwd_dev *d = u->d;
	size_t i = (size_t)(t - d->m->tensors);
	if (u->rc || d->wdev[i])
		return;
	if (t->ne[1] > 1 && !d->b->supports(d->b, t->type)) {
		u->rc = -ENOTSUP;
		u->bad = t;
		return;
	}
	size_t n = tensor_bytes(t);
	int rc = d->b->alloc(d->b, n, &d->wdev[i]);
	if (!rc)
		rc = d->b->upload(d->b, d->wdev[i], t->data, n);
	if (rc)
		u->rc = rc;
	else
		d->w_bytes += n;
}

/* ---- the resident source ---- */

static int res_get(struct md_expert_src *src, uint32_t layer, int32_t e, struct md_expert_w *out)
{
	struct md_fwd_dev *d = ((struct dev_src *)src)->d;
	const struct md_layer *L = &d->m->layers[layer];
	if (!L->gate_exps || e < 0 || (uint32_t)e >= d->m->hp.n_expert)
		return -EINVAL;
	out->gate = dmat(d, L->gate_exps, e);
	out->up = dmat(d, L->up_exps, e);
	out->down = dmat(d, L->down_exps, e);
	out->dev = d->b;
	return 0;
}

static const struct md_expert_src_ops res_ops = { .name = "device", .get = res_get };

/* ---- creation ---- */

static void *xalloc(size_t n, int *fail)
{
	void *p = calloc(1, n ? n : 1);
	if (!p)
		*fail = 1;
	return p;
}

static int dalloc(struct md_fwd_dev *d, size_t n, void *out, int rc)
{
	if (rc)
		return rc;
	void **p = out;
	rc = d->b->alloc(d->b, n ? n : 256, p);
	if (!rc)
		d->act_bytes += n;
	return rc;
}

/* Mirror the host cache's block copy (kv_cache.c block_copy) on the device. */
static void on_kv_copy(void *ud, int32_t dst, int32_t src)
{
	struct md_fwd_dev *d = ud;
	const struct md_kv_cache *kv = d->kv;
	size_t kb = (size_t)MD_KV_BLOCK_TOKENS * kv->kv_dim * kv->k_bytes;
	size_t vb = (size_t)MD_KV_BLOCK_TOKENS * kv->v_dim * sizeof(float);
	for (uint32_t l = 0; l < kv->n_layer; l++) {
		char *k = (char *)d->kc + (size_t)l * d->k_layer * kv->k_bytes;
		d->op->copy(d->b, k + (size_t)dst * kb, k + (size_t)src * kb, kb);
		if (vb) {
			char *v = (char *)(d->vc + (size_t)l * d->v_layer);
			d->op->copy(d->b, v + (size_t)dst * vb, v + (size_t)src * vb, vb);
		}
	}
}

struct type_ud {
	const struct md_backend *b;
	const struct md_tensor *bad;
};

static void check_type(void *ud, const struct md_tensor *t)
{
	struct type_ud *u = ud;
	if (!u->bad && t->ne[1] > 1 && !u->b->supports(u->b, t->type))
		u->bad = t;
}

const char *md_fwd_dev_unsupported(const struct md_model *m, struct md_kv_rows rows,
				   const struct md_backend *b, char *buf, size_t len)
{
	const struct md_hparams *hp = &m->hp;
	if (!b->fwd)
		snprintf(buf, len, "the %s backend has no device forward ops", b->name);
	else if (hp->kv_lora_rank && (!b->fwd->attention_mla || rows.v_dim ||
				      rows.k_dim != hp->kv_lora_rank + hp->n_rot))
		snprintf(buf, len, "the %s backend has no latent attention", b->name);
	else if (hp->kv_lora_rank && rows.k_dim > 1024)
		snprintf(buf, len, "latent rows of %u are over the device's 1024", rows.k_dim);
	else if (hp->kv_lora_rank > 512)
		snprintf(buf, len, "a latent rank of %u is over the device's 512", hp->kv_lora_rank);
	else if (!hp->kv_lora_rank && (rows.k_half || rows.v_dim != rows.k_dim))
		snprintf(buf, len, "the KV cache is not float K and V rows");
	else if (!hp->kv_lora_rank && hp->head_dim > 256)
		snprintf(buf, len, "head_dim %u is over the device attention's 256", hp->head_dim);
	else if (hp->n_rot % 2 || hp->n_rot > hp->head_dim)
		snprintf(buf, len, "rotary dims out of range");
	else if (!hp->kv_lora_rank && (hp->n_head_kv == 0 || hp->n_head % hp->n_head_kv))
		snprintf(buf, len, "query heads are not a multiple of KV heads");
	else
		buf[0] = '\0';
	if (buf[0])
		return buf;
	struct type_ud u = { b, NULL };
	each_tensor(m, true, check_type, &u);
	if (u.bad) {
		const struct md_dtype_info *i = md_dtype_info(u.bad->type);
		snprintf(buf, len, "the %s backend cannot read %s weights (%.*s)", b->name,
			 i ? i->name : "?", (int)u.bad->name_len, u.bad->name);
		return buf;
	}
	return NULL;
}

void md_fwd_dev_free(struct md_fwd_dev *d)
{
	if (!d)
		return;
	struct md_backend *b = d->b;
	if (d->kv && d->kv->copy_ud == d)
		md_kv_set_copy_hook(d->kv, NULL, NULL);
	if (d->wdev)
		for (size_t i = 0; i < d->m->n_tensors; i++)
			b->free(b, d->wdev[i]);
	b->free(b, d->kc);
	b->free(b, (void *)d->mla_tab);
	float *bufs[] = { d->vc, d->x, d->xn, d->q, d->k, d->v, d->att, d->tmp, d->ge,
			  d->ue, d->ye, d->rl, d->gsh, d->dlogits, d->qa, d->kva, d->qn, d->qabs,
			  d->qcat, d->olat, d->ov, d->matt };
	for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
		b->free(b, bufs[i]);
	b->free(b, d->dtab);
	b->free(b, d->drun);
	b->free(b, d->lay);
	for (int i = 0; i <= FAST_MAX_TOK; i++)
		if (d->graph[i])
			b->fwd->graph_free(b, d->graph[i]);
	b->free(b, d->rec_ids);
	b->free(b, d->rec_w);
	free(d->rec_ids_h);
	free(d->rec_w_h);
	free(d->fast_layer);
	free(d->wdev);
	b->host_free(b, d->pin);
	if (d->m->hp.n_expert) {
		md_router_release(&d->router);
		md_router_release(&d->pre_router);
	}
	free(d->seq_tab);
	free(d->seq_last);
	free(d->ex_got);
	free(d->ex_order);
	free(d->ex_ntok);
	free(d->ex_st);
	free(d->allow);
	free(d->lay_w);
	free(d->lay_off);
	free(d->ex_pos);
	free(d->lay_tok);
	free(d->lay_eid);
	free(d->cmb_n);
	md_backend_sim_free(d->host);
	free(d->xn_h);
	free(d->ge_h);
	free(d->ue_h);
	free(d->ye_h);
	free(d);
}

int md_fwd_dev_new(const struct md_model *m, struct md_backend *b, struct md_kv_cache *kv,
		   int max_tokens, bool experts_resident, struct md_fwd_dev **out, char *err,
		   size_t errlen)
{
	*out = NULL;
	const struct md_hparams *hp = &m->hp;
	struct md_kv_rows rows = { kv->kv_dim, kv->v_dim, kv->k_bytes == 2 };
	if (md_fwd_dev_unsupported(m, rows, b, err, errlen))
		return -ENOTSUP;
	if (max_tokens < 1)
		return -EINVAL;
	struct md_fwd_dev *d = calloc(1, sizeof(*d));
	if (!d)
		return -ENOMEM;
	d->m = m;
	d->b = b;
	d->op = b->fwd;
	d->T = max_tokens;
	d->experts_resident = experts_resident && hp->n_expert;
	d->res.base.ops = &res_ops;
	d->res.d = d;
	int fail = 0;
	d->wdev = xalloc(m->n_tensors * sizeof(void *), &fail);
	if (fail) {
		free(d);
		return -ENOMEM;
	}

	/* Weights. */
	struct up_ud u = { d, 0, NULL };
	each_tensor(m, d->experts_resident, upload_tensor, &u);
	if (u.rc) {
		if (u.rc == -ENOTSUP)
			snprintf(err, errlen, "the %s backend cannot read %s weights (%.*s)", b->name,
				 md_dtype_info(u.bad->type) ? md_dtype_info(u.bad->type)->name : "?",
				 (int)u.bad->name_len, u.bad->name);
		else
			snprintf(err, errlen, "cannot upload the weights (%.1f MiB so far): %s",
				 d->w_bytes / 1048576.0, strerror(-u.rc));
		md_fwd_dev_free(d);
		return u.rc;
	}

	/* The KV mirror and the activations. */
	size_t T = (size_t)max_tokens, N = hp->n_embd, QD = (size_t)hp->n_head * hp->head_dim;
	size_t KD = (size_t)hp->n_head_kv * hp->head_dim;
	size_t E = hp->n_expert ? hp->n_expert : 1, K = hp->n_expert_used ? hp->n_expert_used : 1;
	size_t F;
	act_floats(hp, max_tokens, &F);
	d->k_layer = (size_t)kv->n_blocks * MD_KV_BLOCK_TOKENS * kv->kv_dim;
	d->v_layer = (size_t)kv->n_blocks * MD_KV_BLOCK_TOKENS * kv->v_dim;
	int rc = b->alloc(b, d->k_layer * kv->n_layer * kv->k_bytes, &d->kc);
	if (!rc && d->v_layer)
		rc = b->alloc(b, d->v_layer * kv->n_layer * sizeof(float), (void **)&d->vc);
	if (!rc)
		d->kv_bytes = (d->k_layer * kv->k_bytes + d->v_layer * sizeof(float)) * kv->n_layer;
	const size_t fs = sizeof(float);
	rc = dalloc(d, T * N * fs, &d->x, rc);
	rc = dalloc(d, T * N * fs, &d->xn, rc);
	rc = dalloc(d, T * QD * fs, &d->q, rc);
	rc = dalloc(d, T * KD * fs, &d->k, rc);
	rc = dalloc(d, T * KD * fs, &d->v, rc);
	rc = dalloc(d, T * QD * fs, &d->att, rc);
	rc = dalloc(d, T * N * fs, &d->tmp, rc);
	rc = dalloc(d, T * K * F * fs, &d->ge, rc);
	rc = dalloc(d, T * K * F * fs, &d->ue, rc);
	rc = dalloc(d, T * K * N * fs, &d->ye, rc);
	rc = dalloc(d, T * E * fs, &d->rl, rc);
	rc = dalloc(d, T * fs, &d->gsh, rc);
	if (hp->kv_lora_rank) {
		const size_t H = hp->n_head, C = hp->kv_lora_rank, W = C + hp->n_rot;
		const size_t Dn = hp->head_dim_nope, Dv = hp->head_dim_v;
		rc = dalloc(d, T * (hp->q_lora_rank ? hp->q_lora_rank : 1) * fs, &d->qa, rc);
		rc = dalloc(d, T * W * fs, &d->kva, rc);
		rc = dalloc(d, H * T * Dn * fs, &d->qn, rc);
		rc = dalloc(d, H * T * C * fs, &d->qabs, rc);
		rc = dalloc(d, T * H * W * fs, &d->qcat, rc);
		rc = dalloc(d, H * T * C * fs, &d->olat, rc);
		rc = dalloc(d, H * T * Dv * fs, &d->ov, rc);
		rc = dalloc(d, T * H * Dv * fs, &d->matt, rc);
		/* the heads of each layer's wk_b and wv_b, for the per-head grouped products */
		const void **tab = calloc((size_t)hp->n_layer * 2 * H, sizeof(void *));
		size_t tb = (size_t)hp->n_layer * 2 * H * sizeof(void *);
		if (!tab && !rc)
			rc = -ENOMEM;
		for (uint32_t il = 0; il < hp->n_layer && tab; il++) {
			const struct md_layer *L = &m->layers[il];
			for (size_t h = 0; h < H && L->wk_b; h++) {
				tab[(size_t)il * 2 * H + h] = (const char *)dptr(d, L->wk_b) + h * L->wk_b->nb2;
				tab[(size_t)il * 2 * H + H + h] = (const char *)dptr(d, L->wv_b) +
								  h * L->wv_b->nb2;
			}
		}
		rc = dalloc(d, tb, &d->mla_tab, rc);
		if (!rc)
			rc = b->upload(b, (void *)d->mla_tab, tab, tb);
		free(tab);
	}
	if (rc) {
		snprintf(err, errlen, "cannot allocate the KV mirror and activations (%.1f MiB of "
			 "weights uploaded): %s", d->w_bytes / 1048576.0, strerror(-rc));
		md_fwd_dev_free(d);
		return rc;
	}

	/* Host side. */
	d->seq_tab = xalloc(kv->max_seqs * sizeof(int32_t), &fail);
	d->seq_last = xalloc(kv->max_seqs * sizeof(int32_t), &fail);
	if (hp->n_expert) {
		if (md_router_init(&d->router, hp, max_tokens) ||
		    md_router_init(&d->pre_router, hp, max_tokens))
			fail = 1;
		d->ex_got = xalloc(E * sizeof(struct md_expert_w), &fail);
		d->ex_order = xalloc(E * sizeof(int32_t), &fail);
		d->ex_ntok = xalloc(E * sizeof(int32_t), &fail);
		d->ex_st = xalloc(E, &fail);
		d->allow = xalloc(E, &fail);
		d->lay_w = xalloc(E * sizeof(struct md_expert_w), &fail);
		d->lay_off = xalloc((E + 1) * sizeof(int32_t), &fail);
		d->ex_pos = xalloc(T * K * sizeof(int32_t), &fail);
		d->lay_tok = xalloc(T * K * sizeof(int32_t), &fail);
		d->lay_eid = xalloc(T * K * sizeof(int32_t), &fail);
		d->cmb_n = xalloc(T * sizeof(int32_t), &fail);
		if (!d->experts_resident) {
			d->xn_h = xalloc(T * N * fs, &fail);
			d->ge_h = xalloc(T * K * F * fs, &fail);
			d->ue_h = xalloc(T * K * F * fs, &fail);
			d->ye_h = xalloc(T * K * N * fs, &fail);
			if (!fail && !(d->host = md_backend_sim_new(0, 0)))
				fail = 1;
		}
	}
	if (fail) {
		md_fwd_dev_free(d);
		return -ENOMEM;
	}
	/* Routing on the device. */
	d->fast_ok = d->experts_resident && b->fwd->route && b->fwd->moe_layout &&
		     hp->n_expert <= MD_DEV_ROUTE_EMAX;
	if (d->fast_ok) {
		size_t FK = (size_t)FAST_MAX_TOK * K, rec = (size_t)hp->n_layer * T * K;
		size_t lay = 3 * FK * sizeof(void *) + (FK + 1) * sizeof(int32_t) + 4 * FK * 4;
		rc = dalloc(d, lay, &d->lay, 0);
		rc = dalloc(d, rec * sizeof(int32_t), &d->rec_ids, rc);
		rc = dalloc(d, rec * sizeof(float), &d->rec_w, rc);
		d->rec_ids_h = xalloc(rec * sizeof(int32_t), &fail);
		d->rec_w_h = xalloc(rec * sizeof(float), &fail);
		d->fast_layer = xalloc(hp->n_layer, &fail);
		if (rc || fail) {
			snprintf(err, errlen, "cannot allocate the device routing's tables");
			md_fwd_dev_free(d);
			return rc ? rc : -ENOMEM;
		}
	}
	md_rope_init(&d->rope[0], hp, false);
	md_rope_init(&d->rope[1], hp, true);
	d->no_graphs = getenv("MOED_NO_GRAPHS") != NULL; /* A/B measurements */
	d->no_fuse = getenv("MOED_NO_FUSE") != NULL;
	d->kv = kv;
	md_kv_set_copy_hook(kv, on_kv_copy, d);
	*out = d;
	return 0;
}

void md_fwd_dev_mem(const struct md_fwd_dev *d, struct md_fwd_dev_mem *out)
{
	out->weights = d->w_bytes;
	out->kv = d->kv_bytes;
	out->activations = d->act_bytes + d->dtab_cap + d->drun_cap +
			   d->dlogits_rows * d->m->hp.n_vocab * sizeof(float);
	out->experts_resident = d->experts_resident;
}

/* ---- per-pass tables ---- */

/* n bytes of pinned staging for an upload_async on stream 0 (or for the host executor to
 * read). Taken pointers stay valid until stream 0 next drains: when the staging runs out, it
 * drains stream 0 and starts over, and every download does (reset_stage). NULL: no memory. */
void *md_fwd_dev__stage(struct md_fwd_dev *d, size_t n)
{
	n = (n + 63) & ~(size_t)63;
	if (d->pin_off + n > d->pin_cap && d->pin_off > 0) {
		if (d->op->sync(d->b))
			return NULL;
		d->pin_off = 0;
	}
	if (n > d->pin_cap) {
		size_t cap = d->pin_cap ? 2 * d->pin_cap : (size_t)1 << 20;
		while (cap < n)
			cap *= 2;
		d->b->host_free(d->b, d->pin); /* waits for every stream */
		d->pin = NULL;
		d->pin_cap = 0;
		if (d->b->host_alloc(d->b, cap, &d->pin))
			return NULL;
		d->pin_cap = cap;
	}
	void *p = (char *)d->pin + d->pin_off;
	d->pin_off += n;
	return p;
}

/* Stream 0 has drained (a download or a sync): the staging is free again. */
static void reset_stage(struct md_fwd_dev *d)
{
	d->pin_off = 0;
}

/* A download, which drains stream 0 first. */
int md_fwd_dev__download(struct md_fwd_dev *d, void *dst, const void *src, size_t n)
{
	int rc = d->b->download(d->b, dst, src, n);
	reset_stage(d);
	return rc;
}

/* Enqueue an upload of staged bytes on stream 0. */
int md_fwd_dev__upload(struct md_fwd_dev *d, void *dst, const void *staged, size_t n)
{
	return d->b->upload_async(d->b, dst, staged, n, MD_BACKEND_STREAM_COMPUTE);
}

/* Device buffer *buf of at least n bytes (contents not kept). */
int md_fwd_dev__dgrow(struct md_fwd_dev *d, void **buf, size_t *cap, size_t n)
{
	if (n <= *cap)
		return 0;
	size_t c = *cap ? *cap : 4096;
	while (c < n)
		c *= 2;
	if (*buf && d->op->sync(d->b)) /* queued work may still read it */
		return -EIO;
	d->b->free(d->b, *buf);
	*buf = NULL;
	*cap = 0;
	int rc = d->b->alloc(d->b, c, buf);
	if (!rc)
		*cap = c;
	return rc;
}

/* Build and upload the step tables of batch b: positions, the cache rows written, each
 * sequence's block table, the rope tables, the rows whose logits are wanted. */
static int step_tables(struct md_fwd_dev *d, const struct md_kv_cache *kv, const struct md_batch *b,
		       struct step_tab *st)
{
	const struct md_hparams *hp = &d->m->hp;
	const int n = b->n_tokens, R = (int)hp->n_rot;
	const bool two = hp->n_swa && (hp->rope_freq_base_swa != hp->rope_freq_base);
	size_t n_blocks = 0;
	for (int t = 0; t < n; t++)
		d->seq_tab[b->seq[t]] = -1;
	for (int t = 0; t < n; t++)
		if (d->seq_tab[b->seq[t]] == -1 || b->pos[t] > d->seq_last[b->seq[t]]) {
			if (d->seq_tab[b->seq[t]] == -1)
				d->seq_tab[b->seq[t]] = 0;
			d->seq_last[b->seq[t]] = b->pos[t];
		}
	for (int t = 0; t < n; t++) /* the sequence's table: blocks up to its last position */
		if (d->seq_tab[b->seq[t]] == 0 && d->seq_last[b->seq[t]] >= 0) {
			d->seq_tab[b->seq[t]] = -2 - (int32_t)n_blocks; /* placed: offset */
			n_blocks += (size_t)d->seq_last[b->seq[t]] / MD_KV_BLOCK_TOKENS + 1;
		}
	/* Fixed places for a given stride S (the graphs of batches up to FAST_MAX_TOK read them
	 * at the same addresses every step): per-token tables of S entries, the rope tables of
	 * S rows each, then the block tables. */
	const size_t S = n > FAST_MAX_TOK ? (size_t)n : FAST_MAX_TOK;
	const size_t nh = hp->kv_lora_rank ? hp->n_head + 1 : 0;
	const size_t ni = 4 * S + nh, nf = 2 * S * (size_t)R;
	size_t bytes = (ni + nf + n_blocks) * 4;
	int32_t *h = md_fwd_dev__stage(d, bytes);
	if (!h)
		return -ENOMEM;
	int32_t *pos = h, *wrow = h + S, *tab = h + 2 * S, *outr = h + 3 * S;
	float *cs0 = (float *)(h + ni), *cs1 = cs0 + S * R;
	int32_t *blk = h + ni + nf, *hoff = h + 4 * S;
	for (size_t i = 0; i < nh; i++)
		hoff[i] = (int32_t)i * n;
	st->max_pos = 0;
	st->n_out = 0;
	for (int t = 0; t < n; t++) {
		int32_t s = b->seq[t], off = -2 - d->seq_tab[s];
		pos[t] = b->pos[t];
		st->max_pos = b->pos[t] > st->max_pos ? b->pos[t] : st->max_pos;
		wrow[t] = md_kv_seq_block(kv, s, (uint32_t)b->pos[t]) * MD_KV_BLOCK_TOKENS +
			  b->pos[t] % MD_KV_BLOCK_TOKENS;
		tab[t] = off;
		for (int32_t i = 0; i <= d->seq_last[s] / MD_KV_BLOCK_TOKENS; i++)
			blk[off + i] = md_kv_seq_block(kv, s, (uint32_t)i * MD_KV_BLOCK_TOKENS);
		bool want;
		if (b->want_logits) {
			want = b->want_logits[t];
		} else {
			want = true; /* default: the last token of each sequence in the batch */
			for (int u = t + 1; u < n; u++)
				want &= b->seq[u] != b->seq[t];
		}
		if (want)
			outr[st->n_out++] = t;
		if (R) {
			md_rope_table(&d->rope[0], b->pos[t], cs0 + (size_t)t * R);
			if (two)
				md_rope_table(&d->rope[1], b->pos[t], cs1 + (size_t)t * R);
		}
	}
	void *old_tab = d->dtab;
	int rc = md_fwd_dev__dgrow(d, &d->dtab, &d->dtab_cap, bytes);
	if (!rc && d->dtab != old_tab)
		d->gen++; /* graphs read the old tables: capture again */
	if (!rc)
		rc = md_fwd_dev__upload(d, d->dtab, h, bytes);
	if (rc)
		return rc;
	const int32_t *dv = d->dtab;
	st->pos = dv;
	st->wrow = dv + S;
	st->tab = dv + 2 * S;
	st->out_rows = dv + 3 * S;
	st->hoff = dv + 4 * S;
	st->cs[0] = (const float *)(dv + ni);
	st->cs[1] = two ? st->cs[0] + S * R : st->cs[0];
	st->blocks = dv + ni + nf;
	return 0;
}

/* ---- attention ---- */

/* A per-head grouped product (engine/attn_mla.c per_head): y (H, n, w.n_out) = head h's matrix
 * of t (one per head, tab (H) its device pointers) times x (H, n, w.n_in). */
static int per_head(struct md_fwd_dev *d, const struct md_tensor *t, const void *const *tab,
		    const int32_t *hoff, const float *x, int n, float *y)
{
	const int H = (int)d->m->hp.n_head;
	struct md_mat w = md_mat_of(t, 0);
	struct md_dev_experts e = {
		.type = w.type, .n_in = w.n_in, .n_out = w.n_out, .nb1 = w.nb1, .nw = 1, .ng = H,
		.w = tab, .off = hoff, .src = NULL, .x = x, .n_x = H * n, .y = { y, NULL },
		.n_slots = H * n, .max_rows = n,
	};
	return d->op->mm_experts(d->b, &e);
}

/* Latent attention (engine/attn_mla.h), op for op as engine/attn_mla.c: products, the latent
 * and rope key cached (halves, or floats with kv-cache-type f32), the nope queries absorbed
 * into the latent space per head, scores against the cached rows, the values per head, the
 * output projection; residual. */
static int attention_mla(struct md_fwd_dev *d, const struct md_batch *b,
			 const struct step_tab *st, uint32_t il)
{
	const struct md_backend_fwd *op = d->op;
	struct md_backend *B = d->b;
	const struct md_hparams *hp = &d->m->hp;
	const struct md_layer *L = &d->m->layers[il];
	const int n = b->n_tokens, N = (int)hp->n_embd, H = (int)hp->n_head;
	const int C = (int)hp->kv_lora_rank, R = (int)hp->n_rot, Dn = (int)hp->head_dim_nope;
	const int Dv = (int)hp->head_dim_v, QL = (int)hp->q_lora_rank, QW = Dn + R, W = C + R;
	const float eps = hp->rms_eps;
	const bool neox = hp->rope_type == MD_ROPE_NEOX;
	int rc = op->rmsnorm(B, d->xn, d->x, dptr(d, L->attn_norm), n, N, N, eps);
	struct md_mat wkv = dmat(d, L->wkv_a_mqa, 0);
	if (L->wq_a) {
		struct md_mat wqa = dmat(d, L->wq_a, 0), wqb = dmat(d, L->wq_b, 0);
		if (!rc)
			rc = op->mm(B, &wqa, d->xn, n, d->qa);
		if (!rc)
			rc = op->mm(B, &wkv, d->xn, n, d->kva);
		if (!rc)
			rc = op->rmsnorm(B, d->qa, d->qa, dptr(d, L->q_a_norm), n, QL, QL, eps);
		if (!rc)
			rc = op->mm(B, &wqb, d->qa, n, d->q);
	} else {
		struct md_mat wq = dmat(d, L->wq, 0);
		if (!rc)
			rc = op->mm(B, &wq, d->xn, n, d->q);
		if (!rc)
			rc = op->mm(B, &wkv, d->xn, n, d->kva);
	}
	/* the cache row: the normed latent and the roped key; the roped queries */
	if (!rc)
		rc = op->rmsnorm(B, d->kva, d->kva, dptr(d, L->kv_a_norm), n, C, W, eps);
	if (!rc && R)
		rc = op->rope(B, d->kva + C, n, 1, W, R, neox, st->cs[0]);
	if (!rc && R)
		rc = op->rope(B, d->q + Dn, n, H, QW, R, neox, st->cs[0]);
	void *rows = (char *)d->kc + (size_t)il * d->k_layer * d->kv->k_bytes;
	const bool half = d->kv->k_bytes == 2;
	if (!rc)
		rc = half ? op->rows_store_f16(B, rows, st->wrow, d->kva, n, W)
			  : op->rows_store(B, rows, st->wrow, d->kva, n, W);
	/* the nope queries head-major, absorbed into the latent space */
	const void *const *tab = d->mla_tab + (size_t)il * 2 * H;
	if (!rc)
		rc = op->copy2d(B, d->qn, (size_t)Dn, (size_t)n * Dn, d->q, (size_t)H * QW,
				(size_t)QW, n, H, Dn);
	if (!rc)
		rc = per_head(d, L->wk_b, tab, st->hoff, d->qn, n, d->qabs);
	/* [q_abs, q_pe] token-major, the scores and latent outputs */
	if (!rc)
		rc = op->copy2d(B, d->qcat, (size_t)H * W, (size_t)W, d->qabs, (size_t)C,
				(size_t)n * C, n, H, C);
	if (!rc)
		rc = op->copy2d(B, d->qcat + C, (size_t)H * W, (size_t)W, d->q + Dn, (size_t)H * QW,
				(size_t)QW, n, H, R);
	struct md_dev_mla_attn a = {
		.out = d->olat, .q = d->qcat, .rows = rows, .half = half, .pos = st->pos,
		.tab = st->tab, .blocks = st->blocks, .n_tok = n, .n_head = H, .w = W, .c = C,
		.scale = hp->attn_scale, .max_pos = st->max_pos,
	};
	if (!rc)
		rc = op->attention_mla(B, &a);
	/* values per head, heads interleaved back, the output projection */
	if (!rc)
		rc = per_head(d, L->wv_b, tab + H, st->hoff, d->olat, n, d->ov);
	if (!rc)
		rc = op->copy2d(B, d->matt, (size_t)H * Dv, (size_t)Dv, d->ov, (size_t)Dv,
				(size_t)n * Dv, n, H, Dv);
	struct md_mat wo = dmat(d, L->wo, 0);
	if (!rc)
		rc = op->mm(B, &wo, d->matt, n, d->tmp);
	if (!rc)
		rc = op->add(B, d->x, d->tmp, (size_t)n * N);
	return rc;
}

static int attention(struct md_fwd_dev *d, const struct md_batch *b, const struct step_tab *st,
		     uint32_t il)
{
	if (d->m->hp.kv_lora_rank)
		return attention_mla(d, b, st, il);
	const struct md_backend_fwd *op = d->op;
	struct md_backend *B = d->b;
	const struct md_hparams *hp = &d->m->hp;
	const struct md_layer *L = &d->m->layers[il];
	const int n = b->n_tokens, N = (int)hp->n_embd, H = (int)hp->n_head;
	const int K = (int)hp->n_head_kv, D = (int)hp->head_dim;
	const float eps = hp->rms_eps;
	int rc = op->rmsnorm(B, d->xn, d->x, dptr(d, L->attn_norm), n, N, N, eps);
	struct md_mat wq = dmat(d, L->wq, 0), wk = dmat(d, L->wk, 0), wv = dmat(d, L->wv, 0);
	if (!rc)
		rc = md_fwd_dev__mm3(d, &wq, &wk, &wv, d->xn, n, d->q, d->k, d->v);
	if (!rc && L->bq)
		rc = op->add_rows(B, d->q, dptr(d, L->bq), NULL, n, H * D);
	if (!rc && L->bk)
		rc = op->add_rows(B, d->k, dptr(d, L->bk), NULL, n, K * D);
	if (!rc && L->bv)
		rc = op->add_rows(B, d->v, dptr(d, L->bv), NULL, n, K * D);
	const bool swa = md_layer_is_swa(hp, il);
	const bool neox = hp->rope_type == MD_ROPE_NEOX;
	float *kc = (float *)d->kc + (size_t)il * d->k_layer, *vc = d->vc + (size_t)il * d->v_layer;
	struct md_dev_qkv r = {
		.q = d->q, .k = d->k, .v = d->v, .kc = kc, .vc = vc, .wrow = st->wrow,
		.q_norm = dptr(d, L->q_norm), .k_norm = dptr(d, L->k_norm), .norm = (int)hp->qk_norm,
		.eps = eps, .n = n, .n_head = H, .n_head_kv = K, .head_dim = D,
		.n_rot = (int)hp->n_rot, .neox = neox, .cs = st->cs[swa],
	};
	if (!rc)
		rc = md_fwd_dev__fuse(d, qkv_rows) ? op->qkv_rows(B, &r)
						   : md_dev_qkv_rows_ops(op, B, &r);
	struct md_dev_attn a = {
		.out = d->att, .q = d->q, .k = kc, .v = vc, .pos = st->pos, .tab = st->tab,
		.blocks = st->blocks, .sinks = dptr(d, L->attn_sinks), .n_tok = n, .n_head = H,
		.n_head_kv = K, .head_dim = D, .swa = swa ? (int)hp->n_swa : 0,
		.scale = hp->attn_scale, .max_pos = st->max_pos,
	};
	if (!rc)
		rc = op->attention(B, &a);
	struct md_mat wo = dmat(d, L->wo, 0);
	if (!rc && !L->bo && md_fwd_dev__fuse(d, mm_add))
		return op->mm_add(B, &wo, d->att, n, d->x); /* the residual in the product */
	if (!rc)
		rc = op->mm(B, &wo, d->att, n, d->tmp);
	if (!rc && L->bo)
		rc = op->add_rows(B, d->tmp, dptr(d, L->bo), NULL, n, N);
	if (!rc)
		rc = op->add(B, d->x, d->tmp, (size_t)n * N);
	return rc;
}

void md_fwd_dev_counts(const struct md_fwd_dev *d, uint64_t *fast, uint64_t *host)
{
	*fast = d->n_fast;
	*host = d->n_host;
}

void md_fwd_dev_graphs(const struct md_fwd_dev *d, uint64_t *captures, uint64_t *launches)
{
	*captures = d->n_captures;
	*launches = d->n_graph_launches;
}

/* Enqueue every layer, then the final norm and the logits of the wanted rows (no waiting
 * unless a layer routes on the host). */
static int enqueue_pass(struct md_fwd_dev *d, const struct md_fwd_dev_pass *p,
			struct md_expert_src *src, const struct md_batch *b,
			const struct step_tab *st)
{
	const struct md_model *m = d->m;
	const struct md_hparams *hp = &m->hp;
	const int n = b->n_tokens, N = (int)hp->n_embd;
	int rc = 0;
	for (uint32_t il = 0; il < hp->n_layer && !rc; il++) {
		if (p->draft && p->draft->skip && p->draft->skip[il])
			continue;
		rc = attention(d, b, st, il);
		if (!rc)
			rc = md_fwd_dev__ffn(d, p, src, n, il, b->tok_err);
	}
	if (rc || st->n_out == 0)
		return rc;
	struct md_mat wout = dmat(d, m->output, 0);
	rc = d->op->rows_gather(d->b, d->xn, d->x, st->out_rows, st->n_out, N);
	if (!rc)
		rc = d->op->rmsnorm(d->b, d->xn, d->xn, dptr(d, m->output_norm), st->n_out, N, N,
				    hp->rms_eps);
	if (!rc)
		rc = d->op->mm(d->b, &wout, d->xn, st->n_out, d->dlogits);
	return rc;
}

/* Whether this pass can run as a graph: every layer on the device without a host round trip
 * (dense, or routed on the device: fast_route), a batch the graphs cover, logits for every
 * row (the graph's sizes are those of n alone). */
static bool graph_ok(const struct md_fwd_dev *d, const struct md_fwd_dev_pass *p,
		     const struct md_batch *b, const struct step_tab *st)
{
	const struct md_hparams *hp = &d->m->hp;
	if (d->no_graphs || !d->op->capture_begin || b->n_tokens > FAST_MAX_TOK ||
	    st->n_out != b->n_tokens || p->draft || p->pregate_cb)
		return false;
	if (!hp->n_expert)
		return true;
	if (!d->fast_ok)
		return false;
	for (uint32_t il = 0; il < hp->n_layer; il++)
		if (d->m->layers[il].gate_inp && !md_fwd_dev__fast_route(d, p, b->n_tokens, &d->m->layers[il]))
			return false;
	return true;
}

/* The pass as the graph of its batch size: captured the first time (nothing runs during a
 * capture), launched every time. A capture that fails turns graphs off for good (rc 1: run
 * the pass op by op instead). */
static int run_graph(struct md_fwd_dev *d, const struct md_fwd_dev_pass *p,
		     struct md_expert_src *src, const struct md_batch *b, const struct step_tab *st)
{
	const struct md_hparams *hp = &d->m->hp;
	const int n = b->n_tokens;
	void **g = &d->graph[n];
	if (*g && d->graph_gen[n] != d->gen) {
		d->op->graph_free(d->b, *g);
		*g = NULL;
	}
	if (!*g) {
		int rc = d->op->capture_begin(d->b);
		if (rc) {
			d->no_graphs = true;
			return 1;
		}
		uint64_t fast = d->n_fast;
		rc = enqueue_pass(d, p, src, b, st);
		int rc2 = d->op->capture_end(d->b, g);
		d->n_fast = fast; /* counted below, for the launch */
		if (rc || rc2) {
			d->no_graphs = true;
			*g = NULL;
			md_log(MD_LOG_WARN, "device: graphs off: capturing a pass of %d tokens failed "
			       "(%d, %d); passes run op by op", n, rc, rc2);
			return 1;
		}
		d->graph_gen[n] = d->gen;
		d->n_captures++;
	}
	for (uint32_t il = 0; il < hp->n_layer; il++)
		if (d->m->layers[il].gate_inp) {
			d->fast_layer[il] = 1;
			d->n_fast++;
		}
	d->n_graph_launches++;
	return d->op->graph_launch(d->b, *g);
}

int md_fwd_dev_forward(struct md_fwd_dev *d, const struct md_fwd_dev_pass *p,
		       struct md_kv_cache *kv, const struct md_batch *b, float *logits)
{
	const struct md_model *m = d->m;
	const struct md_hparams *hp = &m->hp;
	const int n = b->n_tokens;
	const int64_t N = hp->n_embd;

	if (kv != d->kv)
		return -EINVAL;
	if (n < 1 || n > d->T)
		return -EINVAL;
	for (int t = 0; t < n; t++)
		if (b->tokens[t] < 0 || (uint32_t)b->tokens[t] >= hp->n_vocab)
			return -EINVAL;
	int rc = md_kv_batch_begin(kv, n, b->seq, b->pos);
	if (rc)
		return rc;
	if (b->tok_err)
		memset(b->tok_err, 0, (size_t)n * sizeof(*b->tok_err));
	struct md_expert_src *src = d->experts_resident || !p->src ? &d->res.base : p->src;
	if (!d->experts_resident && src == &d->res.base && hp->n_expert)
		return -EINVAL; /* experts not uploaded and no source to get them from */

	struct step_tab st;
	rc = step_tables(d, kv, b, &st);
	if (rc)
		return rc;
	/* the logits rows (before any capture: allocation is no stream operation) */
	size_t rows = (size_t)st.n_out > FAST_MAX_TOK ? (size_t)st.n_out : FAST_MAX_TOK;
	if ((size_t)st.n_out > d->dlogits_rows || !d->dlogits) {
		d->b->free(d->b, d->dlogits);
		d->dlogits = NULL;
		d->dlogits_rows = 0;
		rc = d->b->alloc(d->b, rows * hp->n_vocab * sizeof(float), (void **)&d->dlogits);
		if (rc)
			return rc;
		d->dlogits_rows = rows;
		d->gen++;
	}
	float *xh = md_fwd_dev__stage(d, (size_t)n * N * sizeof(float));
	if (!xh)
		return -ENOMEM;
	for (int t = 0; t < n; t++)
		md_dequant_row(m->tok_embd->type,
			       (const uint8_t *)m->tok_embd->data + (size_t)b->tokens[t] * m->tok_embd->nb1,
			       xh + (size_t)t * N, N);
	rc = md_fwd_dev__upload(d, d->x, xh, (size_t)n * N * sizeof(float));
	if (d->fast_layer)
		memset(d->fast_layer, 0, hp->n_layer);
	bool graphed = false;
	if (!rc && graph_ok(d, p, b, &st)) {
		rc = run_graph(d, p, src, b, &st);
		graphed = rc == 0;
		if (rc == 1) { /* capture refused: op by op */
			rc = 0;
			if (d->fast_layer)
				memset(d->fast_layer, 0, hp->n_layer);
		}
	}
	if (!rc && !graphed)
		rc = enqueue_pass(d, p, src, b, &st);
	if (!rc && d->fast_layer)
		rc = md_fwd_dev__observe_fast(d, p, n);
	if (rc)
		return rc;

	/* Every layer's rows are written: commit (engine/forward.c). */
	for (int t = 0; t < n; t++) {
		rc = md_kv_commit(kv, b->seq[t], (uint32_t)b->pos[t] + 1);
		MD_ASSERT(rc == 0);
	}
	const int n_out = st.n_out;
	if (n_out == 0)
		return 0;
	rc = md_fwd_dev__download(d, logits, d->dlogits, (size_t)n_out * hp->n_vocab * sizeof(float));
	return rc ? rc : n_out;
}
