/* Unit tests for the threaded matmul against the scalar reference dot product, every type. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "engine/kern/cpu.h"
#include "engine/kern/matmul.h"
#include "engine/quant.h"
#include "engine/kern/threadpool.h"

#include "tests/check.h"
#include "frand.h"

int main(void)
{
	frand_seed(88172645463325252ull);
	const enum md_dtype types[] = { MD_DT_F32, MD_DT_F16, MD_DT_BF16, MD_DT_Q8_0,
					MD_DT_Q4_0, MD_DT_Q4_K, MD_DT_Q5_K, MD_DT_Q6_K };
	const int n_in = 512, n_out = 37, n_tok = 5;
	/* The dequantizing reference path; test_kernels covers the SIMD path. */
	md_kern_set_active(NULL);
	for (int threads = 1; threads <= 3; threads++) {
		struct md_pool *pool = md_pool_new(threads);
		for (size_t ti = 0; ti < sizeof(types) / sizeof(types[0]); ti++) {
			enum md_dtype t = types[ti];
			size_t rb = md_dtype_row_size(t, n_in);
			float *src = malloc(sizeof(float) * n_in);
			unsigned char *w = malloc(rb * n_out);
			for (int r = 0; r < n_out; r++) {
				for (int i = 0; i < n_in; i++)
					src[i] = frand();
				md_quantize_row(t, src, w + rb * r, n_in);
			}
			float *x = malloc(sizeof(float) * n_in * n_tok);
			for (int i = 0; i < n_in * n_tok; i++)
				x[i] = frand();
			float *y = malloc(sizeof(float) * n_out * n_tok);
			float *scratch = malloc(sizeof(float) * md_matmul_scratch_floats(pool, n_in, n_tok));
			struct md_mat m = { t, n_in, n_out, rb, w };
			md_matmul(pool, &m, x, n_tok, y, scratch);
			for (int tok = 0; tok < n_tok; tok++)
				for (int r = 0; r < n_out; r++) {
					float ref = md_vec_dot_ref(t, w + rb * r, x + n_in * tok, n_in);
					float got = y[tok * n_out + r];

					CHECK_CONTEXT("type %s threads %d tok %d row %d",
						      md_dtype_info(t)->name, threads, tok, r);
					CHECK_NEAR(got, ref, 1e-4f * (1.0f + fabsf(ref)));
				}
			free(src);
			free(w);
			free(x);
			free(y);
			free(scratch);
		}
		md_pool_free(pool);
	}
	if (failures) {
		fprintf(stderr, "matmul: %d mismatches\n", failures);
		return 1;
	}
	printf("matmul: ok\n");
	return 0;
}
