/* Unit tests for the start-up memory plan (engine/mem_plan.h): the mode and budgets chosen
 * for each configuration, and the limit read from fake /proc and /sys trees (cgroup v1 and
 * v2, nested limits, "max", MemAvailable tighter than the cgroup). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/mem_plan.h"
#include "tests/check.h"

#define MB ((uint64_t)1 << 20)

static void test_plan(void)
{
	struct md_mem_plan p;
	/* The bench file (2300 MB, 2000 MB of experts) under three limits, auto. */
	struct md_mem_plan_in in = { .limit = 4096 * MB, .file_bytes = 2300 * MB,
				     .expert_bytes = 2000 * MB, .kv_bytes = 512 * MB,
				     .min_cache = 160 * MB, .cache_mb = 0 };
	md_mem_plan_make(&in, &p);
	CHECK(!p.store); /* 2300 <= 0.8 * 4096 */
	CHECK(p.populate);
	CHECK_EQ_U(p.kv_bytes, 512 * MB);
	CHECK(strstr(p.why, "fits in 80%") != NULL);

	in.limit = 2100 * MB; /* 2300 <= 1.1 * 2100: the page cache keeps nearly all of it */
	md_mem_plan_make(&in, &p);
	CHECK(!p.store && !p.refuse);
	CHECK(!p.populate); /* reading it all would push its own pages out */
	CHECK(strstr(p.why, "within 110%") != NULL);
	in.limit = 2000 * MB; /* 2300 > 2200: the store */
	md_mem_plan_make(&in, &p);
	CHECK(p.store);
	CHECK(strstr(p.why, "exceeds 110%") != NULL);

	in.limit = 1300 * MB; /* usable 1040: dense 300, KV capped at 130, experts 610 */
	md_mem_plan_make(&in, &p);
	CHECK(p.store);
	CHECK_EQ_U(p.kv_bytes, in.limit / 10 * 8 / 8);
	CHECK_EQ_U(p.cache_bytes, in.limit / 10 * 8 - 300 * MB - p.kv_bytes);
	CHECK(strstr(p.why, "exceeds 110%") != NULL);

	in.limit = 600 * MB; /* nothing left: the smallest budget that serves a step, */
	md_mem_plan_make(&in, &p); /* 300 + 60 + 160 = 520 <= 600 - 60 */
	CHECK(p.store && !p.refuse);
	CHECK_EQ_U(p.cache_bytes, 160 * MB);
	CHECK(strstr(p.why, "smallest budget") != NULL);

	in.limit = 560 * MB; /* 300 + 56 + 160 = 516 > 504: refused, never an OOM kill */
	md_mem_plan_make(&in, &p);
	CHECK(p.refuse);
	CHECK(strstr(p.why, "need 516 MiB") != NULL && strstr(p.why, "less 56 MiB") != NULL);
	in.limit = 400 * MB; /* the dense weights alone nearly fill it */
	md_mem_plan_make(&in, &p);
	CHECK(p.refuse);

	/* A small limit: the reserve is 32 MiB, not a tenth, and the cache shrinks to fit it. */
	in = (struct md_mem_plan_in){ .limit = 64 * MB, .file_bytes = 110 * MB,
				      .expert_bytes = 107 * MB, .kv_bytes = 512 * MB,
				      .min_cache = 13 * MB, .cache_mb = 0 };
	md_mem_plan_make(&in, &p);
	CHECK(p.store && !p.refuse);
	CHECK_EQ_U(p.kv_bytes, 64 * MB / 10 * 8 / 8);
	CHECK_EQ_U(p.cache_bytes, 32 * MB - 3 * MB - p.kv_bytes);
	in.limit = 40 * MB; /* 3 + 4 + 13 > 40 - 32 */
	md_mem_plan_make(&in, &p);
	CHECK(p.refuse);
	/* The KV pool never below one context (kv_min), whatever the eighth: at 64 MiB a 32 MiB
	 * context leaves nothing for the experts. */
	in.limit = 64 * MB;
	in.kv_min = 32 * MB;
	md_mem_plan_make(&in, &p);
	CHECK(p.refuse);
	CHECK(strstr(p.why, "KV 32 MiB") != NULL);
	/* The whole file mapped: the KV pool (anonymous) kept below the limit less the
	 * reserve, never below one context; refused when one context does not fit. */
	struct md_mem_plan_in mm = { .limit = 64 * MB, .file_bytes = 12 * MB,
				     .expert_bytes = 9 * MB, .kv_bytes = 512 * MB,
				     .kv_min = 4 * MB, .min_cache = 1 * MB, .cache_mb = 0 };
	md_mem_plan_make(&mm, &p);
	CHECK(!p.store && !p.refuse);
	CHECK_EQ_U(p.kv_bytes, 32 * MB);
	CHECK(strstr(p.why, "KV capped at 32 MiB") != NULL);
	mm.cache_mb = -1; /* forced mapping, and a dense model: the same cap */
	md_mem_plan_make(&mm, &p);
	CHECK(!p.store && p.kv_bytes == 32 * MB);
	mm.cache_mb = 0;
	mm.expert_bytes = 0;
	md_mem_plan_make(&mm, &p);
	CHECK(!p.store && p.kv_bytes == 32 * MB);
	mm.kv_min = 40 * MB;
	md_mem_plan_make(&mm, &p);
	CHECK(p.refuse);
	CHECK(strstr(p.why, "smallest KV pool (40 MiB)") != NULL);
	mm.limit = 0; /* no limit known: nothing capped */
	md_mem_plan_make(&mm, &p);
	CHECK(!p.refuse && p.kv_bytes == 512 * MB);
	mm.limit = 64000 * MB; /* a pool that fits is left as it is */
	md_mem_plan_make(&mm, &p);
	CHECK(!p.refuse && p.kv_bytes == 512 * MB && strstr(p.why, "capped") == NULL);

	in.limit = 96 * MB; /* 3 + 32 + 13 fit; the cache gets the rest below 96 - 32 */
	md_mem_plan_make(&in, &p);
	CHECK(p.store && !p.refuse);
	CHECK_EQ_U(p.kv_bytes, 32 * MB);
	CHECK_EQ_U(p.cache_bytes, 64 * MB - 3 * MB - 32 * MB);

	/* Forced either way, and the cases that keep the mapping. */
	in = (struct md_mem_plan_in){ .limit = 1300 * MB, .file_bytes = 2300 * MB,
				      .expert_bytes = 2000 * MB, .kv_bytes = 512 * MB,
				      .min_cache = 160 * MB, .cache_mb = -1 };
	md_mem_plan_make(&in, &p);
	CHECK(!p.store);
	CHECK(!p.populate); /* 2300 > 0.8 * 1300 */
	CHECK(strstr(p.why, "-1") != NULL);
	in.cache_mb = 700;
	in.limit = 64000 * MB;
	md_mem_plan_make(&in, &p);
	CHECK(p.store);
	CHECK_EQ_U(p.cache_bytes, 700 * MB);
	CHECK_EQ_U(p.kv_bytes, 512 * MB);
	in.cache_mb = 0;
	in.limit = 0;
	md_mem_plan_make(&in, &p);
	CHECK(!p.store);
	CHECK(!p.populate); /* no limit known: no telling whether it fits */
	/* a device tier: the store even where the file fits, every expert in host RAM */
	in = (struct md_mem_plan_in){ .limit = 64000 * MB, .file_bytes = 2300 * MB,
				      .expert_bytes = 2000 * MB, .kv_bytes = 512 * MB,
				      .min_cache = 160 * MB, .device = true };
	md_mem_plan_make(&in, &p);
	CHECK(p.store);
	CHECK_EQ_U(p.cache_bytes, 2000 * MB);
	CHECK(strstr(p.why, "device tier") != NULL);
	in.limit = 100 * MB;
	in.expert_bytes = 0;
	md_mem_plan_make(&in, &p);
	CHECK(!p.store);
	CHECK(strstr(p.why, "no routed experts") != NULL);
}

static void put(const char *root, const char *rel, const char *text)
{
	char path[1024], dir[1024];
	snprintf(path, sizeof path, "%s%s", root, rel);
	snprintf(dir, sizeof dir, "%s", path);
	for (char *p = dir + strlen(root) + 1; *p; p++)
		if (*p == '/') {
			*p = 0;
			mkdir(dir, 0700);
			*p = '/';
		}
	FILE *f = fopen(path, "w");
	CHECK(f != NULL);
	if (f) {
		fputs(text, f);
		fclose(f);
	}
}

static void test_limit(void)
{
	char root[256];
	const char *tmp = getenv("TMPDIR");
	snprintf(root, sizeof root, "%s/moed-memplan-XXXXXX", tmp && *tmp ? tmp : "/tmp");
	if (!mkdtemp(root)) {
		failures++;
		return;
	}
	struct md_mem_limit l;
	/* v1: the tighter of the cgroup and its parent; MemAvailable larger. */
	put(root, "/proc/self/cgroup", "5:cpu:/\n4:memory:/a/b\n0::/\n");
	put(root, "/proc/meminfo", "MemTotal: 32000000 kB\nMemAvailable: 20000000 kB\n");
	put(root, "/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
	put(root, "/sys/fs/cgroup/memory/a/memory.limit_in_bytes", "2000000000\n");
	put(root, "/sys/fs/cgroup/memory/a/b/memory.limit_in_bytes", "9223372036854771712\n");
	md_mem_limit_read(&l, root);
	CHECK_EQ_U(l.bytes, 2000000000ull);
	CHECK(strstr(l.source, "cgroup v1") != NULL);
	/* v2 "max" all the way: MemAvailable. */
	put(root, "/proc/self/cgroup", "0::/svc\n");
	put(root, "/sys/fs/cgroup/svc/memory.max", "max\n");
	md_mem_limit_read(&l, root);
	CHECK_EQ_U(l.bytes, 20000000ull * 1024);
	CHECK(strcmp(l.source, "MemAvailable") == 0);
	/* v2 with a limit below MemAvailable. */
	put(root, "/sys/fs/cgroup/svc/memory.max", "1363148800\n");
	md_mem_limit_read(&l, root);
	CHECK_EQ_U(l.bytes, 1363148800ull);
	CHECK(strstr(l.source, "cgroup v2 /svc") != NULL);
	/* MemAvailable tighter than the cgroup. */
	put(root, "/proc/meminfo", "MemAvailable: 1000 kB\n");
	md_mem_limit_read(&l, root);
	CHECK_EQ_U(l.bytes, 1024000ull);
	char cmd[400];
	snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
	CHECK_EQ_I(system(cmd), 0);
	/* The real machine: some limit, whatever it is. */
	md_mem_limit_read(&l, NULL);
	CHECK(l.bytes > 0);
	printf("mem_plan: this machine: %.0f MiB (%s)\n", l.bytes / 1048576.0, l.source);
}

int main(void)
{
	test_plan();
	test_limit();
	if (failures) {
		fprintf(stderr, "mem_plan: %d failures\n", failures);
		return 1;
	}
	printf("mem_plan: ok\n");
	return 0;
}
