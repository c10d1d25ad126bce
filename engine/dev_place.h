/* Where the forward pass runs: the CPU, or a device (CUDA's first GPU, or the simulated
 * device), and how the model's weights are placed there.
 *
 * DESIGN
 * The engine asks once while loading, after the model is mapped and before the expert tiers
 * and the KV pool are set up (the answer sizes both). --device says where: "cpu"; "cuda" (a
 * GPU is required: anything that keeps the model off it is an error at start-up); "auto" (the
 * default: the GPU when one is found and the model can run there, else the CPU, with the
 * reason logged); "sim[:MIB]" (the simulated device of engine/backend_sim.h with MIB of
 * "device memory", default 64 GiB: the device path's logic on machines without a GPU).
 *
 * Placement, from the device's free memory less a reserve (the runtime's own, and
 * fragmentation: 3% of the device's memory, at least 256 MiB; none on the simulated device):
 *   1. everything resident: dense weights, every routed expert, the KV mirror and the
 *      activations fit: the experts are uploaded once and the CPU only embeds tokens and
 *      routes (engine/forward_dev.h);
 *   2. experts larger than the device: the dense weights, KV mirror and activations fit with
 *      room for at least one step's experts (md_expert_store_min_bytes): the routed experts go
 *      through the expert store with the device as its fastest tier (device-expert-mb, or all
 *      the room left); the store's cost model decides per expert and step between uploading
 *      a missing expert and computing it on the CPU where it lives;
 *   3. otherwise the forward pass stays on the CPU (auto) or start-up fails (cuda).
 * No --gpu-layers: an MoE's dense part is small and read by every token, so it always
 * belongs on the device, while its experts are read a few at a time, which is what the
 * expert tier's per-expert residency (hot experts on the device, the rest computed on the
 * CPU or copied up by cost) handles better than any fixed split of whole layers.
 * Engine thread. */
#ifndef MD_DEV_PLACE_H
#define MD_DEV_PLACE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/backend.h"
#include "engine/model.h"

/* 0 when spec is a valid --device value, else -EINVAL with what is accepted in err. */
int md_dev_place_check(const char *spec, char *err, size_t errlen);

struct md_dev_place_config {
	const char *device;      /* borrowed: --device, NULL: "auto" */
	uint64_t kv_bytes;       /* the KV pool the engine will make (its mirror's size) */
	int step_tokens;         /* the largest forward pass */
	int64_t tier_mb;         /* device-expert-mb the user set (0: choose) */
};

struct md_dev_place {
	struct md_backend *b;    /* NULL: the CPU; CUDA's is the process's, a simulated one owned */
	bool owned;
	bool required;           /* --device cuda (or sim): a later failure to start is fatal */
	bool experts_resident;   /* placement 1 */
	int64_t tier_mb;         /* placement 2: the store's device tier budget, MiB */
	struct md_backend_device info;
	char line[640];          /* one line for the log: the device, the placement and why */
};

/* Decide (see above). Returns 0 (p->b NULL for the CPU, with p->line saying why), or -ENODEV /
 * -ENOMEM / -ENOTSUP with err saying why when the device was required and cannot serve. */
int md_dev_place_plan(struct md_dev_place *p, const struct md_model *m,
		      const struct md_dev_place_config *c, char *err, size_t errlen);
void md_dev_place_release(struct md_dev_place *p);

#endif
