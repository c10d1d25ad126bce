/* The batched forward pass: a micro-batch of tokens from many sequences at their positions. */
#ifndef MD_FORWARD_H
#define MD_FORWARD_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/expert_src.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "engine/router.h"

/* One micro-batch. Tokens of one sequence must appear in increasing, contiguous positions,
 * starting at that sequence's current KV length. */
struct md_batch {
	int32_t n_tokens;
	const int32_t *tokens;   /* (n_tokens) */
	const int32_t *seq;      /* (n_tokens) KV sequence ids */
	const int32_t *pos;      /* (n_tokens) positions */
	const bool *want_logits; /* (n_tokens), NULL: the last token of each sequence */
	int32_t *tok_err;        /* (n_tokens) out, or NULL. Where given, an expert whose
				  * weights the source cannot get (a read error) fails only the
				  * tokens routed to it: md_forward writes every entry, 0 or the
				  * get's error code, counts that expert's output as zero for those
				  * tokens and goes on (their later layers and logits are garbage, the
				  * other tokens' results are exact). NULL: md_forward fails with the
				  * code instead. A sequence is only as good as its worst token: the
				  * caller fails every sequence with a token marked. */
};

struct md_forward_ctx; /* opaque: scratch buffers, thread pool, router */

/* A context for batches of up to max_tokens tokens on n_threads threads (the caller's
 * included). Experts come from the model's tensors until md_forward_set_expert_src. NULL on
 * bad sizes or no memory. */
struct md_forward_ctx *md_forward_new(const struct md_model *m, int n_threads, int max_tokens);
void md_forward_free(struct md_forward_ctx *f);
/* Run f's batches on owner's thread pool (same thread count) instead of its own, which is
 * freed: two contexts used by one thread in turn (a draft model beside the target) then do not
 * keep two sets of workers spinning against each other. owner must outlive f's use. */
void md_forward_share_pool(struct md_forward_ctx *f, struct md_forward_ctx *owner);
/* The thread pool f's batches run on (to time a pass: md_spec_watch). */
const struct md_pool *md_forward_pool(const struct md_forward_ctx *f);

/* Where routed experts' weights come from (contract in engine/expert_src.h); NULL restores
 * the default, views of the model's tensors. src is borrowed: it must outlive f or be
 * replaced first. The shared expert (Qwen2-MoE) is always read from the model's tensors. */
void md_forward_set_expert_src(struct md_forward_ctx *f, struct md_expert_src *src);

/* Observer of every MoE layer's routing: called on md_forward's thread after the layer's
 * router ran and before its experts are fetched, with the routing (valid only during the
 * call; read-only). Token indices are batch rows. NULL clears it. */
typedef void (*md_forward_route_cb)(void *ud, uint32_t layer, const struct md_routing *r);
void md_forward_set_route_cb(struct md_forward_ctx *f, md_forward_route_cb cb, void *ud);
/* Observer of pre-gating: after each MoE layer of an exact pass, the routing that layer
 * layer + 1's router picks on the residual stream leaving it (what a prefetching expert source
 * is told to read ahead, engine/forward.c prefetch_next), with layer = the layer predicted.
 * Set, it makes the forward pass compute that prediction even for a source that does not
 * prefetch (one router matmul per layer). Same thread and lifetime rules as route_cb. */
void md_forward_set_pregate_cb(struct md_forward_ctx *f, md_forward_route_cb cb, void *ud);

/*
 * A draft pass (self-speculation, engine/self_draft.h): the same model made cheaper. While
 * set, md_forward routes each token to n_used experts (1..the model's k; 0: the model's k),
 * only among the experts the expert source has resident when resident_only (its resident
 * op; all of them where it has none, or fewer than n_used are resident), skips the layers
 * with skip[l] != 0 entirely (their K/V rows at the batch's positions are not written: a
 * later pass of the same skips never reads them, and the exact pass writes them), and ORs
 * into predict (when not NULL) what the exact pass would route each token to: the model's
 * own top-k on the same scores, predict[l * n_expert + e] = 1. The route observer is not
 * called (it describes exact passes). K/V rows written are the draft's, committed as usual:
 * the caller rolls them back (md_kv_truncate) before the exact pass rewrites those positions.
 * NULL (the default) restores exact passes. d and what it points to are borrowed until then.
 */
struct md_forward_draft {
	uint32_t n_used;
	const uint8_t *skip;    /* (n_layer) or NULL */
	bool resident_only;
	uint8_t *predict;       /* (n_layer * n_expert) or NULL */
};
void md_forward_set_draft(struct md_forward_ctx *f, const struct md_forward_draft *d);

/* Run every later batch on a device (engine/forward_dev.h) instead of the CPU: md_forward
 * keeps its contract, with the expert source, draft mode and observers set here. dev is
 * borrowed (NULL: back to the CPU) and must have been made for the cache the batches use. */
struct md_fwd_dev;
void md_forward_set_device(struct md_forward_ctx *f, struct md_fwd_dev *dev);

/* Run the batch. Validates it against kv (md_kv_batch_begin: live sequences, positions
 * contiguous from each sequence's length and reserved), writes K/V, and once every layer ran
 * commits each sequence's new length (md_kv_commit). Logits of each token with want_logits
 * (in batch order, n_vocab floats each) go to logits. Returns the number of logit rows
 * written or a negative code: -EINVAL (malformed batch), -ENOSPC (positions not reserved, or
 * no block for a copy-on-write), -ENOMEM, or an expert source's error (a plan's or a device's
 * always; a get's only without tok_err). On failure no length moves; shared blocks the batch
 * would have written may have been copied (same contents). */
int md_forward(struct md_forward_ctx *f, struct md_kv_cache *kv, const struct md_batch *b,
	       float *logits);

#endif
