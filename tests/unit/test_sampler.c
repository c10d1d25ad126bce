/* Unit tests for engine/sampler.c: each stage on its own (transforms, distribution, draw),
 * logprobs, speculative decoding's p(token) and residual, and the whole pipeline against the
 * tokens the single-function sampler gave before the split into stages. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/sampler.h"
#include "tests/check.h"

#define V 1000

/* The shared test row: a permutation of 0.00 .. 9.99 (7919 is prime to 1000). */
static float logits[V];
static int32_t best; /* argmax of logits */

static void init_logits(void)
{
	for (int i = 0; i < V; i++)
		logits[i] = (float)((i * 7919) % 1000) / 100.0f;
	best = 0;
	for (int i = 1; i < V; i++)
		if (logits[i] > logits[best])
			best = i;
}

static int32_t sample(struct md_sampler *sm, const struct md_sampling *p, const float *src,
		      const int32_t *gen, uint32_t n_gen, struct md_sample_out *o)
{
	if (md_sampler_sample(sm, p, src, NULL, 0, gen, n_gen, o))
		return -1;
	return o->token;
}

static void bitmap_allow(uint32_t *bits, int32_t t)
{
	bits[t / 32] |= 1u << (t % 32);
}

/* ---- stage (a) ------------------------------------------------------------------------- */

static void test_bias(void)
{
	struct md_sampler sm;
	struct md_sampling p;
	float in[8] = { 0, 1, 2, 3, 4, 5, 6, 7 }, out[8];
	struct md_logit_bias lb[4] = { { 1, 2.5f }, { 6, -100 }, { 8, 50 }, { -1, 50 } };
	struct md_sampler_ctx ctx = { 0 };
	CHECK_EQ_I(md_sampler_init(&sm, 8, 1), 0);
	md_sampling_default(&p);
	p.logit_bias = lb;
	p.n_logit_bias = 4;
	CHECK_EQ_I(md_sampler_transform(&sm, &p, &ctx, in, out), 0);
	CHECK_EQ_F(out[1], 3.5f);
	CHECK_EQ_F(out[6], -94.0f);
	CHECK_EQ_F(out[0], 0.0f); /* untouched; ids 8 and -1 are outside the vocabulary */
	CHECK_EQ_F(out[7], 7.0f);
	CHECK_EQ_F(in[1], 1.0f);  /* the input is read only */
	/* no context: no history, no mask */
	CHECK_EQ_I(md_sampler_transform(&sm, &p, NULL, in, out), 0);
	CHECK_EQ_F(out[1], 3.5f);
	/* in place */
	CHECK_EQ_I(md_sampler_transform(&sm, &p, &ctx, in, in), 0);
	CHECK_EQ_F(in[1], 3.5f);
	md_sampler_release(&sm);
}

static void test_penalties(void)
{
	struct md_sampler sm;
	struct md_sampling p;
	float in[8] = { 2, -2, 4, -4, 1, 1, 1, 1 }, out[8];
	int32_t prompt[3] = { 0, 1, 0 };
	int32_t gen[6] = { 2, 3, 2, 2, 0, 9 }; /* 9: outside the vocabulary, ignored */
	struct md_sampler_ctx ctx = { .prompt = prompt, .n_prompt = 3, .gen = gen, .n_gen = 6 };
	CHECK_EQ_I(md_sampler_init(&sm, 8, 1), 0);

	/* repetition: once per distinct id of prompt + gen, positive divided, negative multiplied */
	md_sampling_default(&p);
	p.repetition_penalty = 2;
	CHECK_EQ_I(md_sampler_transform(&sm, &p, &ctx, in, out), 0);
	CHECK_EQ_F(out[0], 1.0f);  /* in prompt twice and gen once: still divided once */
	CHECK_EQ_F(out[1], -4.0f);
	CHECK_EQ_F(out[2], 2.0f);
	CHECK_EQ_F(out[3], -8.0f);
	CHECK_EQ_F(out[4], 1.0f);

	/* presence once per distinct generated id, frequency per occurrence; prompt not counted */
	md_sampling_default(&p);
	p.presence_penalty = 0.5f;
	p.frequency_penalty = 0.25f;
	CHECK_EQ_I(md_sampler_transform(&sm, &p, &ctx, in, out), 0);
	CHECK_EQ_F(out[2], 4.0f - (3 * 0.25f + 0.5f));
	CHECK_EQ_F(out[3], -4.0f - (0.25f + 0.5f));
	CHECK_EQ_F(out[0], 2.0f - (0.25f + 0.5f));
	CHECK_EQ_F(out[1], -2.0f); /* only in the prompt */
	CHECK_EQ_F(out[5], 1.0f);
	/* negative penalties raise */
	p.presence_penalty = -1;
	p.frequency_penalty = 0;
	CHECK_EQ_I(md_sampler_transform(&sm, &p, &ctx, in, out), 0);
	CHECK_EQ_F(out[3], -3.0f);

	/* order: bias before the repetition penalty (1 - 3 = -2, then * 2 = -4; the other way
	 * round would give 0.5 - 3 = -2.5) */
	struct md_logit_bias lb = { 4, -3 };
	md_sampling_default(&p);
	p.logit_bias = &lb;
	p.n_logit_bias = 1;
	p.repetition_penalty = 2;
	int32_t g4 = 4;
	struct md_sampler_ctx c4 = { .gen = &g4, .n_gen = 1 };
	CHECK_EQ_I(md_sampler_transform(&sm, &p, &c4, in, out), 0);
	CHECK_EQ_F(out[4], -4.0f);
	md_sampler_release(&sm);
}

/* The UBSan find: a presence/frequency penalty on the first generated token sorted a NULL
 * history (qsort(NULL, 0, ...)); the sanitizer build stopped the server there. */
static void test_penalties_empty_history(void)
{
	struct md_sampler sm;
	struct md_sampling p;
	struct md_sample_out o;
	float out[V];
	struct md_sampler_ctx ctx = { 0 };
	CHECK_EQ_I(md_sampler_init(&sm, V, 7), 0);
	md_sampling_default(&p);
	p.temperature = 0;
	p.presence_penalty = 1;
	p.frequency_penalty = 1;
	p.repetition_penalty = 1.5f;
	CHECK_EQ_I(md_sampler_transform(&sm, &p, &ctx, logits, out), 0);
	CHECK_EQ_I(memcmp(out, logits, sizeof(out)), 0); /* nothing to penalise */
	CHECK_EQ_I(md_sampler_sample(&sm, &p, logits, NULL, 0, NULL, 0, &o), 0);
	CHECK_EQ_I(o.token, best);
	md_sampler_release(&sm);
}

static void test_mask(void)
{
	struct md_sampler sm;
	struct md_sampling p;
	struct md_sampler_dist d;
	uint32_t bits[(V + 31) / 32] = { 0 };
	static float out[V];
	/* 999 sits in the last, partial word (V is not a multiple of 32) */
	const int32_t allow[4] = { 3, 40, 500, 999 };
	for (int i = 0; i < 4; i++)
		bitmap_allow(bits, allow[i]);
	struct md_sampler_ctx ctx = { .allowed = bits };
	CHECK_EQ_I(md_sampler_init(&sm, V, 5), 0);
	CHECK_EQ_I(md_sampler_dist_init(&d, V), 0);

	md_sampling_default(&p);
	CHECK_EQ_I(md_sampler_transform(&sm, &p, &ctx, logits, out), 0);
	int n_allowed = 0;
	for (int i = 0; i < V; i++) {
		if (out[i] == -INFINITY)
			continue;
		n_allowed++;
		CHECK_EQ_F(out[i], logits[i]);
	}
	CHECK_EQ_I(n_allowed, 4);
	/* the distribution and the draws stay inside the mask */
	CHECK_EQ_I(md_sampler_dist_build(&d, &p, out), 0);
	CHECK_EQ_U(d.n, 4);
	double mass = 0;
	for (int i = 0; i < 4; i++)
		mass += md_sampler_dist_prob(&d, allow[i]);
	CHECK_NEAR(mass, 1.0, 1e-6);
	for (int i = 0; i < 1000; i++) {
		int32_t t = md_sampler_draw(&sm, &d);
		CHECK(t == 3 || t == 40 || t == 500 || t == 999);
	}
	/* greedy picks the best allowed token, not the global argmax */
	int32_t want = allow[0];
	for (int i = 1; i < 4; i++)
		if (logits[allow[i]] > logits[want])
			want = allow[i];
	p.temperature = 0;
	CHECK_EQ_I(md_sampler_dist_build(&d, &p, out), 0);
	CHECK_EQ_I(md_sampler_draw(&sm, &d), want);

	/* the mask is the last transform: a bias cannot lift a masked token */
	struct md_logit_bias lb = { best, 100 };
	p.logit_bias = &lb;
	p.n_logit_bias = 1;
	CHECK(best != 3 && best != 40 && best != 500 && best != 999);
	CHECK_EQ_I(md_sampler_transform(&sm, &p, &ctx, logits, out), 0);
	CHECK(out[best] == -INFINITY);
	CHECK_EQ_I(md_sampler_dist_build(&d, &p, out), 0);
	CHECK_EQ_I(md_sampler_draw(&sm, &d), want);

	/* a mask that allows nothing leaves nothing to draw */
	memset(bits, 0, sizeof(bits));
	md_sampling_default(&p);
	CHECK_EQ_I(md_sampler_transform(&sm, &p, &ctx, logits, out), 0);
	CHECK_EQ_I(md_sampler_dist_build(&d, &p, out), -EDOM);
	CHECK_EQ_U(d.n, 0);
	CHECK_EQ_I(md_sampler_draw(&sm, &d), -1);
	CHECK_EQ_F(md_sampler_dist_prob(&d, 3), 0.0f);
	md_sampler_dist_release(&d);
	md_sampler_release(&sm);
}

/* ---- stage (b) ------------------------------------------------------------------------- */

/* softmax(l / t) over the ids in keep (others 0), in double. */
static void ref_softmax(const float *l, int n, double t, const int *keep, double *out)
{
	double mx = -INFINITY, z = 0;
	for (int i = 0; i < n; i++)
		if (keep[i] && l[i] > mx)
			mx = l[i];
	for (int i = 0; i < n; i++) {
		out[i] = keep[i] ? exp((l[i] - mx) / t) : 0;
		z += out[i];
	}
	for (int i = 0; i < n; i++)
		out[i] /= z;
}

static void check_dist(const struct md_sampler_dist *d, const double *want, int n, int line)
{
	double total = 0;
	int n_support = 0;
	for (int i = 0; i < n; i++) {
		float got = md_sampler_dist_prob(d, i);
		if (!(fabs(got - want[i]) <= 1e-6)) {
			fprintf(stderr, "%s:%d (from line %d): p(%d) = %.9g, want %.9g\n", __FILE__,
				__LINE__, line, i, got, want[i]);
			failures++;
		}
		n_support += want[i] > 0;
		total += got;
	}
	CHECK_EQ_U(d->n, n_support);
	CHECK_NEAR(total, 1.0, 1e-6);
	double at = 0;
	for (uint32_t i = 0; i < d->n; i++) {
		CHECK(want[d->id[i]] > 0);
		at += md_sampler_dist_prob_at(d, i);
	}
	CHECK_NEAR(at, 1.0, 1e-6);
}

static void test_dist_filters(void)
{
	/* p at T = 1 is about .05 .23 .09 .01 .62 .00 ... in id order: 4 > 1 > 2 > 0 > 3 > rest */
	const float l[10] = { 0.5f, 2.0f, 1.0f, -1.0f, 3.0f, -5.0f, -6.0f, -7.0f, -8.0f, -9.0f };
	const int all[10] = { 1, 1, 1, 1, 1, 1, 1, 1, 1, 1 };
	double want[10];
	struct md_sampler_dist d;
	struct md_sampling p;
	CHECK_EQ_I(md_sampler_dist_init(&d, 10), 0);

	md_sampling_default(&p);
	CHECK_EQ_I(md_sampler_dist_build(&d, &p, l), 0);
	ref_softmax(l, 10, 1.0, all, want);
	check_dist(&d, want, 10, __LINE__);
	CHECK(!d.greedy);

	/* temperature sharpens: p(4) / p(1) = exp((3 - 2) / 0.5) */
	p.temperature = 0.5f;
	CHECK_EQ_I(md_sampler_dist_build(&d, &p, l), 0);
	ref_softmax(l, 10, 0.5, all, want);
	check_dist(&d, want, 10, __LINE__);
	CHECK_NEAR(md_sampler_dist_prob(&d, 4) / md_sampler_dist_prob(&d, 1), exp(2.0), 1e-4);

	/* top_k = 3 keeps 4, 1, 2 and renormalises */
	md_sampling_default(&p);
	p.top_k = 3;
	CHECK_EQ_I(md_sampler_dist_build(&d, &p, l), 0);
	const int k3[10] = { 0, 1, 1, 0, 1 };
	ref_softmax(l, 10, 1.0, k3, want);
	check_dist(&d, want, 10, __LINE__);

	/* min_p = 0.1: keep p >= 0.1 * p(4), i.e. logit >= 3 + ln 0.1 = 0.697: 4, 1, 2 */
	md_sampling_default(&p);
	p.min_p = 0.1f;
	CHECK_EQ_I(md_sampler_dist_build(&d, &p, l), 0);
	check_dist(&d, want, 10, __LINE__);

	/* top_p = 0.8: p(4) = .62 < .8, p(4) + p(1) = .85 >= .8: the nucleus is {4, 1}, sorted */
	md_sampling_default(&p);
	p.top_p = 0.8f;
	CHECK_EQ_I(md_sampler_dist_build(&d, &p, l), 0);
	const int n2[10] = { 0, 1, 0, 0, 1 };
	ref_softmax(l, 10, 1.0, n2, want);
	check_dist(&d, want, 10, __LINE__);
	CHECK_EQ_I(d.id[0], 4);
	CHECK_EQ_I(d.id[1], 1);

	/* filters compose: top_k 4 keeps {4, 1, 2, 0}, min_p .09 drops 0, top_p .99 keeps the
	 * three left ((e^3 + e^2) / (e^3 + e^2 + e) = .91 < .99) */
	md_sampling_default(&p);
	p.top_k = 4;
	p.min_p = 0.09f; /* p(0) / p(4) = exp(0.5 - 3) = 0.082 */
	p.top_p = 0.99f;
	CHECK_EQ_I(md_sampler_dist_build(&d, &p, l), 0);
	ref_softmax(l, 10, 1.0, k3, want);
	check_dist(&d, want, 10, __LINE__);

	/* greedy: a point mass on the argmax, whatever the filters */
	md_sampling_default(&p);
	p.temperature = 0;
	p.top_k = 2;
	CHECK_EQ_I(md_sampler_dist_build(&d, &p, l), 0);
	CHECK(d.greedy);
	CHECK_EQ_U(d.n, 1);
	CHECK_EQ_I(d.id[0], 4);
	CHECK_EQ_F(md_sampler_dist_prob(&d, 4), 1.0f);
	CHECK_EQ_F(md_sampler_dist_prob(&d, 1), 0.0f);
	CHECK_EQ_F(md_sampler_dist_prob_at(&d, 0), 1.0f);

	/* lookups outside the vocabulary are 0 */
	md_sampling_default(&p);
	CHECK_EQ_I(md_sampler_dist_build(&d, &p, l), 0);
	CHECK_EQ_F(md_sampler_dist_prob(&d, -1), 0.0f);
	CHECK_EQ_F(md_sampler_dist_prob(&d, 10), 0.0f);
	md_sampler_dist_release(&d);
}

/* Ties: equal logits are ordered by id, so top-k and top-p cut between equals by id. */
static void test_dist_ties(void)
{
	const float l[6] = { 1, 2, 2, 2, 1, 0 };
	struct md_sampler_dist d;
	struct md_sampling p;
	CHECK_EQ_I(md_sampler_dist_init(&d, 6), 0);
	md_sampling_default(&p);
	p.top_k = 2;
	CHECK_EQ_I(md_sampler_dist_build(&d, &p, l), 0);
	CHECK_NEAR(md_sampler_dist_prob(&d, 1), 0.5, 1e-7);
	CHECK_NEAR(md_sampler_dist_prob(&d, 2), 0.5, 1e-7);
	CHECK_EQ_F(md_sampler_dist_prob(&d, 3), 0.0f);
	md_sampling_default(&p);
	p.top_p = 0.5f; /* 3 x e^2 / (3 e^2 + 2 e + 1) = 0.77: two of the three 2s are enough */
	CHECK_EQ_I(md_sampler_dist_build(&d, &p, l), 0);
	CHECK_EQ_U(d.n, 2);
	CHECK_EQ_I(d.id[0], 1);
	CHECK_EQ_I(d.id[1], 2);
	CHECK_EQ_F(md_sampler_dist_prob(&d, 3), 0.0f);
	p.temperature = 0;
	CHECK_EQ_I(md_sampler_dist_build(&d, &p, l), 0);
	CHECK_EQ_I(d.id[0], 1);
	md_sampler_dist_release(&d);
}

/* Top-p over a large, flat vocabulary makes the nucleus sort run over thousands of ids with
 * many equal keys: the support must be the best-first prefix of a brute-force ranking. */
static void test_dist_top_p_large(void)
{
	enum { N = 20000 };
	static float l[N];
	static int32_t rank[N];
	struct md_sampler_dist d;
	struct md_sampling p;
	uint64_t s = 99;
	for (int i = 0; i < N; i++) {
		s = s * 6364136223846793005ull + 1442695040888963407ull;
		l[i] = (float)(s >> 56) / 64.0f; /* 256 distinct values: many ties */
	}
	CHECK_EQ_I(md_sampler_dist_init(&d, N), 0);
	md_sampling_default(&p);
	p.top_p = 0.9f;
	CHECK_EQ_I(md_sampler_dist_build(&d, &p, l), 0);
	CHECK(d.n > 1000 && d.n < N);
	/* best-first with the lowest id on ties, and nothing better left outside */
	int sorted = 1;
	for (uint32_t i = 1; i < d.n; i++) {
		float a = l[d.id[i - 1]], b = l[d.id[i]];
		sorted &= a > b || (a == b && d.id[i - 1] < d.id[i]);
	}
	CHECK(sorted);
	int32_t worst = d.id[d.n - 1];
	int n_better = 0;
	for (int i = 0; i < N; i++) {
		rank[i] = l[i] > l[worst] || (l[i] == l[worst] && i <= worst);
		n_better += rank[i];
		if ((md_sampler_dist_prob(&d, i) > 0) != rank[i]) {
			fprintf(stderr, "%s:%d: membership of %d wrong\n", __FILE__, __LINE__, i);
			failures++;
			break;
		}
	}
	CHECK_EQ_I(n_better, d.n);
	/* the nucleus is the smallest such prefix: without its last entry the mass is short */
	double mass = 0;
	for (uint32_t i = 0; i + 1 < d.n; i++)
		mass += md_sampler_dist_prob_at(&d, i);
	double total = 0, kept = 0;
	for (int i = 0; i < N; i++) {
		double w = exp((double)l[i] - 255.0 / 64.0);
		total += w;
		kept += rank[i] ? w : 0;
	}
	CHECK(kept / total >= 0.9 - 1e-6);
	CHECK(mass * kept / total < 0.9 + 1e-6);
	md_sampler_dist_release(&d);
}

/* NaN and +-inf. Before the split, greedy returned token 0 whenever logits[0] was NaN, and any
 * row without a finite logit gave token 0 (the comment claimed a "raw argmax"). */
static void test_dist_nonfinite(void)
{
	struct md_sampler sm;
	struct md_sampler_dist d;
	struct md_sampling p;
	struct md_sample_out o;
	float l[6] = { NAN, 1, 3, -INFINITY, 2, NAN };
	CHECK_EQ_I(md_sampler_init(&sm, 6, 1), 0);
	CHECK_EQ_I(md_sampler_dist_init(&d, 6), 0);
	md_sampling_default(&p);
	p.temperature = 0;
	CHECK_EQ_I(md_sampler_sample(&sm, &p, l, NULL, 0, NULL, 0, &o), 0);
	CHECK_EQ_I(o.token, 2);
	md_sampling_default(&p);
	CHECK_EQ_I(md_sampler_dist_build(&d, &p, l), 0);
	CHECK_EQ_U(d.n, 3);
	CHECK_EQ_F(md_sampler_dist_prob(&d, 0), 0.0f);
	CHECK_EQ_F(md_sampler_dist_prob(&d, 3), 0.0f);
	CHECK_EQ_F(md_sampler_dist_prob(&d, 5), 0.0f);
	/* +inf tokens share the mass */
	float inf2[6] = { 0, INFINITY, 5, INFINITY, NAN, -INFINITY };
	CHECK_EQ_I(md_sampler_dist_build(&d, &p, inf2), 0);
	CHECK_EQ_F(md_sampler_dist_prob(&d, 1), 0.5f);
	CHECK_EQ_F(md_sampler_dist_prob(&d, 3), 0.5f);
	CHECK_EQ_F(md_sampler_dist_prob(&d, 2), 0.0f);
	/* nothing finite: an error, not an invented token */
	float none[6] = { NAN, -INFINITY, NAN, -INFINITY, -INFINITY, NAN };
	for (int greedy = 0; greedy < 2; greedy++) {
		p.temperature = greedy ? 0 : 1;
		CHECK_EQ_I(md_sampler_dist_build(&d, &p, none), -EDOM);
		CHECK_EQ_I(md_sampler_sample(&sm, &p, none, NULL, 0, NULL, 0, &o), -EDOM);
	}
	md_sampler_dist_release(&d);
	md_sampler_release(&sm);
}

/* ---- stage (c) ------------------------------------------------------------------------- */

/* Draw frequencies against the distribution for a fixed seed: 200,000 draws, each frequency
 * within 5 standard deviations (sqrt(p (1 - p) / n)) of p; ids outside the support never. */
static void test_draw_frequencies(void)
{
	enum { DRAWS = 200000 };
	const float l[8] = { 1.0f, 0.2f, 2.0f, -0.5f, 1.5f, 0.0f, -3.0f, 0.9f };
	struct md_sampler sm;
	struct md_sampler_dist d;
	struct md_sampling p;
	long count[8] = { 0 };
	CHECK_EQ_I(md_sampler_init(&sm, 8, 2024), 0);
	CHECK_EQ_I(md_sampler_dist_init(&d, 8), 0);
	md_sampling_default(&p);
	p.temperature = 0.8f;
	p.top_k = 6; /* drops 3 and 6 */
	CHECK_EQ_I(md_sampler_dist_build(&d, &p, l), 0);
	for (int i = 0; i < DRAWS; i++) {
		int32_t t = md_sampler_draw(&sm, &d);
		CHECK(t >= 0 && t < 8);
		if (t >= 0 && t < 8)
			count[t]++;
	}
	CHECK_EQ_I(count[3], 0);
	CHECK_EQ_I(count[6], 0);
	for (int t = 0; t < 8; t++) {
		double pt = md_sampler_dist_prob(&d, t);
		double tol = 5 * sqrt(pt * (1 - pt) / DRAWS) + 1e-9;
		CHECK_NEAR((double)count[t] / DRAWS, pt, tol);
	}
	md_sampler_dist_release(&d);
	md_sampler_release(&sm);
}

/* Greedy draws use no randomness: the RNG state is unchanged, so a greedy step in the middle
 * of a seeded sequence does not shift the tokens after it. Same seed, same sequence; another
 * seed, another. */
static void test_draw_rng(void)
{
	struct md_sampler a, b, c;
	struct md_sampling p, g;
	struct md_sample_out o;
	CHECK_EQ_I(md_sampler_init(&a, V, 42), 0);
	CHECK_EQ_I(md_sampler_init(&b, V, 42), 0);
	CHECK_EQ_I(md_sampler_init(&c, V, 43), 0);
	md_sampling_default(&p);
	p.temperature = 1.5f;
	md_sampling_default(&g);
	g.temperature = 0;
	int same_ac = 1;
	for (int i = 0; i < 32; i++) {
		if (i % 4 == 0) {
			uint64_t r0 = a.rng[0], r1 = a.rng[1];
			CHECK_EQ_I(sample(&a, &g, logits, NULL, 0, &o), best);
			CHECK_EQ_U(a.rng[0], r0);
			CHECK_EQ_U(a.rng[1], r1);
		}
		int32_t ta = sample(&a, &p, logits, NULL, 0, &o);
		CHECK_EQ_I(ta, sample(&b, &p, logits, NULL, 0, &o));
		same_ac &= ta == sample(&c, &p, logits, NULL, 0, &o);
	}
	CHECK(!same_ac);
	double u = md_sampler_uniform(&a);
	CHECK(u >= 0 && u < 1);
	md_sampler_release(&a);
	md_sampler_release(&b);
	md_sampler_release(&c);
}

/* ---- speculative decoding: p(token), residual, and the rejection rule ------------------- */

static void test_residual(void)
{
	const float lp[5] = { 2.0f, 1.0f, 0.0f, 0.5f, -1.0f };  /* target */
	const float lq[5] = { 0.0f, 2.0f, 0.0f, 0.5f, 1.0f };   /* draft */
	struct md_sampler_dist dp, dq, dr;
	struct md_sampling p;
	struct md_sampler sm;
	CHECK_EQ_I(md_sampler_init(&sm, 5, 77), 0);
	CHECK_EQ_I(md_sampler_dist_init(&dp, 5), 0);
	CHECK_EQ_I(md_sampler_dist_init(&dq, 5), 0);
	CHECK_EQ_I(md_sampler_dist_init(&dr, 5), 0);
	md_sampling_default(&p);
	CHECK_EQ_I(md_sampler_dist_build(&dp, &p, lp), 0);
	CHECK_EQ_I(md_sampler_dist_build(&dq, &p, lq), 0);
	CHECK_EQ_I(md_sampler_dist_residual(&dr, &dp, &dq), 0);
	double want[5], z = 0;
	for (int t = 0; t < 5; t++) {
		double x = (double)md_sampler_dist_prob(&dp, t) - md_sampler_dist_prob(&dq, t);
		want[t] = x > 0 ? x : 0;
		z += want[t];
	}
	for (int t = 0; t < 5; t++)
		want[t] /= z;
	check_dist(&dr, want, 5, __LINE__);
	CHECK_EQ_F(md_sampler_dist_prob(&dr, 1), 0.0f); /* q(1) > p(1) */

	/* The rejection rule with these calls reproduces p: draft x ~ q, accept with probability
	 * min(1, p(x)/q(x)), else draw from the residual. 200,000 rounds, 5 sigma. */
	enum { ROUNDS = 200000 };
	long count[5] = { 0 };
	for (int i = 0; i < ROUNDS; i++) {
		int32_t x = md_sampler_draw(&sm, &dq);
		double px = md_sampler_dist_prob(&dp, x), qx = md_sampler_dist_prob(&dq, x);
		if (md_sampler_uniform(&sm) < px / qx)
			count[x]++;
		else
			count[md_sampler_draw(&sm, &dr)]++;
	}
	for (int t = 0; t < 5; t++) {
		double pt = md_sampler_dist_prob(&dp, t);
		CHECK_NEAR((double)count[t] / ROUNDS, pt, 5 * sqrt(pt * (1 - pt) / ROUNDS));
	}

	/* p == q: nothing is positive, r is p */
	CHECK_EQ_I(md_sampler_dist_residual(&dr, &dp, &dp), 0);
	for (int t = 0; t < 5; t++)
		CHECK_EQ_F(md_sampler_dist_prob(&dr, t), md_sampler_dist_prob(&dp, t));

	/* a greedy target: the residual is the point mass (p - q)+ = 1 - q at the argmax */
	p.temperature = 0;
	CHECK_EQ_I(md_sampler_dist_build(&dp, &p, lp), 0);
	CHECK_EQ_I(md_sampler_dist_residual(&dr, &dp, &dq), 0);
	CHECK_EQ_U(dr.n, 1);
	CHECK_EQ_F(md_sampler_dist_prob(&dr, 0), 1.0f);
	CHECK_EQ_I(md_sampler_draw(&sm, &dr), 0);
	md_sampler_dist_release(&dp);
	md_sampler_dist_release(&dq);
	md_sampler_dist_release(&dr);
	md_sampler_release(&sm);
}

/* ---- logprobs ---------------------------------------------------------------------------- */

static void test_logprobs(void)
{
	struct md_sampler sm;
	struct md_sampling p;
	struct md_sample_out o;
	CHECK_EQ_I(md_sampler_init(&sm, V, 1), 0);
	md_sampling_default(&p);
	p.temperature = 0;
	p.top_logprobs = 3;
	/* a bias moves the token but logprobs stay those of the raw logits */
	struct md_logit_bias lb = { 3, 100 };
	p.logit_bias = &lb;
	p.n_logit_bias = 1;
	CHECK_EQ_I(sample(&sm, &p, logits, NULL, 0, &o), 3);
	double z = 0;
	for (int i = 0; i < V; i++)
		z += exp(logits[i] - logits[best]);
	double lse = logits[best] + log(z);
	CHECK_NEAR(o.logprob, logits[3] - lse, 1e-4);
	CHECK_EQ_U(o.n_top, 3);
	CHECK_EQ_I(o.top_id[0], best);
	CHECK_NEAR(o.top_logprob[0], -log(z), 1e-4);
	CHECK(o.top_logprob[0] > o.top_logprob[1] && o.top_logprob[1] > o.top_logprob[2]);

	/* more than MD_SAMPLER_MAX_TOP is clamped, and the list is the best MD_SAMPLER_MAX_TOP */
	p.top_logprobs = 50;
	p.n_logit_bias = 0;
	CHECK_EQ_I(sample(&sm, &p, logits, NULL, 0, &o), best);
	CHECK_EQ_U(o.n_top, MD_SAMPLER_MAX_TOP);
	for (int i = 0; i < MD_SAMPLER_MAX_TOP; i++) /* logits are 9.99, 9.98, ... */
		CHECK_NEAR(logits[o.top_id[i]], 9.99 - 0.01 * i, 1e-5);
	/* no logprobs requested: zeros */
	p.top_logprobs = -1;
	sample(&sm, &p, logits, NULL, 0, &o);
	CHECK_EQ_F(o.logprob, 0.0f);
	CHECK_EQ_U(o.n_top, 0);
	md_sampler_release(&sm);

	/* ties go to the lower id; n_top is clamped to the vocabulary */
	const float l[4] = { 1, 5, 5, 1 };
	md_sampler_logprobs(l, 4, 3, 20, &o);
	CHECK_EQ_I(o.token, 3);
	CHECK_EQ_U(o.n_top, 4);
	CHECK_EQ_I(o.top_id[0], 1);
	CHECK_EQ_I(o.top_id[1], 2);
	CHECK_EQ_I(o.top_id[2], 0);
	CHECK_EQ_I(o.top_id[3], 3);
	CHECK_EQ_F(o.top_logprob[2], o.logprob);
	/* a tie across the cut: of three equal best, the two lowest ids */
	const float l5[5] = { 5, 1, 5, 5, 0 };
	md_sampler_logprobs(l5, 5, 0, 2, &o);
	CHECK_EQ_U(o.n_top, 2);
	CHECK_EQ_I(o.top_id[0], 0);
	CHECK_EQ_I(o.top_id[1], 2);
}

/* ---- the whole pipeline, against the sampler before the split ----------------------------
 * Tokens printed by the single-function md_sampler_sample (commit e62ab1c) for the rows and
 * seeds below; the staged one must give every one of them (greedy bit-identical, seeded
 * sampling identical), which also pins the top-k permutation and the draw order. */
static const int32_t want_greedy[16] = { 642, 321, 284, 247, 605, 963, 247, 210, 321, 926, 210,
					 321, 284, 642, 321, 284 };
static const int32_t want_temp[32] = { 939, 980, 593, 374, 38, 387, 572, 628, 941, 918, 101,
				       656, 125, 149, 371, 138, 611, 683, 742, 644, 136, 284,
				       914, 407, 274, 99, 321, 224, 668, 605, 446, 778 };
static const int32_t want_top_k[32] = { 383, 494, 247, 25, 272, 346, 593, 87, 482, 642, 618,
					321, 963, 605, 889, 99, 741, 124, 729, 99, 951, 346,
					556, 630, 99, 544, 951, 568, 568, 568, 667, 778 };
static const int32_t want_top_p[32] = { 199, 779, 828, 680, 519, 334, 667, 828, 680, 939, 903,
					75, 741, 618, 162, 336, 62, 952, 520, 593, 471, 198,
					815, 87, 309, 174, 446, 445, 815, 285, 100, 927 };
static const int32_t want_all[48] = { 852, 3, 346, 520, 235, 840, 457, 631, 13, 815, 964, 25,
				      470, 247, 173, 359, 865, 186, 458, 112, 495, 210, 791,
				      593, 63, 926, 889, 149, 507, 531, 988, 260, 717, 803,
				      630, 568, 705, 284, 951, 87, 272, 642, 963, 594, 421,
				      866, 199, 1 };
static const int32_t want_greedy_pen[32] = { 642, 321, 284, 247, 605, 963, 99, 210, 568, 926,
					     62, 173, 531, 889, 25, 136, 494, 852, 383, 346,
					     457, 815, 741, 309, 420, 778, 704, 272, 630, 988,
					     667, 235 };

/* Step i samples from logits plus a small per-step wobble, with prompt {5, 17, 5, 999} and,
 * when feed, the tokens generated so far as the history. */
static void check_run(const char *name, const struct md_sampling *p, uint64_t seed,
		      const int32_t *want, int n, int feed)
{
	struct md_sampler sm;
	struct md_sample_out o;
	const int32_t prompt[4] = { 5, 17, 5, 999 };
	int32_t gen[64];
	static float row[V], copy[V];
	CHECK_EQ_I(md_sampler_init(&sm, V, seed), 0);
	for (int i = 0; i < n; i++) {
		for (int j = 0; j < V; j++)
			row[j] = logits[j] + (float)((j * 31 + i * 17) % 13) * 0.05f;
		memcpy(copy, row, sizeof(row));
		CHECK_EQ_I(md_sampler_sample(&sm, p, row, prompt, 4, gen, feed ? (uint32_t)i : 0, &o),
			   0);
		CHECK_EQ_I(memcmp(copy, row, sizeof(row)), 0); /* logits are read only */
		if (o.token != want[i]) {
			fprintf(stderr, "%s:%d: %s step %d: token %d, want %d\n", __FILE__, __LINE__,
				name, i, o.token, want[i]);
			failures++;
			break;
		}
		gen[i] = o.token;
	}
	md_sampler_release(&sm);
}

static void test_pipeline_golden(void)
{
	struct md_sampling p;
	md_sampling_default(&p);
	p.temperature = 0;
	check_run("greedy", &p, 1, want_greedy, 16, 0);
	md_sampling_default(&p);
	p.temperature = 1.5f;
	check_run("temp", &p, 42, want_temp, 32, 0);
	md_sampling_default(&p);
	p.temperature = 0.9f;
	p.top_k = 40;
	check_run("top_k", &p, 7, want_top_k, 32, 0);
	md_sampling_default(&p);
	p.temperature = 1.2f;
	p.top_p = 0.8f;
	check_run("top_p", &p, 9, want_top_p, 32, 0);
	struct md_logit_bias lb[3] = { { 3, 4.0f }, { 500, -2.0f }, { 2000, 50.0f } };
	md_sampling_default(&p);
	p.top_k = 100;
	p.top_p = 0.95f;
	p.min_p = 0.2f;
	p.presence_penalty = 0.5f;
	p.frequency_penalty = 0.3f;
	p.repetition_penalty = 1.2f;
	p.logit_bias = lb;
	p.n_logit_bias = 3;
	check_run("all", &p, 11, want_all, 48, 1);
	md_sampling_default(&p);
	p.temperature = 0;
	p.presence_penalty = 1.5f;
	p.repetition_penalty = 1.3f;
	check_run("greedy_pen", &p, 1, want_greedy_pen, 32, 1);

	/* logprobs, bit for bit */
	static const int32_t want_lp_id[5] = { 321, 642, 963, 284, 605 };
	static const uint32_t want_lp_bits[5] = { 0xc093861c, 0xc093d808, 0xc09429f2, 0xc0947bde,
						  0xc094cdca };
	struct md_sampler sm;
	struct md_sample_out o;
	md_sampling_default(&p);
	p.top_logprobs = 5;
	CHECK_EQ_I(md_sampler_init(&sm, V, 3), 0);
	CHECK_EQ_I(md_sampler_sample(&sm, &p, logits, NULL, 0, NULL, 0, &o), 0);
	CHECK_EQ_I(o.token, 766);
	uint32_t bits;
	memcpy(&bits, &o.logprob, 4);
	CHECK_EQ_U(bits, 0xc0a1ec82);
	CHECK_EQ_U(o.n_top, 5);
	for (int k = 0; k < 5; k++) {
		CHECK_EQ_I(o.top_id[k], want_lp_id[k]);
		memcpy(&bits, &o.top_logprob[k], 4);
		CHECK_EQ_U(bits, want_lp_bits[k]);
	}
	md_sampler_release(&sm);
}

/* The staged calls compose to md_sampler_sample: same tokens from the same seed. */
static void test_stages_compose(void)
{
	struct md_sampler a, b;
	struct md_sampler_dist d;
	struct md_sampling p;
	struct md_sample_out o;
	static float w[V];
	int32_t gen[40];
	CHECK_EQ_I(md_sampler_init(&a, V, 5), 0);
	CHECK_EQ_I(md_sampler_init(&b, V, 5), 0);
	CHECK_EQ_I(md_sampler_dist_init(&d, V), 0);
	md_sampling_default(&p);
	p.temperature = 0.7f;
	p.top_k = 50;
	p.top_p = 0.9f;
	p.frequency_penalty = 0.4f;
	for (int i = 0; i < 40; i++) {
		CHECK_EQ_I(md_sampler_sample(&a, &p, logits, NULL, 0, gen, (uint32_t)i, &o), 0);
		struct md_sampler_ctx ctx = { .gen = gen, .n_gen = (uint32_t)i };
		CHECK_EQ_I(md_sampler_transform(&b, &p, &ctx, logits, w), 0);
		CHECK_EQ_I(md_sampler_dist_build(&d, &p, w), 0);
		int32_t t = md_sampler_draw(&b, &d);
		CHECK_EQ_I(t, o.token);
		CHECK(md_sampler_dist_prob(&d, t) > 0);
		gen[i] = o.token;
	}
	md_sampler_dist_release(&d);
	md_sampler_release(&a);
	md_sampler_release(&b);
}

int main(void)
{
	init_logits();
	test_bias();
	test_penalties();
	test_penalties_empty_history();
	test_mask();
	test_dist_filters();
	test_dist_ties();
	test_dist_top_p_large();
	test_dist_nonfinite();
	test_draw_frequencies();
	test_draw_rng();
	test_residual();
	test_logprobs();
	test_pipeline_golden();
	test_stages_compose();
	if (failures) {
		fprintf(stderr, "sampler: %d check(s) failed\n", failures);
		return 1;
	}
	printf("sampler: all checks passed\n");
	return 0;
}
