/* The speculation controller in simulation: steps whose time follows a given cost curve (with
 * noise), drafts accepted with a given probability; the tokens per second it achieves against
 * plain decoding on the same curve. Where verification costs as much per token as decoding
 * (compute-bound) it must not fall below 0.97x; where a larger step costs little more (memory-
 * bound MoE, long right drafts) it must find the speedup; under load it must step aside. */
#include <math.h>
#include <string.h>

#include "engine/spec_ctl.h"
#include "tests/check.h"

static uint64_t rng = 88172645463325252ull;

static double unif(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return (double)(rng >> 11) / 9007199254740992.0;
}

typedef double (*cost_fn)(uint32_t n);

static double compute_bound(uint32_t n)
{
	return 1e-3 * n;
}

/* default-1g's shape: 28 MB dense, 4 layers x 16 experts of 14 MB, top-2, bandwidth-bound */
static double memory_bound(uint32_t n)
{
	double u = 16 * (1 - pow(1 - 2.0 / 16, n));
	return (28e6 + 4 * u * 14.2e6) / 20e9;
}

static double overhead_bound(uint32_t n)
{
	return 1e-3 + 2e-6 * n;
}

/* Run `steps` steps of B identical streams with acceptance alpha and drafts of up to kmax
 * free (n-gram) tokens; returns tokens/s relative to plain decoding. */
static double simulate(cost_fn cost, uint32_t B, double alpha, uint32_t kmax, double noise,
		       int steps, bool drift)
{
	struct md_spec_ctl c;
	memset(&c, 0, sizeof(c));
	c.rvar = 0.0625;
	c.load = 1;
	c.w_dense = 28e6;
	c.w_expert = 14.2e6;
	c.n_moe_layers = 4;
	c.n_expert = 16;
	c.n_used = 2;
	struct md_spec_seq *ss[16];
	uint32_t k[16];
	bool free_draft[16];
	for (uint32_t i = 0; i < B; i++) {
		ss[i] = md_spec_seq_new(MD_SPEC_NGRAM, kmax, i);
		free_draft[i] = true;
	}
	double time = 0, toks = 0;
	for (int s = 0; s < steps; s++) {
		for (uint32_t i = 0; i < B; i++)
			k[i] = kmax;
		md_spec_ctl_choose(&c, ss, k, free_draft, B, B, 0);
		uint32_t n = B;
		for (uint32_t i = 0; i < B; i++)
			n += k[i];
		/* noise, and a load that drifts 3x up and down over the run */
		double load = drift ? 2 + sin(s * 0.01) : 1;
		double dt = load * cost(n) * (1 + noise * (2 * unif() - 1));
		md_spec_ctl_observe(&c, n, dt);
		time += dt / load; /* against plain decode at the same load */
		for (uint32_t i = 0; i < B; i++) {
			uint32_t acc = 0;
			while (acc < k[i] && unif() < alpha)
				acc++;
			toks += 1 + acc;
			/* with k = 0 an n-gram proposal is still judged (the shadow) */
			if (k[i] == 0)
				ss[i]->shadow = 7;
			md_spec_ctl_feedback(ss[i], k[i], acc, unif() < alpha ? 7 : 8);
		}
	}
	for (uint32_t i = 0; i < B; i++)
		md_spec_seq_free(ss[i]);
	return (toks / time) / (B / cost(B));
}

/* The best any fixed k gives on the curve (every stream drafting k): the cost model's bound. */
static double bound(cost_fn cost, uint32_t B, double alpha, uint32_t kmax)
{
	double best = 1;
	for (uint32_t k = 1; k <= kmax; k++) {
		double e = 1, p = 1;
		for (uint32_t j = 0; j < k; j++)
			e += (p *= alpha);
		double r = (B * e / cost(B + B * k)) / (B / cost(B));
		best = r > best ? r : best;
	}
	return best;
}

int main(void)
{
	struct { const char *name; cost_fn f; uint32_t B; double alpha, noise, lo, hi; bool drift; }
	cases[] = {
		{ "compute-bound, alpha 0.9", compute_bound, 1, 0.9, 0.0, 0.97, 1.05, false },
		{ "compute-bound, noisy", compute_bound, 1, 0.9, 0.6, 0.97, 1.10, false },
		{ "memory-bound, alpha 0.95", memory_bound, 1, 0.95, 0.0, 1.5, 10, false },
		{ "memory-bound, alpha 0.95, noisy", memory_bound, 1, 0.95, 0.3, 1.4, 10, false },
		{ "memory-bound, alpha 0.3", memory_bound, 1, 0.3, 0.0, 0.97, 10, false },
		{ "memory-bound, alpha 0.05", memory_bound, 1, 0.05, 0.2, 0.97, 10, false },
		{ "overhead-bound, alpha 0.8", overhead_bound, 1, 0.8, 0.0, 2.0, 10, false },
		{ "compute-bound, 8 streams", compute_bound, 8, 0.9, 0.3, 0.97, 1.10, false },
		{ "memory-bound, 16 streams, alpha 0.6", memory_bound, 16, 0.6, 0.2, 0.97, 10, false },
		{ "compute-bound, drifting load", compute_bound, 1, 0.9, 0.3, 0.97, 1.10, true },
		{ "memory-bound, drifting load", memory_bound, 1, 0.95, 0.3, 1.3, 10, true },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		double r = simulate(cases[i].f, cases[i].B, cases[i].alpha, 8, cases[i].noise, 4000,
				    cases[i].drift);
		double b = bound(cases[i].f, cases[i].B, cases[i].alpha, 8);
		printf("%-40s %.2fx plain decode (bound %.2fx)\n", cases[i].name, r, b);
		CHECK_CONTEXT("%s", cases[i].name);
		CHECK(r >= cases[i].lo && r <= cases[i].hi);
		/* within 15% of the bound where the bound is worth having */
		if (b > 1.1)
			CHECK(r >= 0.85 * b);
	}
	return failures ? 1 : 0;
}
