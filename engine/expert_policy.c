/* Expert cache eviction policies (see expert_policy.h).
 *
 * DESIGN. One struct for every kind: per-unit arrays (resident flag, last use) that each kind
 * reads as it needs, and a victim search that scans the resident units for the lowest score.
 * The scan is O(units) per eviction (a 48-layer, 128-expert model has 6144 units: a few
 * microseconds, against a miss that costs a disk read of megabytes); an ordered structure is
 * worth it only if evictions ever show in a profile. */
#include "engine/expert_policy.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

struct md_epol {
	enum md_epol_kind kind;
	uint32_t n_units;
	uint32_t n_resident;
	uint8_t *resident;  /* owned (n_units) */
	uint64_t *last_use; /* owned (n_units): time of the last access or insert */
};

static const char *const kind_names[MD_EPOL_KIND_COUNT] = {
	[MD_EPOL_LRU] = "lru",
};

struct md_epol *md_epol_new(enum md_epol_kind kind, uint32_t n_layer, uint32_t n_expert)
{
	if ((unsigned)kind >= MD_EPOL_KIND_COUNT || n_layer == 0 || n_expert == 0)
		return NULL;
	struct md_epol *p = calloc(1, sizeof(*p));
	if (!p)
		return NULL;
	p->kind = kind;
	p->n_units = n_layer * n_expert;
	p->resident = calloc(p->n_units, 1);
	p->last_use = calloc(p->n_units, sizeof(*p->last_use));
	if (!p->resident || !p->last_use) {
		md_epol_free(p);
		return NULL;
	}
	return p;
}

void md_epol_free(struct md_epol *p)
{
	if (!p)
		return;
	free(p->resident);
	free(p->last_use);
	free(p);
}

void md_epol_insert(struct md_epol *p, uint32_t unit, uint64_t now)
{
	if (unit >= p->n_units || p->resident[unit])
		return;
	p->resident[unit] = 1;
	p->n_resident++;
	p->last_use[unit] = now;
}

void md_epol_remove(struct md_epol *p, uint32_t unit)
{
	if (unit >= p->n_units || !p->resident[unit])
		return;
	p->resident[unit] = 0;
	p->n_resident--;
}

void md_epol_access(struct md_epol *p, uint32_t unit, uint64_t now)
{
	if (unit < p->n_units)
		p->last_use[unit] = now;
}

void md_epol_hint(struct md_epol *p, uint32_t unit, float prob, uint64_t now)
{
	(void)p;
	(void)unit;
	(void)prob;
	(void)now;
}

int64_t md_epol_victim(struct md_epol *p, md_epol_evictable_fn ok, void *arg, uint64_t now)
{
	(void)now;
	int64_t best = -1;
	for (uint32_t u = 0; u < p->n_units; u++) {
		if (!p->resident[u] || (ok && !ok(arg, u)))
			continue;
		if (best < 0 || p->last_use[u] < p->last_use[best])
			best = u;
	}
	return best;
}

bool md_epol_resident(const struct md_epol *p, uint32_t unit)
{
	return unit < p->n_units && p->resident[unit];
}

uint32_t md_epol_n_resident(const struct md_epol *p)
{
	return p->n_resident;
}

const char *md_epol_name(enum md_epol_kind kind)
{
	return (unsigned)kind < MD_EPOL_KIND_COUNT ? kind_names[kind] : NULL;
}

int md_epol_parse(const char *name, enum md_epol_kind *out)
{
	for (int k = 0; k < MD_EPOL_KIND_COUNT; k++)
		if (name && strcmp(name, kind_names[k]) == 0) {
			*out = (enum md_epol_kind)k;
			return 0;
		}
	return -EINVAL;
}
