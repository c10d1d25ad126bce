/* Prometheus metrics: counters and histograms updated on the loop thread, text exposition. */
#include "server/metrics.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Bucket bounds follow vLLM's so existing dashboards read them the same way. */
static const double ttft_bounds[] = { 0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25,
				      0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0 };
static const double itl_bounds[] = { 0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
				     0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0 };
static const double e2e_bounds[] = { 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
				     30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0 };
static const double len_bounds[] = { 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000,
				     10000, 20000, 50000, 100000 };

#define NB(a) (sizeof(a) / sizeof(a[0]))

static void hist_init(struct md_histogram *h, const double *b, size_t n)
{
	memset(h, 0, sizeof(*h));
	h->bounds = b;
	h->n_bounds = n;
}

void md_metrics_init(struct md_metrics *m)
{
	memset(m, 0, sizeof(*m));
	hist_init(&m->ttft, ttft_bounds, NB(ttft_bounds));
	hist_init(&m->itl, itl_bounds, NB(itl_bounds));
	hist_init(&m->e2e, e2e_bounds, NB(e2e_bounds));
	hist_init(&m->prompt_len, len_bounds, NB(len_bounds));
	hist_init(&m->gen_len, len_bounds, NB(len_bounds));
}

void md_metrics_http(struct md_metrics *m, int status)
{
	if (status >= 100 && status < 600)
		m->http_by_code[status]++;
}

void md_hist_observe(struct md_histogram *h, double v)
{
	size_t i = 0;
	while (i < h->n_bounds && v > h->bounds[i])
		i++;
	h->counts[i]++;
	h->sum += v;
	h->count++;
}

struct sbuf {
	char *p;
	size_t len, cap;
	int err;
};

static void sb_printf(struct sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void sb_printf(struct sbuf *b, const char *fmt, ...)
{
	if (b->err)
		return;
	for (;;) {
		va_list ap;
		va_start(ap, fmt);
		int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
		va_end(ap);
		if (n < 0) {
			b->err = -EINVAL;
			return;
		}
		if ((size_t)n < b->cap - b->len) {
			b->len += (size_t)n;
			return;
		}
		size_t nc = b->cap * 2 + (size_t)n;
		char *np = realloc(b->p, nc);
		if (!np) {
			b->err = -ENOMEM;
			return;
		}
		b->p = np;
		b->cap = nc;
	}
}

static void hist_render(struct sbuf *b, const char *name, const char *help,
			const struct md_histogram *h, const char *labels)
{
	sb_printf(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
	uint64_t cum = 0;
	for (size_t i = 0; i < h->n_bounds; i++) {
		cum += h->counts[i];
		sb_printf(b, "%s_bucket{%s,le=\"%g\"} %llu\n", name, labels, h->bounds[i],
			  (unsigned long long)cum);
	}
	cum += h->counts[h->n_bounds];
	sb_printf(b, "%s_bucket{%s,le=\"+Inf\"} %llu\n", name, labels, (unsigned long long)cum);
	sb_printf(b, "%s_sum{%s} %.9g\n", name, labels, h->sum);
	sb_printf(b, "%s_count{%s} %llu\n", name, labels, (unsigned long long)h->count);
}

static void counter(struct sbuf *b, const char *name, const char *help, const char *labels,
		    uint64_t v)
{
	sb_printf(b, "# HELP %s %s\n# TYPE %s counter\n%s{%s} %llu\n", name, help, name, name, labels,
		  (unsigned long long)v);
}

static void gauge(struct sbuf *b, const char *name, const char *help, const char *labels,
		  double v)
{
	sb_printf(b, "# HELP %s %s\n# TYPE %s gauge\n%s{%s} %.9g\n", name, help, name, name, labels, v);
}

long md_metrics_render(const struct md_metrics *m, const struct md_metrics_gauges *g,
		       const char *model, char **out)
{
	struct sbuf b = { .p = malloc(8192), .cap = 8192 };
	if (!b.p)
		return -ENOMEM;
	b.p[0] = 0;
	char lab[300];
	/* model names come from our config or the GGUF: keep them label-safe */
	char safe[200];
	size_t j = 0;
	for (const char *s = model; *s && j < sizeof(safe) - 1; s++)
		safe[j++] = (*s == '"' || *s == '\\' || *s == '\n') ? '_' : *s;
	safe[j] = 0;
	snprintf(lab, sizeof(lab), "model_name=\"%s\"", safe);

	sb_printf(&b, "# HELP moed:http_requests_total HTTP responses by status code.\n"
		      "# TYPE moed:http_requests_total counter\n");
	for (int code = 100; code < 600; code++)
		if (m->http_by_code[code])
			sb_printf(&b, "moed:http_requests_total{code=\"%d\"} %llu\n", code,
				  (unsigned long long)m->http_by_code[code]);
	sb_printf(&b, "# HELP moed:request_success_total Finished generation requests by reason.\n"
		      "# TYPE moed:request_success_total counter\n");
	static const char *const reasons[] = { "stop", "length", "abort", "error" };
	const uint64_t vals[] = { m->finished_stop, m->finished_length, m->finished_abort,
				  m->finished_error };
	for (int i = 0; i < 4; i++)
		sb_printf(&b, "moed:request_success_total{%s,finished_reason=\"%s\"} %llu\n", lab,
			  reasons[i], (unsigned long long)vals[i]);
	counter(&b, "moed:prompt_tokens_total", "Prefilled prompt tokens.", lab, m->prompt_tokens);
	counter(&b, "moed:generation_tokens_total", "Generated tokens.", lab, m->generation_tokens);
	hist_render(&b, "moed:time_to_first_token_seconds", "Time to first token.", &m->ttft, lab);
	hist_render(&b, "moed:inter_token_latency_seconds", "Time between output tokens.", &m->itl,
		    lab);
	hist_render(&b, "moed:e2e_request_latency_seconds", "End-to-end request latency.", &m->e2e,
		    lab);
	hist_render(&b, "moed:request_prompt_tokens", "Prompt length of finished requests.",
		    &m->prompt_len, lab);
	hist_render(&b, "moed:request_generation_tokens", "Output length of finished requests.",
		    &m->gen_len, lab);
	gauge(&b, "moed:num_requests_running", "Sequences in the running batch.", lab, g->running);
	gauge(&b, "moed:num_requests_waiting", "Requests queued for admission.", lab, g->waiting);
	gauge(&b, "moed:kv_cache_blocks_used", "KV cache blocks in use.", lab, g->kv_blocks_used);
	gauge(&b, "moed:kv_cache_blocks_total", "KV cache blocks in the pool.", lab,
	      g->kv_blocks_total);
	gauge(&b, "moed:kv_cache_usage_perc", "Fraction of KV cache blocks in use.", lab,
	      g->kv_blocks_total ? (double)g->kv_blocks_used / g->kv_blocks_total : 0.0);
	counter(&b, "moed:engine_steps_total", "Engine forward steps.", lab, g->engine_steps);
	counter(&b, "moed:num_preemptions_total", "Sequences preempted for KV space.", lab,
		g->preemptions);
	gauge(&b, "moed:http_connections", "Open client connections.", lab, (double)g->connections);
	gauge(&b, "moed:http_requests_in_flight", "Requests being handled.", lab, (double)g->busy);
	gauge(&b, "moed:ready", "1 when the model is loaded and the server accepts work.", lab,
	      g->ready);
	if (b.err) {
		free(b.p);
		return b.err;
	}
	*out = b.p;
	return (long)b.len;
}
