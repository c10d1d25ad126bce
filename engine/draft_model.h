/* The draft-model drafter: a second, smaller model with the target's vocabulary, its own KV
 * cache and forward context, run by the engine thread before each step, batched across
 * sequences. */
#ifndef MD_DRAFT_MODEL_H
#define MD_DRAFT_MODEL_H

/*
 * DESIGN
 * md_draft_propose drafts k_i tokens for each of n sequences in k_max rounds of one batched
 * forward pass each:
 *   round 0   every sequence feeds what its draft KV lacks (toks[n_dkv .. n_toks): after the
 *             first time, the last emitted token plus the drafts it accepted that the draft had
 *             not seen, usually 1-2 tokens; the whole prompt once) and gets logits for its last;
 *   round r   sequences with k_i > r feed their draft r-1 and get the next logits.
 * The draft at each position is taken from q, the draft's logits through the request's own
 * transforms and filters (md_sampler_transform/_dist_build with the history extended by the
 * drafts so far): its argmax when greedy (a point mass; the verification is then the plain
 * draw), else a draw from q with the sequence's draft RNG, with q kept for the min(1, p/q)
 * test (engine/spec.h).
 *
 * The draft KV keeps toks[dkv_base..n_toks) plus the drafts fed (k_i - 1); the next call keeps
 * the prefix that still agrees with toks (the accepted drafts) and truncates the rest. When
 * more than MD_DRAFT_CATCHUP tokens are missing (a long prompt, or a sequence the controller
 * kept from drafting for a while) the draft restarts on the last MD_DRAFT_WINDOW tokens only:
 * a draft needs no exact context (verification keeps the output exact), and catching up on
 * everything would make each probe after a pause cost a prefill of the draft. A sequence
 * whose catch-up does not fit the round's token budget, or whose KV cannot be reserved,
 * gets no drafts this step (k_i = 0): drafting is an optimisation and never fails a request.
 *
 * The draft's forward context shares the target's thread pool (md_forward_share_pool).
 * Ownership: everything here is owned by the struct; sequences are borrowed for the call.
 * Engine thread only.
 */

#include <stdbool.h>
#include <stdint.h>

#include "engine/backend.h"
#include "engine/forward.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/sched.h"
#include "engine/spec_ctl.h"

#define MD_DRAFT_CATCHUP 96
#define MD_DRAFT_WINDOW 64

struct md_draft_model {
	struct md_model model;       /* owned */
	bool loaded, kv_ready;
	struct md_forward_ctx *fw;   /* owned; its pool borrowed from the target's context */
	struct md_fwd_dev *fdev;     /* owned: its forward pass on the target's device, NULL:
				      * on the CPU (md_draft_set_device) */
	struct md_kv_cache kv;       /* owned: one slot per running sequence at most */
	uint32_t n_vocab, budget;    /* budget: tokens in one draft forward pass */
	float *logits;               /* owned (max_seqs, n_vocab) */
	int32_t *tok, *seq, *pos;    /* owned (budget): one round's batch */
	bool *want;                  /* owned (budget) */
	struct md_seq **row_seq;     /* owned (max_seqs): the sequence of each logits row */
	uint32_t max_seqs;
	struct md_sampler sm;        /* owned: transform and filter scratch (its RNG unused) */
	struct md_spec_rounds rounds; /* times of its rounds by the tokens they feed (one per
				      * drafting sequence, more in a round 0 that catches
				      * sequences up); the controller reads it */
};

/*
 * Load the draft GGUF at path for a target model (vocabulary compared token by token when both
 * files carry one, else by size) and set up its KV cache (up to kv_mb MiB, at least one full
 * context of n_ctx), its forward context on target_fw's pool and its buffers. Returns 0, or a
 * negative code with one line in err (the file, and why it cannot serve as a draft).
 */
int md_draft_load(struct md_draft_model *dm, const char *path, const struct md_model *target,
		  struct md_forward_ctx *target_fw, int n_threads, uint32_t max_seqs,
		  uint32_t n_ctx, uint32_t budget, uint32_t kv_mb, char *err, size_t errlen);
/* Run the draft model's passes on device b too (its weights uploaded, its KV cache mirrored,
 * engine/forward_dev.h), as the target's run there. Returns 0, or a negative code with the
 * reason in err (the draft then stays on the CPU). */
int md_draft_set_device(struct md_draft_model *dm, struct md_backend *b, char *err, size_t errlen);
/* Free everything; sequences must have released their draft KV slots first. */
void md_draft_release(struct md_draft_model *dm);

/*
 * Draft for seqs[0..n): k[i] tokens each (reduced where they cannot be drafted; 0 means none),
 * into seqs[i]->spec (draft, n_draft, draft_q, q). Every sequence must be decoding and have
 * room for k[i] scratch tokens after toks[n_toks). Returns 0, or a negative code from the
 * forward pass (then no sequence has drafts).
 */
int md_draft_propose(struct md_draft_model *dm, struct md_seq **seqs, uint32_t *k, uint32_t n);
/* The tokens md_draft_propose's round 0 would feed for s now (its catch-up, the last token
 * included: 1 when the draft has seen everything before it). s must have a drafter state. */
uint32_t md_draft_catchup_rows(const struct md_seq *s);

/*
 * The draft at position r (0-based after toks[n_toks)) of s from a drafter's logits row
 * (n_vocab floats), as DESIGN says: the row through the request's transforms and filters with
 * the history extended by the drafts before r, then its argmax (greedy) or a draw with the
 * sequence's draft RNG, q kept in s->spec->q[r] for the verification. sm: the drafter's
 * scratch sampler (its RNG unused). Returns 0 or a negative code (-ENOMEM, -EDOM).
 */
int md_draft_pick(struct md_sampler *sm, uint32_t n_vocab, struct md_seq *s, uint32_t r,
		  const float *row);

#endif
