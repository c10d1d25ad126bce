/* Where the forward pass runs (dev_place.h). */
#include "engine/dev_place.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/backend_sim.h"
#include "engine/experts.h"
#include "engine/forward_dev.h"

#define MIB 1048576.0

enum kind { K_AUTO, K_CPU, K_CUDA, K_SIM };

/* Parse spec into *k and, for sim, the capacity in bytes. */
static int parse(const char *spec, enum kind *k, uint64_t *sim_bytes, char *err, size_t errlen)
{
	*sim_bytes = (uint64_t)64 << 30;
	if (!spec || !*spec || strcmp(spec, "auto") == 0) {
		*k = K_AUTO;
	} else if (strcmp(spec, "cpu") == 0) {
		*k = K_CPU;
	} else if (strcmp(spec, "cuda") == 0) {
		*k = K_CUDA;
	} else if (strncmp(spec, "sim", 3) == 0 && (spec[3] == '\0' || spec[3] == ':')) {
		*k = K_SIM;
		if (spec[3] == ':') {
			char *end;
			double mb = strtod(spec + 4, &end);
			if (end == spec + 4 || *end || !(mb > 0) || mb > 1e9) {
				snprintf(err, errlen, "must be auto, cpu, cuda or sim[:MIB]");
				return -EINVAL;
			}
			*sim_bytes = (uint64_t)(mb * MIB);
		}
	} else {
		snprintf(err, errlen, "must be auto, cpu, cuda or sim[:MIB]");
		return -EINVAL;
	}
	return 0;
}

int md_dev_place_check(const char *spec, char *err, size_t errlen)
{
	enum kind k;
	uint64_t b;
	return parse(spec, &k, &b, err, errlen);
}

void md_dev_place_release(struct md_dev_place *p)
{
	if (p->owned)
		md_backend_sim_free(p->b);
	p->b = NULL;
	p->owned = false;
}

/* Back to the CPU with the reason, or (required) an error. */
static int no_device(struct md_dev_place *p, int rc, const char *why, char *err, size_t errlen)
{
	if (p->required) {
		snprintf(err, errlen, "%s", why);
		md_dev_place_release(p);
		return rc;
	}
	snprintf(p->line, sizeof(p->line), "device: cpu (%s)", why);
	md_dev_place_release(p);
	return 0;
}

int md_dev_place_plan(struct md_dev_place *p, const struct md_model *m,
		      const struct md_dev_place_config *c, char *err, size_t errlen)
{
	memset(p, 0, sizeof(*p));
	enum kind k;
	uint64_t sim_bytes;
	int rc = parse(c->device, &k, &sim_bytes, err, errlen);
	if (rc)
		return rc;
	if (k == K_CPU) {
		snprintf(p->line, sizeof(p->line), "device: cpu (--device cpu)");
		return 0;
	}
	p->required = k != K_AUTO;
	char why[400];
	if (k == K_SIM) {
		p->b = md_backend_sim_new((size_t)sim_bytes, 0);
		if (!p->b)
			return -ENOMEM;
		p->owned = true;
	} else {
		p->b = md_backend_cuda();
		if (!p->b) {
			snprintf(why, sizeof(why), "no CUDA device: %s", md_backend_cuda_error());
			return no_device(p, -ENODEV, why, err, errlen);
		}
	}
	if (p->b->device_info(p->b, 0, &p->info)) {
		snprintf(why, sizeof(why), "cannot query the %s device", p->b->name);
		return no_device(p, -ENODEV, why, err, errlen);
	}
	char buf[300];
	if (md_fwd_dev_unsupported(m, md_model_kv_rows(m), p->b, buf, sizeof(buf))) {
		snprintf(why, sizeof(why), "%s cannot run this model: %s", p->info.name, buf);
		return no_device(p, -ENOTSUP, why, err, errlen);
	}
	/* The room: free memory less the reserve (none on the simulated device). */
	uint64_t total = p->info.mem_total, free_b = p->info.mem_free;
	uint64_t reserve = 0;
	if (!p->owned) {
		reserve = total / 33;
		if (reserve < ((uint64_t)256 << 20))
			reserve = (uint64_t)256 << 20;
	}
	uint64_t room = free_b > reserve ? free_b - reserve : 0;
	uint64_t all = md_fwd_dev_need(m, true, c->kv_bytes, c->step_tokens);
	uint64_t dense = md_fwd_dev_need(m, false, c->kv_bytes, c->step_tokens);
	uint64_t min_tier = m->hp.n_expert ? md_expert_store_min_bytes(m, c->step_tokens) : 0;
	char head[400];
	snprintf(head, sizeof(head), "device: %s %.200s (%.0f MiB, %.0f free)", p->b->name,
		 p->info.name, total / MIB, free_b / MIB);
	if (all <= room && c->tier_mb <= 0) {
		p->experts_resident = true;
		snprintf(p->line, sizeof(p->line), "%s: the forward pass on the device, every weight "
			 "resident (%.0f MiB with KV and activations, %.0f MiB of it the routed "
			 "experts; room %.0f MiB)", head, all / MIB, (all - dense) / MIB, room / MIB);
		return 0;
	}
	if (m->hp.n_expert && dense + min_tier <= room) {
		uint64_t left = room - dense;
		p->tier_mb = c->tier_mb > 0 ? c->tier_mb : (int64_t)(left / (1 << 20));
		if ((uint64_t)p->tier_mb << 20 > left)
			p->tier_mb = (int64_t)(left >> 20);
		snprintf(p->line, sizeof(p->line), "%s: the forward pass on the device, dense weights "
			 "resident (%.0f MiB with KV and activations), routed experts through the "
			 "expert store with a %lld MiB device tier (%s; every expert would need %.0f "
			 "MiB)", head, dense / MIB, (long long)p->tier_mb,
			 c->tier_mb > 0 ? "device-expert-mb" : "the room left", all / MIB);
		return 0;
	}
	snprintf(why, sizeof(why), "%.200s has %.0f MiB of room; the dense weights, KV and "
		 "activations need %.0f MiB%s", p->info.name, room / MIB, dense / MIB,
		 m->hp.n_expert ? " plus one step's experts" : "");
	return no_device(p, -ENOMEM, why, err, errlen);
}
