/* MoE routing: router logits -> per-token experts and weights -> expert-major grouping.
 *
 * Step 1 and 2 of the MoE layer (DESIGN §4). The routing function is chosen from the model's
 * hyper-parameters through a table (md_route_fn); the forward pass only sees the result, a
 * struct md_routing, which it also hands to an observer (cache statistics, prefetch,
 * expert-aware batching) through md_forward_set_route_cb. */
#ifndef MD_ROUTER_H
#define MD_ROUTER_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/model.h"

/* How router logits become expert choices. One row of route_fns[] in router.c each. */
enum md_route_fn {
	/* Softmax over all experts, the k largest probabilities (ties: the lower expert id),
	 * their weights renormalised to sum 1 when hp.norm_topk (Qwen2/3-MoE, Mixtral, OLMoE). */
	MD_ROUTE_SOFTMAX_TOPK,
	/* The k largest logits (ties: the lower id), their weights a softmax over those k alone
	 * (llama.cpp's SOFTMAX_WEIGHT gating: gpt-oss). */
	MD_ROUTE_SOFTMAX_WEIGHT,
	/* Scores by softmax or sigmoid (hp.gating); the k largest of score + selection bias
	 * (exp_probs_b, md_router_route_bias), within the n_group_used groups of experts whose
	 * two best biased scores sum highest when hp.n_expert_groups > 1; weights are the
	 * unbiased scores, renormalised when hp.norm_topk (sum clamped below at 2^-14), then
	 * times hp.expert_weights_scale (DeepSeek-V2/V3, Kimi-K2, GLM-4.5). */
	MD_ROUTE_SCORED_TOPK,
	MD_ROUTE_FN_COUNT,
};

/* The routing of one layer for n_tokens tokens. Filled by md_router_route; read-only for
 * everybody else, valid until the next md_router_route on the same router. */
struct md_routing {
	int n_tokens;
	int n_expert, n_used;  /* E and k */
	const int32_t *ids;    /* (n_tokens, k) experts of each token, in selection order */
	const float *w;        /* (n_tokens, k) their weights */
	const int32_t *off;    /* (E + 1) expert e's routings are slots off[e] .. off[e+1]-1 */
	const int32_t *tok;    /* (n_tokens * k) token of each slot, expert-major, tokens ascending */
	const float *tok_w;    /* (n_tokens * k) weight of each slot */
	const int32_t *active; /* (n_active) experts with at least one slot, ascending */
	int n_active;
};

struct md_router {
	enum md_route_fn fn;
	int n_expert, n_used, max_tokens;
	bool norm_topk;
	enum md_gating gating;
	float w_scale;     /* 1: none */
	int n_groups, n_group_used; /* n_groups <= 1: no group limit */
	const float *bias; /* borrowed during md_router_route_bias: (E) selection bias, or NULL */
	float *sel;        /* owned (E): biased, group-masked scores */
	float *logits;     /* owned (max_tokens, E): the caller writes router logits here;
			    * md_router_route overwrites them with the scores it selected on */
	int32_t *ids;      /* owned (max_tokens, k) */
	float *w;          /* owned (max_tokens, k) */
	int32_t *off;      /* owned (E + 1) */
	int32_t *tok;      /* owned (max_tokens * k) */
	float *tok_w;      /* owned (max_tokens * k) */
	int32_t *active;   /* owned (E) */
	uint8_t *taken;    /* owned (E) top-k scratch */
	int n_used_model;  /* the model's k (n_used is it, or fewer for a draft pass) */
	const uint8_t *allow; /* borrowed, (E) or NULL: experts a draft pass may choose */
	struct md_routing r;
};

/* The routing function the model's hyper-parameters call for. */
enum md_route_fn md_route_fn_of(const struct md_hparams *hp);
/* Its name ("softmax_topk"), for logs. */
const char *md_route_fn_name(enum md_route_fn fn);

/* Size a router for hp (n_expert > 0, 0 < n_expert_used <= n_expert) and up to max_tokens
 * tokens per call. Returns 0, -EINVAL or -ENOMEM (r zeroed then). */
int md_router_init(struct md_router *r, const struct md_hparams *hp, int max_tokens);
void md_router_release(struct md_router *r);

/* For the calls that follow (a draft pass, engine/forward.h md_forward_draft): choose k
 * experts per token (1 <= k <= the model's; 0 restores the model's), and only among those
 * with allow[e] != 0 (NULL: all; allow is borrowed until the next call). When fewer than k
 * are allowed, every expert may be chosen. */
void md_router_set_draft(struct md_router *r, int k, const uint8_t *allow);

/* Route n tokens (1 <= n <= max_tokens) from the logits the caller wrote into r->logits
 * (n, E). Returns the result (r->r), valid until the next call. Pure arithmetic on the
 * calling thread; the same inputs give bit-identical results. */
const struct md_routing *md_router_route(struct md_router *r, int n);
/* The same with a per-expert selection bias (E floats, borrowed for the call; NULL: none),
 * which only MD_ROUTE_SCORED_TOPK uses: it moves the choice, not the weights. */
const struct md_routing *md_router_route_bias(struct md_router *r, int n, const float *bias);

/* The grouping of a routing already chosen elsewhere (the device forward pass routes on the
 * device): n tokens of k experts each (ids, w: (n, k)), k at most the model's. Returns the
 * routing as md_router_route would have grouped those choices, or NULL for bad sizes. */
const struct md_routing *md_router_from_ids(struct md_router *r, int n, int k,
					    const int32_t *ids, const float *w);

/* After a route of n tokens (a draft pass's, say: fewer experts, or only some allowed), OR
 * into pred (E) the model's own top-k (its k, ties to the lower id) of each token's scores,
 * which md_router_route left in the logits rows: what the exact pass would likely route to
 * (for scored routing the unbiased scores, without selection bias or group limit: a prefetch
 * hint). taken (E) is scratch. */
void md_router_note_topk(const struct md_router *r, int n, uint8_t *taken, uint8_t *pred);

/* A routing as plain numbers (what a device needs to route as md_router_route does). */
struct md_route_params {
	enum md_route_fn fn;
	int E, K;              /* experts, and used per token */
	bool norm_topk;
	enum md_gating gating;
	float w_scale;         /* 1: none */
	int n_groups, n_group_used; /* n_groups <= 1: no group limit */
};
void md_route_params_of(const struct md_hparams *hp, struct md_route_params *p);

/* One token's selection exactly as md_router_route computes it (every routing function, the
 * selection bias, expert groups): logits (E) in (overwritten with the scores), ids and w (K)
 * out; bias (E) or NULL; sel (E floats) and taken (E) scratch. A device implements the same
 * (engine/backend_fwd.h route). */
void md_route_select(const struct md_route_params *p, const float *bias, float *logits,
		     float *sel, uint8_t *taken, int32_t *ids, float *w);

#endif
