/* GGUF v3 writer: keeps metadata serialized in memory and streams tensor data at write time. */
#include "tools/gguf_writer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/gguf.h"
#include "engine/quant.h"

#define GGUF_MAGIC "GGUF"
#define GGUF_VERSION 3u

/* One metadata pair. The value is kept exactly as it will appear in the file after the
 * type field, so every value type (nested arrays excepted) is handled by the same code. */
struct wkv {
	char *key;        /* owned, NUL-terminated */
	uint32_t type;    /* enum md_gguf_vtype */
	uint8_t *val;     /* owned: serialized value (little-endian, as in the file) */
	size_t val_len;
};

struct wtensor {
	char *name;       /* owned */
	uint32_t type;    /* enum md_dtype */
	uint32_t n_dims;
	int64_t ne[MD_GGUF_MAX_DIMS];
	uint64_t nbytes;
	uint64_t offset;  /* relative to the data section; set by md_gguf_writer_write */
	md_gguf_fill_cb fill;
	void *ctx;        /* borrowed: the caller's, until md_gguf_writer_write returns */
};

struct md_gguf_writer {
	struct wkv *kv;   /* owned (n_kv, capacity cap_kv) */
	size_t n_kv, cap_kv;
	struct wtensor *t; /* owned (n_t, capacity cap_t) */
	size_t n_t, cap_t;
	int err;          /* sticky: first allocation failure of a void setter (-ENOMEM) */
};

/* A growable byte buffer used to serialize one value. */
struct wbuf {
	uint8_t *p;       /* owned */
	size_t len, cap;
	bool oom;
};

static void wb_put(struct wbuf *b, const void *src, size_t n)
{
	if (b->oom)
		return;
	if (b->len + n > b->cap) {
		size_t cap = b->cap ? b->cap : 64;
		while (cap < b->len + n)
			cap *= 2;
		uint8_t *p = realloc(b->p, cap);
		if (!p) {
			b->oom = true;
			return;
		}
		b->p = p;
		b->cap = cap;
	}
	if (n == 0)
		return;
	memcpy(b->p + b->len, src, n);
	b->len += n;
}

static void wb_u32(struct wbuf *b, uint32_t v) { wb_put(b, &v, 4); }
static void wb_u64(struct wbuf *b, uint64_t v) { wb_put(b, &v, 8); }

static void wb_str(struct wbuf *b, const char *s, size_t len)
{
	wb_u64(b, len);
	wb_put(b, s, len);
}

/* Byte size of a scalar value type, 0 for string/array. */
static size_t vtype_size(uint32_t t)
{
	switch (t) {
	case MD_GGUF_UINT8: case MD_GGUF_INT8: case MD_GGUF_BOOL: return 1;
	case MD_GGUF_UINT16: case MD_GGUF_INT16: return 2;
	case MD_GGUF_UINT32: case MD_GGUF_INT32: case MD_GGUF_FLOAT32: return 4;
	case MD_GGUF_UINT64: case MD_GGUF_INT64: case MD_GGUF_FLOAT64: return 8;
	default: return 0;
	}
}

struct md_gguf_writer *md_gguf_writer_new(void)
{
	return calloc(1, sizeof(struct md_gguf_writer));
}

void md_gguf_writer_free(struct md_gguf_writer *w)
{
	if (!w)
		return;
	for (size_t i = 0; i < w->n_kv; i++) {
		free(w->kv[i].key);
		free(w->kv[i].val);
	}
	for (size_t i = 0; i < w->n_t; i++)
		free(w->t[i].name);
	free(w->kv);
	free(w->t);
	free(w);
}

/* Store key = (type, serialized value), taking ownership of b's buffer in every case.
 * Replaces an existing key in place so the original order is kept. */
static void set_kv(struct md_gguf_writer *w, const char *key, uint32_t type, struct wbuf *b)
{
	if (b->oom || w->err) {
		free(b->p);
		w->err = -ENOMEM;
		return;
	}
	for (size_t i = 0; i < w->n_kv; i++) {
		if (strcmp(w->kv[i].key, key) == 0) {
			free(w->kv[i].val);
			w->kv[i].type = type;
			w->kv[i].val = b->p;
			w->kv[i].val_len = b->len;
			return;
		}
	}
	if (w->n_kv == w->cap_kv) {
		size_t cap = w->cap_kv ? w->cap_kv * 2 : 32;
		struct wkv *kv = realloc(w->kv, cap * sizeof(*kv));
		if (!kv) {
			free(b->p);
			w->err = -ENOMEM;
			return;
		}
		w->kv = kv;
		w->cap_kv = cap;
	}
	char *k = strdup(key);
	if (!k) {
		free(b->p);
		w->err = -ENOMEM;
		return;
	}
	w->kv[w->n_kv++] = (struct wkv){ .key = k, .type = type, .val = b->p, .val_len = b->len };
}

/* Scalar of any fixed-size type; v points at its little-endian bytes. */
static void set_scalar(struct md_gguf_writer *w, const char *key, uint32_t type, const void *v)
{
	struct wbuf b = { 0 };
	wb_put(&b, v, vtype_size(type));
	set_kv(w, key, type, &b);
}

/* Array of n fixed-size elements of type et, contiguous at v. */
static void set_arr_raw(struct md_gguf_writer *w, const char *key, uint32_t et, const void *v,
			uint64_t n)
{
	struct wbuf b = { 0 };
	wb_u32(&b, et);
	wb_u64(&b, n);
	wb_put(&b, v, vtype_size(et) * n);
	set_kv(w, key, MD_GGUF_ARRAY, &b);
}

void md_gguf_w_u32(struct md_gguf_writer *w, const char *key, uint32_t v)
{
	set_scalar(w, key, MD_GGUF_UINT32, &v);
}

void md_gguf_w_i32(struct md_gguf_writer *w, const char *key, int32_t v)
{
	set_scalar(w, key, MD_GGUF_INT32, &v);
}

void md_gguf_w_u64(struct md_gguf_writer *w, const char *key, uint64_t v)
{
	set_scalar(w, key, MD_GGUF_UINT64, &v);
}

void md_gguf_w_f32(struct md_gguf_writer *w, const char *key, float v)
{
	set_scalar(w, key, MD_GGUF_FLOAT32, &v);
}

void md_gguf_w_bool(struct md_gguf_writer *w, const char *key, bool v)
{
	uint8_t u = v ? 1 : 0;
	set_scalar(w, key, MD_GGUF_BOOL, &u);
}

void md_gguf_w_str_n(struct md_gguf_writer *w, const char *key, const char *v, size_t len)
{
	struct wbuf b = { 0 };
	wb_str(&b, v, len);
	set_kv(w, key, MD_GGUF_STRING, &b);
}

void md_gguf_w_str(struct md_gguf_writer *w, const char *key, const char *v)
{
	md_gguf_w_str_n(w, key, v, strlen(v));
}

void md_gguf_w_arr_str(struct md_gguf_writer *w, const char *key, const char *const *v,
		       const size_t *lens, uint64_t n)
{
	struct wbuf b = { 0 };
	wb_u32(&b, MD_GGUF_STRING);
	wb_u64(&b, n);
	for (uint64_t i = 0; i < n; i++)
		wb_str(&b, v[i], lens ? lens[i] : strlen(v[i]));
	set_kv(w, key, MD_GGUF_ARRAY, &b);
}

void md_gguf_w_arr_i32(struct md_gguf_writer *w, const char *key, const int32_t *v, uint64_t n)
{
	set_arr_raw(w, key, MD_GGUF_INT32, v, n);
}

void md_gguf_w_arr_f32(struct md_gguf_writer *w, const char *key, const float *v, uint64_t n)
{
	set_arr_raw(w, key, MD_GGUF_FLOAT32, v, n);
}

int md_gguf_w_tensor(struct md_gguf_writer *w, const char *name, uint32_t type,
		     uint32_t n_dims, const int64_t *ne, md_gguf_fill_cb fill, void *ctx)
{
	const struct md_dtype_info *ti = md_dtype_info(type);
	if (!ti || !fill || n_dims < 1 || n_dims > MD_GGUF_MAX_DIMS)
		return -EINVAL;
	for (size_t i = 0; i < w->n_t; i++)
		if (strcmp(w->t[i].name, name) == 0)
			return -EINVAL;
	struct wtensor t = { .type = type, .n_dims = n_dims, .fill = fill, .ctx = ctx };
	uint64_t rows = 1;
	for (uint32_t d = 0; d < MD_GGUF_MAX_DIMS; d++) {
		t.ne[d] = d < n_dims ? ne[d] : 1;
		if (t.ne[d] < 1 || t.ne[d] > (INT64_C(1) << 40))
			return -EINVAL;
		if (d > 0)
			rows *= (uint64_t)t.ne[d];
	}
	size_t row = md_dtype_row_size((enum md_dtype)type, t.ne[0]);
	if (row == 0 || rows > (UINT64_C(1) << 40) / row)
		return -EINVAL;
	t.nbytes = row * rows;
	if (w->n_t == w->cap_t) {
		size_t cap = w->cap_t ? w->cap_t * 2 : 64;
		struct wtensor *nt = realloc(w->t, cap * sizeof(*nt));
		if (!nt)
			return -ENOMEM;
		w->t = nt;
		w->cap_t = cap;
	}
	t.name = strdup(name);
	if (!t.name)
		return -ENOMEM;
	w->t[w->n_t++] = t;
	return 0;
}

/* Copy one key of src whose NUL-terminated name is key. Strings go through the reader's
 * accessors; fixed-size values are copied byte for byte from the map. */
static void copy_one(struct md_gguf_writer *w, const struct md_gguf *src,
		     const struct md_gguf_kv *kv, const char *key)
{
	struct wbuf b = { 0 };
	if (kv->type == MD_GGUF_STRING) {
		struct md_gguf_str s = { 0 };
		if (!md_gguf_get_str(src, key, &s))
			return;
		wb_str(&b, s.ptr, s.len);
	} else if (kv->type == MD_GGUF_ARRAY) {
		wb_u32(&b, kv->arr_type);
		wb_u64(&b, kv->arr_n);
		if (kv->arr_type == MD_GGUF_STRING) {
			for (uint64_t i = 0; i < kv->arr_n; i++) {
				struct md_gguf_str s = { 0 };
				md_gguf_arr_str(kv, i, &s);
				wb_str(&b, s.ptr, s.len);
			}
		} else {
			size_t es = vtype_size(kv->arr_type);
			if (es == 0) { /* nested arrays: not produced by any converter; skip */
				free(b.p);
				return;
			}
			wb_put(&b, kv->data, es * kv->arr_n);
		}
	} else {
		size_t es = vtype_size(kv->type);
		if (es == 0) {
			free(b.p);
			return;
		}
		wb_put(&b, kv->data, es);
	}
	set_kv(w, key, kv->type, &b);
}

void md_gguf_w_copy_kv_prefix(struct md_gguf_writer *w, const struct md_gguf *src,
			      const char *prefix)
{
	size_t plen = prefix ? strlen(prefix) : 0;
	for (uint64_t i = 0; i < src->n_kv; i++) {
		const struct md_gguf_kv *kv = &src->kv[i];
		if (kv->key.len < plen || (plen && memcmp(kv->key.ptr, prefix, plen) != 0))
			continue;
		char *key = strndup(kv->key.ptr, kv->key.len);
		if (!key) {
			w->err = -ENOMEM;
			return;
		}
		copy_one(w, src, kv, key);
		free(key);
	}
}

void md_gguf_w_copy_kv(struct md_gguf_writer *w, const struct md_gguf *src)
{
	md_gguf_w_copy_kv_prefix(w, src, NULL);
}

/* Alignment from general.alignment when set to a usable power of two, else 32. */
static uint64_t writer_alignment(const struct md_gguf_writer *w)
{
	for (size_t i = 0; i < w->n_kv; i++) {
		const struct wkv *kv = &w->kv[i];
		if (strcmp(kv->key, "general.alignment") != 0)
			continue;
		uint64_t a = 0;
		size_t es = vtype_size(kv->type);
		if (kv->type == MD_GGUF_FLOAT32 || kv->type == MD_GGUF_FLOAT64 ||
		    kv->type == MD_GGUF_BOOL || es == 0)
			break;
		memcpy(&a, kv->val, es); /* little-endian host */
		if (a >= 1 && a <= (1u << 20) && (a & (a - 1)) == 0)
			return a;
		break;
	}
	return MD_GGUF_DEFAULT_ALIGNMENT;
}

static int put(FILE *f, const void *p, size_t n)
{
	return fwrite(p, 1, n, f) == n ? 0 : -EIO;
}

static int pad_to(FILE *f, uint64_t pos, uint64_t align)
{
	static const uint8_t zeros[64];
	uint64_t n = (align - pos % align) % align;
	while (n > 0) {
		size_t k = n > sizeof(zeros) ? sizeof(zeros) : (size_t)n;
		if (put(f, zeros, k))
			return -EIO;
		n -= k;
	}
	return 0;
}

int md_gguf_writer_write(struct md_gguf_writer *w, const char *path, char *err, size_t errlen)
{
	int rc = 0;
	FILE *f = NULL;
	uint8_t *buf = NULL;
	char *tmp = NULL;
	struct wbuf hdr = { 0 };

	if (errlen)
		err[0] = '\0';
	if (w->err) {
		snprintf(err, errlen, "out of memory while building metadata");
		return w->err;
	}
	uint64_t align = writer_alignment(w);

	/* Header, metadata and tensor infos are serialized in memory first (small). */
	wb_put(&hdr, GGUF_MAGIC, 4);
	wb_u32(&hdr, GGUF_VERSION);
	wb_u64(&hdr, w->n_t);
	wb_u64(&hdr, w->n_kv);
	for (size_t i = 0; i < w->n_kv; i++) {
		wb_str(&hdr, w->kv[i].key, strlen(w->kv[i].key));
		wb_u32(&hdr, w->kv[i].type);
		wb_put(&hdr, w->kv[i].val, w->kv[i].val_len);
	}
	uint64_t off = 0, max_bytes = 0;
	for (size_t i = 0; i < w->n_t; i++) {
		struct wtensor *t = &w->t[i];
		t->offset = off;
		off += (t->nbytes + align - 1) / align * align;
		if (t->nbytes > max_bytes)
			max_bytes = t->nbytes;
		wb_str(&hdr, t->name, strlen(t->name));
		wb_u32(&hdr, t->n_dims);
		for (uint32_t d = 0; d < t->n_dims; d++)
			wb_u64(&hdr, (uint64_t)t->ne[d]);
		wb_u32(&hdr, t->type);
		wb_u64(&hdr, t->offset);
	}
	if (hdr.oom) {
		snprintf(err, errlen, "out of memory serializing the header");
		rc = -ENOMEM;
		goto out_hdr;
	}

	/* Write to a temporary name and rename, so a failed run leaves no half file. */
	size_t plen = strlen(path);
	tmp = malloc(plen + 16);
	if (!tmp) {
		rc = -ENOMEM;
		snprintf(err, errlen, "out of memory");
		goto out_hdr;
	}
	snprintf(tmp, plen + 16, "%s.tmp%ld", path, (long)getpid() % 100000);
	f = fopen(tmp, "wb");
	if (!f) {
		rc = -errno;
		snprintf(err, errlen, "cannot create '%s': %s", tmp, strerror(errno));
		goto out_tmp;
	}
	setvbuf(f, NULL, _IOFBF, 1 << 20);
	errno = 0; /* io_error reports errno when stdio sets it, else EIO */
	if (put(f, hdr.p, hdr.len) || pad_to(f, hdr.len, align))
		goto io_error;

	/* One buffer sized for the largest tensor: memory is bounded by one tensor. */
	if (max_bytes > 0) {
		buf = malloc(max_bytes);
		if (!buf) {
			rc = -ENOMEM;
			snprintf(err, errlen, "cannot allocate %llu bytes for tensor data",
				 (unsigned long long)max_bytes);
			goto out_file;
		}
	}
	for (size_t i = 0; i < w->n_t; i++) {
		struct wtensor *t = &w->t[i];
		int frc = t->fill(t->ctx, buf, t->nbytes);
		if (frc) {
			rc = frc < 0 ? frc : -EIO;
			snprintf(err, errlen, "cannot produce data of tensor '%s': %s", t->name,
				 strerror(-rc));
			goto out_file;
		}
		if (put(f, buf, t->nbytes) || pad_to(f, t->nbytes, align))
			goto io_error;
	}
	if (fflush(f) != 0)
		goto io_error;
	if (fclose(f) != 0) {
		f = NULL;
		goto io_error;
	}
	f = NULL;
	if (rename(tmp, path) != 0) {
		rc = -errno;
		snprintf(err, errlen, "cannot rename '%s' to '%s': %s", tmp, path, strerror(errno));
		unlink(tmp);
	}
	goto out_buf;

io_error:
	rc = errno ? -errno : -EIO;
	snprintf(err, errlen, "cannot write '%s': %s", path, strerror(-rc));
out_file:
	if (f)
		fclose(f);
	unlink(tmp);
out_buf:
	free(buf);
out_tmp:
	free(tmp);
out_hdr:
	free(hdr.p);
	return rc;
}
