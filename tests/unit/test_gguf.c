/* Tests for the GGUF reader: files written byte by byte here, read back, then corrupted. */
#include "engine/gguf.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "engine/quant.h"

#include "tests/check.h"

/* ---- a tiny GGUF emitter (independent of tools/gguf_writer.c) ---- */

struct buf {
	uint8_t *p; /* owned */
	size_t n, cap;
};

static void put(struct buf *b, const void *d, size_t n)
{
	if (b->n + n > b->cap) {
		size_t cap = b->cap ? b->cap : 256;

		while (cap < b->n + n)
			cap *= 2;
		b->p = realloc(b->p, cap);
		if (!b->p)
			abort();
		b->cap = cap;
	}
	memcpy(b->p + b->n, d, n);
	b->n += n;
}

static void put_u8(struct buf *b, uint8_t v) { put(b, &v, 1); }
static void put_u16(struct buf *b, uint16_t v) { put(b, &v, 2); }
static void put_u32(struct buf *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(struct buf *b, uint64_t v) { put(b, &v, 8); }
static void put_f32(struct buf *b, float v) { put(b, &v, 4); }
static void put_f64(struct buf *b, double v) { put(b, &v, 8); }

static void put_str(struct buf *b, const char *s)
{
	put_u64(b, strlen(s));
	put(b, s, strlen(s));
}

static void put_key(struct buf *b, const char *key, uint32_t type)
{
	put_str(b, key);
	put_u32(b, type);
}

static void pad_to(struct buf *b, size_t align)
{
	while (b->n % align)
		put_u8(b, 0);
}

/* Where the emitter put the fields the corruption cases patch. */
#define NT 4
struct layout {
	size_t n_kv_pos;
	size_t key0_len_pos;      /* length of key #0 */
	size_t arch_val_len_pos;  /* length of the general.architecture value */
	size_t u8_type_pos;       /* value type of key t.u8 */
	size_t arr_str_type_pos;  /* element type of t.arr_str */
	size_t arr_str_n_pos;     /* element count of t.arr_str */
	size_t arr_str_e2_pos;    /* length of element 2 of t.arr_str */
	size_t t_ndims_pos[NT];
	size_t t_ne_pos[NT];      /* ne[0] of tensor i */
	size_t t_type_pos[NT];
	size_t t_off_pos[NT];
	size_t data_pos;          /* file offset of the data section */
	uint64_t t_off[NT];
	uint64_t t_nbytes[NT];
};

struct spec {
	uint32_t alignment; /* 0: no general.alignment key (default 32) */
	bool dup_key;
	bool dup_tensor;
};

static const char *const tnames[NT] = {
	"tok_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_norm.weight", "output.weight",
};
static const uint32_t ttypes[NT] = { MD_DT_F32, MD_DT_Q8_0, MD_DT_F16, MD_DT_Q4_K };
static const uint32_t tndims[NT] = { 2, 2, 1, 4 };
static const uint64_t tne[NT][4] = { { 4, 3, 1, 1 }, { 64, 2, 1, 1 }, { 8, 1, 1, 1 },
				     { 256, 1, 1, 1 } };
static const uint64_t tbytes[NT] = { 48, 4 * 34, 16, 144 };
#define N_KV_BASE 20

static uint8_t data_byte(int t, uint64_t i)
{
	return (uint8_t)(t * 31 + i * 7 + 1);
}

/* Builds a valid file: every value type, arrays, NT tensors; the last tensor's data ends
 * exactly at end of file so every strict prefix is invalid. */
static void build(const struct spec *s, struct buf *b, struct layout *l)
{
	uint64_t n_kv = N_KV_BASE + (s->alignment ? 1 : 0) + (s->dup_key ? 1 : 0);
	uint64_t align = s->alignment ? s->alignment : 32;

	memset(b, 0, sizeof(*b));
	memset(l, 0, sizeof(*l));
	put(b, "GGUF", 4);
	put_u32(b, 3);
	put_u64(b, NT);
	l->n_kv_pos = b->n;
	put_u64(b, n_kv);

	l->key0_len_pos = b->n;
	put_key(b, "general.architecture", MD_GGUF_STRING);
	l->arch_val_len_pos = b->n;
	put_str(b, "llama");
	put_str(b, "t.u8");
	l->u8_type_pos = b->n;
	put_u32(b, MD_GGUF_UINT8);
	put_u8(b, 200);
	put_key(b, "t.i8", MD_GGUF_INT8);
	put_u8(b, (uint8_t)-100);
	put_key(b, "t.u16", MD_GGUF_UINT16);
	put_u16(b, 60000);
	put_key(b, "t.i16", MD_GGUF_INT16);
	put_u16(b, (uint16_t)-30000);
	put_key(b, "t.u32", MD_GGUF_UINT32);
	put_u32(b, 4000000000u);
	put_key(b, "t.i32", MD_GGUF_INT32);
	put_u32(b, (uint32_t)-2000000000);
	put_key(b, "t.f32", MD_GGUF_FLOAT32);
	put_f32(b, 1.5f);
	put_key(b, "t.bool", MD_GGUF_BOOL);
	put_u8(b, 1);
	put_key(b, "t.u64", MD_GGUF_UINT64);
	put_u64(b, UINT64_C(1) << 40);
	put_key(b, "t.i64", MD_GGUF_INT64);
	put_u64(b, (uint64_t)-(INT64_C(1) << 40));
	put_key(b, "t.f64", MD_GGUF_FLOAT64);
	put_f64(b, 0.25);
	put_key(b, "t.str_empty", MD_GGUF_STRING);
	put_str(b, "");
	put_key(b, "t.arr_i32", MD_GGUF_ARRAY);
	put_u32(b, MD_GGUF_INT32);
	put_u64(b, 3);
	put_u32(b, 1);
	put_u32(b, (uint32_t)-2);
	put_u32(b, 3);
	put_key(b, "t.arr_f32", MD_GGUF_ARRAY);
	put_u32(b, MD_GGUF_FLOAT32);
	put_u64(b, 2);
	put_f32(b, 0.5f);
	put_f32(b, -1.25f);
	put_key(b, "t.arr_str", MD_GGUF_ARRAY);
	l->arr_str_type_pos = b->n;
	put_u32(b, MD_GGUF_STRING);
	l->arr_str_n_pos = b->n;
	put_u64(b, 3);
	put_str(b, "a");
	put_str(b, "");
	l->arr_str_e2_pos = b->n;
	put_str(b, "hello world");
	put_key(b, "t.arr_u8_empty", MD_GGUF_ARRAY);
	put_u32(b, MD_GGUF_UINT8);
	put_u64(b, 0);
	put_key(b, "t.arr_u64", MD_GGUF_ARRAY);
	put_u32(b, MD_GGUF_UINT64);
	put_u64(b, 2);
	put_u64(b, 7);
	put_u64(b, UINT64_C(1) << 63);
	put_key(b, "t.arr_bool", MD_GGUF_ARRAY);
	put_u32(b, MD_GGUF_BOOL);
	put_u64(b, 2);
	put_u8(b, 1);
	put_u8(b, 0);
	put_key(b, "t.arr_i16", MD_GGUF_ARRAY);
	put_u32(b, MD_GGUF_INT16);
	put_u64(b, 1);
	put_u16(b, (uint16_t)-5);
	if (s->alignment) {
		put_key(b, "general.alignment", MD_GGUF_UINT32);
		put_u32(b, s->alignment);
	}
	if (s->dup_key) {
		put_key(b, "t.u8", MD_GGUF_UINT8);
		put_u8(b, 1);
	}

	uint64_t off = 0;

	for (int t = 0; t < NT; t++) {
		const char *name = (s->dup_tensor && t == 2) ? tnames[1] : tnames[t];

		put_str(b, name);
		l->t_ndims_pos[t] = b->n;
		put_u32(b, tndims[t]);
		l->t_ne_pos[t] = b->n;
		for (uint32_t d = 0; d < tndims[t]; d++)
			put_u64(b, tne[t][d]);
		l->t_type_pos[t] = b->n;
		put_u32(b, ttypes[t]);
		l->t_off_pos[t] = b->n;
		put_u64(b, off);
		l->t_off[t] = off;
		l->t_nbytes[t] = tbytes[t];
		off += tbytes[t];
		off = (off + align - 1) / align * align;
	}
	pad_to(b, align);
	l->data_pos = b->n;
	for (int t = 0; t < NT; t++) {
		while (b->n < l->data_pos + l->t_off[t])
			put_u8(b, 0);
		for (uint64_t i = 0; i < tbytes[t]; i++)
			put_u8(b, data_byte(t, i));
	}
}

static void patch_u32(struct buf *b, size_t pos, uint32_t v) { memcpy(b->p + pos, &v, 4); }
static void patch_u64(struct buf *b, size_t pos, uint64_t v) { memcpy(b->p + pos, &v, 8); }

/* ---- checks ---- */

/* Every error is one line starting with "gguf: ". */
static void check_err_line(const char *err)
{
	if (strncmp(err, "gguf: ", 6) != 0 || strchr(err, '\n') || strlen(err) < 12) {
		fprintf(stderr, "bad error line: '%s'\n", err);
		failures++;
	}
}

/* Opens an exact-size heap copy (so ASan sees any over-read) and expects failure with
 * frag in the message. Returns the message in err. */
static void expect_fail(const char *what, const uint8_t *p, size_t n, const char *frag,
			char *err, size_t errlen)
{
	uint8_t *copy = malloc(n ? n : 1);
	struct md_gguf g;
	int r;

	memcpy(copy, p, n);
	r = md_gguf_open_mem(&g, copy, n, err, errlen);
	if (r >= 0) {
		fprintf(stderr, "%s: open succeeded, expected failure with '%s'\n", what, frag);
		failures++;
		md_gguf_close(&g);
	} else {
		check_err_line(err);
		if (!strstr(err, frag)) {
			fprintf(stderr, "%s: error '%s' lacks '%s'\n", what, err, frag);
			failures++;
		}
		if (r != -EINVAL) {
			fprintf(stderr, "%s: return %d, expected %d\n", what, r, -EINVAL);
			failures++;
		}
	}
	free(copy);
}

static void check_valid(const struct md_gguf *g, const struct layout *l, uint64_t align)
{
	uint32_t u32;
	uint64_t u64;
	float f;
	bool bo;
	struct md_gguf_str s;
	int64_t i64;

	CHECK_EQ_U(g->version, 3);
	CHECK_EQ_U(g->n_tensors, NT);
	CHECK_EQ_U(g->alignment, align);
	CHECK_EQ_U(g->data_offset, l->data_pos);
	CHECK_EQ_U(g->data_offset % align, 0);

	CHECK(md_gguf_get_str(g, "general.architecture", &s) && md_gguf_str_eq(s, "llama"));
	CHECK(md_gguf_get_u32(g, "t.u8", &u32));
	CHECK_EQ_U(u32, 200);
	CHECK(!md_gguf_get_u32(g, "t.i8", &u32)); /* negative */
	CHECK(md_gguf_get_f32(g, "t.i8", &f) && f == -100.0f);
	CHECK(md_gguf_get_u32(g, "t.u16", &u32));
	CHECK_EQ_U(u32, 60000);
	CHECK(md_gguf_get_f32(g, "t.i16", &f) && f == -30000.0f);
	CHECK(md_gguf_get_u32(g, "t.u32", &u32));
	CHECK_EQ_U(u32, 4000000000u);
	CHECK(!md_gguf_get_u64(g, "t.i32", &u64));
	CHECK(md_gguf_get_f32(g, "t.i32", &f) && f == -2000000000.0f);
	CHECK(md_gguf_get_f32(g, "t.f32", &f) && f == 1.5f);
	CHECK(!md_gguf_get_u32(g, "t.f32", &u32)); /* a float is not an integer */
	CHECK(md_gguf_get_bool(g, "t.bool", &bo) && bo);
	CHECK(!md_gguf_get_bool(g, "t.u8", &bo));
	CHECK(md_gguf_get_u64(g, "t.u64", &u64));
	CHECK_EQ_U(u64, UINT64_C(1) << 40);
	CHECK(!md_gguf_get_u32(g, "t.u64", &u32)); /* does not fit */
	CHECK(md_gguf_get_f32(g, "t.i64", &f) && f == -1099511627776.0f);
	CHECK(md_gguf_get_f32(g, "t.f64", &f) && f == 0.25f);
	CHECK(md_gguf_get_str(g, "t.str_empty", &s));
	CHECK_EQ_U(s.len, 0);
	CHECK(!md_gguf_get_str(g, "t.u8", &s));
	CHECK(!md_gguf_get_u32(g, "no.such.key", &u32));
	CHECK_EQ_I(md_gguf_find_key(g, "no.such.key"), -1);
	CHECK_EQ_I(md_gguf_find_key(g, "general.architecture"), 0);
	CHECK_EQ_I(md_gguf_find_key(g, "t.arr_bool"), 18);
	CHECK_EQ_I(md_gguf_find_key(g, "t.arr"), -1); /* prefix of a key */

	int64_t k = md_gguf_find_key(g, "t.arr_i32");
	CHECK(k >= 0);
	if (k >= 0) {
		const struct md_gguf_kv *kv = &g->kv[k];

		CHECK_EQ_U(kv->type, MD_GGUF_ARRAY);
		CHECK_EQ_U(kv->arr_type, MD_GGUF_INT32);
		CHECK_EQ_U(kv->arr_n, 3);
		CHECK(md_gguf_arr_i64(kv, 1, &i64));
		CHECK_EQ_I(i64, -2);
		CHECK(md_gguf_arr_f32(kv, 2, &f) && f == 3.0f);
		CHECK(!md_gguf_arr_i64(kv, 3, &i64));
		CHECK(!md_gguf_arr_str(kv, 0, &s));
	}
	k = md_gguf_find_key(g, "t.arr_f32");
	CHECK(k >= 0);
	if (k >= 0) {
		CHECK(md_gguf_arr_f32(&g->kv[k], 1, &f) && f == -1.25f);
		CHECK(!md_gguf_arr_i64(&g->kv[k], 0, &i64));
	}
	k = md_gguf_find_key(g, "t.arr_str");
	CHECK(k >= 0);
	if (k >= 0) {
		const struct md_gguf_kv *kv = &g->kv[k];

		CHECK_EQ_U(kv->arr_n, 3);
		CHECK(kv->str_offs != NULL);
		CHECK(md_gguf_arr_str(kv, 0, &s) && md_gguf_str_eq(s, "a"));
		CHECK(md_gguf_arr_str(kv, 1, &s) && s.len == 0);
		CHECK(md_gguf_arr_str(kv, 2, &s) && md_gguf_str_eq(s, "hello world"));
		CHECK(!md_gguf_arr_str(kv, 3, &s));
		CHECK(!md_gguf_arr_f32(kv, 0, &f));
	}
	k = md_gguf_find_key(g, "t.arr_u8_empty");
	CHECK(k >= 0);
	if (k >= 0) {
		CHECK_EQ_U(g->kv[k].arr_n, 0);
		CHECK(!md_gguf_arr_i64(&g->kv[k], 0, &i64));
	}
	k = md_gguf_find_key(g, "t.arr_u64");
	CHECK(k >= 0);
	if (k >= 0) {
		CHECK(md_gguf_arr_i64(&g->kv[k], 0, &i64));
		CHECK_EQ_I(i64, 7);
		CHECK(!md_gguf_arr_i64(&g->kv[k], 1, &i64)); /* 2^63 does not fit */
	}
	k = md_gguf_find_key(g, "t.arr_bool");
	CHECK(k >= 0 && g->kv[k].arr_type == MD_GGUF_BOOL && g->kv[k].arr_n == 2 &&
	      g->kv[k].data[0] == 1 && g->kv[k].data[1] == 0);
	k = md_gguf_find_key(g, "t.arr_i16");
	CHECK(k >= 0 && md_gguf_arr_i64(&g->kv[k], 0, &i64) && i64 == -5);

	for (int t = 0; t < NT; t++) {
		const struct md_gguf_tensor *ti = md_gguf_find_tensor(g, tnames[t]);

		CHECK(ti == &g->tensors[t]);
		if (!ti)
			continue;
		CHECK(md_gguf_str_eq(ti->name, tnames[t]));
		CHECK_EQ_U(ti->n_dims, tndims[t]);
		CHECK_EQ_U(ti->type, ttypes[t]);
		for (int d = 0; d < 4; d++)
			CHECK_EQ_I(ti->ne[d], tne[t][d]);
		CHECK_EQ_U(ti->offset, l->t_off[t]);
		CHECK_EQ_U(ti->nbytes, tbytes[t]);
		CHECK_EQ_U((const uint8_t *)ti->data - g->base, l->data_pos + l->t_off[t]);
		CHECK_EQ_U(((const uint8_t *)ti->data - g->base) % align, 0);
		bool same = true;
		for (uint64_t i = 0; i < ti->nbytes; i++)
			same = same && ((const uint8_t *)ti->data)[i] == data_byte(t, i);
		CHECK(same);
	}
	CHECK(md_gguf_find_tensor(g, "blk.0") == NULL);
	CHECK(md_gguf_find_tensor(g, "") == NULL);
}

static void test_valid(uint32_t alignment)
{
	struct spec sp = { .alignment = alignment };
	struct buf b;
	struct layout l;
	struct md_gguf g;
	char err[256];
	int r;

	build(&sp, &b, &l);
	r = md_gguf_open_mem(&g, b.p, b.n, err, sizeof(err));
	if (r != 0) {
		fprintf(stderr, "valid (alignment %u) failed: %d %s\n", alignment, r, err);
		failures++;
	} else {
		CHECK_EQ_U(g.n_kv, N_KV_BASE + (alignment ? 1 : 0));
		check_valid(&g, &l, alignment ? alignment : 32);
		md_gguf_close(&g);
	}
	free(b.p);
}

static const char *tmpdir(void)
{
	const char *d = getenv("TMPDIR");

	return d && *d ? d : "/tmp";
}

static void test_file(void)
{
	struct spec sp = { .alignment = 64 };
	struct buf b;
	struct layout l;
	struct md_gguf g;
	char path[512], err[512];
	int fd, r;

	build(&sp, &b, &l);
	snprintf(path, sizeof(path), "%s/test_gguf_XXXXXX", tmpdir());
	fd = mkstemp(path);
	CHECK(fd >= 0);
	if (fd < 0)
		return;
	CHECK(write(fd, b.p, b.n) == (ssize_t)b.n);
	close(fd);

	r = md_gguf_open(&g, path, err, sizeof(err));
	if (r != 0) {
		fprintf(stderr, "open '%s' failed: %d %s\n", path, r, err);
		failures++;
	} else {
		CHECK(g._mapped);
		check_valid(&g, &l, 64);
		md_gguf_close(&g);
	}

	/* Truncated file on disk: same checks as in memory, through the mmap path. */
	CHECK(truncate(path, (off_t)(b.n - 1)) == 0);
	r = md_gguf_open(&g, path, err, sizeof(err));
	CHECK_EQ_I(r, -EINVAL);
	check_err_line(err);
	CHECK(strstr(err, "tensor 'output.weight' data [") != NULL);

	CHECK(truncate(path, 0) == 0);
	r = md_gguf_open(&g, path, err, sizeof(err));
	CHECK_EQ_I(r, -EINVAL);
	CHECK(strcmp(err, "gguf: truncated at offset 0 while reading magic") == 0);
	unlink(path);

	r = md_gguf_open(&g, path, err, sizeof(err));
	CHECK_EQ_I(r, -ENOENT);
	CHECK(strstr(err, "gguf: cannot open '") == err);
	r = md_gguf_open(&g, tmpdir(), err, sizeof(err));
	CHECK_EQ_I(r, -EINVAL);
	CHECK(strstr(err, "is not a regular file") != NULL);
	md_gguf_close(&g); /* closing a failed open is a no-op */
	free(b.p);
}

/* Every strict prefix of a valid file fails cleanly; the whole file opens. */
static void test_prefixes(uint32_t alignment)
{
	struct spec sp = { .alignment = alignment };
	struct buf b;
	struct layout l;
	char err[256];
	size_t n_trunc = 0, n_past = 0;

	build(&sp, &b, &l);
	for (size_t n = 0; n < b.n; n++) {
		uint8_t *copy = malloc(n ? n : 1);
		struct md_gguf g;
		int r;

		memcpy(copy, b.p, n);
		err[0] = '\0';
		r = md_gguf_open_mem(&g, copy, n, err, sizeof(err));
		if (r == 0) {
			fprintf(stderr, "prefix of %zu/%zu bytes opened\n", n, b.n);
			failures++;
			md_gguf_close(&g);
		} else {
			check_err_line(err);
			if (strstr(err, "data [") && strstr(err, "extends past end of file"))
				n_past++;
			else if (strstr(err, "truncated at offset") || strstr(err, "past end of file"))
				n_trunc++;
			else if (failures++ < 5)
				fprintf(stderr, "prefix %zu: unexpected error '%s'\n", n, err);
			/* Inside the header and infos, the offset named is where the read began. */
			if (n < l.data_pos && n >= 24 && strstr(err, "truncated at offset")) {
				unsigned long long at = strtoull(err + strlen("gguf: truncated at offset "),
								 NULL, 10);
				CHECK(at <= n);
			}
		}
		free(copy);
	}
	printf("prefixes (alignment %u): %zu lengths, %zu truncation errors, %zu data errors\n",
	       alignment ? alignment : 32, b.n, n_trunc, n_past);
	CHECK(n_trunc > 0 && n_past > 0);
	free(b.p);
}

static void test_corrupt(void)
{
	struct spec sp = { 0 };
	struct buf b, c;
	struct layout l;
	char err[256], want[256];

	build(&sp, &b, &l);
	c.p = malloc(b.n);
	c.n = b.n;
#define RESET() memcpy(c.p, b.p, b.n)

	expect_fail("empty", b.p, 0, "truncated at offset 0 while reading magic", err, sizeof(err));
	CHECK(strcmp(err, "gguf: truncated at offset 0 while reading magic") == 0);
	expect_fail("prefix 20", b.p, 20, "gguf: ", err, sizeof(err));
	CHECK(strcmp(err, "gguf: truncated at offset 16 while reading key count") == 0);
	expect_fail("prefix 30", b.p, 30, "gguf: 20 keys and 4 tensors (offsets 16 and 8) run past "
		    "end of file (size 30;", err, sizeof(err));
	/* Past the count check, a cut inside key #16's length field. */
	size_t k16 = (size_t)((uint8_t *)memmem(b.p, b.n, "t.arr_u8_empty", 14) - b.p) - 8;
	expect_fail("prefix in key 16", b.p, k16 + 3, "gguf: ", err, sizeof(err));
	snprintf(want, sizeof(want), "gguf: truncated at offset %zu while reading key #16 length",
		 k16);
	CHECK(strcmp(err, want) == 0);
	printf("truncated file (%zu bytes): %s\n", k16 + 3, err);
	snprintf(want, sizeof(want), "gguf: key #16 length 14 at offset %zu runs past end of file "
		 "(size %zu)", k16, k16 + 10);
	expect_fail("prefix in key 16 name", b.p, k16 + 10, want, err, sizeof(err));

	RESET();
	c.p[0] = 'g';
	expect_fail("bad magic", c.p, c.n, "bad magic 'gGUF' at offset 0", err, sizeof(err));
	RESET();
	patch_u32(&c, 4, 1);
	expect_fail("version 1", c.p, c.n, "version 1 is not supported", err, sizeof(err));
	RESET();
	patch_u32(&c, 4, 4);
	expect_fail("version 4", c.p, c.n, "unsupported version 4", err, sizeof(err));
	RESET();
	patch_u32(&c, 4, 0x03000000u);
	expect_fail("big-endian", c.p, c.n, "big-endian GGUF file", err, sizeof(err));
	RESET();
	patch_u64(&c, l.n_kv_pos, UINT64_C(1) << 40);
	expect_fail("huge n_kv", c.p, c.n, "n_kv 1099511627776 at offset 16 exceeds the limit", err,
		    sizeof(err));
	RESET();
	patch_u64(&c, l.n_kv_pos, 1000);
	expect_fail("n_kv past EOF", c.p, c.n, "1000 keys and 4 tensors (offsets 16 and 8) run past "
		    "end of file", err, sizeof(err));
	RESET();
	patch_u64(&c, 8, UINT64_MAX);
	expect_fail("huge n_tensors", c.p, c.n, "n_tensors 18446744073709551615 at offset 8", err,
		    sizeof(err));
	RESET();
	patch_u64(&c, l.n_kv_pos, N_KV_BASE + 1); /* tensor infos get read as keys */
	expect_fail("n_kv one too many", c.p, c.n, "gguf: ", err, sizeof(err));
	RESET();
	patch_u64(&c, l.key0_len_pos, UINT64_C(1) << 62);
	snprintf(want, sizeof(want), "key #0 length 4611686018427387904 at offset 24 runs past "
		 "end of file (size %zu)", b.n);
	expect_fail("huge key length", c.p, c.n, want, err, sizeof(err));
	RESET();
	patch_u64(&c, l.arch_val_len_pos, UINT64_MAX);
	expect_fail("huge string value", c.p, c.n,
		    "key 'general.architecture' (#0) string length 18446744073709551615", err,
		    sizeof(err));
	RESET();
	patch_u64(&c, l.arr_str_n_pos, UINT64_C(1) << 61);
	snprintf(want, sizeof(want), "key 't.arr_str' (#15) array of 2305843009213693952 string at "
		 "offset %zu runs past end of file (size %zu; 8 bytes per element at least)",
		 l.arr_str_type_pos, b.n);
	expect_fail("huge array", c.p, c.n, want, err, sizeof(err));
	RESET();
	patch_u64(&c, l.arr_str_n_pos, 50); /* fits the size check, then desyncs the reader */
	expect_fail("array count past strings", c.p, c.n, "gguf: ", err, sizeof(err));
	RESET();
	patch_u64(&c, l.arr_str_e2_pos, 1u << 20);
	expect_fail("huge element length", c.p, c.n, "element 2 of key 't.arr_str' (#15): string "
		    "length 1048576", err, sizeof(err));
	RESET();
	patch_u32(&c, l.u8_type_pos, 13);
	expect_fail("unknown value type", c.p, c.n, "key 't.u8' (#1) has unknown value type 13",
		    err, sizeof(err));
	RESET();
	patch_u32(&c, l.arr_str_type_pos, MD_GGUF_ARRAY);
	expect_fail("nested array", c.p, c.n, "nested arrays are not supported", err, sizeof(err));
	RESET();
	patch_u32(&c, l.arr_str_type_pos, 77);
	expect_fail("unknown array type", c.p, c.n, "unknown array element type 77", err,
		    sizeof(err));

	/* Tensor infos. */
	RESET();
	patch_u64(&c, l.t_off_pos[3], l.t_off[3] + 1024);
	snprintf(want, sizeof(want), "gguf: tensor 'output.weight' data [%zu, %zu) extends past "
		 "end of file (size %zu)", l.data_pos + (size_t)l.t_off[3] + 1024,
		 l.data_pos + (size_t)l.t_off[3] + 1024 + 144, b.n);
	expect_fail("offset past EOF", c.p, c.n, want, err, sizeof(err));
	CHECK(strcmp(err, want) == 0);
	printf("corrupted tensor offset: %s\n", err);
	RESET();
	patch_u64(&c, l.t_off_pos[1], UINT64_MAX - 31);
	expect_fail("offset wraps", c.p, c.n, "tensor 'blk.0.attn_q.weight' data at relative "
		    "offset 18446744073709551584 (136 bytes) extends past end of file", err,
		    sizeof(err));
	RESET();
	patch_u64(&c, l.t_off_pos[1], l.t_off[1] + 8);
	expect_fail("unaligned offset", c.p, c.n, "tensor 'blk.0.attn_q.weight' offset 72 is not "
		    "a multiple of the alignment 32", err, sizeof(err));
	RESET();
	patch_u32(&c, l.t_type_pos[0], 99);
	expect_fail("unknown type", c.p, c.n, "tensor 'tok_embd.weight' has unknown type 99", err,
		    sizeof(err));
	RESET();
	patch_u32(&c, l.t_type_pos[0], 4); /* a removed GGML type id */
	expect_fail("removed type", c.p, c.n, "has unknown type 4", err, sizeof(err));
	RESET();
	patch_u64(&c, l.t_ne_pos[3] + 8, UINT64_C(1) << 32);
	patch_u64(&c, l.t_ne_pos[3] + 16, UINT64_C(1) << 32);
	expect_fail("overflowing dims", c.p, c.n, "tensor 'output.weight' element count overflows",
		    err, sizeof(err));
	RESET();
	patch_u64(&c, l.t_ne_pos[0], UINT64_C(1) << 62);
	patch_u64(&c, l.t_ne_pos[0] + 8, 1);
	expect_fail("overflowing bytes", c.p, c.n, "tensor 'tok_embd.weight' byte size overflows",
		    err, sizeof(err));
	RESET();
	patch_u64(&c, l.t_ne_pos[0] + 8, 0);
	expect_fail("zero dim", c.p, c.n, "tensor 'tok_embd.weight' ne[1] = 0", err, sizeof(err));
	RESET();
	patch_u64(&c, l.t_ne_pos[0], UINT64_MAX);
	expect_fail("negative dim", c.p, c.n, "is not a positive int64", err, sizeof(err));
	RESET();
	patch_u64(&c, l.t_ne_pos[1], 48);
	expect_fail("partial block", c.p, c.n, "tensor 'blk.0.attn_q.weight' ne[0] = 48 is not a "
		    "multiple of the q8_0 block size 32", err, sizeof(err));
	RESET();
	patch_u32(&c, l.t_ndims_pos[0], 5);
	expect_fail("n_dims 5", c.p, c.n, "tensor 'tok_embd.weight' has n_dims 5", err,
		    sizeof(err));
	RESET();
	patch_u32(&c, l.t_ndims_pos[0], 0);
	expect_fail("n_dims 0", c.p, c.n, "has n_dims 0", err, sizeof(err));
	RESET();
	c.p[l.t_ndims_pos[0] - 2] = '\n'; /* control bytes in a name never reach the line */
	patch_u32(&c, l.t_type_pos[0], 99);
	expect_fail("name with newline", c.p, c.n, "tensor 'tok_embd.weig?t' has unknown type 99",
		    err, sizeof(err));
	free(c.p);
	free(b.p);

	/* Duplicates and alignment need rebuilt files. */
	sp = (struct spec){ .dup_tensor = true };
	build(&sp, &b, &l);
	expect_fail("dup tensor", b.p, b.n, "duplicate tensor name 'blk.0.attn_q.weight' (#2", err,
		    sizeof(err));
	free(b.p);
	sp = (struct spec){ .dup_key = true };
	build(&sp, &b, &l);
	expect_fail("dup key", b.p, b.n, "duplicate key 't.u8' (#20", err, sizeof(err));
	free(b.p);
	sp = (struct spec){ .alignment = 48 };
	build(&sp, &b, &l);
	expect_fail("alignment 48", b.p, b.n, "general.alignment 48 is not a power of two", err,
		    sizeof(err));
	free(b.p);
	sp = (struct spec){ .alignment = 64 };
	build(&sp, &b, &l);
	patch_u64(&b, l.t_off_pos[1], 32); /* aligned to 32 but not to 64 */
	expect_fail("unaligned for 64", b.p, b.n, "offset 32 is not a multiple of the alignment 64",
		    err, sizeof(err));
	free(b.p);
#undef RESET
}

/* A vocabulary-sized string array and 2,000 tensors: the index and str_offs stay fast. */
static void test_large(void)
{
	enum { N_STR = 150000, N_T = 2000 };
	struct buf b = { 0 };
	struct md_gguf g;
	char err[256], name[64];
	struct timespec t0, t1;

	put(&b, "GGUF", 4);
	put_u32(&b, 2);
	put_u64(&b, N_T);
	put_u64(&b, 41);
	put_key(&b, "tokenizer.ggml.tokens", MD_GGUF_ARRAY);
	put_u32(&b, MD_GGUF_STRING);
	put_u64(&b, N_STR);
	for (int i = 0; i < N_STR; i++) {
		snprintf(name, sizeof(name), "tok%d", i);
		put_str(&b, name);
	}
	for (int i = 0; i < 40; i++) {
		snprintf(name, sizeof(name), "k.%d", i);
		put_key(&b, name, MD_GGUF_UINT32);
		put_u32(&b, (uint32_t)i * 3);
	}
	for (int i = 0; i < N_T; i++) {
		snprintf(name, sizeof(name), "blk.%d.ffn_up_exps.weight", i);
		put_str(&b, name);
		put_u32(&b, 1);
		put_u64(&b, 8);
		put_u32(&b, MD_DT_F32);
		put_u64(&b, (uint64_t)i * 32);
	}
	pad_to(&b, 32);
	for (int i = 0; i < N_T; i++) {
		for (int j = 0; j < 8; j++) {
			float v = (float)i;
			put(&b, &v, 4);
		}
	}
	clock_gettime(CLOCK_MONOTONIC, &t0);
	int r = md_gguf_open_mem(&g, b.p, b.n, err, sizeof(err));
	clock_gettime(CLOCK_MONOTONIC, &t1);
	CHECK_EQ_I(r, 0);
	if (r) {
		fprintf(stderr, "large: %s\n", err);
		free(b.p);
		return;
	}
	double open_ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
	CHECK_EQ_U(g.version, 2);

	struct md_gguf_str s;
	const struct md_gguf_kv *kv = &g.kv[md_gguf_find_key(&g, "tokenizer.ggml.tokens")];
	CHECK_EQ_U(kv->arr_n, N_STR);
	CHECK(md_gguf_arr_str(kv, 123456, &s) && md_gguf_str_eq(s, "tok123456"));
	CHECK(md_gguf_arr_str(kv, N_STR - 1, &s) && md_gguf_str_eq(s, "tok149999"));

	clock_gettime(CLOCK_MONOTONIC, &t0);
	int found = 0;
	for (int rep = 0; rep < 10; rep++) {
		for (int i = 0; i < N_T; i++) {
			snprintf(name, sizeof(name), "blk.%d.ffn_up_exps.weight", i);
			const struct md_gguf_tensor *t = md_gguf_find_tensor(&g, name);
			float v;

			if (t && t == &g.tensors[i]) {
				memcpy(&v, t->data, 4);
				found += v == (float)i;
			}
		}
		for (int i = 0; i < 40; i++) {
			uint32_t u;

			snprintf(name, sizeof(name), "k.%d", i);
			found += md_gguf_get_u32(&g, name, &u) && u == (uint32_t)i * 3;
		}
	}
	clock_gettime(CLOCK_MONOTONIC, &t1);
	double look_us = ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) /
			 1e3 / (10.0 * (N_T + 40));
	CHECK_EQ_I(found, 10 * (N_T + 40));
	printf("large: %zu bytes, %d strings, %d tensors: open %.2f ms, lookup %.3f us\n", b.n,
	       N_STR, N_T, open_ms, look_us);
	CHECK(look_us < 50.0); /* a linear scan of 2,000 names would still pass; the time is printed */
	md_gguf_close(&g);
	free(b.p);
}

/* Seed corpus for tests/fuzz: valid files of each shape. Returns the seed's file name, or
 * NULL past the last one. */
static const char *seed(int k, struct buf *b)
{
	struct spec sp = { 0 };
	struct layout l;

	memset(b, 0, sizeof(*b));
	switch (k) {
	case 0:
		build(&sp, b, &l);
		return "full_a32.gguf";
	case 1:
		sp.alignment = 64;
		build(&sp, b, &l);
		return "full_a64.gguf";
	case 2:
		put(b, "GGUF", 4);
		put_u32(b, 2);
		put_u64(b, 0);
		put_u64(b, 1);
		put_key(b, "general.name", MD_GGUF_STRING);
		put_str(b, "x");
		return "kv_only_v2.gguf";
	case 3:
		put(b, "GGUF", 4);
		put_u32(b, 3);
		put_u64(b, 1);
		put_u64(b, 2);
		put_key(b, "general.alignment", MD_GGUF_UINT32);
		put_u32(b, 8);
		put_key(b, "tokenizer.ggml.tokens", MD_GGUF_ARRAY);
		put_u32(b, MD_GGUF_STRING);
		put_u64(b, 4);
		put_str(b, "<s>");
		put_str(b, "</s>");
		put_str(b, "\xc4\xa0the");
		put_str(b, "");
		put_str(b, "bf");
		put_u32(b, 1);
		put_u64(b, 4);
		put_u32(b, MD_DT_BF16);
		put_u64(b, 0);
		pad_to(b, 8);
		put_u64(b, UINT64_C(0x3f803f803f803f80));
		return "vocab_a8.gguf";
	default:
		return NULL;
	}
}

/* The seeds are valid files (the fuzz corpus is regenerated from them). */
static void test_seeds(void)
{
	struct buf b;
	const char *name;
	char err[256];

	for (int k = 0; (name = seed(k, &b)) != NULL; k++) {
		struct md_gguf g;
		int r = md_gguf_open_mem(&g, b.p, b.n, err, sizeof(err));

		if (r != 0) {
			fprintf(stderr, "seed %s: %s\n", name, err);
			failures++;
		} else {
			CHECK(g.data_offset <= b.n);
			md_gguf_close(&g);
		}
		CHECK(b.n < 4096);
		free(b.p);
	}
}

static int write_corpus(const char *dir)
{
	struct buf b;
	const char *name;
	int rc = 0;

	for (int k = 0; (name = seed(k, &b)) != NULL; k++) {
		char path[1024];
		FILE *f;

		snprintf(path, sizeof(path), "%s/%s", dir, name);
		f = fopen(path, "wb");
		if (!f || fwrite(b.p, 1, b.n, f) != b.n || fclose(f) != 0) {
			fprintf(stderr, "cannot write '%s'\n", path);
			rc = 1;
		} else {
			printf("wrote %s (%zu bytes)\n", path, b.n);
		}
		free(b.p);
	}
	return rc;
}

int main(int argc, char **argv)
{
	/* Regenerates tests/fuzz/corpus/gguf: test_gguf --write-corpus DIR */
	if (argc == 3 && strcmp(argv[1], "--write-corpus") == 0)
		return write_corpus(argv[2]);

	test_valid(0);
	test_valid(32);
	test_valid(64);
	test_file();
	test_prefixes(0);
	test_prefixes(64);
	test_corrupt();
	test_large();
	test_seeds();
	if (failures) {
		fprintf(stderr, "%d check(s) failed\n", failures);
		return 1;
	}
	printf("all gguf checks passed\n");
	return 0;
}
