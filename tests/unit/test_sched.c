/* The scheduler's planner driven without a model: a small KV pool, fake requests, fake
 * sampled tokens. Checks admission order, chunked prefill, preemption and recompute,
 * cancellation, drafts and their rollback, and fairness under a small step budget. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "engine/kv_cache.h"
#include "engine/sched.h"
#include "tests/check.h"

static struct md_engine_req *mkreq(uint64_t id, uint32_t n_prompt, uint32_t max_tokens)
{
	struct md_engine_req *r = calloc(1, sizeof(*r));
	r->id = id;
	r->n_prompt = n_prompt;
	r->prompt = malloc(sizeof(int32_t) * n_prompt);
	for (uint32_t i = 0; i < n_prompt; i++)
		r->prompt[i] = (int32_t)(id * 1000 + i);
	r->max_tokens = max_tokens;
	md_sampling_default(&r->sampling);
	return r;
}

static struct md_seq *mkseq(uint64_t id, uint32_t n_prompt, uint32_t max_tokens)
{
	struct md_seq *s = md_seq_new(mkreq(id, n_prompt, max_tokens), 256, 8, id);
	CHECK(s != NULL);
	return s;
}

struct rig {
	struct md_kv_cache kv;
	struct md_sched sc;
};

static void rig_init(struct rig *g, uint32_t blocks, uint32_t max_seqs, uint32_t step_tokens)
{
	CHECK_EQ_I(md_kv_init(&g->kv, 1, 4, blocks, max_seqs), 0);
	struct md_sched_config c = { .max_seqs = max_seqs, .step_tokens = step_tokens, .n_ctx = 256,
				     .max_logits = 4 * max_seqs };
	CHECK_EQ_I(md_sched_init(&g->sc, &c, &g->kv), 0);
}

static void rig_release(struct rig *g)
{
	md_sched_release(&g->sc);
	md_kv_release(&g->kv);
}

/* What the engine does after a successful forward pass: commit, then give every item with
 * logits a sampled token (id 7), finishing sequences that reached max_tokens. Returns the
 * number of sequences finished. */
static int finish_step(struct rig *g)
{
	md_sched_commit(&g->sc, NULL);
	int done = 0;
	struct md_plan *p = &g->sc.plan;
	for (uint32_t i = 0; i < p->n_items; i++) {
		struct md_seq *q = p->items[i].seq;
		if (!p->items[i].n_logits)
			continue;
		md_sched_append(&g->sc, q, 7);
		q->n_gen++;
		if (q->n_gen >= q->req->max_tokens) {
			md_sched_remove(&g->sc, q);
			md_seq_free(q);
			done++;
		}
	}
	return done;
}

static const struct md_plan_item *item_of(const struct md_plan *p, uint64_t id)
{
	for (uint32_t i = 0; i < p->n_items; i++)
		if (p->items[i].seq->req->id == id)
			return &p->items[i];
	return NULL;
}

/* FIFO admission, chunked prefill in admission order, logits only on a prompt's last row,
 * then one decode token per sequence. */
static void test_admission_and_chunks(void)
{
	struct rig g;
	rig_init(&g, 64, 4, 16);
	md_sched_enqueue(&g.sc, mkseq(1, 10, 3));
	md_sched_enqueue(&g.sc, mkseq(2, 10, 3));
	CHECK_EQ_U(md_sched_plan(&g.sc), 16);
	const struct md_plan *p = &g.sc.plan;
	CHECK_EQ_U(p->n_items, 2);
	CHECK_EQ_U(p->items[0].seq->req->id, 1);
	CHECK_EQ_U(p->items[0].n_tok, 10);
	CHECK_EQ_U(p->items[0].n_logits, 1);
	CHECK_EQ_U(p->items[1].seq->req->id, 2);
	CHECK_EQ_U(p->items[1].n_tok, 6);
	CHECK_EQ_U(p->items[1].n_logits, 0);
	CHECK_EQ_U(p->n_logits, 1);
	CHECK(p->want_logits[9] && !p->want_logits[8] && !p->want_logits[15]);
	/* positions are contiguous per sequence from its KV length */
	CHECK_EQ_I(p->pos[0], 0);
	CHECK_EQ_I(p->pos[10], 0);
	CHECK_EQ_I(p->tokens[12], 2002);
	CHECK_EQ_U(p->n_prompt, 16);
	finish_step(&g);

	/* seq 1 decodes its first generated token, seq 2 finishes its prompt */
	CHECK_EQ_U(md_sched_plan(&g.sc), 5);
	const struct md_plan_item *a = item_of(p, 1), *b = item_of(p, 2);
	CHECK(a && b);
	if (a && b) {
		CHECK_EQ_U(a->n_tok, 1);
		CHECK_EQ_U(a->n_logits, 1);
		CHECK_EQ_I(p->pos[a->row], 10);
		CHECK_EQ_I(p->tokens[a->row], 7);
		CHECK_EQ_U(b->n_tok, 4);
		CHECK_EQ_U(b->n_logits, 1);
	}
	CHECK_EQ_U(p->n_decode, 1);
	CHECK_EQ_U(p->n_prompt, 4);
	finish_step(&g);
	rig_release(&g);
}

/* A prompt larger than the whole pool fails; one that merely does not fit now waits. */
static void test_admission_limits(void)
{
	struct rig g;
	rig_init(&g, 4, 4, 64);
	md_sched_enqueue(&g.sc, mkseq(1, 40, 2)); /* 3 blocks */
	md_sched_enqueue(&g.sc, mkseq(2, 100, 2)); /* 7 blocks: never */
	md_sched_enqueue(&g.sc, mkseq(3, 20, 2)); /* 2 blocks: waits for 1 */
	md_sched_plan(&g.sc);
	const struct md_plan *p = &g.sc.plan;
	CHECK(p->failed != NULL);
	if (p->failed) {
		CHECK_EQ_U(p->failed->req->id, 2);
		CHECK(p->failed->next == NULL);
		md_seq_free(p->failed);
		g.sc.plan.failed = NULL;
	}
	CHECK_EQ_U(p->n_items, 1);
	CHECK_EQ_U(md_sched_n_waiting(&g.sc), 1);
	finish_step(&g);
	md_sched_plan(&g.sc);
	finish_step(&g); /* seq 1 done after 2 tokens */
	CHECK_EQ_U(md_sched_n_running(&g.sc), 0);
	md_sched_plan(&g.sc);
	CHECK_EQ_U(p->n_items, 1);
	CHECK_EQ_U(p->items[0].seq->req->id, 3);
	finish_step(&g);
	rig_release(&g);
}

/* When the pool runs dry a decoder preempts the youngest; the victim is recomputed later
 * (its generated tokens included, counted as recomputed) and its tokens are unchanged. */
static void test_preemption(void)
{
	struct rig g;
	/* 5 blocks of 16: two sequences of 30 tokens fill 4; growing past 32 needs a third each */
	rig_init(&g, 5, 2, 64);
	md_sched_enqueue(&g.sc, mkseq(1, 30, 20));
	md_sched_enqueue(&g.sc, mkseq(2, 30, 20));
	md_sched_plan(&g.sc);
	CHECK_EQ_U(g.sc.plan.n_items, 2);
	finish_step(&g);
	uint64_t preempted_before = g.sc.stats.preemptions;
	for (int i = 0; i < 6 && g.sc.stats.preemptions == preempted_before; i++) {
		md_sched_plan(&g.sc);
		finish_step(&g);
	}
	CHECK_EQ_U(g.sc.stats.preemptions, preempted_before + 1);
	CHECK_EQ_U(md_sched_n_waiting(&g.sc), 1);
	struct md_seq *victim = g.sc.waiting;
	CHECK_EQ_U(victim->req->id, 2); /* the youngest */
	CHECK_EQ_I(victim->kv_seq, -1);
	CHECK_EQ_U(victim->n_kv, 0);
	uint32_t victim_toks = victim->n_toks;
	CHECK(victim_toks > 30);

	/* run seq 1 to completion; then seq 2 comes back and recomputes all its tokens */
	uint64_t prompt_before = g.sc.stats.prompt_tokens;
	while (md_sched_n_running(&g.sc) == 1 && g.sc.running[0]->req->id == 1) {
		md_sched_plan(&g.sc);
		finish_step(&g);
	}
	md_sched_plan(&g.sc);
	const struct md_plan_item *it = item_of(&g.sc.plan, 2);
	CHECK(it != NULL);
	if (it) {
		CHECK_EQ_U(it->n_tok, victim_toks);
		CHECK_EQ_U(it->n_logits, 1);
		CHECK_EQ_I(g.sc.plan.tokens[it->row + 29], 2029);
		CHECK_EQ_I(g.sc.plan.tokens[it->row + 30], 7);
	}
	/* the recompute of KV that existed before is not counted as prompt again */
	CHECK_EQ_U(g.sc.plan.n_recompute, victim_toks - 1);
	CHECK_EQ_U(g.sc.plan.n_prompt, 0);
	finish_step(&g);
	CHECK_EQ_U(g.sc.stats.prompt_tokens, prompt_before);
	rig_release(&g);
}

/* Cancelling a waiting or a running sequence hands it back and frees its blocks. */
static void test_cancel(void)
{
	struct rig g;
	rig_init(&g, 16, 1, 64);
	md_sched_enqueue(&g.sc, mkseq(1, 20, 5));
	md_sched_enqueue(&g.sc, mkseq(2, 20, 5));
	md_sched_plan(&g.sc);
	finish_step(&g);
	CHECK_EQ_U(md_kv_blocks_used(&g.kv), 2);
	struct md_seq *q = md_sched_cancel(&g.sc, 2);
	CHECK(q && q->req->id == 2);
	md_seq_free(q);
	CHECK_EQ_U(md_sched_n_waiting(&g.sc), 0);
	q = md_sched_cancel(&g.sc, 1);
	CHECK(q && q->req->id == 1);
	md_seq_free(q);
	CHECK_EQ_U(md_sched_n_running(&g.sc), 0);
	CHECK_EQ_U(md_kv_blocks_used(&g.kv), 0);
	CHECK(md_sched_cancel(&g.sc, 99) == NULL);
	CHECK_EQ_U(md_sched_plan(&g.sc), 0);
	rig_release(&g);
}

/* Drafted tokens get logits rows; rejected ones roll back in the KV cache. */
static void test_drafts(void)
{
	struct rig g;
	rig_init(&g, 16, 2, 64);
	md_sched_enqueue(&g.sc, mkseq(1, 8, 10));
	md_sched_plan(&g.sc);
	finish_step(&g); /* n_toks 9, n_kv 8 */
	struct md_seq *q = g.sc.running[0];
	static const int32_t draft[3] = { 11, 12, 13 };
	q->draft = draft;
	q->n_draft = 3;
	CHECK_EQ_U(md_sched_plan(&g.sc), 4);
	const struct md_plan *p = &g.sc.plan;
	CHECK_EQ_U(p->items[0].n_tok, 4);
	CHECK_EQ_U(p->items[0].n_draft, 3);
	CHECK_EQ_U(p->items[0].n_logits, 4);
	CHECK_EQ_U(p->n_logits, 4);
	CHECK_EQ_I(p->tokens[0], 7);
	CHECK_EQ_I(p->tokens[1], 11);
	CHECK_EQ_I(p->pos[3], 11);
	CHECK(p->want_logits[0] && p->want_logits[3]);
	/* the forward pass would have stored 12 positions */
	md_kv_reserve(&g.kv, q->kv_seq, 12);
	uint32_t accepted[1] = { 1 };
	md_sched_commit(&g.sc, accepted);
	CHECK_EQ_U(q->n_kv, 10); /* 9 real + 1 accepted draft */
	CHECK(q->draft == NULL && q->n_draft == 0);
	md_sched_append(&g.sc, q, 11); /* the accepted draft */
	md_sched_append(&g.sc, q, 5);  /* the token sampled after it */
	CHECK_EQ_U(md_sched_plan(&g.sc), 1);
	CHECK_EQ_I(p->pos[0], 10);
	CHECK_EQ_I(p->tokens[0], 5);
	md_sched_commit(&g.sc, NULL);
	rig_release(&g);
}

/* The confirmed bug: 40 streams with a 16-token budget. Every stream must get its first
 * token long before the first 16 finish, and streams are served in rotation. */
static void test_fairness(void)
{
	struct rig g;
	rig_init(&g, 200, 40, 16);
	for (uint64_t i = 0; i < 40; i++)
		md_sched_enqueue(&g.sc, mkseq(i, 5, 60));
	uint32_t first_step[40] = { 0 }, served[40] = { 0 };
	int finished = 0;
	uint32_t step = 0, first_finish_step = 0;
	while (md_sched_plan(&g.sc) && step < 2000) {
		step++;
		const struct md_plan *p = &g.sc.plan;
		for (uint32_t i = 0; i < p->n_items; i++) {
			uint64_t id = p->items[i].seq->req->id;
			served[id]++;
			if (p->items[i].n_logits && !first_step[id])
				first_step[id] = step;
		}
		int d = finish_step(&g);
		if (d && !first_finish_step)
			first_finish_step = step;
		finished += d;
	}
	CHECK_EQ_I(finished, 40);
	uint32_t last_first = 0;
	for (int i = 0; i < 40; i++) {
		CHECK(first_step[i] > 0);
		if (first_step[i] > last_first)
			last_first = first_step[i];
	}
	/* 40 prompts of 5 tokens need 13 steps of 16, a few more with the early streams' decode
	 * tokens in between; the first stream needs 60 decode steps to finish. (Decoders always
	 * first, the old rule, filled the budget with 16 decoders: streams 16-39 waited until
	 * those finished.) */
	fprintf(stderr, "fairness: last first token at step %u, first finish at step %u\n",
		last_first, first_finish_step);
	CHECK(last_first <= 20);
	CHECK(first_finish_step > last_first);
	/* rotation: over the whole run every stream was served about equally often */
	for (int i = 1; i < 40; i++)
		CHECK(served[i] <= served[0] + 2 && served[0] <= served[i] + 2);
	rig_release(&g);
}

/* Expert-aware batching: six decoders, room for two per step. Sequences 0-2 route to experts
 * {0,1} at both layers, 3, 4 and 5 to experts of their own. Run 60 steps with the routing the
 * engine would report; returns the mean distinct experts per layer and step, and checks the
 * age bound (expert_age 4, 6 decoders, room 2: a skip of at most 4 + 3 steps). */
static double run_expert_batching(bool aware, uint32_t age, uint32_t *max_skip_out,
				  uint64_t *selections)
{
	static const int32_t ex[6][2] = {
		{ 0, 1 }, { 1, 0 }, { 0, 1 }, { 2, 3 }, { 4, 5 }, { 6, 7 },
	};
	struct rig g;
	CHECK_EQ_I(md_kv_init(&g.kv, 1, 4, 200, 6), 0);
	struct md_sched_config c = { .max_seqs = 6, .step_tokens = 2, .n_ctx = 256,
				     .max_logits = 6, .n_layer = 2, .n_expert = 8,
				     .expert_aware = aware, .expert_age = age };
	REQUIRE(CHECK_EQ_I(md_sched_init(&g.sc, &c, &g.kv), 0));
	for (uint64_t i = 0; i < 6; i++)
		md_sched_enqueue(&g.sc, mkseq(i, 1, 200));
	uint32_t last[6] = { 0 }, max_skip = 0, n_steps = 0, distinct = 0;
	for (uint32_t step = 1; step <= 60; step++) {
		/* who must go this step: skipped age steps or more (all routed by step 4) */
		bool aged = false;
		for (uint32_t i = 0; i < g.sc.n_running; i++)
			aged |= g.sc.step_no - g.sc.running[i]->last_served >= (age ? age : 3);
		REQUIRE(CHECK(md_sched_plan(&g.sc) == 2));
		const struct md_plan *p = &g.sc.plan;
		int32_t ids[2 * 2];
		uint8_t used[8] = { 0 };
		bool all_shared = true;
		for (uint32_t i = 0; i < p->n_items; i++) {
			uint64_t id = p->items[i].seq->req->id;
			uint32_t skip = last[id] ? step - last[id] - 1 : step - 1;
			if (skip > max_skip)
				max_skip = skip;
			last[id] = step;
			all_shared &= id <= 2;
			for (int j = 0; j < 2; j++) {
				ids[p->items[i].row * 2 + j] = ex[id][j];
				used[ex[id][j]] = 1;
			}
		}
		for (int e = 0; e < 8; e++)
			distinct += used[e];
		n_steps++;
		if (aware && step > 8 && !aged) {
			CHECK_CONTEXT("step %u", step);
			CHECK(all_shared); /* nobody is due: two of the sharing three */
			CHECK_CONTEXT_CLEAR();
		}
		struct md_routing r = { .n_tokens = (int)p->n_tokens, .n_expert = 8, .n_used = 2,
					.ids = ids };
		md_sched_note_routing(&g.sc, 0, &r);
		md_sched_note_routing(&g.sc, 1, &r);
		finish_step(&g);
	}
	for (int i = 0; i < 6; i++)
		CHECK(last[i] > 50); /* everyone served lately */
	*max_skip_out = max_skip;
	*selections = g.sc.stats.expert_selections;
	rig_release(&g);
	return (double)distinct / n_steps;
}

static void test_expert_batching(void)
{
	uint32_t skip_on, skip_off;
	uint64_t sel_on, sel_off;
	double on = run_expert_batching(true, 4, &skip_on, &sel_on);
	double off = run_expert_batching(false, 4, &skip_off, &sel_off);
	fprintf(stderr, "expert batching: %.2f distinct experts per layer and step (off: %.2f), "
		"longest wait %u steps (off: %u)\n", on, off, skip_on, skip_off);
	/* off: pairs in rotation, (0,1) (2,3) (4,5): 2, 4, 4 experts; on: mostly 2 */
	CHECK(off > 3.2);
	CHECK(on < off - 0.5);
	CHECK(skip_on <= 4 + 3);
	CHECK_EQ_U(skip_off, 2);
	CHECK(sel_on >= 59);
	CHECK_EQ_U(sel_off, 0);
	/* the default age bound, ceil(6 / 2) = 3: one skip more than the fair order's 2 */
	uint32_t skip_def;
	uint64_t sel_def;
	double def = run_expert_batching(true, 0, &skip_def, &sel_def);
	fprintf(stderr, "expert batching, default age bound: %.2f distinct experts, longest wait "
		"%u steps\n", def, skip_def);
	CHECK(def < off - 0.3);
	CHECK(skip_def <= 3 + 3);

	/* Room for everyone: no selection, plain rotation. */
	struct rig g;
	CHECK_EQ_I(md_kv_init(&g.kv, 1, 4, 200, 4), 0);
	struct md_sched_config c = { .max_seqs = 4, .step_tokens = 4, .n_ctx = 256,
				     .n_layer = 2, .n_expert = 8, .expert_aware = true };
	REQUIRE(CHECK_EQ_I(md_sched_init(&g.sc, &c, &g.kv), 0));
	for (uint64_t i = 0; i < 3; i++)
		md_sched_enqueue(&g.sc, mkseq(i, 1, 200));
	for (int step = 0; step < 5; step++) {
		CHECK_EQ_U(md_sched_plan(&g.sc), 3);
		finish_step(&g);
	}
	CHECK_EQ_U(g.sc.stats.expert_selections, 0);
	rig_release(&g);
}

static bool layer0_45_resident(void *arg, uint32_t layer, uint32_t expert)
{
	(*(int *)arg)++;
	return expert == 4 || expert == 5;
}

/* Under an expert cache: sequences 0-2 share experts {0,1}, 3 and 4 share {4,5}, which are
 * resident, 5 uses {6,7}; room for two. Without residency the step takes two of the bigger
 * cluster 0-2; with it, 3 and 4 (no miss at all). */
static void test_expert_batching_resident(void)
{
	static const int32_t ex[6][2] = {
		{ 0, 1 }, { 0, 1 }, { 1, 0 }, { 4, 5 }, { 5, 4 }, { 6, 7 },
	};
	for (int with = 0; with < 2; with++) {
		struct rig g;
		CHECK_EQ_I(md_kv_init(&g.kv, 1, 4, 100, 6), 0);
		struct md_sched_config c = { .max_seqs = 6, .step_tokens = 6, .n_ctx = 256,
					     .n_layer = 1, .n_expert = 8, .expert_aware = true,
					     .expert_age = 100 };
		REQUIRE(CHECK_EQ_I(md_sched_init(&g.sc, &c, &g.kv), 0));
		int calls = 0;
		if (with)
			md_sched_set_resident(&g.sc, layer0_45_resident, &calls);
		for (uint64_t i = 0; i < 6; i++)
			md_sched_enqueue(&g.sc, mkseq(i, 1, 50));
		/* step 1: room for all six (their prompts); it teaches the routing */
		REQUIRE(CHECK_EQ_U(md_sched_plan(&g.sc), 6));
		int32_t ids[12];
		for (uint32_t i = 0; i < g.sc.plan.n_items; i++) {
			const struct md_plan_item *it = &g.sc.plan.items[i];
			memcpy(&ids[it->row * 2], ex[it->seq->req->id], sizeof(ex[0]));
		}
		struct md_routing r = { .n_tokens = 6, .n_expert = 8, .n_used = 2, .ids = ids };
		md_sched_note_routing(&g.sc, 0, &r);
		finish_step(&g);
		/* step 2 with room for two */
		g.sc.cfg.step_tokens = 2;
		REQUIRE(CHECK_EQ_U(md_sched_plan(&g.sc), 2));
		uint64_t a = g.sc.plan.items[0].seq->req->id, b = g.sc.plan.items[1].seq->req->id;
		CHECK_CONTEXT("with residency %d: chose %llu and %llu", with, (unsigned long long)a,
			      (unsigned long long)b);
		if (with) {
			CHECK((a == 3 && b == 4) || (a == 4 && b == 3));
			CHECK_EQ_I(calls, 8); /* every expert of the layer, once */
		} else {
			CHECK(a <= 2 && b <= 2);
		}
		CHECK_CONTEXT_CLEAR();
		md_sched_commit(&g.sc, NULL);
		rig_release(&g);
	}
}

/* Report the routing the engine would: every row of sequence id goes to the experts ex[id],
 * at the one MoE layer. */
static void route_plan(struct rig *g, const int32_t (*ex)[2])
{
	const struct md_plan *p = &g->sc.plan;
	int32_t ids[2 * 16];
	REQUIRE(CHECK(p->n_tokens <= 16));
	for (uint32_t i = 0; i < p->n_items; i++)
		for (uint32_t t = 0; t < p->items[i].n_tok; t++)
			memcpy(&ids[(p->items[i].row + t) * 2], ex[p->items[i].seq->req->id],
			       sizeof(ex[0]));
	struct md_routing r = { .n_tokens = (int)p->n_tokens, .n_expert = 8, .n_used = 2,
				.ids = ids };
	md_sched_note_routing(&g->sc, 0, &r);
}

/* Prompt chunks ordered by experts: decoder 0 routes to {4,5}, prompt 1 (20 tokens) to
 * {0,1}, prompt 2 (20 tokens) to {4,5}; 9 tokens per step (8 at step 2), so one prompt chunk
 * fits. Steps 1 and 2 give each prompt a chunk in service order (prompt 2 waited longer than
 * the decoder at step 2 and takes the step). At step 3 the decoder goes first and, off,
 * prompt 1, the less recently served; expert-aware, prompt 2, which adds no expert to the
 * decoder's. At step 4 the prompt that waited then stands in front of the decoder and keeps
 * its place in both. */
static void test_prefill_order(void)
{
	static const int32_t ex[3][2] = { { 4, 5 }, { 0, 1 }, { 5, 4 } };
	for (int aware = 0; aware < 2; aware++) {
		struct rig g;
		CHECK_EQ_I(md_kv_init(&g.kv, 1, 4, 64, 3), 0);
		struct md_sched_config c = { .max_seqs = 3, .step_tokens = 9, .n_ctx = 256,
					     .max_logits = 3, .n_layer = 1, .n_expert = 8,
					     .expert_aware = aware };
		REQUIRE(CHECK_EQ_I(md_sched_init(&g.sc, &c, &g.kv), 0));
		md_sched_enqueue(&g.sc, mkseq(0, 1, 50));
		md_sched_enqueue(&g.sc, mkseq(1, 20, 50));
		md_sched_enqueue(&g.sc, mkseq(2, 20, 50));
		uint64_t first_prefill[5] = { 0 };
		for (int step = 1; step <= 4; step++) {
			g.sc.cfg.step_tokens = step == 2 ? 8 : 9;
			REQUIRE(CHECK_EQ_U(md_sched_plan(&g.sc), g.sc.cfg.step_tokens));
			const struct md_plan *p = &g.sc.plan;
			for (uint32_t i = 0; i < p->n_items; i++)
				if (p->items[i].seq->req->id != 0) {
					first_prefill[step] = p->items[i].seq->req->id;
					break;
				}
			if (step == 3)
				CHECK(item_of(p, 0) != NULL && p->items[0].seq->req->id == 0);
			route_plan(&g, ex);
			finish_step(&g);
		}
		CHECK_CONTEXT("expert-aware %d: prompt chunks %llu %llu %llu %llu", aware,
			      (unsigned long long)first_prefill[1],
			      (unsigned long long)first_prefill[2],
			      (unsigned long long)first_prefill[3],
			      (unsigned long long)first_prefill[4]);
		CHECK_EQ_U(first_prefill[1], 1);
		CHECK_EQ_U(first_prefill[2], 2);
		CHECK_EQ_U(first_prefill[3], aware ? 2 : 1);
		CHECK_EQ_U(first_prefill[4], aware ? 1 : 2);
		CHECK_EQ_U(g.sc.stats.prefill_selections, aware ? 1 : 0);
		CHECK_CONTEXT_CLEAR();
		rig_release(&g);
	}
}

/* max_tokens far beyond the context: the sequence's capacity is bounded by the context and
 * nothing wraps. */
static void test_huge_max_tokens(void)
{
	struct md_seq *s = md_seq_new(mkreq(1, 10, UINT32_MAX), 64, 8, 1);
	CHECK(s != NULL);
	if (s) {
		CHECK_EQ_U(s->cap, 65);
		s->kv_seq = -1;
		md_seq_free(s);
	}
}

int main(void)
{
	test_admission_and_chunks();
	test_admission_limits();
	test_preemption();
	test_cancel();
	test_drafts();
	test_fairness();
	test_expert_batching();
	test_expert_batching_resident();
	test_prefill_order();
	test_huge_max_tokens();
	if (failures)
		fprintf(stderr, "%d checks failed\n", failures);
	return failures ? 1 : 0;
}
