/* The engine thread end to end on the default model: requests always end with DONE, even when
 * the engine thread runs out of memory, and max_tokens beyond the context does not wrap.
 *
 * Usage: test_engine MODEL.gguf. Linked with -Wl,--wrap=calloc so the test can make calloc
 * fail on the engine thread (and only there) for a while. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/engine.h"
#include "tests/check.h"

void *__real_calloc(size_t n, size_t size);
void *__wrap_calloc(size_t n, size_t size);

static pthread_t main_thread;
static atomic_bool fail_calloc;

/* calloc that fails off the main thread while fail_calloc is set. */
void *__wrap_calloc(size_t n, size_t size)
{
	if (atomic_load(&fail_calloc) && !pthread_equal(pthread_self(), main_thread))
		return NULL;
	return __real_calloc(n, size);
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static struct md_engine_req *mkreq(uint64_t id, uint32_t max_tokens)
{
	struct md_engine_req *r = calloc(1, sizeof(*r));
	static const int32_t prompt[] = { 1, 2, 3, 4, 5 };
	r->id = id;
	r->n_prompt = 5;
	r->prompt = malloc(sizeof(prompt));
	memcpy(r->prompt, prompt, sizeof(prompt));
	r->max_tokens = max_tokens;
	r->ignore_eos = true;
	md_sampling_default(&r->sampling);
	r->sampling.temperature = 0;
	return r;
}

/* Poll until the DONE event of id arrives (copied to *done) or timeout; counts tokens. */
static bool wait_done(struct md_engine *e, uint64_t id, double timeout, struct md_engine_event *done,
		      uint32_t *n_tokens)
{
	double end = now_s() + timeout;
	*n_tokens = 0;
	while (now_s() < end) {
		struct md_engine_event *l = md_engine_poll(e);
		bool found = false;
		for (struct md_engine_event *ev = l; ev; ev = ev->next) {
			if (ev->req_id != id)
				continue;
			if (ev->kind == MD_EV_TOKEN)
				(*n_tokens)++;
			if (ev->kind == MD_EV_DONE) {
				*done = *ev;
				found = true;
			}
		}
		md_engine_events_free(l);
		if (found)
			return true;
		usleep(2000);
	}
	return false;
}

int main(int argc, char **argv)
{
	if (argc < 2) {
		fprintf(stderr, "usage: test_engine MODEL.gguf\n");
		return 2;
	}
	main_thread = pthread_self();
	struct md_engine_config cfg = {
		.model_path = argv[1], .n_threads = 2, .n_ctx = 64, .kv_mem_mb = 16, .max_seqs = 4,
		.step_tokens = 64, .max_queue = 16,
	};
	struct md_engine *e;
	CHECK_EQ_I(md_engine_new(&e, &cfg, NULL, NULL), 0);
	CHECK_EQ_I(md_engine_start(e), 0);
	double end = now_s() + 60;
	while (md_engine_state(e) == MD_ENGINE_LOADING && now_s() < end)
		usleep(10000);
	CHECK_EQ_I(md_engine_state(e), MD_ENGINE_READY);
	md_engine_events_free(md_engine_poll(e));

	/* 1. Out of memory on the engine thread: the request still ends. */
	struct md_engine_event done;
	uint32_t n_tok;
	struct md_engine_req *r = mkreq(1, 8);
	atomic_store(&fail_calloc, true);
	CHECK_EQ_I(md_engine_submit(e, r), 0);
	bool got = wait_done(e, 1, 10, &done, &n_tok);
	atomic_store(&fail_calloc, false);
	CHECK(got);
	if (got)
		CHECK(done.finish == MD_FINISH_ERROR || done.finish == MD_FINISH_LENGTH);

	/* 2. max_tokens = UINT32_MAX: generation runs to the context limit. */
	r = mkreq(2, UINT32_MAX);
	CHECK_EQ_I(md_engine_submit(e, r), 0);
	got = wait_done(e, 2, 60, &done, &n_tok);
	CHECK(got);
	if (got) {
		CHECK_EQ_I(done.finish, MD_FINISH_LENGTH);
		CHECK_EQ_U(done.n_gen, 64 - 5);
		CHECK_EQ_U(n_tok, 64 - 5);
	}

	/* 3. A normal request after all that. */
	r = mkreq(3, 4);
	CHECK_EQ_I(md_engine_submit(e, r), 0);
	got = wait_done(e, 3, 30, &done, &n_tok);
	CHECK(got);
	if (got) {
		CHECK_EQ_I(done.finish, MD_FINISH_LENGTH);
		CHECK_EQ_U(n_tok, 4);
	}
	/* 4. Constrained decoding: every output matches the grammar and ends where the grammar
	 * does (STOP, even with ignore_eos); temperature 1 with seeds, so the mask decides. */
	static const char gtext[] = "root ::= \"{\\\"n\\\": \" [1-9] [0-9]{0,2} \", \\\"w\\\": \\\"\" "
				    "[a-z ]{1,8} \"\\\"}\"";
	char gerr[200];
	struct md_grammar *g;
	REQUIRE(CHECK_EQ_I(md_grammar_parse(gtext, strlen(gtext), &g, gerr, sizeof(gerr)), 0));
	for (uint64_t k = 0; k < 6; k++) {
		uint64_t id = 40 + k;
		r = mkreq(id, 40);
		r->sampling.temperature = 1;
		r->sampling.seed = k;
		r->sampling.has_seed = true;
		r->grammar = md_grammar_ref(g);
		CHECK_EQ_I(md_engine_submit(e, r), 0);
		char text[512];
		size_t tl = 0;
		struct md_engine_detok *dt = md_engine_detok_new(e, true);
		bool fin = false;
		double until = now_s() + 30;
		while (!fin && now_s() < until) {
			struct md_engine_event *l = md_engine_poll(e);
			for (struct md_engine_event *ev = l; ev; ev = ev->next) {
				if (ev->req_id != id)
					continue;
				if (ev->kind == MD_EV_TOKEN && tl + 256 < sizeof(text))
					tl += (size_t)md_engine_detok_push(dt, ev->token, text + tl, 256);
				if (ev->kind == MD_EV_DONE) {
					fin = true;
					CHECK_EQ_I(ev->finish, MD_FINISH_STOP);
				}
			}
			md_engine_events_free(l);
			usleep(2000);
		}
		md_engine_detok_free(dt);
		text[tl] = 0;
		CHECK(fin);
		struct md_gmatch *m;
		REQUIRE(CHECK_EQ_I(md_gmatch_new(&m, g, md_engine_gvocab(e)), 0));
		CHECK_MSG(md_gmatch_accept_bytes(m, text, tl) == 0 && md_gmatch_is_final(m),
			  "output does not match the grammar: %s", text);
		md_gmatch_free(m);
	}
	md_grammar_unref(g);
	md_engine_free(e);
	if (failures)
		fprintf(stderr, "%d checks failed\n", failures);
	return failures ? 1 : 0;
}
