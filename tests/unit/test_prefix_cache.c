/* The prefix cache end to end on a real model: greedy outputs are the same with the cache on
 * and off (shared system prompts, exact repeats, a later turn that extends an earlier prompt
 * with its answer, prompts submitted together, and a KV pool so small that cached blocks are
 * evicted and sequences preempted), and the DONE events report what was reused.
 *
 * Usage: test_prefix_cache MODEL.gguf */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/engine.h"
#include "tests/check.h"

#define N_PROMPTS 12
#define MAX_PROMPT 160
#define GEN 32

struct out {
	int32_t toks[GEN];
	uint32_t n, n_cached;
	bool done;
};

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static uint32_t lcg(uint32_t *s)
{
	*s = *s * 1664525u + 1013904223u;
	return *s >> 8;
}

static void submit(struct md_engine *e, uint64_t id, const int32_t *p, uint32_t n)
{
	struct md_engine_req *r = calloc(1, sizeof(*r));
	r->id = id;
	r->n_prompt = n;
	r->prompt = malloc(n * sizeof(int32_t));
	memcpy(r->prompt, p, n * sizeof(int32_t));
	r->max_tokens = GEN;
	r->ignore_eos = true;
	md_sampling_default(&r->sampling);
	r->sampling.temperature = 0;
	REQUIRE(CHECK_EQ_I(md_engine_submit(e, r), 0));
}

/* Poll until every request in [lo, hi) is done. */
static void collect(struct md_engine *e, struct out *o, uint64_t lo, uint64_t hi)
{
	double end = now_s() + 120;
	for (;;) {
		bool all = true;
		for (uint64_t i = lo; i < hi; i++)
			all &= o[i].done;
		if (all || now_s() > end)
			break;
		struct md_engine_event *l = md_engine_poll(e);
		for (struct md_engine_event *ev = l; ev; ev = ev->next) {
			struct out *x = &o[ev->req_id];
			if (ev->kind == MD_EV_TOKEN && x->n < GEN)
				x->toks[x->n++] = ev->token;
			if (ev->kind == MD_EV_DONE) {
				x->done = true;
				x->n_cached = ev->n_cached;
			}
		}
		md_engine_events_free(l);
		usleep(1000);
	}
	for (uint64_t i = lo; i < hi; i++)
		CHECK_MSG(o[i].done, "request %llu did not finish", (unsigned long long)i);
}

static struct md_engine *start(const char *model, bool cache, uint32_t kv_blocks)
{
	struct md_engine_config cfg = {
		.model_path = model, .n_threads = 2, .n_ctx = 256, .kv_mem_mb = 16,
		.kv_blocks = kv_blocks, .max_seqs = 4, .step_tokens = 64, .max_queue = 64,
		.no_prefix_cache = !cache,
	};
	struct md_engine *e;
	if (md_engine_new(&e, &cfg, NULL, NULL) || md_engine_start(e))
		return NULL;
	double end = now_s() + 60;
	while (md_engine_state(e) == MD_ENGINE_LOADING && now_s() < end)
		usleep(10000);
	if (md_engine_state(e) != MD_ENGINE_READY) {
		md_engine_free(e);
		return NULL;
	}
	md_engine_events_free(md_engine_poll(e));
	return e;
}

/* The workload: prompts 0-3 one after another (a shared 70-token system part, then the same
 * again exactly, then a later turn: prompt 0 + its answer + more), 4-11 all at once (the
 * shared part with different tails, and two repeats of 4). */
static void run(const char *model, bool cache, uint32_t kv_blocks, struct out *o,
		struct md_engine_stats *st)
{
	memset(o, 0, sizeof(*o) * N_PROMPTS);
	struct md_engine *e = start(model, cache, kv_blocks);
	REQUIRE(CHECK(e != NULL));
	int32_t sys[70], p[MAX_PROMPT];
	uint32_t seed = 12345;
	for (int i = 0; i < 70; i++)
		sys[i] = (int32_t)(10 + lcg(&seed) % 500);

	memcpy(p, sys, sizeof(sys));
	for (int i = 0; i < 9; i++)
		p[70 + i] = 600 + i;
	submit(e, 0, p, 79);
	collect(e, o, 0, 1);
	submit(e, 1, p, 79); /* exact repeat */
	collect(e, o, 1, 2);
	p[70] = 900; /* same system part, another question */
	submit(e, 2, p, 75);
	collect(e, o, 2, 3);
	p[70] = 600; /* a later turn: prompt 0, its answer, a new question */
	memcpy(p + 79, o[0].toks, GEN * sizeof(int32_t));
	for (int i = 0; i < 20; i++)
		p[79 + GEN + i] = 700 + i;
	submit(e, 3, p, 79 + GEN + 20);
	collect(e, o, 3, 4);

	for (uint64_t id = 4; id < N_PROMPTS; id++) {
		uint32_t n = 70 + (uint32_t)id * 3;
		for (uint32_t i = 70; i < n; i++)
			p[i] = (int32_t)(id == 10 || id == 11 ? 4 * 50 + i : id * 50 + i);
		submit(e, id, p, n);
	}
	collect(e, o, 4, N_PROMPTS);
	md_engine_get_stats(e, st);
	md_engine_free(e);
}

int main(int argc, char **argv)
{
	if (argc < 2) {
		fprintf(stderr, "usage: test_prefix_cache MODEL.gguf\n");
		return 2;
	}
	static struct out off[N_PROMPTS], on[N_PROMPTS], small[N_PROMPTS];
	struct md_engine_stats st_off, st_on, st_small;
	run(argv[1], false, 0, off, &st_off);
	run(argv[1], true, 0, on, &st_on);
	/* 17 blocks (the least for a 256-token context): 4 sequences of up to 103 + 32 tokens
	 * sharing 4 blocks need ~24: preemption, and cached blocks evicted */
	run(argv[1], true, 17, small, &st_small);
	printf("prefill tokens computed: off %llu, on %llu (%llu reused), small pool %llu "
	       "(%llu reused, %llu cached blocks evicted, %llu preemptions)\n",
	       (unsigned long long)st_off.prompt_tokens, (unsigned long long)st_on.prompt_tokens,
	       (unsigned long long)st_on.prefix_hit_tokens, (unsigned long long)st_small.prompt_tokens,
	       (unsigned long long)st_small.prefix_hit_tokens, (unsigned long long)st_small.prefix_evictions,
	       (unsigned long long)st_small.preemptions);
	CHECK(st_small.prefix_evictions > 0); /* the small pool did what it is there for */
	CHECK(st_on.prompt_tokens + st_on.prefix_hit_tokens == st_off.prompt_tokens);
	CHECK_EQ_U(st_off.prefix_hit_tokens, 0);
	for (int i = 0; i < N_PROMPTS; i++) {
		CHECK_CONTEXT("prompt %d", i);
		CHECK_EQ_U(off[i].n, GEN);
		CHECK_MEM_EQ(on[i].toks, off[i].toks, sizeof(off[i].toks));
		CHECK_MEM_EQ(small[i].toks, off[i].toks, sizeof(off[i].toks));
		CHECK_EQ_U(off[i].n_cached, 0);
	}
	CHECK_CONTEXT_CLEAR();
	/* What was reused, with room to keep it: nothing the first time; the repeat all of its 79
	 * tokens but the last (whole blocks shared, the rest copied from the first run's last,
	 * partial block); the other question the 70 it shares (4 blocks and 6 rows); the later
	 * turn prompt 0 and its answer, 79 + 31 fed back. */
	CHECK_EQ_U(on[0].n_cached, 0);
	CHECK_EQ_U(on[1].n_cached, 78);
	CHECK_EQ_U(on[2].n_cached, 70);
	CHECK_EQ_U(on[3].n_cached, 110);
	for (int i = 4; i < N_PROMPTS; i++)
		CHECK_MSG(on[i].n_cached >= 64, "prompt %d reused %u", i, on[i].n_cached);
	if (failures)
		fprintf(stderr, "prefix-cache: %d checks failed\n", failures);
	else
		printf("prefix-cache: ok\n");
	return failures ? 1 : 0;
}
