/* Private to engine/grammar.c (compiling) and engine/grammar_match.c (matching): the compiled
 * grammar's layout. */
#ifndef MD_GRAMMAR_INT_H
#define MD_GRAMMAR_INT_H

#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "engine/grammar.h"

enum { EL_BYTES = 0, EL_REF = 1, EL_END = 2 };

#define EL(t, v) (((uint32_t)(t) << 30) | (uint32_t)(v))
#define EL_TYPE(e) ((e) >> 30)
#define EL_VAL(e) ((e) & 0x3fffffffu)

#define MAX_ELEMENTS (1u << 22) /* elements of one grammar, after expansion */
#define MAX_RULES (1u << 20)
#define MAX_EXPAND_DEPTH 10000 /* nested references expanded at once (C stack) */

struct md_grammar {
	_Atomic int refs;
	uint32_t n_rules, root;
	uint32_t *rule_alt;   /* owned (n_rules + 1): first alternative of each rule */
	uint32_t *alt_start;  /* owned (n_alts): first element of each alternative */
	uint32_t n_alts;
	uint32_t *el;         /* owned (n_el) */
	uint32_t n_el;
	uint32_t (*sets)[8];  /* owned (n_sets): 256-bit byte sets */
	uint32_t n_sets;
	uint32_t *suffix_min; /* owned (n_el): fewest bytes that complete the alternative from
			       * each element on (MIN_INF when it cannot complete) */
};

#define MIN_INF (1u << 30)

static inline uint32_t sat_add(uint32_t a, uint32_t b)
{
	return a + b >= MIN_INF ? MIN_INF : a + b;
}

/* A growable array of elements, node ids, ... */
struct u32vec {
	uint32_t *a; /* owned (cap) */
	uint32_t n, cap;
};

static inline int vec_push(struct u32vec *v, uint32_t x)
{
	if (v->n == v->cap) {
		uint32_t nc = v->cap ? v->cap * 2 : 8;
		uint32_t *na = realloc(v->a, sizeof(uint32_t) * nc);
		if (!na)
			return -ENOMEM;
		v->a = na;
		v->cap = nc;
	}
	v->a[v->n++] = x;
	return 0;
}

#endif
