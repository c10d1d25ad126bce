/* Prometheus metrics: counters and histograms kept by their modules, one registry to expose them. */
#ifndef MD_METRICS_H
#define MD_METRICS_H

/*
 * DESIGN
 * Values live where they are produced: the generation module (server/gen.c) owns a
 * struct md_metrics_gen, the reply senders count statuses in a struct md_metrics_http, the
 * engine reports struct md_engine_stats and the HTTP server its connection counts. A scrape
 * gathers pointers to all of them in a struct md_metrics_src and md_metrics_render walks the
 * registry in metrics.c: one row per metric with its name, type, help text and where its
 * value comes from (a source and a field offset, or a function for derived and labelled
 * ones). A new counter or gauge of an existing source is one row there; a new source is one
 * pointer in md_metrics_src. Everything runs on the loop thread; the engine's numbers arrive
 * as a copied snapshot (md_engine_get_stats).
 */

#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"

#define MD_METRICS_MAX_BUCKETS 24

struct md_histogram {
	const double *bounds;   /* borrowed: static upper bounds, ascending */
	size_t n_bounds;
	uint64_t counts[MD_METRICS_MAX_BUCKETS + 1]; /* last: +Inf */
	double sum;
	uint64_t count;
};

void md_hist_observe(struct md_histogram *h, double v);

/* Why a generated choice ended; the label values of moed:request_success_total. */
enum md_metrics_finish {
	MD_METRICS_FIN_STOP,
	MD_METRICS_FIN_LENGTH,
	MD_METRICS_FIN_ABORT,
	MD_METRICS_FIN_ERROR,
	MD_METRICS_N_FIN,
};

/* Counters of the generation module, updated on the loop thread. */
struct md_metrics_gen {
	uint64_t finished[MD_METRICS_N_FIN]; /* choices by finish reason */
	uint64_t prompt_tokens, generation_tokens;
	struct md_histogram ttft, itl, e2e, prompt_len, gen_len;
};

void md_metrics_gen_init(struct md_metrics_gen *m);

/* Responses by HTTP status, counted when a request ends. */
struct md_metrics_http {
	uint64_t by_code[600];
};

/* Out-of-range statuses are ignored. */
void md_metrics_http_count(struct md_metrics_http *m, int status);

/* HTTP server and API state sampled at scrape time. */
struct md_metrics_server {
	size_t connections, busy;
	uint64_t conns_evicted, conns_refused; /* at the connection cap */
	int ready;  /* 1 when the model is loaded and the server accepts work */
};

/* Everything one scrape reads; all borrowed for the duration of md_metrics_render. */
struct md_metrics_src {
	const struct md_metrics_http *http;
	const struct md_metrics_gen *gen;
	const struct md_engine_stats *engine;
	const struct md_metrics_server *server;
};

/* Render the exposition text (Prometheus text format 0.0.4) into a malloc'd buffer; model
 * labels every per-model series. Returns its length or -ENOMEM. */
long md_metrics_render(const struct md_metrics_src *src, const char *model, char **out);

#endif
