/* Expert cache eviction policies (see expert_policy.h).
 *
 * DESIGN. One struct for every kind: per-unit arrays (resident flag, last use, aged use count,
 * the latest hint, the cost of a miss) that each kind reads as it needs, and a victim search
 * that scans the resident units for the lowest score. The scan is O(units) per eviction: for
 * a 48-layer, 128-expert model's 6144 units bench/bench_epol measured 30-48 us (lru), 44-53
 * (lfu) and 102-157 (pred) in two runs on the loaded 2-core development machine, against a
 * miss that costs a disk read of megabytes (about a millisecond); an ordered structure is worth it only if evictions ever
 * show in a profile.
 *
 * lru: the unit used longest ago.
 *
 * lfu: the unit with the lowest use count, where counts halve every half-life ticks. Counts
 * are kept relative to an epoch: a use at time t adds 2^((t - epoch)/half-life), and the
 * count at time now is the sum times 2^(-(now - epoch)/half-life), a factor common to every
 * unit, so comparing counts needs no arithmetic per unit and pred computes the factor once
 * per victim search (the epoch moves forward, rescaling every sum, before the terms could
 * overflow a double: every 256 half-lives). Why aging: plain LFU never forgets, so experts that were hot for an earlier
 * burst of requests (another language, another task) sit in the cache for ever while the
 * current traffic misses; with a half-life a count is about the uses in the last
 * half-life / ln 2 ticks, so the cache follows a shift in traffic within a few half-lives.
 * Why 128 steps: one step's routing is noise (k experts of E per token), so a count must
 * average over many steps; on the moe64 traces of bench/README.md (bench/cache-replay
 * --half-life) lfu's hit rate moves by at most 1.3 points anywhere from 32 to 4096 steps and
 * is 1-7 points lower at 8, and 128 was as good as any. Those traces do not shift traffic;
 * 128 steps (a request or two of output) is short enough to forget an earlier workload in a
 * few hundred tokens. Counts are kept for units that are not resident too (every access counts), so an
 * expert evicted and wanted again comes back with its history.
 *
 * pred (ours): evict the unit whose miss costs least per tick of the time until it is used
 * again, an online estimate of Belady's farthest-next-use weighted by the miss cost. The
 * caller ticks once per MoE layer, so a layer comes round every n_layer ticks (P) while the
 * engine decodes; a unit of layer l is next needed at the next visit of l where it is chosen:
 *   T(u) = d(l) + P * (1 / q(u) - 1)
 * with d(l) the ticks until layer l runs again (from the last tick it was accessed) and q(u)
 * the probability that u is used at a visit, the larger of
 *   - its aged count times (1 - 2^(-P/half-life)) (a unit used at every visit has count
 *     1 / (1 - 2^(-P/half-life)) in steady state, so this is its use rate per visit), and
 *   - the probability of the router's latest hint for it (pre-gating, a sequence's recent
 *     routing), as long as the hint came after its layer's last visit (a hint speaks of the
 *     next visit only).
 *   - recency: for a unit its layer used at its last visit, the layer's measured reuse share
 *     (of a visit's units, those the next visit used again: ~0.1 per token on moe64, ~1
 *     while one token repeats), but only while a step's units take at most two thirds of the
 *     tier (past that, keeping the most recent units is lru's thrashing; the aged rate then
 *     keeps a steady subset). Without it pred trailed lru by 19 points on a trace of the
 *     random bench model's repetitive decode at a 30% budget (69.9% against 88.8%); with it
 *     88.2%, and on the moe64 traces within 1.2 points of its old rates (bench/README.md).
 * The victim is the unit with the lowest cost(u) / T(u) (ties: least recently used). The
 * layer term is what neither lru nor lfu knows: right after layer l ran, its units are the
 * ones needed last, so among units of equal rate pred drops those first; lru drops the
 * units of the layer about to run, whose last use is the oldest. The same value decides
 * admission (md_epol_admit): a unit that just missed is cached only if it is worth more than
 * the victim, as Belady's MIN with bypass would; when a step's layer uses more experts than
 * the cache holds, lru and lfu evict the next layers' experts for units needed again only a
 * cycle later, and hit nothing.
 */
#include "engine/expert_policy.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_HALF_LIFE_STEPS 128
#define REUSE_AVG 0.95 /* pred's reuse share: the average over about 20 visits of a layer */

struct md_epol {
	enum md_epol_kind kind;
	uint32_t n_layer, n_expert, n_units;
	uint32_t n_resident;
	uint64_t half_life;   /* ticks */
	uint8_t *resident;    /* owned (n_units) */
	uint64_t *last_use;   /* owned (n_units): time of the last access or insert */
	double *wcount;       /* owned (n_units): use count scaled to the epoch (see lfu) */
	uint64_t epoch;       /* time the scaled counts refer to */
	uint64_t t_last;      /* latest time seen */
	float *hint_p;        /* owned (n_units): probability of the latest hint */
	uint64_t *hint_t;     /* owned (n_units): its time; 0 = none */
	float *cost;          /* owned (n_units): relative cost of a miss */
	uint64_t *layer_last; /* owned (n_layer): time of the layer's latest access */
	uint8_t *layer_seen;  /* owned (n_layer): the layer was accessed at least once */
	uint8_t *transit;     /* owned (n_units): cached without admission (md_epol_demote) */
	/* pred's recency term, per layer: the share of a visit's units the next visit used
	 * again, averaged (reuse), and the bookkeeping of the visit in progress */
	double *reuse;        /* owned (n_layer) */
	uint64_t *visit_prev; /* owned (n_layer): time of the visit before the current one */
	uint32_t *n_cur, *n_prev, *n_again; /* owned (n_layer): units of the current visit, of
					     * the one before, and of those used again now */
	uint64_t step_units;  /* sum of n_prev over the layers: a step's units */
};

static const char *const kind_names[MD_EPOL_KIND_COUNT] = {
	[MD_EPOL_LRU] = "lru",
	[MD_EPOL_LFU] = "lfu",
	[MD_EPOL_PRED] = "pred",
};

struct md_epol *md_epol_new(enum md_epol_kind kind, uint32_t n_layer, uint32_t n_expert)
{
	if ((unsigned)kind >= MD_EPOL_KIND_COUNT || n_layer == 0 || n_expert == 0 ||
	    (uint64_t)n_layer * n_expert > UINT32_MAX)
		return NULL;
	struct md_epol *p = calloc(1, sizeof(*p));
	if (!p)
		return NULL;
	p->kind = kind;
	p->n_layer = n_layer;
	p->n_expert = n_expert;
	p->n_units = n_layer * n_expert;
	size_t n = p->n_units;
	p->resident = calloc(n, 1);
	p->last_use = calloc(n, sizeof(*p->last_use));
	p->wcount = calloc(n, sizeof(*p->wcount));
	p->hint_p = calloc(n, sizeof(*p->hint_p));
	p->hint_t = calloc(n, sizeof(*p->hint_t));
	p->cost = malloc(n * sizeof(*p->cost));
	p->layer_last = calloc(n_layer, sizeof(*p->layer_last));
	p->layer_seen = calloc(n_layer, 1);
	p->transit = calloc(n, 1);
	p->reuse = calloc(n_layer, sizeof(*p->reuse));
	p->visit_prev = calloc(n_layer, sizeof(*p->visit_prev));
	p->n_cur = calloc(n_layer, sizeof(*p->n_cur));
	p->n_prev = calloc(n_layer, sizeof(*p->n_prev));
	p->n_again = calloc(n_layer, sizeof(*p->n_again));
	if (!p->resident || !p->last_use || !p->wcount || !p->hint_p || !p->hint_t ||
	    !p->cost || !p->layer_last || !p->layer_seen || !p->transit || !p->reuse ||
	    !p->visit_prev || !p->n_cur || !p->n_prev || !p->n_again) {
		md_epol_free(p);
		return NULL;
	}
	for (size_t u = 0; u < n; u++)
		p->cost[u] = 1.0f;
	md_epol_set_half_life(p, 0);
	return p;
}

void md_epol_free(struct md_epol *p)
{
	if (!p)
		return;
	free(p->resident);
	free(p->last_use);
	free(p->wcount);
	free(p->hint_p);
	free(p->hint_t);
	free(p->cost);
	free(p->layer_last);
	free(p->layer_seen);
	free(p->transit);
	free(p->reuse);
	free(p->visit_prev);
	free(p->n_cur);
	free(p->n_prev);
	free(p->n_again);
	free(p);
}

/* Move the epoch to now: every scaled count becomes its value at now. */
static void rebase(struct md_epol *p, uint64_t now)
{
	if (now <= p->epoch)
		return;
	double f = exp2(-(double)(now - p->epoch) / (double)p->half_life);
	for (uint32_t u = 0; u < p->n_units; u++)
		p->wcount[u] *= f;
	p->epoch = now;
}

void md_epol_set_half_life(struct md_epol *p, uint64_t ticks)
{
	/* Counts so far decay with the old half-life up to the latest time seen. */
	if (p->half_life)
		rebase(p, p->t_last);
	p->half_life = ticks ? ticks : (uint64_t)DEFAULT_HALF_LIFE_STEPS * p->n_layer;
}

void md_epol_set_cost(struct md_epol *p, uint32_t unit, float cost)
{
	if (unit < p->n_units && cost > 0)
		p->cost[unit] = cost;
}

/* The factor that turns scaled counts into counts at time now. */
static double count_scale(const struct md_epol *p, uint64_t now)
{
	double dt = (double)now - (double)p->epoch;
	return exp2(-dt / (double)p->half_life);
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
	p->transit[unit] = 0;
	p->n_resident--;
}

/* pred's recency bookkeeping for an access of unit (of layer l) at now, before last_use and
 * layer_last move: a new visit closes the last one's reuse share into the average. */
static void note_visit(struct md_epol *p, uint32_t unit, uint32_t l, uint64_t now)
{
	if (!p->layer_seen[l] || now != p->layer_last[l]) { /* a new visit of layer l */
		if (p->layer_seen[l] && p->n_prev[l])
			p->reuse[l] = REUSE_AVG * p->reuse[l] +
				      (1 - REUSE_AVG) * (double)p->n_again[l] / p->n_prev[l];
		p->visit_prev[l] = p->layer_seen[l] ? p->layer_last[l] : 0;
		p->step_units += p->n_cur[l];
		p->step_units -= p->n_prev[l];
		p->n_prev[l] = p->n_cur[l];
		p->n_cur[l] = 0;
		p->n_again[l] = 0;
	}
	if (p->last_use[unit] == now)
		return; /* counted already */
	p->n_cur[l]++;
	if (p->layer_seen[l] && p->visit_prev[l] && p->last_use[unit] == p->visit_prev[l])
		p->n_again[l]++;
}

void md_epol_access(struct md_epol *p, uint32_t unit, uint64_t now)
{
	if (unit >= p->n_units)
		return;
	note_visit(p, unit, unit / p->n_expert, now);
	p->last_use[unit] = now;
	p->transit[unit] = 0;
	if (now > p->t_last)
		p->t_last = now;
	if (now > p->epoch && now - p->epoch > 256 * p->half_life)
		rebase(p, now);
	p->wcount[unit] += 1.0 / count_scale(p, now);
	uint32_t l = unit / p->n_expert;
	p->layer_last[l] = now;
	p->layer_seen[l] = 1;
}

void md_epol_hint(struct md_epol *p, uint32_t unit, float prob, uint64_t now)
{
	if (unit >= p->n_units || !(prob > 0))
		return;
	/* Two hints for one visit (two sequences predicting the same expert): the larger. */
	uint32_t l = unit / p->n_expert;
	bool fresh = p->hint_t[unit] > p->layer_last[l] || (p->hint_t[unit] && !p->layer_seen[l]);
	if (fresh && p->hint_p[unit] >= prob)
		return;
	p->hint_p[unit] = prob > 1 ? 1 : prob;
	p->hint_t[unit] = now ? now : 1;
}

/* pred's keep value of a unit: cost of its miss per tick until its expected next use. scale:
 * count_scale(p, now), rate: 1 - 2^(-P/half-life) (computed once per search). */
static double pred_value(const struct md_epol *p, uint32_t u, uint64_t now, double scale,
			 double rate)
{
	uint32_t l = u / p->n_expert;
	double P = p->n_layer;
	double q = p->wcount[u] * scale * rate;
	bool hint_live = p->hint_t[u] && (p->hint_t[u] > p->layer_last[l] || !p->layer_seen[l]);
	if (hint_live && p->hint_p[u] > q)
		q = p->hint_p[u];
	/* Recency: a unit its layer used at its last visit is used again with the layer's
	 * measured reuse share (about 1 while one token repeats, 0.1 per token on moe64), as long
	 * as a step's units fit in the tier (when they do not, keeping the most recent ones is
	 * lru's thrashing; the aged rate then keeps a steady subset instead). */
	if (p->layer_seen[l] && p->last_use[u] == p->layer_last[l] && p->reuse[l] > q &&
	    3 * p->step_units <= 2 * (uint64_t)p->n_resident)
		q = p->reuse[l];
	if (q > 1)
		q = 1;
	if (q < 1e-9)
		q = 1e-9;
	/* Ticks until layer l runs again: P after its last visit, counted on from now. */
	double d = P;
	if (p->layer_seen[l]) {
		uint64_t since = now > p->layer_last[l] ? now - p->layer_last[l] : 0;
		d = P - (double)(since % p->n_layer);
	}
	return (double)p->cost[u] / (d + P * (1.0 / q - 1.0));
}

static double pred_rate(const struct md_epol *p)
{
	return 1.0 - exp2(-(double)p->n_layer / (double)p->half_life);
}

/* The victim has the lowest score. lfu: the scaled count (the common factor does not change
 * the order). */
static double score(const struct md_epol *p, uint32_t u, uint64_t now, double scale,
		    double rate)
{
	switch (p->kind) {
	case MD_EPOL_LFU:
		return p->wcount[u];
	case MD_EPOL_PRED:
		return pred_value(p, u, now, scale, rate);
	case MD_EPOL_LRU:
	default:
		return (double)p->last_use[u];
	}
}

/* The lowest-scored evictable resident unit; transit ones first (by last use) unless
 * cached_only, which skips them. */
static int64_t search(struct md_epol *p, md_epol_evictable_fn ok, void *arg, uint64_t now,
		      bool cached_only)
{
	int64_t best = -1;
	bool best_tr = false;
	double best_s = 0, scale = count_scale(p, now), rate = pred_rate(p);
	for (uint32_t u = 0; u < p->n_units; u++) {
		if (!p->resident[u] || (cached_only && p->transit[u]) || (ok && !ok(arg, u)))
			continue;
		bool tr = p->transit[u];
		if (best >= 0 && best_tr && !tr)
			continue;
		double s = tr ? (double)p->last_use[u] : score(p, u, now, scale, rate);
		if (best < 0 || (tr && !best_tr) || s < best_s ||
		    (s == best_s && p->last_use[u] < p->last_use[best])) {
			best = u;
			best_s = s;
			best_tr = tr;
		}
	}
	return best;
}

int64_t md_epol_victim(struct md_epol *p, md_epol_evictable_fn ok, void *arg, uint64_t now)
{
	return search(p, ok, arg, now, false);
}

int64_t md_epol_victim_cached(struct md_epol *p, md_epol_evictable_fn ok, void *arg,
			      uint64_t now)
{
	return search(p, ok, arg, now, true);
}

void md_epol_demote(struct md_epol *p, uint32_t unit)
{
	if (unit < p->n_units && p->resident[unit])
		p->transit[unit] = 1;
}

bool md_epol_transit(const struct md_epol *p, uint32_t unit)
{
	return unit < p->n_units && p->transit[unit];
}

bool md_epol_admit(struct md_epol *p, uint32_t unit, uint32_t victim, uint64_t now)
{
	if (p->kind != MD_EPOL_PRED || unit >= p->n_units || victim >= p->n_units)
		return true;
	double scale = count_scale(p, now), rate = pred_rate(p);
	return pred_value(p, unit, now, scale, rate) > pred_value(p, victim, now, scale, rate);
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
