/* Assertion macros shared by every C test: a failed check prints its file and line, what was
 * compared and both values, and is counted; the test's main returns non-zero when failures > 0. */
#ifndef MD_TEST_CHECK_H
#define MD_TEST_CHECK_H

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/*
 * Usage, in the style of libuv's test/task.h:
 *
 *   CHECK(cond)                 condition
 *   CHECK_MSG(cond, fmt, ...)   condition, with a printf message saying what was expected
 *   CHECK_EQ_I(a, b)            signed integers (printed in decimal)
 *   CHECK_EQ_U(a, b)            unsigned integers (decimal and hex)
 *   CHECK_EQ_F(a, b)            floats, bitwise (so -0 != +0 and NaN == the same NaN)
 *   CHECK_NEAR(a, b, tol)       |a - b| <= tol, as doubles; NaN on either side fails
 *   CHECK_STR_EQ(a, b)          C strings (NULL equals only NULL), both printed escaped
 *   CHECK_MEM_EQ(a, b, n)       n bytes, printing the first differing offset and the bytes there
 *
 * Checks count a failure and go on, so one run reports every broken case. A test that cannot
 * go on after a failure wraps the check: REQUIRE(CHECK_EQ_I(rc, 0)) ends the process through
 * CHECK_FATAL_ACTION() (exit(1); a fuzz target defines it as abort() before including this
 * header, so libFuzzer reports a crash). CHECK_CONTEXT(fmt, ...) sets a phrase printed with
 * every later failure (the case a loop is at); CHECK_CONTEXT_CLEAR() clears it.
 *
 * Output: "file:line: [context: ]a == b failed: <a's value> != <b's value>" on stderr.
 */

#ifndef CHECK_FATAL_ACTION
#define CHECK_FATAL_ACTION() exit(1)
#endif

static int failures;          /* failed checks so far */
static char check_context[256]; /* printed before each failure message when non-empty */

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static inline void check_fail(const char *file, int line, const char *fmt, ...)
{
	va_list ap;

	fprintf(stderr, "%s:%d: ", file, line);
	if (check_context[0] != '\0')
		fprintf(stderr, "%s: ", check_context);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	failures++;
}

/* Prints s quoted, with quotes, backslashes, control bytes and bytes >= 0x7f escaped (so a
 * stray byte in tokenizer output shows), or (null). */
static inline void check_print_str(const char *s)
{
	if (s == NULL) {
		fputs("(null)", stderr);
		return;
	}
	fputc('"', stderr);
	for (const unsigned char *p = (const unsigned char *)s; *p != '\0'; p++) {
		if (*p == '"' || *p == '\\')
			fprintf(stderr, "\\%c", *p);
		else if (*p == '\n')
			fputs("\\n", stderr);
		else if (*p < 0x20 || *p >= 0x7f)
			fprintf(stderr, "\\x%02x", *p);
		else
			fputc(*p, stderr);
	}
	fputc('"', stderr);
}

static inline void check_str_eq(const char *file, int line, const char *ea, const char *eb,
				const char *a, const char *b)
{
	if (a == b || (a != NULL && b != NULL && strcmp(a, b) == 0))
		return;
	check_fail(file, line, "%s == %s failed:", ea, eb);
	fputs("  got:  ", stderr);
	check_print_str(a);
	fputs("\n  want: ", stderr);
	check_print_str(b);
	fputc('\n', stderr);
}

/* Prints up to 16 bytes of p from off (n bytes in all) in hex. */
static inline void check_print_hex(const char *what, const unsigned char *p, size_t off, size_t n)
{
	fprintf(stderr, "  %s[%zu..]:", what, off);
	for (size_t i = off; i < n && i < off + 16; i++)
		fprintf(stderr, " %02x", p[i]);
	fputc('\n', stderr);
}

static inline void check_mem_eq(const char *file, int line, const char *ea, const char *eb,
				const void *a, const void *b, size_t n)
{
	const unsigned char *pa = a, *pb = b;
	size_t i = 0;

	if (n == 0 || memcmp(a, b, n) == 0)
		return;
	while (pa[i] == pb[i])
		i++;
	check_fail(file, line, "%s == %s (%zu bytes) failed: first difference at byte %zu", ea, eb,
		   n, i);
	check_print_hex(ea, pa, i, n);
	check_print_hex(eb, pb, i, n);
}

#define CHECK(cond)                                                                      \
	do {                                                                             \
		if (!(cond))                                                             \
			check_fail(__FILE__, __LINE__, "check failed: %s", #cond);       \
	} while (0)

#define CHECK_MSG(cond, ...)                                                             \
	do {                                                                             \
		if (!(cond)) {                                                           \
			check_fail(__FILE__, __LINE__, "check failed: %s", #cond);       \
			fputs("  ", stderr);                                             \
			fprintf(stderr, __VA_ARGS__);                                    \
			fputc('\n', stderr);                                             \
		}                                                                        \
	} while (0)

/* Unsigned equality; prints decimal and hex (bit patterns read better in hex). */
#define CHECK_EQ_U(a, b)                                                                 \
	do {                                                                             \
		uint64_t a_ = (uint64_t)(a), b_ = (uint64_t)(b);                         \
		if (a_ != b_)                                                            \
			check_fail(__FILE__, __LINE__, "%s == %s failed: %" PRIu64 " (0x%" PRIx64 \
				   ") != %" PRIu64 " (0x%" PRIx64 ")", #a, #b, a_, a_, b_, b_); \
	} while (0)

#define CHECK_EQ_I(a, b)                                                                 \
	do {                                                                             \
		int64_t a_ = (int64_t)(a), b_ = (int64_t)(b);                            \
		if (a_ != b_)                                                            \
			check_fail(__FILE__, __LINE__, "%s == %s failed: %" PRId64 " != %" PRId64, \
				   #a, #b, a_, b_);                                      \
	} while (0)

/* Exact float equality, bitwise (so -0 != +0 is caught where it matters). */
#define CHECK_EQ_F(a, b)                                                                 \
	do {                                                                             \
		float fa_ = (a), fb_ = (b);                                              \
		if (memcmp(&fa_, &fb_, sizeof(float)) != 0)                              \
			check_fail(__FILE__, __LINE__, "%s == %s failed: %.9g != %.9g", #a, #b, \
				   (double)fa_, (double)fb_);                            \
	} while (0)

#define CHECK_NEAR(a, b, tol)                                                            \
	do {                                                                             \
		double na_ = (double)(a), nb_ = (double)(b), nt_ = (double)(tol);        \
		if (!(fabs(na_ - nb_) <= nt_))                                           \
			check_fail(__FILE__, __LINE__, "%s ~= %s failed: %.9g vs %.9g, |diff| %.3g > " \
				   "tolerance %.3g", #a, #b, na_, nb_, fabs(na_ - nb_), nt_); \
	} while (0)

#define CHECK_STR_EQ(a, b) check_str_eq(__FILE__, __LINE__, #a, #b, (a), (b))

#define CHECK_MEM_EQ(a, b, n) check_mem_eq(__FILE__, __LINE__, #a, #b, (a), (b), (n))

#define CHECK_CONTEXT(...) snprintf(check_context, sizeof(check_context), __VA_ARGS__)
#define CHECK_CONTEXT_CLEAR() (check_context[0] = '\0')

/* Runs one CHECK* statement and ends the test when it failed. */
#define REQUIRE(check)                                                                   \
	do {                                                                             \
		int before_ = failures;                                                  \
		check;                                                                   \
		if (failures != before_)                                                 \
			CHECK_FATAL_ACTION();                                            \
	} while (0)

#endif
