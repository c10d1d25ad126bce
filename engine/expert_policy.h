/* Expert cache eviction policies: which resident expert to drop when a tier is full.
 *
 * Pure bookkeeping, no memory of weights and no I/O: the expert store (engine/experts.c)
 * tells a policy what became resident, what was used and what the router predicts, and asks
 * it for a victim; bench/cache-replay drives the same code from a routing trace. The unit is
 * one expert of one layer, numbered unit = layer * n_expert + expert.
 *
 * Time is a counter the caller advances (the store: one tick per MoE layer computed; replay:
 * the same, from the trace), so a policy's choices depend only on the sequence of calls and
 * replays of a trace give the store's hit rates exactly.
 *
 * Not thread-safe: one owner (the engine thread, or the replay program). */
#ifndef MD_EXPERT_POLICY_H
#define MD_EXPERT_POLICY_H

#include <stdbool.h>
#include <stdint.h>

enum md_epol_kind {
	MD_EPOL_LRU,  /* least recently used */
	MD_EPOL_LFU,  /* least frequently used, counts halving every half-life (default 128 steps) */
	MD_EPOL_PRED, /* "pred": least expected miss cost per tick until the next use, from the
		       * aged frequency, the router's hints and the layer order (expert_policy.c) */
	MD_EPOL_KIND_COUNT,
};

struct md_epol;

/* Predicate for md_epol_victim: may this resident unit go now (not in use, not pinned)? */
typedef bool (*md_epol_evictable_fn)(void *arg, uint32_t unit);

/* A policy for n_layer * n_expert units, none resident. NULL on allocation failure. */
struct md_epol *md_epol_new(enum md_epol_kind kind, uint32_t n_layer, uint32_t n_expert);
void md_epol_free(struct md_epol *p);

/* The unit became resident in the tier this policy manages. */
void md_epol_insert(struct md_epol *p, uint32_t unit, uint64_t now);
/* The unit left the tier (evicted, or dropped for another reason). */
void md_epol_remove(struct md_epol *p, uint32_t unit);
/* The forward pass used the unit at time now (resident or not: a policy may count misses). */
void md_epol_access(struct md_epol *p, uint32_t unit, uint64_t now);
/* The router predicts the unit's use soon with probability prob (pre-gating, a sequence's
 * recent routing). Policies that do not use predictions ignore it. */
void md_epol_hint(struct md_epol *p, uint32_t unit, float prob, uint64_t now);

/* Tuning (all kinds accept them; those a kind does not use are kept and ignored).
 * Half-life of the use counts of lfu and pred, in ticks; 0 restores the default, 128 ticks per
 * layer (128 steps when the caller ticks once per MoE layer). */
void md_epol_set_half_life(struct md_epol *p, uint64_t ticks);
/* What a miss of unit costs, relative to others (default 1 each): bytes over the bandwidth of
 * the tier it comes from. pred keeps what is costly to fetch again. */
void md_epol_set_cost(struct md_epol *p, uint32_t unit, float cost);

/* The resident unit to evict next among those ok(arg, unit) allows; -1 when none may go. */
int64_t md_epol_victim(struct md_epol *p, md_epol_evictable_fn ok, void *arg, uint64_t now);

/* Admission: should a unit that just missed take victim's place (the victim md_epol_victim
 * chose), or go through uncached? lru and lfu always admit; pred admits it when it is worth
 * more than the victim by its own measure (a unit just used is needed again only after a whole
 * cycle of layers, so when a step uses more experts than the cache holds pred keeps what the
 * next layers need rather than churning). */
bool md_epol_admit(struct md_epol *p, uint32_t unit, uint32_t victim, uint64_t now);

/* A store cannot stream a unit through without holding it while its layer computes: where
 * md_epol_admit says no, it caches the unit as transit instead. A transit unit is the first
 * victim (before every other unit; among transit ones the least recently used) until it is
 * accessed again, which makes it an ordinary resident. demote marks a resident unit transit;
 * victim_cached is md_epol_victim among the resident units that are not transit (what an
 * admission should be weighed against when the victim is a transit unit). */
void md_epol_demote(struct md_epol *p, uint32_t unit);
bool md_epol_transit(const struct md_epol *p, uint32_t unit);
int64_t md_epol_victim_cached(struct md_epol *p, md_epol_evictable_fn ok, void *arg,
			      uint64_t now);

bool md_epol_resident(const struct md_epol *p, uint32_t unit);
uint32_t md_epol_n_resident(const struct md_epol *p);

/* "lru", "lfu", "pred"; NULL for an unknown kind. */
const char *md_epol_name(enum md_epol_kind kind);
/* Parse a name as md_epol_name writes it; -EINVAL for an unknown one. */
int md_epol_parse(const char *name, enum md_epol_kind *out);

#endif
