/* The expert tiers of an engine: which mode the model's routed experts are served in (the
 * mapping, or the expert store with its host and device tiers), the budgets, the device, the
 * warm restart, and the start-up line that says so.
 *
 * DESIGN
 * The engine calls this once while loading (md_expert_tiers_init, after the model is mapped
 * and before the KV pool is sized, since the plan sizes both) and once at a clean shutdown
 * (md_expert_tiers_save). The mode comes from engine/mem_plan.h. A device tier (device-mb > 0)
 * always goes through the store: it needs host slots to copy from; when the file fits in
 * memory the host tier then holds every expert. The device is CUDA's first GPU where present
 * ("auto", "cuda"), or the simulated device of engine/backend_sim.h ("sim", with copy and
 * compute rates: for tests and for trying the tier's logic without a GPU). Engine thread. */
#ifndef MD_EXPERT_TIERS_H
#define MD_EXPERT_TIERS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/backend.h"
#include "engine/experts.h"
#include "engine/model.h"

/* Which device serves the device tier, parsed from "auto", "none", "cuda" or
 * "sim[:COPY_MBPS[:COMPUTE_MBPS]]" (rates in MB/s; 0 or absent: instant). */
struct md_expert_device {
	enum { MD_XDEV_AUTO, MD_XDEV_NONE, MD_XDEV_CUDA, MD_XDEV_SIM } kind;
	double sim_copy_bps, sim_compute_bps;
};

/* 0, or -EINVAL with the reason in err. NULL or "" is "auto". */
int md_expert_device_parse(const char *spec, struct md_expert_device *out, char *err,
			   size_t errlen);

struct md_expert_tiers_config {
	double cache_mb;          /* expert-cache-mb: 0 auto, -1 the mapping, > 0 that budget */
	int64_t device_mb;        /* device-expert-mb: 0 no device tier */
	const char *device;       /* borrowed, NULL: "auto" (md_expert_device_parse) */
	struct md_backend *dev;   /* borrowed, NULL: the device `device` names; else the tier's
				   * device (the forward pass's, engine/dev_place.h) */
	const char *policy;       /* borrowed, NULL: pred */
	bool prefetch;
	bool fill;                /* expert-fill: fill the empty cache at start (after the warm
				   * start), md_expert_store_fill */
	uint32_t step_tokens;     /* the largest forward pass */
	const char *state_dir;    /* borrowed, NULL/"": no warm restart */
	uint64_t kv_bytes;        /* the KV budget asked for */
	uint64_t kv_min;          /* the least KV pool the engine makes (mem_plan.h) */
};

struct md_expert_tiers {
	struct md_expert_store *store; /* owned; NULL: experts stay in the mapping */
	struct md_backend *dev;        /* the device tier's backend (borrowed: CUDA's lives for
					* the process; owned when dev_owned), NULL: none */
	bool dev_owned;
	uint64_t kv_bytes;             /* the KV budget to use (the plan may lower it) */
	bool refused;                  /* init failed: the model cannot be served within the
					* memory limit (err says why, without the file's name) */
	char hot_path[4200];           /* the warm-restart file, "" without a state dir */
};

/* Choose the mode, make the store (and device tier) when experts go through it, queue the
 * warm start and the fill, page in (and lock where allowed) the dense weights in store mode,
 * page in the whole file in mapping mode when it fits (md_mem_plan.populate), and log one line
 * naming the mode, budgets and why. A model the memory plan refuses fails with -ENOMEM
 * and refused set. On the mapping nothing is paged in here (the engine
 * pages in the whole file). Returns 0, or a negative code with err set (nothing held). */
int md_expert_tiers_init(struct md_expert_tiers *t, const struct md_model *m,
			 const struct md_expert_tiers_config *c, char *err, size_t errlen);
/* A clean shutdown: write the hot set for the next start (logged). */
void md_expert_tiers_save(struct md_expert_tiers *t);
void md_expert_tiers_release(struct md_expert_tiers *t);

#endif
