/* Token sampling: logit bias, penalties, temperature, top-k/top-p/min-p, seeded RNG, logprobs. */
#ifndef MD_SAMPLER_H
#define MD_SAMPLER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct md_logit_bias {
	int32_t id;
	float bias;
};

/* Per-request sampling parameters (OpenAI semantics; vLLM's for top_k/min_p/repetition). */
struct md_sampling {
	float temperature;        /* 0 = greedy (argmax, lowest id on ties) */
	float top_p;              /* (0, 1]; 1 = off */
	int32_t top_k;            /* 0 = off */
	float min_p;              /* [0, 1]; 0 = off */
	float presence_penalty;   /* [-2, 2], over generated tokens */
	float frequency_penalty;  /* [-2, 2], over generated tokens */
	float repetition_penalty; /* > 0; 1 = off, over prompt and generated tokens */
	uint64_t seed;
	bool has_seed;            /* false: the engine picks a fresh seed */
	int32_t top_logprobs;     /* -1 = no logprobs; 0..20 = logprob plus that many alternatives */
	struct md_logit_bias *logit_bias; /* owned (n_logit_bias) */
	uint32_t n_logit_bias;
};

void md_sampling_default(struct md_sampling *s);
void md_sampling_release(struct md_sampling *s);

/* Per-sequence state: RNG and scratch. */
struct md_sampler {
	uint64_t rng[2];        /* xoroshiro128+ state */
	uint32_t n_vocab;
	float *probs;           /* owned (n_vocab): scratch */
	int32_t *idx;           /* owned (n_vocab): scratch */
	int32_t *hist;          /* owned (hist_cap): sorted-copy scratch for penalties */
	uint32_t hist_cap;
};

int md_sampler_init(struct md_sampler *sm, uint32_t n_vocab, uint64_t seed);
void md_sampler_release(struct md_sampler *sm);

struct md_sample_out {
	int32_t token;
	float logprob;          /* log-softmax of the raw logits at token */
	uint32_t n_top;
	int32_t top_id[20];
	float top_logprob[20];  /* raw log-softmax, best first */
};

/* Pick the next token from logits (n_vocab floats, modified in place). prompt/gen are the
 * sequence's prompt and generated tokens (for penalties). Returns 0 or -ENOMEM. */
int md_sampler_sample(struct md_sampler *sm, const struct md_sampling *p, float *logits,
		      const int32_t *prompt, uint32_t n_prompt, const int32_t *gen, uint32_t n_gen,
		      struct md_sample_out *out);

/* A well-mixed 64-bit value (splitmix64) for seeding. */
uint64_t md_sampler_mix(uint64_t x);

#endif
