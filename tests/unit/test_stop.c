/* The stop-string matcher (server/stop.c): what it releases, what it holds back, where it stops. */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "frand.h"
#include "server/stop.h"
#include "tests/check.h"

/* Drives a matcher as the generation's output chain does: push each piece, release what is
 * ready. Returns the released text (malloc'd) and whether a stop string ended it. */
static char *run(char *const *stops, size_t n_stops, const char *const *pieces, size_t n_pieces,
		 bool *stopped)
{
	struct md_stop s;
	md_stop_init(&s, stops, n_stops);
	size_t cap = 1, len = 0;
	for (size_t i = 0; i < n_pieces; i++)
		cap += strlen(pieces[i]);
	char *out = calloc(cap, 1);
	*stopped = false;
	for (size_t i = 0; i <= n_pieces && !*stopped; i++) {
		bool final = i == n_pieces;
		if (!final)
			CHECK_EQ_I(md_stop_push(&s, pieces[i], strlen(pieces[i])), 0);
		size_t n = md_stop_ready(&s, final, stopped);
		CHECK(n <= md_stop_pending(&s));
		memcpy(out + len, md_stop_text(&s), n);
		len += n;
		md_stop_consume(&s, n);
		if (*stopped)
			md_stop_clear(&s);
	}
	out[len] = 0;
	md_stop_release(&s);
	return out;
}

#define RUN_EXPECT(stops, pieces, want, want_stop)                                             \
	do {                                                                                   \
		bool st_;                                                                      \
		char *got_ = run(stops, sizeof(stops) / sizeof(stops[0]), pieces,              \
				 sizeof(pieces) / sizeof(pieces[0]), &st_);                     \
		if (strcmp(got_, want) != 0) {                                                 \
			fprintf(stderr, "%s:%d: released '%s', want '%s'\n", __FILE__, __LINE__, \
				got_, want);                                                   \
			failures++;                                                            \
		}                                                                              \
		CHECK_EQ_I(st_, want_stop);                                                    \
		free(got_);                                                                    \
	} while (0)

/* A stop string arriving over three tokens: the parts are held, then dropped. */
static void test_spanning(void)
{
	char *stops[] = { "END" };
	struct md_stop s;
	md_stop_init(&s, stops, 1);
	bool hit;
	md_stop_push(&s, "hello E", 7);
	CHECK_EQ_U(md_stop_ready(&s, false, &hit), 6); /* "E" held */
	CHECK(!hit);
	md_stop_consume(&s, 6);
	CHECK(strcmp(md_stop_text(&s), "E") == 0);
	md_stop_push(&s, "N", 1);
	CHECK_EQ_U(md_stop_ready(&s, false, &hit), 0); /* "EN" held */
	CHECK(!hit);
	md_stop_push(&s, "D and more", 10);
	CHECK_EQ_U(md_stop_ready(&s, false, &hit), 0);
	CHECK(hit);
	md_stop_release(&s);

	const char *pieces[] = { "The e", "nd is n", "ear: E", "N", "D. After" };
	RUN_EXPECT(stops, pieces, "The end is near: ", true);
	/* a tail that stops looking like the stop string is released at the next push */
	const char *p2[] = { "a E", "Nx", "y" };
	RUN_EXPECT(stops, p2, "a ENxy", false);
}

/* Several stop strings: the earliest occurrence wins, whichever string it is. */
static void test_several(void)
{
	char *stops[] = { "stop1", "stop2", "\n\n" };
	const char *pieces[] = { "one st", "op2 two stop1" };
	RUN_EXPECT(stops, pieces, "one ", true);
	const char *p2[] = { "para\n", "\nnext stop1" };
	RUN_EXPECT(stops, p2, "para", true);
	/* both in one piece: the earlier one cuts */
	const char *p3[] = { "x stop1 y stop2" };
	RUN_EXPECT(stops, p3, "x ", true);
	const char *p4[] = { "x stop2 y stop1" };
	RUN_EXPECT(stops, p4, "x ", true);
	/* the hold is the longest tail any stop string could still begin with */
	struct md_stop s;
	md_stop_init(&s, stops, 3);
	bool hit;
	md_stop_push(&s, "abc sto", 7);
	CHECK_EQ_U(md_stop_ready(&s, false, &hit), 4);
	md_stop_push(&s, "p\n", 2);
	CHECK_EQ_U(md_stop_ready(&s, false, &hit), 8); /* "stop" can no longer match; "\n" can */
	CHECK(!hit);
	md_stop_release(&s);
}

/* A stop string that is a prefix of another: the shorter one ends the choice as soon as it
 * appears; one that appears inside another's prefix is still found. */
static void test_prefix(void)
{
	char *stops[] = { "abc", "ab" };
	const char *pieces[] = { "xa", "bc" };
	RUN_EXPECT(stops, pieces, "x", true);
	char *stops2[] = { "ab", "abc" };
	const char *p2[] = { "x", "a", "b" };
	RUN_EXPECT(stops2, p2, "x", true);
	/* "bc" occurs inside the held prefix "ab" + "c" of "abcd" */
	char *stops3[] = { "abcd", "bc" };
	const char *p3[] = { "xab", "c" };
	RUN_EXPECT(stops3, p3, "xa", true);
	/* "abcd" is never completed: "ab" held, then released when "x" arrives */
	char *stops4[] = { "abcd" };
	const char *p4[] = { "zab", "x" };
	RUN_EXPECT(stops4, p4, "zabx", false);
}

/* Multi-byte UTF-8: holds and cuts fall on character boundaries. */
static void test_utf8(void)
{
	char *stops[] = { "\xc3\xa9!" }; /* "é!" */
	struct md_stop s;
	md_stop_init(&s, stops, 1);
	bool hit;
	md_stop_push(&s, "caf\xc3\xa9", 5);
	CHECK_EQ_U(md_stop_ready(&s, false, &hit), 3); /* "é" (2 bytes) held */
	md_stop_push(&s, "?", 1);
	CHECK_EQ_U(md_stop_ready(&s, false, &hit), 6);
	md_stop_release(&s);

	const char *p1[] = { "caf\xc3\xa9", "!", " more" };
	RUN_EXPECT(stops, p1, "caf", true);
	char *euro[] = { "\xe2\x82\xac\xe2\x82\xac" }; /* "€€" */
	const char *p2[] = { "5 \xe2\x82\xac", "\xe2\x82\xac", " x" };
	RUN_EXPECT(euro, p2, "5 ", true);
	const char *p3[] = { "5 \xe2\x82\xac", " x" };
	RUN_EXPECT(euro, p3, "5 \xe2\x82\xac x", false);
	/* the same lead byte, another character: nothing held past it */
	char *stops4[] = { "\xc3\xa9" };
	const char *p4[] = { "\xc3\xa8\xc3\xa8" };
	RUN_EXPECT(stops4, p4, "\xc3\xa8\xc3\xa8", false);
}

/* Held-back text leaves at the end of the generation; no stop strings hold nothing. */
static void test_flush(void)
{
	char *stops[] = { "END" };
	struct md_stop s;
	md_stop_init(&s, stops, 1);
	bool hit;
	md_stop_push(&s, "foo EN", 6);
	CHECK_EQ_U(md_stop_ready(&s, false, &hit), 4);
	CHECK_EQ_U(md_stop_ready(&s, true, &hit), 6);
	CHECK(!hit);
	md_stop_release(&s);
	const char *pieces[] = { "last words E", "N" };
	RUN_EXPECT(stops, pieces, "last words EN", false);

	md_stop_init(&s, NULL, 0);
	md_stop_push(&s, "abc", 3);
	CHECK_EQ_U(md_stop_ready(&s, false, &hit), 3);
	CHECK(!hit);
	md_stop_consume(&s, 3);
	CHECK_EQ_U(md_stop_pending(&s), 0);
	CHECK(strcmp(md_stop_text(&s), "") == 0);
	md_stop_release(&s);
	/* an empty matcher: ready 0, text "" */
	md_stop_init(&s, stops, 1);
	CHECK_EQ_U(md_stop_ready(&s, true, &hit), 0);
	CHECK(strcmp(md_stop_text(&s), "") == 0);
	md_stop_release(&s);
}

/* A uniform index in [0, n). */
static size_t urand(size_t n)
{
	return (size_t)((frand() + 1.0f) * 0.5f * (float)n) % n;
}

/* Random texts split at random token boundaries against a reference that re-scans the whole
 * text after every piece: the output is the text before the earliest occurrence found at the
 * first piece after which any stop string occurs (or the whole text). */
static void test_random(void)
{
	static const char *const alpha[] = { "a", "b", "c", " ", "\xc3\xa9", "\xe2\x82\xac" };
	for (int iter = 0; iter < 3000; iter++) {
		char text[256] = "";
		const char *pieces[40];
		char piece_buf[40][64];
		size_t np = 0, tl = 0;
		size_t n_tok = 1 + urand(30);
		for (size_t t = 0; t < n_tok && np < 40; t++) {
			size_t k = 1 + urand(3);
			piece_buf[np][0] = 0;
			for (size_t j = 0; j < k; j++)
				strcat(piece_buf[np], alpha[urand(6)]);
			if (tl + strlen(piece_buf[np]) >= sizeof(text))
				break;
			strcat(text, piece_buf[np]);
			tl += strlen(piece_buf[np]);
			pieces[np] = piece_buf[np];
			np++;
		}
		char sb[3][16];
		char *stops[3];
		size_t ns = urand(4);
		for (size_t i = 0; i < ns; i++) {
			sb[i][0] = 0;
			size_t k = 1 + urand(3);
			for (size_t j = 0; j < k; j++)
				strcat(sb[i], alpha[urand(6)]);
			stops[i] = sb[i];
		}
		/* reference */
		char want[256];
		bool want_stop = false;
		size_t seen = 0;
		snprintf(want, sizeof(want), "%s", text);
		for (size_t p = 0; p < np && !want_stop; p++) {
			seen += strlen(pieces[p]);
			size_t best = (size_t)-1;
			for (size_t i = 0; i < ns; i++) {
				const char *hit = memmem(text, seen, stops[i], strlen(stops[i]));
				if (hit && (size_t)(hit - text) < best)
					best = (size_t)(hit - text);
			}
			if (best != (size_t)-1) {
				want_stop = true;
				want[best] = 0;
			}
		}
		bool got_stop;
		char *got = run(stops, ns, pieces, np, &got_stop);
		if (strcmp(got, want) != 0 || got_stop != want_stop) {
			fprintf(stderr, "random %d: text '%s' -> '%s' (stop %d), want '%s' (stop %d)\n",
				iter, text, got, got_stop, want, want_stop);
			failures++;
		}
		free(got);
	}
}

int main(void)
{
	frand_seed(20240601);
	test_spanning();
	test_several();
	test_prefix();
	test_utf8();
	test_flush();
	test_random();
	if (failures)
		fprintf(stderr, "%d check(s) failed\n", failures);
	return failures ? 1 : 0;
}
