/* Speculative decoding: drafters, per-sequence state, the exact verification of one position. */
#ifndef MD_SPEC_H
#define MD_SPEC_H

/*
 * DESIGN
 * A decoding sequence may carry up to k drafted tokens d_1..d_k after its last token; the
 * scheduler puts them in the same forward pass (1 + k rows), which gives the target's logits
 * rows L_0..L_k (L_i predicts the token after d_1..d_i). Verification walks the rows in order
 * and emits tokens while the drafts hold:
 *
 *   row i < k   the target's token at this position is decided from L_i; if it is d_{i+1}
 *               the draft is accepted and the walk goes on, otherwise the decided token is
 *               emitted in its place and the walk stops;
 *   row k       every draft held: the target's own next token (the bonus) is drawn from L_k.
 *
 * So a step emits between 1 and k + 1 tokens, and KV rows of accepted drafts stay while the
 * rest roll back (md_sched_commit). The request's whole sampling pipeline (logit_bias,
 * penalties over the history including the accepted drafts, temperature, top-k/min-p/top-p)
 * builds p from L_i exactly as a plain step would, and likewise q for a draft model.
 *
 * How a position is decided (md_spec_decide):
 * - The draft is a point mass q = delta(d) (n-gram drafts; any greedy draft): the token is
 *   drawn from p with the sequence's RNG exactly as without speculation, and the draft is
 *   accepted when the draw equals d. This IS the standard rejection rule: P(accept) = p(d) =
 *   min(1, p(d)/q(d)), and on rejection the token is distributed as p restricted to t != d
 *   and renormalised, which is norm(max(0, p - q)). Drawing it this way (one uniform per
 *   emitted token, as a plain step) keeps seeded outputs identical with and without
 *   speculation, and greedy decoding is the case p = delta(argmax).
 * - The draft was sampled from a distribution q (a draft model at temperature > 0): accept d
 *   when u < p(d) / q(d), u uniform from the sequence's RNG; on rejection draw from the
 *   residual norm(max(0, p - q)) (md_sampler_dist_residual). The output is distributed as p;
 *   seeded outputs differ from plain decoding (the RNG is used differently).
 *
 * Drafters propose into struct md_spec_seq, which a sequence owns. The n-gram drafter is
 * here: the most recent earlier occurrence of the sequence's last n tokens (n from max_n down
 * to min_n), in the prompt and the generated text, proposes what followed it. The draft model
 * runner is engine/draft_model.h; the choice of k is engine/spec_ctl.h.
 *
 * Engine thread only; nothing here has global state.
 */

#include <stdbool.h>
#include <stdint.h>

#include "engine/kv_cache.h"
#include "engine/sampler.h"

/* The most tokens drafted for one sequence in one step. */
#define MD_SPEC_MAX_K 32
/* Classes of n-gram proposals by their evidence (md_spec_ngram), acceptance rising with the
 * class. */
enum md_spec_cls {
	MD_SPEC_CLS_BIGRAM,  /* a phrase seen before, matched on its last 2 tokens (or fewer) */
	MD_SPEC_CLS_TRIGRAM, /* the same, on 3 */
	MD_SPEC_CLS_SHORT,   /* the same, on 4 or more */
	MD_SPEC_CLS_REPEAT,
	MD_SPEC_CLS_LONG,
	MD_SPEC_CLASSES
};
#define MD_SPEC_LONG_MATCH 32

enum md_spec_drafter {
	MD_SPEC_DEFAULT = 0, /* a request's "use the server's default" */
	MD_SPEC_OFF,
	MD_SPEC_NGRAM,
	MD_SPEC_DRAFT,       /* a draft model (md_engine_config.draft_model_path) */
	MD_SPEC_SELF,        /* the model itself, cheaper: fewer experts, skipped layers
			      * (engine/self_draft.h) */
};

/* A request's choice (moed extension "speculative"). */
struct md_spec_opts {
	enum md_spec_drafter drafter; /* MD_SPEC_DEFAULT: the engine's */
	uint32_t max_k;               /* 0: the engine's; clamped to MD_SPEC_MAX_K */
};

/* "off", "ngram", "draft", "self" (and "default"); NULL for an unknown value. */
const char *md_spec_drafter_name(enum md_spec_drafter d);
/* Parse one of the names above; returns the drafter or -EINVAL. */
int md_spec_drafter_parse(const char *s);

/* What one sequence keeps between steps. */
struct md_spec_seq {
	enum md_spec_drafter drafter;  /* resolved: OFF, NGRAM, DRAFT or SELF */
	uint32_t max_k;                /* resolved, 1..MD_SPEC_MAX_K */
	int32_t draft[MD_SPEC_MAX_K];  /* this step's proposal (n_draft), handed to the scheduler */
	uint32_t n_draft;
	bool draft_q;                  /* drafts were sampled from q[0..n_draft) (else point mass) */
	struct md_sampler_dist *q;     /* owned (max_k), each allocated on its first use
					  (md_spec_seq_alloc_q): the draft model's distribution at
					  each drafted position */
	uint64_t rng[2];               /* the draft model's own RNG for sampling drafts */

	/* controller (engine/spec_ctl.c) */
	double acc_w[MD_SPEC_CLASSES], acc_n[MD_SPEC_CLASSES]; /* decayed counts per class
					  (enum md_spec_cls; other drafters: class 0 only): drafts
					  accepted / drafts judged */
	uint32_t cls;                  /* this step's proposal's class */
	int32_t shadow[MD_SPEC_MAX_K]; /* an n-gram proposal not verified, judged token by token
					  against what the sequence emits next, until the first
					  mismatch (the drafts a verification would have accepted) */
	uint32_t n_shadow, shadow_at;  /* its length (0: none pending) and tokens matched so far */
	uint32_t shadow_cls;           /* its class */
	uint32_t n_prop;               /* this step's proposal length, before the choice of k */
	uint32_t probe_wait, probe_gap; /* steps until a probe when k was 0; current gap */
	uint32_t probe_k;              /* drafts of the next probe of a drafter without a shadow
					  (0: one); probe_sent: that probe is out this step */
	bool probe_sent;
	double probe_value;            /* seconds an accepted draft of that probe saves (a plain
					  step's time per sequence), refunded to the probe credit */
	uint32_t k_used;               /* k given to the scheduler this step */
	double catchup;                /* seconds the drafter needs to catch up on the sequence's
					  tokens it has not seen before it can draft (the draft
					  model's prefill of them; set before each choice, 0 for
					  drafters without) */
	uint32_t horizon;              /* tokens the sequence may still generate (its max_tokens
					  left), over which a catch-up is paid back; 0: unknown */
	uint32_t explore;              /* speculating steps, counted for frontier probes */

	/* the draft model's KV (engine/draft_model.c) */
	int dkv_seq;                   /* slot in the draft model's KV cache, -1: none */
	uint32_t dkv_base;             /* toks[] index at the draft KV's position 0 */
	uint32_t n_dkv;                /* toks[dkv_base .. n_dkv) are in the draft KV */
	uint32_t n_dfed;               /* drafts fed after them (draft[0..n_dfed)) */
	struct md_kv_cache *dkv;       /* borrowed: the draft model's KV cache holding dkv_seq */

	/* counts for the request log and /metrics */
	uint32_t drafted, accepted, verify_steps;
};

/* A state for a sequence (drafter already resolved; max_k clamped to [1, MD_SPEC_MAX_K]).
 * seed seeds the draft RNG. NULL when out of memory. */
struct md_spec_seq *md_spec_seq_new(enum md_spec_drafter drafter, uint32_t max_k, uint64_t seed);
/* Frees the state and its distributions, and the draft model's KV slot when it holds one
 * (the draft KV cache must still exist). NULL is ignored. */
void md_spec_seq_free(struct md_spec_seq *ss);
/* Draft position r's q distribution (r < max_k), allocated for n_vocab tokens on its first
 * use: a sequence holds only the positions it has drafted. Returns 0, -EINVAL or -ENOMEM. */
int md_spec_seq_alloc_q(struct md_spec_seq *ss, uint32_t r, uint32_t n_vocab);

/* Uniform double in [0, 1) from a draft RNG (xoroshiro128+). */
double md_spec_uniform(uint64_t rng[2]);

/*
 * N-gram lookup: find the most recent earlier occurrence of the last n tokens of toks[0..n_toks)
 * for n = max_n down to min_n, and copy the max_k tokens that followed it into out, continuing
 * periodically past the end of toks (an occurrence D tokens back proposes that the last D
 * tokens repeat). Returns max_k, or 0 where nothing matches. O(n_toks * n) per call.
 *
 * *cls (when cls is not NULL) gets the proposal's class, its evidence: how far back the text
 * before the occurrence and the text before the end agree, m tokens (at least n):
 *   MD_SPEC_CLS_BIGRAM  m < D, matched on n <= 2 tokens: a pair of tokens seen before;
 *   MD_SPEC_CLS_TRIGRAM m < D, n = 3;
 *   MD_SPEC_CLS_SHORT   m < D, n >= 4, m < MD_SPEC_LONG_MATCH: a phrase seen before;
 *   MD_SPEC_CLS_REPEAT  m >= D: the last D tokens already repeated the D before them whole;
 *   MD_SPEC_CLS_LONG    m >= MD_SPEC_LONG_MATCH: a long stretch copied or repeated.
 * Acceptance differs by class, so the controller keeps an estimate per class
 * (engine/spec_ctl.h). On default-1g's greedy outputs of the loop workload (16 answers of 256
 * tokens, a proposal at every position, up to 16 tokens), per drafted token: 0.70 (155
 * proposals), 0.90 (106), 0.90 (1034), 0.95 (912) and 0.985 (1200). A pair of tokens says
 * much less than three: a controller that tells them apart may leave the pairs undrafted
 * and draft the rest long (the best fixed k per class on those outputs: 1.54x plain decode
 * against 1.46x with the pairs among the short phrases; bench/README.md).
 */
uint32_t md_spec_ngram(const int32_t *toks, uint32_t n_toks, uint32_t min_n, uint32_t max_n,
		       uint32_t max_k, int32_t *out, uint32_t *cls);

/*
 * Decide one position (see DESIGN). logits: the target's raw row (sm->n_vocab floats); ctx:
 * the history the transforms read (prompt, then generated tokens including the drafts accepted
 * before this position). draft: the drafted token here, or -1 at the bonus position; q: its
 * distribution, or NULL for a point mass; resid: scratch for the residual (n_vocab).
 * out gets the decided token and, when p->top_logprobs >= 0, its logprobs from the raw row.
 * *accepted: out->token == draft. Returns 0, -ENOMEM or -EDOM (nothing to sample).
 */
int md_spec_decide(struct md_sampler *sm, const struct md_sampling *p,
		   const struct md_sampler_ctx *ctx, const float *logits, int32_t draft,
		   const struct md_sampler_dist *q, struct md_sampler_dist *resid,
		   struct md_sample_out *out, bool *accepted);

#endif
