/* The scheduler: sequences, the waiting and running lists, admission, preemption, step plans. */
#include "engine/sched.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* ---- sequences ---- */

struct md_seq *md_seq_new(struct md_engine_req *r, uint32_t n_ctx, uint32_t n_vocab,
			  uint64_t seed)
{
	struct md_seq *s = calloc(1, sizeof(*s));
	if (!s)
		return NULL;
	s->kv_seq = -1;
	s->n_prompt = r->n_prompt;
	/* 64-bit: n_prompt + max_tokens may not fit 32 bits. */
	uint64_t cap = (uint64_t)r->n_prompt + r->max_tokens;
	if (cap > n_ctx)
		cap = n_ctx;
	if (cap < r->n_prompt)
		cap = r->n_prompt;
	s->cap = (uint32_t)cap + 1;
	s->toks = malloc(sizeof(int32_t) * s->cap);
	if (!s->toks || md_sampler_init(&s->sm, n_vocab, seed)) {
		free(s->toks);
		free(s);
		return NULL;
	}
	memcpy(s->toks, r->prompt, sizeof(int32_t) * r->n_prompt);
	s->n_toks = r->n_prompt;
	s->req = r;
	return s;
}

void md_seq_free(struct md_seq *s)
{
	if (!s)
		return;
	MD_ASSERT(s->kv_seq < 0);
	md_sampler_release(&s->sm);
	md_spec_seq_free(s->spec);
	md_engine_req_free(s->req);
	free(s->toks);
	free(s);
}

/* ---- lists ---- */

int md_sched_init(struct md_sched *s, const struct md_sched_config *cfg, struct md_kv_cache *kv)
{
	memset(s, 0, sizeof(*s));
	if (cfg->max_seqs == 0 || cfg->step_tokens == 0 || cfg->n_ctx == 0)
		return -EINVAL;
	s->cfg = *cfg;
	if (s->cfg.max_logits == 0)
		s->cfg.max_logits = cfg->max_seqs;
	s->kv = kv;
	s->owner._name = "engine";
	size_t T = cfg->step_tokens, S = cfg->max_seqs;
	s->running = calloc(S, sizeof(*s->running));
	s->order = calloc(S, sizeof(*s->order));
	s->plan.items = calloc(S, sizeof(*s->plan.items));
	s->plan.tokens = malloc(sizeof(int32_t) * T);
	s->plan.seq = malloc(sizeof(int32_t) * T);
	s->plan.pos = malloc(sizeof(int32_t) * T);
	s->plan.want_logits = malloc(sizeof(bool) * T);
	if (!s->running || !s->order || !s->plan.items || !s->plan.tokens || !s->plan.seq ||
	    !s->plan.pos || !s->plan.want_logits) {
		md_sched_release(s);
		return -ENOMEM;
	}
	return 0;
}

static void kv_drop(struct md_sched *s, struct md_seq *q)
{
	if (q->kv_seq >= 0)
		md_kv_seq_free(s->kv, q->kv_seq);
	q->kv_seq = -1;
	q->n_kv = 0;
}

void md_sched_release(struct md_sched *s)
{
	struct md_seq *q;
	while ((q = md_sched_pop_any(s)))
		md_seq_free(q);
	while ((q = s->plan.failed)) {
		s->plan.failed = q->next;
		md_seq_free(q);
	}
	free(s->running);
	free(s->order);
	free(s->plan.items);
	free(s->plan.tokens);
	free(s->plan.seq);
	free(s->plan.pos);
	free(s->plan.want_logits);
	memset(s, 0, sizeof(*s));
}

void md_sched_enqueue(struct md_sched *s, struct md_seq *q)
{
	MD_ASSERT_OWNER(&s->owner);
	q->next = NULL;
	struct md_seq **pp = &s->waiting;
	while (*pp)
		pp = &(*pp)->next;
	*pp = q;
	s->n_waiting++;
}

static void running_remove_at(struct md_sched *s, uint32_t i)
{
	memmove(&s->running[i], &s->running[i + 1],
		sizeof(struct md_seq *) * (s->n_running - i - 1));
	s->n_running--;
}

void md_sched_remove(struct md_sched *s, struct md_seq *q)
{
	MD_ASSERT_OWNER(&s->owner);
	for (uint32_t i = 0; i < s->n_running; i++)
		if (s->running[i] == q) {
			running_remove_at(s, i);
			kv_drop(s, q);
			return;
		}
	MD_ASSERT(!"sequence not running");
}

struct md_seq *md_sched_cancel(struct md_sched *s, uint64_t id)
{
	MD_ASSERT_OWNER(&s->owner);
	for (struct md_seq **pp = &s->waiting; *pp; pp = &(*pp)->next)
		if ((*pp)->req->id == id) {
			struct md_seq *q = *pp;
			*pp = q->next;
			q->next = NULL;
			s->n_waiting--;
			return q;
		}
	for (uint32_t i = 0; i < s->n_running; i++)
		if (s->running[i]->req->id == id) {
			struct md_seq *q = s->running[i];
			running_remove_at(s, i);
			kv_drop(s, q);
			return q;
		}
	return NULL;
}

struct md_seq *md_sched_pop_any(struct md_sched *s)
{
	struct md_seq *q = s->waiting;
	if (q) {
		s->waiting = q->next;
		q->next = NULL;
		s->n_waiting--;
		return q;
	}
	if (s->n_running == 0)
		return NULL;
	q = s->running[--s->n_running];
	kv_drop(s, q);
	return q;
}

/* ---- admission and preemption ---- */

static uint32_t blocks_for(uint32_t n_pos)
{
	return (n_pos + MD_KV_BLOCK_TOKENS - 1) / MD_KV_BLOCK_TOKENS;
}

/* Preempt the youngest running sequence: free its KV, requeue it at the front. */
static void preempt_youngest(struct md_sched *s)
{
	uint32_t yi = 0;
	for (uint32_t i = 1; i < s->n_running; i++)
		if (s->running[i]->admit_no > s->running[yi]->admit_no)
			yi = i;
	struct md_seq *q = s->running[yi];
	running_remove_at(s, yi);
	kv_drop(s, q);
	q->next = s->waiting;
	s->waiting = q;
	s->n_waiting++;
	s->stats.preemptions++;
}

/* Admit from the queue head while a slot and KV blocks for its pending tokens are free. One
 * block per running sequence stays in reserve for their next decode steps. A head that does
 * not fit blocks the ones behind it, so nothing starves. */
static void admit(struct md_sched *s)
{
	while (s->waiting && s->n_running < s->cfg.max_seqs) {
		struct md_seq *q = s->waiting;
		uint32_t need = blocks_for(q->n_toks + 1);
		if (need > md_kv_blocks_total(s->kv)) {
			s->waiting = q->next;
			s->n_waiting--;
			q->next = s->plan.failed;
			s->plan.failed = q;
			continue;
		}
		if (md_kv_blocks_free(s->kv) < need + s->n_running && s->n_running > 0)
			break;
		int ks = md_kv_seq_new(s->kv);
		if (ks < 0)
			break;
		if (md_kv_reserve(s->kv, ks, q->n_toks)) {
			md_kv_seq_free(s->kv, ks);
			break;
		}
		s->waiting = q->next;
		s->n_waiting--;
		q->next = NULL;
		q->kv_seq = ks;
		q->n_kv = 0;
		q->admit_no = ++s->admit_counter;
		q->last_served = s->step_no;
		s->running[s->n_running++] = q;
	}
}

/* Tokens a running sequence wants computed this step, drafts included. */
static uint32_t pending(const struct md_seq *q)
{
	return q->n_toks - q->n_kv + q->n_draft;
}

static bool is_decoding(const struct md_seq *q)
{
	return q->n_toks - q->n_kv == 1;
}

/* Every decoding sequence needs KV room for its token and drafts; take it from the youngest
 * sequences when the pool is dry (each preemption removes one, so this ends). A sequence whose
 * drafts do not fit drops them rather than preempting anyone. */
static void reserve_decoders(struct md_sched *s)
{
	for (bool again = true; again;) {
		again = false;
		for (uint32_t i = 0; i < s->n_running; i++) {
			struct md_seq *q = s->running[i];
			if (!is_decoding(q))
				continue;
			if (q->n_draft && md_kv_reserve(s->kv, q->kv_seq, q->n_toks + q->n_draft) == 0)
				continue;
			q->n_draft = 0;
			q->draft = NULL;
			if (md_kv_reserve(s->kv, q->kv_seq, q->n_toks) == 0)
				continue;
			preempt_youngest(s);
			again = true;
			break;
		}
	}
}

/* Least recently served first, admission order on ties. */
static int by_service(const void *a, const void *b)
{
	const struct md_seq *x = *(struct md_seq *const *)a, *y = *(struct md_seq *const *)b;
	if (x->last_served != y->last_served)
		return x->last_served < y->last_served ? -1 : 1;
	return x->admit_no < y->admit_no ? -1 : x->admit_no > y->admit_no;
}

static void plan_token(struct md_plan *p, const struct md_seq *q, int32_t tok, uint32_t pos)
{
	uint32_t n = p->n_tokens++;
	p->tokens[n] = tok;
	p->seq[n] = q->kv_seq;
	p->pos[n] = (int32_t)pos;
	p->want_logits[n] = false;
}

uint32_t md_sched_plan(struct md_sched *s)
{
	MD_ASSERT_OWNER(&s->owner);
	struct md_plan *p = &s->plan;
	p->n_tokens = p->n_items = p->n_logits = 0;
	p->n_prompt = p->n_recompute = p->n_decode = 0;
	admit(s);
	reserve_decoders(s);
	if (s->n_running == 0)
		return 0;
	s->step_no++;

	memcpy(s->order, s->running, sizeof(*s->order) * s->n_running);
	qsort(s->order, s->n_running, sizeof(*s->order), by_service);

	uint32_t budget = s->cfg.step_tokens;
	for (uint32_t i = 0; i < s->n_running && budget > 0; i++) {
		struct md_seq *q = s->order[i];
		bool dec = is_decoding(q);
		if (!dec)
			q->n_draft = 0; /* drafts follow a finished prompt only */
		uint32_t want = pending(q);
		if (dec) {
			/* Drafts are trimmed to the budget and the logits rows left; the token itself
			 * always fits (the first max_seqs decoders have a row each). */
			uint32_t rows_left = s->cfg.max_logits - p->n_logits;
			if (rows_left == 0)
				continue;
			if (q->n_draft > budget - 1)
				q->n_draft = budget - 1;
			if (q->n_draft > rows_left - 1)
				q->n_draft = rows_left - 1;
			want = pending(q);
		}
		uint32_t take = want < budget ? want : budget;
		struct md_plan_item *it = &p->items[p->n_items++];
		it->seq = q;
		it->row = p->n_tokens;
		it->n_tok = take;
		it->n_draft = dec ? q->n_draft : 0;
		uint32_t n_real = take - it->n_draft;
		for (uint32_t k = 0; k < n_real; k++) {
			uint32_t pos = q->n_kv + k;
			plan_token(p, q, q->toks[pos], pos);
			if (pos < q->n_kv_max)
				p->n_recompute++;
			else if (pos < q->n_prompt)
				p->n_prompt++;
			else
				p->n_decode++;
		}
		for (uint32_t k = 0; k < it->n_draft; k++)
			plan_token(p, q, q->draft[k], q->n_toks + k);
		/* Logits for the last real token once the prompt is done, and for every draft. */
		it->n_logits = q->n_kv + n_real == q->n_toks ? 1 + it->n_draft : 0;
		for (uint32_t k = 0; k < it->n_logits; k++)
			p->want_logits[it->row + take - it->n_logits + k] = true;
		p->n_logits += it->n_logits;
		q->last_served = s->step_no;
		budget -= take;
	}
	/* Batch order must keep each sequence's rows together and positions increasing, which
	 * the loop above does; logits rows come back in item order. */
	return p->n_tokens;
}

void md_sched_commit(struct md_sched *s, const uint32_t *accepted)
{
	MD_ASSERT_OWNER(&s->owner);
	struct md_plan *p = &s->plan;
	for (uint32_t i = 0; i < p->n_items; i++) {
		struct md_plan_item *it = &p->items[i];
		struct md_seq *q = it->seq;
		uint32_t keep = it->n_draft;
		if (accepted && accepted[i] < keep)
			keep = accepted[i];
		/* The KV keeps the rows of the real tokens and of the accepted drafts, which the
		 * caller appends (md_sched_append) before the next plan. */
		q->n_kv += it->n_tok - it->n_draft + keep;
		if (it->n_draft > keep)
			md_kv_truncate(s->kv, q->kv_seq, q->n_kv);
		if (q->n_kv > q->n_kv_max)
			q->n_kv_max = q->n_kv;
	}
	/* Drafts are borrowed for one step only, served or not. */
	for (uint32_t i = 0; i < s->n_running; i++) {
		s->running[i]->draft = NULL;
		s->running[i]->n_draft = 0;
	}
	s->stats.steps++;
	s->stats.prompt_tokens += p->n_prompt;
	s->stats.recomputed_tokens += p->n_recompute;
	s->stats.gen_tokens += p->n_decode;
}

void md_sched_append(struct md_sched *s, struct md_seq *q, int32_t token)
{
	MD_ASSERT_OWNER(&s->owner);
	MD_ASSERT(q->n_toks < q->cap);
	q->toks[q->n_toks++] = token;
}
