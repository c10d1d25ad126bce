/* Expert-cache simulation on a routing trace (see cache_sim.h). */
#include "bench/cache_sim.h"

#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

/* ---- a growable array of u32 / f32 ---- */

struct vec {
	void *a;
	uint64_t n, cap;
	size_t elt;
};

static int vec_push(struct vec *v, const void *x)
{
	if (v->n == v->cap) {
		uint64_t nc = v->cap ? v->cap * 2 : 1024;
		void *a = realloc(v->a, nc * v->elt);
		if (!a)
			return -ENOMEM;
		v->a = a;
		v->cap = nc;
	}
	memcpy((char *)v->a + v->n * v->elt, x, v->elt);
	v->n++;
	return 0;
}

/* ---- sequence -> last token's experts per layer (the prev predictor) ---- */

struct seq_slot {
	uint64_t seq;
	bool used;
	uint32_t *pos;   /* (n_layer) position of the last token seen at each layer, +1; 0 none */
	int32_t *exp;    /* (n_layer * n_used) */
};

struct seq_map {
	struct seq_slot *s;
	uint64_t cap, n;
	uint32_t n_layer, n_used;
};

static uint64_t mix(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdull;
	x ^= x >> 33;
	return x;
}

static void seq_map_free(struct seq_map *m)
{
	for (uint64_t i = 0; i < m->cap; i++) {
		free(m->s[i].pos);
		free(m->s[i].exp);
	}
	free(m->s);
	memset(m, 0, sizeof(*m));
}

static int seq_map_grow(struct seq_map *m)
{
	uint64_t nc = m->cap ? m->cap * 2 : 256;
	struct seq_slot *ns = calloc(nc, sizeof(*ns));
	if (!ns)
		return -ENOMEM;
	for (uint64_t i = 0; i < m->cap; i++) {
		if (!m->s[i].used)
			continue;
		uint64_t h = mix(m->s[i].seq) & (nc - 1);
		while (ns[h].used)
			h = (h + 1) & (nc - 1);
		ns[h] = m->s[i];
	}
	free(m->s);
	m->s = ns;
	m->cap = nc;
	return 0;
}

static struct seq_slot *seq_map_get(struct seq_map *m, uint64_t seq)
{
	if ((m->n + 1) * 2 > m->cap && seq_map_grow(m))
		return NULL;
	uint64_t h = mix(seq) & (m->cap - 1);
	while (m->s[h].used && m->s[h].seq != seq)
		h = (h + 1) & (m->cap - 1);
	struct seq_slot *sl = &m->s[h];
	if (!sl->used) {
		sl->pos = calloc(m->n_layer, sizeof(*sl->pos));
		sl->exp = calloc((size_t)m->n_layer * m->n_used, sizeof(*sl->exp));
		if (!sl->pos || !sl->exp) {
			free(sl->pos);
			free(sl->exp);
			sl->pos = NULL;
			sl->exp = NULL;
			return NULL;
		}
		sl->used = true;
		sl->seq = seq;
		m->n++;
	}
	return sl;
}

/* ---- building ---- */

static uint32_t count_in(const int32_t *set, uint32_t n, int32_t e)
{
	for (uint32_t i = 0; i < n; i++)
		if (set[i] == e)
			return 1;
	return 0;
}

/* Group-level bookkeeping of one predictor: the units it predicted for the current group. */
static void grp_score(struct md_csim_pred *pr, const uint8_t *pred_mark, uint32_t n_expert,
		      const uint8_t *used_mark)
{
	for (uint32_t e = 0; e < n_expert; e++) {
		pr->grp_predicted += pred_mark[e];
		pr->grp_used += used_mark[e];
		pr->grp_hit += pred_mark[e] & used_mark[e];
	}
}

struct builder {
	const struct md_route_log *log;
	struct md_csim *s;
	struct md_csim_stats *st;
	uint32_t *cooc;              /* (n_layer - 1, E, E) counts */
	uint8_t *used_mark, *prev_mark, *cooc_mark, *pg_mark; /* (E) */
	float *score;                /* (E) */
	int32_t *top;                /* (k) */
	struct seq_map seqs;
	struct vec units, hint_u, hint_p, start, hstart, layers;
	struct vec pg_u, pg_p, pg_start; /* pre-gating's hints, as hint_* */
};

/* cooc's top k for the token whose experts at the layer before are prev (k of them). Returns
 * how many it predicted (0 while nothing was learned). */
static uint32_t cooc_predict(struct builder *b, uint32_t layer, const int32_t *prev)
{
	uint32_t E = b->s->n_expert, k = b->s->n_used;
	const uint32_t *t = b->cooc + (size_t)(layer - 1) * E * E;
	for (uint32_t e = 0; e < E; e++)
		b->score[e] = 0;
	for (uint32_t j = 0; j < k; j++)
		for (uint32_t e = 0; e < E; e++)
			b->score[e] += (float)t[(size_t)prev[j] * E + e];
	uint32_t n = 0;
	for (uint32_t j = 0; j < k; j++) {
		int32_t best = -1;
		for (uint32_t e = 0; e < E; e++)
			if (b->score[e] > 0 && (best < 0 || b->score[e] > b->score[best]))
				best = (int32_t)e;
		if (best < 0)
			break;
		b->top[n++] = best;
		b->score[best] = -1;
	}
	return n;
}

static void cooc_learn(struct builder *b, uint32_t layer, const int32_t *prev, const int32_t *cur)
{
	uint32_t E = b->s->n_expert, k = b->s->n_used;
	uint32_t *t = b->cooc + (size_t)(layer - 1) * E * E;
	for (uint32_t i = 0; i < k; i++)
		for (uint32_t j = 0; j < k; j++)
			t[(size_t)prev[i] * E + cur[j]]++;
}

/* A predictor's precision over the tokens before the current group (whose n_pred predictions
 * and n_hit hits are already counted in p); 0.5 before it has predicted anything. */
static float precision_before(const struct md_csim_pred *p, uint64_t n_pred, uint64_t n_hit)
{
	uint64_t pred = p->tok_predicted - n_pred, hit = p->tok_hit - n_hit;
	return pred ? (float)hit / (float)pred : 0.5f;
}

/* The units of layer marked in mark (E), with probability prob, onto the hint vectors. */
static int push_hints(struct vec *units, struct vec *probs, const uint8_t *mark, uint32_t E,
		      uint32_t layer, float prob)
{
	int rc = 0;
	for (uint32_t x = 0; x < E && !rc; x++) {
		if (!mark[x])
			continue;
		uint32_t u = layer * E + x;
		rc = vec_push(units, &u);
		if (!rc)
			rc = vec_push(probs, &prob);
	}
	return rc;
}

/* One group: records [a, b) of one step and layer; [pa, pb) is the group before it (the layer
 * before in the same step when it has the same rows), or pa == pb. */
static int add_group(struct builder *b, uint64_t a, uint64_t e, uint64_t pa, uint64_t pb)
{
	const struct md_route_log *log = b->log;
	struct md_csim *s = b->s;
	uint32_t E = s->n_expert, k = s->n_used, layer = log->rec[a].layer;
	memset(b->used_mark, 0, E);
	memset(b->prev_mark, 0, E);
	memset(b->cooc_mark, 0, E);
	memset(b->pg_mark, 0, E);
	bool pairs = pb - pa == e - a && layer > 0 && log->rec[pa].layer == layer - 1;
	uint64_t c_pred = 0, c_hit = 0, g_pred = 0, g_hit = 0;
	bool any_pg = false;
	for (uint64_t r = a; r < e; r++) {
		const struct md_route_rec *rec = &log->rec[r];
		const int32_t *cur = log->experts + rec->first;
		for (uint32_t j = 0; j < k; j++)
			b->used_mark[cur[j]] = 1;
		/* pregate: the prediction the trace recorded for this token and layer. */
		if (rec->has_pregate) {
			const int32_t *pg = log->pregate + rec->first;
			any_pg = true;
			b->st->pregate.tok_used += k;
			b->st->pregate.tok_predicted += k;
			for (uint32_t j = 0; j < k; j++) {
				uint32_t hit = count_in(cur, k, pg[j]);
				b->st->pregate.tok_hit += hit;
				g_hit += hit;
				b->pg_mark[pg[j]] = 1;
			}
			g_pred += k;
		}
		/* prev: the sequence's previous token at this layer. */
		struct seq_slot *sl = seq_map_get(&b->seqs, rec->seq);
		if (!sl)
			return -ENOMEM;
		int32_t *last = sl->exp + (size_t)layer * k;
		b->st->prev.tok_used += k;
		if (sl->pos[layer] && sl->pos[layer] == rec->pos) { /* stored +1: pos - 1 */
			b->st->prev.tok_predicted += k;
			for (uint32_t j = 0; j < k; j++) {
				b->st->prev.tok_hit += count_in(cur, k, last[j]);
				b->prev_mark[last[j]] = 1;
			}
		}
		memcpy(last, cur, sizeof(*cur) * k);
		sl->pos[layer] = rec->pos + 1;
		/* cooc: the same token at the layer before. */
		if (!pairs)
			continue;
		const struct md_route_rec *pr = &log->rec[pa + (r - a)];
		if (pr->seq != rec->seq || pr->pos != rec->pos)
			continue;
		const int32_t *before = log->experts + pr->first;
		uint32_t n = cooc_predict(b, layer, before);
		b->st->cooc.tok_used += k;
		b->st->cooc.tok_predicted += n;
		for (uint32_t j = 0; j < n; j++) {
			uint32_t hit = count_in(cur, k, b->top[j]);
			b->st->cooc.tok_hit += hit;
			c_hit += hit;
			b->cooc_mark[b->top[j]] = 1;
		}
		c_pred += n;
		cooc_learn(b, layer, before, cur);
	}
	grp_score(&b->st->prev, b->prev_mark, E, b->used_mark);
	if (pairs)
		grp_score(&b->st->cooc, b->cooc_mark, E, b->used_mark);
	if (any_pg)
		grp_score(&b->st->pregate, b->pg_mark, E, b->used_mark);

	/* Hints before this group: cooc's and pre-gating's predictions, each with its precision
	 * before this group. */
	int rc = push_hints(&b->hint_u, &b->hint_p, b->cooc_mark, E, layer,
			    precision_before(&b->st->cooc, c_pred, c_hit));
	if (!rc)
		rc = push_hints(&b->pg_u, &b->pg_p, b->pg_mark, E, layer,
				precision_before(&b->st->pregate, g_pred, g_hit));
	for (uint32_t x = 0; x < E && !rc; x++) {
		if (!b->used_mark[x])
			continue;
		uint32_t u = layer * E + x;
		rc = vec_push(&b->units, &u);
	}
	if (!rc)
		rc = vec_push(&b->layers, &layer);
	if (!rc)
		rc = vec_push(&b->start, &b->units.n);
	if (!rc)
		rc = vec_push(&b->hstart, &b->hint_u.n);
	if (!rc)
		rc = vec_push(&b->pg_start, &b->pg_u.n);
	return rc;
}

int md_csim_build(struct md_csim *s, const struct md_route_log *log, struct md_csim_stats *st)
{
	memset(s, 0, sizeof(*s));
	memset(st, 0, sizeof(*st));
	s->n_layer = log->n_layer;
	s->n_expert = log->n_expert;
	s->n_used = log->n_used;
	s->n_units = log->n_layer * log->n_expert;
	uint32_t E = s->n_expert;
	struct builder b = {
		.log = log, .s = s, .st = st,
		.seqs = { .n_layer = log->n_layer, .n_used = log->n_used },
		.units = { .elt = sizeof(uint32_t) }, .hint_u = { .elt = sizeof(uint32_t) },
		.hint_p = { .elt = sizeof(float) }, .start = { .elt = sizeof(uint64_t) },
		.hstart = { .elt = sizeof(uint64_t) }, .layers = { .elt = sizeof(uint32_t) },
		.pg_u = { .elt = sizeof(uint32_t) }, .pg_p = { .elt = sizeof(float) },
		.pg_start = { .elt = sizeof(uint64_t) },
	};
	size_t n_cooc = log->n_layer > 1 ? (size_t)(log->n_layer - 1) * E * E : 1;
	b.cooc = calloc(n_cooc, sizeof(*b.cooc));
	b.used_mark = calloc(E, 1);
	b.prev_mark = calloc(E, 1);
	b.cooc_mark = calloc(E, 1);
	b.pg_mark = calloc(E, 1);
	b.score = calloc(E, sizeof(*b.score));
	b.top = calloc(log->n_used, sizeof(*b.top));
	uint64_t zero = 0;
	int rc = -ENOMEM;
	if (!b.cooc || !b.used_mark || !b.prev_mark || !b.cooc_mark || !b.pg_mark || !b.score ||
	    !b.top || vec_push(&b.start, &zero) || vec_push(&b.hstart, &zero) ||
	    vec_push(&b.pg_start, &zero))
		goto out;
	rc = 0;
	uint64_t pa = 0, pb = 0;
	for (uint64_t a = 0; a < log->n_rec && !rc;) {
		uint64_t e = a + 1;
		while (e < log->n_rec && log->rec[e].step == log->rec[a].step &&
		       log->rec[e].layer == log->rec[a].layer)
			e++;
		bool same_step = pb > pa && log->rec[pa].step == log->rec[a].step;
		rc = add_group(&b, a, e, same_step ? pa : 0, same_step ? pb : 0);
		pa = a;
		pb = e;
		a = e;
	}
out:
	free(b.cooc);
	free(b.used_mark);
	free(b.prev_mark);
	free(b.cooc_mark);
	free(b.pg_mark);
	free(b.score);
	free(b.top);
	seq_map_free(&b.seqs);
	if (rc) {
		free(b.units.a);
		free(b.hint_u.a);
		free(b.hint_p.a);
		free(b.start.a);
		free(b.hstart.a);
		free(b.layers.a);
		free(b.pg_u.a);
		free(b.pg_p.a);
		free(b.pg_start.a);
		memset(s, 0, sizeof(*s));
		return rc;
	}
	s->n_groups = b.layers.n;
	s->start = b.start.a;
	s->units = b.units.a;
	s->layer = b.layers.a;
	s->hint_start = b.hstart.a;
	s->hint_unit = b.hint_u.a;
	s->hint_p = b.hint_p.a;
	s->pg_start = b.pg_start.a;
	s->pg_unit = b.pg_u.a;
	s->pg_p = b.pg_p.a;
	s->has_pregate = log->n_pregate > 0;
	return 0;
}

void md_csim_release(struct md_csim *s)
{
	free(s->start);
	free(s->units);
	free(s->layer);
	free(s->hint_start);
	free(s->hint_unit);
	free(s->hint_p);
	free(s->pg_start);
	free(s->pg_unit);
	free(s->pg_p);
	memset(s, 0, sizeof(*s));
}

/* ---- replay ---- */

struct in_use {
	const uint8_t *mark; /* (n_units): used by the current group */
};

static bool evictable(void *arg, uint32_t unit)
{
	const struct in_use *iu = arg;
	return iu->mark[unit] != 1;
}

int md_csim_replay(const struct md_csim *s, enum md_epol_kind kind, uint32_t capacity,
		   unsigned flags, uint64_t half_life, struct md_csim_result *out)
{
	memset(out, 0, sizeof(*out));
	struct md_epol *p = md_epol_new(kind, s->n_layer, s->n_expert);
	uint8_t *mark = calloc(s->n_units, 1);
	if (!p || !mark) {
		md_epol_free(p);
		free(mark);
		return -ENOMEM;
	}
	if (half_life)
		md_epol_set_half_life(p, half_life);
	struct in_use iu = { mark };
	const uint64_t *hs = s->hint_start;
	const uint32_t *hu = s->hint_unit;
	const float *hp = s->hint_p;
	if (flags & MD_CSIM_PREGATE) {
		hs = s->pg_start;
		hu = s->pg_unit;
		hp = s->pg_p;
	}
	for (uint64_t g = 0; g < s->n_groups; g++) {
		uint64_t now = g + 1;
		/* Hints and prefetches for group g come while group g - 1 computes (tick now - 1):
		 * its units are in use. */
		if (g > 0 && (flags & MD_CSIM_PREFETCH))
			for (uint64_t i = s->start[g - 1]; i < s->start[g]; i++)
				mark[s->units[i]] = 1;
		for (uint64_t h = hs[g]; h < hs[g + 1] && flags; h++) {
			uint32_t u = hu[h];
			md_epol_hint(p, u, hp[h], now - 1 ? now - 1 : 1);
			if (!(flags & MD_CSIM_PREFETCH) || md_epol_resident(p, u) || capacity == 0)
				continue;
			if (md_epol_n_resident(p) >= capacity) {
				int64_t v = md_epol_victim(p, evictable, &iu, now - 1);
				if (v < 0 || !md_epol_admit(p, u, (uint32_t)v, now - 1))
					continue;
				md_epol_remove(p, (uint32_t)v);
			}
			md_epol_insert(p, u, now - 1);
			mark[u] = 2; /* prefetched, not in use: may be evicted by the next one */
			out->prefetched++;
		}
		for (uint64_t i = s->start[g]; i < s->start[g + 1]; i++)
			out->prefetch_used += mark[s->units[i]] == 2;
		if (g > 0 && (flags & MD_CSIM_PREFETCH)) {
			for (uint64_t i = s->start[g - 1]; i < s->start[g]; i++)
				mark[s->units[i]] = 0;
			for (uint64_t h = hs[g]; h < hs[g + 1]; h++)
				mark[hu[h]] = 0;
		}
		for (uint64_t i = s->start[g]; i < s->start[g + 1]; i++) {
			uint32_t u = s->units[i];
			mark[u] = 1;
			out->accesses++;
			out->hits += md_epol_resident(p, u);
			md_epol_access(p, u, now);
		}
		for (uint64_t i = s->start[g]; i < s->start[g + 1]; i++) {
			uint32_t u = s->units[i];
			if (md_epol_resident(p, u) || capacity == 0)
				continue;
			if (md_epol_n_resident(p) >= capacity) {
				int64_t v = md_epol_victim(p, evictable, &iu, now);
				/* everything resident in use, or the policy would rather keep the
				 * victim: stream the unit through */
				if (v < 0 || !md_epol_admit(p, u, (uint32_t)v, now))
					continue;
				md_epol_remove(p, (uint32_t)v);
			}
			md_epol_insert(p, u, now);
		}
		for (uint64_t i = s->start[g]; i < s->start[g + 1]; i++)
			mark[s->units[i]] = 0;
	}
	md_epol_free(p);
	free(mark);
	return 0;
}

/* Belady's MIN; with pf, also reading pre-gating's predictions for each group ahead of it
 * (while the group before runs, so not over its units) whenever a predicted unit's next use
 * comes sooner than the farthest one resident: the offline reference for a store that
 * prefetches what pre-gating names. */
static int belady(const struct md_csim *s, uint32_t capacity, bool pf, struct md_csim_result *out)
{
	memset(out, 0, sizeof(*out));
	uint64_t n_acc = s->start[s->n_groups];
	uint64_t *next = malloc(sizeof(*next) * (n_acc ? n_acc : 1));  /* group of the next use */
	uint64_t *up = malloc(sizeof(*up) * s->n_units);  /* each unit's next use from now on */
	uint8_t *res = calloc(s->n_units, 1);
	uint8_t *mark = calloc(s->n_units, 1);  /* 1: used by the group before; 2: read ahead */
	if (!next || !up || !res || !mark) {
		free(next);
		free(up);
		free(res);
		free(mark);
		return -ENOMEM;
	}
	const uint64_t never = UINT64_MAX;
	for (uint32_t u = 0; u < s->n_units; u++)
		up[u] = never;
	for (uint64_t g = s->n_groups; g-- > 0;)
		for (uint64_t i = s->start[g]; i < s->start[g + 1]; i++) {
			next[i] = up[s->units[i]];
			up[s->units[i]] = g;
		}
	uint32_t n_res = 0;
	for (uint64_t g = 0; g < s->n_groups; g++) {
		if (pf && s->pg_start && capacity > 0) {
			if (g > 0)
				for (uint64_t i = s->start[g - 1]; i < s->start[g]; i++)
					mark[s->units[i]] = 1;
			for (uint64_t h = s->pg_start[g]; h < s->pg_start[g + 1]; h++) {
				uint32_t u = s->pg_unit[h];
				if (res[u])
					continue;
				if (n_res >= capacity) {
					int64_t far = -1;
					for (uint32_t v = 0; v < s->n_units; v++)
						if (res[v] && mark[v] != 1 && (far < 0 || up[v] > up[far]))
							far = v;
					if (far < 0 || up[far] <= up[u])
						continue;
					res[far] = 0;
					n_res--;
				}
				res[u] = 1;
				n_res++;
				mark[u] = 2;
				out->prefetched++;
			}
			if (g > 0)
				for (uint64_t i = s->start[g - 1]; i < s->start[g]; i++)
					if (mark[s->units[i]] == 1)
						mark[s->units[i]] = 0;
		}
		for (uint64_t i = s->start[g]; i < s->start[g + 1]; i++) {
			uint32_t u = s->units[i];
			out->accesses++;
			out->hits += res[u];
			out->prefetch_used += mark[u] == 2;
			if (!res[u]) {
				res[u] = 1;
				n_res++;
			}
			up[u] = next[i];
		}
		if (pf && s->pg_start)
			for (uint64_t h = s->pg_start[g]; h < s->pg_start[g + 1]; h++)
				mark[s->pg_unit[h]] = 0;
		/* Keep the capacity units used soonest: drop the farthest next uses. */
		while (n_res > capacity) {
			int64_t far = -1;
			for (uint32_t u = 0; u < s->n_units; u++)
				if (res[u] && (far < 0 || up[u] > up[far]))
					far = u;
			res[far] = 0;
			n_res--;
		}
	}
	free(next);
	free(up);
	free(res);
	free(mark);
	return 0;
}

int md_csim_belady(const struct md_csim *s, uint32_t capacity, struct md_csim_result *out)
{
	return belady(s, capacity, false, out);
}

int md_csim_belady_pregate(const struct md_csim *s, uint32_t capacity, struct md_csim_result *out)
{
	return belady(s, capacity, true, out);
}

static int cmp_count_desc(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x > y ? -1 : x < y;
}

int md_csim_static_best(const struct md_csim *s, uint32_t capacity, struct md_csim_result *out)
{
	memset(out, 0, sizeof(*out));
	uint64_t *cnt = calloc(s->n_units, sizeof(*cnt));
	if (!cnt)
		return -ENOMEM;
	for (uint64_t i = 0; i < s->start[s->n_groups]; i++)
		cnt[s->units[i]]++;
	qsort(cnt, s->n_units, sizeof(*cnt), cmp_count_desc);
	out->accesses = s->start[s->n_groups];
	for (uint32_t i = 0; i < capacity && i < s->n_units; i++)
		out->hits += cnt[i];
	free(cnt);
	return 0;
}

uint32_t md_csim_hot_set(const struct md_csim *s, double share)
{
	uint64_t *cnt = calloc(s->n_units ? s->n_units : 1, sizeof(*cnt));
	if (!cnt)
		return 0;
	uint64_t total = s->start[s->n_groups];
	for (uint64_t i = 0; i < total; i++)
		cnt[s->units[i]]++;
	qsort(cnt, s->n_units, sizeof(*cnt), cmp_count_desc);
	uint64_t sum = 0;
	uint32_t n = 0;
	while (n < s->n_units && (double)sum < share * (double)total)
		sum += cnt[n++];
	free(cnt);
	return n;
}
