/* The forward pass on a device: weights, activations and a mirror of the KV cache in device
 * memory, computed through a backend's device ops (engine/backend_fwd.h).
 *
 * DESIGN
 * A device forward context is made once for a model, a backend with device ops (CUDA, or the
 * simulated device in tests) and the engine's KV cache, and attached to the CPU forward
 * context with md_forward_set_device: from then on md_forward runs every batch here, with the
 * same contract (engine/forward.h), so the engine, the scheduler, speculation and the self
 * draft keep calling md_forward. What stays on the host:
 *   - the KV cache's bookkeeping (block tables, reference counts, the prefix cache): the
 *     device holds a mirror of the pool's rows, block for block, and copies a block on the
 *     device whenever the host cache copies one (md_kv_set_copy_hook);
 *   - token embeddings (one row per token: dequantized on the host and uploaded; the table
 *     stays in host memory);
 *   - routing, where experts come from a source or a draft pass restricts them: each MoE
 *     layer's router logits are downloaded and routed by engine/router.c, the expert layout
 *     uploaded back (with resident experts the device routes, as router.c does, and passes of
 *     up to 64 tokens run as graphs; the route observers get the routings after the pass);
 *   - experts that live in host memory: with experts_resident the context uploads every
 *     expert at creation and needs nothing else; without, experts come from the pass's
 *     expert source (the mapping, or the expert store whose device tier holds the hot ones),
 *     device-resident ones run on the device and the others on the CPU (the store's cost
 *     model has already chosen, per expert and step, between uploading and computing where
 *     the expert lives), their rows uploaded before the scatter.
 * Everything else (norms, projections, rope, attention over the paged mirror, the experts'
 * grouped products, the shared expert, the logits) runs on the device.
 *
 * Latent attention (deepseek2) runs op for op as engine/attn_mla.c, over a mirror of its
 * half (or float) latent rows. Not supported (md_fwd_dev_new refuses with the reason): a
 * head_dim over 256 or latent rows over 1024 elements, weight types the backend cannot read.
 * The engine then serves on the CPU (--device auto) or refuses to start (--device cuda).
 * Engine thread only. */
#ifndef MD_FORWARD_DEV_H
#define MD_FORWARD_DEV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/backend.h"
#include "engine/forward.h"
#include "engine/kern/threadpool.h"

struct md_fwd_dev; /* opaque */

/* What a pass borrows from the CPU forward context that runs it (engine/forward.c). */
struct md_fwd_dev_pass {
	struct md_pool *pool;                 /* host threads for experts computed on the CPU */
	struct md_expert_src *src;            /* where experts come from without experts_resident */
	const struct md_forward_draft *draft; /* NULL: an exact pass */
	md_forward_route_cb route_cb;
	void *route_ud;
	md_forward_route_cb pregate_cb;
	void *pregate_ud;
};

/* Why m cannot run on b with KV rows of that kind (one phrase into buf, returned), or NULL
 * when it can. */
const char *md_fwd_dev_unsupported(const struct md_model *m, struct md_kv_rows rows,
				   const struct md_backend *b, char *buf, size_t len);

/* Device memory a model would take: its weights (experts included when with_experts) and a
 * KV mirror of kv_bytes, plus the activations of max_tokens tokens. For planning. */
uint64_t md_fwd_dev_need(const struct md_model *m, bool with_experts, uint64_t kv_bytes,
			 int max_tokens);

/* Upload the model's weights (its routed experts too when experts_resident) to b, allocate
 * the mirror of kv and the activations for up to max_tokens tokens per pass, and hook kv's
 * block copies. Returns 0 and *out, or a negative code with one line in err: -ENOTSUP (the
 * model or backend cannot run here: why), -ENOMEM (device memory), -EIO. kv must outlive the
 * context; the context must be freed before b. */
int md_fwd_dev_new(const struct md_model *m, struct md_backend *b, struct md_kv_cache *kv,
		   int max_tokens, bool experts_resident, struct md_fwd_dev **out, char *err,
		   size_t errlen);
void md_fwd_dev_free(struct md_fwd_dev *d);

/* md_forward's contract (engine/forward.h) for kv, the cache the context was made with. */
int md_fwd_dev_forward(struct md_fwd_dev *d, const struct md_fwd_dev_pass *p,
		       struct md_kv_cache *kv, const struct md_batch *b, float *logits);

/* Device memory the context holds (weights, KV mirror, activations), and its parts. */
struct md_fwd_dev_mem {
	uint64_t weights, kv, activations;
	bool experts_resident;
};
void md_fwd_dev_mem(const struct md_fwd_dev *d, struct md_fwd_dev_mem *out);

/* MoE layer passes routed on the device (no host round trip) and on the host, since creation. */
void md_fwd_dev_counts(const struct md_fwd_dev *d, uint64_t *fast, uint64_t *host);
/* Passes captured as graphs, and graph launches (each a whole pass), since creation. Where the
 * backend has graphs, a pass of up to 64 tokens that routes on the device (or a dense model's)
 * with every row's logits runs as its size's graph; MOED_NO_GRAPHS=1 in the environment turns
 * them off (for measuring what they save). */
void md_fwd_dev_graphs(const struct md_fwd_dev *d, uint64_t *captures, uint64_t *launches);

#endif
