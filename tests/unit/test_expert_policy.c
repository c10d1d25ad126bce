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
	test_names();
	if (failures) {
		fprintf(stderr, "expert-policy: %d failures\n", failures);
		return 1;
	}
	printf("expert-policy: ok\n");
	return 0;
}
