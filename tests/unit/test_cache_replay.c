/* The cache replay of bench/cache-replay (bench/cache_sim.h) on hand-made traces whose answers
 * are worked out below: grouping by step and layer, LRU and Belady hit counts, units in use
 * streamed rather than cached, the predictors' accuracy and hints, pre-gating's recorded
 * predictions read ahead; and on a random trace,
 * Belady at least as good as every policy at every capacity. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/cache_sim.h"
#include "tests/check.h"

static char path[] = "/tmp/moed-csim-XXXXXX";

static void load(struct md_route_log *log, const char *text)
{
	FILE *f = fopen(path, "w");
	REQUIRE(CHECK(f != NULL));
	fputs(text, f);
	fclose(f);
	char err[256];
	REQUIRE(CHECK_EQ_I(md_route_log_read(log, path, err, sizeof(err)), 0));
}

static uint64_t hits(const struct md_csim *s, int kind, uint32_t cap)
{
	struct md_csim_result r;
	if (kind < 0)
		REQUIRE(CHECK_EQ_I(md_csim_belady(s, cap, &r), 0));
	else
		REQUIRE(CHECK_EQ_I(md_csim_replay(s, (enum md_epol_kind)kind, cap, MD_CSIM_HINTS, 0,
						  &r), 0));
	return r.hits;
}

/* One layer, four experts, one token per step: experts 0 1 2 0 1 3 0 1 2 3.
 * LRU with 2 slots always evicts what comes next: 0 hits. Belady: keeps {0,1} through step 8
 * (2 and 3 are used later than 0 and 1 each time): hits at steps 4, 5, 7, 8 = 4. With all 4
 * slots every policy misses each expert once: 6 hits. */
static void test_loop(void)
{
	static const int ex[] = { 0, 1, 2, 0, 1, 3, 0, 1, 2, 3 };
	char text[1024] = "# moed routing trace 1\n# n_layer 1 n_expert 4 n_used 1\n";
	for (int i = 0; i < 10; i++) {
		size_t n = strlen(text);
		snprintf(text + n, sizeof(text) - n, "%d 0 5 %d %d 1.0\n", i + 1, i, ex[i]);
	}
	struct md_route_log log;
	load(&log, text);
	struct md_csim s;
	struct md_csim_stats st;
	REQUIRE(CHECK_EQ_I(md_csim_build(&s, &log, &st), 0));
	CHECK_EQ_U(s.n_groups, 10);
	CHECK_EQ_U(s.start[s.n_groups], 10);
	CHECK_EQ_U(hits(&s, MD_EPOL_LRU, 2), 0);
	CHECK_EQ_U(hits(&s, -1, 2), 4);
	CHECK_EQ_U(hits(&s, -1, 0), 0);
	for (int k = -1; k < MD_EPOL_KIND_COUNT; k++) {
		CHECK_CONTEXT("kind %d", k);
		CHECK_EQ_U(hits(&s, k, 4), 6);
		CHECK(hits(&s, k, 2) <= 4);
	}
	CHECK_CONTEXT_CLEAR();
	struct md_csim_result r;
	CHECK_EQ_I(md_csim_static_best(&s, 2, &r), 0);
	CHECK_EQ_U(r.hits, 6); /* 0 and 1, used 3 times each */
	/* uses 0:3 1:3 2:2 3:2 of 10: half needs two units, 80% three, all four */
	CHECK_EQ_U(md_csim_hot_set(&s, 0.5), 2);
	CHECK_EQ_U(md_csim_hot_set(&s, 0.8), 3);
	CHECK_EQ_U(md_csim_hot_set(&s, 0.81), 4);
	CHECK_EQ_U(md_csim_hot_set(&s, 1.0), 4);
	/* prev: no token repeats the one before: 9 predicted, none used */
	CHECK_EQ_U(st.prev.tok_used, 10);
	CHECK_EQ_U(st.prev.tok_predicted, 9);
	CHECK_EQ_U(st.prev.tok_hit, 0);
	CHECK_EQ_U(st.cooc.tok_used, 0); /* one layer: nothing to predict from */
	md_csim_release(&s);
	md_route_log_release(&log);
}

/* Two layers, four experts, top-2; sequences 7 and 8 decode together for two steps, each
 * choosing the same experts both times: 7 -> {0,1} then {2,3}, 8 -> {1,2} then {2,3}. */
static void test_two_seqs(void)
{
	struct md_route_log log;
	load(&log, "# moed routing trace 1\n# n_layer 2 n_expert 4 n_used 2\n"
		   "1 0 7 0 0 1 0.5 0.5\n1 0 8 0 1 2 0.5 0.5\n"
		   "1 1 7 0 2 3 0.5 0.5\n1 1 8 0 3 2 0.5 0.5\n"
		   "2 0 7 1 0 1 0.5 0.5\n2 0 8 1 2 1 0.5 0.5\n"
		   "2 1 7 1 3 2 0.5 0.5\n2 1 8 1 2 3 0.5 0.5\n");
	struct md_csim s;
	struct md_csim_stats st;
	REQUIRE(CHECK_EQ_I(md_csim_build(&s, &log, &st), 0));
	/* groups: (1,0) {0,1,2}; (1,1) {6,7}; (2,0) {0,1,2}; (2,1) {6,7} */
	REQUIRE(CHECK_EQ_U(s.n_groups, 4));
	static const uint32_t want[] = { 0, 1, 2, 6, 7, 0, 1, 2, 6, 7 };
	CHECK_EQ_U(s.start[4], 10);
	for (int i = 0; i < 10; i++)
		CHECK_EQ_U(s.units[i], want[i]);
	CHECK_EQ_U(s.layer[1], 1);
	/* Everything fits in 5 units: the second step hits all 5. */
	for (int k = -1; k < MD_EPOL_KIND_COUNT; k++)
		CHECK_EQ_U(hits(&s, k, 5), 5);
	/* One slot: a group of three keeps one unit and streams two; LRU then drops it for layer
	 * 1 and never hits. Belady keeps a layer-0 unit instead of caching 6 (both next used by
	 * the second step, layer 0 first) and hits it once. */
	CHECK_EQ_U(hits(&s, MD_EPOL_LRU, 1), 0);
	CHECK_EQ_U(hits(&s, -1, 1), 1);
	/* prev: step 2 repeats step 1: 8 of 16 used experts predicted, all right */
	CHECK_EQ_U(st.prev.tok_used, 16);
	CHECK_EQ_U(st.prev.tok_predicted, 8);
	CHECK_EQ_U(st.prev.tok_hit, 8);
	/* cooc: nothing learned for the very first layer-1 token (7 at step 1); 8 at step 1 maps
	 * expert 1 through what 7 taught (1 -> 2, 3) and gets both; step 2 both right: 6 of 8 */
	CHECK_EQ_U(st.cooc.tok_used, 8);
	CHECK_EQ_U(st.cooc.tok_predicted, 6);
	CHECK_EQ_U(st.cooc.tok_hit, 6);
	CHECK_EQ_U(st.cooc.grp_used, 4);
	CHECK_EQ_U(st.cooc.grp_hit, 4);
	CHECK_EQ_U(st.cooc.grp_predicted, 4);
	/* hints before the layer-1 groups: units 6 and 7 */
	CHECK_EQ_U(s.hint_start[1] - s.hint_start[0], 0);
	REQUIRE(CHECK_EQ_U(s.hint_start[2] - s.hint_start[1], 2));
	CHECK_EQ_U(s.hint_unit[s.hint_start[1]], 6);
	CHECK_EQ_U(s.hint_unit[s.hint_start[1] + 1], 7);
	/* Prefetching the hinted units with 5 slots: the second layer-1 group is hit anyway;
	 * the first is read ahead (2 units, both used): 7 hits of 10. */
	struct md_csim_result r;
	CHECK_EQ_I(md_csim_replay(&s, MD_EPOL_PRED, 5, MD_CSIM_HINTS | MD_CSIM_PREFETCH, 0, &r), 0);
	CHECK_EQ_U(r.prefetched, 2);
	CHECK_EQ_U(r.prefetch_used, 2);
	CHECK_EQ_U(r.hits, 7);
	md_csim_release(&s);
	md_route_log_release(&log);
}

/* An expert of 8, half the time one of the first three. */
static int skewed(uint64_t *x)
{
	*x = *x * 6364136223846793005ull + 1442695040888963407ull;
	uint32_t r = (uint32_t)(*x >> 33) % 64;
	return r < 32 ? (int)(r % 3) : (int)(r % 8);
}

/* A random trace with skewed popularity: Belady is an upper bound at every capacity, every
 * hit count grows with capacity, and at full capacity only first uses miss. */
static void test_random(void)
{
	size_t cap = 1 << 20, n = 0;
	char *text = malloc(cap);
	n += (size_t)snprintf(text + n, cap - n, "# moed routing trace 1\n"
			      "# n_layer 3 n_expert 8 n_used 2\n");
	uint64_t x = 12345;
	for (int step = 1; step <= 80; step++)
		for (int l = 0; l < 3; l++)
			for (int q = 0; q < 3; q++) {
				int e[2];
				for (int j = 0; j < 2; j++)
					do
						e[j] = skewed(&x); /* experts 0..2 hot */
					while (j == 1 && e[1] == e[0]);
				n += (size_t)snprintf(text + n, cap - n,
						      "%d %d %d %d %d %d 0.5 0.5\n", step, l, q,
						      step - 1, e[0], e[1]);
			}
	struct md_route_log log;
	load(&log, text);
	free(text);
	struct md_csim s;
	struct md_csim_stats st;
	REQUIRE(CHECK_EQ_I(md_csim_build(&s, &log, &st), 0));
	uint64_t prev[MD_EPOL_KIND_COUNT + 1] = { 0 };
	for (uint32_t c = 0; c <= s.n_units; c++) {
		uint64_t b = hits(&s, -1, c);
		CHECK_CONTEXT("capacity %u", c);
		CHECK(b >= prev[MD_EPOL_KIND_COUNT]);
		prev[MD_EPOL_KIND_COUNT] = b;
		for (int k = 0; k < MD_EPOL_KIND_COUNT; k++) {
			uint64_t h = hits(&s, k, c);
			CHECK(h <= b);
			if (c == s.n_units)
				CHECK_EQ_U(h, b);
		}
	}
	CHECK_CONTEXT_CLEAR();
	uint32_t distinct = 0;
	uint8_t seen[24] = { 0 };
	for (uint64_t i = 0; i < s.start[s.n_groups]; i++)
		if (!seen[s.units[i]]++)
			distinct++;
	CHECK_EQ_U(prev[MD_EPOL_KIND_COUNT], s.start[s.n_groups] - distinct);
	md_csim_release(&s);
	md_route_log_release(&log);
}

/* Pre-gating lines: two layers of four experts, top-1, one sequence for 8 steps; layer 0
 * always uses expert 0, layer 1 cycles 0 1 2 3, and every "p" line names the expert layer 1
 * then uses. pregate's accuracy is 100%; with 2 units the online policies hit only layer 0
 * (from step 2: 7 hits) and Belady one more (it keeps layer 1's expert 0 in the free unit
 * from step 1 to step 5), while reading pre-gating's predictions ahead also hits all 8 of
 * layer 1's: each is read while layer 0 runs, over the layer-1 unit of the step before. */
static void test_pregate(void)
{
	char text[2048] = "# moed routing trace 2\n# n_layer 2 n_expert 4 n_used 1\n";
	for (int i = 0; i < 8; i++) {
		size_t n = strlen(text);
		snprintf(text + n, sizeof(text) - n, "%d 0 5 %d 0 1.0\np %d 1 5 %d %d\n"
			 "%d 1 5 %d %d 1.0\n", i + 1, i, i + 1, i, i % 4, i + 1, i, i % 4);
	}
	struct md_route_log log;
	load(&log, text);
	CHECK_EQ_U(log.n_pregate, 8);
	struct md_csim s;
	struct md_csim_stats st;
	REQUIRE(CHECK_EQ_I(md_csim_build(&s, &log, &st), 0));
	CHECK(s.has_pregate);
	CHECK_EQ_U(st.pregate.tok_used, 8);
	CHECK_EQ_U(st.pregate.tok_hit, 8);
	CHECK_EQ_U(st.pregate.grp_predicted, 8);
	CHECK_EQ_U(st.pregate.grp_hit, 8);
	CHECK_EQ_U(hits(&s, -1, 2), 8);
	for (int k = 0; k < MD_EPOL_KIND_COUNT; k++) {
		CHECK_CONTEXT("kind %d", k);
		CHECK_EQ_U(hits(&s, k, 2), 7);
	}
	CHECK_CONTEXT_CLEAR();
	struct md_csim_result r;
	REQUIRE(CHECK_EQ_I(md_csim_replay(&s, MD_EPOL_PRED, 2, MD_CSIM_HINTS | MD_CSIM_PREFETCH |
					  MD_CSIM_PREGATE, 0, &r), 0));
	CHECK_EQ_U(r.accesses, 16);
	CHECK_EQ_U(r.prefetched, 8);
	CHECK_EQ_U(r.prefetch_used, 8);
	CHECK_EQ_U(r.hits, 15); /* layer 0's first visit is the only miss */
	/* Belady with the same reads ahead can do no better here */
	REQUIRE(CHECK_EQ_I(md_csim_belady_pregate(&s, 2, &r), 0));
	CHECK_EQ_U(r.hits, 15);
	CHECK_EQ_U(r.prefetch_used, 8);
	md_csim_release(&s);
	md_route_log_release(&log);
}

int main(void)
{
	int fd = mkstemp(path);
	REQUIRE(CHECK(fd >= 0));
	close(fd);
	test_loop();
	test_two_seqs();
	test_random();
	test_pregate();
	unlink(path);
	if (failures)
		fprintf(stderr, "cache-replay: %d checks failed\n", failures);
	else
		printf("cache-replay: ok\n");
	return failures ? 1 : 0;
}
