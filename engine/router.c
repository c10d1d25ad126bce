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

/* Top-k on the raw logits (the same arg-max rule), then a softmax over the k chosen: float exp,
 * double sum, as the softmax above. */
static void select_softmax_weight(const struct md_router *r, float *p, int32_t *ids, float *w)
{
	const int E = r->n_expert, K = r->n_used;
	memset(r->taken, 0, (size_t)E);
	for (int k = 0; k < K; k++) {
		int best = -1;
		for (int e = 0; e < E; e++)
			if (!r->taken[e] && (best < 0 || p[e] > p[best]))
				best = e;
		r->taken[best] = 1;
		ids[k] = best;
	}
	float mx = p[ids[0]];
	double sum = 0;
	for (int k = 0; k < K; k++) {
		w[k] = expf(p[ids[k]] - mx);
		sum += w[k];
	}
	for (int k = 0; k < K; k++)
		w[k] = (float)(w[k] / sum);
}

static const struct {
	const char *name;
	route_select_fn select;
} route_fns[MD_ROUTE_FN_COUNT] = {
	[MD_ROUTE_SOFTMAX_TOPK] = { "softmax_topk", select_softmax_topk },
	[MD_ROUTE_SOFTMAX_WEIGHT] = { "softmax_weight", select_softmax_weight },
};

/* Every architecture but gpt-oss gates by softmax over all experts. The switch names each one so that adding an
 * md_arch without deciding its routing is a compile error (-Wswitch, -Werror). */
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
	memset(r, 0, sizeof(*r));
}

int md_router_init(struct md_router *r, const struct md_hparams *hp, int max_tokens)
{
	memset(r, 0, sizeof(*r));
	if (hp->n_expert == 0 || hp->n_expert_used == 0 || hp->n_expert_used > hp->n_expert ||
	    hp->n_expert > INT32_MAX / 2 || max_tokens < 1)
		return -EINVAL;
	r->fn = md_route_fn_of(hp);
	r->n_expert = (int)hp->n_expert;
	r->n_used = r->n_used_model = (int)hp->n_expert_used;
	r->max_tokens = max_tokens;
	r->norm_topk = hp->norm_topk;
	const size_t T = (size_t)max_tokens, E = hp->n_expert, K = hp->n_expert_used;
	r->logits = malloc(T * E * sizeof(float));
	r->ids = malloc(T * K * sizeof(int32_t));
	r->w = malloc(T * K * sizeof(float));
	r->off = malloc((E + 1) * sizeof(int32_t));
	r->tok = malloc(T * K * sizeof(int32_t));
	r->tok_w = malloc(T * K * sizeof(float));
	r->active = malloc(E * sizeof(int32_t));
	r->taken = malloc(E);
	if (!r->logits || !r->ids || !r->w || !r->off || !r->tok || !r->tok_w || !r->active ||
	    !r->taken) {
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
	const int E = r->n_expert, K = r->n_used;
	route_select_fn sel = route_fns[r->fn].select;

	/* 1. Select per token; count routings per expert in off[e + 1]. */
	memset(r->off, 0, (size_t)(E + 1) * sizeof(int32_t));
	for (int t = 0; t < n; t++) {
		int32_t *ids = r->ids + (size_t)t * K;
		sel(r, r->logits + (size_t)t * E, ids, r->w + (size_t)t * K);
		for (int k = 0; k < K; k++)
			r->off[ids[k] + 1]++;
	}

	/* 2. Offsets, the active list, then the stable counting sort into expert-major slots
	 * (off[e] serves as expert e's write cursor, then is restored). */
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
