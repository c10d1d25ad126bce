/* Unit tests for md_matmul_experts: every group's slots against md_matmul on the same rows,
 * with gathered (src) and direct inputs, several types and thread counts. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/kern/cpu.h"
#include "engine/kern/matmul.h"
#include "engine/quant.h"
#include "engine/kern/threadpool.h"

#include "tests/check.h"
#include "frand.h"


int main(void)
{
	frand_seed(0x2545f4914f6cdd1dull);
	const enum md_dtype types[] = { MD_DT_F32, MD_DT_F16, MD_DT_BF16, MD_DT_Q8_0, MD_DT_Q4_0,
					MD_DT_Q4_K, MD_DT_Q5_K, MD_DT_Q6_K };
	/* 4 groups; group 1 gets 11 slots (two token tiles), group 2 one slot. */
	const int ng = 4, n_in = 512, n_out = 200, n_x = 7;
	const int32_t off[5] = { 0, 3, 14, 15, 20 };
	const int n_slots = off[ng];
	if (!md_kern_active()) {
		printf("no kernels active (MOED_KERNELS=ref): nothing to test\n");
		return 0;
	}
	int32_t src[20];
	for (int s = 0; s < n_slots; s++)
		src[s] = (s * 5 + 1) % n_x;
	for (int threads = 1; threads <= 3; threads += 2) {
		struct md_pool *pool = md_pool_new(threads);
		for (size_t ti = 0; ti < sizeof(types) / sizeof(types[0]); ti++) {
			const enum md_dtype t = types[ti];
			const size_t rb = md_dtype_row_size(t, n_in);
			/* 2 weights per group (gate/up style). */
			unsigned char *wb = malloc(rb * n_out * 2 * ng);
			float *row = malloc(sizeof(float) * n_in);
			for (int r = 0; r < n_out * 2 * ng; r++) {
				for (int i = 0; i < n_in; i++)
					row[i] = frand();
				md_quantize_row(t, row, wb + rb * r, n_in);
			}
			struct md_mat w[8];
			for (int i = 0; i < 2 * ng; i++)
				w[i] = (struct md_mat){ t, n_in, n_out, rb, wb + rb * n_out * i };
			CHECK_MSG(md_matmul_experts_ok(w, 2), "type %d: no kernel path", t);
			if (!md_matmul_experts_ok(w, 2))
				continue;
			float *x = malloc(sizeof(float) * n_in * n_slots);
			for (int i = 0; i < n_in * n_slots; i++)
				x[i] = frand();
			float *y0 = malloc(sizeof(float) * n_out * n_slots);
			float *y1 = malloc(sizeof(float) * n_out * n_slots);
			float *ref = malloc(sizeof(float) * n_out * n_slots);
			float *xg = malloc(sizeof(float) * n_in * n_slots);
			void *scr = malloc(md_matmul_experts_scratch_bytes(n_in, n_slots, n_slots));
			float *mscr = malloc(sizeof(float) * md_matmul_scratch_floats(pool, n_in, n_slots));
			for (int mode = 0; mode < 2; mode++) {
				/* mode 0: gathered rows of x (n_x rows); mode 1: one row per slot. */
				for (int s = 0; s < n_slots; s++)
					memcpy(xg + (size_t)s * n_in, x + (size_t)(mode ? s : src[s]) * n_in,
					       sizeof(float) * n_in);
				float *const ys[2] = { y0, y1 };
				memset(y0, 0, sizeof(float) * n_out * n_slots);
				memset(y1, 0, sizeof(float) * n_out * n_slots);
				md_matmul_experts(pool, w, 2, ng, off, x, mode ? n_slots : n_x,
						  mode ? NULL : src, ys, scr);
				for (int g = 0; g < ng; g++)
					for (int i = 0; i < 2; i++) {
						const int m = off[g + 1] - off[g];
						md_matmul(pool, &w[2 * g + i], xg + (size_t)off[g] * n_in, m,
							  ref, mscr);
						const float *got = (i ? y1 : y0) + (size_t)off[g] * n_out;
						for (int k = 0; k < m * n_out; k++) {
							CHECK_MSG(got[k] == ref[k],
								  "type %d threads %d mode %d group %d w %d elem %d: %g != %g",
								  t, threads, mode, g, i, k, got[k], ref[k]);
							if (got[k] != ref[k])
								break; /* one report per group */
						}
					}
			}
			free(wb);
			free(row);
			free(x);
			free(y0);
			free(y1);
			free(ref);
			free(xg);
			free(scr);
			free(mscr);
		}
		md_pool_free(pool);
	}
	printf("%s (%d failures)\n", failures ? "FAIL" : "ok", failures);
	return failures ? 1 : 0;
}
