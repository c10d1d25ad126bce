/* Token sampling in three stages: logits transforms, the filtered distribution, the draw. */
#ifndef MD_SAMPLER_H
#define MD_SAMPLER_H

/*
 * DESIGN
 *
 * One sampling step is three stages, each callable on its own:
 *
 *   (a) transforms   md_sampler_transform: raw logits -> transformed logits, in this order
 *                    1. logit_bias (added),
 *                    2. repetition penalty (prompt + generated tokens, once per distinct id),
 *                    3. presence and frequency penalties (generated tokens),
 *                    4. the allowed-token mask (the grammar slot: disallowed tokens -> -inf).
 *                    The mask comes last so that no bias or penalty can re-enable a token the
 *                    grammar forbids.
 *   (b) distribution md_sampler_dist_build: transformed logits -> struct md_sampler_dist, the
 *                    filtered distribution (temperature, then top-k, min-p, top-p), an explicit
 *                    object with its support and normalised probabilities, so that speculative
 *                    decoding can evaluate p(token) for any token and sample from the residual
 *                    (p - q)+ (md_sampler_dist_prob, md_sampler_dist_residual).
 *   (c) draw         md_sampler_draw: one token from a distribution with the sequence's seeded
 *                    RNG (xoroshiro128+, per sequence).
 *
 * Logprobs (md_sampler_logprobs) are the log-softmax of the raw logits, untouched by every
 * stage: what the model said, as OpenAI reports it. md_sampler_sample runs the whole pipeline
 * (without a mask) and gives the same tokens as the single-function sampler it replaced.
 *
 * Threads: a struct md_sampler and its distributions belong to the engine thread; nothing here
 * has global state, so separate samplers may run on separate threads.
 */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The most top_logprobs alternatives a sample carries (OpenAI's limit). */
#define MD_SAMPLER_MAX_TOP 20

struct md_logit_bias {
	int32_t id;
	float bias;
};

/* Per-request sampling parameters (OpenAI semantics; vLLM's for top_k/min_p/repetition). */
struct md_sampling {
	float temperature;        /* <= 1e-6 = greedy (argmax, lowest id on ties) */
	float top_p;              /* (0, 1]; 1 = off */
	int32_t top_k;            /* <= 0 = off */
	float min_p;              /* [0, 1]; 0 = off */
	float presence_penalty;   /* [-2, 2], over generated tokens */
	float frequency_penalty;  /* [-2, 2], over generated tokens */
	float repetition_penalty; /* > 0; 1 = off, over prompt and generated tokens */
	uint64_t seed;
	bool has_seed;            /* false: the engine picks a fresh seed */
	int32_t top_logprobs;     /* -1 = no logprobs; 0..MD_SAMPLER_MAX_TOP = logprob plus that
				   * many alternatives (more is clamped to MD_SAMPLER_MAX_TOP) */
	struct md_logit_bias *logit_bias; /* owned (n_logit_bias) */
	uint32_t n_logit_bias;
};

void md_sampling_default(struct md_sampling *s);
void md_sampling_release(struct md_sampling *s);

/*
 * What the transforms read about the sequence besides the parameters. All borrowed for the
 * duration of the call; a NULL array needs a zero count.
 *
 * allowed is the grammar mask slot: a bitmap of ceil(n_vocab / 32) words where bit (t % 32) of
 * word t / 32 set means token t may be sampled (the layout of xgrammar's token bitmask, so a
 * grammar engine can fill it directly). NULL allows every token.
 */
struct md_sampler_ctx {
	const int32_t *prompt;   /* borrowed (n_prompt) */
	uint32_t n_prompt;
	const int32_t *gen;      /* borrowed (n_gen): tokens generated so far */
	uint32_t n_gen;
	const uint32_t *allowed; /* borrowed (ceil(n_vocab / 32)) or NULL */
};

/*
 * The filtered distribution of one position: its support and the weights that make its
 * probabilities. Read it through md_sampler_dist_prob/_prob_at; the fields are public for
 * iteration (id[0..n)) and for tests.
 *
 * Why weights and a sum instead of a normalised array: the draw walks the support with
 * unnormalised float weights and a double sum, which keeps every seeded sequence identical to
 * the sampler before the split; normalising up front would be an extra pass over up to n_vocab
 * entries per token that only speculative decoding needs.
 */
struct md_sampler_dist {
	uint32_t n_vocab;
	uint32_t n;     /* support size; 0 = empty (no token had a finite transformed logit) */
	bool greedy;    /* a point mass on id[0] (temperature 0); the draw uses no randomness */
	int32_t *id;    /* owned (n_vocab): id[0..n) is the support in draw order; best first
			 * when top_p filtered (sorted) or greedy, otherwise unspecified */
	float *w;       /* owned (n_vocab): by token id, the unnormalised weight (> 0 inside the
			 * support); meaningless when greedy */
	double sum;     /* sum of w[id[i]] for i < n (1 when greedy) */
	float _cut_w;   /* the support is every t with w[t] > 0 that is no worse than */
	int32_t _cut_id; /* (_cut_w, _cut_id) in the order (weight desc, id asc) */
};

/* Allocate a distribution for n_vocab tokens (empty). Returns 0 or -ENOMEM (d released). */
int md_sampler_dist_init(struct md_sampler_dist *d, uint32_t n_vocab);
void md_sampler_dist_release(struct md_sampler_dist *d);

/*
 * Stage (b): build d from transformed logits (d->n_vocab floats; may be d->w itself, then it
 * is overwritten). Order: temperature (softmax of logits / T, computed as exp((l - max) / T)),
 * top-k, min-p (keep p >= min_p * p_max), top-p (the smallest best-first prefix whose mass
 * reaches top_p of the total). Greedy (temperature <= 1e-6) ignores the filters and gives the
 * argmax, lowest id on ties. NaN and -inf logits are never in the support; when some logits
 * are +inf the support is those tokens, equally likely.
 * Returns 0, or -EDOM when no logit is finite or +inf (d->n == 0: every token -inf or NaN, for
 * instance a mask that allows nothing); nothing is drawn from an empty distribution.
 */
int md_sampler_dist_build(struct md_sampler_dist *d, const struct md_sampling *p,
			  const float *logits);

/* p(token): its normalised probability in d, 0 outside the support or the vocabulary. O(1). */
float md_sampler_dist_prob(const struct md_sampler_dist *d, int32_t token);

/* The normalised probability of the i-th support entry, id[i] (i < d->n). */
float md_sampler_dist_prob_at(const struct md_sampler_dist *d, uint32_t i);

/*
 * The residual distribution of speculative sampling's rejection step: r = norm(max(0, p - q)),
 * over p's support in p's order (p and q share n_vocab; r must be a third distribution).
 * When p - q is nowhere positive (p == q up to rounding, where a rejection cannot really
 * happen) r is a copy of p. Returns 0, or -EDOM when p is empty (r is left empty).
 */
int md_sampler_dist_residual(struct md_sampler_dist *r, const struct md_sampler_dist *p,
			     const struct md_sampler_dist *q);

/* Per-sequence state: the RNG, the convenience path's distribution, penalty scratch. */
struct md_sampler {
	uint64_t rng[2];              /* xoroshiro128+ state */
	uint32_t n_vocab;
	struct md_sampler_dist dist;  /* owned: md_sampler_sample's distribution (scratch) */
	int32_t *hist;                /* owned (hist_cap): sorted-copy scratch for penalties */
	uint32_t hist_cap;
};

/* Seeds the RNG from seed (same seed, same draws on every platform). 0 or -ENOMEM. */
int md_sampler_init(struct md_sampler *sm, uint32_t n_vocab, uint64_t seed);
void md_sampler_release(struct md_sampler *sm);

/*
 * Stage (a): out[t] = logits[t] with bias, penalties and mask applied (order in DESIGN above);
 * out and logits hold sm->n_vocab floats and may be the same array; ctx may be NULL (no
 * history, no mask). Ids outside the vocabulary in logit_bias or the history are ignored.
 * Returns 0 or -ENOMEM (penalty scratch; out is then only partly transformed).
 */
int md_sampler_transform(struct md_sampler *sm, const struct md_sampling *p,
			 const struct md_sampler_ctx *ctx, const float *logits, float *out);

/*
 * Stage (c): draw one token from d with sm's RNG. A greedy distribution gives id[0] and leaves
 * the RNG alone; any other consumes one uniform. Returns the token, or -1 when d is empty.
 */
int32_t md_sampler_draw(struct md_sampler *sm, const struct md_sampler_dist *d);

/* The next uniform double in [0, 1) from sm's RNG (speculative decoding's acceptance test). */
double md_sampler_uniform(struct md_sampler *sm);

struct md_sample_out {
	int32_t token;
	float logprob;          /* log-softmax of the raw logits at token */
	uint32_t n_top;         /* <= MD_SAMPLER_MAX_TOP */
	int32_t top_id[MD_SAMPLER_MAX_TOP];
	float top_logprob[MD_SAMPLER_MAX_TOP]; /* raw log-softmax, best first (lowest id on ties) */
};

/*
 * Logprobs of token from the raw logits (n_vocab floats): out->logprob, and the n_top best
 * alternatives (n_top clamped to [0, MD_SAMPLER_MAX_TOP] and to n_vocab) in out->top_*.
 * Sets out->token = token.
 */
void md_sampler_logprobs(const float *logits, uint32_t n_vocab, int32_t token, int32_t n_top,
			 struct md_sample_out *out);

/*
 * All stages without a mask: transform, build, draw, then logprobs when p->top_logprobs >= 0
 * (otherwise out->logprob = 0 and out->n_top = 0). logits (sm->n_vocab floats) are read only.
 * prompt/gen are the sequence's prompt and generated tokens (for penalties).
 * Returns 0, -ENOMEM, or -EDOM when no token has a finite logit (every logit NaN or -inf, a
 * broken model output: there is nothing to sample, and no token is invented); out is
 * unspecified on error.
 */
int md_sampler_sample(struct md_sampler *sm, const struct md_sampling *p, const float *logits,
		      const int32_t *prompt, uint32_t n_prompt, const int32_t *gen, uint32_t n_gen,
		      struct md_sample_out *out);

/* md_sampler_sample with the transforms' context given whole, mask included (ctx->allowed;
 * ctx may be NULL): the path of a sequence under a grammar. Same returns. */
int md_sampler_sample_ctx(struct md_sampler *sm, const struct md_sampling *p, const float *logits,
			  const struct md_sampler_ctx *ctx, struct md_sample_out *out);

/* A well-mixed 64-bit value (splitmix64) for seeding. */
uint64_t md_sampler_mix(uint64_t x);

#endif
