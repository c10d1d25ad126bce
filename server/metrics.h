/* Prometheus metrics: counters and histograms updated on the loop thread, text exposition. */
#ifndef MD_METRICS_H
#define MD_METRICS_H

#include <stddef.h>
#include <stdint.h>

#define MD_METRICS_MAX_BUCKETS 24

struct md_histogram {
	const double *bounds;   /* borrowed: static upper bounds, ascending */
	size_t n_bounds;
	uint64_t counts[MD_METRICS_MAX_BUCKETS + 1]; /* last: +Inf */
	double sum;
	uint64_t count;
};

/* Gauges sampled at scrape time (from the engine and the HTTP server). */
struct md_metrics_gauges {
	uint32_t waiting, running;
	uint32_t kv_blocks_used, kv_blocks_total;
	uint64_t engine_steps, preemptions;
	size_t connections, busy;
	int ready;
};

struct md_metrics {
	uint64_t http_by_code[600];  /* responses by HTTP status */
	uint64_t finished_stop, finished_length, finished_abort, finished_error;
	uint64_t prompt_tokens, generation_tokens;
	struct md_histogram ttft, itl, e2e, prompt_len, gen_len;
};

void md_metrics_init(struct md_metrics *m);
void md_metrics_http(struct md_metrics *m, int status);
void md_hist_observe(struct md_histogram *h, double v);
/* Render the exposition text into a malloc'd buffer. Returns its length or -ENOMEM. */
long md_metrics_render(const struct md_metrics *m, const struct md_metrics_gauges *g,
		       const char *model, char **out);

#endif
