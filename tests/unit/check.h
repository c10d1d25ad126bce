/* Shared assertion macros for the C unit tests: each failed check prints both values with its
 * file and line and is counted; the test's main returns non-zero when failures > 0. */
#ifndef MD_TEST_CHECK_H
#define MD_TEST_CHECK_H

#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static int failures;

#define CHECK(cond)                                                                      \
	do {                                                                             \
		if (!(cond)) {                                                           \
			fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
			failures++;                                                      \
		}                                                                        \
	} while (0)

/* Unsigned equality; prints decimal and hex (bit patterns read better in hex). */
#define CHECK_EQ_U(a, b)                                                                 \
	do {                                                                             \
		uint64_t a_ = (uint64_t)(a), b_ = (uint64_t)(b);                         \
		if (a_ != b_) {                                                          \
			fprintf(stderr, "%s:%d: %s == %s failed: %" PRIu64 " (0x%" PRIx64 ") != %" PRIu64 \
				" (0x%" PRIx64 ")\n", __FILE__, __LINE__, #a, #b, a_, a_, b_, b_); \
			failures++;                                                      \
		}                                                                        \
	} while (0)

#define CHECK_EQ_I(a, b)                                                                 \
	do {                                                                             \
		int64_t a_ = (int64_t)(a), b_ = (int64_t)(b);                            \
		if (a_ != b_) {                                                          \
			fprintf(stderr, "%s:%d: %s == %s failed: %" PRId64 " != %" PRId64 "\n", \
				__FILE__, __LINE__, #a, #b, a_, b_);                     \
			failures++;                                                      \
		}                                                                        \
	} while (0)

/* Exact float equality, bitwise (so -0 != +0 is caught where it matters). */
#define CHECK_EQ_F(a, b)                                                                 \
	do {                                                                             \
		float fa_ = (a), fb_ = (b);                                              \
		if (memcmp(&fa_, &fb_, sizeof(float)) != 0) {                            \
			fprintf(stderr, "%s:%d: %s == %s failed: %.9g != %.9g\n", __FILE__, \
				__LINE__, #a, #b, (double)fa_, (double)fb_);             \
			failures++;                                                      \
		}                                                                        \
	} while (0)

#endif
