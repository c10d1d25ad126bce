/* Expert sources: where the forward pass gets each routed expert's weights from.
 *
 * The unit is one expert of one layer: its gate, up and down matrices. The forward pass asks
 * an md_expert_src for the experts the router chose and knows nothing else of where they
 * live. The default source returns views of the model's expert tensors (md_expert_src_map:
 * the mapping, or the model's merged buffer for files with per-expert tensors); the expert
 * store (host RAM / VRAM tiers fed from the file) is another implementation of the same ops
 * table (engine/experts.h).
 *
 * Contract, per MoE layer of one md_forward call, all on the thread that calls md_forward
 * (the engine thread; pool workers only read the returned weights, between get and release):
 *   1. plan(layer, experts, tokens, n, order): once, with the layer's active experts
 *      (ascending, distinct) and how many tokens are routed to each (tokens[i] for
 *      experts[i]), before any get of that layer. order (n entries) arrives as the identity
 *      0..n-1; the source may permute it: it is the order of the gets (indices into experts).
 *      The return value n_ready (0..n) says that the first n_ready experts of order are
 *      resident now (their gets will not block): the forward pass then computes those first,
 *      as one wave, and only then gets the others, so a fetch started here overlaps that
 *      compute. 0 or n: one wave. A source may start fetching every missing expert here.
 *      A negative return fails md_forward with that code (nothing held). Optional (NULL:
 *      identity order, one wave).
 *   2. get(layer, e, out): once per active expert, in plan's order. out's views must stay
 *      valid and unchanged until release(layer, e); all the layer's experts are held at once
 *      (up to min(n_expert, tokens * n_expert_used)). May block until the weights are
 *      resident. A negative return fails md_forward with that code, after the experts already
 *      got are released; or, for a batch with md_batch.tok_err, only the tokens routed to
 *      that expert (the forward pass gets the layer's other experts and goes on). Either way
 *      the failed expert is not released, and the source must be usable for the next plan.
 *   3. release(layer, e): once per successful get, after the layer's expert compute, in get
 *      order. The views are not used after it. Optional (NULL: views live as long as the
 *      source, which must outlive every forward context using it).
 *   prefetch(layer, experts, n): optional. Where the source has it, the forward pass
 *      predicts layer l+1's experts (pre-gating: layer l+1's router on the hidden state
 *      leaving layer l, engine/forward.c) and calls it once layer l is done, before layer
 *      l+1's attention, with the predicted experts (ascending, distinct). A hint: the source
 *      may start reading them; nothing is held, and the next plan of that layer says what
 *      was used.
 *   observe(dev, bytes, tok_bytes, seconds): optional. The forward pass reports how long
 *      each run of experts took: experts of bytes weight bytes in all, tok_bytes the sum of
 *      each one's bytes times its tokens, on the device (dev) or the CPU; the source may
 *      learn compute rates from it (the store's cost model, engine/expert_cost.h).
 *   resident(layer, e): optional. Whether the expert's weights are in fast memory now, so a
 *      get would not wait for a read (a self-speculation draft pass routes among those only,
 *      engine/forward.h). Asks, holds nothing. Without it every expert counts as resident.
 * Weights of one layer's experts may differ in type; views of one expert must have gate and
 * up of the same shape (n_embd -> n_ff_exp) and down (n_ff_exp -> n_embd). */
#ifndef MD_EXPERT_SRC_H
#define MD_EXPERT_SRC_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/backend.h"
#include "engine/kern/matmul.h"
#include "engine/model.h"

/* Weights of one expert of one layer. */
struct md_expert_w {
	struct md_mat gate; /* (n_embd -> n_ff_exp), data borrowed from the source */
	struct md_mat up;   /* (n_embd -> n_ff_exp) */
	struct md_mat down; /* (n_ff_exp -> n_embd) */
	struct md_backend *dev; /* borrowed: NULL when the data is host memory; else device
				 * memory of this backend, and the forward pass computes the
				 * expert with dev->matmul (its copy fence has passed) */
};

/* Bytes of an expert's three matrices. */
static inline uint64_t md_expert_w_bytes(const struct md_expert_w *x)
{
	return (uint64_t)x->gate.nb1 * (uint64_t)x->gate.n_out +
	       (uint64_t)x->up.nb1 * (uint64_t)x->up.n_out +
	       (uint64_t)x->down.nb1 * (uint64_t)x->down.n_out;
}

struct md_expert_src;

struct md_expert_src_ops {
	const char *name; /* "mmap", for logs */
	int (*plan)(struct md_expert_src *src, uint32_t layer, const int32_t *experts,
		    const int32_t *tokens, int n, int32_t *order);
	int (*get)(struct md_expert_src *src, uint32_t layer, int32_t expert,
		   struct md_expert_w *out);
	void (*release)(struct md_expert_src *src, uint32_t layer, int32_t expert);
	void (*prefetch)(struct md_expert_src *src, uint32_t layer, const int32_t *experts, int n);
	void (*observe)(struct md_expert_src *src, bool dev, uint64_t bytes, uint64_t tok_bytes,
			double seconds);
	bool (*resident)(struct md_expert_src *src, uint32_t layer, int32_t expert);
};

/* Embed as the first member of an implementation's struct (the ops receive this pointer). */
struct md_expert_src {
	const struct md_expert_src_ops *ops; /* borrowed: static */
};

/* order: n entries, filled with the identity before the source may permute it; tokens may
 * be NULL (one each). Returns n_ready (0..n) or a negative code. */
static inline int md_expert_src_plan(struct md_expert_src *s, uint32_t layer,
				     const int32_t *experts, const int32_t *tokens, int n,
				     int32_t *order)
{
	for (int i = 0; i < n; i++)
		order[i] = i;
	return s->ops->plan ? s->ops->plan(s, layer, experts, tokens, n, order) : n;
}

static inline int md_expert_src_get(struct md_expert_src *s, uint32_t layer, int32_t expert,
				    struct md_expert_w *out)
{
	return s->ops->get(s, layer, expert, out);
}

static inline void md_expert_src_prefetch(struct md_expert_src *s, uint32_t layer,
					  const int32_t *experts, int n)
{
	if (s->ops->prefetch)
		s->ops->prefetch(s, layer, experts, n);
}

static inline bool md_expert_src_resident(struct md_expert_src *s, uint32_t layer, int32_t expert)
{
	return s->ops->resident ? s->ops->resident(s, layer, expert) : true;
}

static inline void md_expert_src_release(struct md_expert_src *s, uint32_t layer, int32_t expert)
{
	if (s->ops->release)
		s->ops->release(s, layer, expert);
}

/* The default source: views of the model's 3-D expert tensors (md_mat_of), which live in
 * the mapping or in a buffer the model owns. get never fails for a layer < n_layer and an
 * expert < n_expert of an MoE model (-EINVAL otherwise); views stay valid while the model is
 * loaded; no plan, no release. */
struct md_expert_src_map {
	struct md_expert_src base;
	const struct md_model *m; /* borrowed: outlives the source */
};

void md_expert_src_map_init(struct md_expert_src_map *s, const struct md_model *m);

#endif
