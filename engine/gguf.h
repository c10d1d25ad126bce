/* GGUF v2/v3 reader: memory-mapped, read-only, every field of the untrusted file checked. */
#ifndef MD_GGUF_H
#define MD_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum md_gguf_vtype {
	MD_GGUF_UINT8 = 0,
	MD_GGUF_INT8 = 1,
	MD_GGUF_UINT16 = 2,
	MD_GGUF_INT16 = 3,
	MD_GGUF_UINT32 = 4,
	MD_GGUF_INT32 = 5,
	MD_GGUF_FLOAT32 = 6,
	MD_GGUF_BOOL = 7,
	MD_GGUF_STRING = 8,
	MD_GGUF_ARRAY = 9,
	MD_GGUF_UINT64 = 10,
	MD_GGUF_INT64 = 11,
	MD_GGUF_FLOAT64 = 12,
};

#define MD_GGUF_MAX_DIMS 4
#define MD_GGUF_DEFAULT_ALIGNMENT 32

/* A string inside the mapped file: not NUL-terminated. */
struct md_gguf_str {
	uint64_t len;
	const char *ptr; /* borrowed: valid until md_gguf_close */
};

struct md_gguf_kv {
	struct md_gguf_str key;
	enum md_gguf_vtype type;
	enum md_gguf_vtype arr_type; /* element type when type == ARRAY */
	uint64_t arr_n;              /* element count when type == ARRAY */
	const uint8_t *data;         /* borrowed: the value (or first array element) in the map */
	const uint64_t *str_offs;    /* owned: for string arrays, offset of element i from data
	                              * (arr_n + 1 entries; the last is the end); else NULL */
};

struct md_gguf_tensor {
	struct md_gguf_str name;
	uint32_t n_dims;
	int64_t ne[MD_GGUF_MAX_DIMS]; /* ne[0] innermost; unused dims are 1 */
	uint32_t type;                /* enum md_dtype value */
	uint64_t offset;              /* relative to the data section */
	uint64_t nbytes;
	const void *data;             /* borrowed: into the map, checked in bounds */
};

struct md_gguf {
	uint32_t version;
	uint64_t n_kv;
	struct md_gguf_kv *kv; /* owned (n_kv) */
	uint64_t n_tensors;
	struct md_gguf_tensor *tensors; /* owned (n_tensors) */
	uint64_t alignment;
	uint64_t data_offset; /* file offset of the tensor data section (<= size) */
	const uint8_t *base;  /* the mapping (or caller's buffer for md_gguf_open_mem) */
	size_t size;
	bool _mapped;
	int _fd;                  /* owned when >= 0 (md_gguf_open); -1 otherwise */
	uint32_t *_kv_index;      /* owned: open-addressing hash of keys, slot = kv index + 1 */
	uint32_t *_tensor_index;  /* owned: same for tensor names */
	uint64_t _kv_index_mask;  /* slots - 1 (a power of two minus one) */
	uint64_t _tensor_index_mask;
};

/* Open and validate a GGUF file. On failure returns a negative MD_E* style code (-errno or
 * -EINVAL), writes one line to err (what is wrong, at which offset or tensor) and leaves *g
 * needing no release. */
int md_gguf_open(struct md_gguf *g, const char *path, char *err, size_t errlen);

/* Same, over a caller-owned buffer (borrowed until md_gguf_close); used by the fuzzer. */
int md_gguf_open_mem(struct md_gguf *g, const void *buf, size_t len, char *err, size_t errlen);

void md_gguf_close(struct md_gguf *g);

/* Index of a key, or -1. */
int64_t md_gguf_find_key(const struct md_gguf *g, const char *key);

/* Typed getters. Integer getters accept any integer vtype whose value fits; return false
 * when the key is absent or the value does not fit/convert. */
bool md_gguf_get_u32(const struct md_gguf *g, const char *key, uint32_t *out);
bool md_gguf_get_u64(const struct md_gguf *g, const char *key, uint64_t *out);
bool md_gguf_get_f32(const struct md_gguf *g, const char *key, float *out); /* f32/f64/ints */
bool md_gguf_get_bool(const struct md_gguf *g, const char *key, bool *out);
bool md_gguf_get_str(const struct md_gguf *g, const char *key, struct md_gguf_str *out);

/* Array access: the kv must be an ARRAY; returns false on type mismatch or index out of range. */
bool md_gguf_arr_str(const struct md_gguf_kv *kv, uint64_t i, struct md_gguf_str *out);
bool md_gguf_arr_f32(const struct md_gguf_kv *kv, uint64_t i, float *out);
bool md_gguf_arr_i64(const struct md_gguf_kv *kv, uint64_t i, int64_t *out); /* any int type */

const struct md_gguf_tensor *md_gguf_find_tensor(const struct md_gguf *g, const char *name);

/* Name of a value type ("u32", "string", ...) for printing. */
const char *md_gguf_vtype_name(enum md_gguf_vtype t);

/* True when s equals the NUL-terminated c string. */
bool md_gguf_str_eq(struct md_gguf_str s, const char *c);

#endif
