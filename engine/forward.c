/* The batched forward pass: a micro-batch of tokens from many sequences at their positions.
 *
 * Per layer: RMSNorm -> Q/K/V projections for all tokens -> QK-norm and RoPE -> K/V written to
 * the rows the paged cache hands out (md_kv_batch_begin validated the batch first) -> causal attention per (token, head) -> output projection -> RMSNorm ->
 * router -> experts in expert-major order (each active expert's weights read once for all the
 * tokens routed to it) -> weighted scatter-add. Logits only for the rows the caller asks for. */
#include "engine/forward.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/assert.h"
#include "engine/kern/cpu.h"
#include "engine/kern/matmul.h"
#include "engine/kern/threadpool.h"

struct md_forward_ctx {
	const struct md_model *m; /* borrowed: outlives the context */
	struct md_pool *pool;     /* owned */
	int max_tokens;
	float *x;     /* (T, N) residual stream */
	float *xn;    /* (T, N) normed input of the current sub-layer */
	float *q;     /* (T, H*D) */
	float *k;     /* (T, K*D) */
	float *v;     /* (T, K*D) */
	float *att;   /* (T, H*D) attention output before Wo */
	float *tmp;   /* (T, N) sub-layer output */
	float *rw;    /* (T, E) router probabilities */
	int32_t *sel; /* (T, k) chosen experts */
	float *selw;  /* (T, k) their weights */
	int32_t *cnt; /* (E + 1) tokens per expert, then offsets */
	int32_t *lst; /* (T * k) token index per routing, expert-major */
	float *lstw;  /* (T * k) routing weight, expert-major */
	float *xe;    /* (T, N) gathered inputs of one expert */
	float *ge;    /* (T, Fmax) gate activations */
	float *ue;    /* (T, Fmax) up activations */
	float *ye;    /* (T, N) expert outputs */
	float *mm_scratch; /* per-thread dequantized rows */
	void *ex_scratch;  /* quantized expert inputs (md_matmul_experts) */
	struct md_mat *ex_w; /* (3 * E) gate, up of the active experts, then their down */
	int32_t *ex_off;     /* (E + 1) slot offsets of the active experts */
	float *att_scratch; /* per-thread attention scores (att_cap each) */
	size_t att_cap;
	float *rope_cs; /* (n_rot) cos, sin pairs of the current token's position (rope_table) */
};

static void *xalloc(size_t n, int *fail)
{
	void *p = malloc(n ? n : 1);
	if (!p)
		*fail = 1;
	return p;
}

void md_forward_free(struct md_forward_ctx *f)
{
	if (!f)
		return;
	md_pool_free(f->pool);
	free(f->x);
	free(f->xn);
	free(f->q);
	free(f->k);
	free(f->v);
	free(f->att);
	free(f->tmp);
	free(f->rw);
	free(f->sel);
	free(f->selw);
	free(f->cnt);
	free(f->lst);
	free(f->lstw);
	free(f->xe);
	free(f->ge);
	free(f->ue);
	free(f->ye);
	free(f->mm_scratch);
	free(f->ex_scratch);
	free(f->ex_w);
	free(f->ex_off);
	free(f->att_scratch);
	free(f->rope_cs);
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
	f->pool = md_pool_new(n_threads);
	if (!f->pool) {
		free(f);
		return NULL;
	}
	size_t T = (size_t)max_tokens, N = hp->n_embd, QD = (size_t)hp->n_head * hp->head_dim;
	size_t KD = (size_t)hp->n_head_kv * hp->head_dim;
	size_t E = hp->n_expert ? hp->n_expert : 1, K = hp->n_expert_used ? hp->n_expert_used : 1;
	size_t F = hp->n_ff_exp;
	if (hp->n_ff_shexp > F)
		F = hp->n_ff_shexp;
	if (!hp->n_expert && hp->n_ff > F)
		F = hp->n_ff;
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
	f->rw = xalloc(T * E * sizeof(float), &fail);
	f->sel = xalloc(T * K * sizeof(int32_t), &fail);
	f->selw = xalloc(T * K * sizeof(float), &fail);
	f->cnt = xalloc((E + 1) * sizeof(int32_t), &fail);
	f->lst = xalloc(T * K * sizeof(int32_t), &fail);
	f->lstw = xalloc(T * K * sizeof(float), &fail);
	f->xe = xalloc(T * N * sizeof(float), &fail);
	/* Expert buffers hold one row per routing (T * K), the shared expert's one per token. */
	f->ge = xalloc(T * K * F * sizeof(float), &fail);
	f->ue = xalloc(T * K * F * sizeof(float), &fail);
	f->ye = xalloc(T * K * N * sizeof(float), &fail);
	if (hp->n_expert) {
		size_t in_ex = N > F ? N : F;
		f->ex_scratch = xalloc(md_matmul_experts_scratch_bytes((int64_t)in_ex, (int)T, (int)(T * K)), &fail);
		f->ex_w = xalloc(3 * E * sizeof(struct md_mat), &fail);
		f->ex_off = xalloc((E + 1) * sizeof(int32_t), &fail);
	}
	f->mm_scratch = xalloc(md_matmul_scratch_floats(f->pool, (int64_t)in_max, max_tokens) * sizeof(float), &fail);
	f->rope_cs = xalloc((size_t)hp->n_rot * sizeof(float), &fail);
	if (fail) {
		md_forward_free(f);
		return NULL;
	}
	return f;
}

static void rmsnorm(float *out, const float *in, const float *w, int64_t n, float eps)
{
	const struct md_kern *kn = md_kern_active();
	if (kn) {
		float s = (float)(1.0 / sqrt((double)kn->sumsq_f32(in, n) / (double)n + eps));
		kn->scale_mul_f32(out, in, s, w, n);
		return;
	}
	double ss = 0;
	for (int64_t i = 0; i < n; i++)
		ss += (double)in[i] * in[i];
	float s = (float)(1.0 / sqrt(ss / (double)n + eps));
	for (int64_t i = 0; i < n; i++)
		out[i] = in[i] * s * w[i];
}

static inline float silu(float x)
{
	return x / (1.0f + expf(-x));
}

/* cos/sin of every rotary pair for position pos: cs[2i] = cos, cs[2i+1] = sin. Computed once
 * per token and shared by all its heads (the angles depend only on the position). */
static void rope_table(float *cs, const struct md_hparams *hp, int32_t pos)
{
	const int half = (int)hp->n_rot / 2;
	for (int i = 0; i < half; i++) {
		double theta = (double)pos * pow((double)hp->rope_freq_base, -2.0 * i / (double)hp->n_rot);
		cs[2 * i] = (float)cos(theta);
		cs[2 * i + 1] = (float)sin(theta);
	}
}

/* Rotate the pairs of one head in place with the table of its position. */
static void rope_head(float *h, const struct md_hparams *hp, const float *cs)
{
	const int half = (int)hp->n_rot / 2;
	if (hp->rope_type == MD_ROPE_NEOX) {
		for (int i = 0; i < half; i++) {
			float c = cs[2 * i], s = cs[2 * i + 1];
			float x0 = h[i], x1 = h[i + half];
			h[i] = x0 * c - x1 * s;
			h[i + half] = x0 * s + x1 * c;
		}
	} else {
		for (int i = 0; i < half; i++) {
			float c = cs[2 * i], s = cs[2 * i + 1];
			float x0 = h[2 * i], x1 = h[2 * i + 1];
			h[2 * i] = x0 * c - x1 * s;
			h[2 * i + 1] = x0 * s + x1 * c;
		}
	}
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
	const float scale = 1.0f / sqrtf((float)D);
	const struct md_kern *kn = md_kern_active(); /* NULL: portable loops */
	float *sc = f->att_scratch + f->att_cap * (size_t)ith;
	int total = j->b->n_tokens * H;
	int per = (total + nth - 1) / nth;
	int i0 = per * ith, i1 = i0 + per < total ? i0 + per : total;
	for (int i = i0; i < i1; i++) {
		int t = i / H, h = i % H, kvh = h / group;
		int seq = j->b->seq[t], pos = j->b->pos[t];
		const float *q = f->q + ((size_t)t * H + h) * D;
		float mx = -INFINITY;
		for (int p = 0; p <= pos; p++) {
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
		double sum = 0;
		for (int p = 0; p <= pos; p++) {
			sc[p] = expf(sc[p] - mx);
			sum += sc[p];
		}
		float inv = (float)(1.0 / sum);
		float *o = f->att + ((size_t)t * H + h) * D;
		memset(o, 0, (size_t)D * sizeof(float));
		for (int p = 0; p <= pos; p++) {
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
		rmsnorm(f->xn + (size_t)t * N, f->x + (size_t)t * N, L->attn_norm->data, N, eps);

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
			rmsnorm(q, q, L->q_norm->data, H * D, eps);
			rmsnorm(k, k, L->k_norm->data, K * D, eps);
		} else if (hp->qk_norm == MD_QK_NORM_HEAD) {
			for (int64_t h = 0; h < H; h++)
				rmsnorm(q + h * D, q + h * D, L->q_norm->data, D, eps);
			for (int64_t h = 0; h < K; h++)
				rmsnorm(k + h * D, k + h * D, L->k_norm->data, D, eps);
		}
		if (t == 0 || b->pos[t] != b->pos[t - 1])
			rope_table(f->rope_cs, hp, b->pos[t]);
		for (int64_t h = 0; h < H; h++)
			rope_head(q + h * D, hp, f->rope_cs);
		for (int64_t h = 0; h < K; h++)
			rope_head(k + h * D, hp, f->rope_cs);
		float *kr, *vr;
		md_kv_write_rows(kv, il, b->seq[t], (uint32_t)b->pos[t], &kr, &vr);
		memcpy(kr, k, (size_t)(K * D) * sizeof(float));
		memcpy(vr, f->v + (size_t)t * K * D, (size_t)(K * D) * sizeof(float));
	}

	struct att_job aj = { f, kv, b, il };
	md_pool_run(f->pool, att_worker, &aj);

	struct md_mat wo = md_mat_of(L->wo, 0);
	md_matmul(f->pool, &wo, f->att, n, f->tmp, f->mm_scratch);
	for (size_t i = 0; i < (size_t)n * N; i++)
		f->x[i] += f->tmp[i];
}

/* out (n, N) = Wdown(silu(Wgate x) * (Wup x)) for x (n, N). */
static void swiglu(struct md_forward_ctx *f, const struct md_mat *gate, const struct md_mat *up,
		   const struct md_mat *down, const float *x, int n, float *out)
{
	const struct md_mat wgu[2] = { *gate, *up };
	float *const ygu[2] = { f->ge, f->ue };
	md_matmul_multi(f->pool, wgu, 2, x, n, ygu, f->mm_scratch);
	size_t m = (size_t)n * gate->n_out;
	for (size_t i = 0; i < m; i++)
		f->ge[i] = silu(f->ge[i]) * f->ue[i];
	md_matmul(f->pool, down, f->ge, n, out, f->mm_scratch);
}

struct glu_job {
	float *g;        /* (rows, F) gate in, silu(gate) * up out */
	const float *u;  /* (rows, F) */
	size_t rows, F;
};

static void glu_worker(void *ctx, int ith, int nth)
{
	struct glu_job *j = ctx;
	size_t per = (j->rows + (size_t)nth - 1) / (size_t)nth;
	size_t a = per * (size_t)ith < j->rows ? per * (size_t)ith : j->rows;
	size_t z = a + per < j->rows ? a + per : j->rows;
	for (size_t i = a * j->F; i < z * j->F; i++)
		j->g[i] = silu(j->g[i]) * j->u[i];
}

/* Step 3 of moe() for every active expert at once: one pool pass for all gate/up rows (the
 * normed input quantized once for the layer), one for silu * up, one for all down rows. Fills
 * f->ye in slot order. Returns false (nothing done) where the kernels can't take the
 * weights; the per-expert loop runs then. */
static bool moe_grouped(struct md_forward_ctx *f, int n, uint32_t il)
{
	const struct md_hparams *hp = &f->m->hp;
	const struct md_layer *L = &f->m->layers[il];
	const int E = (int)hp->n_expert;
	if (!f->ex_w)
		return false;
	struct md_mat gu[2] = { md_mat_of(L->gate_exps, 0), md_mat_of(L->up_exps, 0) };
	struct md_mat d = md_mat_of(L->down_exps, 0);
	if (!md_matmul_experts_ok(gu, 2) || !md_matmul_experts_ok(&d, 1))
		return false;
	int na = 0;
	struct md_mat *wgu = f->ex_w, *wd = f->ex_w + 2 * E;
	for (int e = 0; e < E; e++) {
		if (f->cnt[e] == f->cnt[e + 1])
			continue;
		wgu[2 * na] = md_mat_of(L->gate_exps, e);
		wgu[2 * na + 1] = md_mat_of(L->up_exps, e);
		wd[na] = md_mat_of(L->down_exps, e);
		f->ex_off[na] = f->cnt[e];
		na++;
	}
	f->ex_off[na] = f->cnt[E];
	const int rows = f->cnt[E];
	float *const ygu[2] = { f->ge, f->ue };
	md_matmul_experts(f->pool, wgu, 2, na, f->ex_off, f->xn, n, f->lst, ygu, f->ex_scratch);
	struct glu_job gj = { f->ge, f->ue, (size_t)rows, (size_t)gu[0].n_out };
	if (rows >= 16)
		md_pool_run(f->pool, glu_worker, &gj);
	else
		glu_worker(&gj, 0, 1);
	float *const yd[1] = { f->ye };
	md_matmul_experts(f->pool, wd, 1, na, f->ex_off, f->ge, rows, NULL, yd, f->ex_scratch);
	return true;
}

static void moe(struct md_forward_ctx *f, int n, uint32_t il)
{
	const struct md_hparams *hp = &f->m->hp;
	const struct md_layer *L = &f->m->layers[il];
	const int64_t N = hp->n_embd;
	const int E = (int)hp->n_expert, K = (int)hp->n_expert_used;

	/* 1. Route: softmax over all experts, top-k, optional renormalisation. */
	struct md_mat wr = md_mat_of(L->gate_inp, 0);
	md_matmul(f->pool, &wr, f->xn, n, f->rw, f->mm_scratch);
	memset(f->cnt, 0, (size_t)(E + 1) * sizeof(int32_t));
	for (int t = 0; t < n; t++) {
		float *p = f->rw + (size_t)t * E;
		float mx = p[0];
		for (int e = 1; e < E; e++)
			mx = p[e] > mx ? p[e] : mx;
		double sum = 0;
		for (int e = 0; e < E; e++) {
			p[e] = expf(p[e] - mx);
			sum += p[e];
		}
		for (int e = 0; e < E; e++)
			p[e] = (float)(p[e] / sum);
		double wsum = 0;
		for (int k = 0; k < K; k++) {
			int best = -1;
			for (int e = 0; e < E; e++) {
				bool taken = false;
				for (int kk = 0; kk < k; kk++)
					taken |= f->sel[(size_t)t * K + kk] == e;
				if (!taken && (best < 0 || p[e] > p[best]))
					best = e;
			}
			f->sel[(size_t)t * K + k] = best;
			f->selw[(size_t)t * K + k] = p[best];
			wsum += p[best];
			f->cnt[best]++;
		}
		if (hp->norm_topk)
			for (int k = 0; k < K; k++)
				f->selw[(size_t)t * K + k] = (float)(f->selw[(size_t)t * K + k] / wsum);
	}

	/* 2. Group routings expert-major: cnt becomes offsets. */
	int32_t off = 0;
	for (int e = 0; e < E; e++) {
		int32_t c = f->cnt[e];
		f->cnt[e] = off;
		off += c;
	}
	f->cnt[E] = off;
	for (int t = 0; t < n; t++) {
		for (int k = 0; k < K; k++) {
			int e = f->sel[(size_t)t * K + k];
			int32_t slot = f->cnt[e]++;
			f->lst[slot] = t;
			f->lstw[slot] = f->selw[(size_t)t * K + k];
		}
	}
	for (int e = E; e > 0; e--)
		f->cnt[e] = f->cnt[e - 1];
	f->cnt[0] = 0;

	/* 3. Run each active expert once over all its tokens; 4. scatter-add (in expert order,
	 * the same sums whichever path computed the experts). */
	memset(f->tmp, 0, (size_t)n * N * sizeof(float));
	if (!moe_grouped(f, n, il)) {
		for (int e = 0; e < E; e++) {
			int32_t a = f->cnt[e], z = f->cnt[e + 1];
			if (a == z)
				continue;
			int m = z - a;
			for (int i = 0; i < m; i++)
				memcpy(f->xe + (size_t)i * N, f->xn + (size_t)f->lst[a + i] * N,
				       (size_t)N * sizeof(float));
			struct md_mat g = md_mat_of(L->gate_exps, e), u = md_mat_of(L->up_exps, e);
			struct md_mat d = md_mat_of(L->down_exps, e);
			swiglu(f, &g, &u, &d, f->xe, m, f->ye + (size_t)a * N);
		}
	}
	for (int s = 0; s < f->cnt[E]; s++) {
		float w = f->lstw[s];
		float *dst = f->tmp + (size_t)f->lst[s] * N;
		const float *src = f->ye + (size_t)s * N;
		for (int64_t j = 0; j < N; j++)
			dst[j] += w * src[j];
	}

	/* Qwen2-MoE shared expert with its sigmoid gate. */
	if (L->gate_shexp) {
		struct md_mat g = md_mat_of(L->gate_shexp, 0), u = md_mat_of(L->up_shexp, 0);
		struct md_mat d = md_mat_of(L->down_shexp, 0);
		swiglu(f, &g, &u, &d, f->xn, n, f->ye);
		const float *gw = L->gate_inp_shexp->data;
		for (int t = 0; t < n; t++) {
			const float *xr = f->xn + (size_t)t * N;
			double s = 0;
			for (int64_t j = 0; j < N; j++)
				s += (double)gw[j] * xr[j];
			float gate = (float)(1.0 / (1.0 + exp(-s)));
			float *dst = f->tmp + (size_t)t * N;
			const float *src = f->ye + (size_t)t * N;
			for (int64_t j = 0; j < N; j++)
				dst[j] += gate * src[j];
		}
	}
}

static void ffn(struct md_forward_ctx *f, int n, uint32_t il)
{
	const struct md_hparams *hp = &f->m->hp;
	const struct md_layer *L = &f->m->layers[il];
	const int64_t N = hp->n_embd;
	for (int t = 0; t < n; t++)
		rmsnorm(f->xn + (size_t)t * N, f->x + (size_t)t * N, L->ffn_norm->data, N, hp->rms_eps);
	if (hp->n_expert) {
		moe(f, n, il);
	} else {
		struct md_mat g = md_mat_of(L->ffn_gate, 0), u = md_mat_of(L->ffn_up, 0);
		struct md_mat d = md_mat_of(L->ffn_down, 0);
		swiglu(f, &g, &u, &d, f->xn, n, f->tmp);
	}
	for (size_t i = 0; i < (size_t)n * N; i++)
		f->x[i] += f->tmp[i];
}

int md_forward(struct md_forward_ctx *f, struct md_kv_cache *kv, const struct md_batch *b,
	       float *logits)
{
	const struct md_model *m = f->m;
	const struct md_hparams *hp = &m->hp;
	const int n = b->n_tokens;
	const int64_t N = hp->n_embd;

	/* The batch's own checks, then the cache's (sequences, positions, reservations). */
	if (n < 1 || n > f->max_tokens)
		return -EINVAL;
	for (int t = 0; t < n; t++)
		if (b->tokens[t] < 0 || (uint32_t)b->tokens[t] >= hp->n_vocab)
			return -EINVAL;
	int rc = md_kv_batch_begin(kv, n, b->seq, b->pos);
	if (rc)
		return rc;

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
		attention(f, kv, b, il);
		ffn(f, n, il);
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
			rmsnorm(f->xn + (size_t)n_out * N, f->x + (size_t)t * N, m->output_norm->data, N, hp->rms_eps);
			n_out++;
		}
	}
	struct md_mat wout = md_mat_of(m->output, 0);
	md_matmul(f->pool, &wout, f->xn, n_out, logits, f->mm_scratch);
	return n_out;
}
