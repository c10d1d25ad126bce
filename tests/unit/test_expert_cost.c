/* Unit tests for the compute-where-it-lives cost model (engine/expert_cost.h): the rate fit
 * recovers known rates from observations, predicts single-token decode from collinear ones,
 * and the planner sends experts to the device exactly when the modelled layer gets shorter:
 * never over a slow bus, all of them over a fast one (within the free device slots), long
 * prefill chunks before decode tokens when the bus is in between. */
#include <math.h>
#include <stdio.h>

#include "engine/expert_cost.h"
#include "tests/check.h"

#define MIB 1048576.0

static void test_fit(void)
{
	struct md_xcost c;
	md_xcost_init(&c, 0, 0, 0);
	/* host: 1e-4 s per MiB read, 2e-5 s per MiB per token */
	const double a = 1e-4, k = 2e-5;
	for (int i = 0; i < 200; i++) {
		int t = 1 + i % 23;
		uint64_t b = (uint64_t)((3 + i % 7) * MIB);
		md_xcost_observe(&c, false, b, b * (uint64_t)t, (double)b / MIB * (a + t * k));
	}
	CHECK_NEAR(c.host.a, a, a * 0.01);
	CHECK_NEAR(c.host.k, k, k * 0.01);
	CHECK_NEAR(md_xcost_host(&c, (uint64_t)(2 * MIB), 5), 2 * (a + 5 * k), 2 * (a + 5 * k) * 0.01);
	/* only one-token observations: the one-token prediction is right whatever the split */
	md_xcost_init(&c, 0, 0, 0);
	for (int i = 0; i < 50; i++)
		md_xcost_observe(&c, false, (uint64_t)(4 * MIB), (uint64_t)(4 * MIB), 4 * 3e-4);
	CHECK_NEAR(md_xcost_host(&c, (uint64_t)MIB, 1), 3e-4, 3e-6);
	CHECK(c.host.a > 0 && c.host.k > 0);
	/* ignored: nothing measured */
	struct md_xcost d = c;
	md_xcost_observe(&c, true, 0, 0, 1.0);
	md_xcost_observe(&c, true, 100, 100, 0.0);
	CHECK(c.dev.a == d.dev.a && c.dev.k == d.dev.k && c.dev.n == 0);
	/* copies: the average of recent ones */
	for (int i = 0; i < 100; i++)
		md_xcost_observe_up(&c, (uint64_t)(2 * MIB), 2e-3);
	CHECK_NEAR(md_xcost_up(&c, (uint64_t)MIB), 1e-3, 1e-6);
	/* a device probe: two points solved exactly */
	md_xcost_set_dev(&c, (uint64_t)(2 * MIB), 1, 2 * (5e-6 + 1e-7), 64, 2 * (5e-6 + 64e-7));
	CHECK_NEAR(c.dev.a, 5e-6, 1e-9);
	CHECK_NEAR(c.dev.k, 1e-7, 1e-10);
}

/* A layer of n experts of 2 MiB with the given tokens: how many the planner copies up. */
static int plan(const struct md_xcost *c, double w0, const int *tok, int n, int max_up,
		uint8_t *up, int32_t *order, double *end)
{
	struct md_xcost_item it[16];
	for (int i = 0; i < n; i++)
		it[i] = (struct md_xcost_item){ (uint64_t)(2 * MIB), tok[i] };
	return md_xcost_choose(c, w0, it, n, max_up, up, order, end);
}

static void test_choose(void)
{
	struct md_xcost c;
	uint8_t up[16];
	int32_t order[16];
	double end, all_host;
	const int decode[4] = { 1, 1, 1, 1 };
	/* host 10 GB/s, device 1 TB/s */
	md_xcost_init(&c, 10e9, 1e12, 1e6); /* bus 1 MB/s: a copy takes seconds */
	CHECK_EQ_I(plan(&c, 1e-3, decode, 4, 4, up, order, &end), 0);
	all_host = 1e-3 + 4 * md_xcost_host(&c, (uint64_t)(2 * MIB), 1);
	CHECK_NEAR(end, all_host, 1e-12);
	md_xcost_init(&c, 10e9, 1e12, 100e9); /* bus 100 GB/s: copying beats the CPU's read */
	CHECK_EQ_I(plan(&c, 1e-3, decode, 4, 4, up, order, &end), 4);
	CHECK(end < all_host);
	CHECK_EQ_I(plan(&c, 1e-3, decode, 4, 2, up, order, NULL), 2); /* two free device slots */
	CHECK_EQ_I(up[order[0]] + up[order[1]], 2);
	/* bus 6 GB/s: alone, a decode token stays on the CPU (the copy costs more than the CPU's
	 * read at 10 GB/s) and a 64-token chunk goes up (its arithmetic dominates on the CPU) */
	md_xcost_init(&c, 10e9, 1e12, 6e9);
	const int one[1] = { 1 }, chunk[1] = { 64 };
	CHECK_EQ_I(plan(&c, 0, one, 1, 4, up, order, NULL), 0);
	CHECK_EQ_I(plan(&c, 0, chunk, 1, 4, up, order, NULL), 1);
	/* together: the chunks go up, largest saving first, and their copies hide behind the
	 * CPU's decode experts; one more decode expert would wait for its copy */
	const int mixed[4] = { 1, 64, 1, 40 };
	CHECK_EQ_I(plan(&c, 0, mixed, 4, 4, up, order, &end), 2);
	CHECK(up[1] && up[3] && !up[0] && !up[2]);
	CHECK_EQ_I(order[0], 1);
	CHECK_EQ_I(order[1], 3);
	/* with more CPU work before them (w0) a decode expert's copy hides too */
	CHECK_EQ_I(plan(&c, 1e-3, mixed, 4, 4, up, order, &end), 3);
	/* nothing to plan */
	CHECK_EQ_I(md_xcost_choose(&c, 0, NULL, 0, 4, up, order, &end), 0);
	CHECK_NEAR(end, 0, 0);
}

int main(void)
{
	test_fit();
	test_choose();
	if (failures) {
		fprintf(stderr, "expert-cost: %d failures\n", failures);
		return 1;
	}
	printf("expert-cost: ok\n");
	return 0;
}
