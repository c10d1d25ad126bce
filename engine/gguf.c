/* GGUF v2/v3 reader: maps the file read-only and validates every field before exposing it. */
#include "engine/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/quant.h"

/*
 * DESIGN
 *
 * The whole file is parsed once at open time by a bounds-checked cursor; afterwards every
 * pointer handed out (key, string value, array element, tensor data) is known to lie inside
 * the buffer, so the getters only check types and indices. Counts read from the file are
 * compared with the bytes that remain before anything is allocated for them, and the kv and
 * tensor arrays grow as entries are actually parsed, so a lying header costs at most a small
 * multiple of the file's real size in memory. String arrays (a 150k-token vocabulary) get
 * their element offsets computed in the same pass, so element access is O(1) later.
 *
 * Keys and tensor names are indexed by an open-addressing hash (FNV-1a, load <= 1/2), which
 * also detects duplicates while the file is parsed.
 *
 * GGUF is little-endian on disk and moed only targets little-endian hosts, so values are read
 * with memcpy (the map gives no alignment guarantee for metadata).
 */

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "engine/gguf.c assumes a little-endian host"
#endif

/* Ceiling on n_kv and n_tensors: far above any real model (tens of thousands of tensors at
 * most), low enough that indices fit the uint32_t hash slots. */
#define GGUF_MAX_ENTRIES (UINT64_C(1) << 24)

/* Smallest possible encodings, used to reject counts the remaining bytes cannot hold. */
#define KV_MIN_BYTES 14     /* key len(8) + 1 key byte + type(4) + a u8 value(1) */
#define TENSOR_MIN_BYTES 33 /* name len(8) + 1 name byte + n_dims(4) + ne(8) + type(4) + off(8) */

struct cur {
	const uint8_t *base; /* borrowed: the buffer being parsed */
	uint64_t size;
	uint64_t pos;
	char *err; /* borrowed: caller's error buffer (may be NULL) */
	size_t errlen;
};

static int fail(struct cur *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int fail(struct cur *c, const char *fmt, ...)
{
	if (c->err && c->errlen) {
		int n = snprintf(c->err, c->errlen, "gguf: ");
		if (n >= 0 && (size_t)n < c->errlen) {
			va_list ap;

			va_start(ap, fmt);
			vsnprintf(c->err + n, c->errlen - (size_t)n, fmt, ap);
			va_end(ap);
		}
	}
	return -EINVAL;
}

/* "truncated at offset N while reading <what>". */
static int fail_trunc(struct cur *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int fail_trunc(struct cur *c, const char *fmt, ...)
{
	if (c->err && c->errlen) {
		int n = snprintf(c->err, c->errlen, "gguf: truncated at offset %" PRIu64
				 " while reading ", c->pos);
		if (n >= 0 && (size_t)n < c->errlen) {
			va_list ap;

			va_start(ap, fmt);
			vsnprintf(c->err + n, c->errlen - (size_t)n, fmt, ap);
			va_end(ap);
		}
	}
	return -EINVAL;
}

static int fail_nomem(struct cur *c, uint64_t n, const char *what)
{
	fail(c, "out of memory for %" PRIu64 " %s at offset %" PRIu64, n, what, c->pos);
	return -ENOMEM;
}

static uint64_t remaining(const struct cur *c)
{
	return c->size - c->pos;
}

static bool rd_u32(struct cur *c, uint32_t *v)
{
	if (remaining(c) < 4)
		return false;
	memcpy(v, c->base + c->pos, 4);
	c->pos += 4;
	return true;
}

static bool rd_u64(struct cur *c, uint64_t *v)
{
	if (remaining(c) < 8)
		return false;
	memcpy(v, c->base + c->pos, 8);
	c->pos += 8;
	return true;
}

/* Printable, bounded, quoted-safe copy of untrusted bytes for an error line. */
#define SAFE_NAME_LEN 80
static const char *safe_name(char *buf, const char *p, uint64_t len)
{
	size_t o = 0;
	uint64_t i;

	for (i = 0; i < len && o < SAFE_NAME_LEN - 4; i++) {
		unsigned char ch = (unsigned char)p[i];

		buf[o++] = (ch >= 0x20 && ch < 0x7f && ch != '\'') ? (char)ch : '?';
	}
	if (i < len) {
		buf[o++] = '.';
		buf[o++] = '.';
		buf[o++] = '.';
	}
	buf[o] = '\0';
	return buf;
}

static uint64_t hash_bytes(const char *p, uint64_t len)
{
	uint64_t h = UINT64_C(0xcbf29ce484222325);

	for (uint64_t i = 0; i < len; i++) {
		h ^= (unsigned char)p[i];
		h *= UINT64_C(0x100000001b3);
	}
	return h;
}

static bool str_eq_bytes(struct md_gguf_str s, const char *p, uint64_t len)
{
	return s.len == len && (len == 0 || memcmp(s.ptr, p, len) == 0);
}

/* Allocates an empty index for n entries (load factor <= 1/2). */
static int index_new(uint64_t n, uint32_t **slots, uint64_t *mask)
{
	uint64_t cap = 16;

	while (cap < 2 * n)
		cap <<= 1;
	*slots = calloc(cap, sizeof(**slots));
	if (!*slots)
		return -ENOMEM;
	*mask = cap - 1;
	return 0;
}

/* Finds the slot for name: either the one holding it or the empty slot where it belongs. */
typedef struct md_gguf_str (*name_of_fn)(const struct md_gguf *g, uint32_t idx);

static struct md_gguf_str kv_name(const struct md_gguf *g, uint32_t idx)
{
	return g->kv[idx].key;
}

static struct md_gguf_str tensor_name(const struct md_gguf *g, uint32_t idx)
{
	return g->tensors[idx].name;
}

static uint64_t index_probe(const struct md_gguf *g, const uint32_t *slots, uint64_t mask,
			    name_of_fn name_of, const char *p, uint64_t len)
{
	uint64_t i = hash_bytes(p, len) & mask;

	while (slots[i] != 0 && !str_eq_bytes(name_of(g, slots[i] - 1), p, len))
		i = (i + 1) & mask;
	return i;
}

static size_t vtype_size(uint32_t t)
{
	switch (t) {
	case MD_GGUF_UINT8:
	case MD_GGUF_INT8:
	case MD_GGUF_BOOL:
		return 1;
	case MD_GGUF_UINT16:
	case MD_GGUF_INT16:
		return 2;
	case MD_GGUF_UINT32:
	case MD_GGUF_INT32:
	case MD_GGUF_FLOAT32:
		return 4;
	case MD_GGUF_UINT64:
	case MD_GGUF_INT64:
	case MD_GGUF_FLOAT64:
		return 8;
	default:
		return 0; /* STRING, ARRAY (variable) or unknown */
	}
}

static bool vtype_known(uint32_t t)
{
	return t <= MD_GGUF_FLOAT64;
}

/* Reads a u64-length string; desc names it in errors ("key #3", "tensor #7 name"). */
static int rd_str(struct cur *c, struct md_gguf_str *s, const char *desc, uint64_t idx)
{
	uint64_t len;

	if (!rd_u64(c, &len))
		return fail_trunc(c, "%s #%" PRIu64 " length", desc, idx);
	if (len > remaining(c))
		return fail(c, "%s #%" PRIu64 " length %" PRIu64 " at offset %" PRIu64
			    " runs past end of file (size %" PRIu64 ")", desc, idx, len, c->pos - 8,
			    c->size);
	s->len = len;
	s->ptr = (const char *)c->base + c->pos;
	c->pos += len;
	return 0;
}

/* Parses the value of kv (type already read): scalars, strings and arrays; string arrays get
 * their element offsets, relative to the first element, in kv->str_offs. */
static int parse_value(struct cur *c, struct md_gguf_kv *kv, uint64_t idx)
{
	char nb[SAFE_NAME_LEN];
	uint64_t start = c->pos;
	size_t esz;

	kv->data = c->base + c->pos;
	if (kv->type == MD_GGUF_STRING) {
		uint64_t len;

		if (!rd_u64(c, &len))
			return fail_trunc(c, "value length of key '%s' (#%" PRIu64 ")",
					  safe_name(nb, kv->key.ptr, kv->key.len), idx);
		if (len > remaining(c))
			return fail(c, "key '%s' (#%" PRIu64 ") string length %" PRIu64
				    " at offset %" PRIu64 " runs past end of file (size %" PRIu64 ")",
				    safe_name(nb, kv->key.ptr, kv->key.len), idx, len, start, c->size);
		c->pos += len;
		return 0;
	}
	if (kv->type != MD_GGUF_ARRAY) {
		esz = vtype_size(kv->type);
		if (remaining(c) < esz)
			return fail_trunc(c, "value of key '%s' (#%" PRIu64 ")",
					  safe_name(nb, kv->key.ptr, kv->key.len), idx);
		c->pos += esz;
		return 0;
	}

	uint32_t at;
	uint64_t n;

	if (!rd_u32(c, &at))
		return fail_trunc(c, "array type of key '%s' (#%" PRIu64 ")",
				  safe_name(nb, kv->key.ptr, kv->key.len), idx);
	if (at == MD_GGUF_ARRAY)
		return fail(c, "key '%s' (#%" PRIu64 ") at offset %" PRIu64
			    " is an array of arrays (nested arrays are not supported)",
			    safe_name(nb, kv->key.ptr, kv->key.len), idx, start);
	if (!vtype_known(at))
		return fail(c, "key '%s' (#%" PRIu64 ") has unknown array element type %" PRIu32
			    " at offset %" PRIu64, safe_name(nb, kv->key.ptr, kv->key.len), idx, at,
			    start);
	if (!rd_u64(c, &n))
		return fail_trunc(c, "array length of key '%s' (#%" PRIu64 ")",
				  safe_name(nb, kv->key.ptr, kv->key.len), idx);
	kv->arr_type = (enum md_gguf_vtype)at;
	kv->arr_n = n;
	kv->data = c->base + c->pos;

	/* Every element takes at least esz bytes (8 for a string's length). */
	esz = at == MD_GGUF_STRING ? 8 : vtype_size(at);
	if (n > remaining(c) / esz)
		return fail(c, "key '%s' (#%" PRIu64 ") array of %" PRIu64 " %s at offset %" PRIu64
			    " runs past end of file (size %" PRIu64 "; %zu bytes per element%s)",
			    safe_name(nb, kv->key.ptr, kv->key.len), idx, n,
			    md_gguf_vtype_name((enum md_gguf_vtype)at), start, c->size, esz,
			    at == MD_GGUF_STRING ? " at least" : "");
	if (at != MD_GGUF_STRING) {
		c->pos += n * esz;
		return 0;
	}

	/* n <= remaining / 8, so n + 1 entries cannot overflow the size computation. */
	uint64_t *offs = malloc((size_t)(n + 1) * sizeof(*offs));
	uint64_t arr0 = c->pos;

	if (!offs)
		return fail_nomem(c, n + 1, "string offsets");
	kv->str_offs = offs;
	for (uint64_t j = 0; j < n; j++) {
		uint64_t len;

		offs[j] = c->pos - arr0;
		if (!rd_u64(c, &len))
			return fail_trunc(c, "length of element %" PRIu64 " of key '%s' (#%" PRIu64
					  ")", j, safe_name(nb, kv->key.ptr, kv->key.len), idx);
		if (len > remaining(c))
			return fail(c, "element %" PRIu64 " of key '%s' (#%" PRIu64 "): string length %"
				    PRIu64 " at offset %" PRIu64 " runs past end of file (size %"
				    PRIu64 ")", j, safe_name(nb, kv->key.ptr, kv->key.len), idx, len,
				    c->pos - 8, c->size);
		c->pos += len;
	}
	offs[n] = c->pos - arr0;
	return 0;
}

/* Parses n keys; g->n_kv counts the entries initialised so far, so a failure part-way
 * leaves exactly those for release() to free. */
static int parse_kvs(struct cur *c, struct md_gguf *g, uint64_t n)
{
	uint64_t cap = 0;
	int r;

	if (index_new(n, &g->_kv_index, &g->_kv_index_mask) != 0)
		return fail_nomem(c, n, "key index slots");
	for (uint64_t i = 0; i < n; i++) {
		char nb[SAFE_NAME_LEN];
		struct md_gguf_kv *kv;
		uint64_t key_off = c->pos;
		uint32_t t;

		if (i == cap) {
			uint64_t ncap = cap ? cap * 2 : 64;
			struct md_gguf_kv *nkv;

			if (ncap > n)
				ncap = n;
			nkv = realloc(g->kv, (size_t)ncap * sizeof(*nkv));
			if (!nkv)
				return fail_nomem(c, ncap, "keys");
			g->kv = nkv;
			cap = ncap;
		}
		kv = &g->kv[i];
		memset(kv, 0, sizeof(*kv));
		g->n_kv = i + 1;

		r = rd_str(c, &kv->key, "key", i);
		if (r)
			return r;
		if (kv->key.len == 0)
			return fail(c, "key #%" PRIu64 " at offset %" PRIu64 " is empty", i, key_off);

		uint64_t slot = index_probe(g, g->_kv_index, g->_kv_index_mask, kv_name,
					    kv->key.ptr, kv->key.len);
		if (g->_kv_index[slot] != 0)
			return fail(c, "duplicate key '%s' (#%" PRIu64 " at offset %" PRIu64
				    ", first seen as #%" PRIu32 ")",
				    safe_name(nb, kv->key.ptr, kv->key.len), i, key_off,
				    g->_kv_index[slot] - 1);

		if (!rd_u32(c, &t))
			return fail_trunc(c, "type of key '%s' (#%" PRIu64 ")",
					  safe_name(nb, kv->key.ptr, kv->key.len), i);
		if (!vtype_known(t))
			return fail(c, "key '%s' (#%" PRIu64 ") has unknown value type %" PRIu32
				    " at offset %" PRIu64, safe_name(nb, kv->key.ptr, kv->key.len), i,
				    t, c->pos - 4);
		kv->type = (enum md_gguf_vtype)t;
		r = parse_value(c, kv, i);
		if (r)
			return r;
		g->_kv_index[slot] = (uint32_t)(i + 1);
	}
	return 0;
}

static int parse_alignment(struct cur *c, struct md_gguf *g)
{
	int64_t i = md_gguf_find_key(g, "general.alignment");
	uint32_t a;

	g->alignment = MD_GGUF_DEFAULT_ALIGNMENT;
	if (i < 0)
		return 0;
	if (g->kv[i].type != MD_GGUF_UINT32)
		return fail(c, "key 'general.alignment' has type %s, expected u32",
			    md_gguf_vtype_name(g->kv[i].type));
	memcpy(&a, g->kv[i].data, 4);
	if (a == 0 || (a & (a - 1)) != 0)
		return fail(c, "general.alignment %" PRIu32 " is not a power of two", a);
	g->alignment = a;
	return 0;
}

static int parse_tensor_info(struct cur *c, struct md_gguf *g, uint64_t i)
{
	struct md_gguf_tensor *t = &g->tensors[i];
	char nb[SAFE_NAME_LEN];
	const struct md_dtype_info *info;
	uint64_t name_off = c->pos;
	uint32_t n_dims, type;
	int r;

	r = rd_str(c, &t->name, "tensor", i);
	if (r)
		return r;
	if (t->name.len == 0)
		return fail(c, "tensor #%" PRIu64 " at offset %" PRIu64 " has an empty name", i,
			    name_off);
	safe_name(nb, t->name.ptr, t->name.len);

	if (!rd_u32(c, &n_dims))
		return fail_trunc(c, "n_dims of tensor '%s' (#%" PRIu64 ")", nb, i);
	if (n_dims < 1 || n_dims > MD_GGUF_MAX_DIMS)
		return fail(c, "tensor '%s' has n_dims %" PRIu32 " at offset %" PRIu64
			    " (must be 1..%d)", nb, n_dims, c->pos - 4, MD_GGUF_MAX_DIMS);
	t->n_dims = n_dims;
	for (uint32_t d = 0; d < MD_GGUF_MAX_DIMS; d++)
		t->ne[d] = 1;
	for (uint32_t d = 0; d < n_dims; d++) {
		uint64_t v;

		if (!rd_u64(c, &v))
			return fail_trunc(c, "ne[%" PRIu32 "] of tensor '%s' (#%" PRIu64 ")", d, nb,
					  i);
		if (v == 0 || v > (uint64_t)INT64_MAX)
			return fail(c, "tensor '%s' ne[%" PRIu32 "] = %" PRIu64 " at offset %" PRIu64
				    " is not a positive int64", nb, d, v, c->pos - 8);
		t->ne[d] = (int64_t)v;
	}
	if (!rd_u32(c, &type))
		return fail_trunc(c, "type of tensor '%s' (#%" PRIu64 ")", nb, i);
	if (!rd_u64(c, &t->offset))
		return fail_trunc(c, "offset of tensor '%s' (#%" PRIu64 ")", nb, i);
	t->type = type;

	info = md_dtype_info(type);
	if (!info || info->blck <= 0 || info->type_size == 0)
		return fail(c, "tensor '%s' has unknown type %" PRIu32, nb, type);

	int64_t nel = 1;

	for (uint32_t d = 0; d < n_dims; d++) {
		if (t->ne[d] > INT64_MAX / nel)
			return fail(c, "tensor '%s' element count overflows (ne = [%" PRId64 ", %"
				    PRId64 ", %" PRId64 ", %" PRId64 "])", nb, t->ne[0], t->ne[1],
				    t->ne[2], t->ne[3]);
		nel *= t->ne[d];
	}
	if (t->ne[0] % info->blck != 0)
		return fail(c, "tensor '%s' ne[0] = %" PRId64 " is not a multiple of the %s block "
			    "size %" PRId64, nb, t->ne[0], info->name ? info->name : "?", info->blck);
	uint64_t nblocks = (uint64_t)(nel / info->blck);
	if (nblocks > UINT64_MAX / info->type_size)
		return fail(c, "tensor '%s' byte size overflows (%" PRIu64 " blocks of %zu bytes)",
			    nb, nblocks, info->type_size);
	t->nbytes = nblocks * info->type_size;
	return 0;
}

static int parse_tensors(struct cur *c, struct md_gguf *g, uint64_t n)
{
	uint64_t cap = 0;
	int r;

	if (index_new(n, &g->_tensor_index, &g->_tensor_index_mask) != 0)
		return fail_nomem(c, n, "tensor index slots");
	for (uint64_t i = 0; i < n; i++) {
		char nb[SAFE_NAME_LEN];
		uint64_t name_off = c->pos;

		if (i == cap) {
			uint64_t ncap = cap ? cap * 2 : 256;
			struct md_gguf_tensor *nt;

			if (ncap > n)
				ncap = n;
			nt = realloc(g->tensors, (size_t)ncap * sizeof(*nt));
			if (!nt)
				return fail_nomem(c, ncap, "tensors");
			g->tensors = nt;
			cap = ncap;
		}
		memset(&g->tensors[i], 0, sizeof(g->tensors[i]));
		g->n_tensors = i + 1;
		r = parse_tensor_info(c, g, i);
		if (r)
			return r;

		struct md_gguf_tensor *t = &g->tensors[i];
		uint64_t slot = index_probe(g, g->_tensor_index, g->_tensor_index_mask,
					    tensor_name, t->name.ptr, t->name.len);
		if (g->_tensor_index[slot] != 0)
			return fail(c, "duplicate tensor name '%s' (#%" PRIu64 " at offset %" PRIu64
				    ", first seen as #%" PRIu32 ")",
				    safe_name(nb, t->name.ptr, t->name.len), i, name_off,
				    g->_tensor_index[slot] - 1);
		g->_tensor_index[slot] = (uint32_t)(i + 1);
	}
	return 0;
}

/* Places the data section and checks every tensor's bytes lie inside the file. */
static int place_data(struct cur *c, struct md_gguf *g)
{
	uint64_t pad = (g->alignment - c->pos % g->alignment) % g->alignment;

	g->data_offset = c->pos + pad; /* pos <= size < 2^63 and pad < 2^32: no overflow */
	if (g->n_tensors == 0 && g->data_offset > c->size)
		g->data_offset = c->size; /* no data section: writers may omit the padding */
	for (uint64_t i = 0; i < g->n_tensors; i++) {
		struct md_gguf_tensor *t = &g->tensors[i];
		char nb[SAFE_NAME_LEN];

		safe_name(nb, t->name.ptr, t->name.len);
		if (t->offset % g->alignment != 0)
			return fail(c, "tensor '%s' offset %" PRIu64 " is not a multiple of the "
				    "alignment %" PRIu64, nb, t->offset, g->alignment);
		if (g->data_offset > c->size || t->offset > c->size - g->data_offset ||
		    t->nbytes > c->size - g->data_offset - t->offset) {
			uint64_t start = g->data_offset + t->offset; /* may wrap: printed as is */

			if (t->offset > UINT64_MAX - g->data_offset ||
			    t->nbytes > UINT64_MAX - start)
				return fail(c, "tensor '%s' data at relative offset %" PRIu64
					    " (%" PRIu64 " bytes) extends past end of file (size %"
					    PRIu64 ")", nb, t->offset, t->nbytes, c->size);
			return fail(c, "tensor '%s' data [%" PRIu64 ", %" PRIu64 ") extends past end "
				    "of file (size %" PRIu64 ")", nb, start, start + t->nbytes,
				    c->size);
		}
		t->data = c->base + g->data_offset + t->offset;
	}
	return 0;
}

static int parse(struct md_gguf *g, char *err, size_t errlen)
{
	struct cur c = { .base = g->base, .size = g->size, .err = err, .errlen = errlen };
	uint64_t n_kv, n_tensors;
	uint32_t version;
	int r;

	if (remaining(&c) < 4)
		return fail_trunc(&c, "magic");
	if (memcmp(c.base, "GGUF", 4) != 0) {
		char nb[SAFE_NAME_LEN];

		return fail(&c, "bad magic '%s' at offset 0 (not a GGUF file)",
			    safe_name(nb, (const char *)c.base, 4));
	}
	c.pos = 4;
	if (!rd_u32(&c, &version))
		return fail_trunc(&c, "version");
	if (version == 1)
		return fail(&c, "version 1 is not supported (GGUF v1 files must be re-converted "
			    "to v2 or v3)");
	if (version != 2 && version != 3) {
		uint32_t sw = __builtin_bswap32(version);

		if (sw >= 1 && sw <= 3)
			return fail(&c, "big-endian GGUF file (version field 0x%08" PRIx32
				    ") is not supported", version);
		return fail(&c, "unsupported version %" PRIu32 " (expected 2 or 3)", version);
	}
	g->version = version;
	if (!rd_u64(&c, &n_tensors))
		return fail_trunc(&c, "tensor count");
	if (!rd_u64(&c, &n_kv))
		return fail_trunc(&c, "key count");
	if (n_kv > GGUF_MAX_ENTRIES)
		return fail(&c, "n_kv %" PRIu64 " at offset 16 exceeds the limit of %" PRIu64,
			    n_kv, GGUF_MAX_ENTRIES);
	if (n_tensors > GGUF_MAX_ENTRIES)
		return fail(&c, "n_tensors %" PRIu64 " at offset 8 exceeds the limit of %" PRIu64,
			    n_tensors, GGUF_MAX_ENTRIES);
	/* Both limits are < 2^24, so the products below cannot overflow. */
	if (n_kv * KV_MIN_BYTES + n_tensors * TENSOR_MIN_BYTES > remaining(&c))
		return fail(&c, "%" PRIu64 " keys and %" PRIu64 " tensors (offsets 16 and 8) run "
			    "past end of file (size %" PRIu64 "; each key takes at least %d bytes, "
			    "each tensor info %d)", n_kv, n_tensors, c.size, KV_MIN_BYTES,
			    TENSOR_MIN_BYTES);

	r = parse_kvs(&c, g, n_kv);
	if (r)
		return r;
	r = parse_alignment(&c, g);
	if (r)
		return r;
	r = parse_tensors(&c, g, n_tensors);
	if (r)
		return r;
	return place_data(&c, g);
}

static void release(struct md_gguf *g)
{
	if (g->kv) {
		for (uint64_t i = 0; i < g->n_kv; i++)
			free((void *)g->kv[i].str_offs);
	}
	free(g->kv);
	free(g->tensors);
	free(g->_kv_index);
	free(g->_tensor_index);
	if (g->_mapped && g->base)
		munmap((void *)g->base, g->size);
	if (g->_fd >= 0)
		close(g->_fd);
	memset(g, 0, sizeof(*g));
	g->_fd = -1;
}

static void clear_err(char *err, size_t errlen)
{
	if (err && errlen)
		err[0] = '\0';
}

int md_gguf_open_mem(struct md_gguf *g, const void *buf, size_t len, char *err, size_t errlen)
{
	int r;

	memset(g, 0, sizeof(*g));
	g->_fd = -1;
	clear_err(err, errlen);
	if (!buf && len)
		return -EINVAL;
	g->base = buf ? buf : (const uint8_t *)"";
	g->size = len;
	r = parse(g, err, errlen);
	if (r)
		release(g);
	return r;
}

int md_gguf_open(struct md_gguf *g, const char *path, char *err, size_t errlen)
{
	struct stat st;
	void *map;
	int fd, r;

	memset(g, 0, sizeof(*g));
	g->_fd = -1;
	clear_err(err, errlen);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		r = -errno;
		if (err && errlen)
			snprintf(err, errlen, "gguf: cannot open '%s': %s", path, strerror(-r));
		return r;
	}
	if (fstat(fd, &st) != 0) {
		r = -errno;
		if (err && errlen)
			snprintf(err, errlen, "gguf: cannot stat '%s': %s", path, strerror(-r));
		close(fd);
		return r;
	}
	if (!S_ISREG(st.st_mode)) {
		if (err && errlen)
			snprintf(err, errlen, "gguf: '%s' is not a regular file", path);
		close(fd);
		return -EINVAL;
	}
	if (st.st_size == 0) {
		/* mmap cannot map 0 bytes; parse the empty buffer for the usual message. */
		close(fd);
		return md_gguf_open_mem(g, NULL, 0, err, errlen);
	}
	map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
	if (map == MAP_FAILED) {
		r = -errno;
		if (err && errlen)
			snprintf(err, errlen, "gguf: cannot mmap '%s': %s", path, strerror(-r));
		close(fd);
		return r;
	}
	/* The weights are read front to back at load and then at random per expert: ask for
	 * read-ahead now, and for 2 MiB page-cache folios mapped with 2 MiB entries where the
	 * kernel can (fewer TLB misses while decode streams the weights; llama.cpp gets the same
	 * once the cache holds such folios). Hints; failure is harmless. */
#ifdef MADV_HUGEPAGE
	(void)madvise(map, (size_t)st.st_size, MADV_HUGEPAGE);
#endif
	(void)madvise(map, (size_t)st.st_size, MADV_WILLNEED);
	g->base = map;
	g->size = (size_t)st.st_size;
	g->_mapped = true;
	g->_fd = fd;
	r = parse(g, err, errlen);
	if (r)
		release(g);
	return r;
}

void md_gguf_close(struct md_gguf *g)
{
	release(g);
}

int64_t md_gguf_find_key(const struct md_gguf *g, const char *key)
{
	uint64_t len = strlen(key), slot;

	if (!g->_kv_index)
		return -1;
	slot = index_probe(g, g->_kv_index, g->_kv_index_mask, kv_name, key, len);
	return g->_kv_index[slot] ? (int64_t)g->_kv_index[slot] - 1 : -1;
}

const struct md_gguf_tensor *md_gguf_find_tensor(const struct md_gguf *g, const char *name)
{
	uint64_t len = strlen(name), slot;

	if (!g->_tensor_index)
		return NULL;
	slot = index_probe(g, g->_tensor_index, g->_tensor_index_mask, tensor_name, name, len);
	return g->_tensor_index[slot] ? &g->tensors[g->_tensor_index[slot] - 1] : NULL;
}

/* An integer value of type t at p: *u for unsigned types, *s for signed ones. */
struct ival {
	bool is_signed;
	int64_t s;
	uint64_t u;
};

static bool read_int(enum md_gguf_vtype t, const uint8_t *p, struct ival *v)
{
	v->is_signed = false;
	v->s = 0;
	v->u = 0;
	switch (t) {
	case MD_GGUF_UINT8:
		v->u = p[0];
		return true;
	case MD_GGUF_UINT16: {
		uint16_t x;
		memcpy(&x, p, 2);
		v->u = x;
		return true;
	}
	case MD_GGUF_UINT32: {
		uint32_t x;
		memcpy(&x, p, 4);
		v->u = x;
		return true;
	}
	case MD_GGUF_UINT64:
		memcpy(&v->u, p, 8);
		return true;
	case MD_GGUF_INT8:
		v->is_signed = true;
		v->s = (int8_t)p[0];
		return true;
	case MD_GGUF_INT16: {
		int16_t x;
		memcpy(&x, p, 2);
		v->is_signed = true;
		v->s = x;
		return true;
	}
	case MD_GGUF_INT32: {
		int32_t x;
		memcpy(&x, p, 4);
		v->is_signed = true;
		v->s = x;
		return true;
	}
	case MD_GGUF_INT64:
		memcpy(&v->s, p, 8);
		v->is_signed = true;
		return true;
	default:
		return false;
	}
}

/* Value as u64 when it is a non-negative integer. */
static bool read_u64(enum md_gguf_vtype t, const uint8_t *p, uint64_t *out)
{
	struct ival v;

	if (!read_int(t, p, &v))
		return false;
	if (v.is_signed) {
		if (v.s < 0)
			return false;
		*out = (uint64_t)v.s;
	} else {
		*out = v.u;
	}
	return true;
}

static bool read_f32(enum md_gguf_vtype t, const uint8_t *p, float *out)
{
	struct ival v;

	if (t == MD_GGUF_FLOAT32) {
		memcpy(out, p, 4);
		return true;
	}
	if (t == MD_GGUF_FLOAT64) {
		double d;

		memcpy(&d, p, 8);
		*out = (float)d;
		return true;
	}
	if (!read_int(t, p, &v))
		return false;
	*out = v.is_signed ? (float)v.s : (float)v.u;
	return true;
}

static const struct md_gguf_kv *kv_get(const struct md_gguf *g, const char *key)
{
	int64_t i = md_gguf_find_key(g, key);

	return i < 0 ? NULL : &g->kv[i];
}

bool md_gguf_get_u64(const struct md_gguf *g, const char *key, uint64_t *out)
{
	const struct md_gguf_kv *kv = kv_get(g, key);

	return kv && read_u64(kv->type, kv->data, out);
}

bool md_gguf_get_u32(const struct md_gguf *g, const char *key, uint32_t *out)
{
	uint64_t v;

	if (!md_gguf_get_u64(g, key, &v) || v > UINT32_MAX)
		return false;
	*out = (uint32_t)v;
	return true;
}

bool md_gguf_get_f32(const struct md_gguf *g, const char *key, float *out)
{
	const struct md_gguf_kv *kv = kv_get(g, key);

	return kv && read_f32(kv->type, kv->data, out);
}

bool md_gguf_get_bool(const struct md_gguf *g, const char *key, bool *out)
{
	const struct md_gguf_kv *kv = kv_get(g, key);

	if (!kv || kv->type != MD_GGUF_BOOL)
		return false;
	*out = kv->data[0] != 0;
	return true;
}

bool md_gguf_get_str(const struct md_gguf *g, const char *key, struct md_gguf_str *out)
{
	const struct md_gguf_kv *kv = kv_get(g, key);

	if (!kv || kv->type != MD_GGUF_STRING)
		return false;
	memcpy(&out->len, kv->data, 8);
	out->ptr = (const char *)kv->data + 8;
	return true;
}

bool md_gguf_arr_str(const struct md_gguf_kv *kv, uint64_t i, struct md_gguf_str *out)
{
	if (kv->type != MD_GGUF_ARRAY || kv->arr_type != MD_GGUF_STRING || i >= kv->arr_n ||
	    !kv->str_offs)
		return false;
	out->len = kv->str_offs[i + 1] - kv->str_offs[i] - 8;
	out->ptr = (const char *)kv->data + kv->str_offs[i] + 8;
	return true;
}

bool md_gguf_arr_f32(const struct md_gguf_kv *kv, uint64_t i, float *out)
{
	if (kv->type != MD_GGUF_ARRAY || i >= kv->arr_n || vtype_size(kv->arr_type) == 0 ||
	    kv->arr_type == MD_GGUF_BOOL)
		return false;
	return read_f32(kv->arr_type, kv->data + i * vtype_size(kv->arr_type), out);
}

bool md_gguf_arr_i64(const struct md_gguf_kv *kv, uint64_t i, int64_t *out)
{
	struct ival v;

	if (kv->type != MD_GGUF_ARRAY || i >= kv->arr_n || vtype_size(kv->arr_type) == 0)
		return false;
	if (!read_int(kv->arr_type, kv->data + i * vtype_size(kv->arr_type), &v))
		return false;
	if (v.is_signed) {
		*out = v.s;
		return true;
	}
	if (v.u > (uint64_t)INT64_MAX)
		return false;
	*out = (int64_t)v.u;
	return true;
}

const char *md_gguf_vtype_name(enum md_gguf_vtype t)
{
	static const char *const names[] = {
		[MD_GGUF_UINT8] = "u8",	     [MD_GGUF_INT8] = "i8",	[MD_GGUF_UINT16] = "u16",
		[MD_GGUF_INT16] = "i16",     [MD_GGUF_UINT32] = "u32",	[MD_GGUF_INT32] = "i32",
		[MD_GGUF_FLOAT32] = "f32",   [MD_GGUF_BOOL] = "bool",	[MD_GGUF_STRING] = "string",
		[MD_GGUF_ARRAY] = "array",   [MD_GGUF_UINT64] = "u64",	[MD_GGUF_INT64] = "i64",
		[MD_GGUF_FLOAT64] = "f64",
	};

	if ((unsigned)t >= sizeof(names) / sizeof(names[0]))
		return "unknown";
	return names[t];
}

bool md_gguf_str_eq(struct md_gguf_str s, const char *c)
{
	return str_eq_bytes(s, c, strlen(c));
}
