/* Speculative decoding: drafters, per-sequence state, the exact verification of one position. */
#include "engine/spec.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static const char *const names[] = {
	[MD_SPEC_DEFAULT] = "default",
	[MD_SPEC_OFF] = "off",
	[MD_SPEC_NGRAM] = "ngram",
	[MD_SPEC_DRAFT] = "draft",
	[MD_SPEC_SELF] = "self",
};

const char *md_spec_drafter_name(enum md_spec_drafter d)
{
	return (unsigned)d < sizeof(names) / sizeof(names[0]) ? names[d] : NULL;
}

int md_spec_drafter_parse(const char *s)
{
	for (unsigned i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		if (strcmp(s, names[i]) == 0)
			return (int)i;
	return -EINVAL;
}

struct md_spec_seq *md_spec_seq_new(enum md_spec_drafter drafter, uint32_t max_k, uint64_t seed)
{
	struct md_spec_seq *ss = calloc(1, sizeof(*ss));
	if (!ss)
		return NULL;
	ss->drafter = drafter;
	ss->max_k = max_k < 1 ? 1 : max_k > MD_SPEC_MAX_K ? MD_SPEC_MAX_K : max_k;
	ss->rng[0] = md_sampler_mix(seed ^ 0x5bd1e995u);
	ss->rng[1] = md_sampler_mix(ss->rng[0]) | 1;
	ss->dkv_seq = -1;
	return ss;
}

void md_spec_seq_free(struct md_spec_seq *ss)
{
	if (!ss)
		return;
	if (ss->q) {
		for (uint32_t i = 0; i < ss->max_k; i++)
			md_sampler_dist_release(&ss->q[i]);
		free(ss->q);
	}
	if (ss->dkv && ss->dkv_seq >= 0)
		md_kv_seq_free(ss->dkv, ss->dkv_seq);
	free(ss);
}

int md_spec_seq_alloc_q(struct md_spec_seq *ss, uint32_t r, uint32_t n_vocab)
{
	if (r >= ss->max_k)
		return -EINVAL;
	/* Per position, on first use: each holds two arrays of the vocabulary's size (8 bytes a
	 * token), so a sequence that may draft 32 but drafts 4 holds 4 (a 152k vocabulary: 1.2
	 * MB each, 39 MB for all 32). */
	if (!ss->q) {
		ss->q = calloc(ss->max_k, sizeof(*ss->q));
		if (!ss->q)
			return -ENOMEM;
	}
	if (ss->q[r].id)
		return 0;
	return md_sampler_dist_init(&ss->q[r], n_vocab);
}

static uint64_t rotl(uint64_t x, int k)
{
	return (x << k) | (x >> (64 - k));
}

double md_spec_uniform(uint64_t rng[2])
{
	uint64_t s0 = rng[0], s1 = rng[1];
	uint64_t r = s0 + s1;
	s1 ^= s0;
	rng[0] = rotl(s0, 24) ^ s1 ^ (s1 << 16);
	rng[1] = rotl(s1, 37);
	return (double)(r >> 11) * (1.0 / 9007199254740992.0);
}

/* ---- the n-gram drafter ---- */

uint32_t md_spec_ngram(const int32_t *toks, uint32_t n_toks, uint32_t min_n, uint32_t max_n,
		       uint32_t max_k, int32_t *out, uint32_t *cls)
{
	if (min_n < 1)
		min_n = 1;
	for (uint32_t n = max_n; n >= min_n && max_k > 0; n--) {
		if (n_toks < n + 1)
			continue;
		const int32_t *suf = toks + n_toks - n;
		/* Occurrences that end before the suffix starts its last token; newest first. */
		for (uint32_t j = n_toks - n; j-- > 0;) {
			if (toks[j] != suf[0] || memcmp(toks + j, suf, sizeof(int32_t) * n) != 0)
				continue;
			/* What followed it, and past the end of toks the proposal itself: the
			 * text D = n_toks - from tokens back repeats (a loop's period), so a
			 * proposal is as long as max_k allows, not cut at the end of toks. */
			uint32_t from = j + n, D = n_toks - from;
			for (uint32_t k = 0; k < max_k; k++)
				out[k] = k < D ? toks[from + k] : out[k - D];
			if (cls) {
				uint32_t m = n;
				while (m < MD_SPEC_LONG_MATCH && m < from &&
				       toks[from - 1 - m] == toks[n_toks - 1 - m])
					m++;
				*cls = m >= MD_SPEC_LONG_MATCH ? MD_SPEC_CLS_LONG
				     : m >= D ? MD_SPEC_CLS_REPEAT
				     : n >= 4 ? MD_SPEC_CLS_SHORT
				     : n == 3 ? MD_SPEC_CLS_TRIGRAM : MD_SPEC_CLS_BIGRAM;
			}
			return max_k;
		}
	}
	return 0;
}

/* ---- verification of one position ---- */

int md_spec_decide(struct md_sampler *sm, const struct md_sampling *p,
		   const struct md_sampler_ctx *ctx, const float *logits, int32_t draft,
		   const struct md_sampler_dist *q, struct md_sampler_dist *resid,
		   struct md_sample_out *out, bool *accepted)
{
	*accepted = false;
	if (!q || q->greedy) {
		/* Point mass: the plain draw, compared with the draft (DESIGN). */
		int rc = ctx->allowed /* a grammar's mask */
			? md_sampler_sample_ctx(sm, p, logits, ctx, out)
			: md_sampler_sample(sm, p, logits, ctx->prompt, ctx->n_prompt, ctx->gen,
					    ctx->n_gen, out);
		if (rc)
			return rc;
		*accepted = draft >= 0 && out->token == draft;
		return 0;
	}
	struct md_sampler_dist *d = &sm->dist;
	int rc = md_sampler_transform(sm, p, ctx, logits, d->w);
	if (rc)
		return rc;
	rc = md_sampler_dist_build(d, p, d->w);
	if (rc)
		return rc;
	int32_t tok;
	double pd = md_sampler_dist_prob(d, draft), qd = md_sampler_dist_prob(q, draft);
	double u = md_sampler_uniform(sm);
	if (qd > 0 && u * qd < pd) {
		tok = draft;
		*accepted = true;
	} else {
		rc = md_sampler_dist_residual(resid, d, q);
		if (rc)
			return rc;
		tok = md_sampler_draw(sm, resid);
	}
	if (p->top_logprobs >= 0) {
		md_sampler_logprobs(logits, sm->n_vocab, tok, p->top_logprobs, out);
	} else {
		out->token = tok;
		out->logprob = 0;
		out->n_top = 0;
	}
	return 0;
}
