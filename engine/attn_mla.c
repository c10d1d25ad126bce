/* Multi-head latent attention: the compressed cache and attention in the latent space.
 *
 * Steps for a batch of n tokens (shapes: N = n_embd, H heads, C = kv_lora_rank, R = n_rot,
 * Dn / Dv = a head's nope key / value width, QL = q_lora_rank):
 *   1. q (n, H * (Dn + R)) = W_q_b RMSNorm(W_q_a xn), or W_q xn without q_lora_rank;
 *      kva (n, C + R) = W_kv_a_mqa xn (one pass over the pool for the products of xn).
 *   2. Per token: c = RMSNorm(kva[0, C)), k_pe = rope(kva[C, C + R)); the cache row [c, k_pe]
 *      is written in half (IEEE binary16, as llama.cpp's F16 cache holds it; float with
 *      the engine's kv_f32); every head's
 *      q_pe = rope(q_h[Dn, Dn + R)); q_h[0, Dn) is gathered head-major into qn (H, n, Dn).
 *   3. qabs (H, n, C) = W_k_b,h qn_h for every head (the heads are groups of one grouped
 *      product, as the experts of a MoE layer are).
 *   4. qcat (n, H, C + R) = [qabs, q_pe]; per (token, head) the scores scale * qcat . row(p)
 *      for every cached p <= pos, softmax, olat (H, n, C) = sum_p w_p c_p.
 *   5. ov (H, n, Dv) = W_v_b,h olat_h; att (n, H * Dv) interleaves the heads back;
 *      out = W_o att.
 * The scale is hp.attn_scale (1/sqrt(Dn + R), times YaRN's mscale^2 where the file scales
 * rope). */
#include "engine/attn_mla.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/assert.h"
#include "engine/kern/cpu.h"
#include "engine/kern/matmul.h"
#include "engine/rope.h"

struct md_mla {
	const struct md_model *m; /* borrowed: outlives the context */
	int max_tokens;
	struct md_rope rope;
	float *qa;    /* (T, QL) */
	float *q;     /* (T, H * (Dn + R)) */
	float *kva;   /* (T, C + R) */
	float *qn;    /* (H, T, Dn) nope queries, head-major */
	float *qabs;  /* (H, T, C) absorbed queries */
	float *qcat;  /* (T, H, C + R) */
	float *olat;  /* (H, T, C) latent outputs */
	float *ov;    /* (H, T, Dv) value outputs */
	float *att;   /* (T, H * Dv) */
	float *cs;    /* (R) rope table of the current token */
	int32_t *off; /* (H + 1) head h's rows of qn / olat: off[h] .. off[h+1]-1 */
	struct md_mat *wk, *wv; /* (H) head views of the current layer's W_k_b, W_v_b */
	float *mm_scratch;      /* md_matmul's */
	void *ex_scratch;       /* md_matmul_experts' */
};

static void *xalloc(size_t n, int *fail)
{
	void *p = malloc(n ? n : 1);
	if (!p)
		*fail = 1;
	return p;
}

void md_mla_free(struct md_mla *a)
{
	if (!a)
		return;
	free(a->qa);
	free(a->q);
	free(a->kva);
	free(a->qn);
	free(a->qabs);
	free(a->qcat);
	free(a->olat);
	free(a->ov);
	free(a->att);
	free(a->cs);
	free(a->off);
	free(a->wk);
	free(a->wv);
	free(a->mm_scratch);
	free(a->ex_scratch);
	free(a);
}

struct md_mla *md_mla_new(const struct md_model *m, const struct md_pool *pool, int max_tokens)
{
	const struct md_hparams *hp = &m->hp;
	if (max_tokens < 1 || hp->kv_lora_rank == 0)
		return NULL;
	struct md_mla *a = calloc(1, sizeof(*a));
	if (!a)
		return NULL;
	a->m = m;
	a->max_tokens = max_tokens;
	md_rope_init(&a->rope, hp, false);
	const size_t T = (size_t)max_tokens, H = hp->n_head, C = hp->kv_lora_rank, R = hp->n_rot;
	const size_t Dn = hp->head_dim_nope, Dv = hp->head_dim_v, QL = hp->q_lora_rank;
	size_t in_max = hp->n_embd;
	const size_t ins[] = { QL, Dn, C, H * Dv };
	for (size_t i = 0; i < sizeof(ins) / sizeof(ins[0]); i++)
		in_max = ins[i] > in_max ? ins[i] : in_max;
	int fail = 0;
	a->qa = xalloc(T * (QL ? QL : 1) * sizeof(float), &fail);
	a->q = xalloc(T * H * (Dn + R) * sizeof(float), &fail);
	a->kva = xalloc(T * (C + R) * sizeof(float), &fail);
	a->qn = xalloc(H * T * Dn * sizeof(float), &fail);
	a->qabs = xalloc(H * T * C * sizeof(float), &fail);
	a->qcat = xalloc(T * H * (C + R) * sizeof(float), &fail);
	a->olat = xalloc(H * T * C * sizeof(float), &fail);
	a->ov = xalloc(H * T * Dv * sizeof(float), &fail);
	a->att = xalloc(T * H * Dv * sizeof(float), &fail);
	a->cs = xalloc(R * sizeof(float), &fail);
	a->off = xalloc((H + 1) * sizeof(int32_t), &fail);
	a->wk = xalloc(H * sizeof(struct md_mat), &fail);
	a->wv = xalloc(H * sizeof(struct md_mat), &fail);
	a->mm_scratch = xalloc(md_matmul_scratch_floats(pool, (int64_t)in_max, max_tokens) *
			       sizeof(float), &fail);
	size_t in_ex = Dn > C ? Dn : C;
	a->ex_scratch = xalloc(md_matmul_experts_scratch_bytes((int64_t)in_ex, (int)(H * T),
							       (int)(H * T)), &fail);
	if (fail) {
		md_mla_free(a);
		return NULL;
	}
	return a;
}

/* y (H, n, n_out) = w[h] x_h for x (H, n, n_in), every head one group of a grouped product
 * (one pass over the pool), or head by head where the kernels can't group the weights. */
static void per_head(struct md_mla *a, struct md_pool *pool, const struct md_mat *w, int H, int n,
		     const float *x, float *y)
{
	if (md_matmul_experts_ok(w, 1)) {
		for (int h = 0; h <= H; h++)
			a->off[h] = h * n;
		float *const ys[1] = { y };
		md_matmul_experts(pool, w, 1, H, a->off, x, H * n, NULL, ys, a->ex_scratch);
		return;
	}
	for (int h = 0; h < H; h++)
		md_matmul(pool, &w[h], x + (size_t)h * n * w[h].n_in, n, y + (size_t)h * n * w[h].n_out,
			  a->mm_scratch);
}

struct score_job {
	struct md_mla *a;
	struct md_kv_cache *kv;
	const struct md_batch *b;
	uint32_t layer;
	float *scores;
	size_t cap;
};

/* q . the first n elements of the cached row (l, seq, p), float or half rows; kn NULL: the
 * portable loop. */
static float row_dot(const struct md_kern *kn, const struct md_kv_cache *kv, uint32_t l, int seq,
		     uint32_t p, const float *q, int n)
{
	float s = 0;
	if (kv->k_bytes == 2) {
		const uint16_t *r = md_kv_k16(kv, l, seq, p);
		if (kn)
			return kn->dot_f32_f16(q, r, n);
		for (int d = 0; d < n; d++)
			s += q[d] * md_f16_to_f32(r[d]);
		return s;
	}
	const float *r = md_kv_k(kv, l, seq, p);
	if (kn)
		return kn->dot_f32(q, r, n);
	for (int d = 0; d < n; d++)
		s += q[d] * r[d];
	return s;
}

/* o += w * the first n elements of the cached row (l, seq, p). */
static void row_axpy(const struct md_kern *kn, const struct md_kv_cache *kv, uint32_t l, int seq,
		     uint32_t p, float w, float *o, int n)
{
	if (kv->k_bytes == 2) {
		const uint16_t *r = md_kv_k16(kv, l, seq, p);
		if (kn) {
			kn->axpy_f16(o, w, r, n);
			return;
		}
		for (int d = 0; d < n; d++)
			o[d] += w * md_f16_to_f32(r[d]);
		return;
	}
	const float *r = md_kv_k(kv, l, seq, p);
	if (kn) {
		kn->axpy_f32(o, w, r, n);
		return;
	}
	for (int d = 0; d < n; d++)
		o[d] += w * r[d];
}

/* Step 4 for the (token, head) items of thread ith. */
static void score_worker(void *ctx, int ith, int nth)
{
	struct score_job *j = ctx;
	struct md_mla *a = j->a;
	const struct md_hparams *hp = &a->m->hp;
	const int H = (int)hp->n_head, C = (int)hp->kv_lora_rank, W = C + (int)hp->n_rot;
	const int n = j->b->n_tokens;
	const float scale = hp->attn_scale;
	const struct md_kern *kn = md_kern_active(); /* NULL: portable loops */
	float *sc = j->scores + j->cap * (size_t)ith;
	int total = n * H;
	int per = (total + nth - 1) / nth;
	int i0 = per * ith, i1 = i0 + per < total ? i0 + per : total;
	for (int i = i0; i < i1; i++) {
		int t = i / H, h = i % H;
		int seq = j->b->seq[t], pos = j->b->pos[t];
		const float *q = a->qcat + ((size_t)t * H + h) * W;
		float mx = -INFINITY;
		for (int p = 0; p <= pos; p++) {
			float s = row_dot(kn, j->kv, j->layer, seq, (uint32_t)p, q, W) * scale;
			sc[p] = s;
			if (s > mx)
				mx = s;
		}
		double sum = 0;
		for (int p = 0; p <= pos; p++) {
			sc[p] = expf(sc[p] - mx);
			sum += sc[p];
		}
		float inv = (float)(1.0 / sum);
		float *o = a->olat + ((size_t)h * n + t) * C;
		memset(o, 0, (size_t)C * sizeof(float));
		for (int p = 0; p <= pos; p++) {
			row_axpy(kn, j->kv, j->layer, seq, (uint32_t)p, sc[p] * inv, o, C);
		}
	}
}

void md_mla_attention(struct md_mla *a, struct md_pool *pool, struct md_kv_cache *kv,
		      const struct md_batch *b, uint32_t il, const float *xn, float *out,
		      float *scores, size_t cap)
{
	const struct md_hparams *hp = &a->m->hp;
	const struct md_layer *L = &a->m->layers[il];
	const int n = b->n_tokens, H = (int)hp->n_head;
	const int64_t C = hp->kv_lora_rank, R = hp->n_rot, Dn = hp->head_dim_nope, Dv = hp->head_dim_v;
	const int64_t QW = Dn + R; /* a head's query width */
	const float eps = hp->rms_eps;
	MD_ASSERT(n <= a->max_tokens && kv->kv_dim == (uint32_t)(C + R) && kv->v_dim == 0);

	/* 1. The products of xn. */
	struct md_mat wkv = md_mat_of(L->wkv_a_mqa, 0);
	if (L->wq_a) {
		struct md_mat wqa = md_mat_of(L->wq_a, 0), wqb = md_mat_of(L->wq_b, 0);
		const struct md_mat w2[2] = { wqa, wkv };
		float *const y2[2] = { a->qa, a->kva };
		md_matmul_multi(pool, w2, 2, xn, n, y2, a->mm_scratch);
		const int64_t QL = hp->q_lora_rank;
		for (int t = 0; t < n; t++)
			md_rmsnorm(a->qa + (size_t)t * QL, a->qa + (size_t)t * QL, L->q_a_norm->data, QL, eps);
		md_matmul(pool, &wqb, a->qa, n, a->q, a->mm_scratch);
	} else {
		struct md_mat wq = md_mat_of(L->wq, 0);
		const struct md_mat w2[2] = { wq, wkv };
		float *const y2[2] = { a->q, a->kva };
		md_matmul_multi(pool, w2, 2, xn, n, y2, a->mm_scratch);
	}

	/* 2. Cache rows, roped queries, the nope queries head-major. */
	for (int t = 0; t < n; t++) {
		float *kva = a->kva + (size_t)t * (C + R), *q = a->q + (size_t)t * H * QW;
		if (t == 0 || b->pos[t] != b->pos[t - 1])
			md_rope_table(&a->rope, b->pos[t], a->cs);
		md_rmsnorm(kva, kva, L->kv_a_norm->data, C, eps);
		md_rope_apply(&a->rope, a->cs, kva + C);
		if (kv->k_bytes == 2) {
			uint16_t *kr = md_kv_write_k16(kv, il, b->seq[t], (uint32_t)b->pos[t]);
			for (int64_t d = 0; d < C + R; d++)
				kr[d] = md_f32_to_f16(kva[d]);
		} else {
			float *kr, *vr;
			md_kv_write_rows(kv, il, b->seq[t], (uint32_t)b->pos[t], &kr, &vr);
			memcpy(kr, kva, (size_t)(C + R) * sizeof(float));
		}
		for (int h = 0; h < H; h++) {
			float *qh = q + (size_t)h * QW;
			md_rope_apply(&a->rope, a->cs, qh + Dn);
			memcpy(a->qn + ((size_t)h * n + t) * Dn, qh, (size_t)Dn * sizeof(float));
		}
	}

	/* 3. Absorb the nope queries into the latent space. */
	for (int h = 0; h < H; h++) {
		a->wk[h] = md_mat_of(L->wk_b, h);
		a->wv[h] = md_mat_of(L->wv_b, h);
	}
	per_head(a, pool, a->wk, H, n, a->qn, a->qabs);

	/* 4. Scores against the cached rows, latent outputs. */
	for (int t = 0; t < n; t++)
		for (int h = 0; h < H; h++) {
			float *dst = a->qcat + ((size_t)t * H + h) * (C + R);
			memcpy(dst, a->qabs + ((size_t)h * n + t) * C, (size_t)C * sizeof(float));
			memcpy(dst + C, a->q + ((size_t)t * H + h) * QW + Dn, (size_t)R * sizeof(float));
		}
	struct score_job sj = { a, kv, b, il, scores, cap };
	md_pool_run(pool, score_worker, &sj);

	/* 5. Values, heads interleaved back, output projection. */
	per_head(a, pool, a->wv, H, n, a->olat, a->ov);
	for (int t = 0; t < n; t++)
		for (int h = 0; h < H; h++)
			memcpy(a->att + ((size_t)t * H + h) * Dv, a->ov + ((size_t)h * n + t) * Dv,
			       (size_t)Dv * sizeof(float));
	struct md_mat wo = md_mat_of(L->wo, 0);
	md_matmul(pool, &wo, a->att, n, out, a->mm_scratch);
}
