/* Unit tests for the CUDA backend: which backend engine_dep links, buffers and copies (sync and
 * async with fences), and every weight type's matmul against the scalar CPU reference. */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/backend.h"
#include "engine/quant.h"

#include "tests/check.h"
#include "tests/unit/frand.h"

/*
 * Tolerance: normalised mean squared error sum (y - ref)^2 / sum ref^2 over all outputs of one
 * call must stay below NMSE_TOL. The GPU computes the same dequantized values as the reference
 * and differs only in summation order (float lanes and a shuffle tree against float blocks
 * summed in double), which for these sizes gives an NMSE near 1e-12. One element decoded wrong
 * in a 4096-long row already costs about 1e-6, so 1e-7 catches layout bugs with margin.
 */
#define NMSE_TOL 1e-7

static void *xmalloc(size_t n)
{
	void *p = malloc(n);

	if (p == NULL) {
		fprintf(stderr, "out of memory (%zu bytes)\n", n);
		exit(1);
	}
	return p;
}

/* Runs one matmul of type t on the device and checks it against md_vec_dot_ref. pad adds
 * bytes between rows (nb1 > row size). Returns the NMSE, or -1 when a call failed. */
static double check_case(struct md_backend *b, enum md_dtype t, int64_t n_in, int64_t n_out,
			 int n_tok, size_t pad)
{
	size_t rb = md_dtype_row_size(t, n_in);
	size_t nb1 = rb + pad;
	unsigned char *w = xmalloc(nb1 * (size_t)n_out);
	float *src = xmalloc(sizeof(float) * (size_t)n_in);
	float *x = xmalloc(sizeof(float) * (size_t)(n_in * n_tok));
	float *y = xmalloc(sizeof(float) * (size_t)(n_out * n_tok));
	void *dw = NULL;
	struct md_mat m;
	double err = 0.0, ref2 = 0.0, nmse = -1.0;
	int rc;

	memset(w, 0xa5, nb1 * (size_t)n_out); /* padding bytes must never be read as weights */
	for (int64_t r = 0; r < n_out; r++) {
		/* Vary the magnitude per row so K-quant scales and mins cover a range. */
		float scale = 0.25f + 2.0f * (float)(r % 7) / 7.0f;

		for (int64_t i = 0; i < n_in; i++)
			src[i] = frand() * scale + (r % 3 == 0 ? 0.3f * scale : 0.0f);
		md_quantize_row(t, src, w + nb1 * (size_t)r, n_in);
	}
	for (int64_t i = 0; i < n_in * n_tok; i++)
		x[i] = frand();
	for (int64_t i = 0; i < n_out * n_tok; i++)
		y[i] = NAN;

	rc = b->alloc(b, nb1 * (size_t)n_out, &dw);
	CHECK_MSG(rc == 0, "alloc %zu bytes: %d", nb1 * (size_t)n_out, rc);
	if (rc != 0)
		goto out;
	rc = b->upload(b, dw, w, nb1 * (size_t)n_out);
	CHECK_MSG(rc == 0, "upload: %d", rc);
	if (rc != 0)
		goto out_dev;
	m = (struct md_mat){ .type = t, .n_in = n_in, .n_out = n_out, .nb1 = nb1, .data = dw };
	rc = b->matmul(b, &m, x, n_tok, y);
	CHECK_MSG(rc == 0, "matmul %s %lldx%lld n_tok %d: %d", md_dtype_info(t)->name,
	      (long long)n_in, (long long)n_out, n_tok, rc);
	if (rc != 0)
		goto out_dev;
	for (int tok = 0; tok < n_tok; tok++)
		for (int64_t r = 0; r < n_out; r++) {
			double ref = md_vec_dot_ref(t, w + nb1 * (size_t)r, x + n_in * tok, n_in);
			double got = y[tok * n_out + r];

			if (isnan(got)) /* never written: counts as a total miss */
				got = ref + 1.0 + fabs(ref);
			err += (got - ref) * (got - ref);
			ref2 += ref * ref;
		}
	nmse = ref2 > 0.0 ? err / ref2 : err;
	CHECK_MSG(nmse <= NMSE_TOL, "%s n_in %lld n_out %lld n_tok %d pad %zu: nmse %.3g > %.3g (y[0] %g ref %g)",
	      md_dtype_info(t)->name, (long long)n_in, (long long)n_out, n_tok, pad, nmse, NMSE_TOL,
	      (double)y[0], (double)md_vec_dot_ref(t, w, x, n_in));
out_dev:
	b->free(b, dw);
out:
	free(w);
	free(src);
	free(x);
	free(y);
	return nmse;
}

/* Buffers, copies and the argument checks the ops table documents. */
static void check_api(struct md_backend *b)
{
	struct md_backend_device info;
	unsigned char host[1000], back[1000];
	void *d = NULL;
	float x[32] = { 0 }, y[4];
	int n = b->device_count(b);
	int rc;

	CHECK_MSG(n >= 1, "device_count %d", n);
	rc = b->device_info(b, 0, &info);
	CHECK_MSG(rc == 0, "device_info(0): %d", rc);
	if (rc == 0)
		printf("cuda: device 0: %s, cc %d.%d, %d SMs, %.1f GiB (%.1f free), %d device(s)\n",
		       info.name, info.cc_major, info.cc_minor, info.n_sm,
		       (double)info.mem_total / (1 << 30), (double)info.mem_free / (1 << 30), n);
	rc = b->device_info(b, n, &info);
	CHECK_MSG(rc == -ENODEV, "device_info(%d): got %d want %d", n, rc, -ENODEV);

	for (size_t i = 0; i < sizeof(host); i++)
		host[i] = (unsigned char)(i * 7 + 3);
	memset(back, 0, sizeof(back));
	rc = b->alloc(b, sizeof(host), &d);
	CHECK_MSG(rc == 0 && d != NULL, "alloc: %d", rc);
	if (rc != 0)
		return;
	CHECK_MSG((uintptr_t)d % 256 == 0, "alloc alignment: %p", d);
	rc = b->upload(b, d, host, sizeof(host));
	CHECK_MSG(rc == 0, "upload: %d", rc);
	rc = b->download(b, back, (char *)d + 100, sizeof(host) - 100);
	CHECK_MSG(rc == 0, "download: %d", rc);
	CHECK_MEM_EQ(back, host + 100, sizeof(host) - 100);

	/* every type the engine reads */
	for (int t = 0; t < MD_DT_COUNT; t++)
		if (md_dtype_info((uint32_t)t) && md_dtype_info((uint32_t)t)->supported)
			CHECK_MSG(b->supports(b, (enum md_dtype)t), "supports(%s) false",
				  md_dtype_info((uint32_t)t)->name);
	CHECK_MSG(!b->supports(b, (enum md_dtype)MD_DT_COUNT), "supports(MD_DT_COUNT) true");

	/* Invalid calls fail with -EINVAL and leave the backend usable. */
	struct md_mat m = { .type = (enum md_dtype)MD_DT_COUNT, .n_in = 256, .n_out = 1, .nb1 = 84,
			    .data = d };
	rc = b->matmul(b, &m, x, 1, y);
	CHECK_MSG(rc == -EINVAL, "unknown type: got %d want %d", rc, -EINVAL);
	m = (struct md_mat){ .type = MD_DT_Q8_0, .n_in = 48, .n_out = 1, .nb1 = 68, .data = d };
	rc = b->matmul(b, &m, x, 1, y);
	CHECK_MSG(rc == -EINVAL, "n_in not a block multiple: got %d want %d", rc, -EINVAL);
	m = (struct md_mat){ .type = MD_DT_Q4_K, .n_in = 256, .n_out = 1, .nb1 = 144,
			     .data = (char *)d + 2 };
	rc = b->matmul(b, &m, x, 1, y);
	CHECK_MSG(rc == -EINVAL, "misaligned q4_K rows: got %d want %d", rc, -EINVAL);
	m = (struct md_mat){ .type = MD_DT_F32, .n_in = 32, .n_out = 1, .nb1 = 128, .data = d };
	rc = b->matmul(b, &m, x, 0, y);
	CHECK_MSG(rc == -EINVAL, "n_tok 0: got %d want %d", rc, -EINVAL);
	m.nb1 = 100; /* shorter than a row */
	rc = b->matmul(b, &m, x, 1, y);
	CHECK_MSG(rc == -EINVAL, "nb1 < row size: got %d want %d", rc, -EINVAL);
	m.nb1 = 128;
	rc = b->matmul(b, &m, x, 1, y);
	CHECK_MSG(rc == 0, "valid call after invalid ones: %d", rc);
	b->free(b, d);
}

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Fills p with a pattern that differs per seed and per byte position. */
static void fill(unsigned char *p, size_t n, unsigned seed)
{
	uint32_t x = 2463534242u ^ seed;

	for (size_t i = 0; i < n; i++) {
		x ^= x << 13;
		x ^= x >> 17;
		x ^= x << 5;
		p[i] = (unsigned char)x;
	}
}

/*
 * upload_async and fences: two pinned buffers uploaded on two streams while a matmul runs on
 * stream 0, fences waited and queried, the device contents downloaded and compared; a pageable
 * source; more fences than the backend's ring holds; the argument checks.
 */
static void check_async(struct md_backend *b)
{
	const size_t n = (size_t)64 << 20; /* large enough that the copies take milliseconds */
	unsigned char *h0 = NULL, *h1 = NULL, *back = xmalloc(n), *page = xmalloc(4096);
	void *d = NULL;
	uint64_t f0 = 0, f1 = 0, f2 = 0, last = 0;
	double t0, t_enq, t_done;
	int rc;

	rc = b->host_alloc(b, n, (void **)&h0);
	CHECK_MSG(rc == 0 && h0 != NULL, "host_alloc %zu: %d", n, rc);
	rc = b->host_alloc(b, n, (void **)&h1);
	CHECK_MSG(rc == 0 && h1 != NULL, "host_alloc %zu: %d", n, rc);
	rc = b->alloc(b, 2 * n, &d);
	CHECK_MSG(rc == 0 && d != NULL, "alloc %zu: %d", 2 * n, rc);
	if (h0 == NULL || h1 == NULL || d == NULL)
		goto out;
	CHECK_MSG((uintptr_t)h0 % 256 == 0, "host_alloc alignment: %p", (void *)h0);
	fill(h0, n, 1);
	fill(h1, n, 2);

	/* Two copies on two streams, a matmul on stream 0 meanwhile. */
	t0 = now_s();
	rc = b->upload_async(b, d, h0, n, MD_BACKEND_STREAM_COPY);
	CHECK_EQ_I(rc, 0);
	rc = b->upload_async(b, (char *)d + n, h1, n, 2);
	CHECK_EQ_I(rc, 0);
	CHECK_EQ_I(b->fence_record(b, MD_BACKEND_STREAM_COPY, &f0), 0);
	CHECK_EQ_I(b->fence_record(b, 2, &f1), 0);
	t_enq = now_s() - t0;
	CHECK_MSG(f0 != 0 && f1 > f0, "fence ids %llu then %llu", (unsigned long long)f0,
		  (unsigned long long)f1);
	rc = b->fence_done(b, f0);
	CHECK_MSG(rc == 0 || rc == 1, "fence_done while copying: %d", rc);
	printf("cuda: async: 2 x %zu MiB enqueued in %.3f ms, fence %s right after\n", n >> 20,
	       t_enq * 1e3, rc == 1 ? "already passed" : "pending");
	check_case(b, MD_DT_Q8_0, 4096, 64, 3, 0); /* stream 0 work while the copies run */
	CHECK_EQ_I(b->fence_wait(b, f0), 0);
	CHECK_EQ_I(b->fence_wait(b, f1), 0);
	t_done = now_s() - t0;
	printf("cuda: async: both fences passed after %.3f ms (%.1f GB/s over both copies)\n",
	       t_done * 1e3, 2.0 * (double)n / t_done / 1e9);
	CHECK_EQ_I(b->fence_done(b, f0), 1);
	CHECK_EQ_I(b->fence_done(b, f1), 1);
	CHECK_EQ_I(b->fence_wait(b, f0), 0); /* waiting twice is fine */
	memset(back, 0, n);
	CHECK_EQ_I(b->download(b, back, d, n), 0);
	CHECK_MEM_EQ(back, h0, n);
	CHECK_EQ_I(b->download(b, back, (char *)d + n, n), 0);
	CHECK_MEM_EQ(back, h1, n);

	/* Pageable source memory: correct, if not overlapped. size 0 enqueues nothing. */
	fill(page, 4096, 3);
	CHECK_EQ_I(b->upload_async(b, (char *)d + 4096, page, 4096, MD_BACKEND_STREAM_COPY), 0);
	CHECK_EQ_I(b->upload_async(b, d, page, 0, MD_BACKEND_STREAM_COPY), 0);
	CHECK_EQ_I(b->fence_record(b, MD_BACKEND_STREAM_COPY, &f2), 0);
	CHECK_EQ_I(b->fence_wait(b, f2), 0);
	CHECK_EQ_I(b->download(b, back, (char *)d + 4096, 4096), 0);
	CHECK_MEM_EQ(back, page, 4096);
	CHECK_EQ_I(b->download(b, back, d, 4096), 0); /* the size-0 copy left d alone */
	CHECK_MEM_EQ(back, h0, 4096);

	/* More fences than any small ring: each a chunk of h1 into the first half. Ids keep
	 * increasing, and once the last passed every earlier one reads as passed. */
	uint64_t ids[300];
	const size_t chunk = n / 300;

	for (int i = 0; i < 300; i++) {
		CHECK_EQ_I(b->upload_async(b, (char *)d + (size_t)i * chunk, h1 + (size_t)i * chunk,
					   chunk, MD_BACKEND_STREAM_COPY), 0);
		CHECK_EQ_I(b->fence_record(b, i % 2 ? MD_BACKEND_STREAM_COPY : 3, &ids[i]), 0);
		CHECK_MSG(ids[i] > (i ? ids[i - 1] : f2), "fence %d: id %llu after %llu", i,
			  (unsigned long long)ids[i], (unsigned long long)(i ? ids[i - 1] : f2));
	}
	last = ids[299];
	CHECK_EQ_I(b->fence_wait(b, last), 0);    /* the copy stream's last */
	CHECK_EQ_I(b->fence_wait(b, ids[298]), 0); /* stream 3's last */
	for (int i = 0; i < 300; i++)
		CHECK_EQ_I(b->fence_done(b, ids[i]), 1);
	CHECK_EQ_I(b->fence_done(b, f0), 1);
	CHECK_EQ_I(b->download(b, back, d, chunk * 300), 0);
	CHECK_MEM_EQ(back, h1, chunk * 300);

	/* Invalid calls fail with -EINVAL and enqueue nothing. */
	CHECK_EQ_I(b->upload_async(b, d, h0, 16, -1), -EINVAL);
	CHECK_EQ_I(b->upload_async(b, d, h0, 16, MD_BACKEND_STREAMS), -EINVAL);
	CHECK_EQ_I(b->fence_record(b, MD_BACKEND_STREAMS, &f2), -EINVAL);
	CHECK_EQ_I(b->fence_wait(b, 0), -EINVAL);
	CHECK_EQ_I(b->fence_done(b, 0), -EINVAL);
	CHECK_EQ_I(b->fence_wait(b, last + 1000), -EINVAL);
	CHECK_EQ_I(b->fence_done(b, last + 1), -EINVAL);
	{
		void *p = (void *)1;

		CHECK_EQ_I(b->host_alloc(b, 0, &p), -EINVAL);
		CHECK(p == NULL);
	}
	b->host_free(b, NULL);
out:
	b->free(b, d);
	b->host_free(b, h0);
	b->host_free(b, h1);
	free(back);
	free(page);
}

/*
 * Which backend engine_dep linked (this file links nothing else and defines no macro, exactly
 * like engine code): in a CUDA build the real one, whose error, without a GPU, says why there
 * is no device; otherwise the no-op one. Returns the backend, or NULL when the test ends here.
 */
static struct md_backend *check_linked_backend(void)
{
	struct md_backend *b = md_backend_cuda();
	const char *why = md_backend_cuda_error();

	CHECK(md_backend_cuda() == b); /* one object for the process */
#if MD_TEST_CUDA_BUILT
	if (b == NULL) {
		CHECK_MSG(why != NULL && why[0] != '\0' && strcmp(why, "built without cuda") != 0,
			  "a CUDA build links the no-op backend: md_backend_cuda_error() = '%s'",
			  why ? why : "(null)");
		return NULL;
	}
	CHECK_STR_EQ(why, "");
	CHECK_STR_EQ(b->name, "cuda");
#else
	CHECK(b == NULL);
	CHECK_STR_EQ(why, "built without cuda");
	b = NULL;
#endif
	return b;
}

int main(void)
{
	frand_seed(0x9e3779b97f4a7c15ull);
	struct md_backend *b = check_linked_backend();

	if (failures) {
		fprintf(stderr, "cuda: %d check(s) failed\n", failures);
		return 1;
	}
	if (b == NULL) {
		if (!MD_TEST_CUDA_BUILT) {
			printf("cuda: built without cuda: the no-op backend is linked, as expected\n");
			return 0;
		}
		printf("cuda: SKIP: %s; the CUDA backend is linked but no GPU can run it\n",
		       md_backend_cuda_error());
		return 77; /* meson: skipped */
	}
	printf("cuda: backend '%s'\n", b->name);
	check_api(b);
	check_async(b);

	const enum md_dtype types[] = { MD_DT_F32, MD_DT_F16, MD_DT_BF16, MD_DT_Q8_0,
					MD_DT_Q4_0, MD_DT_Q4_K, MD_DT_Q5_K, MD_DT_Q6_K,
					MD_DT_Q4_1, MD_DT_Q5_0, MD_DT_Q5_1, MD_DT_IQ4_NL,
					MD_DT_IQ4_XS, MD_DT_MXFP4, MD_DT_Q2_K, MD_DT_Q3_K };
	/* Shapes: two rows, row counts that leave a partial thread block, wide rows; token
	 * counts below, at and above the kernel's 8-token tile. Float types also get a row
	 * length that is no multiple of 32. */
	const struct { int64_t n_in, n_out; } shapes[] = {
		{ 256, 2 }, { 512, 37 }, { 768, 130 }, { 4096, 64 }, { 2816, 9 },
	};
	const int toks[] = { 1, 3, 8, 9, 17 };

	for (size_t ti = 0; ti < sizeof(types) / sizeof(types[0]); ti++) {
		enum md_dtype t = types[ti];
		const struct md_dtype_info *info = md_dtype_info(t);
		double worst = 0.0;
		int cases = 0;

		for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
			if (shapes[si].n_in % info->blck != 0)
				continue;
			for (size_t k = 0; k < sizeof(toks) / sizeof(toks[0]); k++) {
				double e = check_case(b, t, shapes[si].n_in, shapes[si].n_out, toks[k], 0);

				worst = e > worst ? e : worst;
				cases++;
			}
		}
		/* Padded rows (nb1 a multiple of 256 bytes, as an aligned upload would lay them out). */
		size_t rb = md_dtype_row_size(t, 512);
		double e = check_case(b, t, 512, 21, 5, (rb + 255) / 256 * 256 - rb + 256);
		worst = e > worst ? e : worst;
		cases++;
		if (info->blck == 1) {
			e = check_case(b, t, 100, 33, 4, 0);
			worst = e > worst ? e : worst;
			cases++;
		}
		printf("cuda: %-5s %2d cases, worst nmse %.3g (tolerance %.0e)\n", info->name, cases,
		       worst, NMSE_TOL);
	}
	if (failures) {
		fprintf(stderr, "cuda: %d check(s) failed\n", failures);
		return 1;
	}
	printf("cuda: ok\n");
	return 0;
}
