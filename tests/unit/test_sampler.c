/* Unit tests for engine/sampler.c: greedy, top-k/top-p/min-p, penalties, bias, seeds, logprobs. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/sampler.h"

static int fails;

#define CHECK_EQ(a, b, what)                                                                   \
	do {                                                                                   \
		long long _a = (long long)(a), _b = (long long)(b);                            \
		if (_a != _b) {                                                                \
			printf("FAIL %s: %lld != %lld (line %d)\n", what, _a, _b, __LINE__);   \
			fails++;                                                               \
		}                                                                              \
	} while (0)

#define V 1000

static int32_t sample(struct md_sampler *sm, const struct md_sampling *p, const float *src,
		      const int32_t *gen, uint32_t n_gen, struct md_sample_out *o)
{
	static float l[V];
	memcpy(l, src, sizeof(l));
	if (md_sampler_sample(sm, p, l, NULL, 0, gen, n_gen, o))
		return -1;
	return o->token;
}

int main(void)
{
	static float logits[V];
	for (int i = 0; i < V; i++)
		logits[i] = (float)((i * 7919) % 1000) / 100.0f; /* max 9.99 at i with i*7919%1000==999 */
	int32_t best = 0;
	for (int i = 1; i < V; i++)
		if (logits[i] > logits[best])
			best = i;
	struct md_sampler sm;
	struct md_sample_out o;
	struct md_sampling p;
	md_sampler_init(&sm, V, 1);

	md_sampling_default(&p);
	p.temperature = 0;
	CHECK_EQ(sample(&sm, &p, logits, NULL, 0, &o), best, "greedy argmax");

	/* top_k = 1 is greedy whatever the temperature */
	md_sampling_default(&p);
	p.temperature = 2;
	p.top_k = 1;
	for (int i = 0; i < 20; i++)
		CHECK_EQ(sample(&sm, &p, logits, NULL, 0, &o), best, "top_k=1");
	/* tiny top_p and min_p = 1 keep only the best */
	md_sampling_default(&p);
	p.top_p = 1e-6f;
	for (int i = 0; i < 20; i++)
		CHECK_EQ(sample(&sm, &p, logits, NULL, 0, &o), best, "top_p tiny");
	md_sampling_default(&p);
	p.min_p = 1.0f;
	for (int i = 0; i < 20; i++)
		CHECK_EQ(sample(&sm, &p, logits, NULL, 0, &o), best, "min_p=1");
	/* top_k = 5: only the five best ever come out */
	md_sampling_default(&p);
	p.top_k = 5;
	p.temperature = 5;
	for (int i = 0; i < 200; i++) {
		int32_t t = sample(&sm, &p, logits, NULL, 0, &o);
		int better = 0;
		for (int j = 0; j < V; j++)
			better += logits[j] > logits[t];
		if (better >= 5) {
			printf("FAIL top_k=5 gave rank %d\n", better);
			fails++;
			break;
		}
	}
	/* logit bias forces a token */
	struct md_logit_bias lb = { .id = 3, .bias = 100 };
	md_sampling_default(&p);
	p.temperature = 0;
	p.logit_bias = &lb;
	p.n_logit_bias = 1;
	CHECK_EQ(sample(&sm, &p, logits, NULL, 0, &o), 3, "logit_bias");
	/* a presence penalty on the best token moves greedy away from it */
	md_sampling_default(&p);
	p.temperature = 0;
	p.presence_penalty = 2;
	p.frequency_penalty = 2;
	int32_t gen[3] = { best, best, best };
	int32_t t = sample(&sm, &p, logits, gen, 3, &o);
	if (t == best) {
		printf("FAIL penalties did not move greedy off %d\n", best);
		fails++;
	}
	/* penalties before any token was generated: no history at all. The sampler used to sort
	 * a NULL history (qsort(NULL, 0, ...)), which stops a UBSan build. */
	{
		struct md_sampler fresh;
		md_sampler_init(&fresh, V, 7);
		md_sampling_default(&p);
		p.temperature = 0;
		p.presence_penalty = 1;
		p.frequency_penalty = 1;
		CHECK_EQ(sample(&fresh, &p, logits, NULL, 0, &o), best, "penalties, empty history");
		md_sampler_release(&fresh);
	}
	/* seeds: same seed same sequence, different seed different sequence */
	md_sampling_default(&p);
	p.temperature = 1.5f;
	int32_t a[32], b[32], c[32];
	struct md_sampler s1, s2, s3;
	md_sampler_init(&s1, V, 42);
	md_sampler_init(&s2, V, 42);
	md_sampler_init(&s3, V, 43);
	int same_ac = 1;
	for (int i = 0; i < 32; i++) {
		a[i] = sample(&s1, &p, logits, NULL, 0, &o);
		b[i] = sample(&s2, &p, logits, NULL, 0, &o);
		c[i] = sample(&s3, &p, logits, NULL, 0, &o);
		CHECK_EQ(a[i], b[i], "same seed");
		same_ac &= a[i] == c[i];
	}
	CHECK_EQ(same_ac, 0, "different seeds differ");
	/* logprobs: log-softmax of the raw logits, top list best first */
	md_sampling_default(&p);
	p.temperature = 0;
	p.top_logprobs = 3;
	sample(&sm, &p, logits, NULL, 0, &o);
	double z = 0;
	for (int i = 0; i < V; i++)
		z += exp(logits[i] - logits[best]);
	double want = -log(z);
	if (fabs(o.logprob - want) > 1e-4) {
		printf("FAIL logprob %f != %f\n", o.logprob, want);
		fails++;
	}
	CHECK_EQ(o.n_top, 3, "n_top");
	CHECK_EQ(o.top_id[0], best, "top[0] is the argmax");
	if (!(o.top_logprob[0] >= o.top_logprob[1] && o.top_logprob[1] >= o.top_logprob[2])) {
		printf("FAIL top logprobs not sorted\n");
		fails++;
	}
	md_sampler_release(&sm);
	md_sampler_release(&s1);
	md_sampler_release(&s2);
	md_sampler_release(&s3);
	if (fails)
		printf("%d failure(s)\n", fails);
	else
		printf("sampler: all checks passed\n");
	return fails ? 1 : 0;
}
