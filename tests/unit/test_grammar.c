/* Unit tests for engine/grammar.c: compile errors, matching over bytes and tokens, the token
 * mask against a token-by-token reference, end-of-generation rules, UTF-8 classes, and a JSON
 * grammar over the default model's real vocabulary. usage: test_grammar [MODEL.gguf] */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/gguf.h"
#include "engine/grammar.h"
#include "engine/tokenizer.h"
#include "tests/check.h"

static struct md_grammar *compile(const char *text)
{
	char err[256];
	struct md_grammar *g = NULL;
	int rc = md_grammar_parse(text, strlen(text), &g, err, sizeof(err));
	CHECK_MSG(rc == 0, "grammar %s: %s", text, err);
	return g;
}

/* Does the grammar match exactly this text (and may it end there)? */
static bool matches(struct md_grammar *g, const struct md_gvocab *v, const char *s)
{
	struct md_gmatch *m;
	REQUIRE(CHECK_EQ_I(md_gmatch_new(&m, g, v), 0));
	bool ok = md_gmatch_accept_bytes(m, s, strlen(s)) == 0 && md_gmatch_can_end(m);
	md_gmatch_free(m);
	return ok;
}

static void expect_error(const char *text, const char *want)
{
	char err[256] = "";
	struct md_grammar *g = NULL;
	int rc = md_grammar_parse(text, strlen(text), &g, err, sizeof(err));
	CHECK_MSG(rc == -EINVAL && !g && strstr(err, want), "grammar %s: rc %d, err '%s', want '%s'",
		  text, rc, err, want);
	md_grammar_unref(g);
}

static void test_errors(void)
{
	expect_error("", "empty");
	expect_error("a ::= \"x\"", "no 'root'");
	expect_error("root ::= foo", "undefined rule 'foo'");
	expect_error("root ::= \"abc", "unterminated string");
	expect_error("root ::= [abc", "unterminated character class");
	expect_error("root ::= \"\\q\"", "unknown escape");
	expect_error("root ::= root \"a\" | \"b\"", "left-recursive");
	expect_error("root ::= x\nx ::= y? root\ny ::= \"a\"", "left-recursive");
	expect_error("root ::= (\"a\"?)*", "left-recursive");
	expect_error("root ::= \"a\"{3,2}", "out of order");
	expect_error("root ::= \"a\"\nroot ::= \"b\"", "defined twice");
	expect_error("root ::= (\"a\"", "unclosed");
	expect_error("root ::= \"a\" )", "unmatched");
	expect_error("root ::= [z-a]", "out of order");
	expect_error("root ::= \"a\"{99999}", "repetition bound");
	/* line and column of the error */
	expect_error("root ::= \"a\"\n  x ::= @", "line 2 col 9");
}

/* A byte-level vocabulary: every single byte is a token, plus a few longer ones. */
static struct md_gvocab *byte_vocab(void)
{
	static char one[256][1];
	const char *pieces[256 + 8];
	size_t lens[256 + 8];
	bool eog[256 + 8] = { 0 };
	for (int i = 0; i < 256; i++) {
		one[i][0] = (char)i;
		pieces[i] = one[i];
		lens[i] = 1;
	}
	const char *extra[] = { "ab", "abc", "{\"", "\"}", "\xC3\xA9", "true", "ab" };
	for (int i = 0; i < 7; i++) {
		pieces[256 + i] = extra[i];
		lens[256 + i] = strlen(extra[i]);
	}
	pieces[263] = "";
	lens[263] = 0;
	eog[263] = true; /* the end token */
	struct md_gvocab *v;
	REQUIRE(CHECK_EQ_I(md_gvocab_new_pieces(&v, pieces, lens, eog, 264), 0));
	return v;
}

static void test_match(void)
{
	struct md_gvocab *v = byte_vocab();
	struct md_grammar *g = compile("root ::= \"a\" b* (\"c\" | \"d\")\nb ::= [0-9]");
	CHECK(matches(g, v, "ac"));
	CHECK(matches(g, v, "a123d"));
	CHECK(!matches(g, v, "a12"));
	CHECK(!matches(g, v, "a1x2c"));
	CHECK(!matches(g, v, "acc"));
	md_grammar_unref(g);

	g = compile("root ::= \"x\"{2,3} \"y\"{2} \"z\"{1,}");
	CHECK(!matches(g, v, "xyyz"));
	CHECK(matches(g, v, "xxyyz"));
	CHECK(matches(g, v, "xxxyyzzz"));
	CHECK(!matches(g, v, "xxxxyyz"));
	CHECK(!matches(g, v, "xxyz"));
	md_grammar_unref(g);

	/* right recursion, nullable rules, comments, newlines inside rules, both quote styles */
	g = compile("# lists\nroot ::= \"[\" (item (\",\" item)*)? \"]\"\n"
		    "item ::=\n  'n'\n  | root  # nested\nopt ::= \"\"");
	CHECK(matches(g, v, "[]"));
	CHECK(matches(g, v, "[n,[n,[]],n]"));
	CHECK(!matches(g, v, "[n,]"));
	CHECK(!matches(g, v, "[[n]"));
	md_grammar_unref(g);

	/* ambiguous grammar: both parses live until one dies */
	g = compile("root ::= \"a\" \"b\"* | \"a\" \"b\" \"c\"");
	CHECK(matches(g, v, "abbb"));
	CHECK(matches(g, v, "abc"));
	CHECK(!matches(g, v, "abbc"));
	md_grammar_unref(g);
	md_gvocab_free(v);
}

static void test_utf8(void)
{
	struct md_gvocab *v = byte_vocab();
	struct md_grammar *g = compile("root ::= [^\"\\\\]+");
	CHECK(matches(g, v, "h\xC3\xA9llo \xE2\x82\xAC \xF0\x9F\x98\x80"));
	CHECK(!matches(g, v, "a\"b"));
	CHECK(!matches(g, v, "\xC3"));          /* incomplete character */
	CHECK(!matches(g, v, "\xC0\x80"));      /* overlong */
	CHECK(!matches(g, v, "\xED\xA0\x80"));  /* surrogate */
	CHECK(!matches(g, v, "\xF4\x90\x80\x80")); /* above U+10FFFF */
	md_grammar_unref(g);

	g = compile("root ::= [\\u00e0-\\u00ff\\U0001F600]");
	CHECK(matches(g, v, "\xC3\xA9"));
	CHECK(matches(g, v, "\xF0\x9F\x98\x80"));
	CHECK(!matches(g, v, "\xC3\x9F")); /* U+00DF */
	CHECK(!matches(g, v, "e"));
	md_grammar_unref(g);

	g = compile("root ::= . \"!\"");
	CHECK(matches(g, v, "\xE2\x82\xAC!"));
	CHECK(matches(g, v, "\n!"));
	CHECK(!matches(g, v, "ab!"));
	md_grammar_unref(g);
	md_gvocab_free(v);
}

static bool bit(const uint32_t *bits, int32_t t)
{
	return bits[t >> 5] >> (t & 31) & 1;
}

/* The mask from the trie walk must equal accepting each token on its own. */
static void check_mask_reference(struct md_gmatch *m, uint32_t n_vocab, const char *where)
{
	const uint32_t *bits;
	REQUIRE(CHECK_EQ_I(md_gmatch_mask(m, &bits), 0));
	uint32_t words = (n_vocab + 31) / 32;
	uint32_t *copy = malloc(words * 4);
	memcpy(copy, bits, words * 4);
	int32_t st = md_gmatch_state(m);
	int bad = 0;
	for (uint32_t t = 0; t < n_vocab; t++) {
		bool ok = md_gmatch_accept(m, (int32_t)t) == 0;
		md_gmatch_set_state(m, st);
		if (ok != bit(copy, (int32_t)t) && bad++ < 5)
			CHECK_MSG(false, "%s: token %u reference %d mask %d", where, t, ok,
				  bit(copy, (int32_t)t));
	}
	free(copy);
}

static void test_mask_and_end(void)
{
	struct md_gvocab *v = byte_vocab();
	struct md_grammar *g = compile("root ::= \"{\\\"\" [a-c]+ \"\\\"}\" | \"true\"");
	struct md_gmatch *m;
	REQUIRE(CHECK_EQ_I(md_gmatch_new(&m, g, v), 0));
	const uint32_t *bits;
	REQUIRE(CHECK_EQ_I(md_gmatch_mask(m, &bits), 0));
	CHECK(bit(bits, '{'));
	CHECK(bit(bits, 't'));
	CHECK(bit(bits, 256 + 2)); /* {" */
	CHECK(bit(bits, 256 + 5)); /* true */
	CHECK(!bit(bits, 'a'));
	CHECK(!bit(bits, 263));    /* the end token: not yet */
	CHECK(!md_gmatch_can_end(m));
	check_mask_reference(m, 264, "start");
	CHECK_EQ_I(md_gmatch_accept(m, 263), -EINVAL);
	CHECK_EQ_I(md_gmatch_accept(m, 'a'), -EINVAL);
	CHECK_EQ_I(md_gmatch_accept(m, 256 + 2), 0);
	check_mask_reference(m, 264, "after {\"");
	REQUIRE(CHECK_EQ_I(md_gmatch_mask(m, &bits), 0));
	CHECK(bit(bits, 256 + 0) && bit(bits, 256 + 6)); /* "ab" twice in the vocabulary */
	CHECK(bit(bits, 256 + 1)); /* abc */
	CHECK(!bit(bits, 256 + 3)); /* "} needs one letter first */
	CHECK_EQ_I(md_gmatch_accept(m, 256 + 1), 0);
	CHECK_EQ_I(md_gmatch_accept(m, 256 + 3), 0);
	CHECK(md_gmatch_can_end(m));
	CHECK(md_gmatch_is_final(m));
	REQUIRE(CHECK_EQ_I(md_gmatch_mask(m, &bits), 0));
	for (int t = 0; t < 263; t++)
		CHECK_MSG(!bit(bits, t), "token %d allowed after the end", t);
	CHECK(bit(bits, 263));
	CHECK_EQ_I(md_gmatch_accept(m, 263), 0);
	/* states are cached: revisiting costs no new state */
	uint32_t ns = md_gmatch_n_states(m);
	md_gmatch_free(m);
	REQUIRE(CHECK_EQ_I(md_gmatch_new(&m, g, v), 0));
	CHECK_EQ_I(md_gmatch_accept_bytes(m, "{\"abcabc", 8), 0);
	CHECK(!md_gmatch_can_end(m));
	CHECK(ns > 0);
	md_gmatch_free(m);
	md_grammar_unref(g);

	/* a grammar that may end or go on: the end token and more text are both allowed */
	g = compile("root ::= [0-9]+");
	REQUIRE(CHECK_EQ_I(md_gmatch_new(&m, g, v), 0));
	CHECK_EQ_I(md_gmatch_accept(m, '7'), 0);
	REQUIRE(CHECK_EQ_I(md_gmatch_mask(m, &bits), 0));
	CHECK(bit(bits, '8') && bit(bits, 263) && !bit(bits, 'x'));
	CHECK(md_gmatch_can_end(m) && !md_gmatch_is_final(m));
	md_gmatch_free(m);
	md_grammar_unref(g);

	/* a multi-byte character split across tokens */
	g = compile("root ::= \"\\u00e9\"+");
	REQUIRE(CHECK_EQ_I(md_gmatch_new(&m, g, v), 0));
	REQUIRE(CHECK_EQ_I(md_gmatch_mask(m, &bits), 0));
	CHECK(bit(bits, 0xC3) && bit(bits, 256 + 4) && !bit(bits, 0xA9));
	CHECK_EQ_I(md_gmatch_accept(m, 0xC3), 0);
	REQUIRE(CHECK_EQ_I(md_gmatch_mask(m, &bits), 0));
	CHECK(bit(bits, 0xA9) && !bit(bits, 0xC3) && !bit(bits, 263));
	CHECK_EQ_I(md_gmatch_accept(m, 0xA9), 0);
	CHECK(md_gmatch_can_end(m));
	md_gmatch_free(m);
	md_grammar_unref(g);
	md_gvocab_free(v);
}

/* Bounds: a grammar whose stacks multiply reports -E2BIG instead of growing without end. */
static void test_bounds(void)
{
	struct md_gvocab *v = byte_vocab();
	struct md_grammar *g = compile("root ::= x*\nx ::= \"a\" | \"a\" \"a\" | \"a\" \"a\" \"a\"");
	struct md_gmatch *m;
	REQUIRE(CHECK_EQ_I(md_gmatch_new(&m, g, v), 0));
	char a[200];
	memset(a, 'a', sizeof(a));
	/* this grammar's stacks stay few (the set is deduplicated), so it keeps working */
	CHECK_EQ_I(md_gmatch_accept_bytes(m, a, sizeof(a)), 0);
	md_gmatch_free(m);
	md_grammar_unref(g);

	/* 20000 rules, each reachable before any byte (r_i ::= r_{i+1}? "a"): compiles (the
	 * checks are linear), but expanding it at once is refused, not a stack overflow */
	size_t cap = 20000 * 40 + 100, len = 0;
	char *text = malloc(cap);
	len += (size_t)snprintf(text + len, cap - len, "root ::= r0\n");
	for (int i = 0; i < 20000; i++)
		len += (size_t)snprintf(text + len, cap - len, "r%d ::= r%d? \"a\"\n", i, i + 1);
	len += (size_t)snprintf(text + len, cap - len, "r20000 ::= \"z\"");
	char err[200];
	REQUIRE(CHECK_EQ_I(md_grammar_parse(text, len, &g, err, sizeof(err)), 0));
	CHECK_EQ_I(md_gmatch_new(&m, g, v), -E2BIG);
	md_grammar_unref(g);
	free(text);

	/* nested ambiguous repetitions: the stack sets outgrow their bound, reported as -E2BIG */
	g = compile("root ::= (((\"a\"{1,50}){1,50}){1,50})");
	REQUIRE(CHECK_EQ_I(md_gmatch_new(&m, g, v), 0));
	int rc = 0;
	for (int i = 0; i < 200 && rc == 0; i++)
		rc = md_gmatch_accept_bytes(m, "a", 1);
	CHECK(rc == 0 || rc == -E2BIG);
	md_gmatch_free(m);
	md_grammar_unref(g);
	md_gvocab_free(v);
}

static const char json_grammar[] =
	"root   ::= object\n"
	"value  ::= object | array | string | number | (\"true\" | \"false\" | \"null\")\n"
	"object ::= \"{\" ws ( string \":\" ws value (\",\" ws string \":\" ws value)* )? \"}\"\n"
	"array  ::= \"[\" ws ( value (\",\" ws value)* )? \"]\"\n"
	"string ::= \"\\\"\" ( [^\"\\\\\\x00-\\x1f] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" [0-9a-fA-F]{4}) )* "
	"\"\\\"\"\n"
	"number ::= \"-\"? ([0-9] | [1-9] [0-9]*) (\".\" [0-9]+)? ([eE] [-+]? [0-9]+)?\n"
	"ws     ::= \" \"?\n";

static uint64_t rng = 88172645463325252ull;

static uint32_t xrand(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return (uint32_t)rng;
}

/* Random walks over the real vocabulary: every chosen token is allowed by the mask, the mask
 * equals the token-by-token reference at sampled states, and the text produced is accepted
 * by a fresh matcher fed its bytes. */
static void test_real_vocab(const char *path)
{
	struct md_gguf gg;
	char err[256];
	struct md_tokenizer *tok;
	if (md_gguf_open(&gg, path, err, sizeof(err))) {
		CHECK_MSG(false, "open %s: %s", path, err);
		return;
	}
	REQUIRE(CHECK_EQ_I(md_tokenizer_load(&tok, &gg, err, sizeof(err)), 0));
	struct md_gvocab *v;
	REQUIRE(CHECK_EQ_I(md_gvocab_new(&v, tok), 0));
	uint32_t V = md_gvocab_n_vocab(v);
	struct md_grammar *g = compile(json_grammar);
	for (int walk = 0; walk < 20; walk++) {
		struct md_gmatch *m;
		REQUIRE(CHECK_EQ_I(md_gmatch_new(&m, g, v), 0));
		char text[4096];
		size_t tl = 0;
		bool ended = false;
		for (int step = 0; step < 200 && !ended; step++) {
			const uint32_t *bits;
			REQUIRE(CHECK_EQ_I(md_gmatch_mask(m, &bits), 0));
			if (step % 23 == 0)
				check_mask_reference(m, V, "json walk");
			int32_t allowed[8192];
			uint32_t na = 0;
			for (uint32_t t = 0; t < V && na < 8192; t++)
				if (bit(bits, (int32_t)t))
					allowed[na++] = (int32_t)t;
			REQUIRE(CHECK(na > 0));
			/* prefer closing after a while so walks end */
			int32_t t = allowed[xrand() % na];
			if (step > 60 && md_gmatch_can_end(m))
				t = -1;
			for (uint32_t i = 0; t < 0 && i < na; i++)
				if (md_tokenizer_is_eog(tok, allowed[i]))
					t = allowed[i];
			if (t < 0)
				t = allowed[xrand() % na];
			if (md_tokenizer_is_eog(tok, t)) {
				CHECK(md_gmatch_can_end(m));
				ended = true;
				break;
			}
			char piece[256];
			int n = md_tokenizer_piece(tok, t, piece, sizeof(piece));
			REQUIRE(CHECK(n > 0 && tl + (size_t)n < sizeof(text)));
			memcpy(text + tl, piece, (size_t)n);
			tl += (size_t)n;
			REQUIRE(CHECK_EQ_I(md_gmatch_accept(m, t), 0));
		}
		md_gmatch_free(m);
		if (ended) {
			text[tl] = 0;
			CHECK_MSG(matches(g, v, text), "walk %d text not accepted: %s", walk, text);
			CHECK(text[0] == '{' && text[tl - 1] == '}');
		}
	}
	md_grammar_unref(g);
	md_gvocab_free(v);
	md_tokenizer_free(tok);
	md_gguf_close(&gg);
}

int main(int argc, char **argv)
{
	test_errors();
	test_match();
	test_utf8();
	test_mask_and_end();
	test_bounds();
	if (argc > 1)
		test_real_vocab(argv[1]);
	return failures ? 1 : 0;
}
