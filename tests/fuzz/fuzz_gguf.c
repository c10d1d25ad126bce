/* libFuzzer target for the GGUF reader: open any bytes, then walk every key and tensor. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/gguf.h"

/* Invariant violations abort, so libFuzzer (or the corpus driver) reports them as crashes. */
#define CHECK_FATAL_ACTION() abort()
#include "tests/check.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static volatile uint64_t sink;

/* Touches every byte of s so ASan sees any out-of-bounds pointer. */
static void touch(struct md_gguf_str s)
{
	uint64_t h = 0;

	for (uint64_t i = 0; i < s.len; i++)
		h += (unsigned char)s.ptr[i];
	sink += h;
}

/* NUL-terminated copy, or NULL when the name has an embedded NUL (not findable by C string). */
static char *cstr(struct md_gguf_str s)
{
	char *c;

	if (memchr(s.ptr, '\0', s.len))
		return NULL;
	c = malloc(s.len + 1);
	if (!c)
		abort();
	memcpy(c, s.ptr, s.len);
	c[s.len] = '\0';
	return c;
}

static void walk_kv(const struct md_gguf *g, uint64_t i)
{
	const struct md_gguf_kv *kv = &g->kv[i];
	struct md_gguf_str s;
	uint32_t u32;
	uint64_t u64;
	int64_t i64;
	float f;
	bool b;
	char *key;

	touch(kv->key);
	(void)md_gguf_vtype_name(kv->type);
	key = cstr(kv->key);
	if (key) {
		REQUIRE(CHECK_EQ_I(md_gguf_find_key(g, key), i));
		REQUIRE(CHECK(md_gguf_str_eq(kv->key, key)));
		sink += md_gguf_get_u32(g, key, &u32) ? u32 : 0;
		sink += md_gguf_get_u64(g, key, &u64) ? u64 : 0;
		sink += md_gguf_get_f32(g, key, &f) ? (uint64_t)(f == f) : 0;
		sink += md_gguf_get_bool(g, key, &b) ? b : 0;
		if (md_gguf_get_str(g, key, &s)) {
			REQUIRE(CHECK(kv->type == MD_GGUF_STRING));
			touch(s);
		}
		free(key);
	}
	if (kv->type != MD_GGUF_ARRAY)
		return;
	(void)md_gguf_vtype_name(kv->arr_type);
	for (uint64_t j = 0; j <= kv->arr_n; j++) {
		bool ok = md_gguf_arr_str(kv, j, &s);

		REQUIRE(CHECK(!ok || (j < kv->arr_n && kv->arr_type == MD_GGUF_STRING)));
		if (ok)
			touch(s);
		ok = md_gguf_arr_f32(kv, j, &f);
		REQUIRE(CHECK(!ok || j < kv->arr_n));
		if (ok)
			sink += (uint64_t)(f == f);
		ok = md_gguf_arr_i64(kv, j, &i64);
		REQUIRE(CHECK(!ok || j < kv->arr_n));
		if (ok)
			sink += (uint64_t)i64;
	}
}

static void walk_tensor(const struct md_gguf *g, uint64_t i)
{
	const struct md_gguf_tensor *t = &g->tensors[i];
	const uint8_t *p = t->data;
	char *name;

	touch(t->name);
	REQUIRE(CHECK(t->n_dims >= 1 && t->n_dims <= MD_GGUF_MAX_DIMS));
	REQUIRE(CHECK(t->nbytes > 0));
	REQUIRE(CHECK(p >= g->base + g->data_offset &&
		      (uint64_t)(p - g->base) + t->nbytes <= g->size));
	REQUIRE(CHECK(t->offset % g->alignment == 0));
	for (int d = 0; d < MD_GGUF_MAX_DIMS; d++)
		REQUIRE(CHECK(t->ne[d] >= 1));
	sink += p[0] + p[t->nbytes - 1];
	name = cstr(t->name);
	if (name) {
		REQUIRE(CHECK(md_gguf_find_tensor(g, name) == t));
		free(name);
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct md_gguf g;
	char err[256];
	int r;

	r = md_gguf_open_mem(&g, data, size, err, sizeof(err));
	if (r != 0) {
		REQUIRE(CHECK(r < 0));
		REQUIRE(CHECK(strncmp(err, "gguf: ", 6) == 0 && !strchr(err, '\n')));
		return 0;
	}
	REQUIRE(CHECK(g.version == 2 || g.version == 3));
	REQUIRE(CHECK(g.alignment && (g.alignment & (g.alignment - 1)) == 0));
	for (uint64_t i = 0; i < g.n_kv; i++)
		walk_kv(&g, i);
	for (uint64_t i = 0; i < g.n_tensors; i++)
		walk_tensor(&g, i);
	REQUIRE(CHECK_EQ_I(md_gguf_find_key(&g, ""), -1));
	REQUIRE(CHECK(md_gguf_find_tensor(&g, "") == NULL));
	md_gguf_close(&g);
	return 0;
}
