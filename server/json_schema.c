/* JSON Schema (the subset OpenAI's structured outputs accept) to grammar text (engine/grammar.h). */
#include "server/json_schema.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The rules every generated grammar carries. j-char is one character of a JSON string (raw or
 * escaped); numbers have at most 16 integer and 15 fraction digits and a 3-digit exponent,
 * so no number runs on without end. */
#define FIXED_RULES \
	"ws ::= \" \"?\n" \
	"j-value ::= j-object | j-array | j-string | j-number | \"true\" | \"false\" | \"null\"\n" \
	"j-object ::= \"{\" ws ( j-string \":\" ws j-value ( \",\" ws j-string \":\" ws j-value )* )? \"}\"\n" \
	"j-array ::= \"[\" ws ( j-value ( \",\" ws j-value )* )? \"]\"\n" \
	"j-string ::= \"\\\"\" j-char* \"\\\"\"\n" \
	"j-char ::= [^\"\\\\\\x00-\\x1f] | \"\\\\\" ( [\"\\\\/bfnrt] | \"u\" [0-9a-fA-F]{4} )\n" \
	"j-safe ::= [^\"\\\\\\x00-\\x1f]\n" \
	"j-number ::= j-int ( \".\" [0-9]{1,15} )? ( [eE] [-+]? [0-9]{1,3} )?\n" \
	"j-int ::= \"-\"? ( [0-9] | [1-9] [0-9]{1,15} )\n"

static const char object_grammar[] = "root ::= j-object\n" FIXED_RULES;

const char *md_json_object_grammar(void)
{
	return object_grammar;
}

/* ---- a string builder ---- */

struct sb {
	char *s;       /* owned (cap), NUL-terminated */
	size_t n, cap;
	bool oom;
};

static void sb_add_n(struct sb *b, const char *s, size_t n)
{
	if (b->oom)
		return;
	if (b->n + n + 1 > b->cap) {
		size_t nc = b->cap ? b->cap : 256;
		while (nc < b->n + n + 1)
			nc *= 2;
		char *ns = realloc(b->s, nc);
		if (!ns) {
			b->oom = true;
			return;
		}
		b->s = ns;
		b->cap = nc;
	}
	memcpy(b->s + b->n, s, n);
	b->n += n;
	b->s[b->n] = 0;
}

static void sb_add(struct sb *b, const char *s)
{
	sb_add_n(b, s, strlen(s));
}

__attribute__((format(printf, 2, 3)))
static void sb_printf(struct sb *b, const char *fmt, ...)
{
	char buf[512];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	if (n < 0 || (size_t)n >= sizeof(buf)) {
		b->oom = true;
		return;
	}
	sb_add_n(b, buf, (size_t)n);
}

/* A grammar literal matching exactly the bytes s[0..n). */
static void sb_lit(struct sb *b, const char *s, size_t n)
{
	sb_add(b, "\"");
	for (size_t i = 0; i < n; i++) {
		unsigned char c = (unsigned char)s[i];
		if (c == '"' || c == '\\') {
			char e[3] = { '\\', (char)c, 0 };
			sb_add(b, e);
		} else if (c < 0x20 || c == 0x7f) {
			sb_printf(b, "\\x%02x", c);
		} else {
			sb_add_n(b, (const char *)&c, 1);
		}
	}
	sb_add(b, "\"");
}

/* ---- the translator ---- */

#define MAX_DEFS 256
#define MAX_DEPTH 64
#define MAX_ITEMS_BOUND 1000
#define INT_CAP 9999999999999999ull /* the largest integer a grammar writes: 16 digits */

struct def {
	char *ref;        /* owned: the $ref string */
	char name[24];    /* its rule */
};

struct jctx {
	struct sb out;               /* every rule written so far */
	const cJSON *root;           /* borrowed: the whole schema ($ref targets) */
	int next;                    /* rule counter */
	struct def defs[MAX_DEFS];
	int n_defs;
	int rc;
	char *err;                   /* borrowed (errlen) */
	size_t errlen;
	int depth;
};

__attribute__((format(printf, 2, 3)))
static int fail(struct jctx *x, const char *fmt, ...)
{
	if (x->rc)
		return x->rc;
	x->rc = -EINVAL;
	if (x->err && x->errlen) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(x->err, x->errlen, fmt, ap);
		va_end(ap);
	}
	return x->rc;
}

static void new_rule_name(struct jctx *x, char *name, size_t cap)
{
	snprintf(name, cap, "s%d", x->next++);
}

/* Write "name ::= body\n" (body consumed). */
static void emit_rule(struct jctx *x, const char *name, struct sb *body)
{
	sb_add(&x->out, name);
	sb_add(&x->out, " ::= ");
	sb_add(&x->out, body->s ? body->s : "\"\"");
	sb_add(&x->out, "\n");
	if (body->oom)
		x->out.oom = true;
	free(body->s);
	memset(body, 0, sizeof(*body));
}

static int gen(struct jctx *x, const cJSON *s, const char *path, char *name, size_t cap);

static const char *const annotations[] = {
	"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
	"readOnly", "writeOnly", "strict", "$defs", "definitions", NULL,
};

static const char *const handled[] = {
	"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
	"enum", "const", "anyOf", "$ref", "minLength", "maxLength", "pattern", "format",
	"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", NULL,
};

static bool in_list(const char *const *l, const char *k)
{
	for (; *l; l++)
		if (strcmp(*l, k) == 0)
			return true;
	return false;
}

/* Refuse keywords the translator does not enforce. */
static int check_keywords(struct jctx *x, const cJSON *s, const char *path)
{
	const cJSON *it;
	cJSON_ArrayForEach(it, s) {
		if (!in_list(annotations, it->string) && !in_list(handled, it->string))
			return fail(x, "unsupported JSON Schema keyword '%s' at %s", it->string, path);
	}
	return 0;
}

/* ---- numbers ---- */

static int ndigits(uint64_t v)
{
	int n = 1;
	while (v >= 10) {
		v /= 10;
		n++;
	}
	return n;
}

static uint64_t pow10u(int n)
{
	uint64_t p = 1;
	while (n-- > 0)
		p *= 10;
	return p;
}

/* Alternatives for the equal-length digit strings from a to b (a <= b, n digits). */
static void digits_range(struct sb *o, const char *a, const char *b, size_t n)
{
	if (n == 0 || n > 20) /* callers pass 1..20 digits (uint64_t) */
		return;
	if (n == 1) {
		if (a[0] == b[0])
			sb_printf(o, "\"%c\"", a[0]);
		else
			sb_printf(o, "[%c-%c]", a[0], b[0]);
		return;
	}
	if (a[0] == b[0]) {
		sb_printf(o, "\"%c\" ", a[0]);
		digits_range(o, a + 1, b + 1, n - 1);
		return;
	}
	bool a_low = true, b_high = true;
	for (size_t i = 1; i < n; i++) {
		a_low &= a[i] == '0';
		b_high &= b[i] == '9';
	}
	char nines[24], zeros[24];
	memset(nines, '9', n - 1);
	memset(zeros, '0', n - 1);
	char lo = a_low ? a[0] : (char)(a[0] + 1), hi = b_high ? b[0] : (char)(b[0] - 1);
	bool first = true;
	sb_add(o, "( ");
	if (!a_low) {
		sb_printf(o, "\"%c\" ( ", a[0]);
		digits_range(o, a + 1, nines, n - 1);
		sb_add(o, " )");
		first = false;
	}
	if (lo <= hi) {
		sb_printf(o, "%s[%c-%c] [0-9]{%zu}", first ? "" : " | ", lo, hi, n - 1);
		first = false;
	}
	if (!b_high) {
		sb_printf(o, "%s\"%c\" ( ", first ? "" : " | ", b[0]);
		digits_range(o, zeros, b + 1, n - 1);
		sb_add(o, " )");
	}
	sb_add(o, " )");
}

/* Alternatives for the non-negative integers lo..hi (no leading zeros). */
static void uint_range(struct sb *o, uint64_t lo, uint64_t hi)
{
	bool first = true;
	sb_add(o, "( ");
	for (int len = ndigits(lo); len <= ndigits(hi); len++) {
		uint64_t a = lo, z = hi;
		uint64_t min_len = len == 1 ? 0 : pow10u(len - 1), max_len = pow10u(len) - 1;
		if (a < min_len)
			a = min_len;
		if (z > max_len)
			z = max_len;
		if (a > z)
			continue;
		char sa[24], sz[24];
		snprintf(sa, sizeof(sa), "%llu", (unsigned long long)a);
		snprintf(sz, sizeof(sz), "%llu", (unsigned long long)z);
		if (!first)
			sb_add(o, " | ");
		digits_range(o, sa, sz, (size_t)len);
		first = false;
	}
	sb_add(o, " )");
}

/* The integers in [lo, hi] (each side capped at 16 digits). */
static void int_range(struct sb *o, int64_t lo, int64_t hi)
{
	bool first = true;
	sb_add(o, "( ");
	if (lo < 0) {
		uint64_t a = hi < 0 ? (uint64_t)(-hi) : 1, z = (uint64_t)(-lo);
		sb_add(o, "\"-\" ");
		uint_range(o, a, z);
		first = false;
	}
	if (hi >= 0) {
		if (!first)
			sb_add(o, " | ");
		uint_range(o, lo > 0 ? (uint64_t)lo : 0, (uint64_t)hi);
	}
	sb_add(o, " )");
}

/* Read one integer-valued bound. Returns 1 read, 0 absent, -1 after failing. */
static int read_bound(struct jctx *x, const cJSON *s, const char *kw, const char *path,
		      int64_t *v)
{
	const cJSON *b = cJSON_GetObjectItemCaseSensitive(s, kw);
	if (!b)
		return 0;
	if (!cJSON_IsNumber(b)) {
		fail(x, "'%s' at %s must be a number", kw, path);
		return -1;
	}
	double d = b->valuedouble;
	if (d != floor(d) || fabs(d) > (double)INT_CAP) {
		fail(x, "unsupported JSON Schema value: '%s' at %s must be an integer within 16 "
		     "digits (non-integer bounds are not supported)", kw, path);
		return -1;
	}
	*v = (int64_t)d;
	return 1;
}

/* Inclusive integer bounds from minimum / maximum / exclusive*. Returns 0 or -1. */
static int int_bounds(struct jctx *x, const cJSON *s, const char *path, int64_t *lo,
		      int64_t *hi, bool *has_lo, bool *has_hi, bool *ex_lo, bool *ex_hi)
{
	int64_t v;
	int r;
	*lo = -(int64_t)INT_CAP;
	*hi = (int64_t)INT_CAP;
	*has_lo = *has_hi = *ex_lo = *ex_hi = false;
	if ((r = read_bound(x, s, "minimum", path, &v)) < 0)
		return -1;
	if (r) {
		*lo = v;
		*has_lo = true;
	}
	if ((r = read_bound(x, s, "exclusiveMinimum", path, &v)) < 0)
		return -1;
	if (r && (!*has_lo || v >= *lo)) {
		*lo = v;
		*has_lo = *ex_lo = true;
	}
	if ((r = read_bound(x, s, "maximum", path, &v)) < 0)
		return -1;
	if (r) {
		*hi = v;
		*has_hi = true;
	}
	if ((r = read_bound(x, s, "exclusiveMaximum", path, &v)) < 0)
		return -1;
	if (r && (!*has_hi || v <= *hi)) {
		*hi = v;
		*has_hi = *ex_hi = true;
	}
	return 0;
}

static void gen_integer(struct jctx *x, const cJSON *s, const char *path, struct sb *o)
{
	int64_t lo, hi;
	bool hl, hh, el, eh;
	if (int_bounds(x, s, path, &lo, &hi, &hl, &hh, &el, &eh))
		return;
	if (!hl && !hh) {
		sb_add(o, "j-int");
		return;
	}
	if (el)
		lo++;
	if (eh)
		hi--;
	if (lo > hi) {
		fail(x, "no integer satisfies the bounds at %s", path);
		return;
	}
	int_range(o, lo, hi);
}

/* Numbers in the bounds: integers in range, and k.f (a fraction with a non-zero last digit,
 * so strictly between k and k + 1) where that whole open interval is in range. */
static void gen_number(struct jctx *x, const cJSON *s, const char *path, struct sb *o)
{
	int64_t lo, hi;
	bool hl, hh, el, eh;
	if (int_bounds(x, s, path, &lo, &hi, &hl, &hh, &el, &eh))
		return;
	if (!hl && !hh) {
		sb_add(o, "j-number");
		return;
	}
	static const char frac[] = " \".\" [0-9]{0,5} [1-9]";
	int64_t ilo = el ? lo + 1 : lo, ihi = eh ? hi - 1 : hi;
	bool any = false;
	sb_add(o, "( ");
	if (ilo <= ihi) {
		int_range(o, ilo, ihi);
		any = true;
	}
	/* positive fractions: k in [max(lo, 0), hi - 1] */
	int64_t plo = lo > 0 ? lo : 0, phi = hi - 1;
	if (plo <= phi) {
		sb_add(o, any ? " | " : "");
		uint_range(o, (uint64_t)plo, (uint64_t)phi);
		sb_add(o, frac);
		any = true;
	}
	/* negative fractions -(k.f): k in [max(0, -hi), -lo - 1] */
	int64_t nlo = hi < 0 ? -hi : 0, nhi = -lo - 1;
	if (nlo <= nhi) {
		sb_add(o, any ? " | \"-\" " : "\"-\" ");
		uint_range(o, (uint64_t)nlo, (uint64_t)nhi);
		sb_add(o, frac);
		any = true;
	}
	sb_add(o, " )");
	if (!any)
		fail(x, "no number satisfies the bounds at %s", path);
}

/* ---- strings ---- */

/* Regular expression subset -> grammar over the characters of a JSON string's content. */
struct re {
	const char *p;    /* borrowed: the pattern */
	size_t n, i;
	struct jctx *x;
	const char *path;
	int depth;
};

static int re_fail(struct re *r, const char *what)
{
	return fail(r->x, "unsupported JSON Schema value: 'pattern' at %s: %s (at offset %zu)",
		    r->path, what, r->i);
}

/* A character as it may appear in a grammar class (escaped). */
static void class_char(struct sb *o, unsigned c)
{
	if (c == ']' || c == '[' || c == '\\' || c == '^' || c == '-' || c == '"')
		sb_printf(o, "\\%c", c);
	else if (c < 0x20 || c == 0x7f)
		sb_printf(o, "\\x%02x", c);
	else
		sb_printf(o, "%c", c);
}

/* Write class ranges for a shorthand escape (d, w, s). */
static void shorthand(struct sb *o, char e)
{
	if (e == 'd' || e == 'D')
		sb_add(o, "0-9");
	else if (e == 'w' || e == 'W')
		sb_add(o, "a-zA-Z0-9_");
	else
		sb_add(o, " "); /* \s: only the space can be written unescaped */
}

static int re_alt(struct re *r, struct sb *o);

/* A literal character of the pattern (one UTF-8 sequence, copied) as a grammar literal of its
 * JSON-string form. */
static int re_literal(struct re *r, struct sb *o, unsigned c)
{
	if (c == '"')
		sb_add(o, "\"\\\\\\\"\"");
	else if (c == '\\')
		sb_add(o, "\"\\\\\\\\\"");
	else if (c == '\n')
		sb_add(o, "\"\\\\n\"");
	else if (c == '\t')
		sb_add(o, "\"\\\\t\"");
	else if (c == '\r')
		sb_add(o, "\"\\\\r\"");
	else if (c < 0x20)
		return re_fail(r, "control character");
	else {
		char ch = (char)c;
		sb_lit(o, &ch, 1);
	}
	return 0;
}

static int re_class(struct re *r, struct sb *o)
{
	r->i++; /* [ */
	bool neg = r->i < r->n && r->p[r->i] == '^';
	if (neg)
		r->i++;
	sb_add(o, neg ? "[^\"\\\\\\x00-\\x1f" : "[");
	size_t count = 0;
	bool first = true;
	while (r->i < r->n && (r->p[r->i] != ']' || first)) {
		first = false;
		unsigned char c = (unsigned char)r->p[r->i];
		if (c == '\\') {
			if (r->i + 1 >= r->n)
				return re_fail(r, "unfinished escape");
			char e = r->p[r->i + 1];
			r->i += 2;
			if (strchr("dws", e)) {
				shorthand(o, e);
				count++;
				continue;
			}
			if (strchr("DWSbBpPu", e))
				return re_fail(r, "this escape is not supported in a class");
			c = e == 'n' ? '\n' : e == 't' ? '\t' : (unsigned char)e;
		} else if (c >= 0x80) {
			/* copy one UTF-8 sequence */
			size_t k = 1;
			while (r->i + k < r->n && ((unsigned char)r->p[r->i + k] & 0xC0) == 0x80)
				k++;
			sb_add_n(o, r->p + r->i, k);
			r->i += k;
			count++;
			continue;
		} else {
			r->i++;
		}
		if (c == '"' || c == '\\' || c < 0x20)
			continue; /* would need an escape in the JSON string: left out */
		class_char(o, c);
		count++;
		if (r->i + 1 < r->n && r->p[r->i] == '-' && r->p[r->i + 1] != ']') {
			unsigned char d = (unsigned char)r->p[r->i + 1];
			r->i += 2;
			if (d == '\\' || d >= 0x80 || d < c)
				return re_fail(r, "unsupported range in a class");
			sb_add(o, "-");
			class_char(o, d);
		}
	}
	if (r->i >= r->n)
		return re_fail(r, "unterminated class");
	r->i++; /* ] */
	sb_add(o, "]");
	if (!neg && count == 0)
		return re_fail(r, "a class with nothing a JSON string writes unescaped");
	return 0;
}

static int re_atom(struct re *r, struct sb *o)
{
	unsigned char c = (unsigned char)r->p[r->i];
	if (c == '(') {
		r->i++;
		if (r->i < r->n && r->p[r->i] == '?') {
			if (r->i + 1 < r->n && r->p[r->i + 1] == ':')
				r->i += 2;
			else
				return re_fail(r, "lookaround and named groups are not supported");
		}
		if (++r->depth > 50)
			return re_fail(r, "groups nested too deeply");
		sb_add(o, "( ");
		if (re_alt(r, o))
			return r->x->rc;
		if (r->i >= r->n || r->p[r->i] != ')')
			return re_fail(r, "unclosed group");
		r->i++;
		r->depth--;
		sb_add(o, " )");
		return 0;
	}
	if (c == '[')
		return re_class(r, o);
	if (c == '.') {
		r->i++;
		sb_add(o, "j-safe");
		return 0;
	}
	if (c == '\\') {
		if (r->i + 1 >= r->n)
			return re_fail(r, "unfinished escape");
		char e = r->p[r->i + 1];
		r->i += 2;
		if (strchr("dws", e)) {
			sb_add(o, "[");
			shorthand(o, e);
			sb_add(o, "]");
			return 0;
		}
		if (strchr("DWS", e)) {
			sb_add(o, "[^\"\\\\\\x00-\\x1f");
			shorthand(o, e);
			sb_add(o, "]");
			return 0;
		}
		if (e == 'n' || e == 't' || e == 'r')
			return re_literal(r, o, e == 'n' ? '\n' : e == 't' ? '\t' : '\r');
		if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z') || (e >= '0' && e <= '9'))
			return re_fail(r, "this escape is not supported");
		return re_literal(r, o, (unsigned char)e);
	}
	if (c == ')' || c == '|' || c == '*' || c == '+' || c == '?' || c == '{')
		return re_fail(r, "unexpected operator");
	if (c >= 0x80) {
		size_t k = 1;
		while (r->i + k < r->n && ((unsigned char)r->p[r->i + k] & 0xC0) == 0x80)
			k++;
		sb_lit(o, r->p + r->i, k);
		r->i += k;
		return 0;
	}
	r->i++;
	return re_literal(r, o, c);
}

static int re_seq(struct re *r, struct sb *o)
{
	bool any = false;
	while (r->i < r->n && r->p[r->i] != '|' && r->p[r->i] != ')') {
		if (r->p[r->i] == '$' && r->i + 1 == r->n)
			break;
		if (r->p[r->i] == '^' || r->p[r->i] == '$')
			return re_fail(r, "anchors are supported only at the ends");
		sb_add(o, any ? " ( " : "( ");
		if (re_atom(r, o))
			return r->x->rc;
		sb_add(o, " )");
		any = true;
		if (r->i < r->n && strchr("*+?{", r->p[r->i])) {
			char q = r->p[r->i];
			if (q == '{') {
				size_t j = r->i + 1;
				unsigned m = 0, n2 = 0;
				bool comma = false, has_n = false;
				while (j < r->n && r->p[j] >= '0' && r->p[j] <= '9' && m <= MAX_ITEMS_BOUND)
					m = m * 10 + (unsigned)(r->p[j++] - '0');
				if (j < r->n && r->p[j] == ',') {
					comma = true;
					j++;
					while (j < r->n && r->p[j] >= '0' && r->p[j] <= '9' &&
					       n2 <= MAX_ITEMS_BOUND) {
						n2 = n2 * 10 + (unsigned)(r->p[j++] - '0');
						has_n = true;
					}
				}
				if (j >= r->n || r->p[j] != '}' || j == r->i + 1)
					return re_fail(r, "bad repetition");
				if (m > MAX_ITEMS_BOUND || n2 > MAX_ITEMS_BOUND)
					return re_fail(r, "repetition bound too large");
				if (!comma)
					sb_printf(o, "{%u}", m);
				else if (has_n)
					sb_printf(o, "{%u,%u}", m, n2);
				else
					sb_printf(o, "{%u,}", m);
				r->i = j + 1;
			} else {
				sb_printf(o, "%c", q);
				r->i++;
			}
			if (r->i < r->n && r->p[r->i] == '?')
				r->i++; /* lazy: the same language */
		}
	}
	if (!any)
		sb_add(o, "\"\"");
	return 0;
}

static int re_alt(struct re *r, struct sb *o)
{
	for (;;) {
		if (re_seq(r, o))
			return r->x->rc;
		if (r->i < r->n && r->p[r->i] == '|') {
			r->i++;
			sb_add(o, " | ");
			continue;
		}
		return 0;
	}
}

static void gen_pattern(struct jctx *x, const char *pat, const char *path, struct sb *o)
{
	struct re r = { .p = pat, .n = strlen(pat), .x = x, .path = path };
	bool start = r.n > 0 && pat[0] == '^';
	bool end = r.n > 0 && pat[r.n - 1] == '$' && (r.n < 2 || pat[r.n - 2] != '\\');
	if (start)
		r.i = 1;
	sb_add(o, "\"\\\"\" ");
	if (!start)
		sb_add(o, "j-char* ");
	sb_add(o, "( ");
	if (re_alt(&r, o))
		return;
	if (r.i < r.n && pat[r.i] == ')') {
		re_fail(&r, "unmatched ')'");
		return;
	}
	sb_add(o, " ) ");
	if (!end)
		sb_add(o, "j-char* ");
	sb_add(o, "\"\\\"\"");
}

static const char date_g[] =
	"[0-9]{4} \"-\" ( ( \"0\" [13578] | \"1\" [02] ) \"-\" ( \"0\" [1-9] | [12] [0-9] | \"3\" [01] )"
	" | ( \"0\" [469] | \"11\" ) \"-\" ( \"0\" [1-9] | [12] [0-9] | \"30\" )"
	" | \"02-\" ( \"0\" [1-9] | \"1\" [0-9] | \"2\" [0-8] ) )";
static const char time_g[] =
	"( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] \":\" [0-5] [0-9] ( \".\" [0-9]{1,6} )?"
	" ( \"Z\" | [+-] ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] )";

static void gen_format(struct jctx *x, const char *fmt, const char *path, struct sb *o)
{
	static const char q[] = "\"\\\"\" ";
	sb_add(o, q);
	if (strcmp(fmt, "date") == 0) {
		sb_add(o, date_g);
	} else if (strcmp(fmt, "time") == 0) {
		sb_add(o, time_g);
	} else if (strcmp(fmt, "date-time") == 0) {
		sb_add(o, date_g);
		sb_add(o, " \"T\" ");
		sb_add(o, time_g);
	} else if (strcmp(fmt, "uuid") == 0) {
		sb_add(o, "[0-9a-f]{8} \"-\" [0-9a-f]{4} \"-\" [0-9a-f]{4} \"-\" [0-9a-f]{4} \"-\" "
		       "[0-9a-f]{12}");
	} else if (strcmp(fmt, "email") == 0) {
		sb_add(o, "[a-z0-9_+-]{1,20} ( \".\" [a-z0-9_+-]{1,20} )? \"@\" "
		       "( [a-z0-9] [a-z0-9-]{0,20} [a-z0-9] \".\" ){1,3} [a-z]{2,6}");
	} else if (strcmp(fmt, "ipv4") == 0) {
		sb_add(o, "( ( \"25\" [0-5] | \"2\" [0-4] [0-9] | \"1\" [0-9] [0-9] | [1-9]? [0-9] ) \".\" "
		       "){3} ( \"25\" [0-5] | \"2\" [0-4] [0-9] | \"1\" [0-9] [0-9] | [1-9]? [0-9] )");
	} else {
		fail(x, "unsupported JSON Schema value: 'format' '%s' at %s (supported: date, "
		     "time, date-time, uuid, email, ipv4)", fmt, path);
		return;
	}
	sb_add(o, " \"\\\"\"");
}

/* A non-negative integer keyword (minLength, maxItems, ...). Returns 1, 0 absent, -1 failed. */
static int read_count(struct jctx *x, const cJSON *s, const char *kw, const char *path,
		      unsigned *v)
{
	const cJSON *b = cJSON_GetObjectItemCaseSensitive(s, kw);
	if (!b)
		return 0;
	if (!cJSON_IsNumber(b) || b->valuedouble < 0 || b->valuedouble != floor(b->valuedouble)) {
		fail(x, "'%s' at %s must be a non-negative integer", kw, path);
		return -1;
	}
	if (b->valuedouble > MAX_ITEMS_BOUND) {
		fail(x, "unsupported JSON Schema value: '%s' at %s is above %d", kw, path,
		     MAX_ITEMS_BOUND);
		return -1;
	}
	*v = (unsigned)b->valuedouble;
	return 1;
}

static void gen_string(struct jctx *x, const cJSON *s, const char *path, struct sb *o)
{
	const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(s, "format");
	const cJSON *pat = cJSON_GetObjectItemCaseSensitive(s, "pattern");
	unsigned mn = 0, mx = 0;
	int hmn = read_count(x, s, "minLength", path, &mn);
	int hmx = hmn < 0 ? -1 : read_count(x, s, "maxLength", path, &mx);
	if (hmn < 0 || hmx < 0)
		return;
	if ((fmt || pat) && (hmn || hmx || (fmt && pat))) {
		fail(x, "unsupported JSON Schema keyword combination at %s: 'format', 'pattern' "
		     "and 'minLength'/'maxLength' cannot be combined", path);
		return;
	}
	if (fmt) {
		if (!cJSON_IsString(fmt)) {
			fail(x, "'format' at %s must be a string", path);
			return;
		}
		gen_format(x, fmt->valuestring, path, o);
		return;
	}
	if (pat) {
		if (!cJSON_IsString(pat)) {
			fail(x, "'pattern' at %s must be a string", path);
			return;
		}
		gen_pattern(x, pat->valuestring, path, o);
		return;
	}
	if (hmx && mx < mn) {
		fail(x, "'maxLength' is below 'minLength' at %s", path);
		return;
	}
	/* JSON Schema counts code points; one j-char is one code point (an escape decodes to
	 * one, except a surrogate pair, which the grammar writes as two \u escapes: length 2 in
	 * UTF-16 terms too) */
	if (!hmn && !hmx)
		sb_add(o, "j-string");
	else if (hmx)
		sb_printf(o, "\"\\\"\" j-char{%u,%u} \"\\\"\"", mn, mx);
	else
		sb_printf(o, "\"\\\"\" j-char{%u,} \"\\\"\"", mn);
}

/* ---- arrays and objects ---- */

static void gen_array(struct jctx *x, const cJSON *s, const char *path, struct sb *o)
{
	const cJSON *items = cJSON_GetObjectItemCaseSensitive(s, "items");
	char item[32] = "j-value", sub[300];
	unsigned mn = 0, mx = 0;
	int hmn = read_count(x, s, "minItems", path, &mn);
	int hmx = hmn < 0 ? -1 : read_count(x, s, "maxItems", path, &mx);
	if (hmn < 0 || hmx < 0)
		return;
	if (hmx && mx < mn) {
		fail(x, "'maxItems' is below 'minItems' at %s", path);
		return;
	}
	if (items) {
		snprintf(sub, sizeof(sub), "%s.items", path);
		if (gen(x, items, sub, item, sizeof(item)))
			return;
	}
	if (hmx && mx == 0) {
		sb_add(o, "\"[\" ws \"]\"");
		return;
	}
	sb_printf(o, "\"[\" ws ( %s ( \",\" ws %s )", item, item);
	unsigned rmin = mn > 0 ? mn - 1 : 0;
	if (hmx)
		sb_printf(o, "{%u,%u}", rmin, mx - 1);
	else
		sb_printf(o, "{%u,}", rmin);
	sb_printf(o, " )%s \"]\"", mn > 0 ? "" : "?");
}

struct prop {
	const char *key;  /* borrowed */
	char rule[32];
	bool required;
};

#define MAX_PROPS 256

static void gen_object(struct jctx *x, const cJSON *s, const char *path, struct sb *o)
{
	const cJSON *props = cJSON_GetObjectItemCaseSensitive(s, "properties");
	const cJSON *req = cJSON_GetObjectItemCaseSensitive(s, "required");
	const cJSON *add = cJSON_GetObjectItemCaseSensitive(s, "additionalProperties");
	char sub[300];
	if (props && !cJSON_IsObject(props)) {
		fail(x, "'properties' at %s must be an object", path);
		return;
	}
	if (req && !cJSON_IsArray(req)) {
		fail(x, "'required' at %s must be an array of strings", path);
		return;
	}
	if (add && !cJSON_IsBool(add) && !cJSON_IsObject(add)) {
		fail(x, "'additionalProperties' at %s must be a boolean or a schema", path);
		return;
	}
	int n_props = props ? cJSON_GetArraySize(props) : 0;
	if (!props && !req && add && cJSON_IsObject(add)) {
		/* a map: any keys, values of one schema */
		char val[32];
		snprintf(sub, sizeof(sub), "%s.additionalProperties", path);
		if (gen(x, add, sub, val, sizeof(val)))
			return;
		sb_printf(o, "\"{\" ws ( j-string \":\" ws %s ( \",\" ws j-string \":\" ws %s )* )? "
			  "\"}\"", val, val);
		return;
	}
	if (!props && !req && (!add || cJSON_IsTrue(add))) {
		sb_add(o, "j-object");
		return;
	}
	struct prop *pl = calloc(MAX_PROPS, sizeof(*pl));
	int np = 0;
	if (!pl) {
		x->out.oom = true;
		return;
	}
	const cJSON *it;
	cJSON_ArrayForEach(it, props) {
		if (np == MAX_PROPS) {
			fail(x, "more than %d properties at %s", MAX_PROPS, path);
			goto out;
		}
		snprintf(sub, sizeof(sub), "%s.properties.%s", path, it->string);
		pl[np].key = it->string;
		if (gen(x, it, sub, pl[np].rule, sizeof(pl[np].rule)))
			goto out;
		np++;
	}
	cJSON_ArrayForEach(it, req) {
		if (!cJSON_IsString(it)) {
			fail(x, "'required' at %s must be an array of strings", path);
			goto out;
		}
		int k;
		for (k = 0; k < np; k++)
			if (strcmp(pl[k].key, it->valuestring) == 0)
				break;
		if (k == np) {
			/* required but not described: any value, unless nothing extra is allowed */
			if (add && cJSON_IsFalse(add)) {
				fail(x, "'required' names '%s' at %s, which 'properties' does not define "
				     "and 'additionalProperties' forbids", it->valuestring, path);
				goto out;
			}
			if (np == MAX_PROPS) {
				fail(x, "more than %d properties at %s", MAX_PROPS, path);
				goto out;
			}
			pl[np].key = it->valuestring;
			snprintf(pl[np].rule, sizeof(pl[np].rule), "j-value");
			np++;
		}
		pl[k].required = true;
	}
	(void)n_props;
	/* first_i: properties i.. with none written yet; rest_i: after one was written */
	char base[24];
	new_rule_name(x, base, sizeof(base));
	for (int i = np - 1; i >= 0; i--) {
		struct sb kv = { 0 }, first = { 0 }, rest = { 0 };
		cJSON *ks = cJSON_CreateString(pl[i].key);
		char *enc = ks ? cJSON_PrintUnformatted(ks) : NULL;
		cJSON_Delete(ks);
		if (!enc) {
			x->out.oom = true;
			goto out;
		}
		sb_lit(&kv, enc, strlen(enc));
		free(enc);
		sb_printf(&kv, " \":\" ws %s", pl[i].rule);
		char next_first[40], next_rest[40];
		if (i + 1 < np) {
			snprintf(next_first, sizeof(next_first), " %s-f%d", base, i + 1);
			snprintf(next_rest, sizeof(next_rest), " %s-r%d", base, i + 1);
		} else {
			next_first[0] = next_rest[0] = 0;
		}
		sb_printf(&first, "%s%s", kv.s ? kv.s : "", next_rest);
		if (!pl[i].required)
			sb_printf(&first, " | %s", next_first[0] ? next_first + 1 : "\"\"");
		sb_printf(&rest, "\",\" ws %s%s", kv.s ? kv.s : "", next_rest);
		if (!pl[i].required)
			sb_printf(&rest, " | %s", next_rest[0] ? next_rest + 1 : "\"\"");
		free(kv.s);
		char nm[40];
		snprintf(nm, sizeof(nm), "%s-f%d", base, i);
		emit_rule(x, nm, &first);
		snprintf(nm, sizeof(nm), "%s-r%d", base, i);
		emit_rule(x, nm, &rest);
	}
	if (np == 0)
		sb_add(o, "\"{\" ws \"}\"");
	else
		sb_printf(o, "\"{\" ws %s-f0 \"}\"", base);
out:
	free(pl);
}

/* ---- $ref ---- */

static const cJSON *resolve_ref(struct jctx *x, const char *ref, const char *path)
{
	if (strcmp(ref, "#") == 0)
		return x->root;
	const char *name = NULL;
	const cJSON *defs = NULL;
	if (strncmp(ref, "#/$defs/", 8) == 0) {
		name = ref + 8;
		defs = cJSON_GetObjectItemCaseSensitive(x->root, "$defs");
	} else if (strncmp(ref, "#/definitions/", 14) == 0) {
		name = ref + 14;
		defs = cJSON_GetObjectItemCaseSensitive(x->root, "definitions");
	}
	if (!name || strchr(name, '/') || strchr(name, '~')) {
		fail(x, "unsupported JSON Schema value: '$ref' '%.100s' at %s (only #, #/$defs/NAME "
		     "and #/definitions/NAME)", ref, path);
		return NULL;
	}
	const cJSON *t = defs ? cJSON_GetObjectItemCaseSensitive(defs, name) : NULL;
	if (!t)
		fail(x, "'$ref' '%.100s' at %s does not resolve", ref, path);
	return t;
}

static int gen_ref(struct jctx *x, const char *ref, const char *path, char *name, size_t cap)
{
	for (int i = 0; i < x->n_defs; i++)
		if (strcmp(x->defs[i].ref, ref) == 0) {
			snprintf(name, cap, "%s", x->defs[i].name);
			return 0;
		}
	const cJSON *t = resolve_ref(x, ref, path);
	if (!t)
		return x->rc;
	if (x->n_defs == MAX_DEFS)
		return fail(x, "more than %d distinct $ref targets", MAX_DEFS);
	struct def *d = &x->defs[x->n_defs];
	if (!(d->ref = strdup(ref))) {
		x->out.oom = true;
		return -ENOMEM;
	}
	new_rule_name(x, d->name, sizeof(d->name));
	x->n_defs++;
	snprintf(name, cap, "%s", d->name);
	/* the rule's name is known before its body, so a recursive reference finds it */
	char body_name[32];
	char sub[300];
	snprintf(sub, sizeof(sub), "%s", ref);
	if (gen(x, t, sub, body_name, sizeof(body_name)))
		return x->rc;
	struct sb b = { 0 };
	sb_add(&b, body_name);
	emit_rule(x, d->name, &b);
	return 0;
}

/* ---- one node ---- */

static void gen_literal(struct jctx *x, const cJSON *v, struct sb *o)
{
	char *t = cJSON_PrintUnformatted(v);
	if (!t) {
		x->out.oom = true;
		return;
	}
	sb_lit(o, t, strlen(t));
	free(t);
}

static void gen_type(struct jctx *x, const cJSON *s, const char *type, const char *path,
		     struct sb *o)
{
	if (strcmp(type, "string") == 0)
		gen_string(x, s, path, o);
	else if (strcmp(type, "integer") == 0)
		gen_integer(x, s, path, o);
	else if (strcmp(type, "number") == 0)
		gen_number(x, s, path, o);
	else if (strcmp(type, "boolean") == 0)
		sb_add(o, "( \"true\" | \"false\" )");
	else if (strcmp(type, "null") == 0)
		sb_add(o, "\"null\"");
	else if (strcmp(type, "object") == 0)
		gen_object(x, s, path, o);
	else if (strcmp(type, "array") == 0)
		gen_array(x, s, path, o);
	else
		fail(x, "unknown JSON Schema type '%.40s' at %s", type, path);
}

/* The keywords that belong to one type, to infer it when "type" is absent. */
static const char *implied_type(const cJSON *s)
{
	static const struct { const char *kw, *type; } t[] = {
		{ "properties", "object" }, { "required", "object" },
		{ "additionalProperties", "object" }, { "items", "array" }, { "minItems", "array" },
		{ "maxItems", "array" }, { "minLength", "string" }, { "maxLength", "string" },
		{ "pattern", "string" }, { "format", "string" }, { "minimum", "number" },
		{ "maximum", "number" }, { "exclusiveMinimum", "number" },
		{ "exclusiveMaximum", "number" },
	};
	for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++)
		if (cJSON_GetObjectItemCaseSensitive(s, t[i].kw))
			return t[i].type;
	return NULL;
}

static bool type_is(const char *t, const cJSON *v)
{
	if (strcmp(t, "string") == 0)
		return cJSON_IsString(v);
	if (strcmp(t, "number") == 0)
		return cJSON_IsNumber(v);
	if (strcmp(t, "integer") == 0)
		return cJSON_IsNumber(v) && v->valuedouble == floor(v->valuedouble);
	if (strcmp(t, "boolean") == 0)
		return cJSON_IsBool(v);
	if (strcmp(t, "null") == 0)
		return cJSON_IsNull(v);
	if (strcmp(t, "object") == 0)
		return cJSON_IsObject(v);
	if (strcmp(t, "array") == 0)
		return cJSON_IsArray(v);
	return false;
}

/* Does a "type" keyword (absent, a string or a list) admit the value? */
static bool type_admits(const cJSON *type, const cJSON *v)
{
	if (!type)
		return true;
	if (cJSON_IsString(type))
		return type_is(type->valuestring, v);
	const cJSON *t;
	cJSON_ArrayForEach(t, type)
		if (cJSON_IsString(t) && type_is(t->valuestring, v))
			return true;
	return false;
}

static int gen(struct jctx *x, const cJSON *s, const char *path, char *name, size_t cap)
{
	if (x->rc)
		return x->rc;
	if (++x->depth > MAX_DEPTH)
		return fail(x, "the schema nests deeper than %d at %s", MAX_DEPTH, path);
	struct sb o = { 0 };
	char sub[300];
	if (cJSON_IsTrue(s)) {
		snprintf(name, cap, "j-value");
		goto done;
	}
	if (cJSON_IsFalse(s)) {
		fail(x, "the schema at %s accepts nothing (false)", path);
		goto done;
	}
	if (!cJSON_IsObject(s)) {
		fail(x, "the schema at %s must be an object or a boolean", path);
		goto done;
	}
	if (check_keywords(x, s, path))
		goto done;
	const cJSON *ref = cJSON_GetObjectItemCaseSensitive(s, "$ref");
	const cJSON *en = cJSON_GetObjectItemCaseSensitive(s, "enum");
	const cJSON *cn = cJSON_GetObjectItemCaseSensitive(s, "const");
	const cJSON *any = cJSON_GetObjectItemCaseSensitive(s, "anyOf");
	const cJSON *type = cJSON_GetObjectItemCaseSensitive(s, "type");
	int n_kinds = !!ref + !!en + !!cn + !!any;
	/* enum and const may name their type; nothing else combines */
	if (n_kinds > 1 || (n_kinds == 1 && (implied_type(s) || (type && (ref || any))))) {
		const char *k = ref ? "$ref" : en ? "enum" : cn ? "const" : "anyOf";
		fail(x, "unsupported JSON Schema keyword combination at %s: '%s' with other "
		     "constraints", path, k);
		goto done;
	}
	if (ref) {
		if (!cJSON_IsString(ref)) {
			fail(x, "'$ref' at %s must be a string", path);
			goto done;
		}
		gen_ref(x, ref->valuestring, path, name, cap);
		x->depth--;
		return x->rc;
	}
	if (en) {
		if (!cJSON_IsArray(en) || cJSON_GetArraySize(en) == 0) {
			fail(x, "'enum' at %s must be a non-empty array", path);
			goto done;
		}
		const cJSON *v;
		bool first = true;
		sb_add(&o, "( ");
		cJSON_ArrayForEach(v, en) {
			if (!type_admits(type, v))
				continue;
			if (!first)
				sb_add(&o, " | ");
			gen_literal(x, v, &o);
			first = false;
		}
		sb_add(&o, " )");
		if (first)
			fail(x, "no 'enum' value at %s has the schema's type", path);
	} else if (cn) {
		if (!type_admits(type, cn))
			fail(x, "the 'const' value at %s does not have the schema's type", path);
		gen_literal(x, cn, &o);
	} else if (any) {
		if (!cJSON_IsArray(any) || cJSON_GetArraySize(any) == 0) {
			fail(x, "'anyOf' at %s must be a non-empty array", path);
			goto done;
		}
		const cJSON *v;
		int i = 0;
		sb_add(&o, "( ");
		cJSON_ArrayForEach(v, any) {
			char alt[32];
			snprintf(sub, sizeof(sub), "%s.anyOf[%d]", path, i);
			if (gen(x, v, sub, alt, sizeof(alt)))
				goto done;
			sb_printf(&o, "%s%s", i ? " | " : "", alt);
			i++;
		}
		sb_add(&o, " )");
	} else if (type) {
		if (cJSON_IsString(type)) {
			gen_type(x, s, type->valuestring, path, &o);
		} else if (cJSON_IsArray(type) && cJSON_GetArraySize(type) > 0) {
			const cJSON *t;
			bool first = true;
			sb_add(&o, "( ");
			cJSON_ArrayForEach(t, type) {
				if (!cJSON_IsString(t)) {
					fail(x, "'type' at %s must be a string or an array of strings",
					     path);
					goto done;
				}
				if (!first)
					sb_add(&o, " | ");
				gen_type(x, s, t->valuestring, path, &o);
				first = false;
			}
			sb_add(&o, " )");
		} else {
			fail(x, "'type' at %s must be a string or an array of strings", path);
			goto done;
		}
	} else if (implied_type(s)) {
		gen_type(x, s, implied_type(s), path, &o);
	} else {
		snprintf(name, cap, "j-value"); /* no constraint: any value */
		goto done;
	}
	if (!x->rc) {
		new_rule_name(x, name, cap);
		emit_rule(x, name, &o);
	}
done:
	free(o.s);
	x->depth--;
	return x->rc;
}

/* ---- the builder ---- */

struct md_jgrammar {
	struct jctx x;
};

struct md_jgrammar *md_jgrammar_new(void)
{
	return calloc(1, sizeof(struct md_jgrammar));
}

void md_jgrammar_free(struct md_jgrammar *b)
{
	if (!b)
		return;
	for (int i = 0; i < b->x.n_defs; i++)
		free(b->x.defs[i].ref);
	free(b->x.out.s);
	free(b);
}

int md_jgrammar_add(struct md_jgrammar *b, const cJSON *schema, char *rule, size_t cap,
		    char *err, size_t errlen)
{
	struct jctx *x = &b->x;
	/* $refs resolve within this schema: targets of an earlier one are other rules */
	for (int i = 0; i < x->n_defs; i++)
		free(x->defs[i].ref);
	x->n_defs = 0;
	x->root = schema;
	x->err = err;
	x->errlen = errlen;
	x->rc = 0;
	x->depth = 0;
	if (err && errlen)
		err[0] = 0;
	gen(x, schema, "$", rule, cap);
	if (!x->rc && x->out.oom) {
		x->rc = -ENOMEM;
		if (err && errlen)
			snprintf(err, errlen, "out of memory translating the schema");
	}
	return x->rc;
}

int md_jgrammar_finish(struct md_jgrammar *b, const char *root_body, char **out)
{
	struct sb o = { 0 };
	*out = NULL;
	sb_printf(&o, "root ::= ");
	sb_add(&o, root_body);
	sb_add(&o, "\n");
	if (b->x.out.s)
		sb_add(&o, b->x.out.s);
	sb_add(&o, FIXED_RULES);
	if (o.oom || b->x.out.oom) {
		free(o.s);
		return -ENOMEM;
	}
	*out = o.s;
	return 0;
}

int md_json_schema_grammar(const cJSON *schema, char **out, char *err, size_t errlen)
{
	struct md_jgrammar *b = md_jgrammar_new();
	char root[32];
	*out = NULL;
	if (!b) {
		if (err && errlen)
			snprintf(err, errlen, "out of memory translating the schema");
		return -ENOMEM;
	}
	int rc = md_jgrammar_add(b, schema, root, sizeof(root), err, errlen);
	if (!rc && (rc = md_jgrammar_finish(b, root, out)) && err && errlen)
		snprintf(err, errlen, "out of memory translating the schema");
	md_jgrammar_free(b);
	return rc;
}
