/* The scheduler: sequences, the waiting and running lists, admission, preemption, step plans. */
#ifndef MD_SCHED_H
#define MD_SCHED_H

/*
 * DESIGN
 * The scheduler decides, once per engine step, which tokens of which sequences go into the
 * next forward pass; it never runs the model. A step is a plan/commit pair:
 *
 *   md_sched_plan    admits waiting sequences (FIFO, while a slot and KV blocks for the whole
 *                    pending prompt are free), reserves KV positions for what it schedules
 *                    (preempting the youngest sequence when a running one cannot grow), and
 *                    writes the batch: tokens, KV slots, positions, which rows want logits,
 *                    and one md_plan_item per participating sequence (its token count and how
 *                    many logits rows it gets: one today, 1 + drafted tokens for speculation);
 *   md_sched_commit  after the forward pass: the scheduled tokens are now in the KV cache;
 *                    per item, how many drafted tokens were accepted (the rest roll back).
 *
 * The caller then samples each item's logits rows and appends tokens (md_sched_append) or
 * removes finished sequences (md_sched_remove), which hands them back to the caller.
 *
 * Fairness: every sequence carries the step it was last served in. A step walks the running
 * sequences least recently served first (admission order on ties): a decoding sequence takes
 * one token (plus its drafts), a prefilling one a chunk of what is left of the budget. When
 * the budget covers everyone (the usual case) every decoder gets its token each step and
 * prefill takes the rest, oldest admission first; when it does not (more decoders than
 * budget), whoever was skipped goes first next step, so no stream waits on the others'
 * completion. The rejected alternative, decoders always first in admission order, starved
 * every sequence past the budget until the ones in front had finished.
 *
 * Prefix cache (when the KV cache has it on): admission attaches the longest cached run of
 * whole blocks of the sequence's tokens, all but the last token (whose logits are needed), and
 * the sequence starts computing after it; every commit registers the sequence's newly full
 * blocks, prompt and generated tokens alike, so a later turn of a conversation, a retry, or a
 * preempted sequence coming back finds them.
 * Expert-aware batching (cfg.n_layer/n_expert set and cfg.expert_aware): when more sequences
 * decode than the step has room for, the step takes the set that touches the fewest distinct
 * experts, predicted from each sequence's last routed token (md_sched_note_routing keeps, per
 * KV slot, a bitmap of its last token's experts at every MoE layer; a trained router's next
 * choices overlap its last ones, and sequences on one topic route alike). Greedy: first every
 * sequence that has skipped A steps or more (oldest first), A = md_sched_config.expert_age or
 * by default ceil(decoders / room), one more than the fair order's longest skip, so in steps
 * that serve decoders nothing waits much longer than A + ceil(decoders / room); then, one at a time, the sequence that adds the fewest experts to the union (ties:
 * the one whose experts most other decoders share, so the first pick lands in the biggest
 * cluster; then least recently served; a sequence with no routing yet counts as adding every
 * expert). The chosen ones take the decoders' first places in the service order, the rest
 * follow; prefilling sequences keep their places. With room for everyone (the usual case)
 * nothing changes. Under an expert cache (md_sched_set_resident) only misses cost reads: an
 * added expert that is not resident counts MD_SCHED_MISS_WEIGHT, a resident one 1, so the
 * step prefers sequences whose experts are already in fast memory. Rejected: the exact
 * minimum (set cover, exponential) and clustering by topic (needs a model of topics; the
 * bitmaps are that model).
 * Prompt chunks are ordered likewise when the step cannot hold every prefilling sequence's
 * pending prompt: a prompt chunk that is not its prompt's last leaves, as its sequence's
 * prediction, the union of its tokens' experts (the next chunk of the same text routes
 * alike). The places of the prefillers behind the first decoder in the service order are
 * refilled with, first, those that skipped A steps or more (A = expert_age or by default the
 * number of them), then one at a time the one whose next chunk adds the fewest experts
 * (misses weighted as above) to the union of what goes before it: the prefillers in front,
 * the step's decoders, the prefillers placed already; ties and sequences with no routing yet
 * (a first chunk) keep service order. Prefillers in front of every decoder (they waited
 * longest) and the decoders keep their places. Rejected: reordering every prefiller's place.
 * It continued a prompt under way before any other (first tokens 0.88x sooner at the median
 * on moe64-2g under a 1400 MiB limit, 64 streams), but the prompts kept waiting drifted to
 * the front of the order, ahead of the decoders, and the chunk served there took the whole
 * step: p99 inter-token latency 1.31x, for no fewer bytes read.
 * Preemption by recompute: a preempted sequence frees its KV and returns to the front of the
 * queue; its generated tokens become part of what it prefills when readmitted, its sampler
 * state stays. Tokens computed again are counted as recomputed, not as prompt tokens.
 *
 * Ownership: the scheduler owns every sequence on its lists; md_sched_remove and
 * md_sched_cancel hand one back. It borrows the KV cache. Engine thread only.
 */

#include <stdbool.h>
#include <stdint.h>

#include "common/assert.h"
#include "engine/engine.h"
#include "engine/kv_cache.h"
#include "engine/router.h"
#include "engine/sampler.h"
#include "engine/spec.h"

/* One request in the engine: its tokens and where it stands. */
struct md_seq {
	struct md_engine_req *req;  /* owned: prompt, sampling, limits, preallocated DONE event */
	int32_t *toks;              /* owned: prompt then generated tokens, (cap) */
	uint32_t n_toks, cap;       /* cap = min(n_prompt + max_tokens, n_ctx) + 1 */
	uint32_t n_prompt;
	uint32_t n_kv;              /* tokens whose K/V are in the cache */
	uint32_t n_kv_max;          /* most tokens ever in the cache (recompute accounting) */
	uint32_t n_gen;
	uint32_t n_cached;          /* prompt tokens its first admission took from the prefix cache */
	const int32_t *draft;       /* borrowed until commit: tokens proposed after toks, or NULL */
	uint32_t n_draft;
	int kv_seq;                 /* KV sequence slot, -1 while waiting */
	uint64_t admit_no;          /* order of (re)admission */
	uint64_t last_served;       /* step number this sequence last had tokens in */
	struct md_sampler sm;
	struct md_spec_seq *spec;   /* owned: speculation state (engine/spec.h), NULL: none */
	struct md_seq *next;        /* waiting list link */
};

/* Create a sequence for r (taking ownership of r only on success). n_ctx bounds its length,
 * n_vocab sizes its sampler. Returns NULL when out of memory. */
struct md_seq *md_seq_new(struct md_engine_req *r, uint32_t n_ctx, uint32_t n_vocab,
			  uint64_t seed);
/* Free a sequence that is on no list (its KV must already be released) and its request. */
void md_seq_free(struct md_seq *s);

struct md_sched_config {
	uint32_t max_seqs;     /* sequences running at once */
	uint32_t step_tokens;  /* tokens in one forward pass */
	uint32_t n_ctx;        /* longest sequence */
	uint32_t max_logits;   /* logits rows in one step; 0 = max_seqs (drafts are trimmed to
				  fit: the caller's logits buffer has this many rows) */
	/* Expert-aware batching (see DESIGN); off when n_layer or n_expert is 0. */
	uint32_t n_layer, n_expert;
	bool expert_aware;
	uint32_t expert_age;   /* steps a sequence may skip before it must go; 0: one more than
				  the fair order's longest skip, ceil(decoders / room) */
};

/* What one sequence contributes to a step: n_tok tokens at batch rows [row, row + n_tok),
 * and its last n_logits rows want logits (0 while a prompt chunk is not the last). */
struct md_plan_item {
	struct md_seq *seq;    /* borrowed: valid until it is removed */
	uint32_t row, n_tok, n_logits;
	uint32_t n_draft;      /* drafted tokens among the n_tok (the last ones) */
};

/* A step's batch, in the arrays md_forward takes. Buffers are owned by the scheduler and
 * valid until the next plan. */
struct md_plan {
	uint32_t n_tokens;
	int32_t *tokens, *seq, *pos;   /* (step_tokens) */
	bool *want_logits;             /* (step_tokens) */
	struct md_plan_item *items;    /* (max_seqs) in batch order */
	uint32_t n_items;
	uint32_t n_logits;             /* logits rows, in item order */
	uint32_t n_prompt, n_recompute, n_decode; /* tokens by kind, for statistics */
	struct md_seq *failed;         /* owned by the caller after plan: sequences that can
					  never fit (prompt beyond the KV pool), list via next */
};

/* Is expert e of layer l resident in fast memory? Asked for every (layer, expert) once per
 * step that selects by experts. */
typedef bool (*md_sched_resident_fn)(void *arg, uint32_t layer, uint32_t expert);

struct md_sched_stats {
	uint64_t steps, preemptions;
	uint64_t prompt_tokens;       /* prompt tokens computed the first time */
	uint64_t recomputed_tokens;   /* tokens computed again after a preemption */
	uint64_t gen_tokens;          /* decode tokens (one per generated token fed back) */
	uint64_t prefix_queries;      /* admissions that looked up the prefix cache */
	uint64_t prefix_hits;         /* ... and attached at least one block */
	uint64_t prefix_hit_tokens;   /* positions attached instead of computed */
	uint64_t expert_selections;   /* steps whose decoders were chosen by their experts */
	uint64_t prefill_selections;  /* steps whose prompt chunks were reordered by experts */
};

struct md_sched {
	struct md_sched_config cfg;
	struct md_kv_cache *kv;        /* borrowed */
	struct md_seq *waiting;        /* owned: FIFO */
	struct md_seq **running;       /* owned (max_seqs), admission order */
	uint32_t n_running, n_waiting;
	uint64_t admit_counter, step_no;
	struct md_plan plan;
	struct md_seq **order;         /* owned (max_seqs): scratch for the service order */
	uint64_t *exp_bits;            /* owned (max_seqs * n_layer * exp_words): per KV slot, the
					  experts of its last routed token at each layer */
	uint8_t *exp_known;            /* owned (max_seqs): the slot has routing since admission */
	uint64_t *exp_union;           /* owned (n_layer * exp_words): selection scratch */
	uint8_t *exp_pick;             /* owned (max_seqs): selection scratch */
	uint32_t *exp_pop;             /* owned (n_layer * exp_words * 64): decoders per expert */
	uint32_t *exp_share;           /* owned (max_seqs): selection scratch */
	uint64_t *exp_res;             /* owned (n_layer * exp_words): resident experts, per step */
	md_sched_resident_fn resident; /* NULL: residency unknown */
	uint64_t exp_res_step;         /* the step exp_res was loaded for */
	void *resident_arg;            /* borrowed */
	struct md_seq **exp_tmp;       /* owned (max_seqs): selection scratch */
	uint32_t exp_words;            /* 64-bit words per layer bitmap */
	struct md_sched_stats stats;
	struct md_thread_owner owner;  /* the engine thread, once it claims it */
};

/* Returns 0, -EINVAL (zero limits) or -ENOMEM. */
int md_sched_init(struct md_sched *s, const struct md_sched_config *cfg, struct md_kv_cache *kv);
/* Frees every sequence still on the lists. */
void md_sched_release(struct md_sched *s);

/* Queue a new sequence at the back. */
void md_sched_enqueue(struct md_sched *s, struct md_seq *q);
/* Take the sequence of request id off whichever list holds it (its KV freed) and hand it
 * back; NULL when unknown. */
struct md_seq *md_sched_cancel(struct md_sched *s, uint64_t id);
/* Take the next sequence off the lists (waiting first, then running, KV freed); NULL when
 * both are empty. For shutdown and engine errors. */
struct md_seq *md_sched_pop_any(struct md_sched *s);

/* Plan the next step into s->plan (see DESIGN). Returns the number of tokens (0: nothing to
 * run). Sequences that can never be admitted are moved to plan->failed. */
uint32_t md_sched_plan(struct md_sched *s);
/* The forward pass of the plan succeeded: advance each item's KV length by its tokens, less
 * the drafted tokens it did not accept (accepted: per item, NULL = all). */
void md_sched_commit(struct md_sched *s, const uint32_t *accepted);

/* Where experts live, for expert-aware batching (md_sched_resident_fn above); NULL (the
 * default): all alike. arg is borrowed until replaced. */
void md_sched_set_resident(struct md_sched *s, md_sched_resident_fn fn, void *arg);

#define MD_SCHED_MISS_WEIGHT 8 /* a miss reads megabytes; a resident expert only computes */

/* Record one MoE layer's routing of the current plan (call between md_sched_plan and
 * md_sched_commit, from the forward pass's route observer): each item's last real token's
 * experts become its sequence's prediction at that layer. No-op unless expert-aware batching
 * is configured. */
void md_sched_note_routing(struct md_sched *s, uint32_t layer, const struct md_routing *r);

/* Append a sampled token to a running sequence (room is guaranteed while n_toks < cap). */
void md_sched_append(struct md_sched *s, struct md_seq *q, int32_t token);
/* Take a running sequence off the running list (its KV freed) and hand it back. */
void md_sched_remove(struct md_sched *s, struct md_seq *q);

static inline uint32_t md_sched_n_waiting(const struct md_sched *s)
{
	return s->n_waiting;
}

static inline uint32_t md_sched_n_running(const struct md_sched *s)
{
	return s->n_running;
}

#endif
