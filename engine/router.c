/* MoE routing: per-token expert selection from router logits, then expert-major grouping.
 *
 * DESIGN. Selection is a table of functions indexed by enum md_route_fn, picked once from the
 * hyper-parameters, so a new gating scheme is one row and one function, not a branch inside
 * the forward pass. Grouping is shared by all of them: a counting sort of the (token, expert)
 * pairs by expert, stable in token order, so each expert's slots list its tokens ascending and
 * the scatter-add that follows sums in a fixed order (greedy output does not depend on which
 * path computed the experts). */
#include "engine/router.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Select k experts for one token: p (E) logits in, scores out; ids, w (k) out. */
typedef void (*route_select_fn)(const struct md_router *r, float *p, int32_t *ids, float *w);

/* Softmax over all experts, top-k by repeated arg-max (strictly greater wins, so ties go to
 * the lower id), optional renormalisation. The arithmetic (float exp, double sums) is the
 * numpy reference's and today's engine's: keep it bit-for-bit. */
static void select_softmax_topk(const struct md_router *r, float *p, int32_t *ids, float *w)
{
	const int E = r->n_expert, K = r->n_used;
	if (E < 1)
		return;
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
	memset(r->taken, 0, (size_t)E);
	if (r->allow) /* a draft pass: the experts it may not use count as taken */
		for (int e = 0; e < E; e++)
			r->taken[e] = !r->allow[e];
	double wsum = 0;
	for (int k = 0; k < K; k++) {
		int best = -1;
		for (int e = 0; e < E; e++)
			if (!r->taken[e] && (best < 0 || p[e] > p[best]))
				best = e;
		r->taken[best] = 1;
		ids[k] = best;
		w[k] = p[best];
		wsum += p[best];
	}
	if (r->norm_topk)
		for (int k = 0; k < K; k++)
			w[k] = (float)(w[k] / wsum);
}

/* The k largest of v (E) among those with allow[e] != 0 (NULL: all; at least K allowed) by
 * repeated arg-max, strictly greater wins (ties: the lower id); taken (E) is scratch. */
static void topk_among(const float *v, int E, int K, uint8_t *taken, const uint8_t *allow,
		       int32_t *ids)
{
	for (int e = 0; e < E; e++)
		taken[e] = allow && !allow[e];
	for (int k = 0; k < K; k++) {
		int best = -1;
		for (int e = 0; e < E; e++)
			if (!taken[e] && (best < 0 || v[e] > v[best]))
				best = e;
		taken[best] = 1;
		ids[k] = best;
	}
}

static void topk(const float *v, int E, int K, uint8_t *taken, int32_t *ids)
{
	topk_among(v, E, K, taken, NULL, ids);
}

/* Top-k on the raw logits (the same arg-max rule), then a softmax over the k chosen: float exp,
 * double sum, as the softmax above. */
static void select_softmax_weight(const struct md_router *r, float *p, int32_t *ids, float *w)
{
	const int K = r->n_used;
	topk_among(p, r->n_expert, K, r->taken, r->allow, ids); /* a draft: the allowed only */
	float mx = p[ids[0]];
	double sum = 0;
	for (int k = 0; k < K; k++) {
		w[k] = expf(p[ids[k]] - mx);
		sum += w[k];
	}
	for (int k = 0; k < K; k++)
		w[k] = (float)(w[k] / sum);
}

/* Scores (softmax or sigmoid), selection on score + bias within the best groups, weights
 * from the unbiased scores (see MD_ROUTE_SCORED_TOPK). */
static void select_scored_topk(const struct md_router *r, float *p, int32_t *ids, float *w)
{
	const int E = r->n_expert, K = r->n_used;
	if (r->gating == MD_GATING_SIGMOID) {
		for (int e = 0; e < E; e++)
			p[e] = 1.0f / (1.0f + expf(-p[e]));
	} else {
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
	}
	float *sel = r->sel;
	for (int e = 0; e < E; e++)
		sel[e] = r->bias ? p[e] + r->bias[e] : p[e];
	if (r->allow) /* a draft pass: its groups and experts from the allowed ones */
		for (int e = 0; e < E; e++)
			if (!r->allow[e])
				sel[e] = -INFINITY;
	if (r->n_groups > 1) {
		/* A group's score: the sum of its two largest biased scores. Groups outside the
		 * n_group_used best are masked out (-inf). */
		const int G = r->n_groups, per = E / G;
		float gs[64];
		int32_t gid[64], top2[2];
		for (int g = 0; g < G; g++) {
			int two = per < 2 ? per : 2;
			topk(sel + g * per, per, two, r->taken, top2);
			gs[g] = 0.0f;
			for (int j = 0; j < two; j++)
				gs[g] += sel[g * per + top2[j]];
		}
		topk(gs, G, r->n_group_used, r->taken, gid);
		uint8_t keep[64] = { 0 };
		for (int j = 0; j < r->n_group_used; j++)
			keep[gid[j]] = 1;
		for (int g = 0; g < G; g++)
			if (!keep[g])
				for (int e = g * per; e < (g + 1) * per; e++)
					sel[e] = -INFINITY;
	}
	topk(sel, E, K, r->taken, ids);
	float wsum = 0.0f;
	for (int k = 0; k < K; k++) {
		w[k] = p[ids[k]];
		wsum += w[k];
	}
	if (r->norm_topk) {
		if (wsum < 6.103515625e-5f)
			wsum = 6.103515625e-5f;
		for (int k = 0; k < K; k++)
			w[k] /= wsum;
	}
	if (r->w_scale != 1.0f)
		for (int k = 0; k < K; k++)
			w[k] *= r->w_scale;
}

static const struct {
	const char *name;
	route_select_fn select;
} route_fns[MD_ROUTE_FN_COUNT] = {
	[MD_ROUTE_SOFTMAX_TOPK] = { "softmax_topk", select_softmax_topk },
	[MD_ROUTE_SOFTMAX_WEIGHT] = { "softmax_weight", select_softmax_weight },
	[MD_ROUTE_SCORED_TOPK] = { "scored_topk", select_scored_topk },
};

/* The switch names each architecture so that adding an md_arch without deciding its routing
 * is a compile error (-Wswitch, -Werror). */
enum md_route_fn md_route_fn_of(const struct md_hparams *hp)
{
	switch (hp->arch) {
	case MD_ARCH_QWEN3MOE:
	case MD_ARCH_QWEN2MOE:
	case MD_ARCH_LLAMA:
	case MD_ARCH_OLMOE:
	case MD_ARCH_QWEN2:
	case MD_ARCH_QWEN3:
		break;
	case MD_ARCH_GPT_OSS:
		return MD_ROUTE_SOFTMAX_WEIGHT;
	case MD_ARCH_DEEPSEEK2:
	case MD_ARCH_GLM4MOE:
		return MD_ROUTE_SCORED_TOPK;
	}
	return MD_ROUTE_SOFTMAX_TOPK;
}

const char *md_route_fn_name(enum md_route_fn fn)
{
	return (unsigned)fn < MD_ROUTE_FN_COUNT ? route_fns[fn].name : "?";
}

void md_router_release(struct md_router *r)
{
	free(r->logits);
	free(r->ids);
	free(r->w);
	free(r->off);
	free(r->tok);
	free(r->tok_w);
	free(r->active);
	free(r->taken);
	free(r->sel);
	memset(r, 0, sizeof(*r));
}

int md_router_init(struct md_router *r, const struct md_hparams *hp, int max_tokens)
{
	memset(r, 0, sizeof(*r));
	if (hp->n_expert == 0 || hp->n_expert_used == 0 || hp->n_expert_used > hp->n_expert ||
	    hp->n_expert > INT32_MAX / 2 || max_tokens < 1 || hp->n_expert_groups > 64 ||
	    (hp->n_expert_groups > 1 && (hp->n_expert % hp->n_expert_groups ||
					 hp->n_group_used == 0 || hp->n_group_used > hp->n_expert_groups ||
					 hp->n_expert_used > hp->n_group_used * (hp->n_expert / hp->n_expert_groups))))
		return -EINVAL;
	r->fn = md_route_fn_of(hp);
	r->n_expert = (int)hp->n_expert;
	r->n_used = r->n_used_model = (int)hp->n_expert_used;
	r->max_tokens = max_tokens;
	r->norm_topk = hp->norm_topk;
	r->gating = hp->gating;
	r->w_scale = hp->expert_weights_scale != 0.0f ? hp->expert_weights_scale : 1.0f;
	r->n_groups = (int)hp->n_expert_groups;
	r->n_group_used = (int)hp->n_group_used;
	const size_t T = (size_t)max_tokens, E = hp->n_expert, K = hp->n_expert_used;
	r->logits = malloc(T * E * sizeof(float));
	r->ids = malloc(T * K * sizeof(int32_t));
	r->w = malloc(T * K * sizeof(float));
	r->off = malloc((E + 1) * sizeof(int32_t));
	r->tok = malloc(T * K * sizeof(int32_t));
	r->tok_w = malloc(T * K * sizeof(float));
	r->active = malloc(E * sizeof(int32_t));
	r->taken = malloc(E);
	r->sel = malloc(E * sizeof(float));
	if (!r->logits || !r->ids || !r->w || !r->off || !r->tok || !r->tok_w || !r->active ||
	    !r->taken || !r->sel) {
		md_router_release(r);
		return -ENOMEM;
	}
	return 0;
}

void md_router_set_draft(struct md_router *r, int k, const uint8_t *allow)
{
	r->n_used = k >= 1 && k <= r->n_used_model ? k : r->n_used_model;
	r->allow = NULL;
	if (allow) {
		int n = 0;
		for (int e = 0; e < r->n_expert; e++)
			n += allow[e] != 0;
		if (n >= r->n_used)
			r->allow = allow;
	}
}

const struct md_routing *md_router_route(struct md_router *r, int n)
{
	return md_router_route_bias(r, n, NULL);
}

/* Step 2 for the first n tokens of r->ids / r->w (k each): offsets, the active list, then the
 * stable counting sort into expert-major slots (off[e] serves as expert e's write cursor, then
 * is restored). */
static const struct md_routing *group(struct md_router *r, int n, int K)
{
	const int E = r->n_expert;
	memset(r->off, 0, (size_t)(E + 1) * sizeof(int32_t));
	for (size_t i = 0; i < (size_t)n * K; i++)
		r->off[r->ids[i] + 1]++;
	r->r.n_active = 0;
	for (int e = 0; e < E; e++) {
		if (r->off[e + 1])
			r->active[r->r.n_active++] = e;
		r->off[e + 1] += r->off[e];
	}
	for (int t = 0; t < n; t++) {
		for (int k = 0; k < K; k++) {
			int e = r->ids[(size_t)t * K + k];
			int32_t slot = r->off[e]++;
			r->tok[slot] = t;
			r->tok_w[slot] = r->w[(size_t)t * K + k];
		}
	}
	for (int e = E; e > 0; e--)
		r->off[e] = r->off[e - 1];
	r->off[0] = 0;

	r->r.n_tokens = n;
	r->r.n_expert = E;
	r->r.n_used = K;
	r->r.ids = r->ids;
	r->r.w = r->w;
	r->r.off = r->off;
	r->r.tok = r->tok;
	r->r.tok_w = r->tok_w;
	r->r.active = r->active;
	return &r->r;
}

const struct md_routing *md_router_route_bias(struct md_router *r, int n, const float *bias)
{
	r->bias = bias;
	const int E = r->n_expert, K = r->n_used;
	route_select_fn sel = route_fns[r->fn].select;

	/* 1. Select per token. */
	for (int t = 0; t < n; t++)
		sel(r, r->logits + (size_t)t * E, r->ids + (size_t)t * K, r->w + (size_t)t * K);
	r->bias = NULL;
	return group(r, n, K);
}

const struct md_routing *md_router_from_ids(struct md_router *r, int n, int k,
					    const int32_t *ids, const float *w)
{
	if (n < 1 || n > r->max_tokens || k < 1 || k > r->n_used_model)
		return NULL;
	memcpy(r->ids, ids, (size_t)n * k * sizeof(int32_t));
	memcpy(r->w, w, (size_t)n * k * sizeof(float));
	return group(r, n, k);
}

void md_route_params_of(const struct md_hparams *hp, struct md_route_params *p)
{
	p->fn = md_route_fn_of(hp);
	p->E = (int)hp->n_expert;
	p->K = (int)hp->n_expert_used;
	p->norm_topk = hp->norm_topk;
	p->gating = hp->gating;
	p->w_scale = hp->expert_weights_scale != 0.0f ? hp->expert_weights_scale : 1.0f;
	p->n_groups = (int)hp->n_expert_groups;
	p->n_group_used = (int)hp->n_group_used;
}

void md_route_select(const struct md_route_params *p, const float *bias, float *logits,
		     float *sel, uint8_t *taken, int32_t *ids, float *w)
{
	struct md_router t = {
		.fn = p->fn, .n_expert = p->E, .n_used = p->K, .n_used_model = p->K,
		.norm_topk = p->norm_topk, .gating = p->gating, .w_scale = p->w_scale,
		.n_groups = p->n_groups, .n_group_used = p->n_group_used, .bias = bias,
		.sel = sel, .taken = taken,
	};
	route_fns[p->fn].select(&t, logits, ids, w);
}

void md_router_note_topk(const struct md_router *r, int n, uint8_t *taken, uint8_t *pred)
{
	const int E = r->n_expert, K = r->n_used_model;
	for (int t = 0; t < n; t++) {
		const float *p = r->logits + (size_t)t * E;
		memset(taken, 0, (size_t)E);
		for (int k = 0; k < K; k++) {
			int best = -1;
			for (int e = 0; e < E; e++)
				if (!taken[e] && (best < 0 || p[e] > p[best]))
					best = e;
			taken[best] = 1;
			pred[best] = 1;
		}
	}
}
