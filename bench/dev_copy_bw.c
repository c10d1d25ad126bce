/* The device's copy bandwidth (dev_copy_bw.h), shared by moed-bench and bench_dev_ops. */
#include "bench/dev_copy_bw.h"

#include <time.h>

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

double md_bench_dev_copy_bw(struct md_backend *b, size_t n)
{
	void *a = NULL, *c = NULL;
	double best = 0;
	if (b->alloc(b, n, &a) || b->alloc(b, n, &c)) {
		b->free(b, a);
		return 0;
	}
	for (int r = 0; r < 6; r++) {
		double t0 = now_s();
		if (b->fwd->copy(b, c, a, n) || b->fwd->sync(b))
			break;
		double bw = 2.0 * (double)n / (now_s() - t0);
		if (r > 0 && bw > best)
			best = bw;
	}
	b->free(b, a);
	b->free(b, c);
	return best;
}
