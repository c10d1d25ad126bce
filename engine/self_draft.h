/* The self-speculation drafter: the target model itself, made cheaper, drafting into the
 * target's own KV cache. */
#ifndef MD_SELF_DRAFT_H
#define MD_SELF_DRAFT_H

/*
 * DESIGN
 * A draft pass is the target's forward pass with fewer active experts per token (n_used,
 * default 1), with only the experts the expert store holds when it is on (no draft ever
 * waits for a read), and optionally some layers skipped (engine/forward.h
 * md_forward_draft). md_self_draft_propose drafts k_i tokens for each of n decoding
 * sequences in max k_i rounds of one batched draft pass each: round 0 feeds each sequence's
 * pending token (toks[n_kv], at position n_kv) and takes draft 0 from its logits; round r
 * feeds draft r-1 at n_kv + r. Drafts are picked as the draft model's are
 * (md_draft_pick: the request's transforms and filters, argmax when greedy, else a draw kept
 * as q for the min(1, p/q) test), so verification stays exact.
 *
 * The KV cache. The draft's K/V are the target's own: round r writes the draft pass's rows at
 * position n_kv + r of the sequence's slot, and later rounds attend to them (they are the
 * draft's approximation of the context it drafts from; positions below n_kv are the exact
 * rows). After the last round every sequence is truncated back to n_kv (md_kv_truncate), so
 * the scheduler sees the cache as it was; the verification step then feeds toks[n_kv] and the
 * k drafts at n_kv .. n_kv + k and its exact pass overwrites every one of those rows, layer
 * by layer, before any attention of that layer reads them (engine/forward.c writes a layer's
 * rows for the whole batch first). Rows of skipped layers are not written by a draft pass
 * and not read by the next one (same skips). So nothing of a draft survives into the exact
 * KV: rejected drafts need no further rollback than the scheduler's usual one.
 *
 * Prefetch. Where the experts come from the expert store, each draft pass also notes what the
 * exact pass would route its tokens to (the model's own top-k on the draft's router scores)
 * and after the rounds the store is asked to prefetch those experts per layer
 * (md_expert_src_prefetch): the verification step's experts start arriving while the step
 * is planned, and its own pre-gating takes over from there.
 *
 * A sequence whose positions cannot be reserved gets no drafts (k_i = 0): drafting is an
 * optimisation and never fails a request. Ownership: buffers owned here; the forward
 * context, KV cache and expert source are the engine's (borrowed). Engine thread only.
 */

#include <stdbool.h>
#include <stdint.h>

#include "engine/expert_src.h"
#include "engine/forward.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/sched.h"
#include "engine/spec_ctl.h"

struct md_self_draft {
	bool ready;
	struct md_forward_ctx *fw;   /* borrowed: the target's */
	struct md_kv_cache *kv;      /* borrowed: the target's */
	struct md_expert_src *src;   /* borrowed, NULL: experts from the mapping (no prefetch) */
	struct md_forward_draft mode;
	uint8_t *skip;               /* owned (n_layer) */
	uint8_t *predict;            /* owned (n_layer * n_expert): the exact pass's likely experts */
	int32_t *plist;              /* owned (n_expert): one layer's experts to prefetch */
	uint32_t n_layer, n_expert, n_vocab, budget, max_seqs;
	float *logits;               /* owned (max_seqs, n_vocab) */
	int32_t *tok, *seq, *pos;    /* owned (max_seqs): one round's batch */
	bool *want;                  /* owned (max_seqs) */
	struct md_seq **row_seq;     /* owned (max_seqs) */
	struct md_sampler sm;        /* owned: transform and filter scratch (its RNG unused) */
	struct md_spec_rounds rounds; /* its rounds' times by rows (the controller reads it) */
	uint64_t prefetched;         /* experts handed to the source's prefetch */
	bool predicted;              /* predict holds the last propose's prediction, not taken */
};

/*
 * Set up self-speculation for model m on the engine's forward context and KV cache: draft
 * passes route n_used experts per token (0: 1) and skip the layers listed in skip (a comma
 * list of layer indices, NULL or "" for none). Returns 0, or -EINVAL with one line in err
 * (a dense model with nothing skipped: the draft would be the model; every layer skipped; a
 * bad list), or -ENOMEM.
 */
int md_self_draft_init(struct md_self_draft *sd, const struct md_model *m,
		       struct md_forward_ctx *fw, struct md_kv_cache *kv, uint32_t n_used,
		       const char *skip, uint32_t max_seqs, char *err, size_t errlen);
void md_self_draft_release(struct md_self_draft *sd);

/* Experts come from src (the expert store): draft passes use only its resident experts and
 * prefetch what verification will likely need. NULL: the mapping. */
void md_self_draft_set_src(struct md_self_draft *sd, struct md_expert_src *src);

/*
 * Draft for seqs[0..n): k[i] tokens each (reduced to 0 where a sequence cannot draft now),
 * into seqs[i]->spec (draft, n_draft, draft_q, q). Every sequence must be decoding
 * (n_toks == n_kv + 1) with room for k[i] scratch tokens after toks[n_toks). Leaves every
 * sequence's KV length at n_kv. Returns 0, or a negative code from a draft pass (then no
 * sequence has drafts).
 */
int md_self_draft_propose(struct md_self_draft *sd, struct md_seq **seqs, uint32_t *k,
			  uint32_t n);

/* Whether the last propose predicted (and prefetched) the experts of the step that follows
 * it; true once per such propose. */
bool md_self_draft_take_prediction(struct md_self_draft *sd);
/* The prediction for layer l (n_expert flags), valid until the next propose. */
const uint8_t *md_self_draft_predicted(const struct md_self_draft *sd, uint32_t l);

#endif
