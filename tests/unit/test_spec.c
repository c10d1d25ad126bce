/* Speculative decoding through the engine thread: outputs with speculation are the outputs
 * without it (greedy, and seeded sampling with point-mass drafts), rejected drafts leave the
 * KV cache as if never computed, cancellation in the middle of speculation frees everything;
 * and the n-gram drafter and the decision rule on their own.
 *
 * Usage: test_spec CASE MOED_GGUF DEFAULT_MODEL [DRAFT_MODEL]
 * Cases: ngram, greedy-default, greedy-gen, seeded-gen, cancel, chisq-ngram, chisq-draft,
 * greedy-draft, draft-refused, and for self-speculation greedy-self, greedy-self-gen,
 * self-refused, chisq-self, self-store. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/engine.h"
#include "engine/spec.h"
#include "tests/check.h"
#include "engine/experts.h"
#include "engine/model.h"
#include "tests/unit/gen_model.h"

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* ---- engine helpers ---- */

struct run {
	uint64_t id;
	int32_t out[512];
	uint32_t n_out;
	bool done;
	struct md_engine_event fin;
};

/* Self-speculation's settings for the engines start() makes next. */
static const char *self_skip;
static uint32_t self_experts;
static double cache_mb; /* expert store budget (0: the mapping) */

static struct md_engine *start(const char *model, const char *draft, enum md_spec_drafter spec,
			       uint32_t k, uint32_t max_seqs, uint32_t n_ctx)
{
	struct md_engine_config cfg = {
		.model_path = model, .n_threads = 2, .n_ctx = n_ctx, .kv_mem_mb = 64,
		.max_seqs = max_seqs, .step_tokens = 256, .max_queue = 256, .spec = spec,
		.spec_k = k, .spec_fixed = true, .draft_model_path = draft,
		.spec_self_experts = self_experts, .spec_self_skip = self_skip,
		.expert_cache_mb = cache_mb,
	};
	struct md_engine *e;
	REQUIRE(CHECK_EQ_I(md_engine_new(&e, &cfg, NULL, NULL), 0));
	REQUIRE(CHECK_EQ_I(md_engine_start(e), 0));
	double end = now_s() + 120;
	while (md_engine_state(e) == MD_ENGINE_LOADING && now_s() < end)
		usleep(5000);
	md_engine_events_free(md_engine_poll(e));
	return e;
}

static struct md_engine_req *mkreq(uint64_t id, const int32_t *prompt, uint32_t n,
				   uint32_t max_tokens, float temp, uint64_t seed,
				   enum md_spec_drafter d)
{
	struct md_engine_req *r = calloc(1, sizeof(*r));
	r->id = id;
	r->n_prompt = n;
	r->prompt = malloc(sizeof(int32_t) * n);
	memcpy(r->prompt, prompt, sizeof(int32_t) * n);
	r->max_tokens = max_tokens;
	md_sampling_default(&r->sampling);
	r->sampling.temperature = temp;
	r->sampling.seed = seed;
	r->sampling.has_seed = true;
	r->spec.drafter = d;
	return r;
}

/* Collect events until every run is done (or timeout). */
static bool collect(struct md_engine *e, struct run *runs, size_t n, double timeout)
{
	double end = now_s() + timeout;
	size_t left = 0;
	for (size_t i = 0; i < n; i++)
		left += !runs[i].done;
	while (left && now_s() < end) {
		struct md_engine_event *l = md_engine_poll(e);
		for (struct md_engine_event *ev = l; ev; ev = ev->next)
			for (size_t i = 0; i < n; i++) {
				struct run *r = &runs[i];
				if (r->id != ev->req_id || r->done)
					continue;
				if (ev->kind == MD_EV_TOKEN && r->n_out < 512)
					r->out[r->n_out++] = ev->token;
				if (ev->kind == MD_EV_DONE) {
					r->fin = *ev;
					r->fin.next = NULL;
					r->done = true;
					left--;
				}
			}
		md_engine_events_free(l);
		if (left)
			usleep(1000);
	}
	return left == 0;
}

/* Prompts that make the default model quote or continue memorised text, in both the chat
 * format it was trained on and plain text, and some it has never seen. */
static int default_prompts(struct md_engine *e, int32_t **ids, uint32_t *lens, int max)
{
	static const char *const books[] = { "Genesis", "Exodus", "Psalms", "Proverbs", "John",
					     "Matthew", "Romans", "Isaiah", "Luke", "Acts" };
	static const char *const text[] = {
		"In the beginning God created", "And God said, Let there be",
		"The LORD is my shepherd;", "For God so loved the world,",
		"Blessed are the poor in spirit:", "And it came to pass, when",
		"Hello, how are you today?", "The quick brown fox jumps over the lazy dog.",
		"1 In the beginning was the Word, and the Word was with God, and the Word was God. "
		"2 The same was in the beginning with God. 1 In the beginning was the Word,",
		"and the earth was without form, and void; and darkness was upon the face of the deep.",
	};
	int n = 0;
	for (int b = 0; b < 10 && n < max; b++)
		for (int c = 1; c <= 4 && n < max; c++) {
			char msg[128];
			snprintf(msg, sizeof(msg), "Quote %s %d:%d-%d.", books[b], c, c + 1, c + 3);
			struct md_engine_msg m = { .role = "user", .content = msg };
			int k = md_engine_chat_tokenize(e, &m, 1, &ids[n]);
			REQUIRE(CHECK(k > 0));
			lens[n++] = (uint32_t)k;
		}
	for (int t = 0; t < 10 && n < max; t++) {
		int k = md_engine_tokenize(e, text[t], strlen(text[t]), true, false, &ids[n]);
		REQUIRE(CHECK(k > 0));
		lens[n++] = (uint32_t)k;
	}
	/* Long prompts (beyond the draft model's catch-up window): texts one after another. */
	for (int t = 0; t < 2 && n < max; t++) {
		char buf[2048] = "";
		for (int i = 0; i < 10; i++)
			strncat(buf, text[(i + t) % 10], sizeof(buf) - strlen(buf) - 2);
		int k = md_engine_tokenize(e, buf, strlen(buf), true, false, &ids[n]);
		REQUIRE(CHECK(k > 96));
		lens[n++] = (uint32_t)k;
	}
	return n;
}

/* Random prompts for a generated model, some repeating themselves (drafts to accept). */
static int random_prompts(int32_t **ids, uint32_t *lens, int max, uint32_t n_vocab)
{
	uint64_t x = 12345;
	for (int i = 0; i < max; i++) {
		uint32_t n = 4 + (uint32_t)(md_sampler_mix(x++) % 20);
		ids[i] = malloc(sizeof(int32_t) * n * 2);
		for (uint32_t j = 0; j < n; j++)
			ids[i][j] = (int32_t)(md_sampler_mix(x++) % n_vocab);
		if (i % 2) { /* the prompt twice */
			memcpy(ids[i] + n, ids[i], sizeof(int32_t) * n);
			n *= 2;
		}
		lens[i] = n;
	}
	return max;
}

/* Run every prompt with drafter d, max_seqs at a time in flight (mixed batches). */
static void run_all(struct md_engine *e, int32_t **ids, const uint32_t *lens, int n,
		    uint32_t max_tokens, float temp, enum md_spec_drafter d, struct run *runs,
		    uint64_t id0)
{
	for (int i = 0; i < n; i++) {
		memset(&runs[i], 0, sizeof(runs[i]));
		runs[i].id = id0 + (uint64_t)i;
		REQUIRE(CHECK_EQ_I(md_engine_submit(e, mkreq(runs[i].id, ids[i], lens[i], max_tokens,
							    temp, 1000 + (uint64_t)i, d)), 0));
	}
	REQUIRE(CHECK(collect(e, runs, (size_t)n, 600)));
}

/* Outputs of drafter d equal outputs without speculation, prompt by prompt. Returns the
 * drafted and accepted totals. */
static void compare(struct md_engine *e, int32_t **ids, const uint32_t *lens, int n,
		    uint32_t max_tokens, float temp, enum md_spec_drafter d, uint64_t *drafted,
		    uint64_t *accepted)
{
	static struct run plain[64], spec[64];
	REQUIRE(CHECK(n <= 64));
	run_all(e, ids, lens, n, max_tokens, temp, MD_SPEC_OFF, plain, 1000);
	run_all(e, ids, lens, n, max_tokens, temp, d, spec, 2000);
	int same = 0;
	*drafted = *accepted = 0;
	for (int i = 0; i < n; i++) {
		CHECK_CONTEXT("prompt %d", i);
		CHECK_EQ_U(plain[i].fin.n_drafted, 0);
		CHECK_EQ_I(spec[i].fin.finish, plain[i].fin.finish);
		CHECK_EQ_U(spec[i].n_out, plain[i].n_out);
		CHECK_EQ_U(spec[i].fin.n_gen, plain[i].fin.n_gen);
		if (spec[i].n_out == plain[i].n_out &&
		    memcmp(spec[i].out, plain[i].out, sizeof(int32_t) * plain[i].n_out) == 0)
			same++;
		else
			CHECK_MEM_EQ(spec[i].out, plain[i].out, sizeof(int32_t) * plain[i].n_out);
		*drafted += spec[i].fin.n_drafted;
		*accepted += spec[i].fin.n_accepted;
	}
	CHECK_CONTEXT_CLEAR();
	struct md_engine_stats st;
	md_engine_get_stats(e, &st);
	printf("%d/%d prompts identical; drafted %llu, accepted %llu; KV blocks in use %u\n", same,
	       n, (unsigned long long)*drafted, (unsigned long long)*accepted, st.kv_blocks_used);
	CHECK_EQ_I(same, n);
	CHECK_EQ_U(st.kv_blocks_used, 0);
	/* Speculation happened, and so did rejections (each rollback then mattered). */
	CHECK(*accepted > 0);
	CHECK(*drafted > *accepted);
}

static void free_prompts(int32_t **ids, int n)
{
	for (int i = 0; i < n; i++)
		free(ids[i]);
}

/* ---- cases ---- */

static void case_ngram(void)
{
	int32_t t[] = { 1, 2, 3, 4, 9, 9, 1, 2, 3 }, out[8];
	uint32_t cls = 99;
	/* "1 2 3" occurred before, followed by 4 9 9 1 ...: a phrase of 3 tokens seen once */
	CHECK_EQ_U(md_spec_ngram(t, 9, 2, 4, 3, out, &cls), 3);
	CHECK_EQ_U(cls, MD_SPEC_CLS_TRIGRAM);
	/* Matched on 4 tokens: a phrase */
	int32_t t4[] = { 8, 1, 2, 3, 4, 9, 8, 1, 2, 3 };
	CHECK_EQ_U(md_spec_ngram(t4, 10, 2, 4, 2, out, &cls), 2);
	CHECK_EQ_U(cls, MD_SPEC_CLS_SHORT);
	CHECK_EQ_I(out[0], 4);
	CHECK_EQ_I(out[0], 4);
	CHECK_EQ_I(out[1], 9);
	CHECK_EQ_I(out[2], 9);
	/* The most recent occurrence wins; past the end of the text the proposal repeats the
	 * last 3 tokens (the occurrence's distance), as a loop would. */
	int32_t u[] = { 5, 6, 7, 5, 6, 8, 5, 6 };
	CHECK_EQ_U(md_spec_ngram(u, 8, 2, 4, 5, out, &cls), 5);
	CHECK_EQ_U(cls, MD_SPEC_CLS_BIGRAM); /* "5 6" agrees, "7" against "8" does not */
	CHECK_EQ_I(out[0], 8);
	CHECK_EQ_I(out[1], 5);
	CHECK_EQ_I(out[2], 6);
	CHECK_EQ_I(out[3], 8);
	CHECK_EQ_I(out[4], 5);
	/* No match of length >= 2. */
	int32_t v[] = { 1, 2, 3, 4, 5 };
	CHECK_EQ_U(md_spec_ngram(v, 5, 2, 4, 4, out, NULL), 0);
	/* A run of one token proposes more of it, as many as asked. */
	int32_t w[] = { 7, 7, 7, 7 };
	CHECK_EQ_U(md_spec_ngram(w, 4, 2, 4, 4, out, &cls), 4);
	for (int i = 0; i < 4; i++)
		CHECK_EQ_I(out[i], 7);
	CHECK_EQ_U(cls, MD_SPEC_CLS_REPEAT); /* period 1, already repeated */
	/* A period-5 loop: once its text repeated whole, REPEAT; once the agreement reaches
	 * MD_SPEC_LONG_MATCH tokens, LONG. */
	int32_t lp[48];
	for (int i = 0; i < 48; i++)
		lp[i] = 100 + (i * 3) % 5 + (i < 3 ? 10 : 0);
	CHECK_EQ_U(md_spec_ngram(lp, 13, 2, 4, 4, out, &cls), 4);
	CHECK_EQ_U(cls, MD_SPEC_CLS_REPEAT);
	CHECK_EQ_I(out[0], lp[13]);
	CHECK_EQ_U(md_spec_ngram(lp, 48, 2, 4, 4, out, &cls), 4);
	CHECK_EQ_U(cls, MD_SPEC_CLS_LONG);
	CHECK_EQ_U(md_spec_ngram(lp, 10, 2, 4, 4, out, &cls), 4);
	CHECK_EQ_U(cls, MD_SPEC_CLS_BIGRAM); /* "104 102" seen, the period not yet repeated */
	CHECK_EQ_I(md_spec_drafter_parse("ngram"), MD_SPEC_NGRAM);
	CHECK_EQ_I(md_spec_drafter_parse("draft"), MD_SPEC_DRAFT);
	CHECK_EQ_I(md_spec_drafter_parse("off"), MD_SPEC_OFF);
	CHECK_EQ_I(md_spec_drafter_parse("self"), MD_SPEC_SELF);
	CHECK_EQ_I(md_spec_drafter_parse("eagle"), -EINVAL);
}

static void case_greedy_default(const char *model)
{
	struct md_engine *e = start(model, NULL, MD_SPEC_OFF, 8, 4, 256);
	REQUIRE(CHECK_EQ_I(md_engine_state(e), MD_ENGINE_READY));
	int32_t *ids[64];
	uint32_t lens[64];
	int n = default_prompts(e, ids, lens, 52);
	CHECK(n >= 52);
	uint64_t dr, ac;
	compare(e, ids, lens, n, 64, 0, MD_SPEC_NGRAM, &dr, &ac);
	free_prompts(ids, n);
	md_engine_free(e);
}

static bool gen_tiny(const char *moed_gguf, const char *seed, const char *vocab, char *dir,
		     size_t dl, char *path, size_t pl)
{
	const char *args[] = { "--arch", "qwen3moe", "--seed", seed, "--n-layer", "2",
			       "--n-expert", "8", "--n-expert-used", "2", "--n-vocab", vocab,
			       "--std", "0.3", NULL };
	return gen_model(moed_gguf, args, "spec.gguf", dir, dl, path, pl) == 0;
}

static void case_greedy_gen(const char *moed_gguf)
{
	char dir[512], path[600];
	REQUIRE(CHECK(gen_tiny(moed_gguf, "11", "512", dir, sizeof dir, path, sizeof path)));
	struct md_engine *e = start(path, NULL, MD_SPEC_OFF, 6, 4, 512);
	REQUIRE(CHECK_EQ_I(md_engine_state(e), MD_ENGINE_READY));
	int32_t *ids[64];
	uint32_t lens[64];
	int n = random_prompts(ids, lens, 60, md_engine_n_vocab(e));
	uint64_t dr, ac;
	compare(e, ids, lens, n, 96, 0, MD_SPEC_NGRAM, &dr, &ac);
	free_prompts(ids, n);
	md_engine_free(e);
	gen_model_cleanup(dir, path);
}

/* Seeded sampling with point-mass drafts draws exactly the plain decode's tokens. */
static void case_seeded_gen(const char *moed_gguf)
{
	char dir[512], path[600];
	REQUIRE(CHECK(gen_tiny(moed_gguf, "12", "512", dir, sizeof dir, path, sizeof path)));
	struct md_engine *e = start(path, NULL, MD_SPEC_OFF, 6, 4, 512);
	REQUIRE(CHECK_EQ_I(md_engine_state(e), MD_ENGINE_READY));
	int32_t *ids[64];
	uint32_t lens[64];
	int n = random_prompts(ids, lens, 50, md_engine_n_vocab(e));
	uint64_t dr, ac;
	compare(e, ids, lens, n, 96, 0.7f, MD_SPEC_NGRAM, &dr, &ac);
	free_prompts(ids, n);
	md_engine_free(e);
	gen_model_cleanup(dir, path);
}

/* Cancel requests in the middle of speculative steps: they end CANCELLED, their KV returns,
 * and the engine then gives the same output as before. */
static void case_cancel(const char *model)
{
	struct md_engine *e = start(model, NULL, MD_SPEC_NGRAM, 8, 4, 256);
	REQUIRE(CHECK_EQ_I(md_engine_state(e), MD_ENGINE_READY));
	int32_t *ids[64];
	uint32_t lens[64];
	int n = default_prompts(e, ids, lens, 4);
	struct run ref;
	memset(&ref, 0, sizeof(ref));
	ref.id = 1;
	REQUIRE(CHECK_EQ_I(md_engine_submit(e, mkreq(1, ids[0], lens[0], 120, 0, 1,
						     MD_SPEC_DEFAULT)), 0));
	REQUIRE(CHECK(collect(e, &ref, 1, 120)));
	CHECK(ref.fin.n_drafted > 0);
	for (int round = 0; round < 6; round++) {
		struct run rs[4];
		memset(rs, 0, sizeof(rs));
		for (int i = 0; i < 4; i++) {
			rs[i].id = 100 + (uint64_t)round * 10 + (uint64_t)i;
			REQUIRE(CHECK_EQ_I(md_engine_submit(e, mkreq(rs[i].id, ids[i], lens[i], 200, 0,
								    1, MD_SPEC_DEFAULT)), 0));
		}
		/* Wait for a few tokens, then cancel at a different point each round. */
		double end = now_s() + 30;
		uint32_t seen = 0;
		while (seen < (uint32_t)(2 + round * 3) && now_s() < end) {
			struct md_engine_event *l = md_engine_poll(e);
			for (struct md_engine_event *ev = l; ev; ev = ev->next)
				seen += ev->kind == MD_EV_TOKEN;
			md_engine_events_free(l);
			usleep(200);
		}
		for (int i = 0; i < 4; i++)
			md_engine_cancel(e, rs[i].id);
		CHECK(collect(e, rs, 4, 30));
		for (int i = 0; i < 4; i++)
			CHECK(rs[i].fin.finish == MD_FINISH_CANCELLED ||
			      rs[i].fin.finish == MD_FINISH_STOP || rs[i].fin.finish == MD_FINISH_LENGTH);
		struct md_engine_stats st;
		md_engine_get_stats(e, &st);
		CHECK_EQ_U(st.kv_blocks_used, 0);
		CHECK_EQ_U(st.running, 0);
	}
	struct run again;
	memset(&again, 0, sizeof(again));
	again.id = 999;
	REQUIRE(CHECK_EQ_I(md_engine_submit(e, mkreq(999, ids[0], lens[0], 120, 0, 1,
						     MD_SPEC_DEFAULT)), 0));
	REQUIRE(CHECK(collect(e, &again, 1, 120)));
	CHECK_EQ_U(again.n_out, ref.n_out);
	CHECK_MEM_EQ(again.out, ref.out, sizeof(int32_t) * ref.n_out);
	free_prompts(ids, n);
	md_engine_free(e);
}

/* The default model with its draft: greedy outputs equal plain decoding's. */
static void case_greedy_draft(const char *model, const char *draft)
{
	struct md_engine *e = start(model, draft, MD_SPEC_OFF, 6, 4, 256);
	REQUIRE(CHECK_EQ_I(md_engine_state(e), MD_ENGINE_READY));
	CHECK(md_engine_has_draft(e));
	int32_t *ids[64];
	uint32_t lens[64];
	int n = default_prompts(e, ids, lens, 52);
	uint64_t dr, ac;
	compare(e, ids, lens, n, 64, 0, MD_SPEC_DRAFT, &dr, &ac);
	free_prompts(ids, n);
	md_engine_free(e);
}

/* Self-speculation on the default model: drafts from the model with one expert per token
 * (then also with its last layer skipped), written into the target's own KV cache and
 * overwritten by the verification; greedy outputs equal plain decoding's over 52 prompts
 * each, and every KV block comes back. */
static void case_greedy_self(const char *model)
{
	for (int v = 0; v < 2; v++) {
		self_skip = v ? "3" : NULL;
		struct md_engine *e = start(model, NULL, MD_SPEC_OFF, 6, 4, 256);
		REQUIRE(CHECK_EQ_I(md_engine_state(e), MD_ENGINE_READY));
		CHECK(md_engine_has_self(e));
		int32_t *ids[64];
		uint32_t lens[64];
		int n = default_prompts(e, ids, lens, 52);
		CHECK(n >= 52);
		uint64_t dr, ac;
		printf("self-speculation, 1 expert per token%s: ", v ? ", layer 3 skipped" : "");
		compare(e, ids, lens, n, 64, 0, MD_SPEC_SELF, &dr, &ac);
		free_prompts(ids, n);
		md_engine_free(e);
	}
	self_skip = NULL;
}

/* The same on a generated model (8 experts, top-2, two layers): 60 random prompts. */
static void case_greedy_self_gen(const char *moed_gguf)
{
	char dir[512], path[600];
	REQUIRE(CHECK(gen_tiny(moed_gguf, "13", "512", dir, sizeof dir, path, sizeof path)));
	struct md_engine *e = start(path, NULL, MD_SPEC_OFF, 6, 4, 512);
	REQUIRE(CHECK_EQ_I(md_engine_state(e), MD_ENGINE_READY));
	int32_t *ids[64];
	uint32_t lens[64];
	int n = random_prompts(ids, lens, 60, md_engine_n_vocab(e));
	uint64_t dr, ac;
	compare(e, ids, lens, n, 96, 0, MD_SPEC_SELF, &dr, &ac);
	free_prompts(ids, n);
	md_engine_free(e);
	gen_model_cleanup(dir, path);
}

/*
 * Self-speculation under the expert store (a budget of 10 of the generated model's 16
 * experts): draft passes route only among resident experts, and their prediction of what
 * the verification step routes to is prefetched. Greedy outputs equal plain decoding's (50
 * prompts), predictions were made and used, and the step's own routing shows how many of its
 * experts the drafts foresaw.
 */
static void case_self_store(const char *moed_gguf)
{
	char dir[512], path[600];
	const char *args[] = { "--arch", "qwen3moe", "--seed", "14", "--n-layer", "2",
			       "--n-expert", "8", "--n-expert-used", "2", "--n-vocab", "512",
			       "--n-embd", "256", "--n-ff-exp", "512", "--std", "0.3", NULL };
	REQUIRE(CHECK_EQ_I(gen_model(moed_gguf, args, "spec.gguf", dir, sizeof dir, path, sizeof path), 0));
	struct md_model m;
	char err[256];
	REQUIRE(CHECK_EQ_I(md_model_load(&m, path, err, sizeof err), 0));
	cache_mb = 10.0 * (double)md_expert_store_slot_bytes(&m) / 1048576.0;
	md_model_free(&m);
	struct md_engine *e = start(path, NULL, MD_SPEC_OFF, 6, 4, 512);
	cache_mb = 0;
	REQUIRE(CHECK_EQ_I(md_engine_state(e), MD_ENGINE_READY));
	int32_t *ids[64];
	uint32_t lens[64];
	int n = random_prompts(ids, lens, 50, md_engine_n_vocab(e));
	uint64_t dr, ac;
	compare(e, ids, lens, n, 64, 0, MD_SPEC_SELF, &dr, &ac);
	struct md_engine_stats st;
	md_engine_get_stats(e, &st);
	printf("store: %u slots; self drafts predicted %llu experts, %llu of them used; the verifying "
	       "steps used %llu (recall %.2f, precision %.2f); prefetch issued %llu, used %llu\n",
	       st.experts_slots, (unsigned long long)st.spec_self_predicted,
	       (unsigned long long)st.spec_self_predicted_used, (unsigned long long)st.spec_self_used,
	       st.spec_self_used ? (double)st.spec_self_predicted_used / st.spec_self_used : 0.0,
	       st.spec_self_predicted ? (double)st.spec_self_predicted_used / st.spec_self_predicted
				      : 0.0,
	       (unsigned long long)st.experts_prefetch_issued,
	       (unsigned long long)st.experts_prefetch_used);
	CHECK(st.experts_slots > 0 && st.experts_slots < 16); /* the store, not the mapping */
	CHECK(st.spec_self_predicted > 0);
	CHECK(st.spec_self_predicted_used > 0);
	CHECK(st.spec_self_predicted_used <= st.spec_self_used);
	free_prompts(ids, n);
	md_engine_free(e);
	gen_model_cleanup(dir, path);
}

/* Self-speculation is refused where it cannot draft: a dense model with no layer skipped, a
 * skip list naming a layer the model lacks or every layer. */
static void case_self_refused(const char *model, const char *draft)
{
	struct md_engine *e = start(draft, NULL, MD_SPEC_SELF, 4, 2, 256);
	CHECK_EQ_I(md_engine_state(e), MD_ENGINE_FAILED);
	printf("refused: %s\n", md_engine_error(e));
	CHECK(strstr(md_engine_error(e), "self-speculation") != NULL);
	md_engine_free(e);
	e = start(draft, NULL, MD_SPEC_OFF, 4, 2, 256);
	CHECK_EQ_I(md_engine_state(e), MD_ENGINE_READY);
	CHECK(!md_engine_has_self(e)); /* not asked for: the engine serves without it */
	md_engine_free(e);
	const char *bad[] = { "9", "0,1,2,3", "1,x" };
	for (int i = 0; i < 3; i++) {
		self_skip = bad[i];
		e = start(model, NULL, MD_SPEC_SELF, 4, 2, 256);
		CHECK_EQ_I(md_engine_state(e), MD_ENGINE_FAILED);
		printf("refused: %s\n", md_engine_error(e));
		CHECK(strstr(md_engine_error(e), "spec-self-skip") != NULL);
		md_engine_free(e);
	}
	self_skip = NULL;
}

/* A draft that cannot serve is refused at start-up with a message saying why. */
static void case_draft_refused(const char *moed_gguf, const char *model)
{
	char dir[512], path[600];
	REQUIRE(CHECK(gen_tiny(moed_gguf, "5", "300", dir, sizeof dir, path, sizeof path)));
	struct md_engine *e = start(model, path, MD_SPEC_DRAFT, 4, 2, 256);
	CHECK_EQ_I(md_engine_state(e), MD_ENGINE_FAILED);
	printf("refused: %s\n", md_engine_error(e));
	CHECK(strstr(md_engine_error(e), "vocabulary") != NULL);
	md_engine_free(e);
	e = start(model, "/nonexistent/draft.gguf", MD_SPEC_DRAFT, 4, 2, 256);
	CHECK_EQ_I(md_engine_state(e), MD_ENGINE_FAILED);
	printf("refused: %s\n", md_engine_error(e));
	CHECK(strstr(md_engine_error(e), "cannot load draft model") != NULL);
	md_engine_free(e);
	e = start(model, NULL, MD_SPEC_DRAFT, 4, 2, 256);
	CHECK_EQ_I(md_engine_state(e), MD_ENGINE_FAILED);
	printf("refused: %s\n", md_engine_error(e));
	md_engine_free(e);
	gen_model_cleanup(dir, path);
}

/* ---- the distribution test ---- */

#define TOPK 4

/* The top-TOPK tokens after prompt and their probabilities at temperature 1 with top_k TOPK
 * (softmax of the raw logprobs over the TOPK best, as the sampler builds it), from one plain
 * greedy step with logprobs. */
static void next_dist(struct md_engine *e, const int32_t *prompt, uint32_t n, int32_t *id,
		      double *pr, uint64_t rid)
{
	struct md_engine_req *r = mkreq(rid, prompt, n, 1, 0, 1, MD_SPEC_OFF);
	r->sampling.top_logprobs = TOPK;
	r->ignore_eos = true;
	REQUIRE(CHECK_EQ_I(md_engine_submit(e, r), 0));
	double end = now_s() + 60;
	bool got = false, done = false;
	while (!done && now_s() < end) {
		struct md_engine_event *l = md_engine_poll(e);
		for (struct md_engine_event *ev = l; ev; ev = ev->next) {
			done |= ev->req_id == rid && ev->kind == MD_EV_DONE;
			if (ev->req_id == rid && ev->kind == MD_EV_TOKEN) {
				REQUIRE(CHECK_EQ_U(ev->n_top, TOPK));
				double z = 0;
				for (int i = 0; i < TOPK; i++)
					z += exp(ev->top[i].logprob);
				for (int i = 0; i < TOPK; i++) {
					id[i] = ev->top[i].id;
					pr[i] = exp(ev->top[i].logprob) / z;
				}
				got = true;
			}
		}
		md_engine_events_free(l);
		usleep(200);
	}
	REQUIRE(CHECK(got));
}

/* Exact probabilities of every (t1, t2, t3) the model can sample after prompt with top_k
 * TOPK at temperature 1: TOPK^3 cells, cell id[c] (3 tokens), prob[c]. */
static void exact_cells(struct md_engine *e, const int32_t *prompt, uint32_t n,
			int32_t (*id)[3], double *prob)
{
	int32_t ctx[64], a[TOPK], b[TOPK], c3[TOPK];
	double pa[TOPK], pb[TOPK], pc[TOPK];
	uint64_t rid = 50000;
	memcpy(ctx, prompt, sizeof(int32_t) * n);
	next_dist(e, ctx, n, a, pa, rid++);
	int cell = 0;
	for (int i = 0; i < TOPK; i++) {
		ctx[n] = a[i];
		next_dist(e, ctx, n + 1, b, pb, rid++);
		for (int j = 0; j < TOPK; j++) {
			ctx[n + 1] = b[j];
			next_dist(e, ctx, n + 2, c3, pc, rid++);
			for (int k = 0; k < TOPK; k++, cell++) {
				id[cell][0] = a[i];
				id[cell][1] = b[j];
				id[cell][2] = c3[k];
				prob[cell] = pa[i] * pb[j] * pc[k];
			}
		}
	}
}

/* Upper alpha = 0.001 point of chi-square with df degrees of freedom (Wilson-Hilferty; within
 * 1% of the exact quantile for df >= 3). */
static double chisq_crit_001(int df)
{
	double z = 3.0902, h = 2.0 / (9.0 * df);
	double t = 1 - h + z * sqrt(h);
	return df * t * t * t;
}

/* Pearson's statistic of counts against n * prob over the cells, cells with an expected count
 * below 5 pooled into one. Returns it; *df gets the degrees of freedom. */
static double pearson(const uint32_t *cnt, const double *prob, int cells, uint32_t n, int *df)
{
	double x2 = 0, pool_e = 0, pool_o = 0;
	int k = 0;
	for (int c = 0; c < cells; c++) {
		double ex = n * prob[c];
		if (ex < 5) {
			pool_e += ex;
			pool_o += cnt[c];
			continue;
		}
		x2 += (cnt[c] - ex) * (cnt[c] - ex) / ex;
		k++;
	}
	if (pool_e > 0) {
		x2 += (pool_o - pool_e) * (pool_o - pool_e) / pool_e;
		k++;
	}
	*df = k - 1;
	return x2;
}

/*
 * Sampled outputs with draft-model speculation follow the target distribution. The target is
 * a generated model with a 300-token vocabulary, the draft the same model requantized to
 * q4_0 (close but not equal, so both the acceptance test and the residual draw are exercised);
 * top_k 4 at temperature 1 gives 64 possible 3-token continuations whose exact probabilities
 * come from the target's logprobs. N seeded requests of 4 tokens with k = 2 (tokens 2 and 3 come
 * from one verification of two drafts) give counts of the first three; Pearson's chi-square must stay below the
 * alpha = 0.001 point (a correct sampler fails this 1 run in 1000; the seeds are fixed, so the
 * run is deterministic). The test's power is shown too: the draft's own distribution (what
 * accepting every draft would give) is computed exactly and must sit far above the threshold.
 */
static void case_chisq_draft(const char *moed_gguf)
{
	char dir[512], path[600], ddir[512], dpath[600];
	REQUIRE(CHECK(gen_tiny(moed_gguf, "21", "300", dir, sizeof dir, path, sizeof path)));
	/* The draft: the target requantized to 4 bits, close to it but not equal. */
	snprintf(ddir, sizeof ddir, "%s", dir);
	snprintf(dpath, sizeof dpath, "%s/draft.gguf", dir);
	char cmd[2048];
	snprintf(cmd, sizeof cmd, "'%s' quantize '%s' '%s' q4_0 > /dev/null 2>&1", moed_gguf, path,
		 dpath);
	REQUIRE(CHECK_EQ_I(system(cmd), 0));
	enum { CELLS = TOPK * TOPK * TOPK, N = 4000 };
	static int32_t id[CELLS][3];
	static double prob[CELLS], qprob[CELLS];
	const int32_t prompt[] = { 17, 99, 3, 250, 42 };
	const uint32_t np = 5;

	/* The draft's distribution over the same cells (t1 from the target, t2 and t3 from q). */
	struct md_engine *d = start(dpath, NULL, MD_SPEC_OFF, 2, 8, 64);
	REQUIRE(CHECK_EQ_I(md_engine_state(d), MD_ENGINE_READY));

	struct md_engine *e = start(path, dpath, MD_SPEC_DRAFT, 2, 8, 64);
	REQUIRE(CHECK_EQ_I(md_engine_state(e), MD_ENGINE_READY));
	exact_cells(e, prompt, np, id, prob);
	double sum = 0;
	for (int c = 0; c < CELLS; c++)
		sum += prob[c];
	CHECK_NEAR(sum, 1.0, 1e-4);
	for (int c = 0; c < CELLS; c++) {
		int32_t ctx[8], qi[TOPK];
		double qp[TOPK], q2 = 0, q3 = 0, p1 = prob[c];
		memcpy(ctx, prompt, sizeof(prompt));
		ctx[np] = id[c][0];
		next_dist(d, ctx, np + 1, qi, qp, 70000 + (uint64_t)c * 2);
		for (int i = 0; i < TOPK; i++)
			q2 += qi[i] == id[c][1] ? qp[i] : 0;
		ctx[np + 1] = id[c][1];
		next_dist(d, ctx, np + 2, qi, qp, 70001 + (uint64_t)c * 2);
		for (int i = 0; i < TOPK; i++)
			q3 += qi[i] == id[c][2] ? qp[i] : 0;
		/* p(t1) = the cell's probability summed over t2, t3 */
		p1 = 0;
		for (int x = 0; x < CELLS; x++)
			p1 += id[x][0] == id[c][0] ? prob[x] : 0;
		qprob[c] = p1 * q2 * q3;
	}
	md_engine_free(d);

	static uint32_t cnt[CELLS];
	static struct run runs[64];
	uint32_t other = 0, done = 0;
	uint64_t drafted = 0, accepted = 0;
	while (done < N) {
		int batch = N - done < 64 ? (int)(N - done) : 64;
		for (int i = 0; i < batch; i++) {
			memset(&runs[i], 0, sizeof(runs[i]));
			runs[i].id = 1 + done + (uint64_t)i;
			struct md_engine_req *r = mkreq(runs[i].id, prompt, np, 4, 1.0f,
							777 + done + (uint64_t)i, MD_SPEC_DRAFT);
			r->sampling.top_k = TOPK;
			r->ignore_eos = true;
			REQUIRE(CHECK_EQ_I(md_engine_submit(e, r), 0));
		}
		REQUIRE(CHECK(collect(e, runs, (size_t)batch, 120)));
		for (int i = 0; i < batch; i++) {
			REQUIRE(CHECK_EQ_U(runs[i].n_out, 4));
			drafted += runs[i].fin.n_drafted;
			accepted += runs[i].fin.n_accepted;
			int c = 0;
			while (c < CELLS && memcmp(id[c], runs[i].out, sizeof(id[c])) != 0)
				c++;
			if (c < CELLS)
				cnt[c]++;
			else
				other++;
		}
		done += (uint32_t)batch;
	}
	CHECK_EQ_U(other, 0);
	int df, qdf;
	double x2 = pearson(cnt, prob, CELLS, N, &df);
	double crit = chisq_crit_001(df);
	/* Power: the expected statistic if outputs followed the draft (Pearson's noncentrality
	 * plus df), over the same pooled cells. */
	double lam = 0;
	for (int c = 0; c < CELLS; c++)
		if (N * prob[c] >= 5)
			lam += N * (qprob[c] - prob[c]) * (qprob[c] - prob[c]) / prob[c];
	(void)qdf;
	printf("chi-square %.1f, df %d, alpha 0.001 threshold %.1f; %d samples, drafted %llu, "
	       "accepted %llu (%.0f%%); outputs distributed as the draft would give ~%.0f\n", x2,
	       df, crit, N, (unsigned long long)drafted, (unsigned long long)accepted,
	       drafted ? 100.0 * accepted / drafted : 0.0, lam + df);
	CHECK(x2 < crit);
	CHECK(lam + df > 3 * crit);
	CHECK(accepted > 0 && drafted > accepted);
	md_engine_free(e);
	unlink(dpath);
	gen_model_cleanup(dir, path);
}

/*
 * Sampled outputs with self-speculation follow the target distribution: as chisq-draft, on a
 * generated model with 8 experts (top-2) whose draft passes route one expert per token (so
 * drafts are sampled from a q that differs from p, and both the min(1, p/q) test and the
 * residual draw run), 4000 seeded requests of 4 tokens with k = 2, top_k 4 at temperature 1:
 * Pearson's chi-square over the 64 three-token cells below the alpha = 0.001 point.
 */
static void case_chisq_self(const char *moed_gguf)
{
	char dir[512], path[600];
	REQUIRE(CHECK(gen_tiny(moed_gguf, "22", "300", dir, sizeof dir, path, sizeof path)));
	enum { CELLS = TOPK * TOPK * TOPK, N = 4000 };
	static int32_t id[CELLS][3];
	static double prob[CELLS];
	const int32_t prompt[] = { 17, 99, 3, 250, 42 };
	const uint32_t np = 5;
	struct md_engine *e = start(path, NULL, MD_SPEC_SELF, 2, 8, 64);
	REQUIRE(CHECK_EQ_I(md_engine_state(e), MD_ENGINE_READY));
	exact_cells(e, prompt, np, id, prob);
	static uint32_t cnt[CELLS];
	static struct run runs[64];
	uint32_t other = 0, done = 0;
	uint64_t drafted = 0, accepted = 0;
	while (done < N) {
		int batch = N - done < 64 ? (int)(N - done) : 64;
		for (int i = 0; i < batch; i++) {
			memset(&runs[i], 0, sizeof(runs[i]));
			runs[i].id = 1 + done + (uint64_t)i;
			struct md_engine_req *r = mkreq(runs[i].id, prompt, np, 4, 1.0f,
							4242 + done + (uint64_t)i, MD_SPEC_SELF);
			r->sampling.top_k = TOPK;
			r->ignore_eos = true;
			REQUIRE(CHECK_EQ_I(md_engine_submit(e, r), 0));
		}
		REQUIRE(CHECK(collect(e, runs, (size_t)batch, 120)));
		for (int i = 0; i < batch; i++) {
			REQUIRE(CHECK_EQ_U(runs[i].n_out, 4));
			drafted += runs[i].fin.n_drafted;
			accepted += runs[i].fin.n_accepted;
			int c = 0;
			while (c < CELLS && memcmp(id[c], runs[i].out, sizeof(id[c])) != 0)
				c++;
			if (c < CELLS)
				cnt[c]++;
			else
				other++;
		}
		done += (uint32_t)batch;
	}
	CHECK_EQ_U(other, 0);
	int df;
	double x2 = pearson(cnt, prob, CELLS, N, &df);
	double crit = chisq_crit_001(df);
	printf("self: chi-square %.1f, df %d, alpha 0.001 threshold %.1f; %d samples, drafted %llu, "
	       "accepted %llu (%.0f%%)\n", x2, df, crit, N, (unsigned long long)drafted,
	       (unsigned long long)accepted, drafted ? 100.0 * accepted / drafted : 0.0);
	CHECK(x2 < crit);
	CHECK(accepted > 0 && drafted > accepted);
	md_engine_free(e);
	gen_model_cleanup(dir, path);
}

int main(int argc, char **argv)
{
	if (argc < 4) {
		fprintf(stderr, "usage: test_spec CASE MOED_GGUF DEFAULT_MODEL [DRAFT_MODEL]\n");
		return 2;
	}
	const char *c = argv[1];
	if (strcmp(c, "ngram") == 0)
		case_ngram();
	else if (strcmp(c, "greedy-default") == 0)
		case_greedy_default(argv[3]);
	else if (strcmp(c, "greedy-gen") == 0)
		case_greedy_gen(argv[2]);
	else if (strcmp(c, "seeded-gen") == 0)
		case_seeded_gen(argv[2]);
	else if (strcmp(c, "cancel") == 0)
		case_cancel(argv[3]);
	else if (strcmp(c, "greedy-draft") == 0 && argc > 4)
		case_greedy_draft(argv[3], argv[4]);
	else if (strcmp(c, "draft-refused") == 0)
		case_draft_refused(argv[2], argv[3]);
	else if (strcmp(c, "chisq-draft") == 0)
		case_chisq_draft(argv[2]);
	else if (strcmp(c, "greedy-self") == 0)
		case_greedy_self(argv[3]);
	else if (strcmp(c, "greedy-self-gen") == 0)
		case_greedy_self_gen(argv[2]);
	else if (strcmp(c, "self-refused") == 0 && argc > 4)
		case_self_refused(argv[3], argv[4]);
	else if (strcmp(c, "chisq-self") == 0)
		case_chisq_self(argv[2]);
	else if (strcmp(c, "self-store") == 0)
		case_self_store(argv[2]);
	else {
		fprintf(stderr, "unknown case '%s'\n", c);
		return 2;
	}
	return failures ? 1 : 0;
}
