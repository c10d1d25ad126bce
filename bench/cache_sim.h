/* Expert-cache simulation on a routing trace: the replay behind bench/cache-replay.
 *
 * DESIGN
 * A trace (engine/route_trace.h) becomes a list of groups, one per (step, MoE layer) in the
 * order the forward pass ran them: the distinct experts the layer used in that step, as units
 * layer * n_expert + expert. That is what an expert store sees: within a step a layer reads
 * each active expert once, however many tokens chose it (expert-major grouping, DESIGN §4).
 * Time advances one tick per group, as the store ticks once per MoE layer computed.
 *
 * A cache of C units replays the groups under an md_epol policy (engine/expert_policy.h, the
 * store's own code): a unit of the group that is resident is a hit, others are misses and are
 * inserted, evicting the policy's victim among units the group does not use (they are in use)
 * if the policy admits the unit (md_epol_admit); when every resident unit is in use, or the
 * policy would rather keep its victim, the missing unit streams through uncached. Belady's MIN is
 * the offline limit on the same groups: after each group the cache keeps the C units, among
 * those resident and those just used, whose next use is nearest (a unit not used again is
 * kept last); no online policy can hit more. All units have the same size (every layer's
 * experts do in the models moed runs), so a budget in units is a budget in bytes.
 *
 * Predictors (prefetch accuracy = predicted ∩ used / used, per token and per group):
 *   prev   a sequence's previous token's experts at the same layer;
 *   cooc   the same token's experts at the layer before, mapped through co-occurrence counts
 *          learned online from the trace so far (for each expert e at layer l, how often each
 *          expert of layer l+1 followed it): the k best-scoring experts of layer l+1. Known
 *          one layer ahead, like pre-gating, and usable by the store in the same place.
 *   pregate the prediction the trace recorded ("p" lines, engine/route_trace.h): layer l's
 *          router on the residual leaving layer l - 1, what the store's prefetcher reads.
 *          Known later than cooc (after layer l - 1's experts ran, not after its router),
 *          and only where the trace has it.
 * cooc's predictions feed the pred policy as hints (md_epol_hint), with the predictor's
 * precision so far as their probability; with MD_CSIM_PREFETCH they are also read in ahead of
 * their group, as the store's prefetcher would while the layer before computes; with
 * MD_CSIM_PREGATE pre-gating's take cooc's place, precision and all. Belady's MIN
 * bounds demand fetching only: prefetching can beat it, at the price of the bytes it wastes.
 */
#ifndef MD_CACHE_SIM_H
#define MD_CACHE_SIM_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/expert_policy.h"
#include "engine/route_trace.h"

struct md_csim {
	uint32_t n_layer, n_expert, n_units, n_used;
	uint64_t n_groups;
	uint64_t *start;      /* owned (n_groups + 1): group g's units are units[start[g] ..] */
	uint32_t *units;      /* owned: distinct, ascending within a group */
	uint32_t *layer;      /* owned (n_groups) */
	uint64_t *hint_start; /* owned (n_groups + 1): hints given just before group g */
	uint32_t *hint_unit;  /* owned */
	float *hint_p;        /* owned */
	uint64_t *pg_start;   /* owned (n_groups + 1): pre-gating's hints, as hint_start */
	uint32_t *pg_unit;    /* owned */
	float *pg_p;          /* owned */
	bool has_pregate;     /* the trace recorded pre-gating ("p" lines) */
};

/* Prefetch accuracy of one predictor. */
struct md_csim_pred {
	uint64_t tok_used, tok_hit;        /* per token: experts used, of them predicted */
	uint64_t tok_predicted;            /* per token: experts predicted */
	uint64_t grp_used, grp_hit;        /* per group: units used, of them predicted */
	uint64_t grp_predicted;            /* per group: units predicted (what a prefetch reads) */
};

struct md_csim_stats {
	struct md_csim_pred prev, cooc, pregate;
};

/* Build the groups, the predictors' accuracy (into st) and the hints from a trace. Returns 0
 * or -ENOMEM. */
int md_csim_build(struct md_csim *s, const struct md_route_log *log, struct md_csim_stats *st);
void md_csim_release(struct md_csim *s);

struct md_csim_result {
	uint64_t accesses, hits;
	uint64_t prefetched;     /* units read ahead (MD_CSIM_PREFETCH) */
	uint64_t prefetch_used;  /* of them, used by the group they were read for */
};

enum {
	MD_CSIM_HINTS = 1,    /* feed cooc's predictions to the policy (md_epol_hint) */
	MD_CSIM_PREFETCH = 2, /* and read them in before their group, evicting by the policy
			       * among units the group before does not use (it is running) */
	MD_CSIM_PREGATE = 4,  /* hints (and prefetches) from pre-gating instead of cooc */
};

/* Replay the groups under policy kind with a cache of capacity units; flags as above.
 * half_life 0: the policy's default. Returns 0 or -ENOMEM. */
int md_csim_replay(const struct md_csim *s, enum md_epol_kind kind, uint32_t capacity,
		   unsigned flags, uint64_t half_life, struct md_csim_result *out);
/* Belady's MIN on the same groups (demand fetching). Returns 0 or -ENOMEM. */
int md_csim_belady(const struct md_csim *s, uint32_t capacity, struct md_csim_result *out);
/* The same, also reading pre-gating's predictions of each group ahead (as pred + pre-gating
 * prefetch is given them) whenever that beats the farthest next use resident, not over the
 * units of the group before: an offline reference for a store that prefetches what pre-gating
 * names (a greedy one: not proven optimal with prefetch, as MIN is without). Without "p" lines
 * it is Belady's MIN. Returns 0 or -ENOMEM. */
int md_csim_belady_pregate(const struct md_csim *s, uint32_t capacity, struct md_csim_result *out);
/* The best fixed set in hindsight: the capacity units used most over the whole trace, loaded
 * before it starts (no policy that keeps a fixed set does better). */
int md_csim_static_best(const struct md_csim *s, uint32_t capacity, struct md_csim_result *out);
/* The hot set: how many of the most-used units serve share (0..1) of all accesses (0 when out
 * of memory or the trace is empty). */
uint32_t md_csim_hot_set(const struct md_csim *s, double share);

#endif
