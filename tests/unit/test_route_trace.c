/* Routing traces: the engine, serving two greedy requests at once with --trace-routing, writes
 * one record per (token, layer) whose experts and weights are the router's (checked against a
 * separate forward pass over the same tokens); the reader refuses malformed traces by line.
 * And the engine's other routing observer, expert-aware batching: same greedy output on and
 * off, with the distinct-experts counters.
 *
 * Usage: test_route_trace MODEL.gguf (a MoE model). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/engine.h"
#include "engine/forward.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "engine/route_trace.h"
#include "tests/check.h"

#define N_REQ 2
#define MAX_GEN 7
#define MAX_TOK 64

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

struct req_out {
	uint64_t id;
	int32_t toks[MAX_TOK]; /* prompt then generated */
	uint32_t n_prompt, n;
	bool done;
};

static struct md_engine_req *mkreq(struct req_out *o)
{
	struct md_engine_req *r = calloc(1, sizeof(*r));
	r->id = o->id;
	r->n_prompt = o->n_prompt;
	r->prompt = malloc(sizeof(int32_t) * o->n_prompt);
	memcpy(r->prompt, o->toks, sizeof(int32_t) * o->n_prompt);
	r->max_tokens = MAX_GEN;
	r->ignore_eos = true;
	md_sampling_default(&r->sampling);
	r->sampling.temperature = 0;
	return r;
}

/* The routing a reference forward pass computes, per layer and row, and its pre-gating. */
struct capture {
	uint32_t n_used;
	int32_t ids[8][MAX_TOK][8];
	float w[8][MAX_TOK][8];
	int32_t pg[8][MAX_TOK][8];
	int n_rows;
};

static void on_pregate(void *ud, uint32_t layer, const struct md_routing *r)
{
	struct capture *c = ud;
	for (int i = 0; i < r->n_tokens; i++)
		for (int j = 0; j < r->n_used; j++)
			c->pg[layer][i][j] = r->ids[i * r->n_used + j];
}

static void on_route(void *ud, uint32_t layer, const struct md_routing *r)
{
	struct capture *c = ud;
	c->n_rows = r->n_tokens;
	for (int i = 0; i < r->n_tokens; i++)
		for (int j = 0; j < r->n_used; j++) {
			c->ids[layer][i][j] = r->ids[i * r->n_used + j];
			c->w[layer][i][j] = r->w[i * r->n_used + j];
		}
}

/* Run the engine on n requests (a trace when trace is set); fill outs with their tokens. */
static void run_engine_n(const char *model, const char *trace, struct req_out *outs, int n,
			 uint32_t step_tokens, bool expert_batching, struct md_engine_stats *st)
{
	struct md_engine_config cfg = {
		.model_path = model, .n_threads = 2, .n_ctx = MAX_TOK, .kv_mem_mb = 16,
		.max_seqs = 8, .step_tokens = step_tokens, .max_queue = 16, .trace_routing = trace,
		.expert_batching = expert_batching,
	};
	struct md_engine *e;
	REQUIRE(CHECK_EQ_I(md_engine_new(&e, &cfg, NULL, NULL), 0));
	REQUIRE(CHECK_EQ_I(md_engine_start(e), 0));
	double end = now_s() + 60;
	while (md_engine_state(e) == MD_ENGINE_LOADING && now_s() < end)
		usleep(10000);
	REQUIRE(CHECK_EQ_I(md_engine_state(e), MD_ENGINE_READY));
	md_engine_events_free(md_engine_poll(e));
	for (int i = 0; i < n; i++)
		REQUIRE(CHECK_EQ_I(md_engine_submit(e, mkreq(&outs[i])), 0));
	end = now_s() + 60;
	int n_done = 0;
	while (n_done < n && now_s() < end) {
		struct md_engine_event *l = md_engine_poll(e);
		for (struct md_engine_event *ev = l; ev; ev = ev->next)
			for (int i = 0; i < n; i++) {
				struct req_out *o = &outs[i];
				if (ev->req_id != o->id)
					continue;
				if (ev->kind == MD_EV_TOKEN && o->n < MAX_TOK)
					o->toks[o->n++] = ev->token;
				if (ev->kind == MD_EV_DONE) {
					o->done = true;
					n_done++;
				}
			}
		md_engine_events_free(l);
		usleep(2000);
	}
	if (st)
		md_engine_get_stats(e, st);
	md_engine_free(e); /* closes the trace */
	for (int i = 0; i < n; i++) {
		CHECK(outs[i].done);
		CHECK_EQ_U(outs[i].n, outs[i].n_prompt + MAX_GEN);
	}
}

static void run_engine(const char *model, const char *trace, struct req_out *outs)
{
	run_engine_n(model, trace, outs, N_REQ, 16, false, NULL);
}

/* Expert-aware batching changes which sequences share a step, never what they generate:
 * six greedy requests with room for four per step give the same tokens with it on and off,
 * and only "on" chose steps by experts. */
static void test_expert_batching_same_output(const char *model)
{
	struct req_out on[6], off[6];
	for (int i = 0; i < 6; i++) {
		memset(&on[i], 0, sizeof(on[i]));
		on[i].id = 10 + (uint64_t)i;
		on[i].n_prompt = 3 + (uint32_t)i;
		for (uint32_t k = 0; k < on[i].n_prompt; k++)
			on[i].toks[k] = (int32_t)(100 + 37 * i + 11 * k);
		on[i].n = on[i].n_prompt;
		off[i] = on[i];
	}
	struct md_engine_stats st_on, st_off;
	run_engine_n(model, NULL, on, 6, 4, true, &st_on);
	run_engine_n(model, NULL, off, 6, 4, false, &st_off);
	for (int i = 0; i < 6; i++) {
		CHECK_CONTEXT("request %d", i);
		CHECK_EQ_U(on[i].n, off[i].n);
		CHECK_MEM_EQ(on[i].toks, off[i].toks, sizeof(int32_t) * on[i].n);
	}
	CHECK_CONTEXT_CLEAR();
	CHECK(st_on.expert_selections > 0);
	CHECK_EQ_U(st_off.expert_selections, 0);
	/* every MoE layer (moe64: 6) of every step counted, 1 to 4 tokens x k = 4 experts each */
	CHECK(st_on.moe_layer_steps == st_on.steps * 6);
	CHECK(st_on.moe_distinct_experts <= st_on.moe_layer_steps * 4 * 4);
	CHECK(st_on.moe_distinct_experts >= st_on.moe_layer_steps * 4);
}

static void test_engine_trace(const char *model, const char *trace)
{
	/* A prompt longer than the step budget (16): prefill takes two steps. */
	struct req_out outs[N_REQ] = { { .id = 101, .n_prompt = 20 }, { .id = 202, .n_prompt = 5 } };
	for (uint32_t k = 0; k < outs[0].n_prompt; k++)
		outs[0].toks[k] = (int32_t)(300 + 17 * k);
	for (uint32_t k = 0; k < outs[1].n_prompt; k++)
		outs[1].toks[k] = (int32_t)(40 + 3 * k);
	for (int i = 0; i < N_REQ; i++)
		outs[i].n = outs[i].n_prompt;
	run_engine(model, trace, outs);

	struct md_route_log log;
	char err[256];
	REQUIRE(CHECK_EQ_I(md_route_log_read(&log, trace, err, sizeof(err)), 0));

	char lerr[400];
	struct md_model m;
	REQUIRE(CHECK_EQ_I(md_model_load(&m, model, lerr, sizeof(lerr)), 0));
	CHECK_EQ_U(log.n_layer, m.hp.n_layer);
	CHECK_EQ_U(log.n_expert, m.hp.n_expert);
	CHECK_EQ_U(log.n_used, m.hp.n_expert_used);
	REQUIRE(CHECK(m.hp.n_layer <= 8 && m.hp.n_expert_used <= 8));

	/* Every token fed to the model (all but the last sampled) once per layer. */
	uint64_t want = 0;
	for (int i = 0; i < N_REQ; i++)
		want += (uint64_t)(outs[i].n - 1) * m.hp.n_layer;
	CHECK_EQ_U(log.n_rec, want);

	/* Steps: the budget of 16 rows is never exceeded. When both requests are in before the
	 * first step: 16 tokens of the long prompt, then the short prompt and the long one's last
	 * 4, then one decode step per token (8 steps); when the engine thread starts on the
	 * first alone, the short one trails by a step or two. */
	uint64_t rows_in_step = 0, step = 0, max_rows = 0, n_steps = 0;
	for (uint64_t r = 0; r < log.n_rec; r++) {
		if (log.rec[r].layer != 0)
			continue;
		if (log.rec[r].step != step) {
			step = log.rec[r].step;
			rows_in_step = 0;
			n_steps++;
		}
		if (++rows_in_step > max_rows)
			max_rows = rows_in_step;
	}
	CHECK(max_rows <= 16);
	CHECK(n_steps >= MAX_GEN + 1 && n_steps <= MAX_GEN + 3);

	/* The experts and weights of each record are the router's: a reference forward pass per
	 * request, prompt in one batch then one token at a time as the engine fed them. */
	struct md_kv_cache kv;
	REQUIRE(CHECK_EQ_I(md_kv_init(&kv, m.hp.n_layer, m.hp.n_head_kv * m.hp.head_dim, 16, 1), 0));
	struct md_forward_ctx *f = md_forward_new(&m, 2, MAX_TOK);
	REQUIRE(CHECK(f != NULL));
	float *logits = malloc(sizeof(float) * m.hp.n_vocab);
	struct capture *cap = calloc(1, sizeof(*cap));
	md_forward_set_route_cb(f, on_route, cap);
	md_forward_set_pregate_cb(f, on_pregate, cap);
	uint32_t k = m.hp.n_expert_used;
	uint64_t matched = 0, pg_recs = 0, pg_used = 0, pg_hit = 0;
	for (int i = 0; i < N_REQ; i++) {
		struct req_out *o = &outs[i];
		int s = md_kv_seq_new(&kv);
		REQUIRE(CHECK(s >= 0 && md_kv_reserve(&kv, s, o->n) == 0));
		int32_t seq[MAX_TOK], pos[MAX_TOK];
		for (uint32_t p = 0; p < o->n - 1;) {
			uint32_t n = p == 0 ? o->n_prompt : 1;
			for (uint32_t j = 0; j < n; j++) {
				seq[j] = s;
				pos[j] = (int32_t)(p + j);
			}
			struct md_batch b = { (int32_t)n, o->toks + p, seq, pos, NULL, NULL };
			REQUIRE(CHECK(md_forward(f, &kv, &b, logits) >= 0));
			for (uint64_t r = 0; r < log.n_rec; r++) {
				const struct md_route_rec *rec = &log.rec[r];
				if (rec->seq != o->id || rec->pos < p || rec->pos >= p + n)
					continue;
				uint32_t row = rec->pos - p;
				CHECK_CONTEXT("request %llu layer %u pos %u", (unsigned long long)o->id,
					      rec->layer, rec->pos);
				for (uint32_t j = 0; j < k; j++) {
					CHECK_EQ_I(log.experts[rec->first + j], cap->ids[rec->layer][row][j]);
					CHECK_NEAR(log.weights[rec->first + j], cap->w[rec->layer][row][j],
						   6e-5);
				}
				/* Every layer after the first has the pre-gating prediction, the
				 * reference pass's, whatever else shared the engine's step. */
				CHECK_EQ_I(rec->has_pregate, rec->layer > 0);
				for (uint32_t j = 0; rec->has_pregate && j < k; j++) {
					int32_t e = log.pregate[rec->first + j];
					CHECK_EQ_I(e, cap->pg[rec->layer][row][j]);
					for (uint32_t q = 0; q < k; q++)
						pg_hit += e == log.experts[rec->first + q];
				}
				if (rec->has_pregate) {
					pg_recs++;
					pg_used += k;
				}
				matched++;
			}
			/* The previous layers' captures are overwritten by the next batch. */
			p += n;
		}
		md_kv_seq_free(&kv, s);
	}
	CHECK_CONTEXT_CLEAR();
	CHECK_EQ_U(matched, want);
	CHECK_EQ_U(log.n_pregate, pg_recs);
	CHECK_EQ_U(pg_recs, want / m.hp.n_layer * (m.hp.n_layer - 1));
	/* The trained router: pre-gating names far more than chance (k / E) of the experts. */
	CHECK(pg_used && (double)pg_hit / (double)pg_used > 0.5);
	free(cap);
	free(logits);
	md_forward_free(f);
	md_kv_release(&kv);
	md_model_free(&m);
	md_route_log_release(&log);
}

/* Write text to path and read it back; returns the reader's code, err its message. */
static int read_text(const char *path, const char *text, char *err, size_t errlen)
{
	FILE *f = fopen(path, "w");
	REQUIRE(CHECK(f != NULL));
	fputs(text, f);
	fclose(f);
	struct md_route_log log;
	int rc = md_route_log_read(&log, path, err, errlen);
	md_route_log_release(&log);
	return rc;
}

static void test_reader_errors(const char *path)
{
	static const char *hdr = "# moed routing trace 1\n# n_layer 2 n_expert 4 n_used 2\n";
	char text[512], err[256];
	snprintf(text, sizeof(text), "%s1 0 7 0 3 1 0.6 0.4\n1 1 7 0 2 0 0.5 0.5\n", hdr);
	CHECK_EQ_I(read_text(path, text, err, sizeof(err)), 0);
	struct {
		const char *rec, *why;
		int line;
	} bad[] = {
		{ "1 2 7 0 3 1 0.6 0.4\n", "layer out of range", 3 },
		{ "1 0 7 0 4 1 0.6 0.4\n", "bad experts", 3 },
		{ "1 0 7 0 3 1 0.6\n", "bad experts", 3 },
		{ "1 0 7 0 3 1 0.6 0.4 9\n", "bad experts", 3 },
		{ "2 0 7 0 3 1 0.6 0.4\n1 0 7 1 3 1 0.6 0.4\n", "step goes backwards", 4 },
		{ "x 0 7 0 3 1 0.6 0.4\n", "malformed record", 3 },
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		snprintf(text, sizeof(text), "%s%s", hdr, bad[i].rec);
		CHECK_CONTEXT("bad record %zu", i);
		CHECK_EQ_I(read_text(path, text, err, sizeof(err)), -EINVAL);
		char where[32];
		snprintf(where, sizeof(where), ":%d: ", bad[i].line);
		CHECK(strstr(err, where) != NULL);
		CHECK(strstr(err, bad[i].why) != NULL);
	}
	CHECK_CONTEXT_CLEAR();
	/* Version 2's pre-gating lines: one attached to the record it names (whatever the order
	 * of the rows), one naming no record of its step dropped, malformed ones refused. */
	static const char *hdr2 = "# moed routing trace 2\n# n_layer 2 n_expert 4 n_used 2\n";
	snprintf(text, sizeof(text), "%sp 1 1 7 0 2 1\np 1 1 8 0 0 3\np 1 1 9 0 1 2\n"
		 "1 1 8 0 0 1 0.5 0.5\n1 1 7 0 2 0 0.5 0.5\n2 0 7 1 3 1 0.6 0.4\n", hdr2);
	{
		FILE *f = fopen(path, "w");
		REQUIRE(CHECK(f != NULL));
		fputs(text, f);
		fclose(f);
		struct md_route_log lg;
		REQUIRE(CHECK_EQ_I(md_route_log_read(&lg, path, err, sizeof(err)), 0));
		REQUIRE(CHECK_EQ_U(lg.n_rec, 3));
		CHECK_EQ_U(lg.n_pregate, 2);
		CHECK(lg.rec[0].has_pregate && lg.rec[1].has_pregate && !lg.rec[2].has_pregate);
		CHECK_EQ_I(lg.pregate[lg.rec[0].first], 0); /* seq 8's */
		CHECK_EQ_I(lg.pregate[lg.rec[0].first + 1], 3);
		CHECK_EQ_I(lg.pregate[lg.rec[1].first], 2); /* seq 7's */
		CHECK_EQ_I(lg.pregate[lg.rec[2].first], -1);
		md_route_log_release(&lg);
	}
	static const char *bad_pg[] = { "p 1 2 7 0 2 1\n", "p 1 1 7 0 2 4\n", "p 1 1 7 0 2\n",
					"p 1 1 7 0 2 1 0.5\n", "p x 1 7 0 2 1\n" };
	for (size_t i = 0; i < sizeof(bad_pg) / sizeof(bad_pg[0]); i++) {
		snprintf(text, sizeof(text), "%s%s", hdr2, bad_pg[i]);
		CHECK_CONTEXT("bad pre-gating line %zu", i);
		CHECK_EQ_I(read_text(path, text, err, sizeof(err)), -EINVAL);
		CHECK(strstr(err, ":3: malformed pre-gating line") != NULL);
	}
	CHECK_CONTEXT_CLEAR();
	CHECK_EQ_I(read_text(path, "# moed routing trace 3\n# n_layer 2 n_expert 4 n_used 2\n",
			     err, sizeof(err)), -EINVAL);
	CHECK_EQ_I(read_text(path, "1 0 7 0 3 1 0.6 0.4\n", err, sizeof(err)), -EINVAL);
	CHECK_EQ_I(read_text(path, "", err, sizeof(err)), -EINVAL);
	CHECK_EQ_I(read_text(path, "# moed routing trace 1\n# n_layer 2 n_expert 4 n_used 5\n", err,
			     sizeof(err)), -EINVAL);
	struct md_route_log log;
	CHECK_EQ_I(md_route_log_read(&log, "/nonexistent/trace", err, sizeof(err)), -ENOENT);
}

int main(int argc, char **argv)
{
	if (argc < 2) {
		fprintf(stderr, "usage: test_route_trace MODEL.gguf\n");
		return 2;
	}
	char trace[] = "/tmp/moed-trace-XXXXXX";
	int fd = mkstemp(trace);
	REQUIRE(CHECK(fd >= 0));
	close(fd);
	test_engine_trace(argv[1], trace);
	test_reader_errors(trace);
	test_expert_batching_same_output(argv[1]);
	unlink(trace);
	if (failures)
		fprintf(stderr, "route-trace: %d checks failed\n", failures);
	else
		printf("route-trace: ok\n");
	return failures ? 1 : 0;
}
