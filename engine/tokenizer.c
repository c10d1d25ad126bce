/* Byte-level BPE and SentencePiece BPE tokenizers, and the streaming detokenizer. */
#include "engine/tokenizer.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include "engine/gguf.h"

/*
 * DESIGN
 *
 * Encoding runs in three stages, as in Hugging Face tokenizers (the reference the tests
 * compare against) and llama.cpp:
 *   1. added tokens are cut out of the raw text (leftmost, longest first);
 *   2. each remaining fragment is normalised (NFC for qwen2; "▁" for spaces and a "▁" prefix
 *      for SentencePiece) and, for byte-level BPE, split into words by the family's regexes
 *      (PCRE2, UTF + Unicode properties, JIT-compiled; Split "Isolated": matches and the gaps
 *      between them are words, and each further regex splits the words of the previous one);
 *   3. each word is merged: byte-level BPE starts from one symbol per byte and merges the
 *      adjacent pair of lowest merge rank; SentencePiece starts from one symbol per character
 *      and merges the adjacent pair whose concatenation is a vocab token of highest score,
 *      then spells unknown symbols as <0xNN> byte tokens. Ties go to the leftmost pair.
 *      Both use one binary heap with lazy deletion, so a long word costs O(n log n).
 *
 * Oniguruma (which the Rust tokenizers use) reads \s as the Unicode White_Space property,
 * which includes U+0085; PCRE2's \s with UCP does not. The patterns are therefore written with
 * an explicit White_Space class (expand_ws below) instead of \s and \S.
 *
 * The tokenizer is immutable after load; every encode call allocates its own scratch state
 * (PCRE2 match data included), so concurrent calls need no lock.
 */

#define MAX_VOCAB (1u << 24)
#define REPL "\xEF\xBF\xBD" /* U+FFFD */
#define SPM_SPACE "\xE2\x96\x81" /* U+2581 ▁ */

enum tok_kind { KIND_BPE, KIND_SPM };
enum tok_pre { PRE_GPT2, PRE_QWEN2, PRE_LLAMA3, PRE_DEEPSEEK3, PRE_GPT4O, PRE_GLM4 };

struct merge_ent {
	uint64_t key; /* (left id << 32) | right id; UINT64_MAX when empty */
	uint32_t rank;
	int32_t result;
};

#define MAX_RE 3
#define MAX_EOG 16

struct md_tokenizer {
	enum tok_kind kind;
	enum tok_pre pre;
	uint32_t n_vocab;
	char *pool;       /* owned: all token texts back to back */
	uint64_t *offs;   /* owned (n_vocab + 1): text of id i is pool[offs[i], offs[i+1]) */
	uint8_t *types;   /* owned (n_vocab): enum md_token_type */
	float *scores;    /* owned (n_vocab) or NULL */
	uint32_t *hash;   /* owned (hash_mask + 1): id + 1, 0 empty; text -> id */
	uint64_t hash_mask;
	struct merge_ent *merges; /* owned (merge_mask + 1), BPE only */
	uint64_t merge_mask;
	int32_t byte_tok[256]; /* BPE: token of each byte; SPM: <0xNN> token or -1 */
	uint8_t bl_enc[256][2]; /* byte-level: byte -> code point (as UTF-8, 1-2 bytes) */
	int16_t bl_dec[324];    /* byte-level: code point -> byte, -1 if none */
	char *ppool;      /* owned: decoded bytes of every token back to back */
	uint64_t *poffs;  /* owned (n_vocab + 1): piece of id i is ppool[poffs[i], poffs[i+1]) */
	int32_t *added;    /* owned (n_added): control/user-defined/unknown ids, sorted by first
	                    * byte, then longest first */
	uint32_t n_added;
	uint32_t added_first[257]; /* added[added_first[c] .. added_first[c + 1]) start with c */
	pcre2_code *re[MAX_RE];    /* owned */
	int n_re;
	bool nfc, ignore_merges, add_bos, add_eos, add_space_prefix;
	int32_t bos, eos, unk;
	int32_t eog[MAX_EOG];
	int n_eog;
};

/* ---------------------------------------------------------------- small helpers */

static void seterr(char *err, size_t errlen, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
static void seterr(char *err, size_t errlen, const char *fmt, ...)
{
	va_list ap;

	if (!err || !errlen)
		return;
	va_start(ap, fmt);
	vsnprintf(err, errlen, fmt, ap);
	va_end(ap);
}

struct ivec {
	int32_t *v; /* owned */
	size_t n, cap;
};

static int ivec_push(struct ivec *a, int32_t x)
{
	if (a->n == a->cap) {
		size_t nc = a->cap ? a->cap * 2 : 64;
		int32_t *nv = realloc(a->v, nc * sizeof(*nv));

		if (!nv)
			return -ENOMEM;
		a->v = nv;
		a->cap = nc;
	}
	a->v[a->n++] = x;
	return 0;
}

/* Grow *p (element size sz) to hold at least n elements. */
static int grow(void *pp, size_t *cap, size_t n, size_t sz)
{
	void **p = pp;
	size_t nc;
	void *np;

	if (n <= *cap)
		return 0;
	nc = *cap ? *cap : 64;
	while (nc < n)
		nc *= 2;
	np = realloc(*p, nc * sz);
	if (!np)
		return -ENOMEM;
	*p = np;
	*cap = nc;
	return 0;
}

static uint64_t hash_bytes(const char *s, size_t n)
{
	uint64_t h = 0xcbf29ce484222325ull;

	for (size_t i = 0; i < n; i++) {
		h ^= (unsigned char)s[i];
		h *= 0x100000001b3ull;
	}
	return h ^ (h >> 29);
}

static uint64_t hash_u64(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdull;
	x ^= x >> 33;
	x *= 0xc4ceb9fe1a85ec53ull;
	return x ^ (x >> 33);
}

static inline const char *tok_text(const struct md_tokenizer *t, uint32_t id, size_t *len)
{
	*len = (size_t)(t->offs[id + 1] - t->offs[id]);
	return t->pool + t->offs[id];
}

static int32_t lookup(const struct md_tokenizer *t, const char *s, size_t n)
{
	uint64_t i = hash_bytes(s, n) & t->hash_mask;

	for (;; i = (i + 1) & t->hash_mask) {
		uint32_t e = t->hash[i];
		size_t l;
		const char *p;

		if (!e)
			return -1;
		p = tok_text(t, e - 1, &l);
		if (l == n && memcmp(p, s, n) == 0)
			return (int32_t)(e - 1);
	}
}

static const struct merge_ent *merge_find(const struct md_tokenizer *t, int32_t a, int32_t b)
{
	uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
	uint64_t i = hash_u64(key) & t->merge_mask;

	for (;; i = (i + 1) & t->merge_mask) {
		const struct merge_ent *e = &t->merges[i];

		if (e->key == key)
			return e;
		if (e->key == UINT64_MAX)
			return NULL;
	}
}

/* ---------------------------------------------------------------- UTF-8 */

/* Classify the sequence at s (n > 0 bytes available). Returns 1 for a well-formed character
 * (*len its length), 0 for an ill-formed one (*len the length of its maximal subpart, >= 1),
 * -1 when s holds a well-formed but truncated prefix (*len == n). */
static int utf8_scan(const unsigned char *s, size_t n, size_t *len)
{
	unsigned c = s[0], need, lo = 0x80, hi = 0xBF;

	if (c < 0x80) {
		*len = 1;
		return 1;
	}
	if (c >= 0xC2 && c <= 0xDF) {
		need = 1;
	} else if (c >= 0xE0 && c <= 0xEF) {
		need = 2;
		if (c == 0xE0)
			lo = 0xA0;
		else if (c == 0xED)
			hi = 0x9F;
	} else if (c >= 0xF0 && c <= 0xF4) {
		need = 3;
		if (c == 0xF0)
			lo = 0x90;
		else if (c == 0xF4)
			hi = 0x8F;
	} else {
		*len = 1;
		return 0;
	}
	for (unsigned i = 1; i <= need; i++) {
		unsigned b;

		if (i >= n) {
			*len = n;
			return -1;
		}
		b = s[i];
		if (b < lo || b > hi) {
			*len = i;
			return 0;
		}
		lo = 0x80;
		hi = 0xBF;
	}
	*len = need + 1;
	return 1;
}

/* Returns a malloc'd copy of s with every maximal ill-formed subpart (a truncated sequence at
 * the end included) replaced by U+FFFD, or NULL with *nout = 0 when s is already valid.
 * Returns NULL with *nout = SIZE_MAX on allocation failure. */
static char *utf8_sanitize(const char *s, size_t n, size_t *nout)
{
	const unsigned char *u = (const unsigned char *)s;
	size_t i = 0, l;
	char *out = NULL;
	size_t o = 0;

	*nout = 0;
	while (i < n) {
		if (u[i] < 0x80) {
			i++;
			continue;
		}
		if (utf8_scan(u + i, n - i, &l) == 1) {
			i += l;
			continue;
		}
		break;
	}
	if (i == n)
		return NULL;
	out = malloc(n * 3 + 1); /* each bad byte may become 3 bytes */
	if (!out) {
		*nout = SIZE_MAX;
		return NULL;
	}
	memcpy(out, s, i);
	o = i;
	while (i < n) {
		int r = utf8_scan(u + i, n - i, &l);

		if (r == 1) {
			memcpy(out + o, s + i, l);
			o += l;
		} else {
			memcpy(out + o, REPL, 3);
			o += 3;
		}
		i += l;
	}
	*nout = o;
	return out;
}

static size_t utf8_len1(unsigned char c)
{
	return c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
}

static uint32_t utf8_cp(const unsigned char *s, size_t *len)
{
	size_t l = utf8_len1(s[0]);

	*len = l;
	switch (l) {
	case 1: return s[0];
	case 2: return ((uint32_t)(s[0] & 0x1F) << 6) | (s[1] & 0x3F);
	case 3: return ((uint32_t)(s[0] & 0x0F) << 12) | ((uint32_t)(s[1] & 0x3F) << 6) |
		       (s[2] & 0x3F);
	default: return ((uint32_t)(s[0] & 0x07) << 18) | ((uint32_t)(s[1] & 0x3F) << 12) |
			((uint32_t)(s[2] & 0x3F) << 6) | (s[3] & 0x3F);
	}
}

/* ---------------------------------------------------------------- pre-tokenizer patterns */

/* Regexes of the Hugging Face pre-tokenizers of each family (tokenizer.json "Split" patterns),
 * with \s and \S standing for Oniguruma's Unicode White_Space (see expand_ws). */
static const char *const re_gpt2[] = {
	"'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+",
};
static const char *const re_qwen2[] = {
	"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}|"
	" ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
};
static const char *const re_llama3[] = {
	"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}|"
	" ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
};
/* GLM-4 / GLM-4.5 ("glm4", "chatglm-bpe"): Llama-3's split with the contractions' case
 * spelled out as classes, as llama.cpp defines it (so 's matches 'S but not 'ſ). */
static const char *const re_glm4[] = {
	"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
	"\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
};
static const char *const re_deepseek3[] = {
	"\\p{N}{1,3}",
	"[\\x{4E00}-\\x{9FA5}\\x{3040}-\\x{309F}\\x{30A0}-\\x{30FF}]+",
	("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?"
	 "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"),
};

/* o200k (gpt-4o, gpt-oss; llama.cpp's "gpt-4o"): the tokenizer.json pattern as it is, case
 * classes and (?i:) included, which PCRE2 takes directly (llama.cpp rewrites it for its own
 * regex engine). */
static const char *const re_gpt4o[] = {
	"[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
	"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
	"[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"
	"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
	"\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
};

#define WS_CLASS "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}" \
		 "\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"

/* Rewrite \s as [WS], \S as [^WS] and \s inside a class as WS. Returns malloc'd or NULL. */
static char *expand_ws(const char *p)
{
	size_t n = strlen(p), o = 0;
	char *out = malloc(n * 16 + sizeof(WS_CLASS) * 8 + 1);
	bool in_class = false;

	if (!out)
		return NULL;
	for (size_t i = 0; i < n; i++) {
		if (p[i] == '\\' && i + 1 < n) {
			char c = p[i + 1];

			if (c == 's' || c == 'S') {
				const char *rep = c == 's' ? (in_class ? WS_CLASS : "[" WS_CLASS "]")
							   : "[^" WS_CLASS "]";

				memcpy(out + o, rep, strlen(rep));
				o += strlen(rep);
			} else {
				out[o++] = p[i];
				out[o++] = c;
			}
			i++;
			continue;
		}
		if (p[i] == '[' && !in_class)
			in_class = true;
		else if (p[i] == ']' && in_class)
			in_class = false;
		out[o++] = p[i];
	}
	out[o] = 0;
	return out;
}

static int compile_res(struct md_tokenizer *t, const char *const *pats, int n, char *err,
		       size_t errlen)
{
	for (int i = 0; i < n; i++) {
		char *p = expand_ws(pats[i]);
		int ec;
		PCRE2_SIZE eo;

		if (!p)
			return -ENOMEM;
		t->re[i] = pcre2_compile((PCRE2_SPTR)p, PCRE2_ZERO_TERMINATED,
					 PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &ec, &eo, NULL);
		free(p);
		if (!t->re[i]) {
			PCRE2_UCHAR msg[128];

			pcre2_get_error_message(ec, msg, sizeof(msg));
			seterr(err, errlen, "cannot compile pre-tokenizer regex %d: %s", i,
			       (char *)msg);
			return -EINVAL;
		}
		/* JIT is an optimisation: without it (no JIT support) matching still works. */
		(void)pcre2_jit_compile(t->re[i], PCRE2_JIT_COMPLETE);
		t->n_re = i + 1;
	}
	return 0;
}

/* ---------------------------------------------------------------- loading */

static void byte_level_tables(struct md_tokenizer *t)
{
	int n = 0;

	for (int i = 0; i < 324; i++)
		t->bl_dec[i] = -1;
	for (int b = 0; b < 256; b++) {
		uint32_t cp;

		if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255))
			cp = (uint32_t)b;
		else
			cp = 256 + (uint32_t)n++;
		t->bl_dec[cp] = (int16_t)b;
		if (cp < 0x80) {
			t->bl_enc[b][0] = (uint8_t)cp;
			t->bl_enc[b][1] = 0;
		} else {
			t->bl_enc[b][0] = (uint8_t)(0xC0 | (cp >> 6));
			t->bl_enc[b][1] = (uint8_t)(0x80 | (cp & 0x3F));
		}
	}
}

static size_t bl_enc_len(const struct md_tokenizer *t, unsigned char b)
{
	return t->bl_enc[b][0] < 0x80 ? 1 : 2;
}

static const struct md_gguf_kv *find_arr(const struct md_gguf *g, const char *key,
					 enum md_gguf_vtype et)
{
	int64_t i = md_gguf_find_key(g, key);
	const struct md_gguf_kv *kv;

	if (i < 0)
		return NULL;
	kv = &g->kv[i];
	if (kv->type != MD_GGUF_ARRAY)
		return NULL;
	if (et != MD_GGUF_ARRAY && kv->arr_type != et)
		return NULL;
	return kv;
}

static int32_t get_id(const struct md_gguf *g, const char *key, uint32_t n)
{
	uint32_t v;

	if (!md_gguf_get_u32(g, key, &v) || v >= n)
		return -1;
	return (int32_t)v;
}

static int load_merges(struct md_tokenizer *t, const struct md_gguf_kv *kv, char *err,
		       size_t errlen)
{
	uint64_t n = kv->arr_n, cap = 16;
	char *buf = NULL;
	size_t bcap = 0;

	while (cap < n * 2)
		cap *= 2;
	t->merges = malloc(cap * sizeof(*t->merges));
	if (!t->merges)
		return -ENOMEM;
	t->merge_mask = cap - 1;
	for (uint64_t i = 0; i < cap; i++)
		t->merges[i].key = UINT64_MAX;
	for (uint64_t r = 0; r < n; r++) {
		struct md_gguf_str s;
		const char *sp;
		int32_t a, b, c;
		uint64_t key, h;

		if (!md_gguf_arr_str(kv, r, &s)) {
			free(buf);
			seterr(err, errlen, "tokenizer.ggml.merges[%llu] unreadable",
			       (unsigned long long)r);
			return -EINVAL;
		}
		sp = s.len > 1 ? memchr(s.ptr + 1, ' ', s.len - 1) : NULL;
		if (!sp)
			continue;
		a = lookup(t, s.ptr, (size_t)(sp - s.ptr));
		b = lookup(t, sp + 1, (size_t)(s.ptr + s.len - sp - 1));
		if (grow(&buf, &bcap, s.len, 1)) {
			free(buf);
			return -ENOMEM;
		}
		memcpy(buf, s.ptr, (size_t)(sp - s.ptr));
		memcpy(buf + (sp - s.ptr), sp + 1, (size_t)(s.ptr + s.len - sp - 1));
		c = lookup(t, buf, (size_t)s.len - 1);
		if (a < 0 || b < 0 || c < 0)
			continue;
		key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
		for (h = hash_u64(key) & t->merge_mask; t->merges[h].key != UINT64_MAX;
		     h = (h + 1) & t->merge_mask)
			if (t->merges[h].key == key)
				break;
		if (t->merges[h].key == key)
			continue; /* keep the lowest rank */
		t->merges[h].key = key;
		t->merges[h].rank = (uint32_t)r;
		t->merges[h].result = c;
	}
	free(buf);
	return 0;
}

static int build_pieces(struct md_tokenizer *t);

static const char *const eog_texts[] = {
	"<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end|>", "<end_of_turn>",
	"<|end_of_text|>", "<｜end▁of▁sentence｜>", "<EOT>", "</s>", "<|return|>", "<|call|>",
};

/* Take <|end|> off the end-of-generation list where <|return|> and <|call|> are on it. */
static void drop_harmony_end(struct md_tokenizer *t)
{
	int32_t end = lookup(t, "<|end|>", 7), ret = lookup(t, "<|return|>", 10);
	int32_t call = lookup(t, "<|call|>", 8);
	bool has_ret = false, has_call = false;
	for (int i = 0; i < t->n_eog; i++) {
		has_ret |= ret >= 0 && t->eog[i] == ret;
		has_call |= call >= 0 && t->eog[i] == call;
	}
	if (!has_ret || !has_call || end < 0)
		return;
	for (int i = 0; i < t->n_eog; i++)
		if (t->eog[i] == end) {
			t->eog[i] = t->eog[--t->n_eog];
			return;
		}
}

static void add_eog(struct md_tokenizer *t, int32_t id)
{
	if (id < 0 || t->n_eog >= MAX_EOG)
		return;
	for (int i = 0; i < t->n_eog; i++)
		if (t->eog[i] == id)
			return;
	t->eog[t->n_eog++] = id;
}

static const struct md_tokenizer *sort_ctx;

static int cmp_added(const void *pa, const void *pb)
{
	int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
	size_t la, lb;
	const unsigned char *sa = (const unsigned char *)tok_text(sort_ctx, (uint32_t)a, &la);
	const unsigned char *sb = (const unsigned char *)tok_text(sort_ctx, (uint32_t)b, &lb);

	if (sa[0] != sb[0])
		return sa[0] < sb[0] ? -1 : 1;
	if (la != lb)
		return la > lb ? -1 : 1;
	return a < b ? -1 : a > b;
}

static int build_added(struct md_tokenizer *t)
{
	uint32_t n = 0;

	for (uint32_t i = 0; i < t->n_vocab; i++) {
		uint8_t ty = t->types[i];

		if ((ty == MD_TOKEN_CONTROL || ty == MD_TOKEN_USER_DEFINED ||
		     ty == MD_TOKEN_UNKNOWN) && t->offs[i + 1] > t->offs[i])
			n++;
	}
	t->added = malloc((n ? n : 1) * sizeof(*t->added));
	if (!t->added)
		return -ENOMEM;
	n = 0;
	for (uint32_t i = 0; i < t->n_vocab; i++) {
		uint8_t ty = t->types[i];

		if ((ty == MD_TOKEN_CONTROL || ty == MD_TOKEN_USER_DEFINED ||
		     ty == MD_TOKEN_UNKNOWN) && t->offs[i + 1] > t->offs[i])
			t->added[n++] = (int32_t)i;
	}
	t->n_added = n;
	/* qsort has no context argument in C11; loading is not hot, a static is fine under the
	 * single-threaded model load. */
	sort_ctx = t;
	qsort(t->added, n, sizeof(*t->added), cmp_added);
	sort_ctx = NULL;
	for (uint32_t c = 0, k = 0; c <= 256; c++) {
		while (k < n && (unsigned char)t->pool[t->offs[t->added[k]]] < c)
			k++;
		t->added_first[c] = k;
	}
	return 0;
}

int md_tokenizer_load(struct md_tokenizer **out, const struct md_gguf *g, char *err,
		      size_t errlen)
{
	struct md_tokenizer *t;
	struct md_gguf_str model, pre = { 0, NULL };
	const struct md_gguf_kv *ktok, *ktype, *kscore, *kmerge;
	uint64_t total = 0, hcap = 16;
	int rc = -EINVAL;
	bool b;

	*out = NULL;
	if (!md_gguf_get_str(g, "tokenizer.ggml.model", &model)) {
		seterr(err, errlen, "missing tokenizer.ggml.model");
		return -EINVAL;
	}
	t = calloc(1, sizeof(*t));
	if (!t)
		return -ENOMEM;
	if (md_gguf_str_eq(model, "gpt2")) {
		t->kind = KIND_BPE;
	} else if (md_gguf_str_eq(model, "llama")) {
		t->kind = KIND_SPM;
	} else {
		seterr(err, errlen, "unsupported tokenizer.ggml.model '%.*s' (want gpt2 or llama)",
		       (int)(model.len > 64 ? 64 : model.len), model.ptr);
		rc = -ENOTSUP;
		goto fail;
	}
	if (t->kind == KIND_BPE) {
		if (!md_gguf_get_str(g, "tokenizer.ggml.pre", &pre) ||
		    md_gguf_str_eq(pre, "default") || md_gguf_str_eq(pre, "gpt2") ||
		    md_gguf_str_eq(pre, "gpt-2")) {
			t->pre = PRE_GPT2;
		} else if (md_gguf_str_eq(pre, "qwen2") ||
			   md_gguf_str_eq(pre, "deepseek-r1-qwen")) {
			t->pre = PRE_QWEN2;
		} else if (md_gguf_str_eq(pre, "llama-bpe") || md_gguf_str_eq(pre, "llama3") ||
			   md_gguf_str_eq(pre, "llama-v3")) {
			t->pre = PRE_LLAMA3;
		} else if (md_gguf_str_eq(pre, "deepseek-v3")) {
			t->pre = PRE_DEEPSEEK3;
		} else if (md_gguf_str_eq(pre, "gpt-4o")) {
			t->pre = PRE_GPT4O;
		} else if (md_gguf_str_eq(pre, "glm4") || md_gguf_str_eq(pre, "chatglm-bpe")) {
			t->pre = PRE_GLM4;
		} else {
			seterr(err, errlen, "unsupported tokenizer.ggml.pre '%.*s' (want default, "
			       "qwen2, llama-bpe, deepseek-v3, gpt-4o or glm4)",
			       (int)(pre.len > 64 ? 64 : pre.len), pre.ptr);
			rc = -ENOTSUP;
			goto fail;
		}
	}

	ktok = find_arr(g, "tokenizer.ggml.tokens", MD_GGUF_STRING);
	if (!ktok || ktok->arr_n == 0 || ktok->arr_n > MAX_VOCAB) {
		seterr(err, errlen, "tokenizer.ggml.tokens missing, not a string array, or of bad "
		       "size");
		goto fail;
	}
	t->n_vocab = (uint32_t)ktok->arr_n;
	for (uint32_t i = 0; i < t->n_vocab; i++) {
		struct md_gguf_str s;

		if (!md_gguf_arr_str(ktok, i, &s)) {
			seterr(err, errlen, "tokenizer.ggml.tokens[%u] unreadable", i);
			goto fail;
		}
		total += s.len;
	}
	rc = -ENOMEM;
	t->pool = malloc(total + 1);
	t->offs = malloc((t->n_vocab + 1ull) * sizeof(*t->offs));
	t->types = malloc(t->n_vocab);
	while (hcap < 2ull * t->n_vocab)
		hcap *= 2;
	t->hash = calloc(hcap, sizeof(*t->hash));
	t->hash_mask = hcap - 1;
	if (!t->pool || !t->offs || !t->types || !t->hash)
		goto fail;
	total = 0;
	for (uint32_t i = 0; i < t->n_vocab; i++) {
		struct md_gguf_str s;

		md_gguf_arr_str(ktok, i, &s);
		memcpy(t->pool + total, s.ptr, s.len);
		t->offs[i] = total;
		total += s.len;
	}
	t->offs[t->n_vocab] = total;

	ktype = find_arr(g, "tokenizer.ggml.token_type", MD_GGUF_ARRAY);
	for (uint32_t i = 0; i < t->n_vocab; i++) {
		int64_t v = MD_TOKEN_NORMAL;

		if (ktype && (!md_gguf_arr_i64(ktype, i, &v) || v < 0 || v > MD_TOKEN_BYTE))
			v = MD_TOKEN_NORMAL;
		t->types[i] = (uint8_t)v;
	}
	kscore = find_arr(g, "tokenizer.ggml.scores", MD_GGUF_ARRAY);
	if (kscore) {
		t->scores = malloc(t->n_vocab * sizeof(*t->scores));
		if (!t->scores)
			goto fail;
		for (uint32_t i = 0; i < t->n_vocab; i++)
			if (!md_gguf_arr_f32(kscore, i, &t->scores[i]))
				t->scores[i] = 0.0f;
	}
	/* Text -> id; the first id wins when two tokens share a text. */
	for (uint32_t i = 0; i < t->n_vocab; i++) {
		size_t l;
		const char *s = tok_text(t, i, &l);
		uint64_t h = hash_bytes(s, l) & t->hash_mask;

		if (lookup(t, s, l) >= 0)
			continue;
		while (t->hash[h])
			h = (h + 1) & t->hash_mask;
		t->hash[h] = i + 1;
	}

	/* GLM's files name [gMASK] as BOS, which their template writes itself: llama.cpp
	 * drops the BOS of this pre-tokenizer, and so does moed. */
	t->bos = t->pre == PRE_GLM4 ? -1 : get_id(g, "tokenizer.ggml.bos_token_id", t->n_vocab);
	t->eos = get_id(g, "tokenizer.ggml.eos_token_id", t->n_vocab);
	t->unk = get_id(g, "tokenizer.ggml.unknown_token_id", t->n_vocab);
	t->add_bos = t->kind == KIND_SPM || t->pre == PRE_LLAMA3;
	if (md_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &b))
		t->add_bos = b;
	if (md_gguf_get_bool(g, "tokenizer.ggml.add_eos_token", &b))
		t->add_eos = b;
	t->add_space_prefix = t->kind == KIND_SPM;
	if (md_gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", &b))
		t->add_space_prefix = b && t->kind == KIND_SPM;
	add_eog(t, t->eos);
	add_eog(t, get_id(g, "tokenizer.ggml.eot_token_id", t->n_vocab));
	add_eog(t, get_id(g, "tokenizer.ggml.eom_token_id", t->n_vocab));
	for (size_t i = 0; i < sizeof(eog_texts) / sizeof(eog_texts[0]); i++) {
		int32_t id = lookup(t, eog_texts[i], strlen(eog_texts[i]));

		if (id >= 0 && t->types[id] == MD_TOKEN_CONTROL)
			add_eog(t, id);
	}
	/* o200k_harmony (gpt-oss): <|end|> closes a message, not the generation, when the
	 * vocabulary has <|return|> and <|call|> (llama.cpp's rule too). */
	drop_harmony_end(t);

	if (t->kind == KIND_BPE) {
		byte_level_tables(t);
		for (int c = 0; c < 256; c++) {
			t->byte_tok[c] = lookup(t, (const char *)t->bl_enc[c],
						bl_enc_len(t, (unsigned char)c));
			if (t->byte_tok[c] < 0) {
				seterr(err, errlen, "byte-level vocab lacks the token of byte 0x%02X",
				       c);
				rc = -EINVAL;
				goto fail;
			}
		}
		kmerge = find_arr(g, "tokenizer.ggml.merges", MD_GGUF_STRING);
		if (!kmerge) {
			seterr(err, errlen, "tokenizer.ggml.merges missing or not a string array");
			rc = -EINVAL;
			goto fail;
		}
		rc = load_merges(t, kmerge, err, errlen);
		if (rc)
			goto fail;
		t->nfc = t->pre == PRE_QWEN2;
		t->ignore_merges = t->pre == PRE_LLAMA3 || t->pre == PRE_GPT4O;
		switch (t->pre) {
		case PRE_GPT2: rc = compile_res(t, re_gpt2, 1, err, errlen); break;
		case PRE_QWEN2: rc = compile_res(t, re_qwen2, 1, err, errlen); break;
		case PRE_LLAMA3: rc = compile_res(t, re_llama3, 1, err, errlen); break;
		case PRE_DEEPSEEK3: rc = compile_res(t, re_deepseek3, 3, err, errlen); break;
		case PRE_GPT4O: rc = compile_res(t, re_gpt4o, 1, err, errlen); break;
		case PRE_GLM4: rc = compile_res(t, re_glm4, 1, err, errlen); break;
		}
		if (rc)
			goto fail;
	} else {
		for (int c = 0; c < 256; c++) {
			char name[8];

			snprintf(name, sizeof(name), "<0x%02X>", c);
			t->byte_tok[c] = lookup(t, name, 6);
		}
		if (!t->scores) {
			seterr(err, errlen, "tokenizer.ggml.scores missing (needed by model llama)");
			rc = -EINVAL;
			goto fail;
		}
	}
	rc = build_added(t);
	if (!rc)
		rc = build_pieces(t);
	if (rc)
		goto fail;
	*out = t;
	return 0;
fail:
	if (rc == -ENOMEM)
		seterr(err, errlen, "out of memory loading the tokenizer");
	md_tokenizer_free(t);
	return rc;
}

void md_tokenizer_free(struct md_tokenizer *t)
{
	if (!t)
		return;
	for (int i = 0; i < t->n_re; i++)
		pcre2_code_free(t->re[i]);
	free(t->added);
	free(t->ppool);
	free(t->poffs);
	free(t->merges);
	free(t->hash);
	free(t->scores);
	free(t->types);
	free(t->offs);
	free(t->pool);
	free(t);
}

uint32_t md_tokenizer_n_vocab(const struct md_tokenizer *t) { return t->n_vocab; }
int32_t md_tokenizer_bos(const struct md_tokenizer *t) { return t->bos; }
int32_t md_tokenizer_eos(const struct md_tokenizer *t) { return t->eos; }
bool md_tokenizer_add_bos(const struct md_tokenizer *t) { return t->add_bos && t->bos >= 0; }

bool md_tokenizer_is_eog(const struct md_tokenizer *t, int32_t id)
{
	for (int i = 0; i < t->n_eog; i++)
		if (t->eog[i] == id)
			return true;
	return false;
}

enum md_token_type md_tokenizer_type(const struct md_tokenizer *t, int32_t id)
{
	if (id < 0 || (uint32_t)id >= t->n_vocab)
		return MD_TOKEN_UNDEFINED;
	return (enum md_token_type)t->types[id];
}

const char *md_tokenizer_token_text(const struct md_tokenizer *t, int32_t id, size_t *len)
{
	if (id < 0 || (uint32_t)id >= t->n_vocab)
		return NULL;
	return tok_text(t, (uint32_t)id, len);
}

int32_t md_tokenizer_find(const struct md_tokenizer *t, const char *text, size_t len)
{
	return lookup(t, text, len);
}

/* ---------------------------------------------------------------- merging */

struct sym {
	uint32_t start, len; /* bytes of the word */
	int32_t prev, next;  /* neighbours, -1 at the ends */
	int32_t id;          /* token, or -1 for an SPM character not (yet) known */
};

struct cand {
	float prio;  /* lower merges first: BPE rank, SPM -score */
	uint32_t left, right, llen, rlen;
	int32_t result;
};

/* Per-call scratch; grown as needed, freed at the end of md_tokenizer_encode. */
struct work {
	struct sym *syms;
	size_t syms_cap;
	struct cand *heap;
	size_t heap_n, heap_cap;
	char *buf;
	size_t buf_cap;
	uint64_t *pieces, *pieces2; /* (start << 32 | len) */
	size_t pieces_cap, pieces2_cap;
	pcre2_match_data *md;
	pcre2_match_context *mctx;
	pcre2_jit_stack *jstack;
};

static bool cand_less(const struct cand *a, const struct cand *b)
{
	if (a->prio != b->prio)
		return a->prio < b->prio;
	return a->left < b->left;
}

static int heap_push(struct work *w, const struct cand *c)
{
	size_t i;

	if (grow(&w->heap, &w->heap_cap, w->heap_n + 1, sizeof(*w->heap)))
		return -ENOMEM;
	i = w->heap_n++;
	while (i > 0) {
		size_t p = (i - 1) / 2;

		if (!cand_less(c, &w->heap[p]))
			break;
		w->heap[i] = w->heap[p];
		i = p;
	}
	w->heap[i] = *c;
	return 0;
}

static struct cand heap_pop(struct work *w)
{
	struct cand top = w->heap[0], last = w->heap[--w->heap_n];
	size_t i = 0, n = w->heap_n;

	for (;;) {
		size_t l = 2 * i + 1, m = i;

		if (l >= n)
			break;
		m = l;
		if (l + 1 < n && cand_less(&w->heap[l + 1], &w->heap[l]))
			m = l + 1;
		if (!cand_less(&w->heap[m], &last))
			break;
		w->heap[i] = w->heap[m];
		i = m;
	}
	if (n)
		w->heap[i] = last;
	return top;
}

/* Queue the pair (l, r) if it can merge. */
static int try_pair(const struct md_tokenizer *t, struct work *w, const char *text, int32_t l,
		    int32_t r)
{
	struct sym *a, *b;
	struct cand c;

	if (l < 0 || r < 0)
		return 0;
	a = &w->syms[l];
	b = &w->syms[r];
	if (t->kind == KIND_BPE) {
		const struct merge_ent *m = merge_find(t, a->id, b->id);

		if (!m)
			return 0;
		c.prio = (float)m->rank;
		c.result = m->result;
	} else {
		int32_t id = lookup(t, text + a->start, a->len + b->len);

		if (id < 0 || t->types[id] != MD_TOKEN_NORMAL)
			return 0;
		c.prio = -t->scores[id];
		c.result = id;
	}
	c.left = (uint32_t)l;
	c.right = (uint32_t)r;
	c.llen = a->len;
	c.rlen = b->len;
	return heap_push(w, &c);
}

/* Merge the symbols of text[0, n) (already set up in w->syms, n_sym of them). */
static int merge_all(const struct md_tokenizer *t, struct work *w, const char *text,
		     int32_t n_sym)
{
	w->heap_n = 0;
	for (int32_t i = 0; i + 1 < n_sym; i++)
		if (try_pair(t, w, text, i, i + 1))
			return -ENOMEM;
	while (w->heap_n) {
		struct cand c = heap_pop(w);
		struct sym *a = &w->syms[c.left], *b = &w->syms[c.right];

		if (a->len != c.llen || b->len != c.rlen || a->next != (int32_t)c.right)
			continue; /* stale: one side merged since */
		a->len += b->len;
		a->id = c.result;
		a->next = b->next;
		if (b->next >= 0)
			w->syms[b->next].prev = (int32_t)c.left;
		b->len = 0;
		if (try_pair(t, w, text, a->prev, (int32_t)c.left) ||
		    try_pair(t, w, text, (int32_t)c.left, a->next))
			return -ENOMEM;
	}
	return 0;
}

/* Most words are short: for them a linear scan for the best pair (each pair's merge looked up
 * once and refreshed only next to a merge) beats the heap. Same order: lowest rank, then
 * leftmost. */
#define SHORT_WORD 24
static int bpe_short(const struct md_tokenizer *t, const unsigned char *u, size_t n,
		     struct ivec *out)
{
	int32_t id[SHORT_WORD], res[SHORT_WORD];
	uint32_t rank[SHORT_WORD];
	size_t m = n;

	for (size_t i = 0; i < n; i++)
		id[i] = t->byte_tok[u[i]];
	for (size_t i = 0; i + 1 < n; i++) {
		const struct merge_ent *e = merge_find(t, id[i], id[i + 1]);

		rank[i] = e ? e->rank : UINT32_MAX;
		res[i] = e ? e->result : -1;
	}
	while (m > 1) {
		size_t best = 0;

		for (size_t i = 1; i + 1 < m; i++)
			if (rank[i] < rank[best])
				best = i;
		if (rank[best] == UINT32_MAX)
			break;
		id[best] = res[best];
		m--;
		for (size_t i = best + 1; i < m; i++) {
			id[i] = id[i + 1];
			rank[i] = rank[i + 1];
			res[i] = res[i + 1];
		}
		for (size_t i = best ? best - 1 : 0; i <= best && i + 1 < m; i++) {
			const struct merge_ent *e = merge_find(t, id[i], id[i + 1]);

			rank[i] = e ? e->rank : UINT32_MAX;
			res[i] = e ? e->result : -1;
		}
	}
	for (size_t i = 0; i < m; i++)
		if (ivec_push(out, id[i]))
			return -ENOMEM;
	return 0;
}

/* Byte-level BPE of one pre-tokenized word. */
static int bpe_word(const struct md_tokenizer *t, struct work *w, const char *s, size_t n,
		    struct ivec *out)
{
	const unsigned char *u = (const unsigned char *)s;

	if (n == 1)
		return ivec_push(out, t->byte_tok[u[0]]);
	if (t->ignore_merges) {
		size_t o = 0;
		int32_t id;

		if (grow(&w->buf, &w->buf_cap, 2 * n, 1))
			return -ENOMEM;
		for (size_t i = 0; i < n; i++) {
			size_t l = bl_enc_len(t, u[i]);

			memcpy(w->buf + o, t->bl_enc[u[i]], l);
			o += l;
		}
		id = lookup(t, w->buf, o);
		if (id >= 0 && t->types[id] == MD_TOKEN_NORMAL)
			return ivec_push(out, id);
	}
	if (n <= SHORT_WORD)
		return bpe_short(t, u, n, out);
	if (n > INT32_MAX || grow(&w->syms, &w->syms_cap, n, sizeof(*w->syms)))
		return -ENOMEM;
	for (size_t i = 0; i < n; i++)
		w->syms[i] = (struct sym){ (uint32_t)i, 1, (int32_t)i - 1,
					   i + 1 < n ? (int32_t)i + 1 : -1, t->byte_tok[u[i]] };
	if (merge_all(t, w, s, (int32_t)n))
		return -ENOMEM;
	for (int32_t i = 0; i >= 0; i = w->syms[i].next)
		if (ivec_push(out, w->syms[i].id))
			return -ENOMEM;
	return 0;
}

static int push_pieces(struct work *w, bool second, size_t *n, uint64_t start, uint64_t len)
{
	uint64_t **pp = second ? &w->pieces2 : &w->pieces;
	size_t *cap = second ? &w->pieces2_cap : &w->pieces_cap;

	if (!len)
		return 0;
	if (grow(pp, cap, *n + 1, sizeof(uint64_t)))
		return -ENOMEM;
	(*pp)[(*n)++] = (start << 32) | len;
	return 0;
}

/* Next match of re in s[0, n) at or after off: 1 found ([*ms, *me)), 0 none, <0 error. */
static int re_next(struct work *w, const pcre2_code *re, const char *s, size_t n, size_t off,
		   size_t *ms, size_t *me)
{
	int r;
	PCRE2_SIZE *ov;

	r = pcre2_match(re, (PCRE2_SPTR)s, n, off, PCRE2_NO_UTF_CHECK, w->md, w->mctx);
	if (r == PCRE2_ERROR_JIT_STACKLIMIT && !w->jstack) {
		/* A very long run (say 100k spaces before a lookahead) outgrew the default 32 KiB
		 * JIT stack: retry once with a private, larger one. */
		w->jstack = pcre2_jit_stack_create(64 * 1024, 64 * 1024 * 1024, NULL);
		w->mctx = pcre2_match_context_create(NULL);
		if (!w->jstack || !w->mctx)
			return -ENOMEM;
		pcre2_jit_stack_assign(w->mctx, NULL, w->jstack);
		r = pcre2_match(re, (PCRE2_SPTR)s, n, off, PCRE2_NO_UTF_CHECK, w->md, w->mctx);
	}
	if (r == PCRE2_ERROR_NOMATCH)
		return 0;
	if (r < 0)
		return -EINVAL;
	ov = pcre2_get_ovector_pointer(w->md);
	*ms = ov[0];
	*me = ov[1];
	return 1;
}

/* NFC of s[0, n) into a malloc'd *out (*out NULL when s is ASCII, hence already NFC). Only the
 * runs of non-ASCII characters, each with the ASCII character before it, go through utf8proc:
 * ASCII characters are starters that never compose with what precedes them, so normalising the
 * runs separately gives the NFC of the whole, and ASCII text costs a scan. */
static int nfc_runs(const char *s, size_t n, char **out, size_t *out_n)
{
	char *o = NULL;
	size_t on = 0, cap = 0, i = 0;

	*out = NULL;
	*out_n = 0;
	while (i < n) {
		size_t j = i, start, end;
		utf8proc_uint8_t *dst = NULL;
		utf8proc_ssize_t r;

		while (j < n && (unsigned char)s[j] < 0x80)
			j++;
		if (j == n && !o)
			return 0; /* all ASCII */
		start = j > i ? j - 1 : j;
		end = j;
		while (end < n && (unsigned char)s[end] >= 0x80)
			end++;
		if (grow(&o, &cap, on + (start - i) + 1, 1))
			goto nomem;
		memcpy(o + on, s + i, start - i);
		on += start - i;
		if (end > start) {
			r = utf8proc_map((const utf8proc_uint8_t *)s + start,
					 (utf8proc_ssize_t)(end - start), &dst,
					 UTF8PROC_STABLE | UTF8PROC_COMPOSE);
			if (r < 0) {
				free(o);
				return r == UTF8PROC_ERROR_NOMEM ? -ENOMEM : -EINVAL;
			}
			if (grow(&o, &cap, on + (size_t)r + 1, 1)) {
				free(dst);
				goto nomem;
			}
			memcpy(o + on, dst, (size_t)r);
			on += (size_t)r;
			free(dst);
		}
		i = end;
	}
	*out = o;
	*out_n = on;
	return 0;
nomem:
	free(o);
	return -ENOMEM;
}

/* Byte-level BPE of one text fragment: normalise, split with the regex chain, merge words. */
static int bpe_fragment(const struct md_tokenizer *t, struct work *w, const char *s, size_t n,
			struct ivec *out)
{
	char *norm = NULL;
	size_t np, np2;
	int rc = 0;

	if (t->nfc) {
		rc = nfc_runs(s, n, &norm, &np);
		if (rc)
			return rc;
		if (norm) {
			s = norm;
			n = np;
		}
	}
	if (n >= (1ull << 32)) {
		rc = -EINVAL;
		goto out;
	}
	np = 0;
	if ((rc = push_pieces(w, false, &np, 0, n)))
		goto out;
	for (int k = 0; k < t->n_re; k++) {
		np2 = 0;
		for (size_t i = 0; i < np; i++) {
			size_t ps = (size_t)(w->pieces[i] >> 32), pl = (size_t)(w->pieces[i] & 0xffffffffu);
			size_t off = 0, ms, me;

			while (off < pl) {
				int r = re_next(w, t->re[k], s + ps, pl, off, &ms, &me);

				if (r < 0) {
					rc = r;
					goto out;
				}
				if (r == 0)
					break;
				if (me == ms) { /* empty match: step one character */
					me = ms + utf8_len1((unsigned char)s[ps + ms]);
					if (me > pl)
						me = pl;
					off = me;
					continue;
				}
				if ((rc = push_pieces(w, true, &np2, ps + off, ms - off)) ||
				    (rc = push_pieces(w, true, &np2, ps + ms, me - ms)))
					goto out;
				off = me;
			}
			if ((rc = push_pieces(w, true, &np2, ps + off, pl - off)))
				goto out;
		}
		{
			uint64_t *tp = w->pieces;
			size_t tc = w->pieces_cap;

			w->pieces = w->pieces2;
			w->pieces_cap = w->pieces2_cap;
			w->pieces2 = tp;
			w->pieces2_cap = tc;
			np = np2;
		}
	}
	for (size_t i = 0; i < np; i++) {
		rc = bpe_word(t, w, s + (w->pieces[i] >> 32), (size_t)(w->pieces[i] & 0xffffffffu),
			      out);
		if (rc)
			goto out;
	}
out:
	free(norm);
	return rc;
}

/* SentencePiece BPE of one text fragment (no pre-tokenizer: the fragment is one word). */
static int spm_fragment(const struct md_tokenizer *t, struct work *w, const char *s, size_t n,
			struct ivec *out)
{
	size_t o = 0, nsp = 0;
	int32_t n_sym = 0;

	for (size_t i = 0; i < n; i++)
		nsp += s[i] == ' ';
	if (grow(&w->buf, &w->buf_cap, n + 2 * nsp + 3, 1))
		return -ENOMEM;
	if (t->add_space_prefix) {
		memcpy(w->buf, SPM_SPACE, 3);
		o = 3;
	}
	for (size_t i = 0; i < n; i++) {
		if (s[i] == ' ') {
			memcpy(w->buf + o, SPM_SPACE, 3);
			o += 3;
		} else {
			w->buf[o++] = s[i];
		}
	}
	if (o > INT32_MAX || grow(&w->syms, &w->syms_cap, o, sizeof(*w->syms)))
		return -ENOMEM;
	for (size_t i = 0; i < o;) {
		size_t l = utf8_len1((unsigned char)w->buf[i]);

		if (i + l > o)
			l = o - i;
		w->syms[n_sym] = (struct sym){ (uint32_t)i, (uint32_t)l, n_sym - 1, n_sym + 1, -1 };
		n_sym++;
		i += l;
	}
	if (!n_sym)
		return 0;
	w->syms[n_sym - 1].next = -1;
	if (merge_all(t, w, w->buf, n_sym))
		return -ENOMEM;
	for (int32_t i = 0; i >= 0; i = w->syms[i].next) {
		struct sym *y = &w->syms[i];
		int32_t id = y->id;

		if (id < 0) {
			id = lookup(t, w->buf + y->start, y->len);
			if (id >= 0 && t->types[id] != MD_TOKEN_NORMAL)
				id = -1;
		}
		if (id >= 0) {
			if (ivec_push(out, id))
				return -ENOMEM;
			continue;
		}
		/* Byte fallback; without byte tokens, one <unk> per unknown character. */
		for (uint32_t k = 0; k < y->len; k++)
			if (t->byte_tok[(unsigned char)w->buf[y->start + k]] < 0)
				id = t->unk;
		if (id >= 0) {
			if (ivec_push(out, id))
				return -ENOMEM;
			continue;
		}
		for (uint32_t k = 0; k < y->len; k++)
			if (ivec_push(out, t->byte_tok[(unsigned char)w->buf[y->start + k]]))
				return -ENOMEM;
	}
	return 0;
}

static int fragment(const struct md_tokenizer *t, struct work *w, const char *s, size_t n,
		    struct ivec *out)
{
	if (!n)
		return 0;
	if (t->kind == KIND_BPE)
		return bpe_fragment(t, w, s, n, out);
	return spm_fragment(t, w, s, n, out);
}

/* Longest added token matching at s (n bytes left), or -1. */
static int32_t match_added(const struct md_tokenizer *t, const char *s, size_t n,
			   bool parse_special, size_t *len)
{
	unsigned char c = (unsigned char)s[0];

	for (uint32_t k = t->added_first[c]; k < t->added_first[c + 1]; k++) {
		int32_t id = t->added[k];
		size_t l;
		const char *p = tok_text(t, (uint32_t)id, &l);

		if (!parse_special && t->types[id] != MD_TOKEN_USER_DEFINED)
			continue;
		if (l <= n && memcmp(p, s, l) == 0) {
			*len = l;
			return id;
		}
	}
	return -1;
}

int md_tokenizer_encode(const struct md_tokenizer *t, const char *text, size_t len,
			bool add_bos, bool parse_special, int32_t **ids)
{
	struct ivec out = { 0 };
	struct work w = { 0 };
	size_t clean_n, frag = 0;
	char *clean;
	int rc = -ENOMEM;

	*ids = NULL;
	if (!text && len)
		return -EINVAL;
	clean = utf8_sanitize(text ? text : "", len, &clean_n);
	if (!clean && clean_n == SIZE_MAX)
		return -ENOMEM;
	if (clean) {
		text = clean;
		len = clean_n;
	}
	if (t->kind == KIND_BPE) {
		w.md = pcre2_match_data_create(1, NULL);
		if (!w.md)
			goto out;
	}
	if (add_bos && t->add_bos && t->bos >= 0 && ivec_push(&out, t->bos))
		goto out;
	for (size_t i = 0; i < len; i++) {
		size_t l;
		int32_t id;

		if (t->added_first[(unsigned char)text[i]] ==
		    t->added_first[(unsigned char)text[i] + 1])
			continue;
		id = match_added(t, text + i, len - i, parse_special, &l);
		if (id < 0)
			continue;
		if ((rc = fragment(t, &w, text + frag, i - frag, &out)))
			goto out;
		rc = -ENOMEM;
		if (ivec_push(&out, id))
			goto out;
		i += l - 1;
		frag = i + 1;
	}
	if ((rc = fragment(t, &w, text + frag, len - frag, &out)))
		goto out;
	rc = -ENOMEM;
	if (add_bos && t->add_eos && t->eos >= 0 && ivec_push(&out, t->eos))
		goto out;
	rc = out.n > INT32_MAX ? -EINVAL : (int)out.n;
out:
	if (rc < 0 || out.n == 0) {
		free(out.v);
		out.v = NULL;
	}
	*ids = out.v;
	free(clean);
	free(w.syms);
	free(w.heap);
	free(w.buf);
	free(w.pieces);
	free(w.pieces2);
	if (w.md)
		pcre2_match_data_free(w.md);
	if (w.mctx)
		pcre2_match_context_free(w.mctx);
	if (w.jstack)
		pcre2_jit_stack_free(w.jstack);
	return rc;
}

/* ---------------------------------------------------------------- decoding */

static int hexval(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	return -1;
}

/* The bytes of token id, computed from its text (see md_tokenizer_piece). */
static size_t piece_compute(const struct md_tokenizer *t, int32_t id, char *buf, size_t cap)
{
	size_t l, o = 0;
	const char *s;
	uint8_t ty;

	s = tok_text(t, (uint32_t)id, &l);
	ty = t->types[id];
	if (ty == MD_TOKEN_BYTE && l == 6 && s[0] == '<' && s[1] == '0' && s[2] == 'x' &&
	    s[5] == '>' && hexval(s[3]) >= 0 && hexval(s[4]) >= 0) {
		if (cap)
			buf[0] = (char)(hexval(s[3]) * 16 + hexval(s[4]));
		return 1;
	}
	if (ty != MD_TOKEN_NORMAL) {
		if (cap)
			memcpy(buf, s, l < cap ? l : cap);
		return l;
	}
	if (t->kind == KIND_SPM) {
		for (size_t i = 0; i < l;) {
			if (i + 3 <= l && memcmp(s + i, SPM_SPACE, 3) == 0) {
				if (o < cap)
					buf[o] = ' ';
				o++;
				i += 3;
			} else {
				if (o < cap)
					buf[o] = s[i];
				o++;
				i++;
			}
		}
		return o;
	}
	for (size_t i = 0; i < l;) {
		size_t cl;
		uint32_t cp;

		if (utf8_scan((const unsigned char *)s + i, l - i, &cl) != 1) {
			if (o < cap)
				buf[o] = s[i];
			o++;
			i++;
			continue;
		}
		cp = utf8_cp((const unsigned char *)s + i, &cl);
		if (cp < 324 && t->bl_dec[cp] >= 0) {
			if (o < cap)
				buf[o] = (char)t->bl_dec[cp];
			o++;
		} else {
			for (size_t k = 0; k < cl; k++, o++)
				if (o < cap)
					buf[o] = s[i + k];
		}
		i += cl;
	}
	return o;
}

/* Pieces of every token, computed once at load: decoding is then a copy per token. */
static int build_pieces(struct md_tokenizer *t)
{
	size_t total = 0;

	t->poffs = malloc((t->n_vocab + 1ull) * sizeof(*t->poffs));
	if (!t->poffs)
		return -ENOMEM;
	for (uint32_t i = 0; i < t->n_vocab; i++)
		total += piece_compute(t, (int32_t)i, NULL, 0);
	t->ppool = malloc(total + 1);
	if (!t->ppool)
		return -ENOMEM;
	total = 0;
	for (uint32_t i = 0; i < t->n_vocab; i++) {
		t->poffs[i] = total;
		total += piece_compute(t, (int32_t)i, t->ppool + total, SIZE_MAX);
	}
	t->poffs[t->n_vocab] = total;
	return 0;
}

int md_tokenizer_piece(const struct md_tokenizer *t, int32_t id, char *buf, size_t cap)
{
	size_t l;

	if (id < 0 || (uint32_t)id >= t->n_vocab)
		return -EINVAL;
	l = (size_t)(t->poffs[id + 1] - t->poffs[id]);
	if (cap)
		memcpy(buf, t->ppool + t->poffs[id], l < cap ? l : cap);
	return (int)l;
}

void md_detok_init(struct md_detok *d, const struct md_tokenizer *t)
{
	memset(d, 0, sizeof(*d));
	d->tok = t;
	d->lstrip_first = t->kind == KIND_SPM && t->add_space_prefix;
}

/* Append complete characters of src to out (capacity cap, position *o); leave an incomplete
 * tail (<= 3 bytes) in pend. An ill-formed subpart becomes one U+FFFD, or with per_byte one
 * per byte (SentencePiece byte fallback, as Hugging Face's ByteFallback decoder does). Returns
 * 0 or -ENOSPC. */
static int emit_utf8(const unsigned char *src, size_t n, char *out, size_t cap, size_t *o,
		     unsigned char *pend, uint8_t *n_pend, bool per_byte)
{
	size_t i = 0;

	*n_pend = 0;
	while (i < n) {
		size_t l;
		int r = utf8_scan(src + i, n - i, &l);

		if (r == -1) {
			memcpy(pend, src + i, l);
			*n_pend = (uint8_t)l;
			return 0;
		}
		if (r == 0) {
			for (size_t k = 0; k < (per_byte ? l : 1); k++) {
				if (*o + 3 > cap)
					return -ENOSPC;
				memcpy(out + *o, REPL, 3);
				*o += 3;
			}
		} else {
			if (*o + l > cap)
				return -ENOSPC;
			memcpy(out + *o, src + i, l);
			*o += l;
		}
		i += l;
	}
	return 0;
}

int md_detok_push(struct md_detok *d, int32_t id, char *out, size_t cap)
{
	const struct md_tokenizer *t = d->tok;
	unsigned char stack[256 + 4], *buf = stack, pend[4];
	uint8_t n_pend;
	size_t o = 0, skip = 0;
	enum md_token_type ty = md_tokenizer_type(t, id);
	bool is_added = ty == MD_TOKEN_CONTROL || ty == MD_TOKEN_USER_DEFINED ||
			ty == MD_TOKEN_UNKNOWN;
	int pl, rc = 0;

	if (ty == MD_TOKEN_UNDEFINED)
		return -EINVAL;
	pl = md_tokenizer_piece(t, id, NULL, 0);
	if (pl < 0)
		return pl;
	if ((size_t)pl + 4 > sizeof(stack)) {
		buf = malloc((size_t)pl + 4);
		if (!buf)
			return -ENOMEM;
	}
	if (is_added) {
		/* A character cannot continue across an added token: waiting bytes become
		 * U+FFFD, then the token renders (unless skipped) as its text. */
		size_t k_pend = t->kind == KIND_SPM ? d->_n_pend : d->_n_pend ? 1 : 0;
		if (cap < 3 * k_pend) {
			rc = -ENOSPC;
			goto out;
		}
		for (; o < 3 * k_pend; o += 3)
			memcpy(out + o, REPL, 3);
		if (!(d->skip_special && ty == MD_TOKEN_CONTROL)) {
			if (o + (size_t)pl > cap) {
				rc = -ENOSPC;
				goto out;
			}
			md_tokenizer_piece(t, id, out + o, (size_t)pl);
			o += (size_t)pl;
			/* rendered text: a space after it is the text's own (HF keeps it) */
			if (pl > 0)
				d->_seen_text = true;
		}
		d->_n_pend = 0;
		rc = (int)o;
		goto out;
	}
	memcpy(buf, d->_pend, d->_n_pend);
	md_tokenizer_piece(t, id, (char *)buf + d->_n_pend, (size_t)pl);
	if (!d->_seen_text && d->lstrip_first && pl > 0 && d->_n_pend == 0 && buf[0] == ' ')
		skip = 1;
	rc = emit_utf8(buf + skip, d->_n_pend + (size_t)pl - skip, out, cap, &o, pend, &n_pend,
		       t->kind == KIND_SPM);
	if (rc)
		goto out;
	memcpy(d->_pend, pend, n_pend);
	d->_n_pend = n_pend;
	if (pl > 0)
		d->_seen_text = true;
	rc = (int)o;
out:
	if (buf != stack)
		free(buf);
	return rc;
}

int md_detok_flush(struct md_detok *d, char *out, size_t cap)
{
	size_t k = d->tok->kind == KIND_SPM ? d->_n_pend : d->_n_pend ? 1 : 0;
	if (cap < 3 * k)
		return -ENOSPC;
	for (size_t i = 0; i < k; i++)
		memcpy(out + 3 * i, REPL, 3);
	d->_n_pend = 0;
	return (int)(3 * k);
}

int md_tokenizer_decode(const struct md_tokenizer *t, const int32_t *ids, size_t n,
			bool skip_special, char **out, size_t *out_len)
{
	struct md_detok d;
	char *buf = NULL;
	size_t cap = 0, o = 0;
	int r;

	*out = NULL;
	*out_len = 0;
	md_detok_init(&d, t);
	d.skip_special = skip_special;
	size_t checked = 0; /* byte tokens before this index are in a run found valid */
	for (size_t i = 0; i <= n; i++) {
		/* SentencePiece: a run of byte tokens that is not UTF-8 as a whole becomes one
		 * U+FFFD per byte (Hugging Face's ByteFallback), valid characters in it too */
		size_t j = i;
		while (t->kind == KIND_SPM && i >= checked && j < n &&
		       md_tokenizer_type(t, ids[j]) == MD_TOKEN_BYTE)
			j++;
		if (j > i) {
			unsigned char pend[4];
			size_t np = 0;
			bool valid = true;
			for (size_t k = i; k < j && valid; k++) {
				size_t l;
				char c;
				md_tokenizer_piece(t, ids[k], &c, 1);
				pend[np++] = (unsigned char)c;
				int sc = utf8_scan(pend, np, &l);
				if (sc == 0)
					valid = false;
				else if (sc == 1)
					np = 0;
			}
			valid = valid && np == 0;
			checked = j;
			if (!valid) {
				if (grow(&buf, &cap, o + 3 * (j - i) + 1, 1)) {
					free(buf);
					return -ENOMEM;
				}
				for (size_t k = i; k < j; k++, o += 3)
					memcpy(buf + o, REPL, 3);
				d._seen_text = true;
				i = j - 1;
				continue;
			}
		}
		int pl = i < n ? md_tokenizer_piece(t, ids[i], NULL, 0) : 0;

		if (pl < 0) {
			free(buf);
			return -EINVAL;
		}
		if (grow(&buf, &cap, o + 3 * ((size_t)pl + 8) + 1, 1)) {
			free(buf);
			return -ENOMEM;
		}
		r = i < n ? md_detok_push(&d, ids[i], buf + o, cap - o - 1)
			  : md_detok_flush(&d, buf + o, cap - o - 1);
		if (r < 0) {
			free(buf);
			return r;
		}
		o += (size_t)r;
	}
	if (!buf && !(buf = malloc(1)))
		return -ENOMEM;
	buf[o] = 0;
	*out = buf;
	*out_len = o;
	return 0;
}
