/* Prometheus metrics: the registry of exposed metrics and its text exposition. */
#include "server/metrics.h"

#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
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

void md_metrics_gen_init(struct md_metrics_gen *m)
{
	memset(m, 0, sizeof(*m));
	hist_init(&m->ttft, ttft_bounds, NB(ttft_bounds));
	hist_init(&m->itl, itl_bounds, NB(itl_bounds));
	hist_init(&m->e2e, e2e_bounds, NB(e2e_bounds));
	hist_init(&m->prompt_len, len_bounds, NB(len_bounds));
	hist_init(&m->gen_len, len_bounds, NB(len_bounds));
}

void md_metrics_http_count(struct md_metrics_http *m, int status)
{
	if (status >= 100 && status < 600)
		m->by_code[status]++;
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

/* ---- text buffer ---- */

struct sbuf {
	char *p;   /* owned */
	size_t len, cap;
	int err;   /* sticky: the first failure */
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

/* ---- the registry ---- */

enum row_kind { K_COUNTER, K_GAUGE, K_HISTOGRAM, K_FAMILY };
enum row_src { SRC_HTTP, SRC_GEN, SRC_ENGINE, SRC_SERVER };
enum val_type { V_U64, V_U32, V_SIZE, V_INT, V_HIST };

struct row;
/* Renders the sample lines of a labelled family (after its HELP and TYPE lines). */
typedef void (*family_fn)(struct sbuf *b, const struct md_metrics_src *src, const char *lab);
/* Computes a gauge from several fields. */
typedef double (*derive_fn)(const struct md_metrics_src *src);

/* One exposed metric: counters and gauges read one field (src + off, typed vt), histograms
 * one struct md_histogram; derived gauges and labelled families call a function instead. */
struct row {
	const char *name;
	enum row_kind kind;
	const char *help;
	enum row_src src;
	size_t off;
	enum val_type vt;
	derive_fn derive;  /* K_GAUGE computed from several fields; NULL otherwise */
	family_fn family;  /* K_FAMILY only */
	const char *type;  /* K_FAMILY: the TYPE line's word */
};

#define COUNTER(n, h, s, st, f, t) \
	{ .name = n, .kind = K_COUNTER, .help = h, .src = s, .off = offsetof(st, f), .vt = t }
#define GAUGE(n, h, s, st, f, t) \
	{ .name = n, .kind = K_GAUGE, .help = h, .src = s, .off = offsetof(st, f), .vt = t }
#define HIST(n, h, f) \
	{ .name = n, .kind = K_HISTOGRAM, .help = h, .src = SRC_GEN, \
	  .off = offsetof(struct md_metrics_gen, f), .vt = V_HIST }
#define DERIVED(n, h, fn) { .name = n, .kind = K_GAUGE, .help = h, .derive = fn }
#define FAMILY(n, t, h, fn) { .name = n, .kind = K_FAMILY, .help = h, .family = fn, .type = t }

#define GEN struct md_metrics_gen
#define ENG struct md_engine_stats
#define SRV struct md_metrics_server

static void fam_http_codes(struct sbuf *b, const struct md_metrics_src *src, const char *lab)
{
	(void)lab; /* by status only: the series predate the model label */
	for (int code = 100; code < 600; code++)
		if (src->http->by_code[code])
			sb_printf(b, "moed:http_requests_total{code=\"%d\"} %llu\n", code,
				  (unsigned long long)src->http->by_code[code]);
}

static void fam_finished(struct sbuf *b, const struct md_metrics_src *src, const char *lab)
{
	static const char *const reasons[MD_METRICS_N_FIN] = { "stop", "length", "abort", "error" };
	for (int i = 0; i < MD_METRICS_N_FIN; i++)
		sb_printf(b, "moed:request_success_total{%s,finished_reason=\"%s\"} %llu\n", lab,
			  reasons[i], (unsigned long long)src->gen->finished[i]);
}

static double kv_usage(const struct md_metrics_src *src)
{
	const struct md_engine_stats *e = src->engine;
	return e->kv_blocks_total ? (double)e->kv_blocks_used / e->kv_blocks_total : 0.0;
}

/* ---- the expert store (md_engine_stats.experts_*, dev_*): a row per tier ---- */

/* One family: the host tier's row (the store's RAM cache) and, with a device tier, the
 * device's; nothing on the mapping. */
#define TIER_FAM(fn, metric, host, dev, fmt)                                                    \
	static void fn(struct sbuf *b, const struct md_metrics_src *src, const char *lab)      \
	{                                                                                      \
		const struct md_engine_stats *e = src->engine;                                 \
		if (e->experts_store)                                                          \
			sb_printf(b, metric "{%s,tier=\"host\"} " fmt "\n", lab, host);       \
		if (e->experts_store && e->experts_device)                                     \
			sb_printf(b, metric "{%s,tier=\"device\"} " fmt "\n", lab, dev);      \
	}
#define U(x) ((unsigned long long)(x))
TIER_FAM(fam_ex_hits, "moed:expert_hits_total", U(e->experts_hits), U(e->dev_hits), "%llu")
TIER_FAM(fam_ex_misses, "moed:expert_misses_total", U(e->experts_misses), U(e->dev_misses),
	 "%llu")
TIER_FAM(fam_ex_bytes, "moed:expert_read_bytes_total", U(e->experts_bytes_read),
	 U(e->dev_bytes_uploaded), "%llu")
TIER_FAM(fam_ex_evict, "moed:expert_evictions_total", U(e->experts_evictions),
	 U(e->dev_evictions), "%llu")
TIER_FAM(fam_ex_stall, "moed:expert_stall_seconds_total", e->experts_stall_s, e->dev_stall_s,
	 "%.6f")
TIER_FAM(fam_ex_resident, "moed:expert_resident", U(e->experts_resident), U(e->dev_resident),
	 "%llu")
TIER_FAM(fam_ex_cache, "moed:expert_cache_bytes", U(e->experts_cache_bytes),
	 U(e->dev_mem_bytes), "%llu")
TIER_FAM(fam_ex_pf_issued, "moed:expert_prefetch_issued_total", U(e->experts_prefetch_issued),
	 U(e->dev_prefetch_issued), "%llu")
TIER_FAM(fam_ex_pf_used, "moed:expert_prefetch_used_total", U(e->experts_prefetch_used),
	 U(e->dev_prefetch_used), "%llu")
TIER_FAM(fam_ex_pf_wasted, "moed:expert_prefetch_wasted_bytes_total",
	 U(e->experts_prefetch_wasted_bytes), U(e->dev_prefetch_wasted_bytes), "%llu")

/* Read errors are the host tier's only (the file). */
static void fam_ex_errors(struct sbuf *b, const struct md_metrics_src *src, const char *lab)
{
	const struct md_engine_stats *e = src->engine;
	if (e->experts_store)
		sb_printf(b, "moed:expert_read_errors_total{%s,tier=\"host\"} %llu\n", lab,
			  U(e->experts_read_errors));
}

/* The cost model's choices for device misses (compute where it lives). */
static void fam_ex_where(struct sbuf *b, const struct md_metrics_src *src, const char *lab)
{
	const struct md_engine_stats *e = src->engine;
	if (!e->experts_store || !e->experts_device)
		return;
	sb_printf(b, "moed:expert_device_misses_computed_total{%s,on=\"device\"} %llu\n", lab,
		  U(e->dev_compute_dev));
	sb_printf(b, "moed:expert_device_misses_computed_total{%s,on=\"cpu\"} %llu\n", lab,
		  U(e->dev_compute_host));
}

/* ---- the forward pass on a device (md_engine_stats.dev_*): nothing on the CPU ---- */

static void fam_dev_info(struct sbuf *b, const struct md_metrics_src *src, const char *lab)
{
	const struct md_engine_stats *e = src->engine;
	if (!e->dev_forward)
		return;
	char safe[sizeof(e->dev_name)];
	size_t j = 0;
	for (const char *s = e->dev_name; *s && j < sizeof(safe) - 1; s++)
		safe[j++] = (*s == '"' || *s == '\\' || *s == '\n') ? '_' : *s;
	safe[j] = 0;
	sb_printf(b, "moed:device_info{%s,device=\"%s\"} 1\n", lab, safe);
}

static void fam_dev_mem(struct sbuf *b, const struct md_metrics_src *src, const char *lab)
{
	const struct md_engine_stats *e = src->engine;
	if (!e->dev_forward)
		return;
	sb_printf(b, "moed:device_memory_bytes{%s,part=\"weights\"} %llu\n", lab,
		  U(e->dev_mem_weights));
	sb_printf(b, "moed:device_memory_bytes{%s,part=\"kv\"} %llu\n", lab, U(e->dev_mem_kv));
	sb_printf(b, "moed:device_memory_bytes{%s,part=\"activations\"} %llu\n", lab,
		  U(e->dev_mem_act));
	sb_printf(b, "moed:device_memory_bytes{%s,part=\"experts\"} %llu\n", lab,
		  U(e->experts_device ? e->dev_mem_bytes : 0));
}

static void fam_dev_routed(struct sbuf *b, const struct md_metrics_src *src, const char *lab)
{
	const struct md_engine_stats *e = src->engine;
	if (!e->dev_forward)
		return;
	sb_printf(b, "moed:device_moe_layers_routed_total{%s,on=\"device\"} %llu\n", lab,
		  U(e->dev_layers_routed_dev));
	sb_printf(b, "moed:device_moe_layers_routed_total{%s,on=\"host\"} %llu\n", lab,
		  U(e->dev_layers_routed_host));
}

static void fam_dev_graphs(struct sbuf *b, const struct md_metrics_src *src, const char *lab)
{
	const struct md_engine_stats *e = src->engine;
	if (!e->dev_forward)
		return;
	sb_printf(b, "moed:device_graph_launches_total{%s} %llu\n", lab, U(e->dev_graph_launches));
}

static void fam_dev_captures(struct sbuf *b, const struct md_metrics_src *src, const char *lab)
{
	const struct md_engine_stats *e = src->engine;
	if (e->dev_forward)
		sb_printf(b, "moed:device_graph_captures_total{%s} %llu\n", lab,
			  U(e->dev_graph_captures));
}

static void fam_dev_total(struct sbuf *b, const struct md_metrics_src *src, const char *lab)
{
	const struct md_engine_stats *e = src->engine;
	if (e->dev_forward)
		sb_printf(b, "moed:device_memory_total_bytes{%s} %llu\n", lab, U(e->dev_mem_total));
}

static double ex_store(const struct md_metrics_src *src)
{
	return src->engine->experts_store ? 1.0 : 0.0;
}

static double ex_distinct(const struct md_metrics_src *src)
{
	const struct md_engine_stats *e = src->engine;
	return e->experts_steps ? (double)e->experts_step_distinct / e->experts_steps : 0.0;
}

static double ex_accuracy(const struct md_metrics_src *src)
{
	const struct md_engine_stats *e = src->engine;
	return e->experts_predicted_total
		? (double)e->experts_predicted_used / e->experts_predicted_total : 0.0;
}

/* Tokens a verification step emits on average: 1 + accepted drafts per step (0: none yet). */
static double spec_mean_len(const struct md_metrics_src *src)
{
	const struct md_engine_stats *e = src->engine;
	return e->spec_verify_steps ? (double)e->spec_emitted / e->spec_verify_steps : 0.0;
}

/* Distinct experts per MoE layer of a verifying step (0: none yet). */
static double spec_verify_distinct(const struct md_metrics_src *src)
{
	const struct md_engine_stats *e = src->engine;
	return e->spec_verify_layers ? (double)e->spec_verify_distinct / e->spec_verify_layers : 0.0;
}

static double spec_accept_rate(const struct md_metrics_src *src)
{
	const struct md_engine_stats *e = src->engine;
	return e->spec_drafted ? (double)e->spec_accepted / e->spec_drafted : 0.0;
}

static const struct row registry[] = {
	FAMILY("moed:http_requests_total", "counter", "HTTP responses by status code.",
	       fam_http_codes),
	FAMILY("moed:request_success_total", "counter", "Finished generation requests by reason.",
	       fam_finished),
	COUNTER("moed:prompt_tokens_total", "Prefilled prompt tokens.", SRC_GEN, GEN,
		prompt_tokens, V_U64),
	COUNTER("moed:generation_tokens_total", "Generated tokens.", SRC_GEN, GEN,
		generation_tokens, V_U64),
	HIST("moed:time_to_first_token_seconds", "Time to first token.", ttft),
	HIST("moed:inter_token_latency_seconds", "Time between output tokens.", itl),
	HIST("moed:e2e_request_latency_seconds", "End-to-end request latency.", e2e),
	HIST("moed:request_prompt_tokens", "Prompt length of finished requests.", prompt_len),
	HIST("moed:request_generation_tokens", "Output length of finished requests.", gen_len),
	GAUGE("moed:num_requests_running", "Sequences in the running batch.", SRC_ENGINE, ENG,
	      running, V_U32),
	GAUGE("moed:num_requests_waiting", "Requests queued for admission.", SRC_ENGINE, ENG,
	      waiting, V_U32),
	GAUGE("moed:kv_cache_blocks_used", "KV cache blocks in use.", SRC_ENGINE, ENG,
	      kv_blocks_used, V_U32),
	GAUGE("moed:kv_cache_blocks_total", "KV cache blocks in the pool.", SRC_ENGINE, ENG,
	      kv_blocks_total, V_U32),
	DERIVED("moed:kv_cache_usage_perc", "Fraction of KV cache blocks in use.", kv_usage),
	COUNTER("moed:engine_steps_total", "Engine forward steps.", SRC_ENGINE, ENG, steps, V_U64),
	COUNTER("moed:num_preemptions_total", "Sequences preempted for KV space.", SRC_ENGINE, ENG,
		preemptions, V_U64),
	COUNTER("moed:recomputed_tokens_total", "Tokens computed again after a preemption.",
		SRC_ENGINE, ENG, recomputed_tokens, V_U64),
	COUNTER("moed:prefix_cache_queries_total", "Admissions that looked up the prefix cache.",
		SRC_ENGINE, ENG, prefix_queries, V_U64),
	COUNTER("moed:prefix_cache_hits_total", "Admissions that reused at least one cached block.",
		SRC_ENGINE, ENG, prefix_hits, V_U64),
	COUNTER("moed:prefix_cache_hit_tokens_total", "Prompt positions reused instead of computed.",
		SRC_ENGINE, ENG, prefix_hit_tokens, V_U64),
	COUNTER("moed:prefix_cache_evictions_total", "Cached KV blocks reused for other content.",
		SRC_ENGINE, ENG, prefix_evictions, V_U64),
	GAUGE("moed:prefix_cache_blocks", "KV blocks registered in the prefix cache.", SRC_ENGINE,
	      ENG, prefix_blocks, V_U32),
	COUNTER("moed:moe_layer_steps_total", "MoE layers computed (steps x MoE layers).",
		SRC_ENGINE, ENG, moe_layer_steps, V_U64),
	COUNTER("moed:moe_distinct_experts_total", "Distinct experts computed, summed over MoE "
		"layers and steps (divide by moe_layer_steps_total for experts per layer and step).",
		SRC_ENGINE, ENG, moe_distinct_experts, V_U64),
	COUNTER("moed:expert_batching_selections_total", "Steps whose decoding sequences were "
		"chosen by shared experts (expert-batching).", SRC_ENGINE, ENG, expert_selections,
		V_U64),
	COUNTER("moed:expert_batching_prefill_selections_total", "Steps whose prompt chunks were "
		"ordered by shared experts (expert-batching).", SRC_ENGINE, ENG,
		prefill_selections, V_U64),
	DERIVED("moed:expert_store", "1 when routed experts go through the expert store.",
		ex_store),
	FAMILY("moed:expert_hits_total", "counter", "Experts a layer used that the tier held "
	       "(host: resident or already being read; device: copied up and ready).", fam_ex_hits),
	FAMILY("moed:expert_misses_total", "counter", "Experts a layer used that the tier did not "
	       "hold (host: read on demand; device: computed on the CPU or copied up for the "
	       "step).", fam_ex_misses),
	FAMILY("moed:expert_read_bytes_total", "counter", "Bytes brought into the tier (host: "
	       "read from the file; device: copied up from host RAM).", fam_ex_bytes),
	FAMILY("moed:expert_read_errors_total", "counter", "Expert reads that failed (their "
	       "requests got an error).", fam_ex_errors),
	FAMILY("moed:expert_evictions_total", "counter", "Experts evicted from the tier.",
	       fam_ex_evict),
	FAMILY("moed:expert_stall_seconds_total", "counter", "Time the forward pass waited for "
	       "the tier (host: file reads; device: copies).", fam_ex_stall),
	FAMILY("moed:expert_resident", "gauge", "Experts resident (or on their way) in the tier.",
	       fam_ex_resident),
	FAMILY("moed:expert_cache_bytes", "gauge", "Memory of the tier's expert slots (host RAM; "
	       "device memory used).", fam_ex_cache),
	FAMILY("moed:expert_prefetch_issued_total", "counter", "Experts brought in ahead of use "
	       "(host: the prefetcher's reads, the warm start's and the start-up fill's; device: "
	       "background copies).", fam_ex_pf_issued),
	FAMILY("moed:expert_prefetch_used_total", "counter", "Of those, experts a layer then "
	       "used from the tier.", fam_ex_pf_used),
	FAMILY("moed:expert_prefetch_wasted_bytes_total", "counter", "Bytes of experts brought "
	       "in ahead and evicted unused.", fam_ex_pf_wasted),
	COUNTER("moed:expert_prefetch_cancelled_total", "Prefetcher guesses their layer did not "
		"use, taken off the queue before their read started.", SRC_ENGINE, ENG,
		experts_prefetch_cancelled, V_U64),
	FAMILY("moed:device_info", "gauge", "The device the forward pass runs on (absent on the "
	       "CPU).", fam_dev_info),
	FAMILY("moed:device_memory_bytes", "gauge", "Device memory the forward pass holds, by "
	       "part: weights (dense, and the experts when resident), the KV cache's rows, "
	       "activations, the expert store's device tier.", fam_dev_mem),
	FAMILY("moed:device_memory_total_bytes", "gauge", "The device's memory.", fam_dev_total),
	FAMILY("moed:device_moe_layers_routed_total", "counter", "MoE layer passes on the device "
	       "by where they were routed: on the device (no host round trip) or on the host.",
	       fam_dev_routed),
	FAMILY("moed:device_graph_launches_total", "counter", "Forward passes run as one CUDA "
	       "graph (decode and verification steps up to 64 tokens that need no host round "
	       "trip).", fam_dev_graphs),
	FAMILY("moed:device_graph_captures_total", "counter", "Graphs captured (one per batch "
	       "size, again when a buffer it reads moved).", fam_dev_captures),
	FAMILY("moed:expert_device_misses_computed_total", "counter", "Device misses by where "
	       "the cost model ran them: copied up and on the device, or on the CPU from host "
	       "RAM.", fam_ex_where),
	COUNTER("moed:expert_predicted_used_total", "Experts used that the prediction for their "
		"layer named.", SRC_ENGINE, ENG, experts_predicted_used, V_U64),
	COUNTER("moed:expert_predicted_total", "Experts used by layers that had a prediction.",
		SRC_ENGINE, ENG, experts_predicted_total, V_U64),
	DERIVED("moed:expert_prefetch_accuracy", "Predicted and used over used, since start.",
		ex_accuracy),
	DERIVED("moed:expert_distinct_per_step", "Distinct experts a step used, mean since start.",
		ex_distinct),
	COUNTER("moed:spec_draft_tokens_total", "Speculative decoding: drafted tokens verified.",
		SRC_ENGINE, ENG, spec_drafted, V_U64),
	COUNTER("moed:spec_accepted_tokens_total", "Speculative decoding: drafted tokens accepted.",
		SRC_ENGINE, ENG, spec_accepted, V_U64),
	COUNTER("moed:spec_verify_steps_total",
		"Speculative decoding: sequence-steps that verified drafts.", SRC_ENGINE, ENG,
		spec_verify_steps, V_U64),
	COUNTER("moed:spec_sequence_steps_total",
		"Speculative decoding: decode sequence-steps of requests with a drafter.", SRC_ENGINE,
		ENG, spec_seq_steps, V_U64),
	COUNTER("moed:spec_proposal_steps_total",
		"Speculative decoding: those in which the drafter had a proposal (drafted or not).",
		SRC_ENGINE, ENG, spec_proposal_steps, V_U64),
	COUNTER("moed:spec_proposed_tokens_total",
		"Speculative decoding: tokens those proposals offered, drafted or not.", SRC_ENGINE,
		ENG, spec_proposed, V_U64),
	COUNTER("moed:spec_emitted_tokens_total",
		"Speculative decoding: tokens emitted by verifying steps (accepted drafts plus one).",
		SRC_ENGINE, ENG, spec_emitted, V_U64),
	COUNTER("moed:spec_verify_layer_passes_total",
		"Speculative decoding: MoE layer passes of steps that verified drafts.", SRC_ENGINE, ENG,
		spec_verify_layers, V_U64),
	COUNTER("moed:spec_verify_distinct_experts_total",
		"Speculative decoding: distinct experts over those layer passes.", SRC_ENGINE, ENG,
		spec_verify_distinct, V_U64),
	DERIVED("moed:spec_verify_distinct_experts",
		"Distinct experts per MoE layer of a verifying step, mean since start.",
		spec_verify_distinct),
	COUNTER("moed:spec_self_predicted_experts_total",
		"Self-speculation: experts its drafts predicted for the verifying step and prefetched "
		"(expert store only; per layer, summed).", SRC_ENGINE, ENG, spec_self_predicted, V_U64),
	COUNTER("moed:spec_self_predicted_used_total",
		"Self-speculation: of those, experts the verifying step then used.", SRC_ENGINE, ENG,
		spec_self_predicted_used, V_U64),
	COUNTER("moed:spec_self_used_experts_total",
		"Self-speculation: experts the verifying steps it predicted for used.", SRC_ENGINE, ENG,
		spec_self_used, V_U64),
	DERIVED("moed:spec_mean_accepted_length",
		"Tokens emitted per verifying step (1 + accepted drafts), since start.", spec_mean_len),
	DERIVED("moed:spec_acceptance_rate", "Accepted over drafted tokens, since start.",
		spec_accept_rate),
	GAUGE("moed:http_connections", "Open client connections.", SRC_SERVER, SRV, connections,
	      V_SIZE),
	GAUGE("moed:http_requests_in_flight", "Requests being handled.", SRC_SERVER, SRV, busy,
	      V_SIZE),
	COUNTER("moed:http_connections_evicted_total",
		"Idle connections closed to make room at the connection cap.", SRC_SERVER, SRV,
		conns_evicted, V_U64),
	COUNTER("moed:http_connections_refused_total",
		"Connections answered 503 at the connection cap (none idle) or while draining.",
		SRC_SERVER, SRV, conns_refused, V_U64),
	GAUGE("moed:ready", "1 when the model is loaded and the server accepts work.", SRC_SERVER,
	      SRV, ready, V_INT),
};

static const void *source(const struct md_metrics_src *src, enum row_src s)
{
	switch (s) {
	case SRC_HTTP: return src->http;
	case SRC_GEN: return src->gen;
	case SRC_ENGINE: return src->engine;
	case SRC_SERVER: return src->server;
	}
	return NULL;
}

/* The row's field as a number (counters keep their integer value exactly below 2^53). */
static double field(const struct row *r, const struct md_metrics_src *src, uint64_t *as_u64)
{
	const char *p = (const char *)source(src, r->src) + r->off;
	uint64_t u = 0;
	switch (r->vt) {
	case V_U64: u = *(const uint64_t *)p; break;
	case V_U32: u = *(const uint32_t *)p; break;
	case V_SIZE: u = *(const size_t *)p; break;
	case V_INT: u = (uint64_t)*(const int *)p; break;
	case V_HIST: break;
	}
	*as_u64 = u;
	return r->vt == V_INT ? (double)*(const int *)p : (double)u;
}

static void render_hist(struct sbuf *b, const char *name, const struct md_histogram *h,
			const char *labels)
{
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

static void render_row(struct sbuf *b, const struct row *r, const struct md_metrics_src *src,
		       const char *lab)
{
	static const char *const types[] = { "counter", "gauge", "histogram", NULL };
	sb_printf(b, "# HELP %s %s\n# TYPE %s %s\n", r->name, r->help, r->name,
		  r->kind == K_FAMILY ? r->type : types[r->kind]);
	uint64_t u;
	switch (r->kind) {
	case K_COUNTER:
		field(r, src, &u);
		sb_printf(b, "%s{%s} %llu\n", r->name, lab, (unsigned long long)u);
		break;
	case K_GAUGE: {
		double v = r->derive ? r->derive(src) : field(r, src, &u);
		sb_printf(b, "%s{%s} %.9g\n", r->name, lab, v);
		break;
	}
	case K_HISTOGRAM:
		render_hist(b, r->name,
			    (const struct md_histogram *)((const char *)source(src, r->src) + r->off),
			    lab);
		break;
	case K_FAMILY:
		r->family(b, src, lab);
		break;
	}
}

long md_metrics_render(const struct md_metrics_src *src, const char *model, char **out)
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
	for (size_t i = 0; i < NB(registry); i++)
		render_row(&b, &registry[i], src, lab);
	if (b.err) {
		free(b.p);
		return b.err;
	}
	*out = b.p;
	return (long)b.len;
}
