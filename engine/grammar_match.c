/* Constrained decoding, matching: the vocabulary trie and the per-sequence matcher with its
 * cached states and token masks (engine/grammar.h). */
#include "engine/grammar.h"

/*
 * DESIGN: see grammar.h (the model) and grammar.c (the compiled form). The matcher works on
 * struct md_grammar's flattened elements (grammar_int.h) and never sees grammar text.
 */

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/grammar_int.h"
#include "engine/tokenizer.h"

/* ---- the vocabulary trie ---- */

struct tnode {
	uint32_t skip;     /* index of the first node after this subtree */
	uint32_t tok_off;  /* tokens ending here: toks[tok_off .. tok_off + tok_n) */
	uint32_t tok_n;
	uint32_t depth;    /* 1 = a child of the root */
	uint8_t byte;
};

struct md_gvocab {
	uint32_t n_vocab, words;
	char *bytes;       /* owned: every token's bytes */
	uint32_t *off;     /* owned (n_vocab + 1): token t is bytes[off[t] .. off[t + 1]) */
	uint32_t *eog;     /* owned (words): end-of-generation tokens */
	struct tnode *nodes; /* owned (n_nodes), preorder */
	uint32_t n_nodes, max_depth;
	int32_t *toks;     /* owned: token ids, grouped by trie node */
};

struct tok_ent {
	const char *p;
	uint32_t len;
	int32_t id;
};

static int cmp_tok(const void *x, const void *y)
{
	const struct tok_ent *a = x, *c = y;
	uint32_t n = a->len < c->len ? a->len : c->len;
	int r = memcmp(a->p, c->p, n);
	if (r)
		return r;
	if (a->len != c->len)
		return a->len < c->len ? -1 : 1;
	return a->id < c->id ? -1 : a->id > c->id;
}

void md_gvocab_free(struct md_gvocab *v)
{
	if (!v)
		return;
	free(v->bytes);
	free(v->off);
	free(v->eog);
	free(v->nodes);
	free(v->toks);
	free(v);
}

uint32_t md_gvocab_n_vocab(const struct md_gvocab *v)
{
	return v->n_vocab;
}

static int build_trie(struct md_gvocab *v)
{
	uint32_t V = v->n_vocab, n = 0;
	size_t total = v->off[V];
	struct tok_ent *ents = malloc(sizeof(*ents) * (V ? V : 1));
	/* at most one node per byte of every token */
	v->nodes = malloc(sizeof(*v->nodes) * (total ? total : 1));
	v->toks = malloc(sizeof(int32_t) * (V ? V : 1));
	uint32_t *path = NULL;
	uint32_t maxlen = 0;
	if (!ents || !v->nodes || !v->toks)
		goto nomem;
	for (uint32_t t = 0; t < V; t++) {
		uint32_t l = v->off[t + 1] - v->off[t];
		if (l == 0)
			continue;
		ents[n++] = (struct tok_ent){ v->bytes + v->off[t], l, (int32_t)t };
		if (l > maxlen)
			maxlen = l;
	}
	qsort(ents, n, sizeof(*ents), cmp_tok);
	path = malloc(sizeof(uint32_t) * (maxlen + 1));
	if (!path)
		goto nomem;
	uint32_t nn = 0, prev_len = 0;
	const char *prev = NULL;
	for (uint32_t k = 0; k < n; k++) {
		const struct tok_ent *e = &ents[k];
		uint32_t lcp = 0;
		while (prev && lcp < prev_len && lcp < e->len && prev[lcp] == e->p[lcp])
			lcp++;
		for (uint32_t d = prev_len; d > lcp; d--)
			v->nodes[path[d]].skip = nn;
		for (uint32_t d = lcp + 1; d <= e->len; d++) {
			v->nodes[nn] = (struct tnode){ .depth = d, .byte = (uint8_t)e->p[d - 1] };
			path[d] = nn++;
		}
		struct tnode *t = &v->nodes[path[e->len]];
		if (t->tok_n == 0)
			t->tok_off = k;
		t->tok_n++;
		v->toks[k] = e->id;
		prev = e->p;
		prev_len = e->len;
	}
	for (uint32_t d = prev_len; d > 0; d--)
		v->nodes[path[d]].skip = nn;
	v->n_nodes = nn;
	v->max_depth = maxlen;
	free(path);
	free(ents);
	return 0;
nomem:
	free(path);
	free(ents);
	return -ENOMEM;
}

int md_gvocab_new_pieces(struct md_gvocab **out, const char *const *pieces, const size_t *lens,
			 const bool *eog, uint32_t n_vocab)
{
	*out = NULL;
	struct md_gvocab *v = calloc(1, sizeof(*v));
	if (!v)
		return -ENOMEM;
	v->n_vocab = n_vocab;
	v->words = (n_vocab + 31) / 32;
	size_t total = 0;
	for (uint32_t t = 0; t < n_vocab; t++)
		total += lens[t];
	if (total > UINT32_MAX / 2)
		goto nomem;
	v->bytes = malloc(total ? total : 1);
	v->off = malloc(sizeof(uint32_t) * (n_vocab + 1));
	v->eog = calloc(v->words ? v->words : 1, sizeof(uint32_t));
	if (!v->bytes || !v->off || !v->eog)
		goto nomem;
	uint32_t at = 0;
	for (uint32_t t = 0; t < n_vocab; t++) {
		v->off[t] = at;
		if (lens[t])
			memcpy(v->bytes + at, pieces[t], lens[t]);
		at += (uint32_t)lens[t];
		if (eog && eog[t])
			v->eog[t >> 5] |= 1u << (t & 31);
	}
	v->off[n_vocab] = at;
	if (build_trie(v))
		goto nomem;
	*out = v;
	return 0;
nomem:
	md_gvocab_free(v);
	return -ENOMEM;
}

int md_gvocab_new(struct md_gvocab **out, const struct md_tokenizer *t)
{
	uint32_t V = md_tokenizer_n_vocab(t);
	char **pieces = calloc(V ? V : 1, sizeof(char *));
	size_t *lens = calloc(V ? V : 1, sizeof(size_t));
	bool *eog = calloc(V ? V : 1, sizeof(bool));
	int rc = -ENOMEM;
	if (!pieces || !lens || !eog)
		goto out;
	for (uint32_t i = 0; i < V; i++) {
		enum md_token_type ty = md_tokenizer_type(t, (int32_t)i);
		eog[i] = md_tokenizer_is_eog(t, (int32_t)i);
		if (eog[i] || ty == MD_TOKEN_CONTROL || ty == MD_TOKEN_UNUSED ||
		    ty == MD_TOKEN_UNKNOWN)
			continue;
		char buf[512];
		int n = md_tokenizer_piece(t, (int32_t)i, buf, sizeof(buf));
		if (n <= 0)
			continue;
		if (n > (int)sizeof(buf)) {
			if (!(pieces[i] = malloc((size_t)n)))
				goto out;
			md_tokenizer_piece(t, (int32_t)i, pieces[i], (size_t)n);
		} else {
			if (!(pieces[i] = malloc((size_t)n)))
				goto out;
			memcpy(pieces[i], buf, (size_t)n);
		}
		lens[i] = (size_t)n;
	}
	rc = md_gvocab_new_pieces(out, (const char *const *)pieces, lens, eog, V);
out:
	for (uint32_t i = 0; pieces && i < V; i++)
		free(pieces[i]);
	free(pieces);
	free(lens);
	free(eog);
	return rc;
}

/* ---- the matcher ---- */

struct gnode {
	uint32_t pos;      /* element index: the next element of this frame */
	int32_t parent;    /* node id, -1 at the bottom */
	uint32_t cost;     /* fewest bytes that complete this stack (this frame and below) */
};

struct gstate {
	uint32_t off, n;   /* node ids: pool[off .. off + n), sorted */
	bool accept;
	uint32_t min_left; /* fewest bytes that complete the grammar from here (0 when accepting) */
	uint32_t max_next; /* largest min_left after one allowed token (set with mask) */
	int32_t *trans;    /* owned (256) or NULL: -2 unknown, -1 dead, else a state id */
	uint32_t *mask;    /* owned (words) or NULL until asked */
};

struct md_gmatch {
	struct md_grammar *g;        /* owned reference */
	const struct md_gvocab *v;   /* borrowed */
	struct gnode *nodes;         /* owned (cap_nodes) */
	uint32_t n_nodes, cap_nodes;
	uint32_t *node_ht;           /* owned (node_ht_cap): node id + 1, 0 = free */
	uint32_t node_ht_cap;
	uint32_t *pool;              /* owned (cap_pool): states' node lists */
	size_t n_pool, cap_pool;
	struct gstate *states;       /* owned (cap_states) */
	uint32_t n_states, cap_states;
	uint32_t *state_ht;          /* owned (state_ht_cap): state id + 1, 0 = free */
	uint32_t state_ht_cap;
	struct u32vec scratch;       /* owned: a state being built */
	uint32_t *budget_mask;       /* owned (words): md_gmatch_mask_budget's filtered mask */
	int32_t *walk;               /* owned (max_depth + 1): trie walk, state per depth */
	int32_t cur;
};

static uint64_t mix64(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdull;
	x ^= x >> 33;
	x *= 0xc4ceb9fe1a85ec53ull;
	return x ^ (x >> 33);
}

static uint64_t node_hash(uint32_t pos, int32_t parent)
{
	return mix64(((uint64_t)pos << 32) ^ (uint32_t)parent);
}

static int node_ht_grow(struct md_gmatch *m)
{
	uint32_t nc = m->node_ht_cap ? m->node_ht_cap * 2 : 1024;
	uint32_t *nh = calloc(nc, sizeof(uint32_t));
	if (!nh)
		return -ENOMEM;
	for (uint32_t i = 0; i < m->n_nodes; i++) {
		uint32_t j = (uint32_t)node_hash(m->nodes[i].pos, m->nodes[i].parent) & (nc - 1);
		while (nh[j])
			j = (j + 1) & (nc - 1);
		nh[j] = i + 1;
	}
	free(m->node_ht);
	m->node_ht = nh;
	m->node_ht_cap = nc;
	return 0;
}

/* The node (pos, parent): its id, or a negative code. */
static int32_t node_intern(struct md_gmatch *m, uint32_t pos, int32_t parent)
{
	if ((m->n_nodes + 1) * 2 > m->node_ht_cap && node_ht_grow(m))
		return -ENOMEM;
	uint32_t mask = m->node_ht_cap - 1;
	uint32_t j = (uint32_t)node_hash(pos, parent) & mask;
	while (m->node_ht[j]) {
		const struct gnode *n = &m->nodes[m->node_ht[j] - 1];
		if (n->pos == pos && n->parent == parent)
			return (int32_t)(m->node_ht[j] - 1);
		j = (j + 1) & mask;
	}
	if (m->n_nodes >= (uint32_t)INT32_MAX / 2)
		return -E2BIG;
	if (m->n_nodes == m->cap_nodes) {
		uint32_t nc = m->cap_nodes ? m->cap_nodes * 2 : 1024;
		struct gnode *nn = realloc(m->nodes, sizeof(*nn) * nc);
		if (!nn)
			return -ENOMEM;
		m->nodes = nn;
		m->cap_nodes = nc;
	}
	uint32_t cost = sat_add(m->g->suffix_min[pos], parent >= 0 ? m->nodes[parent].cost : 0);
	m->nodes[m->n_nodes] = (struct gnode){ pos, parent, cost };
	m->node_ht[j] = m->n_nodes + 1;
	return (int32_t)m->n_nodes++;
}

/* Make every top a byte set: add the stacks reached from (pos, parent) to m->scratch. */
static int expand(struct md_gmatch *m, uint32_t pos, int32_t parent, bool *accept, int depth)
{
	const struct md_grammar *g = m->g;
	if (depth > MAX_EXPAND_DEPTH)
		return -E2BIG;
	for (;;) {
		uint32_t e = g->el[pos];
		switch (EL_TYPE(e)) {
		case EL_BYTES: {
			int32_t id = node_intern(m, pos, parent);
			if (id < 0)
				return id;
			if (m->scratch.n >= MD_GRAMMAR_MAX_STACKS * 4)
				return -E2BIG;
			return vec_push(&m->scratch, (uint32_t)id);
		}
		case EL_END:
			if (parent < 0) {
				*accept = true;
				return 0;
			}
			pos = m->nodes[parent].pos;
			parent = m->nodes[parent].parent;
			continue; /* a pop: no deeper recursion */
		default: {
			/* A reference in tail position returns straight to the parent (the END
			 * after it would only pop): without this, each turn of a right-recursive
			 * repetition would push a frame, and no two string characters would share
			 * a state or a cached mask. */
			uint32_t r = EL_VAL(e);
			int32_t ret = EL_TYPE(g->el[pos + 1]) == EL_END ? parent
								       : node_intern(m, pos + 1, parent);
			if (ret < -1)
				return ret;
			for (uint32_t a = g->rule_alt[r]; a < g->rule_alt[r + 1]; a++) {
				int rc = expand(m, g->alt_start[a], ret, accept, depth + 1);
				if (rc)
					return rc;
			}
			return 0;
		}
		}
	}
}

static int cmp_u32(const void *x, const void *y)
{
	uint32_t a = *(const uint32_t *)x, c = *(const uint32_t *)y;
	return a < c ? -1 : a > c;
}

static uint64_t state_hash(const uint32_t *ids, uint32_t n, bool accept)
{
	uint64_t h = accept ? 0x9e3779b97f4a7c15ull : 0x7f4a7c159e3779b9ull;
	for (uint32_t i = 0; i < n; i++)
		h = mix64(h ^ ids[i]);
	return h ^ n;
}

static int state_ht_grow(struct md_gmatch *m)
{
	uint32_t nc = m->state_ht_cap ? m->state_ht_cap * 2 : 256;
	uint32_t *nh = calloc(nc, sizeof(uint32_t));
	if (!nh)
		return -ENOMEM;
	for (uint32_t i = 0; i < m->n_states; i++) {
		const struct gstate *s = &m->states[i];
		uint32_t j = (uint32_t)state_hash(m->pool + s->off, s->n, s->accept) & (nc - 1);
		while (nh[j])
			j = (j + 1) & (nc - 1);
		nh[j] = i + 1;
	}
	free(m->state_ht);
	m->state_ht = nh;
	m->state_ht_cap = nc;
	return 0;
}

/* Intern the state in m->scratch (sorted and deduplicated here). Returns its id, or -1 for the
 * dead state (no stack, not accepting) and for errors, which go to *err (-ENOMEM, -E2BIG). */
static int32_t state_intern(struct md_gmatch *m, bool accept, int *err)
{
	struct u32vec *sc = &m->scratch;
	*err = 0;
	if (sc->n > 1) {
		qsort(sc->a, sc->n, sizeof(uint32_t), cmp_u32);
		uint32_t k = 1;
		for (uint32_t i = 1; i < sc->n; i++)
			if (sc->a[i] != sc->a[k - 1])
				sc->a[k++] = sc->a[i];
		sc->n = k;
	}
	if (sc->n == 0 && !accept)
		return -1;
	if (sc->n > MD_GRAMMAR_MAX_STACKS) {
		*err = -E2BIG;
		return -1;
	}
	if ((m->n_states + 1) * 2 > m->state_ht_cap && state_ht_grow(m)) {
		*err = -ENOMEM;
		return -1;
	}
	uint32_t mask = m->state_ht_cap - 1;
	uint32_t j = (uint32_t)state_hash(sc->a, sc->n, accept) & mask;
	while (m->state_ht[j]) {
		const struct gstate *s = &m->states[m->state_ht[j] - 1];
		if (s->n == sc->n && s->accept == accept &&
		    (sc->n == 0 || memcmp(m->pool + s->off, sc->a, sizeof(uint32_t) * sc->n) == 0))
			return (int32_t)(m->state_ht[j] - 1);
		j = (j + 1) & mask;
	}
	if (m->n_states >= MD_GRAMMAR_MAX_STATES) {
		*err = -E2BIG;
		return -1;
	}
	if (m->n_states == m->cap_states) {
		uint32_t nc = m->cap_states ? m->cap_states * 2 : 64;
		struct gstate *ns = realloc(m->states, sizeof(*ns) * nc);
		if (!ns) {
			*err = -ENOMEM;
			return -1;
		}
		m->states = ns;
		m->cap_states = nc;
	}
	if (m->n_pool + sc->n > m->cap_pool) {
		size_t nc = m->cap_pool ? m->cap_pool * 2 : 1024;
		while (nc < m->n_pool + sc->n)
			nc *= 2;
		uint32_t *np = realloc(m->pool, sizeof(uint32_t) * nc);
		if (!np) {
			*err = -ENOMEM;
			return -1;
		}
		m->pool = np;
		m->cap_pool = nc;
	}
	if (sc->n)
		memcpy(m->pool + m->n_pool, sc->a, sizeof(uint32_t) * sc->n);
	uint32_t min_left = accept ? 0 : MIN_INF;
	for (uint32_t i = 0; i < sc->n; i++)
		if (m->nodes[sc->a[i]].cost < min_left)
			min_left = m->nodes[sc->a[i]].cost;
	m->states[m->n_states] = (struct gstate){ .off = (uint32_t)m->n_pool, .n = sc->n,
						  .accept = accept, .min_left = min_left };
	m->n_pool += sc->n;
	m->state_ht[j] = m->n_states + 1;
	return (int32_t)m->n_states++;
}

/* The state after byte c from state s: an id, -1 dead, or -ENOMEM/-E2BIG in *err. */
static int32_t advance(struct md_gmatch *m, int32_t s, uint8_t c, int *err)
{
	struct gstate *st = &m->states[s];
	*err = 0;
	if (st->trans && st->trans[c] != -2)
		return st->trans[c];
	if (!st->trans) {
		st->trans = malloc(sizeof(int32_t) * 256);
		if (!st->trans) {
			*err = -ENOMEM;
			return -1;
		}
		for (int i = 0; i < 256; i++)
			st->trans[i] = -2;
	}
	const struct md_grammar *g = m->g;
	bool accept = false;
	m->scratch.n = 0;
	uint32_t off = st->off, n = st->n;
	for (uint32_t i = 0; i < n; i++) {
		struct gnode nd = m->nodes[m->pool[off + i]];
		const uint32_t *set = g->sets[EL_VAL(g->el[nd.pos])];
		if (set[c >> 5] >> (c & 31) & 1) {
			int rc = expand(m, nd.pos + 1, nd.parent, &accept, 0);
			if (rc) {
				*err = rc;
				return -1;
			}
		}
	}
	int32_t t = state_intern(m, accept, err);
	if (*err)
		return -1;
	m->states[s].trans[c] = t; /* states may have moved */
	return t;
}

int md_gmatch_new(struct md_gmatch **out, struct md_grammar *g, const struct md_gvocab *v)
{
	*out = NULL;
	struct md_gmatch *m = calloc(1, sizeof(*m));
	if (!m)
		return -ENOMEM;
	m->g = md_grammar_ref(g);
	m->v = v;
	m->walk = malloc(sizeof(int32_t) * (v->max_depth + 1));
	if (!m->walk) {
		md_gmatch_free(m);
		return -ENOMEM;
	}
	bool accept = false;
	int rc = 0;
	for (uint32_t a = g->rule_alt[g->root]; a < g->rule_alt[g->root + 1] && !rc; a++)
		rc = expand(m, g->alt_start[a], -1, &accept, 0);
	int32_t s = -1;
	if (!rc)
		s = state_intern(m, accept, &rc);
	if (rc || s < 0) {
		md_gmatch_free(m);
		return rc ? rc : -EINVAL;
	}
	m->cur = s;
	*out = m;
	return 0;
}

void md_gmatch_free(struct md_gmatch *m)
{
	if (!m)
		return;
	for (uint32_t i = 0; i < m->n_states; i++) {
		free(m->states[i].trans);
		free(m->states[i].mask);
	}
	free(m->states);
	free(m->state_ht);
	free(m->pool);
	free(m->nodes);
	free(m->node_ht);
	free(m->scratch.a);
	free(m->budget_mask);
	free(m->walk);
	md_grammar_unref(m->g);
	free(m);
}

/* One walk of the trie from state s: set in bits (zeroed here) every token allowed there
 * whose end state can still complete in at most limit bytes; *max_next and *min_next get the
 * largest and smallest min_left among the end states of all the tokens allowed there. */
static int walk_trie(struct md_gmatch *m, int32_t s, uint32_t limit, uint32_t *bits,
		     uint32_t *max_next, uint32_t *min_next)
{
	const struct md_gvocab *v = m->v;
	int32_t *walk = m->walk;
	uint32_t mx = 0, mn = MIN_INF;
	memset(bits, 0, sizeof(uint32_t) * v->words);
	walk[0] = s;
	const struct tnode *nodes = v->nodes;
	for (uint32_t i = 0; i < v->n_nodes;) {
		const struct tnode *nd = &nodes[i];
		int32_t ps = walk[nd->depth - 1];
		const int32_t *tr = m->states[ps].trans;
		int32_t t = tr ? tr[nd->byte] : -2;
		if (t == -2) {
			int err;
			t = advance(m, ps, nd->byte, &err);
			if (err)
				return err;
		}
		if (t < 0) {
			i = nd->skip;
			continue;
		}
		uint32_t left = m->states[t].min_left;
		if (nd->tok_n) {
			if (left > mx)
				mx = left;
			if (left < mn)
				mn = left;
		}
		if (nd->tok_n && left <= limit) {
			for (uint32_t k = 0; k < nd->tok_n; k++) {
				int32_t id = v->toks[nd->tok_off + k];
				bits[id >> 5] |= 1u << (id & 31);
			}
		}
		walk[nd->depth] = t;
		i++;
	}
	if (m->states[s].accept)
		for (uint32_t w = 0; w < v->words; w++)
			bits[w] |= v->eog[w];
	*max_next = mx;
	*min_next = mn;
	return 0;
}

/* Compute the mask of state s. */
static int compute_mask(struct md_gmatch *m, int32_t s)
{
	const struct md_gvocab *v = m->v;
	uint32_t *bits = malloc(sizeof(uint32_t) * (v->words ? v->words : 1)), mx, mn;
	if (!bits)
		return -ENOMEM;
	int rc = walk_trie(m, s, UINT32_MAX, bits, &mx, &mn);
	if (rc) {
		free(bits);
		return rc;
	}
	m->states[s].mask = bits;
	m->states[s].max_next = mx;
	return 0;
}

int md_gmatch_mask(struct md_gmatch *m, const uint32_t **bits)
{
	if (!m->states[m->cur].mask) {
		int rc = compute_mask(m, m->cur);
		if (rc)
			return rc;
	}
	*bits = m->states[m->cur].mask;
	return 0;
}

int md_gmatch_mask_budget(struct md_gmatch *m, uint32_t budget, const uint32_t **bits)
{
	int rc = md_gmatch_mask(m, bits);
	if (rc || budget == 0 || m->states[m->cur].max_next <= budget - 1)
		return rc;
	const struct md_gvocab *v = m->v;
	if (!m->budget_mask && !(m->budget_mask = malloc(sizeof(uint32_t) * (v->words ? v->words : 1))))
		return -ENOMEM;
	uint32_t mx, mn;
	if ((rc = walk_trie(m, m->cur, budget - 1, m->budget_mask, &mx, &mn)))
		return rc;
	bool any = m->states[m->cur].accept;
	for (uint32_t w = 0; w < v->words && !any; w++)
		any = m->budget_mask[w] != 0;
	/* Nothing fits in bytes (a budget short from the start; tokens often hold several
	 * bytes, so it may still fit): the tokens that bring the end nearest. */
	if (!any && mn < MIN_INF && (rc = walk_trie(m, m->cur, mn, m->budget_mask, &mx, &mn)))
		return rc;
	*bits = m->budget_mask;
	return 0;
}

uint32_t md_gmatch_min_left(const struct md_gmatch *m)
{
	return m->states[m->cur].min_left;
}

int md_gmatch_accept_bytes(struct md_gmatch *m, const char *s, size_t n)
{
	int32_t st = m->cur;
	for (size_t i = 0; i < n; i++) {
		int err;
		st = advance(m, st, (uint8_t)s[i], &err);
		if (err)
			return err;
		if (st < 0)
			return -EINVAL;
	}
	m->cur = st;
	return 0;
}

int md_gmatch_accept(struct md_gmatch *m, int32_t token)
{
	const struct md_gvocab *v = m->v;
	if (token < 0 || (uint32_t)token >= v->n_vocab)
		return -EINVAL;
	if (v->eog[token >> 5] >> (token & 31) & 1)
		return m->states[m->cur].accept ? 0 : -EINVAL;
	uint32_t len = v->off[token + 1] - v->off[token];
	if (len == 0)
		return -EINVAL;
	return md_gmatch_accept_bytes(m, v->bytes + v->off[token], len);
}

bool md_gmatch_can_end(const struct md_gmatch *m)
{
	return m->states[m->cur].accept;
}

bool md_gmatch_is_final(struct md_gmatch *m)
{
	const struct gstate *s = &m->states[m->cur];
	return s->accept && s->n == 0;
}

int32_t md_gmatch_state(const struct md_gmatch *m)
{
	return m->cur;
}

void md_gmatch_set_state(struct md_gmatch *m, int32_t state)
{
	if (state >= 0 && (uint32_t)state < m->n_states)
		m->cur = state;
}

uint32_t md_gmatch_n_states(const struct md_gmatch *m)
{
	return m->n_states;
}
