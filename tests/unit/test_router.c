/* Unit tests for MoE routing: softmax top-k selection (ties, renormalisation), the scored
 * selection of DeepSeek-V3/GLM-4.5 (sigmoid, selection bias, expert groups, routed scale) and
 * the expert-major grouping the expert compute relies on. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/router.h"
#include "tests/check.h"

static struct md_hparams hparams(uint32_t E, uint32_t k, bool norm)
{
	struct md_hparams hp;
	memset(&hp, 0, sizeof(hp));
	hp.arch = MD_ARCH_QWEN3MOE;
	hp.n_expert = E;
	hp.n_expert_used = k;
	hp.norm_topk = norm;
	return hp;
}

/* Softmax probability of expert e for logits row l (E), in double. */
static double prob(const float *l, int E, int e)
{
	double mx = l[0], s = 0;
	for (int i = 1; i < E; i++)
		mx = l[i] > mx ? l[i] : mx;
	for (int i = 0; i < E; i++)
		s += exp((double)l[i] - mx);
	return exp((double)l[e] - mx) / s;
}

/* The grouping is a permutation of the (token, choice) pairs, expert-major, tokens
 * ascending within an expert, with the choice's weight; active lists the non-empty experts. */
static void check_grouping(const struct md_routing *r)
{
	const int E = r->n_expert, K = r->n_used, n = r->n_tokens;
	CHECK_EQ_I(r->off[0], 0);
	CHECK_EQ_I(r->off[E], n * K);
	int na = 0;
	for (int e = 0; e < E; e++) {
		CHECK(r->off[e] <= r->off[e + 1]);
		if (r->off[e] < r->off[e + 1]) {
			CHECK(na < r->n_active && r->active[na] == e);
			na++;
		}
		for (int s = r->off[e]; s < r->off[e + 1]; s++) {
			int t = r->tok[s];
			CHECK(t >= 0 && t < n);
			if (s > r->off[e])
				CHECK(r->tok[s - 1] < t);
			int found = 0;
			for (int k = 0; k < K; k++)
				if (r->ids[t * K + k] == e) {
					found++;
					CHECK_EQ_F(r->tok_w[s], r->w[t * K + k]);
				}
			CHECK_EQ_I(found, 1);
		}
	}
	CHECK_EQ_I(na, r->n_active);
}

static void test_fn_table(void)
{
	struct md_hparams hp = hparams(8, 2, false);
	for (int a = MD_ARCH_QWEN3MOE; a <= MD_ARCH_QWEN3; a++) {
		hp.arch = (enum md_arch)a;
		CHECK_EQ_I(md_route_fn_of(&hp), MD_ROUTE_SOFTMAX_TOPK);
	}
	hp.arch = MD_ARCH_DEEPSEEK2;
	CHECK_EQ_I(md_route_fn_of(&hp), MD_ROUTE_SCORED_TOPK);
	hp.arch = MD_ARCH_GLM4MOE;
	CHECK_EQ_I(md_route_fn_of(&hp), MD_ROUTE_SCORED_TOPK);
	CHECK(strcmp(md_route_fn_name(MD_ROUTE_SCORED_TOPK), "scored_topk") == 0);
	CHECK(strcmp(md_route_fn_name(MD_ROUTE_SOFTMAX_TOPK), "softmax_topk") == 0);
	CHECK(strcmp(md_route_fn_name(MD_ROUTE_FN_COUNT), "?") == 0);
	struct md_router r;
	struct md_hparams bad = hparams(4, 5, false);
	CHECK(md_router_init(&r, &bad, 4) < 0);
	bad = hparams(0, 0, false);
	CHECK(md_router_init(&r, &bad, 4) < 0);
	CHECK(md_router_init(&r, &hp, 0) < 0);
}

static void test_small(bool norm)
{
	enum { E = 6, K = 2, T = 4 };
	struct md_hparams hp = hparams(E, K, norm);
	struct md_router r;
	CHECK_EQ_I(md_router_init(&r, &hp, T), 0);
	static const float lg[T][E] = {
		{ 0, 1, 2, 3, 4, 5 },        /* top: 5 then 4 */
		{ 1, 1, 1, 1, 1, 1 },        /* all tied: the lowest ids, 0 then 1 */
		{ -1, 2, 0, 7, 2, -3 },      /* 3, then the tie 1 / 4 goes to 1 */
		{ 9, -9, 0.5f, 0.5f, 9, 0 }, /* 0 and 4 tied at the top */
	};
	static const int want[T][K] = { { 5, 4 }, { 0, 1 }, { 3, 1 }, { 0, 4 } };
	memcpy(r.logits, lg, sizeof(lg));
	const struct md_routing *rt = md_router_route(&r, T);
	CHECK_EQ_I(rt->n_tokens, T);
	for (int t = 0; t < T; t++) {
		double sum = 0;
		for (int k = 0; k < K; k++) {
			CHECK_EQ_I(rt->ids[t * K + k], want[t][k]);
			sum += prob(lg[t], E, want[t][k]);
		}
		for (int k = 0; k < K; k++) {
			double p = prob(lg[t], E, want[t][k]);
			double expect = norm ? p / sum : p;
			CHECK(fabs(rt->w[t * K + k] - expect) < 1e-6);
		}
	}
	/* Experts 0, 1, 3, 4, 5 are used; 2 is not. */
	CHECK_EQ_I(rt->n_active, 5);
	CHECK_EQ_I(rt->off[1] - rt->off[0], 2); /* expert 0: tokens 1 and 3 */
	CHECK_EQ_I(rt->tok[rt->off[0]], 1);
	CHECK_EQ_I(rt->tok[rt->off[0] + 1], 3);
	CHECK_EQ_I(rt->off[3] - rt->off[2], 0);
	check_grouping(rt);
	md_router_release(&r);
}

/* Many tokens, many experts, fixed pseudo-random logits; then fewer tokens through the same
 * router (nothing of the previous call may leak into the next). */
static void test_random(void)
{
	enum { E = 64, K = 8, T = 37 };
	struct md_hparams hp = hparams(E, K, true);
	struct md_router r;
	CHECK_EQ_I(md_router_init(&r, &hp, T), 0);
	uint64_t x = 88172645463325252ull;
	float lg[T][E];
	for (int pass = 0; pass < 2; pass++) {
		int n = pass ? 5 : T;
		for (int t = 0; t < n; t++)
			for (int e = 0; e < E; e++) {
				x ^= x << 13, x ^= x >> 7, x ^= x << 17;
				lg[t][e] = (float)((double)(x >> 11) / 9007199254740992.0 * 8.0 - 4.0);
			}
		memcpy(r.logits, lg, (size_t)n * E * sizeof(float));
		const struct md_routing *rt = md_router_route(&r, n);
		for (int t = 0; t < n; t++) {
			const int32_t *ids = rt->ids + t * K;
			double wsum = 0;
			for (int k = 0; k < K; k++) {
				wsum += rt->w[t * K + k];
				if (k)
					CHECK(rt->w[t * K + k] <= rt->w[t * K + k - 1]);
				for (int j = 0; j < k; j++)
					CHECK(ids[j] != ids[k]);
			}
			CHECK(fabs(wsum - 1.0) < 1e-5);
			/* Every chosen logit is at least every unchosen one. */
			for (int e = 0; e < E; e++) {
				bool chosen = false;
				for (int k = 0; k < K; k++)
					chosen |= ids[k] == e;
				if (!chosen)
					CHECK(lg[t][e] <= lg[t][ids[K - 1]]);
			}
		}
		check_grouping(rt);
	}
	md_router_release(&r);
}

static float sigm(float x)
{
	return 1.0f / (1.0f + expf(-x));
}

/* Sigmoid scores, worked by hand. Logits of 8 experts: expert 7 scores highest, 6 next. */
static void test_scored(void)
{
	enum { E = 8, K = 2 };
	const float lg[E] = { 0.1f, -0.4f, 0.3f, 0.2f, -1.0f, 0.0f, 0.8f, 1.2f };
	struct md_hparams hp = hparams(E, K, false);
	hp.arch = MD_ARCH_DEEPSEEK2;
	hp.gating = MD_GATING_SIGMOID;
	struct md_router r;

	/* Plain: the two largest sigmoids, weights the sigmoids themselves. */
	CHECK_EQ_I(md_router_init(&r, &hp, 1), 0);
	memcpy(r.logits, lg, sizeof(lg));
	const struct md_routing *rt = md_router_route(&r, 1);
	CHECK_EQ_I(rt->ids[0], 7);
	CHECK_EQ_I(rt->ids[1], 6);
	CHECK_NEAR(rt->w[0], sigm(1.2f), 1e-6);
	CHECK_NEAR(rt->w[1], sigm(0.8f), 1e-6);

	/* A selection bias moves the choice, not the weights: +0.45 on expert 4 (score 0.27 +
	 * 0.45 = 0.72 > sigm(0.8) = 0.69) takes it second, with its unbiased weight. */
	float bias[E] = { 0 };
	bias[4] = 0.45f;
	memcpy(r.logits, lg, sizeof(lg));
	rt = md_router_route_bias(&r, 1, bias);
	CHECK_EQ_I(rt->ids[0], 7);
	CHECK_EQ_I(rt->ids[1], 4);
	CHECK_NEAR(rt->w[1], sigm(-1.0f), 1e-6);
	check_grouping(rt);
	md_router_release(&r);

	/* Renormalised and scaled by 2.5: the weights sum to 2.5. */
	hp.norm_topk = true;
	hp.expert_weights_scale = 2.5f;
	CHECK_EQ_I(md_router_init(&r, &hp, 1), 0);
	memcpy(r.logits, lg, sizeof(lg));
	rt = md_router_route(&r, 1);
	float s7 = sigm(1.2f), s6 = sigm(0.8f);
	CHECK_NEAR(rt->w[0], 2.5f * s7 / (s7 + s6), 1e-6);
	CHECK_NEAR(rt->w[0] + rt->w[1], 2.5f, 1e-5);
	md_router_release(&r);

	/* Four groups of two, one used: group scores (sum of both) are {0,1}: 0.93, {2,3}: 1.12,
	 * {4,5}: 0.77, {6,7}: 1.46, so only experts 6 and 7 may be taken; with a bias that lifts
	 * group {2,3} (+0.4 each: 1.92) above it, the choice is 2 then 3 although 7 scores more. */
	hp.norm_topk = false;
	hp.expert_weights_scale = 0.0f;
	hp.n_expert_groups = 4;
	hp.n_group_used = 1;
	CHECK_EQ_I(md_router_init(&r, &hp, 1), 0);
	memcpy(r.logits, lg, sizeof(lg));
	rt = md_router_route(&r, 1);
	CHECK_EQ_I(rt->ids[0], 7);
	CHECK_EQ_I(rt->ids[1], 6);
	float gb[E] = { 0, 0, 0.4f, 0.4f, 0, 0, 0, 0 };
	memcpy(r.logits, lg, sizeof(lg));
	rt = md_router_route_bias(&r, 1, gb);
	CHECK_EQ_I(rt->ids[0], 2);
	CHECK_EQ_I(rt->ids[1], 3);
	CHECK_NEAR(rt->w[0], sigm(0.3f), 1e-6);
	md_router_release(&r);

	/* Groups that cannot hold k experts are refused at init. */
	hp.n_expert_used = 3;
	CHECK(md_router_init(&r, &hp, 1) < 0);

	/* Softmax scores with the same machinery (DeepSeek-V2): weights are probabilities. */
	hp = hparams(E, K, false);
	hp.arch = MD_ARCH_DEEPSEEK2;
	hp.gating = MD_GATING_SOFTMAX;
	CHECK_EQ_I(md_router_init(&r, &hp, 1), 0);
	memcpy(r.logits, lg, sizeof(lg));
	rt = md_router_route(&r, 1);
	CHECK_EQ_I(rt->ids[0], 7);
	CHECK_NEAR(rt->w[0], prob(lg, E, 7), 1e-6);
	md_router_release(&r);
}

int main(void)
{
	test_fn_table();
	test_scored();
	test_small(false);
	test_small(true);
	test_random();
	if (failures) {
		fprintf(stderr, "router: %d failures\n", failures);
		return 1;
	}
	printf("router: ok\n");
	return 0;
}
