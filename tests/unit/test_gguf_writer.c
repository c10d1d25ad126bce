/* Unit test of the GGUF writer: every value type and a few tensors, read back with md_gguf_open. */
#include "tools/gguf_writer.c" /* reaches set_scalar/set_arr_raw for types with no public setter */

#include <inttypes.h>
#include <sys/stat.h>

#include "tests/check.h"

/* The expected content: one entry per key, its type and serialized value bytes. */
struct expect_kv {
	const char *key;
	uint32_t type;
};

static const char *const str_arr[] = { "!", "\"", "", "Ġthe", "<|im_end|>" };
static const uint8_t u8_arr[] = { 0, 1, 255 };
static const int8_t i8_arr[] = { -128, 0, 127 };
static const uint16_t u16_arr[] = { 0, 65535, 7 };
static const int16_t i16_arr[] = { -32768, 32767 };
static const uint32_t u32_arr[] = { 4000000000u, 1, 2, 3 };
static const int32_t i32_arr[] = { -1, 1, 3, 4, 6, INT32_MIN };
static const float f32_arr[] = { 0.5f, -1e30f, 3.25f };
static const uint8_t bool_arr[] = { 1, 0, 1, 1 };
static const uint64_t u64_arr[] = { UINT64_MAX, 0 };
static const int64_t i64_arr[] = { INT64_MIN, -5, INT64_MAX };
static const double f64_arr[] = { 1.0 / 3.0, -2.5e300 };

/* Set every value type into w (keys listed in the same order as check_kvs reads them). */
static void set_all(struct md_gguf_writer *w)
{
	uint8_t u8 = 200; int8_t i8 = -100; uint16_t u16 = 60000; int16_t i16 = -30000;
	int64_t i64 = -1234567890123LL; double f64 = 2.718281828459045;
	md_gguf_w_u32(w, "general.alignment", 64);
	set_scalar(w, "t.u8", MD_GGUF_UINT8, &u8);
	set_scalar(w, "t.i8", MD_GGUF_INT8, &i8);
	set_scalar(w, "t.u16", MD_GGUF_UINT16, &u16);
	set_scalar(w, "t.i16", MD_GGUF_INT16, &i16);
	md_gguf_w_u32(w, "t.u32", 1);          /* replaced below */
	md_gguf_w_i32(w, "t.i32", -7);
	md_gguf_w_f32(w, "t.f32", 1.5f);
	md_gguf_w_bool(w, "t.bool", true);
	md_gguf_w_str(w, "t.str", "héllo");
	md_gguf_w_u64(w, "t.u64", 0x123456789abcdefULL);
	set_scalar(w, "t.i64", MD_GGUF_INT64, &i64);
	set_scalar(w, "t.f64", MD_GGUF_FLOAT64, &f64);
	md_gguf_w_str_n(w, "t.str_nul", "a\0b", 3);
	md_gguf_w_arr_str(w, "t.arr_str", str_arr, NULL, 5);
	set_arr_raw(w, "t.arr_u8", MD_GGUF_UINT8, u8_arr, 3);
	set_arr_raw(w, "t.arr_i8", MD_GGUF_INT8, i8_arr, 3);
	set_arr_raw(w, "t.arr_u16", MD_GGUF_UINT16, u16_arr, 3);
	set_arr_raw(w, "t.arr_i16", MD_GGUF_INT16, i16_arr, 2);
	set_arr_raw(w, "t.arr_u32", MD_GGUF_UINT32, u32_arr, 4);
	md_gguf_w_arr_i32(w, "t.arr_i32", i32_arr, 6);
	md_gguf_w_arr_f32(w, "t.arr_f32", f32_arr, 3);
	set_arr_raw(w, "t.arr_bool", MD_GGUF_BOOL, bool_arr, 4);
	set_arr_raw(w, "t.arr_u64", MD_GGUF_UINT64, u64_arr, 2);
	set_arr_raw(w, "t.arr_i64", MD_GGUF_INT64, i64_arr, 3);
	set_arr_raw(w, "t.arr_f64", MD_GGUF_FLOAT64, f64_arr, 2);
	md_gguf_w_arr_i32(w, "t.arr_empty", NULL, 0);
	md_gguf_w_u32(w, "t.u32", 4000000001u); /* replaces, keeps position */
}

static const struct md_gguf_kv *kv_at(const struct md_gguf *g, const char *key)
{
	int64_t i = md_gguf_find_key(g, key);
	if (i < 0) {
		fprintf(stderr, "key '%s' missing\n", key);
		failures++;
		return NULL;
	}
	return &g->kv[i];
}

static void check_scalar(const struct md_gguf *g, const char *key, uint32_t type,
			 const void *want, size_t n)
{
	const struct md_gguf_kv *kv = kv_at(g, key);
	if (!kv)
		return;
	CHECK_EQ_U(kv->type, type);
	if (memcmp(kv->data, want, n) != 0) {
		fprintf(stderr, "value of '%s' differs\n", key);
		failures++;
	}
}

static void check_arr(const struct md_gguf *g, const char *key, uint32_t et, const void *want,
		      uint64_t n)
{
	const struct md_gguf_kv *kv = kv_at(g, key);
	if (!kv)
		return;
	CHECK_EQ_U(kv->type, MD_GGUF_ARRAY);
	CHECK_EQ_U(kv->arr_type, et);
	CHECK_EQ_U(kv->arr_n, n);
	if (kv->arr_n == n && n > 0 && memcmp(kv->data, want, vtype_size(et) * n) != 0) {
		fprintf(stderr, "elements of '%s' differ\n", key);
		failures++;
	}
}

static void check_str(const struct md_gguf *g, const char *key, const char *want, size_t n)
{
	struct md_gguf_str s;
	const struct md_gguf_kv *kv = kv_at(g, key);
	if (!kv)
		return;
	CHECK_EQ_U(kv->type, MD_GGUF_STRING);
	CHECK(md_gguf_get_str(g, key, &s));
	CHECK_EQ_U(s.len, n);
	if (s.len == n && memcmp(s.ptr, want, n) != 0) {
		fprintf(stderr, "string '%s' differs: '%.*s'\n", key, (int)s.len, s.ptr);
		failures++;
	}
}

static void check_kvs(const struct md_gguf *g)
{
	uint8_t u8 = 200; int8_t i8 = -100; uint16_t u16 = 60000; int16_t i16 = -30000;
	uint32_t u32 = 4000000001u, al = 64; int32_t i32 = -7; float f32 = 1.5f; uint8_t b = 1;
	uint64_t u64 = 0x123456789abcdefULL; int64_t i64 = -1234567890123LL;
	double f64 = 2.718281828459045;

	CHECK_EQ_U(g->n_kv, 27);
	CHECK_EQ_U(g->alignment, 64);
	/* The replaced key keeps its first position (index 5). */
	if (g->n_kv > 5)
		CHECK(md_gguf_str_eq(g->kv[5].key, "t.u32"));
	check_scalar(g, "general.alignment", MD_GGUF_UINT32, &al, 4);
	check_scalar(g, "t.u8", MD_GGUF_UINT8, &u8, 1);
	check_scalar(g, "t.i8", MD_GGUF_INT8, &i8, 1);
	check_scalar(g, "t.u16", MD_GGUF_UINT16, &u16, 2);
	check_scalar(g, "t.i16", MD_GGUF_INT16, &i16, 2);
	check_scalar(g, "t.u32", MD_GGUF_UINT32, &u32, 4);
	check_scalar(g, "t.i32", MD_GGUF_INT32, &i32, 4);
	check_scalar(g, "t.f32", MD_GGUF_FLOAT32, &f32, 4);
	check_scalar(g, "t.bool", MD_GGUF_BOOL, &b, 1);
	check_scalar(g, "t.u64", MD_GGUF_UINT64, &u64, 8);
	check_scalar(g, "t.i64", MD_GGUF_INT64, &i64, 8);
	check_scalar(g, "t.f64", MD_GGUF_FLOAT64, &f64, 8);
	check_str(g, "t.str", "héllo", strlen("héllo"));
	check_str(g, "t.str_nul", "a\0b", 3);

	uint32_t gu32; bool gb; float gf;
	CHECK(md_gguf_get_u32(g, "t.u32", &gu32) && gu32 == u32);
	CHECK(md_gguf_get_bool(g, "t.bool", &gb) && gb);
	CHECK(md_gguf_get_f32(g, "t.f32", &gf) && gf == 1.5f);

	const struct md_gguf_kv *kv = kv_at(g, "t.arr_str");
	if (kv) {
		CHECK_EQ_U(kv->type, MD_GGUF_ARRAY);
		CHECK_EQ_U(kv->arr_type, MD_GGUF_STRING);
		CHECK_EQ_U(kv->arr_n, 5);
		for (uint64_t i = 0; i < 5 && i < kv->arr_n; i++) {
			struct md_gguf_str s;
			CHECK(md_gguf_arr_str(kv, i, &s));
			if (!md_gguf_str_eq(s, str_arr[i])) {
				fprintf(stderr, "arr_str[%" PRIu64 "]: got '%.*s', want '%s'\n", i,
					(int)s.len, s.ptr, str_arr[i]);
				failures++;
			}
		}
	}
	check_arr(g, "t.arr_u8", MD_GGUF_UINT8, u8_arr, 3);
	check_arr(g, "t.arr_i8", MD_GGUF_INT8, i8_arr, 3);
	check_arr(g, "t.arr_u16", MD_GGUF_UINT16, u16_arr, 3);
	check_arr(g, "t.arr_i16", MD_GGUF_INT16, i16_arr, 2);
	check_arr(g, "t.arr_u32", MD_GGUF_UINT32, u32_arr, 4);
	check_arr(g, "t.arr_i32", MD_GGUF_INT32, i32_arr, 6);
	check_arr(g, "t.arr_f32", MD_GGUF_FLOAT32, f32_arr, 3);
	check_arr(g, "t.arr_bool", MD_GGUF_BOOL, bool_arr, 4);
	check_arr(g, "t.arr_u64", MD_GGUF_UINT64, u64_arr, 2);
	check_arr(g, "t.arr_i64", MD_GGUF_INT64, i64_arr, 3);
	check_arr(g, "t.arr_f64", MD_GGUF_FLOAT64, f64_arr, 2);
	check_arr(g, "t.arr_empty", MD_GGUF_INT32, NULL, 0);
	kv = kv_at(g, "t.arr_i32");
	int64_t v;
	if (kv)
		CHECK(md_gguf_arr_i64(kv, 5, &v) && v == INT32_MIN);
}

/* Tensor data: byte i of tensor k is a hash of (k, i), so misplaced data is caught. */
struct fill_ctx {
	uint32_t k;
	int calls;
	int fail; /* return this instead of filling when nonzero */
};

static uint8_t pattern(uint32_t k, size_t i)
{
	uint32_t h = (uint32_t)i * 2654435761u ^ (k + 1) * 40503u;
	return (uint8_t)(h >> 13);
}

static int fill(void *vctx, void *dst, size_t nbytes)
{
	struct fill_ctx *c = vctx;
	c->calls++;
	if (c->fail)
		return c->fail;
	for (size_t i = 0; i < nbytes; i++)
		((uint8_t *)dst)[i] = pattern(c->k, i);
	return 0;
}

struct tspec {
	const char *name;
	uint32_t type;
	uint32_t n_dims;
	int64_t ne[4];
	uint64_t nbytes;
};

static const struct tspec tensors[] = {
	{ "a.weight", MD_DT_F32, 1, { 3 }, 12 },
	{ "b.weight", MD_DT_F16, 2, { 5, 2 }, 20 },
	{ "blk.0.c", MD_DT_Q8_0, 2, { 64, 3 }, 2 * 34 * 3 },
	{ "blk.0.d_exps", MD_DT_F32, 3, { 4, 3, 2 }, 96 },
	{ "e", MD_DT_Q6_K, 2, { 256, 1 }, 210 },
	{ "f", MD_DT_BF16, 4, { 2, 1, 3, 2 }, 24 },
};
#define N_TENSORS (sizeof(tensors) / sizeof(tensors[0]))

static void check_tensors(const struct md_gguf *g, uint64_t align)
{
	CHECK_EQ_U(g->n_tensors, N_TENSORS);
	CHECK_EQ_U(g->data_offset % align, 0);
	for (size_t k = 0; k < N_TENSORS && k < g->n_tensors; k++) {
		const struct tspec *s = &tensors[k];
		const struct md_gguf_tensor *t = md_gguf_find_tensor(g, s->name);
		if (!t) {
			fprintf(stderr, "tensor '%s' missing\n", s->name);
			failures++;
			continue;
		}
		CHECK(t == &g->tensors[k]); /* declaration order kept */
		CHECK_EQ_U(t->type, s->type);
		CHECK_EQ_U(t->n_dims, s->n_dims);
		for (int d = 0; d < 4; d++)
			CHECK_EQ_U(t->ne[d], s->ne[d] ? s->ne[d] : 1);
		CHECK_EQ_U(t->nbytes, s->nbytes);
		CHECK_EQ_U(t->offset % align, 0);
		size_t bad = 0;
		for (size_t i = 0; i < t->nbytes; i++)
			bad += ((const uint8_t *)t->data)[i] != pattern((uint32_t)k, i);
		if (bad) {
			fprintf(stderr, "tensor '%s': %zu bytes differ\n", s->name, bad);
			failures++;
		}
	}
}

int main(void)
{
	char dir[200];
	char path[256], path2[256], path3[256], err[256];
	struct fill_ctx ctx[N_TENSORS];
	struct md_gguf g, g2, g3;

	const char *tmpdir = getenv("TMPDIR");
	snprintf(dir, sizeof(dir), "%s/test_gguf_writer.XXXXXX", tmpdir && *tmpdir ? tmpdir : "/tmp");
	if (!mkdtemp(dir)) {
		perror("mkdtemp");
		return 1;
	}
	snprintf(path, sizeof(path), "%s/all.gguf", dir);
	snprintf(path2, sizeof(path2), "%s/copy.gguf", dir);
	snprintf(path3, sizeof(path3), "%s/fail.gguf", dir);

	/* 1. every value type and a few tensors, alignment 64 */
	struct md_gguf_writer *w = md_gguf_writer_new();
	CHECK(w != NULL);
	set_all(w);
	for (size_t k = 0; k < N_TENSORS; k++) {
		ctx[k] = (struct fill_ctx){ .k = (uint32_t)k };
		int rc = md_gguf_w_tensor(w, tensors[k].name, tensors[k].type, tensors[k].n_dims,
					  tensors[k].ne, fill, &ctx[k]);
		CHECK_EQ_U(rc, 0);
	}
	/* rejected declarations */
	int64_t bad_ne[2] = { 30, 2 };
	CHECK(md_gguf_w_tensor(w, "bad", MD_DT_Q8_0, 2, bad_ne, fill, &ctx[0]) == -EINVAL);
	bad_ne[0] = 128;
	CHECK(md_gguf_w_tensor(w, "bad", MD_DT_Q4_K, 2, bad_ne, fill, &ctx[0]) == -EINVAL);
	CHECK(md_gguf_w_tensor(w, "bad", MD_DT_F32, 0, bad_ne, fill, &ctx[0]) == -EINVAL);
	CHECK(md_gguf_w_tensor(w, "bad", MD_DT_F32, 5, bad_ne, fill, &ctx[0]) == -EINVAL);
	CHECK(md_gguf_w_tensor(w, "a.weight", MD_DT_F32, 1, bad_ne, fill, &ctx[0]) == -EINVAL);
	bad_ne[0] = 0;
	CHECK(md_gguf_w_tensor(w, "bad", MD_DT_F32, 1, bad_ne, fill, &ctx[0]) == -EINVAL);

	int rc = md_gguf_writer_write(w, path, err, sizeof(err));
	if (rc) {
		fprintf(stderr, "write failed: %d %s\n", rc, err);
		return 1;
	}
	for (size_t k = 0; k < N_TENSORS; k++)
		CHECK_EQ_U(ctx[k].calls, 1);
	md_gguf_writer_free(w);

	rc = md_gguf_open(&g, path, err, sizeof(err));
	if (rc) {
		fprintf(stderr, "md_gguf_open failed: %d %s\n", rc, err);
		return 1;
	}
	CHECK_EQ_U(g.version, 3);
	check_kvs(&g);
	check_tensors(&g, 64);

	/* 2. copy_kv round trip: copy every key into a new file, compare again */
	w = md_gguf_writer_new();
	md_gguf_w_copy_kv(w, &g);
	for (size_t k = 0; k < N_TENSORS; k++)
		CHECK_EQ_U(md_gguf_w_tensor(w, tensors[k].name, tensors[k].type, tensors[k].n_dims,
					    tensors[k].ne, fill, &ctx[k]), 0);
	rc = md_gguf_writer_write(w, path2, err, sizeof(err));
	CHECK_EQ_U(rc, 0);
	md_gguf_writer_free(w);
	rc = md_gguf_open(&g2, path2, err, sizeof(err));
	if (rc) {
		fprintf(stderr, "md_gguf_open (copy) failed: %d %s\n", rc, err);
		return 1;
	}
	check_kvs(&g2);
	check_tensors(&g2, 64);
	md_gguf_close(&g2);

	/* 3. prefix copy, default alignment 32, no tensors */
	w = md_gguf_writer_new();
	md_gguf_w_copy_kv_prefix(w, &g, "t.arr_");
	rc = md_gguf_writer_write(w, path2, err, sizeof(err));
	CHECK_EQ_U(rc, 0);
	md_gguf_writer_free(w);
	rc = md_gguf_open(&g2, path2, err, sizeof(err));
	CHECK_EQ_U(rc, 0);
	if (rc == 0) {
		CHECK_EQ_U(g2.n_kv, 13);
		CHECK_EQ_U(g2.alignment, 32);
		CHECK_EQ_U(g2.n_tensors, 0);
		CHECK(md_gguf_find_key(&g2, "t.u32") < 0);
		check_arr(&g2, "t.arr_f64", MD_GGUF_FLOAT64, f64_arr, 2);
		md_gguf_close(&g2);
	}
	md_gguf_close(&g);

	/* 4. a failing fill callback: error returned, one-line message, no file left */
	w = md_gguf_writer_new();
	md_gguf_w_str(w, "general.architecture", "x");
	struct fill_ctx ok = { .k = 0 }, broken = { .k = 1, .fail = -EIO };
	int64_t ne1[1] = { 8 };
	CHECK_EQ_U(md_gguf_w_tensor(w, "ok", MD_DT_F32, 1, ne1, fill, &ok), 0);
	CHECK_EQ_U(md_gguf_w_tensor(w, "broken", MD_DT_F32, 1, ne1, fill, &broken), 0);
	rc = md_gguf_writer_write(w, path3, err, sizeof(err));
	CHECK(rc == -EIO);
	CHECK(strstr(err, "broken") != NULL && strchr(err, '\n') == NULL);
	struct stat st;
	CHECK(stat(path3, &st) != 0);
	md_gguf_writer_free(w);
	CHECK(md_gguf_open(&g3, path3, err, sizeof(err)) < 0);

	/* 5. unwritable path */
	w = md_gguf_writer_new();
	snprintf(path3, sizeof(path3), "%s/no/such/dir.gguf", dir);
	rc = md_gguf_writer_write(w, path3, err, sizeof(err));
	CHECK(rc == -ENOENT);
	CHECK(err[0] != '\0');
	md_gguf_writer_free(w);

	unlink(path);
	unlink(path2);
	rmdir(dir);
	if (failures) {
		fprintf(stderr, "%d check(s) failed\n", failures);
		return 1;
	}
	printf("gguf writer: all checks passed\n");
	return 0;
}
