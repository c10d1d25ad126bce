/* Unit tests for the expert cache policies: the victim each kind picks, the in-use predicate
 * honoured, residency bookkeeping, names. */
#include <stdio.h>

#include "engine/expert_policy.h"
#include "tests/check.h"

static bool not_unit3(void *arg, uint32_t unit)
{
	(void)arg;
	return unit != 3;
}

static void test_lru(void)
{
	struct md_epol *p = md_epol_new(MD_EPOL_LRU, 2, 4);
	REQUIRE(CHECK(p != NULL));
	CHECK_EQ_I(md_epol_victim(p, NULL, NULL, 0), -1);
	for (uint32_t u = 0; u < 5; u++)
		md_epol_insert(p, u, 10 + u);
	CHECK_EQ_U(md_epol_n_resident(p), 5);
	CHECK_EQ_I(md_epol_victim(p, NULL, NULL, 20), 0);
	md_epol_access(p, 0, 21);                    /* 1 is now the oldest */
	CHECK_EQ_I(md_epol_victim(p, NULL, NULL, 22), 1);
	md_epol_access(p, 1, 22);
	md_epol_access(p, 2, 23);
	CHECK_EQ_I(md_epol_victim(p, not_unit3, NULL, 24), 4); /* 3 is in use: the next */
	CHECK_EQ_I(md_epol_victim(p, NULL, NULL, 24), 3);
	md_epol_remove(p, 3);
	CHECK(!md_epol_resident(p, 3));
	CHECK(md_epol_resident(p, 4));
	CHECK_EQ_U(md_epol_n_resident(p), 4);
	md_epol_remove(p, 3);                        /* twice: no effect */
	CHECK_EQ_U(md_epol_n_resident(p), 4);
	md_epol_access(p, 7, 25);                    /* a miss: not resident, never a victim */
	CHECK(!md_epol_resident(p, 7));
	CHECK_EQ_I(md_epol_victim(p, NULL, NULL, 26), 4);
	md_epol_free(p);
}

/* lfu: the lowest aged count goes; counts halve every half-life; misses count. */
static void test_lfu(void)
{
	struct md_epol *p = md_epol_new(MD_EPOL_LFU, 1, 8);
	REQUIRE(CHECK(p != NULL));
	md_epol_set_half_life(p, 1000); /* no aging to speak of at first */
	for (uint32_t u = 0; u < 3; u++)
		md_epol_insert(p, u, 1);
	/* uses: unit 0 four times, unit 1 once, unit 2 three times, all at t 1..4 */
	for (uint64_t t = 1; t <= 4; t++) {
		md_epol_access(p, 0, t);
		if (t <= 1)
			md_epol_access(p, 1, t);
		if (t <= 3)
			md_epol_access(p, 2, t);
	}
	CHECK_EQ_I(md_epol_victim(p, NULL, NULL, 5), 1);
	/* unit 1 used once more, most recently: LRU would now pick 2, LFU still 1 (2 < 3) */
	md_epol_access(p, 1, 5);
	CHECK_EQ_I(md_epol_victim(p, NULL, NULL, 6), 1);
	/* aging, with a half-life of 10 ticks: 40 ticks later unit 1's two fresh uses outweigh 0
	 * and 2's old ones (about 4/16 and 3/16 against 2 + 2/16) */
	md_epol_set_half_life(p, 10);
	md_epol_access(p, 1, 44);
	md_epol_access(p, 1, 45);
	CHECK_EQ_I(md_epol_victim(p, NULL, NULL, 45), 2);
	/* a unit that missed often comes back with its count: six misses of unit 5 */
	for (uint64_t t = 46; t < 52; t++)
		md_epol_access(p, 5, t);
	md_epol_insert(p, 5, 52);
	int64_t v = md_epol_victim(p, NULL, NULL, 52);
	CHECK(v != 5 && v >= 0);
	CHECK_EQ_I(md_epol_victim(p, not_unit3, NULL, 52), v); /* 3 not resident: no effect */
	md_epol_free(p);

	/* Long runs: thousands of half-lives (the scaled counts are rebased, never overflow). */
	p = md_epol_new(MD_EPOL_LFU, 1, 2);
	REQUIRE(CHECK(p != NULL));
	md_epol_set_half_life(p, 2);
	md_epol_insert(p, 0, 1);
	md_epol_insert(p, 1, 1);
	for (uint64_t t = 1; t < 20000; t += 7) {
		md_epol_access(p, 0, t);
		md_epol_access(p, 0, t);
		md_epol_access(p, 1, t);
	}
	CHECK_EQ_I(md_epol_victim(p, NULL, NULL, 20000), 1); /* 0 used twice as often */
	md_epol_access(p, 1, 20100);                         /* 50 half-lives later */
	CHECK_EQ_I(md_epol_victim(p, NULL, NULL, 20100), 0);
	md_epol_free(p);
}

static bool layer3_busy(void *arg, uint32_t unit)
{
	(void)arg;
	return unit / 2 != 3;
}

/* pred: knows the layer order, follows hints, keeps costly units. */
static void test_pred(void)
{
	/* 4 layers of 2 experts; every step uses expert 0 of each layer, layers 0..3 at ticks
	 * 4s+1 .. 4s+4. At tick 8 (layer 3 running) the unit needed last is layer 2's (its layer
	 * ran at tick 7 and comes again at 11); lru drops layer 0's, needed at tick 9. */
	struct md_epol *pr = md_epol_new(MD_EPOL_PRED, 4, 2);
	struct md_epol *lru = md_epol_new(MD_EPOL_LRU, 4, 2);
	REQUIRE(CHECK(pr != NULL && lru != NULL));
	for (uint64_t t = 1; t <= 8; t++) {
		uint32_t u = (uint32_t)((t - 1) % 4) * 2;
		if (t <= 4) {
			md_epol_insert(pr, u, t);
			md_epol_insert(lru, u, t);
		}
		md_epol_access(pr, u, t);
		md_epol_access(lru, u, t);
	}
	CHECK_EQ_I(md_epol_victim(pr, layer3_busy, NULL, 8), 4);
	CHECK_EQ_I(md_epol_victim(lru, layer3_busy, NULL, 8), 0);
	/* Admission: expert 1 of layer 3 missed at tick 8 for the first time; it is needed again
	 * a whole cycle later at best and is rarer than the victim: pred streams it, lru caches
	 * it. A resident unit never used is worth less than anything that was. */
	md_epol_access(pr, 7, 8);
	md_epol_access(lru, 7, 8);
	CHECK(!md_epol_admit(pr, 7, 4, 8));
	CHECK(md_epol_admit(lru, 7, 0, 8));
	md_epol_insert(pr, 1, 8);
	CHECK_EQ_I(md_epol_victim(pr, layer3_busy, NULL, 8), 1);
	CHECK(md_epol_admit(pr, 7, 1, 8));
	md_epol_free(lru);
	md_epol_free(pr);

	/* Hints: two units of layer 1 used equally; a hint for unit 2 keeps it until layer 1's
	 * next visit, after which the hint is spent. */
	pr = md_epol_new(MD_EPOL_PRED, 2, 2);
	REQUIRE(CHECK(pr != NULL));
	md_epol_insert(pr, 2, 1);
	md_epol_insert(pr, 3, 1);
	md_epol_access(pr, 2, 2);
	md_epol_access(pr, 3, 2);
	CHECK_EQ_I(md_epol_victim(pr, NULL, NULL, 3), 2); /* equal: least recently used (tie) */
	md_epol_hint(pr, 2, 0.9f, 3);
	CHECK_EQ_I(md_epol_victim(pr, NULL, NULL, 3), 3);
	md_epol_access(pr, 3, 4);                          /* layer 1 ran: hint spent */
	CHECK_EQ_I(md_epol_victim(pr, NULL, NULL, 5), 2);
	/* Cost: unit 2 is 4x as costly to fetch again, though used less. */
	md_epol_set_cost(pr, 2, 4.0f);
	CHECK_EQ_I(md_epol_victim(pr, NULL, NULL, 5), 3);
	md_epol_free(pr);

	/* Recency: one layer of 8 experts, all resident. Experts 4..7 were used at 30 visits,
	 * then every visit uses 0 and 1 (one token repeating): after 6 such visits their aged
	 * counts are still far below 4..7's, but the layer's measured reuse share is 1, so pred
	 * keeps them and drops one of 4..7, as lru does; lfu drops 2 or 3 (never used), then 0
	 * or 1. A step's units (2) fit in the tier, else recency would not count (thrashing). */
	struct md_epol *k[3] = { md_epol_new(MD_EPOL_PRED, 1, 8), md_epol_new(MD_EPOL_LRU, 1, 8),
				 md_epol_new(MD_EPOL_LFU, 1, 8) };
	REQUIRE(CHECK(k[0] && k[1] && k[2]));
	for (int i = 0; i < 3; i++) {
		for (uint32_t u = 0; u < 8; u++)
			md_epol_insert(k[i], u, 1);
		uint64_t t = 1;
		for (; t <= 30; t++)
			for (uint32_t u = 4; u < 8; u++)
				md_epol_access(k[i], u, t);
		for (; t <= 36; t++) {
			md_epol_access(k[i], 0, t);
			md_epol_access(k[i], 1, t);
		}
		md_epol_remove(k[i], 2);
		md_epol_remove(k[i], 3);
	}
	int64_t v = md_epol_victim(k[0], NULL, NULL, 37);
	CHECK_MSG(v >= 4, "pred keeps the repeating experts: victim %lld", (long long)v);
	CHECK(md_epol_victim(k[1], NULL, NULL, 37) >= 4);
	CHECK(md_epol_victim(k[2], NULL, NULL, 37) <= 1);
	for (int i = 0; i < 3; i++)
		md_epol_free(k[i]);
}

/* Transit units (what a store caches where admission says no): the first victims of every
 * kind, least recently used first; an access makes one an ordinary resident again;
 * victim_cached never picks one; removal clears the mark. */
static void test_transit(void)
{
	for (int k = 0; k < MD_EPOL_KIND_COUNT; k++) {
		struct md_epol *p = md_epol_new((enum md_epol_kind)k, 1, 6);
		REQUIRE(CHECK(p != NULL));
		for (uint32_t u = 0; u < 6; u++) {
			md_epol_insert(p, u, u + 1);
			for (uint32_t r = 0; r <= u; r++) /* later units used more, and later */
				md_epol_access(p, u, 10 + 10 * u + r);
		}
		int64_t plain = md_epol_victim(p, NULL, NULL, 100);
		CHECK_EQ_I(plain, 0);
		md_epol_demote(p, 5);
		md_epol_demote(p, 3);
		CHECK(md_epol_transit(p, 5) && md_epol_transit(p, 3) && !md_epol_transit(p, 0));
		CHECK_EQ_I(md_epol_victim(p, NULL, NULL, 100), 3); /* transit, used longest ago */
		CHECK_EQ_I(md_epol_victim_cached(p, NULL, NULL, 100), plain);
		md_epol_access(p, 3, 101); /* used again: an ordinary resident */
		CHECK(!md_epol_transit(p, 3));
		CHECK_EQ_I(md_epol_victim(p, NULL, NULL, 102), 5);
		md_epol_remove(p, 5);
		md_epol_insert(p, 5, 103);
		CHECK(!md_epol_transit(p, 5));
		md_epol_demote(p, 2);
		md_epol_remove(p, 2);
		CHECK_EQ_I(md_epol_victim(p, NULL, NULL, 104), plain); /* no transit left */
		md_epol_free(p);
	}
}

static void test_names(void)
{
	for (int k = 0; k < MD_EPOL_KIND_COUNT; k++) {
		enum md_epol_kind out;
		REQUIRE(CHECK(md_epol_name((enum md_epol_kind)k) != NULL));
		CHECK_EQ_I(md_epol_parse(md_epol_name((enum md_epol_kind)k), &out), 0);
		CHECK_EQ_I(out, k);
	}
	enum md_epol_kind out;
	CHECK(md_epol_parse("fifo", &out) < 0);
	CHECK(md_epol_parse(NULL, &out) < 0);
	CHECK(md_epol_new(MD_EPOL_KIND_COUNT, 1, 1) == NULL);
}

int main(void)
{
	test_lru();
	test_lfu();
	test_transit();
	test_pred();
	test_names();
	if (failures) {
		fprintf(stderr, "expert-policy: %d failures\n", failures);
		return 1;
	}
	printf("expert-policy: ok\n");
	return 0;
}
