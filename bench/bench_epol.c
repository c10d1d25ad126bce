/* bench_epol: what one eviction decision costs each expert-cache policy.
 *
 * LAYERS x EXPERTS units (default 48 x 128, Qwen3-30B-A3B's 6144), all resident with varied
 * use; each policy picks REPS victims at advancing times (md_epol_victim scans the resident
 * units). Prints microseconds per victim, the median of 5 alternating runs, and the ratio to
 * lru (a scan reading one number per unit). A miss that needs a victim reads an expert from
 * disk: megabytes, about a millisecond at 2 GB/s.
 *
 * usage: bench_epol [LAYERS=48] [EXPERTS=128] [REPS=2000] */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "engine/expert_policy.h"

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

/* Microseconds per victim; sink collects the answers so the loop is not optimised away. */
static double run(enum md_epol_kind k, uint32_t L, uint32_t E, int reps, int64_t *sink)
{
	struct md_epol *p = md_epol_new(k, L, E);
	if (!p)
		return -1;
	uint32_t n = L * E;
	for (uint32_t u = 0; u < n; u++) {
		md_epol_insert(p, u, 1);
		for (uint32_t j = 0; j <= u % 5; j++)
			md_epol_access(p, u, 1 + (u * 7919u) % 997);
		if (u % 3 == 0)
			md_epol_hint(p, u, 0.3f, 998);
	}
	double t0 = now_s();
	for (int i = 0; i < reps; i++)
		*sink += md_epol_victim(p, NULL, NULL, 1000 + (uint64_t)i);
	double us = (now_s() - t0) * 1e6 / reps;
	md_epol_free(p);
	return us;
}

int main(int argc, char **argv)
{
	uint32_t L = argc > 1 ? (uint32_t)strtoul(argv[1], NULL, 10) : 48;
	uint32_t E = argc > 2 ? (uint32_t)strtoul(argv[2], NULL, 10) : 128;
	int reps = argc > 3 ? atoi(argv[3]) : 2000;
	if (!L || !E || reps < 1) {
		fprintf(stderr, "usage: bench_epol [LAYERS] [EXPERTS] [REPS]\n");
		return 2;
	}
	enum { RUNS = 5 };
	double t[MD_EPOL_KIND_COUNT][RUNS];
	int64_t sink = 0;
	for (int r = 0; r < RUNS; r++)
		for (int k = 0; k < MD_EPOL_KIND_COUNT; k++)
			if ((t[k][r] = run((enum md_epol_kind)k, L, E, reps, &sink)) < 0) {
				fprintf(stderr, "bench_epol: out of memory\n");
				return 1;
			}
	printf("%u layers x %u experts = %u resident units, %d victims per run, %d alternating "
	       "runs (checksum %lld)\n", L, E, L * E, reps, RUNS, (long long)(sink % 1000));
	printf("| policy | us per victim (median) | spread | vs lru |\n"
	       "| --- | ---: | ---: | ---: |\n");
	double lru = 0;
	for (int k = 0; k < MD_EPOL_KIND_COUNT; k++) {
		qsort(t[k], RUNS, sizeof(double), cmp_d);
		if (k == MD_EPOL_LRU)
			lru = t[k][RUNS / 2];
		printf("| %s | %.1f | %.1f..%.1f | %.2f |\n", md_epol_name((enum md_epol_kind)k),
		       t[k][RUNS / 2], t[k][0], t[k][RUNS - 1], t[k][RUNS / 2] / lru);
	}
	return 0;
}
