/* Unit tests of the streaming detokenizer and encoder edge cases on tiny in-memory vocabularies. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/gguf.h"
#include "engine/tokenizer.h"

#include "tests/check.h"

/* ------------------------------------------------------------ a tiny GGUF builder */

struct buf {
	unsigned char *p;
	size_t n, cap;
	unsigned n_kv;
};

static void put(struct buf *b, const void *s, size_t n)
{
	if (b->n + n > b->cap) {
		b->cap = (b->n + n) * 2 + 256;
		b->p = realloc(b->p, b->cap);
	}
	memcpy(b->p + b->n, s, n);
	b->n += n;
}

static void put_u32(struct buf *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(struct buf *b, uint64_t v) { put(b, &v, 8); }

static void put_str(struct buf *b, const char *s, size_t n)
{
	put_u64(b, n);
	put(b, s, n);
}

static void kv_key(struct buf *b, const char *k, uint32_t type)
{
	put_str(b, k, strlen(k));
	put_u32(b, type);
	b->n_kv++;
}

static void kv_str(struct buf *b, const char *k, const char *v)
{
	kv_key(b, k, MD_GGUF_STRING);
	put_str(b, v, strlen(v));
}

static void kv_u32(struct buf *b, const char *k, uint32_t v)
{
	kv_key(b, k, MD_GGUF_UINT32);
	put_u32(b, v);
}

static void kv_bool(struct buf *b, const char *k, bool v)
{
	unsigned char c = v;

	kv_key(b, k, MD_GGUF_BOOL);
	put(b, &c, 1);
}

static void kv_strs(struct buf *b, const char *k, char **v, uint32_t n)
{
	kv_key(b, k, MD_GGUF_ARRAY);
	put_u32(b, MD_GGUF_STRING);
	put_u64(b, n);
	for (uint32_t i = 0; i < n; i++)
		put_str(b, v[i], strlen(v[i]));
}

static void kv_i32s(struct buf *b, const char *k, const int32_t *v, uint32_t n)
{
	kv_key(b, k, MD_GGUF_ARRAY);
	put_u32(b, MD_GGUF_INT32);
	put_u64(b, n);
	put(b, v, 4ull * n);
}

static void kv_f32s(struct buf *b, const char *k, const float *v, uint32_t n)
{
	kv_key(b, k, MD_GGUF_ARRAY);
	put_u32(b, MD_GGUF_FLOAT32);
	put_u64(b, n);
	put(b, v, 4ull * n);
}

/* Header + kv body -> a complete GGUF in out. */
static void finish(struct buf *kv, struct buf *out)
{
	memset(out, 0, sizeof(*out));
	put(out, "GGUF", 4);
	put_u32(out, 3);
	put_u64(out, 0);
	put_u64(out, kv->n_kv);
	put(out, kv->p, kv->n);
	free(kv->p);
}

static struct md_tokenizer *load(struct buf *file, struct md_gguf *g)
{
	struct md_tokenizer *t = NULL;
	char err[256] = "";

	if (md_gguf_open_mem(g, file->p, file->n, err, sizeof(err))) {
		fprintf(stderr, "gguf: %s\n", err);
		exit(1);
	}
	if (md_tokenizer_load(&t, g, err, sizeof(err))) {
		fprintf(stderr, "tokenizer: %s\n", err);
		exit(1);
	}
	return t;
}

/* ------------------------------------------------------------ helpers */

/* Push ids one by one; returns the concatenation of events (NUL-terminated, static) and checks
 * each event is whole UTF-8 (no character split across events). */
static char joined[4096];
static int events[64];

static const char *stream(struct md_detok *d, const int32_t *ids, int n, bool flush)
{
	char out[MD_DETOK_MIN_CAP];
	size_t o = 0;

	for (int i = 0; i <= n; i++) {
		int r = i < n ? md_detok_push(d, ids[i], out, sizeof(out))
			      : (flush ? md_detok_flush(d, out, sizeof(out)) : 0);

		CHECK(r >= 0);
		if (r < 0)
			r = 0;
		events[i] = r;
		/* An event never ends inside a character. */
		if (r > 0) {
			int k = r - 1, cont = 0;

			while (k >= 0 && ((unsigned char)out[k] & 0xC0) == 0x80) {
				k--;
				cont++;
			}
			if (k >= 0) {
				unsigned char c = (unsigned char)out[k];
				int need = c < 0x80 ? 0 : c < 0xE0 ? 1 : c < 0xF0 ? 2 : 3;

				CHECK(need == cont);
			}
		}
		memcpy(joined + o, out, (size_t)r);
		o += (size_t)r;
	}
	joined[o] = 0;
	return joined;
}

static bool ids_eq(const int32_t *a, int na, const int32_t *b, int nb)
{
	if (na != nb) {
		fprintf(stderr, "  length %d vs %d\n", na, nb);
		return false;
	}
	for (int i = 0; i < na; i++)
		if (a[i] != b[i]) {
			fprintf(stderr, "  id[%d]: %d vs %d\n", i, a[i], b[i]);
			return false;
		}
	return true;
}

/* ------------------------------------------------------------ SentencePiece vocab */

enum { SP_UNK, SP_BOS, SP_EOS, SP_BYTE0 = 3, SP_SPACE = 259, SP_A, SP_B, SP_SA, SP_AB, SP_SAB,
       SP_SB, SP_EACUTE, SP_N };

static void test_spm(void)
{
	static char names[SP_N][16];
	char *toks[SP_N];
	int32_t types[SP_N];
	float scores[SP_N];
	const char *normal[] = { "\xE2\x96\x81", "a", "b", "\xE2\x96\x81" "a", "ab",
				 "\xE2\x96\x81" "ab", "\xE2\x96\x81" "b", "\xC3\xA9" };
	struct buf kv = { 0 }, file;
	struct md_gguf g;
	struct md_tokenizer *t;
	struct md_detok d;
	int32_t *ids;
	int n;

	for (int i = 0; i < SP_N; i++) {
		toks[i] = names[i];
		scores[i] = 0;
		types[i] = MD_TOKEN_NORMAL;
		if (i == SP_UNK || i == SP_BOS || i == SP_EOS) {
			strcpy(names[i], i == SP_UNK ? "<unk>" : i == SP_BOS ? "<s>" : "</s>");
			types[i] = i == SP_UNK ? MD_TOKEN_UNKNOWN : MD_TOKEN_CONTROL;
		} else if (i < SP_SPACE) {
			snprintf(names[i], sizeof(names[i]), "<0x%02X>", i - SP_BYTE0);
			types[i] = MD_TOKEN_BYTE;
		} else {
			strcpy(names[i], normal[i - SP_SPACE]);
		}
	}
	scores[SP_SA] = -1; /* ▁a merges before ab */
	scores[SP_AB] = -2;
	scores[SP_SAB] = -3;
	scores[SP_SB] = -4;
	kv_str(&kv, "tokenizer.ggml.model", "llama");
	kv_strs(&kv, "tokenizer.ggml.tokens", toks, SP_N);
	kv_i32s(&kv, "tokenizer.ggml.token_type", types, SP_N);
	kv_f32s(&kv, "tokenizer.ggml.scores", scores, SP_N);
	kv_u32(&kv, "tokenizer.ggml.bos_token_id", SP_BOS);
	kv_u32(&kv, "tokenizer.ggml.eos_token_id", SP_EOS);
	kv_u32(&kv, "tokenizer.ggml.unknown_token_id", SP_UNK);
	kv_bool(&kv, "tokenizer.ggml.add_bos_token", true);
	finish(&kv, &file);
	t = load(&file, &g);

	CHECK(md_tokenizer_bos(t) == SP_BOS && md_tokenizer_add_bos(t));
	CHECK(md_tokenizer_is_eog(t, SP_EOS) && !md_tokenizer_is_eog(t, SP_A));

	/* Scores decide: "▁a" (-1) merges before "ab" (-2), then "▁a"+"b" makes "▁ab". */
	{
		int32_t want[] = { SP_BOS, SP_SAB, SP_SA };

		n = md_tokenizer_encode(t, "ab a", 4, true, false, &ids);
		CHECK(ids_eq(ids, n, want, 3));
		md_detok_init(&d, t);
		d.skip_special = true;
		CHECK_STR_EQ(stream(&d, ids, n, true), "ab a"); /* prefix space stripped, BOS skipped */
		md_detok_init(&d, t);
		/* BOS rendered is text: the space after it stays (Hugging Face: "<s> ab a") */
		CHECK_STR_EQ(stream(&d, ids, n, true), "<s> ab a");
		md_detok_init(&d, t);
		d.lstrip_first = false; /* continuation: keep the space */
		CHECK_STR_EQ(stream(&d, ids + 1, n - 1, true), " ab a");
		free(ids);
	}
	/* Byte fallback: "€" (E2 82 AC) is not in the vocab; "é" is. */
	{
		int32_t want[] = { SP_SA, SP_BYTE0 + 0xE2, SP_BYTE0 + 0x82, SP_BYTE0 + 0xAC,
				   SP_EACUTE };

		n = md_tokenizer_encode(t, "a\xE2\x82\xAC\xC3\xA9", 6, false, false, &ids);
		CHECK(ids_eq(ids, n, want, 5));
		md_detok_init(&d, t);
		CHECK_STR_EQ(stream(&d, ids, n, true), "a\xE2\x82\xAC\xC3\xA9");
		CHECK(events[0] == 1 && events[1] == 0 && events[2] == 0 && events[3] == 3 &&
		      events[4] == 2);
		free(ids);
	}
	/* Leftover and invalid bytes become U+FFFD; an added token cuts a pending character. */
	{
		int32_t lone[] = { SP_A, SP_BYTE0 + 0xE2, SP_BYTE0 + 0x82 };
		int32_t bad[] = { SP_A, SP_BYTE0 + 0xFF, SP_B };
		int32_t cut[] = { SP_BYTE0 + 0xE2, SP_EOS, SP_SB };

		md_detok_init(&d, t);
		/* one U+FFFD per byte of the byte-fallback tokens, as HF's ByteFallback */
		CHECK_STR_EQ(stream(&d, lone, 3, true), "a\xEF\xBF\xBD\xEF\xBF\xBD");
		CHECK(events[3] == 6);
		md_detok_init(&d, t);
		CHECK_STR_EQ(stream(&d, bad, 3, true), "a\xEF\xBF\xBD" "b");
		CHECK(events[1] == 3); /* at once: 0xFF can never start a character */
		md_detok_init(&d, t);
		/* The space after an added token is kept, as in Hugging Face's decode. */
		CHECK_STR_EQ(stream(&d, cut, 3, true), "\xEF\xBF\xBD</s> b");
	}
	/* Encode/decode round trip across an added token, and parse_special off. */
	{
		int32_t want[] = { SP_SA, SP_EOS, SP_SB };
		char *txt;
		size_t tl;

		n = md_tokenizer_encode(t, "a</s>b", 6, false, true, &ids);
		CHECK(ids_eq(ids, n, want, 3));
		CHECK(md_tokenizer_decode(t, ids, (size_t)n, false, &txt, &tl) == 0);
		CHECK_STR_EQ(txt, "a</s> b"); /* HF's decode too: the "▁" the encoder added stays */
		free(txt);
		free(ids);
		n = md_tokenizer_encode(t, "a</s>b", 6, false, false, &ids);
		CHECK(n > 3);
		for (int i = 0; i < n; i++)
			CHECK(ids[i] != SP_EOS);
		free(ids);
	}
	/* The empty string: no ids (BOS only when asked). */
	n = md_tokenizer_encode(t, "", 0, false, true, &ids);
	CHECK(n == 0 && ids == NULL);
	n = md_tokenizer_encode(t, "", 0, true, true, &ids);
	CHECK(n == 1 && ids[0] == SP_BOS);
	free(ids);
	/* Pieces. */
	{
		char p[16];

		CHECK_EQ_I(md_tokenizer_piece(t, SP_SAB, p, sizeof(p)), 3);
		CHECK_MEM_EQ(p, " ab", 3);
		CHECK(md_tokenizer_piece(t, SP_BYTE0 + 0x41, p, sizeof(p)) == 1 && p[0] == 'A');
		CHECK(md_tokenizer_piece(t, SP_N, p, sizeof(p)) < 0);
		CHECK(md_tokenizer_find(t, "<s>", 3) == SP_BOS);
	}
	md_tokenizer_free(t);
	md_gguf_close(&g);
	free(file.p);
}

/* ------------------------------------------------------------ byte-level BPE vocab */

/* GPT-2's byte -> code point map, written from its definition. */
static unsigned byte_cp(unsigned b)
{
	unsigned n = 0;

	if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174)
		return b;
	for (unsigned c = 0; c < b; c++)
		if (!((c >= 33 && c <= 126) || (c >= 161 && c <= 172) || c >= 174))
			n++;
	return 256 + n;
}

static void cp_utf8(unsigned cp, char *o)
{
	if (cp < 0x80) {
		o[0] = (char)cp;
		o[1] = 0;
	} else {
		o[0] = (char)(0xC0 | (cp >> 6));
		o[1] = (char)(0x80 | (cp & 0x3F));
		o[2] = 0;
	}
}

static void test_bpe(void)
{
	enum { N = 256 + 4 };
	static char names[N][16];
	char *toks[N], m0[16], m1[16], m2[16], m3[16];
	char *merges[] = { m0, m1, m2, m3 };
	struct buf kv = { 0 }, file;
	struct md_gguf g;
	struct md_tokenizer *t;
	struct md_detok d;
	int32_t *ids, *ids2;
	int n, n2;
	char sp[4], e4[4], b8[4], ad[4];

	for (int i = 0; i < 256; i++) {
		cp_utf8(byte_cp((unsigned)i), names[i]);
		toks[i] = names[i];
	}
	cp_utf8(byte_cp(' '), sp);
	cp_utf8(byte_cp(0xE4), e4);
	cp_utf8(byte_cp(0xB8), b8);
	cp_utf8(byte_cp(0xAD), ad);
	snprintf(names[256], 16, "%sa", sp);       /* "Ġa" */
	snprintf(names[257], 16, "%s%s", e4, b8);  /* first two bytes of 中 (E4 B8 AD) */
	snprintf(names[258], 16, "%s%s%s", sp, e4, b8);
	strcpy(names[259], "<|x|>");
	for (int i = 256; i < N; i++)
		toks[i] = names[i];
	snprintf(m0, 16, "%s a", sp);
	snprintf(m1, 16, "%s %s", e4, b8);
	snprintf(m2, 16, "%s %s%s", sp, e4, b8);
	snprintf(m3, 16, "a b"); /* "ab" is not a token: ignored */
	{
		int32_t types[N];

		for (int i = 0; i < N; i++)
			types[i] = i == 259 ? MD_TOKEN_CONTROL : MD_TOKEN_NORMAL;
		kv_str(&kv, "tokenizer.ggml.model", "gpt2");
		kv_str(&kv, "tokenizer.ggml.pre", "qwen2");
		kv_strs(&kv, "tokenizer.ggml.tokens", toks, N);
		kv_i32s(&kv, "tokenizer.ggml.token_type", types, N);
		kv_strs(&kv, "tokenizer.ggml.merges", merges, 4);
		kv_u32(&kv, "tokenizer.ggml.eos_token_id", 259);
	}
	finish(&kv, &file);
	t = load(&file, &g);
	CHECK(md_tokenizer_bos(t) == -1 && !md_tokenizer_add_bos(t));

	/* " 中" -> [" \xE4\xB8", "\xAD"]: the character is split across two tokens. */
	{
		int32_t want[] = { 258, 0xAD };

		n = md_tokenizer_encode(t, " \xE4\xB8\xAD", 4, true, true, &ids);
		CHECK(ids_eq(ids, n, want, 2));
		md_detok_init(&d, t);
		CHECK_STR_EQ(stream(&d, ids, n, true), " \xE4\xB8\xAD");
		CHECK(events[0] == 1 && events[1] == 3); /* the space, then the whole character */
		free(ids);
	}
	/* Invalid UTF-8 is replaced by U+FFFD per maximal subpart before tokenizing. */
	{
		const char *cases[][2] = {
			{ "a\xFF" "b", "a\xEF\xBF\xBD" "b" },
			{ "x\xE4\xB8", "x\xEF\xBF\xBD" },                       /* truncated at end */
			{ "\xED\xA0\x80!", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD!" }, /* surrogate */
			{ "\xF0\x9F\x98" "z", "\xEF\xBF\xBDz" },                /* cut 4-byte seq */
			{ "\xC0\xAF", "\xEF\xBF\xBD\xEF\xBF\xBD" },             /* overlong */
		};

		for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
			char *txt;
			size_t tl;

			n = md_tokenizer_encode(t, cases[i][0], strlen(cases[i][0]), false, false,
						&ids);
			n2 = md_tokenizer_encode(t, cases[i][1], strlen(cases[i][1]), false, false,
						 &ids2);
			CHECK(n > 0 && ids_eq(ids, n, ids2, n2));
			CHECK(md_tokenizer_decode(t, ids, (size_t)n, false, &txt, &tl) == 0);
			CHECK_STR_EQ(txt, cases[i][1]);
			free(txt);
			free(ids);
			free(ids2);
		}
	}
	/* A NUL byte is an ordinary character. */
	n = md_tokenizer_encode(t, "a\0b", 3, false, false, &ids);
	CHECK(n == 3 && ids[1] == 0);
	free(ids);
	/* Control tokens only with parse_special; is_eog from eos. */
	{
		int32_t want[] = { 'a', 259, 'b' };

		n = md_tokenizer_encode(t, "a<|x|>b", 7, false, true, &ids);
		CHECK(ids_eq(ids, n, want, 3));
		free(ids);
		n = md_tokenizer_encode(t, "a<|x|>b", 7, false, false, &ids);
		CHECK(n == 7);
		free(ids);
		CHECK(md_tokenizer_is_eog(t, 259));
	}
	/* Streaming with a small buffer: -ENOSPC leaves the state unchanged. */
	{
		char small[2], out[MD_DETOK_MIN_CAP];

		md_detok_init(&d, t);
		CHECK(md_detok_push(&d, 257, out, sizeof(out)) == 0);
		CHECK(md_detok_push(&d, 0xAD, small, 2) < 0);
		CHECK_EQ_I(md_detok_push(&d, 0xAD, out, sizeof(out)), 3);
		CHECK_MEM_EQ(out, "\xE4\xB8\xAD", 3);
		CHECK(md_detok_flush(&d, out, sizeof(out)) == 0);
	}
	md_tokenizer_free(t);
	md_gguf_close(&g);
	free(file.p);
}

static void test_bad_metadata(void)
{
	struct buf kv = { 0 }, file;
	struct md_gguf g;
	struct md_tokenizer *t = (struct md_tokenizer *)&g;
	char err[256] = "";
	char *toks[] = { "a" };

	kv_str(&kv, "tokenizer.ggml.model", "gpt2");
	kv_str(&kv, "tokenizer.ggml.pre", "klingon");
	kv_strs(&kv, "tokenizer.ggml.tokens", toks, 1);
	finish(&kv, &file);
	CHECK(md_gguf_open_mem(&g, file.p, file.n, err, sizeof(err)) == 0);
	CHECK(md_tokenizer_load(&t, &g, err, sizeof(err)) < 0 && t == NULL);
	CHECK(strstr(err, "klingon") != NULL);
	md_gguf_close(&g);
	free(file.p);
}

int main(void)
{
	test_spm();
	test_bpe();
	test_bad_metadata();
	if (failures) {
		fprintf(stderr, "%d check(s) failed\n", failures);
		return 1;
	}
	printf("test_detok: all checks passed\n");
	return 0;
}
