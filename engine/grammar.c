/* Constrained decoding, compiling: grammar text to byte-level rules (engine/grammar.h). */
#include "engine/grammar.h"

/*
 * DESIGN (see grammar.h for the model)
 *
 * Compilation: a recursive-descent parser writes rules of alternatives of 32-bit elements
 * (type in the top two bits: a byte set index, a rule reference, or the end of an
 * alternative). Groups, repetitions and multi-byte character classes become auxiliary rules:
 * x* is `aux ::= x aux | ()`, x{m,n} is m copies of x then a chain of n - m optional ones,
 * a class over code points is `aux ::= [single bytes] | [lead][cont]... | ...` with one
 * alternative per run of UTF-8 byte ranges (Russ Cox's utf8 range split). Everything is then
 * flattened into one element array, each alternative terminated by an END element; rule r's
 * alternatives are alt_start[rule_alt[r] .. rule_alt[r + 1]).
 *
 * Matching (grammar_match.c): a stack is a chain of interned nodes (pos, parent): pos is the
 * next element to match, parent the node holding the position to return to. Expansion makes
 * every top a byte set: a reference pushes the position after it and continues in each
 * alternative of the rule; an END pops to the parent's position (or, at the bottom, marks the
 * state accepting). Left recursion is refused here, so expansion always terminates.
 *
 * Compile time is linear in the grammar (hashed names and sets, a worklist for nullable
 * rules): grammar text comes from clients and is compiled on the loop thread.
 */

#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/grammar_int.h"

/* ---- growable arrays ---- */

static int vec_append(struct u32vec *v, const struct u32vec *w)
{
	for (uint32_t i = 0; i < w->n; i++)
		if (vec_push(v, w->a[i]))
			return -ENOMEM;
	return 0;
}

/* ---- the parser ---- */

struct brule {
	char *name;             /* owned, NUL-terminated; NULL for auxiliary rules */
	bool defined;
	size_t first_use;       /* text offset of the first reference (undefined-rule errors) */
	struct u32vec *alts;    /* owned (n_alts) */
	uint32_t n_alts, cap_alts;
};

struct builder {
	const char *s;          /* borrowed: the text */
	size_t len, pos;
	struct brule *rules;    /* owned (n_rules) */
	uint32_t n_rules, cap_rules;
	uint32_t (*sets)[8];    /* owned (n_sets) */
	uint32_t n_sets, cap_sets;
	uint32_t *set_ht;       /* owned (ht_cap): set index + 1, 0 = free */
	uint32_t *name_ht;      /* owned (ht_cap): named rule id + 1, 0 = free */
	uint32_t ht_cap, n_named;
	uint64_t n_el;          /* elements so far (bound) */
	int rc;                 /* first error */
	char *err;              /* borrowed (errlen) */
	size_t errlen;
	int depth;              /* group nesting */
};

__attribute__((format(printf, 3, 4)))
static int fail_at(struct builder *b, size_t at, const char *fmt, ...)
{
	if (b->rc)
		return b->rc;
	b->rc = -EINVAL;
	if (b->err && b->errlen) {
		unsigned line = 1, col = 1;
		for (size_t i = 0; i < at && i < b->len; i++) {
			if (b->s[i] == '\n') {
				line++;
				col = 1;
			} else {
				col++;
			}
		}
		int n = snprintf(b->err, b->errlen, "line %u col %u: ", line, col);
		if (n > 0 && (size_t)n < b->errlen) {
			va_list ap;
			va_start(ap, fmt);
			vsnprintf(b->err + n, b->errlen - (size_t)n, fmt, ap);
			va_end(ap);
		}
	}
	return b->rc;
}

static int oom(struct builder *b)
{
	if (!b->rc) {
		b->rc = -ENOMEM;
		if (b->err && b->errlen)
			snprintf(b->err, b->errlen, "out of memory compiling the grammar");
	}
	return b->rc;
}

static int too_big(struct builder *b)
{
	if (!b->rc) {
		b->rc = -E2BIG;
		if (b->err && b->errlen)
			snprintf(b->err, b->errlen, "the grammar is too large (more than %u elements "
				 "after expanding repetitions)", MAX_ELEMENTS);
	}
	return b->rc;
}

/* FNV-1a over bytes, for the builder's two hash tables (set contents, rule names). */
static uint32_t hash_bytes(const void *p, size_t n)
{
	const unsigned char *c = p;
	uint32_t h = 2166136261u;
	for (size_t i = 0; i < n; i++)
		h = (h ^ c[i]) * 16777619u;
	return h;
}

/* Both tables share one capacity, a power of two at least twice the larger count. Rebuilt on
 * growth from the sets and the named rules. Returns 0 or -ENOMEM. */
static int ht_grow(struct builder *b)
{
	uint32_t nc = b->ht_cap ? b->ht_cap * 2 : 256;
	uint32_t *s = calloc(nc, sizeof(uint32_t)), *r = calloc(nc, sizeof(uint32_t));
	if (!s || !r) {
		free(s);
		free(r);
		return -ENOMEM;
	}
	for (uint32_t i = 0; i < b->n_sets; i++) {
		uint32_t j = hash_bytes(b->sets[i], 32) & (nc - 1);
		while (s[j])
			j = (j + 1) & (nc - 1);
		s[j] = i + 1;
	}
	for (uint32_t i = 0; i < b->n_rules; i++) {
		if (!b->rules[i].name)
			continue;
		uint32_t j = hash_bytes(b->rules[i].name, strlen(b->rules[i].name)) & (nc - 1);
		while (r[j])
			j = (j + 1) & (nc - 1);
		r[j] = i + 1;
	}
	free(b->set_ht);
	free(b->name_ht);
	b->set_ht = s;
	b->name_ht = r;
	b->ht_cap = nc;
	return 0;
}

/* A new rule (name NULL: auxiliary). Returns its id or -1 (b->rc set). */
static int32_t rule_new(struct builder *b, const char *name, size_t nlen)
{
	if (b->n_rules >= MAX_RULES) {
		too_big(b);
		return -1;
	}
	if (b->n_rules == b->cap_rules) {
		uint32_t nc = b->cap_rules ? b->cap_rules * 2 : 16;
		struct brule *nr = realloc(b->rules, sizeof(*nr) * nc);
		if (!nr) {
			oom(b);
			return -1;
		}
		b->rules = nr;
		b->cap_rules = nc;
	}
	struct brule *r = &b->rules[b->n_rules];
	memset(r, 0, sizeof(*r));
	if (name) {
		r->name = strndup(name, nlen);
		if (!r->name || ((b->n_named + 1) * 2 > b->ht_cap && ht_grow(b))) {
			free(r->name);
			r->name = NULL;
			oom(b);
			return -1;
		}
		uint32_t j = hash_bytes(name, nlen) & (b->ht_cap - 1);
		while (b->name_ht[j])
			j = (j + 1) & (b->ht_cap - 1);
		b->name_ht[j] = b->n_rules + 1;
		b->n_named++;
	}
	return (int32_t)b->n_rules++;
}

static int32_t rule_find(struct builder *b, const char *name, size_t nlen)
{
	if (!b->ht_cap)
		return -1;
	uint32_t j = hash_bytes(name, nlen) & (b->ht_cap - 1);
	while (b->name_ht[j]) {
		const char *rn = b->rules[b->name_ht[j] - 1].name;
		if (strlen(rn) == nlen && memcmp(rn, name, nlen) == 0)
			return (int32_t)(b->name_ht[j] - 1);
		j = (j + 1) & (b->ht_cap - 1);
	}
	return -1;
}

/* Add an alternative (copied) to rule r. */
static int rule_add_alt(struct builder *b, int32_t r, const struct u32vec *alt)
{
	struct brule *ru = &b->rules[r];
	if (ru->n_alts == ru->cap_alts) {
		uint32_t nc = ru->cap_alts ? ru->cap_alts * 2 : 2;
		struct u32vec *na = realloc(ru->alts, sizeof(*na) * nc);
		if (!na)
			return oom(b);
		ru->alts = na;
		ru->cap_alts = nc;
	}
	struct u32vec *v = &ru->alts[ru->n_alts++];
	memset(v, 0, sizeof(*v));
	b->n_el += alt->n + 1;
	if (b->n_el > MAX_ELEMENTS)
		return too_big(b);
	if (vec_append(v, alt))
		return oom(b);
	return 0;
}

/* Intern a byte set; returns its index or -1. */
static int32_t set_intern(struct builder *b, const uint32_t set[8])
{
	if (b->ht_cap) {
		uint32_t j = hash_bytes(set, 32) & (b->ht_cap - 1);
		while (b->set_ht[j]) {
			if (memcmp(b->sets[b->set_ht[j] - 1], set, 32) == 0)
				return (int32_t)(b->set_ht[j] - 1);
			j = (j + 1) & (b->ht_cap - 1);
		}
	}
	if ((b->n_sets + 1) * 2 > b->ht_cap && ht_grow(b)) {
		oom(b);
		return -1;
	}
	if (b->n_sets == b->cap_sets) {
		uint32_t nc = b->cap_sets ? b->cap_sets * 2 : 64;
		uint32_t (*ns)[8] = realloc(b->sets, sizeof(*ns) * nc);
		if (!ns) {
			oom(b);
			return -1;
		}
		b->sets = ns;
		b->cap_sets = nc;
	}
	memcpy(b->sets[b->n_sets], set, 32);
	uint32_t j = hash_bytes(set, 32) & (b->ht_cap - 1);
	while (b->set_ht[j])
		j = (j + 1) & (b->ht_cap - 1);
	b->set_ht[j] = b->n_sets + 1;
	return (int32_t)b->n_sets++;
}

static int push_range(struct builder *b, struct u32vec *v, unsigned lo, unsigned hi)
{
	uint32_t set[8] = { 0 };
	for (unsigned c = lo; c <= hi; c++)
		set[c >> 5] |= 1u << (c & 31);
	int32_t si = set_intern(b, set);
	if (si < 0)
		return b->rc;
	return vec_push(v, EL(EL_BYTES, si)) ? oom(b) : 0;
}

static void skip_ws(struct builder *b)
{
	while (b->pos < b->len) {
		char c = b->s[b->pos];
		if (c == ' ' || c == '\t' || c == '\r' || c == '\n') {
			b->pos++;
		} else if (c == '#') {
			while (b->pos < b->len && b->s[b->pos] != '\n')
				b->pos++;
		} else {
			break;
		}
	}
}

static bool is_name_char(char c)
{
	return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
	       c == '-' || c == '_';
}

static size_t name_len_at(const struct builder *b, size_t at)
{
	size_t n = 0;
	while (at + n < b->len && is_name_char(b->s[at + n]))
		n++;
	return n;
}

/* Is a "name ::=" at b->pos (after whitespace)? */
static bool at_rule_start(struct builder *b)
{
	size_t save = b->pos;
	skip_ws(b);
	size_t n = name_len_at(b, b->pos);
	bool yes = false;
	if (n > 0) {
		b->pos += n;
		skip_ws(b);
		yes = b->len - b->pos >= 3 && memcmp(b->s + b->pos, "::=", 3) == 0;
	}
	b->pos = save;
	return yes;
}

static int hexval(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	return -1;
}

/* Decode one UTF-8 character of the text at b->pos. Returns the code point or -1. */
static int32_t text_char(struct builder *b)
{
	const unsigned char *p = (const unsigned char *)b->s + b->pos;
	size_t left = b->len - b->pos;
	unsigned c = p[0];
	uint32_t cp;
	size_t n;
	if (c < 0x80) {
		b->pos++;
		return (int32_t)c;
	}
	if (c >= 0xC2 && c <= 0xDF) {
		n = 2;
		cp = c & 0x1F;
	} else if (c >= 0xE0 && c <= 0xEF) {
		n = 3;
		cp = c & 0x0F;
	} else if (c >= 0xF0 && c <= 0xF4) {
		n = 4;
		cp = c & 0x07;
	} else {
		fail_at(b, b->pos, "invalid UTF-8 in the grammar text");
		return -1;
	}
	if (left < n) {
		fail_at(b, b->pos, "invalid UTF-8 in the grammar text");
		return -1;
	}
	for (size_t i = 1; i < n; i++) {
		if ((p[i] & 0xC0) != 0x80) {
			fail_at(b, b->pos, "invalid UTF-8 in the grammar text");
			return -1;
		}
		cp = cp << 6 | (p[i] & 0x3F);
	}
	if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
	    (cp >= 0xD800 && cp <= 0xDFFF)) {
		fail_at(b, b->pos, "invalid UTF-8 in the grammar text");
		return -1;
	}
	b->pos += n;
	return (int32_t)cp;
}

/* One character of a literal or class, escapes decoded. Returns the code point or -1. */
static int32_t parse_char(struct builder *b)
{
	if (b->pos >= b->len) {
		fail_at(b, b->pos, "unexpected end of the grammar");
		return -1;
	}
	if (b->s[b->pos] != '\\')
		return text_char(b);
	size_t at = b->pos;
	if (b->pos + 1 >= b->len) {
		fail_at(b, at, "unfinished escape");
		return -1;
	}
	char e = b->s[b->pos + 1];
	b->pos += 2;
	int digits = 0;
	switch (e) {
	case 'n': return '\n';
	case 'r': return '\r';
	case 't': return '\t';
	case '0': return 0;
	case '\\': case '"': case '\'': case '[': case ']': case '-': case '^': case '/':
	case '.': case '(': case ')': case '*': case '+': case '?': case '{': case '}': case '|':
		return e;
	case 'x': digits = 2; break;
	case 'u': digits = 4; break;
	case 'U': digits = 8; break;
	default:
		fail_at(b, at, "unknown escape '\\%c'", e);
		return -1;
	}
	uint32_t cp = 0;
	for (int i = 0; i < digits; i++) {
		int h = b->pos < b->len ? hexval(b->s[b->pos]) : -1;
		if (h < 0) {
			fail_at(b, at, "escape '\\%c' needs %d hex digits", e, digits);
			return -1;
		}
		cp = cp << 4 | (uint32_t)h;
		b->pos++;
	}
	if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
		fail_at(b, at, "escape is not a Unicode scalar value");
		return -1;
	}
	return (int32_t)cp;
}

static size_t utf8_encode(uint32_t cp, unsigned char *o)
{
	if (cp < 0x80) {
		o[0] = (unsigned char)cp;
		return 1;
	}
	if (cp < 0x800) {
		o[0] = (unsigned char)(0xC0 | cp >> 6);
		o[1] = (unsigned char)(0x80 | (cp & 0x3F));
		return 2;
	}
	if (cp < 0x10000) {
		o[0] = (unsigned char)(0xE0 | cp >> 12);
		o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
		o[2] = (unsigned char)(0x80 | (cp & 0x3F));
		return 3;
	}
	o[0] = (unsigned char)(0xF0 | cp >> 18);
	o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
	o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
	o[3] = (unsigned char)(0x80 | (cp & 0x3F));
	return 4;
}

/* ---- character classes as UTF-8 byte sequences ---- */

struct cp_range {
	uint32_t lo, hi;
};

/* The rule being built for a multi-byte class: one alternative per byte-range run. */
struct class_out {
	uint32_t single[8];     /* one-byte characters */
	int32_t rule;           /* auxiliary rule for multi-byte runs, -1 until needed */
};

static int class_add_seq(struct builder *b, struct class_out *co, const unsigned char *lo,
			 const unsigned char *hi, size_t n)
{
	if (co->rule < 0 && (co->rule = rule_new(b, NULL, 0)) < 0)
		return b->rc;
	struct u32vec alt = { 0 };
	for (size_t i = 0; i < n && !b->rc; i++)
		push_range(b, &alt, lo[i], hi[i]);
	if (!b->rc)
		rule_add_alt(b, co->rule, &alt);
	free(alt.a);
	return b->rc;
}

/* Split [lo, hi] (no surrogates) into runs whose UTF-8 forms differ only in independent byte
 * ranges, and add each. */
static int utf8_split(struct builder *b, struct class_out *co, uint32_t lo, uint32_t hi)
{
	static const uint32_t lim[] = { 0x7F, 0x7FF, 0xFFFF };
	if (lo > hi || b->rc)
		return b->rc;
	for (int i = 0; i < 3; i++)
		if (lo <= lim[i] && lim[i] < hi) {
			utf8_split(b, co, lo, lim[i]);
			return utf8_split(b, co, lim[i] + 1, hi);
		}
	if (hi < 0x80) {
		for (uint32_t c = lo; c <= hi; c++)
			co->single[c >> 5] |= 1u << (c & 31);
		return 0;
	}
	for (int i = 1; i < 4; i++) {
		uint32_t m = (1u << (6 * i)) - 1;
		if ((lo & ~m) != (hi & ~m)) {
			if ((lo & m) != 0) {
				utf8_split(b, co, lo, lo | m);
				return utf8_split(b, co, (lo | m) + 1, hi);
			}
			if ((hi & m) != m) {
				utf8_split(b, co, lo, (hi & ~m) - 1);
				return utf8_split(b, co, hi & ~m, hi);
			}
		}
	}
	unsigned char a[4], z[4];
	size_t n = utf8_encode(lo, a);
	utf8_encode(hi, z);
	return class_add_seq(b, co, a, z, n);
}

static int cmp_range(const void *x, const void *y)
{
	const struct cp_range *a = x, *c = y;
	return a->lo < c->lo ? -1 : a->lo > c->lo;
}

/* Turn code point ranges (sorted, possibly overlapping; negated when neg) into elements. */
static int class_emit(struct builder *b, struct cp_range *r, size_t n, bool neg,
		      struct u32vec *out, size_t at)
{
	qsort(r, n, sizeof(*r), cmp_range);
	/* merge */
	size_t m = 0;
	for (size_t i = 0; i < n; i++) {
		if (m && r[i].lo <= r[m - 1].hi + 1) {
			if (r[i].hi > r[m - 1].hi)
				r[m - 1].hi = r[i].hi;
		} else {
			r[m++] = r[i];
		}
	}
	/* the positive list, minus surrogates */
	struct cp_range pos[260];
	size_t np = 0;
	struct cp_range tmp[130];
	size_t nt = 0;
	if (neg) {
		uint32_t next = 0;
		for (size_t i = 0; i < m; i++) {
			if (r[i].lo > next)
				tmp[nt++] = (struct cp_range){ next, r[i].lo - 1 };
			next = r[i].hi + 1;
		}
		if (next <= 0x10FFFF)
			tmp[nt++] = (struct cp_range){ next, 0x10FFFF };
	} else {
		memcpy(tmp, r, sizeof(*r) * m);
		nt = m;
	}
	for (size_t i = 0; i < nt; i++) {
		uint32_t lo = tmp[i].lo, hi = tmp[i].hi;
		if (lo < 0xD800 && hi > 0xDFFF) {
			pos[np++] = (struct cp_range){ lo, 0xD7FF };
			pos[np++] = (struct cp_range){ 0xE000, hi };
		} else if (lo >= 0xD800 && hi <= 0xDFFF) {
			continue;
		} else if (lo >= 0xD800 && lo <= 0xDFFF) {
			pos[np++] = (struct cp_range){ 0xE000, hi };
		} else if (hi >= 0xD800 && hi <= 0xDFFF) {
			pos[np++] = (struct cp_range){ lo, 0xD7FF };
		} else {
			pos[np++] = tmp[i];
		}
	}
	if (np == 0)
		return fail_at(b, at, "the character class matches nothing");
	struct class_out co = { .rule = -1 };
	for (size_t i = 0; i < np && !b->rc; i++)
		utf8_split(b, &co, pos[i].lo, pos[i].hi);
	if (b->rc)
		return b->rc;
	bool any_single = false;
	for (int i = 0; i < 8; i++)
		any_single |= co.single[i] != 0;
	if (co.rule < 0) {
		int32_t si = set_intern(b, co.single);
		if (si < 0)
			return b->rc;
		return vec_push(out, EL(EL_BYTES, si)) ? oom(b) : 0;
	}
	if (any_single) {
		int32_t si = set_intern(b, co.single);
		if (si < 0)
			return b->rc;
		struct u32vec alt = { 0 };
		if (vec_push(&alt, EL(EL_BYTES, si)))
			return oom(b);
		rule_add_alt(b, co.rule, &alt);
		free(alt.a);
	}
	return vec_push(out, EL(EL_REF, co.rule)) ? oom(b) : b->rc;
}

#define MAX_CLASS_RANGES 128

static int parse_class(struct builder *b, struct u32vec *out)
{
	size_t at = b->pos;
	b->pos++; /* [ */
	bool neg = false;
	if (b->pos < b->len && b->s[b->pos] == '^') {
		neg = true;
		b->pos++;
	}
	struct cp_range r[MAX_CLASS_RANGES];
	size_t n = 0;
	for (;;) {
		if (b->pos >= b->len)
			return fail_at(b, at, "unterminated character class");
		if (b->s[b->pos] == ']') {
			b->pos++;
			break;
		}
		int32_t lo = parse_char(b);
		if (lo < 0)
			return b->rc;
		int32_t hi = lo;
		if (b->pos + 1 < b->len && b->s[b->pos] == '-' && b->s[b->pos + 1] != ']') {
			b->pos++;
			hi = parse_char(b);
			if (hi < 0)
				return b->rc;
			if (hi < lo)
				return fail_at(b, at, "character range out of order");
		}
		if (n == MAX_CLASS_RANGES)
			return fail_at(b, at, "more than %d ranges in one class", MAX_CLASS_RANGES);
		r[n++] = (struct cp_range){ (uint32_t)lo, (uint32_t)hi };
	}
	if (n == 0 && !neg)
		return fail_at(b, at, "empty character class");
	return class_emit(b, r, n, neg, out, at);
}

static int parse_literal(struct builder *b, struct u32vec *out)
{
	size_t at = b->pos;
	char q = b->s[b->pos++];
	for (;;) {
		if (b->pos >= b->len)
			return fail_at(b, at, "unterminated string literal");
		if (b->s[b->pos] == q) {
			b->pos++;
			return 0;
		}
		int32_t cp = parse_char(b);
		if (cp < 0)
			return b->rc;
		unsigned char u[4];
		size_t k = utf8_encode((uint32_t)cp, u);
		for (size_t i = 0; i < k; i++)
			if (push_range(b, out, u[i], u[i]))
				return b->rc;
	}
}

static int parse_alts(struct builder *b, int32_t rule);

/* Wrap a fragment into a single element (a reference to a new rule when it is longer). */
static int as_one(struct builder *b, struct u32vec *frag, uint32_t *el)
{
	if (frag->n == 1) {
		*el = frag->a[0];
		return 0;
	}
	int32_t r = rule_new(b, NULL, 0);
	if (r < 0 || rule_add_alt(b, r, frag))
		return b->rc;
	*el = EL(EL_REF, r);
	return 0;
}

/* aux ::= x aux | () */
static int32_t star_rule(struct builder *b, uint32_t x)
{
	int32_t r = rule_new(b, NULL, 0);
	if (r < 0)
		return -1;
	uint32_t a[2] = { x, EL(EL_REF, r) };
	struct u32vec alt = { .a = a, .n = 2, .cap = 2 }, empty = { 0 };
	if (rule_add_alt(b, r, &alt) || rule_add_alt(b, r, &empty))
		return -1;
	return r;
}

/* r_k ::= x r_{k-1} | (), r_1 ::= x | (): up to k more copies of x. */
static int32_t opt_chain(struct builder *b, uint32_t x, uint32_t k)
{
	int32_t prev = -1;
	for (uint32_t i = 0; i < k; i++) {
		int32_t r = rule_new(b, NULL, 0);
		if (r < 0)
			return -1;
		uint32_t a[2] = { x, prev >= 0 ? EL(EL_REF, prev) : 0 };
		struct u32vec alt = { .a = a, .n = prev >= 0 ? 2 : 1, .cap = 2 }, empty = { 0 };
		if (rule_add_alt(b, r, &alt) || rule_add_alt(b, r, &empty))
			return -1;
		prev = r;
	}
	return prev;
}

static int parse_uint(struct builder *b, uint32_t *v)
{
	size_t at = b->pos;
	uint64_t x = 0;
	if (b->pos >= b->len || b->s[b->pos] < '0' || b->s[b->pos] > '9')
		return fail_at(b, at, "expected a number");
	while (b->pos < b->len && b->s[b->pos] >= '0' && b->s[b->pos] <= '9') {
		x = x * 10 + (uint64_t)(b->s[b->pos++] - '0');
		if (x > MD_GRAMMAR_MAX_REPEAT)
			return fail_at(b, at, "repetition bound above %d", MD_GRAMMAR_MAX_REPEAT);
	}
	*v = (uint32_t)x;
	return 0;
}

/* Apply one postfix operator at b->pos to frag (replaced in place). */
static int apply_postfix(struct builder *b, struct u32vec *frag)
{
	size_t at = b->pos;
	char op = b->s[b->pos++];
	uint32_t x = 0, m = 0, n = 0;
	bool unbounded = false;
	if (frag->n == 0)
		return fail_at(b, at, "'%c' after nothing", op);
	if (op == '{') {
		skip_ws(b);
		if (parse_uint(b, &m))
			return b->rc;
		skip_ws(b);
		if (b->pos < b->len && b->s[b->pos] == ',') {
			b->pos++;
			skip_ws(b);
			if (b->pos < b->len && b->s[b->pos] == '}') {
				unbounded = true;
			} else if (parse_uint(b, &n)) {
				return b->rc;
			}
			skip_ws(b);
		} else {
			n = m;
		}
		if (b->pos >= b->len || b->s[b->pos] != '}')
			return fail_at(b, at, "expected '}'");
		b->pos++;
		if (!unbounded && n < m)
			return fail_at(b, at, "repetition {%u,%u} out of order", m, n);
	} else if (op == '*') {
		unbounded = true;
	} else if (op == '+') {
		m = 1;
		unbounded = true;
	} else { /* ? */
		n = 1;
	}
	if (as_one(b, frag, &x))
		return b->rc;
	frag->n = 0;
	for (uint32_t i = 0; i < m; i++)
		if (vec_push(frag, x))
			return oom(b);
	if (unbounded) {
		int32_t r = star_rule(b, x);
		if (r < 0)
			return b->rc;
		if (vec_push(frag, EL(EL_REF, r)))
			return oom(b);
	} else if (n > m) {
		int32_t r = opt_chain(b, x, n - m);
		if (r < 0)
			return b->rc;
		if (vec_push(frag, EL(EL_REF, r)))
			return oom(b);
	}
	return 0;
}

/* One item (primary and postfix operators), appended to seq. */
static int parse_item(struct builder *b, struct u32vec *seq)
{
	struct u32vec frag = { 0 };
	size_t at = b->pos;
	char c = b->s[b->pos];
	if (c == '"' || c == '\'') {
		parse_literal(b, &frag);
	} else if (c == '[') {
		parse_class(b, &frag);
	} else if (c == '.') {
		b->pos++;
		struct cp_range any = { 0, 0x10FFFF };
		class_emit(b, &any, 1, false, &frag, at);
	} else if (c == '(') {
		if (++b->depth > 200) {
			fail_at(b, at, "groups nested too deeply");
			goto out;
		}
		b->pos++;
		int32_t r = rule_new(b, NULL, 0);
		if (r >= 0 && parse_alts(b, r) == 0) {
			skip_ws(b);
			if (b->pos >= b->len || b->s[b->pos] != ')')
				fail_at(b, at, "unclosed '('");
			else
				b->pos++;
			if (!b->rc && vec_push(&frag, EL(EL_REF, r)))
				oom(b);
		}
		b->depth--;
	} else if (is_name_char(c)) {
		size_t n = name_len_at(b, b->pos);
		int32_t r = rule_find(b, b->s + b->pos, n);
		if (r < 0 && (r = rule_new(b, b->s + b->pos, n)) >= 0)
			b->rules[r].first_use = b->pos;
		b->pos += n;
		if (r >= 0 && vec_push(&frag, EL(EL_REF, r)))
			oom(b);
	} else {
		fail_at(b, at, "unexpected '%c'", c);
	}
	while (!b->rc && b->pos < b->len && strchr("*+?{", b->s[b->pos]))
		apply_postfix(b, &frag);
	if (!b->rc && vec_append(seq, &frag))
		oom(b);
out:
	free(frag.a);
	return b->rc;
}

/* Alternatives up to ')' or the next rule or the end, added to rule. */
static int parse_alts(struct builder *b, int32_t rule)
{
	for (;;) {
		struct u32vec seq = { 0 };
		for (;;) {
			skip_ws(b);
			if (b->pos >= b->len || b->s[b->pos] == '|' || b->s[b->pos] == ')' ||
			    at_rule_start(b))
				break;
			if (parse_item(b, &seq))
				break;
		}
		if (!b->rc)
			rule_add_alt(b, rule, &seq);
		free(seq.a);
		if (b->rc)
			return b->rc;
		if (b->pos < b->len && b->s[b->pos] == '|') {
			b->pos++;
			continue;
		}
		return 0;
	}
}

static int parse_rules(struct builder *b)
{
	skip_ws(b);
	if (b->pos >= b->len)
		return fail_at(b, b->pos, "the grammar is empty");
	while (!b->rc) {
		skip_ws(b);
		if (b->pos >= b->len)
			break;
		size_t at = b->pos;
		size_t n = name_len_at(b, b->pos);
		if (n == 0 || !at_rule_start(b))
			return fail_at(b, at, "expected a rule definition 'name ::= ...'");
		int32_t r = rule_find(b, b->s + b->pos, n);
		if (r >= 0 && b->rules[r].defined)
			return fail_at(b, at, "rule '%.*s' defined twice", (int)n, b->s + b->pos);
		if (r < 0 && (r = rule_new(b, b->s + b->pos, n)) < 0)
			return b->rc;
		b->rules[r].defined = true;
		b->pos += n;
		skip_ws(b);
		b->pos += 3; /* ::= */
		if (parse_alts(b, r))
			return b->rc;
		if (b->pos < b->len && b->s[b->pos] == ')')
			return fail_at(b, b->pos, "unmatched ')'");
	}
	return b->rc;
}

/* ---- checks on the flattened grammar ---- */

static const uint32_t *alt_el(const struct md_grammar *g, uint32_t a)
{
	return g->el + g->alt_start[a];
}

/* Which rules can match the empty string: a worklist over "alternatives whose references are
 * not yet known nullable", so the cost is linear in the grammar whatever the rule order. */
static int find_nullable(const struct md_grammar *g, bool *nullable)
{
	uint32_t R = g->n_rules, A = g->n_alts;
	uint32_t *left = calloc(A ? A : 1, sizeof(uint32_t));   /* per alt: refs not yet nullable */
	uint32_t *owner = malloc(sizeof(uint32_t) * (A ? A : 1));
	uint32_t *occ_off = calloc(R + 1, sizeof(uint32_t));     /* per rule: where it is used */
	uint32_t *occ = NULL, *queue = malloc(sizeof(uint32_t) * (R ? R : 1));
	uint32_t n_occ = 0, qh = 0, qt = 0;
	int rc = -ENOMEM;
	if (!left || !owner || !occ_off || !queue)
		goto out;
	for (uint32_t r = 0; r < R; r++)
		for (uint32_t a = g->rule_alt[r]; a < g->rule_alt[r + 1]; a++)
			owner[a] = r;
	for (uint32_t a = 0; a < A; a++) {
		bool bytes = false;
		for (const uint32_t *e = alt_el(g, a); EL_TYPE(*e) != EL_END; e++)
			bytes |= EL_TYPE(*e) == EL_BYTES;
		if (bytes) {
			left[a] = UINT32_MAX; /* never nullable */
			continue;
		}
		for (const uint32_t *e = alt_el(g, a); EL_TYPE(*e) != EL_END; e++) {
			left[a]++;
			occ_off[EL_VAL(*e) + 1]++;
			n_occ++;
		}
	}
	for (uint32_t r = 0; r < R; r++)
		occ_off[r + 1] += occ_off[r];
	occ = malloc(sizeof(uint32_t) * (n_occ ? n_occ : 1));
	if (!occ)
		goto out;
	for (uint32_t a = 0; a < A; a++) {
		if (left[a] == UINT32_MAX)
			continue;
		for (const uint32_t *e = alt_el(g, a); EL_TYPE(*e) != EL_END; e++)
			occ[occ_off[EL_VAL(*e)]++] = a;
	}
	for (uint32_t r = R; r > 0; r--) /* back to the starts */
		occ_off[r] = occ_off[r - 1];
	occ_off[0] = 0;
	for (uint32_t a = 0; a < A; a++)
		if (left[a] == 0 && !nullable[owner[a]]) {
			nullable[owner[a]] = true;
			queue[qt++] = owner[a];
		}
	while (qh < qt) {
		uint32_t r = queue[qh++];
		for (uint32_t k = occ_off[r]; k < occ_off[r + 1]; k++) {
			uint32_t a = occ[k];
			if (--left[a] == 0 && !nullable[owner[a]]) {
				nullable[owner[a]] = true;
				queue[qt++] = owner[a];
			}
		}
	}
	rc = 0;
out:
	free(left);
	free(owner);
	free(occ_off);
	free(occ);
	free(queue);
	return rc;
}

/* Refuse rules that can reach themselves without consuming a byte: a depth-first search over
 * left-corner references (the references an alternative reaches before its first byte), each
 * frame a cursor (rule, alternative, element), so every element is looked at once. */
static int check_left_recursion(struct builder *b, struct md_grammar *g)
{
	uint32_t R = g->n_rules;
	bool *nullable = calloc(R ? R : 1, sizeof(bool));
	uint8_t *color = calloc(R ? R : 1, 1);
	uint32_t *stk = malloc(sizeof(uint32_t) * 3 * (R ? R : 1));
	if (!nullable || !color || !stk || find_nullable(g, nullable)) {
		free(nullable);
		free(color);
		free(stk);
		return oom(b);
	}
	const uint32_t START = UINT32_MAX;
	for (uint32_t s = 0; s < R && !b->rc; s++) {
		if (color[s])
			continue;
		uint32_t sp = 0;
		stk[sp++] = s;
		stk[sp++] = g->rule_alt[s];
		stk[sp++] = START;
		color[s] = 1;
		while (sp && !b->rc) {
			uint32_t r = stk[sp - 3], a = stk[sp - 2], e = stk[sp - 1];
			uint32_t next = UINT32_MAX;
			while (a < g->rule_alt[r + 1]) {
				if (e == START)
					e = g->alt_start[a];
				uint32_t el = g->el[e];
				if (EL_TYPE(el) == EL_REF) {
					next = EL_VAL(el);
					if (nullable[next]) {
						e++;
					} else {
						a++;
						e = START;
					}
					break;
				}
				a++;
				e = START;
			}
			stk[sp - 2] = a;
			stk[sp - 1] = e;
			if (next == UINT32_MAX) {
				color[r] = 2;
				sp -= 3;
				continue;
			}
			if (color[next] == 1) {
				const char *nm = b->rules[next].name;
				for (uint32_t i = sp; !nm && i >= 3; i -= 3)
					nm = b->rules[stk[i - 3]].name;
				b->rc = -EINVAL;
				if (b->err && b->errlen)
					snprintf(b->err, b->errlen, "rule '%s' is left-recursive (it can "
						 "reach itself without matching a character)", nm ? nm : "?");
			} else if (color[next] == 0) {
				color[next] = 1;
				stk[sp++] = next;
				stk[sp++] = g->rule_alt[next];
				stk[sp++] = START;
			}
		}
	}
	free(nullable);
	free(color);
	free(stk);
	return b->rc;
}

static void grammar_free(struct md_grammar *g)
{
	if (!g)
		return;
	free(g->rule_alt);
	free(g->alt_start);
	free(g->el);
	free(g->sets);
	free(g->suffix_min);
	free(g);
}

/* Fewest bytes each rule can match (a fixpoint), then every element's suffix minimum: what a
 * budget-limited sequence needs to finish from any position (md_gmatch_mask_budget). */
static int compute_min_lengths(struct md_grammar *g)
{
	uint32_t *rmin = malloc(sizeof(uint32_t) * (g->n_rules ? g->n_rules : 1));
	g->suffix_min = malloc(sizeof(uint32_t) * (g->n_el ? g->n_el : 1));
	if (!rmin || !g->suffix_min) {
		free(rmin);
		return -ENOMEM;
	}
	for (uint32_t r = 0; r < g->n_rules; r++)
		rmin[r] = MIN_INF;
	for (bool changed = true; changed;) {
		changed = false;
		for (uint32_t r = 0; r < g->n_rules; r++) {
			for (uint32_t a = g->rule_alt[r]; a < g->rule_alt[r + 1]; a++) {
				uint32_t c = 0;
				for (const uint32_t *e = g->el + g->alt_start[a]; EL_TYPE(*e) != EL_END; e++)
					c = sat_add(c, EL_TYPE(*e) == EL_BYTES ? 1 : rmin[EL_VAL(*e)]);
				if (c < rmin[r]) {
					rmin[r] = c;
					changed = true;
				}
			}
		}
	}
	for (uint32_t a = 0; a < g->n_alts; a++) {
		uint32_t end = g->alt_start[a];
		while (EL_TYPE(g->el[end]) != EL_END)
			end++;
		uint32_t c = 0;
		g->suffix_min[end] = 0;
		for (uint32_t i = end; i-- > g->alt_start[a];) {
			uint32_t e = g->el[i];
			c = sat_add(c, EL_TYPE(e) == EL_BYTES ? 1 : rmin[EL_VAL(e)]);
			g->suffix_min[i] = c;
		}
	}
	free(rmin);
	return 0;
}

static int flatten(struct builder *b, struct md_grammar **out)
{
	struct md_grammar *g = calloc(1, sizeof(*g));
	if (!g)
		return oom(b);
	uint32_t n_alts = 0;
	for (uint32_t r = 0; r < b->n_rules; r++)
		n_alts += b->rules[r].n_alts;
	g->n_rules = b->n_rules;
	g->n_alts = n_alts;
	g->n_el = (uint32_t)b->n_el;
	g->rule_alt = malloc(sizeof(uint32_t) * (b->n_rules + 1));
	g->alt_start = malloc(sizeof(uint32_t) * (n_alts ? n_alts : 1));
	g->el = malloc(sizeof(uint32_t) * (g->n_el ? g->n_el : 1));
	g->sets = malloc(32 * (b->n_sets ? b->n_sets : 1));
	if (!g->rule_alt || !g->alt_start || !g->el || !g->sets) {
		grammar_free(g);
		return oom(b);
	}
	if (b->n_sets) /* memcpy from NULL is undefined even for 0 bytes */
		memcpy(g->sets, b->sets, 32 * (size_t)b->n_sets);
	g->n_sets = b->n_sets;
	uint32_t a = 0, e = 0;
	for (uint32_t r = 0; r < b->n_rules; r++) {
		g->rule_alt[r] = a;
		for (uint32_t i = 0; i < b->rules[r].n_alts; i++) {
			const struct u32vec *v = &b->rules[r].alts[i];
			g->alt_start[a++] = e;
			if (v->n)
				memcpy(g->el + e, v->a, sizeof(uint32_t) * v->n);
			e += v->n;
			g->el[e++] = EL(EL_END, 0);
		}
	}
	g->rule_alt[b->n_rules] = a;
	atomic_init(&g->refs, 1);
	*out = g;
	return 0;
}

int md_grammar_parse(const char *text, size_t len, struct md_grammar **out, char *err,
		     size_t errlen)
{
	struct builder b = { .s = text, .len = len, .err = err, .errlen = errlen };
	struct md_grammar *g = NULL;
	*out = NULL;
	if (err && errlen)
		err[0] = 0;
	parse_rules(&b);
	int32_t root = -1;
	if (!b.rc) {
		root = rule_find(&b, "root", 4);
		if (root < 0 || !b.rules[root].defined)
			fail_at(&b, 0, "no 'root' rule");
	}
	for (uint32_t r = 0; r < b.n_rules && !b.rc; r++)
		if (b.rules[r].name && !b.rules[r].defined)
			fail_at(&b, b.rules[r].first_use, "undefined rule '%s'", b.rules[r].name);
	if (!b.rc && flatten(&b, &g) == 0) {
		g->root = (uint32_t)root;
		if (compute_min_lengths(g))
			oom(&b);
		if (b.rc || check_left_recursion(&b, g)) {
			grammar_free(g);
			g = NULL;
		}
	}
	for (uint32_t r = 0; r < b.n_rules; r++) {
		for (uint32_t i = 0; i < b.rules[r].n_alts; i++)
			free(b.rules[r].alts[i].a);
		free(b.rules[r].alts);
		free(b.rules[r].name);
	}
	free(b.rules);
	free(b.sets);
	free(b.set_ht);
	free(b.name_ht);
	if (b.rc)
		return b.rc;
	*out = g;
	return 0;
}

struct md_grammar *md_grammar_ref(struct md_grammar *g)
{
	atomic_fetch_add(&g->refs, 1);
	return g;
}

void md_grammar_unref(struct md_grammar *g)
{
	if (g && atomic_fetch_sub(&g->refs, 1) == 1)
		grammar_free(g);
}

uint32_t md_grammar_n_rules(const struct md_grammar *g)
{
	return g->n_rules;
}

uint32_t md_grammar_n_elements(const struct md_grammar *g)
{
	return g->n_el;
}

