/* Seeded uniform floats in [-1, 1) for the C unit tests (xorshift64, so a seed gives the same
 * data on every machine). Call frand_seed() first in main. */
#ifndef MD_TEST_FRAND_H
#define MD_TEST_FRAND_H

#include <stdint.h>

static uint64_t frand_state = 88172645463325252ull;

static inline void frand_seed(uint64_t seed)
{
	frand_state = seed;
}

static inline float frand(void)
{
	frand_state ^= frand_state << 13;
	frand_state ^= frand_state >> 7;
	frand_state ^= frand_state << 17;
	return (float)((frand_state >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}

#endif
