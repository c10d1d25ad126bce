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
	if (cfg->n_layer && cfg->n_expert) {
		s->exp_words = (cfg->n_expert + 63) / 64;
		size_t per = (size_t)cfg->n_layer * s->exp_words;
		s->exp_bits = calloc(S * per, sizeof(*s->exp_bits));
		s->exp_known = calloc(S, 1);
		s->exp_union = calloc(per, sizeof(*s->exp_union));
		s->exp_pick = calloc(S, 1);
		s->exp_pop = calloc(per * 64, sizeof(*s->exp_pop));
		s->exp_share = calloc(S, sizeof(*s->exp_share));
		s->exp_res = calloc(per, sizeof(*s->exp_res));
		s->exp_tmp = calloc(S, sizeof(*s->exp_tmp));
		if (!s->exp_bits || !s->exp_known || !s->exp_union || !s->exp_pick || !s->exp_tmp ||
		    !s->exp_pop || !s->exp_share || !s->exp_res) {
			md_sched_release(s);
			return -ENOMEM;
		}
	}
	return 0;
}

static void kv_drop(struct md_sched *s, struct md_seq *q)
{
	if (q->kv_seq >= 0) {
		/* its rows stay findable, the last partial block's too (kv_cache.h) */
		md_kv_prefix_register_tail(s->kv, q->kv_seq, q->toks,
					   q->n_kv < q->n_toks ? q->n_kv : q->n_toks);
		md_kv_seq_free(s->kv, q->kv_seq);
	}
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
	free(s->exp_bits);
	free(s->exp_known);
	free(s->exp_union);
	free(s->exp_pick);
	free(s->exp_pop);
	free(s->exp_share);
	free(s->exp_res);
	free(s->exp_tmp);
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
 * not fit blocks the ones behind it, so nothing starves. The free-block check counts the
 * whole sequence although a cached prefix may cover part of it: conservative, and simple. */
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
		/* All but the last token may come from the cache: its logits are needed. */
		uint32_t cached = md_kv_prefix_attach(s->kv, ks, q->toks, q->n_toks - 1);
		if (md_kv_reserve(s->kv, ks, q->n_toks)) {
			md_kv_seq_free(s->kv, ks);
			break;
		}
		s->waiting = q->next;
		s->n_waiting--;
		q->next = NULL;
		q->kv_seq = ks;
		q->n_kv = cached;
		if (q->admit_no == 0) { /* first admission: what the request's usage reports */
			q->n_cached = cached;
			s->stats.prefix_queries++;
			s->stats.prefix_hits += cached > 0;
		}
		s->stats.prefix_hit_tokens += cached;
		if (q->n_kv > q->n_kv_max)
			q->n_kv_max = q->n_kv;
		if (s->exp_known)
			s->exp_known[ks] = 0;
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

/* ---- expert-aware batching ---- */

static uint64_t *slot_bits(const struct md_sched *s, int kv_seq)
{
	return s->exp_bits + (size_t)kv_seq * s->cfg.n_layer * s->exp_words;
}

void md_sched_note_routing(struct md_sched *s, uint32_t layer, const struct md_routing *r)
{
	if (!s->exp_bits || layer >= s->cfg.n_layer)
		return;
	const struct md_plan *p = &s->plan;
	for (uint32_t i = 0; i < p->n_items; i++) {
		const struct md_plan_item *it = &p->items[i];
		uint32_t n_real = it->n_tok - it->n_draft;
		if (n_real == 0 || it->row + n_real > (uint32_t)r->n_tokens)
			continue;
		int ks = it->seq->kv_seq;
		uint64_t *b = slot_bits(s, ks) + (size_t)layer * s->exp_words;
		memset(b, 0, sizeof(*b) * s->exp_words);
		/* a prompt chunk that is not the last predicts the next chunk: all its tokens'
		 * experts; otherwise the last token predicts the next token */
		uint32_t first = it->n_logits == 0 ? 0 : n_real - 1;
		for (uint32_t t = first; t < n_real; t++) {
			const int32_t *ids = r->ids + (size_t)(it->row + t) * r->n_used;
			for (int j = 0; j < r->n_used; j++)
				if (ids[j] >= 0 && (uint32_t)ids[j] < s->cfg.n_expert)
					b[ids[j] / 64] |= 1ull << (ids[j] % 64);
		}
		if (layer == s->cfg.n_layer - 1)
			s->exp_known[ks] = 1;
	}
}

void md_sched_set_resident(struct md_sched *s, md_sched_resident_fn fn, void *arg)
{
	s->resident = fn;
	s->resident_arg = arg;
}

/* What the experts q would add to the union cost: one each, MD_SCHED_MISS_WEIGHT for those
 * not resident when residency is known; every expert when q's routing is unknown. */
static uint32_t added_experts(const struct md_sched *s, const struct md_seq *q)
{
	uint32_t miss_w = s->resident ? MD_SCHED_MISS_WEIGHT : 1;
	if (!s->exp_known[q->kv_seq])
		return s->cfg.n_layer * s->cfg.n_expert * miss_w;
	const uint64_t *b = slot_bits(s, q->kv_seq);
	uint32_t n = 0;
	for (size_t w = 0; w < (size_t)s->cfg.n_layer * s->exp_words; w++) {
		uint64_t add = b[w] & ~s->exp_union[w];
		if (s->resident)
			n += (uint32_t)__builtin_popcountll(add & s->exp_res[w]) +
			     miss_w * (uint32_t)__builtin_popcountll(add & ~s->exp_res[w]);
		else
			n += (uint32_t)__builtin_popcountll(add);
	}
	return n;
}

/* The residency bitmap of this step, from the caller's predicate. */
static void load_residency(struct md_sched *s)
{
	if (s->exp_res_step == s->step_no)
		return; /* loaded this step already */
	s->exp_res_step = s->step_no;
	memset(s->exp_res, 0, sizeof(*s->exp_res) * s->cfg.n_layer * s->exp_words);
	for (uint32_t l = 0; l < s->cfg.n_layer; l++)
		for (uint32_t e = 0; e < s->cfg.n_expert; e++)
			if (s->resident(s->resident_arg, l, e))
				s->exp_res[(size_t)l * s->exp_words + e / 64] |= 1ull << (e % 64);
}

/* How many decoders (counted in exp_pop) share q's experts, summed over them: the tie-break
 * that makes the first pick a sequence in the biggest cluster. */
static uint32_t shared_experts(const struct md_sched *s, const struct md_seq *q)
{
	if (!s->exp_known[q->kv_seq])
		return 0;
	const uint64_t *b = slot_bits(s, q->kv_seq);
	uint32_t n = 0;
	for (size_t w = 0; w < (size_t)s->cfg.n_layer * s->exp_words; w++)
		for (uint64_t x = b[w]; x; x &= x - 1)
			n += s->exp_pop[w * 64 + (uint32_t)__builtin_ctzll(x)];
	return n;
}

static void pop_add(struct md_sched *s, const struct md_seq *q)
{
	if (!s->exp_known[q->kv_seq])
		return;
	const uint64_t *b = slot_bits(s, q->kv_seq);
	for (size_t w = 0; w < (size_t)s->cfg.n_layer * s->exp_words; w++)
		for (uint64_t x = b[w]; x; x &= x - 1)
			s->exp_pop[w * 64 + (uint32_t)__builtin_ctzll(x)]++;
}

static void union_add(struct md_sched *s, const struct md_seq *q)
{
	if (!s->exp_known[q->kv_seq])
		return;
	const uint64_t *b = slot_bits(s, q->kv_seq);
	for (size_t w = 0; w < (size_t)s->cfg.n_layer * s->exp_words; w++)
		s->exp_union[w] |= b[w];
}

/* s->order holds the running sequences least recently served first. When more of them
 * decode than room allows, refill the decoders' places in that order with the chosen set
 * first (see DESIGN); prefilling sequences keep their places. */
static void select_by_experts(struct md_sched *s, uint32_t room)
{
	uint32_t n = s->n_running, n_dec = 0;
	for (uint32_t i = 0; i < n; i++)
		n_dec += is_decoding(s->order[i]);
	if (n_dec <= room)
		return;
	if (s->resident)
		load_residency(s);
	/* the age bound: as configured, or one step more than the fair order's longest wait */
	uint32_t age = s->cfg.expert_age ? s->cfg.expert_age : (n_dec + room - 1) / room;
	uint8_t *pick = s->exp_pick; /* pick[i]: order[i] is chosen */
	memset(pick, 0, n);
	memset(s->exp_union, 0, sizeof(*s->exp_union) * s->cfg.n_layer * s->exp_words);
	uint32_t chosen = 0;
	/* 1. the sequences that waited too long, oldest first */
	for (uint32_t i = 0; i < n && chosen < room; i++) {
		struct md_seq *q = s->order[i];
		if (is_decoding(q) && s->step_no - 1 - q->last_served >= age) {
			pick[i] = 1;
			union_add(s, q);
			chosen++;
		}
	}
	/* 2. greedily, the fewest experts added; ties (always at the first pick): the one whose
	 * experts most other decoders share, then least recently served */
	size_t n_bits = (size_t)s->cfg.n_layer * s->exp_words * 64;
	memset(s->exp_pop, 0, sizeof(*s->exp_pop) * n_bits);
	for (uint32_t i = 0; i < n; i++)
		if (!pick[i] && is_decoding(s->order[i]))
			pop_add(s, s->order[i]);
	for (uint32_t i = 0; i < n; i++)
		s->exp_share[i] = pick[i] || !is_decoding(s->order[i]) ? 0
			: shared_experts(s, s->order[i]);
	while (chosen < room) {
		int best = -1;
		uint32_t best_add = 0, best_share = 0;
		for (uint32_t i = 0; i < n; i++) {
			if (pick[i] || !is_decoding(s->order[i]))
				continue;
			uint32_t a = added_experts(s, s->order[i]);
			if (best >= 0 && a > best_add)
				continue;
			uint32_t sh = s->exp_share[i];
			if (best < 0 || a < best_add || sh > best_share) {
				best = (int)i;
				best_add = a;
				best_share = sh;
			}
		}
		if (best < 0)
			break;
		pick[best] = 1;
		union_add(s, s->order[best]);
		chosen++;
	}
	/* 3. refill the decoders' places: chosen first, then the others, each in order */
	struct md_seq **tmp = s->exp_tmp;
	uint32_t k = 0;
	for (int pass = 1; pass >= 0; pass--)
		for (uint32_t i = 0; i < n; i++)
			if (is_decoding(s->order[i]) && pick[i] == pass)
				tmp[k++] = s->order[i];
	k = 0;
	for (uint32_t i = 0; i < n; i++)
		if (is_decoding(s->order[i]))
			s->order[i] = tmp[k++];
	s->stats.expert_selections++;
}

/* When the step cannot hold every prefilling sequence's pending prompt, refill the places of
 * the prefillers that come after the first decoder in s->order (after select_by_experts) so
 * that the first ones are those whose next chunk adds the fewest experts to what the step's
 * decoders (the first room of them) and the prefillers ahead of them touch (see DESIGN).
 * Decoders, and prefillers that waited longer than every decoder, keep their places. */
static void order_prefill(struct md_sched *s, uint32_t room)
{
	uint32_t n = s->n_running, n_pre = 0, want = 0, fd = n;
	for (uint32_t i = 0; i < n; i++) {
		bool dec = is_decoding(s->order[i]);
		if (dec && fd == n)
			fd = i;
		n_pre += !dec && fd < i;
		want += pending(s->order[i]);
	}
	if (n_pre < 2 || want <= s->cfg.step_tokens)
		return;
	if (s->resident)
		load_residency(s);
	uint32_t age = s->cfg.expert_age ? s->cfg.expert_age : n_pre;
	uint8_t *pick = s->exp_pick; /* pick[i]: order[i] is placed; rank[k]: the k-th placed */
	uint32_t *rank = s->exp_share;
	memset(pick, 0, n);
	memset(s->exp_union, 0, sizeof(*s->exp_union) * s->cfg.n_layer * s->exp_words);
	/* what the step serves before these places: the prefillers in front, then the decoders
	 * (one token each, the common case) */
	for (uint32_t i = 0; i < fd; i++)
		union_add(s, s->order[i]);
	for (uint32_t i = fd, k = 0; i < n && k < room; i++)
		if (is_decoding(s->order[i])) {
			union_add(s, s->order[i]);
			k++;
		}
	uint32_t placed = 0;
	/* 1. prefillers that waited too long, in service order */
	for (uint32_t i = fd; i < n; i++) {
		struct md_seq *q = s->order[i];
		if (!is_decoding(q) && s->step_no - 1 - q->last_served >= age) {
			pick[i] = 1;
			rank[placed++] = i;
			union_add(s, q);
		}
	}
	/* 2. greedily, the fewest experts added; ties: service order */
	while (placed < n_pre) {
		int best = -1;
		uint32_t best_add = 0;
		for (uint32_t i = fd; i < n; i++) {
			if (pick[i] || is_decoding(s->order[i]))
				continue;
			uint32_t a = added_experts(s, s->order[i]);
			if (best < 0 || a < best_add) {
				best = (int)i;
				best_add = a;
			}
		}
		pick[best] = 1;
		rank[placed++] = (uint32_t)best;
		union_add(s, s->order[best]);
	}
	/* 3. refill those prefillers' places in the chosen order */
	struct md_seq **tmp = s->exp_tmp;
	for (uint32_t k = 0; k < n_pre; k++)
		tmp[k] = s->order[rank[k]];
	bool moved = false;
	for (uint32_t i = fd, k = 0; i < n; i++)
		if (!is_decoding(s->order[i])) {
			moved |= s->order[i] != tmp[k];
			s->order[i] = tmp[k++];
		}
	s->stats.prefill_selections += moved;
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
	if (s->exp_bits && s->cfg.expert_aware) {
		uint32_t room = s->cfg.step_tokens < s->cfg.max_logits ? s->cfg.step_tokens
									 : s->cfg.max_logits;
		select_by_experts(s, room);
		order_prefill(s, room);
	}

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
		/* Accepted drafts are appended after this: their tokens are not in toks yet. */
		md_kv_prefix_register(s->kv, q->kv_seq, q->toks,
				      q->n_kv < q->n_toks ? q->n_kv : q->n_toks);
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
