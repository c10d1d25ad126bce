/* Unit tests for the paged KV cache: block accounting, reservation limits, truncation. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/kv_cache.h"

#include "tests/check.h"

int main(void)
{
	struct md_kv_cache kv;
	REQUIRE(CHECK_EQ_I(md_kv_init(&kv, 2, 8, 10, 3), 0));
	int a = md_kv_seq_new(&kv), b = md_kv_seq_new(&kv), c = md_kv_seq_new(&kv);
	REQUIRE(CHECK_EQ_I(a, 0));
	REQUIRE(CHECK_EQ_I(b, 1));
	REQUIRE(CHECK_EQ_I(c, 2));
	REQUIRE(CHECK_EQ_I(md_kv_seq_new(&kv), -ENOSPC));

	/* 33 positions need 3 blocks of 16. */
	REQUIRE(CHECK_EQ_I(md_kv_reserve(&kv, a, 33), 0));
	REQUIRE(CHECK_EQ_I(kv.seqs[a].n_blocks, 3));
	REQUIRE(CHECK_EQ_I(md_kv_blocks_used(&kv), 3));
	/* Reserving less is a no-op. */
	REQUIRE(CHECK_EQ_I(md_kv_reserve(&kv, a, 10), 0));
	REQUIRE(CHECK_EQ_I(md_kv_blocks_used(&kv), 3));
	/* 7 blocks left: 8 blocks for b fail and change nothing. */
	REQUIRE(CHECK_EQ_I(md_kv_reserve(&kv, b, 8 * 16), -ENOSPC));
	REQUIRE(CHECK_EQ_I(kv.seqs[b].n_blocks, 0));
	REQUIRE(CHECK_EQ_I(md_kv_blocks_used(&kv), 3));
	REQUIRE(CHECK_EQ_I(md_kv_reserve(&kv, b, 7 * 16), 0));
	REQUIRE(CHECK_EQ_I(md_kv_blocks_used(&kv), 10));
	REQUIRE(CHECK_EQ_I(md_kv_reserve(&kv, c, 1), -ENOSPC));

	/* Rows of different sequences and layers never alias. */
	for (uint32_t l = 0; l < 2; l++)
		for (uint32_t p = 0; p < 33; p++) {
			float *k = md_kv_k(&kv, l, a, p);
			for (int i = 0; i < 8; i++)
				k[i] = (float)(l * 1000 + p * 10 + i);
		}
	for (uint32_t p = 0; p < 7 * 16; p++)
		memset(md_kv_k(&kv, 0, b, p), 0, 8 * sizeof(float));
	for (uint32_t l = 0; l < 2; l++)
		for (uint32_t p = 0; p < 33; p++)
			REQUIRE(CHECK_EQ_I(md_kv_k(&kv, l, a, p)[3], l * 1000 + p * 10 + 3));

	/* Truncation (speculative rollback) frees whole blocks only. */
	kv.seqs[a].n_pos = 33;
	md_kv_truncate(&kv, a, 17);
	REQUIRE(CHECK_EQ_I(kv.seqs[a].n_blocks, 2));
	REQUIRE(CHECK_EQ_I(kv.seqs[a].n_pos, 17));
	REQUIRE(CHECK_EQ_I(md_kv_blocks_used(&kv), 9));
	REQUIRE(CHECK_EQ_I(md_kv_reserve(&kv, c, 16), 0));

	/* Freeing a sequence returns all its blocks and its slot. */
	md_kv_seq_free(&kv, b);
	REQUIRE(CHECK_EQ_I(md_kv_blocks_used(&kv), 3));
	REQUIRE(CHECK_EQ_I(md_kv_seq_new(&kv), 1));
	REQUIRE(CHECK_EQ_I(kv.seqs[1].n_blocks, 0));
	md_kv_release(&kv);
	printf("kv_cache: ok\n");
	return 0;
}
