/* The expert store: routed experts read from the GGUF file into a host-RAM cache, served to
 * the forward pass as an md_expert_src (engine/expert_src.h).
 *
 * DESIGN
 * The unit is one expert of one layer (unit = layer * n_expert + expert): its gate, up and
 * down matrices, three byte ranges of the file (one in each merged ffn_*_exps tensor). The
 * store owns a budget of host RAM cut into equal slots, each able to hold any unit (the
 * largest unit, every range widened to the O_DIRECT alignment). Dense weights stay in the
 * model's mapping; the store reads experts with its own file descriptor, O_DIRECT where the
 * filesystem allows (no page-cache copy, no double counting under a memory limit), else
 * buffered pread with the pages dropped afterwards (logged once).
 *
 * Threads: the engine thread calls every function here (through the ops table) and owns the
 * unit -> slot map, the eviction policy (engine/expert_policy.h) and the pins; a small pool
 * of I/O threads takes read jobs from two queues (demand first, then prefetch) and fills
 * slots. One mutex guards the queues and each slot's load state; a condition variable wakes
 * the readers, another the engine thread when a load ends. A slot being read is never
 * evicted, nor one that the current layer planned or got and has not released.
 *
 * plan() pins the layer's experts, queues reads for the missing ones (in the order they will
 * be got) and orders the gets resident-first, so the forward pass computes resident experts
 * while the others arrive; get() waits only for the expert it needs (moving it to the front
 * of the demand queue if a prefetch had queued it). prefetch() queues reads for a predicted
 * later layer, using only slots that the policy can give up now; that layer's plan takes the
 * guesses it does not use off the queue. A miss the policy would not admit in place of its
 * victim (pred's bypass) is cached as a transit unit, the first to go once released
 * (expert_policy.h). A read that fails (short file, I/O error) fails the get with its code and
 * frees the slot, so a later request tries again; nothing is cached from it.
 *
 * Device tier (optional, through engine/backend.h; engine/backend_sim.h simulates one): a
 * second set of slots in device memory with its own policy. An expert the forward pass got
 * from host RAM is copied up (upload_async on the copy stream, one fence) into a free or
 * evictable device slot; once its fence has passed, plans find it there, order it first, and
 * get returns device views (md_expert_w.dev) that the forward pass computes with the
 * backend's matmul. The host slot it came from is not reused before the fence passes, nor a
 * device slot in use or still being written. A planned expert in host RAM but not on the
 * device (a device miss) runs on the CPU, or is copied up by the plan and computed on the
 * device in the same step, as the cost model says (engine/expert_cost.h: bytes, tokens
 * routed, copy and compute rates measured by a probe at start and from the forward pass's
 * timings); copies chosen so go after the CPU's experts in the get order, and their gets wait
 * for the fence.
 *
 * One forward pass at a time uses a store (the engine thread's), as md_expert_src requires.
 * md_expert_store_get_stats may be called from any thread.
 */
#ifndef MD_EXPERTS_H
#define MD_EXPERTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/expert_cost.h"
#include "engine/expert_policy.h"
#include "engine/expert_src.h"
#include "engine/model.h"

struct md_expert_store_config {
	size_t host_bytes;        /* host RAM for expert slots */
	enum md_epol_kind policy; /* eviction policy of the host tier */
	int io_threads;           /* reader threads; 0: 4 */
	int max_tokens;           /* the largest batch of a forward pass using the store: one
				   * layer may hold min(n_expert, max_tokens * n_expert_used) */
	bool buffered;            /* never try O_DIRECT (diagnostics) */
	bool prefetch;            /* offer the prefetch op (the forward pass then predicts the
				   * next layer's experts and the store reads them ahead) */
	struct md_backend *dev;   /* borrowed, NULL: no device tier; else the device whose
				   * memory holds the hottest experts (outlives the store) */
	size_t dev_bytes;         /* device budget for experts */
	const struct md_xcost *rates; /* borrowed, NULL: the cost model's rates are measured (a
				       * probe of the device at start, then the forward pass's
				       * timings); else these, fixed (tests, diagnostics) */
};

/* Counters since the store was made; a consistent-enough snapshot (each counter atomic). */
struct md_expert_store_stats {
	uint64_t hits;            /* planned experts found resident or already on their way */
	uint64_t misses;          /* planned experts read on demand */
	uint64_t bytes_read;      /* bytes read from the file (alignment included) */
	uint64_t read_errors;     /* reads that failed (the gets got the error) */
	uint64_t evictions;
	uint64_t bypassed;        /* misses the policy would not admit, streamed through as
				   * transit units (pred; expert_policy.h) */
	uint64_t stall_ns;        /* time gets waited for reads */
	uint64_t prefetch_issued; /* reads started by prefetch() or a warm start */
	uint64_t prefetch_used;   /* of those, experts a plan then asked for */
	uint64_t prefetch_wasted_bytes; /* bytes of prefetched experts evicted unused */
	uint64_t prefetch_cancelled; /* of the issued, guesses their layer's plan did not use,
				      * taken off the queue before their read started */
	uint64_t predicted_used;  /* planned experts that the last prediction of the layer named */
	uint64_t predicted_total; /* planned experts of layers that had a prediction */
	uint64_t steps;           /* forward passes seen (plans of a layer not after the last) */
	uint64_t step_experts;    /* sum over those of the distinct experts each used */
	uint32_t last_step_experts; /* distinct experts of the last finished step */
	uint32_t n_slots, n_resident;
	size_t slot_bytes;
	/* device tier (all 0 without one) */
	uint64_t dev_hits;        /* planned experts found on the device (computed there) */
	uint64_t dev_misses;      /* planned experts not on the device */
	uint64_t dev_compute_dev; /* of those, copied up for the step and computed there (the
				   * cost model's choice) */
	uint64_t dev_compute_host; /* ... and computed by the CPU from host RAM */
	uint64_t dev_uploads;     /* experts copied host -> device (for the step or in the
				   * background for later ones) */
	uint64_t dev_bytes_uploaded;
	uint64_t dev_evictions;
	uint64_t dev_stall_ns;    /* time gets waited for copies */
	uint64_t dev_prefetch_issued; /* background copies (of experts the CPU computed) */
	uint64_t dev_prefetch_used;   /* of those, experts a plan then found on the device */
	uint64_t dev_prefetch_wasted_bytes; /* ... evicted from the device unused */
	uint64_t dev_mem_bytes;   /* device memory of the expert slots */
	double dev_up_bps;        /* the cost model's copy rate (measured) */
	uint32_t dev_slots, dev_resident;
	bool direct;              /* reads bypass the page cache */
};

struct md_expert_store; /* opaque */

/* Bytes of one slot for model m (its largest expert, widened to the read alignment), or 0
 * when m has no routed experts. */
size_t md_expert_store_slot_bytes(const struct md_model *m);

/* Bytes of all routed experts of model m as the file holds them (0: none). */
uint64_t md_expert_store_expert_bytes(const struct md_model *m);

/* Smallest host budget that serves batches of up to max_tokens tokens: one slot per expert a
 * layer may use at once. */
size_t md_expert_store_min_bytes(const struct md_model *m, int max_tokens);

/* A store for model m (borrowed: outlives the store), reading m's file by its path. Returns
 * 0, or -EINVAL (budget below md_expert_store_min_bytes, bad config), -ENOTSUP (no routed
 * experts, or experts not laid out in the file as the model reads them), -errno (the file),
 * -ENOMEM, with one line in err. */
int md_expert_store_new(struct md_expert_store **out, const struct md_model *m,
			const struct md_expert_store_config *c, char *err, size_t errlen);
/* Waits for reads in flight, stops the readers, frees the slots. NULL is fine. */
void md_expert_store_free(struct md_expert_store *s);

/* The store as an expert source (md_forward_set_expert_src); valid while s lives. */
struct md_expert_src *md_expert_store_src(struct md_expert_store *s);

void md_expert_store_get_stats(struct md_expert_store *s, struct md_expert_store_stats *out);

/* Warm restart. save writes the hot set, the resident experts that were used (most recently
 * used first; not those a fill or warm start read that no step used since), to
 * path (atomically: PATH.tmp written and synced, then renamed over path; on any failure the
 * temporary file is removed and a previous path is left as it was), with the model's shape
 * and file size; warm
 * reads such a file and queues reads (prefetch priority) for as many of its experts as the
 * cache holds, returning how many in *n. Both on the engine thread, between forward passes.
 * Return 0, -EINVAL for a file of another model (nothing queued) or a malformed line (the
 * reads before it stay queued), or -errno. Warm reads count as prefetches. */
int md_expert_store_save(struct md_expert_store *s, const char *path);
int md_expert_store_warm(struct md_expert_store *s, const char *path, uint32_t *n);

/* Queue reads (prefetch priority) of experts into the free slots, leaving one layer's worth of
 * the largest step free: the layers in turn, so each gets an equal share. For a store just
 * made, after any warm start; returns how many reads were queued. Engine thread. */
uint32_t md_expert_store_fill(struct md_expert_store *s);

/* Whether unit (layer * n_expert + expert) is resident and loaded now (engine thread). */
bool md_expert_store_resident(struct md_expert_store *s, uint32_t layer, uint32_t expert);

#endif
