/* GGUF v3 writer for the tools: metadata first, tensor data streamed at write time. */
#ifndef MD_GGUF_WRITER_H
#define MD_GGUF_WRITER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct md_gguf_writer; /* opaque */

/* Fills dst (nbytes, the tensor's full size) with the tensor's data; returns 0 or -errno. */
typedef int (*md_gguf_fill_cb)(void *ctx, void *dst, size_t nbytes);

struct md_gguf_writer *md_gguf_writer_new(void);
void md_gguf_writer_free(struct md_gguf_writer *w);

/* Metadata setters; keys and string values are copied. Setting a key twice replaces it. */
void md_gguf_w_u32(struct md_gguf_writer *w, const char *key, uint32_t v);
void md_gguf_w_i32(struct md_gguf_writer *w, const char *key, int32_t v);
void md_gguf_w_u64(struct md_gguf_writer *w, const char *key, uint64_t v);
void md_gguf_w_f32(struct md_gguf_writer *w, const char *key, float v);
void md_gguf_w_bool(struct md_gguf_writer *w, const char *key, bool v);
void md_gguf_w_str(struct md_gguf_writer *w, const char *key, const char *v);
void md_gguf_w_str_n(struct md_gguf_writer *w, const char *key, const char *v, size_t len);
void md_gguf_w_arr_str(struct md_gguf_writer *w, const char *key, const char *const *v,
		       const size_t *lens /* NULL: strlen */, uint64_t n);
void md_gguf_w_arr_i32(struct md_gguf_writer *w, const char *key, const int32_t *v, uint64_t n);
void md_gguf_w_arr_f32(struct md_gguf_writer *w, const char *key, const float *v, uint64_t n);

/* Declare a tensor (ne[0] innermost, n_dims <= 4, type an enum md_dtype). Its bytes come from
 * fill(ctx, ...) during md_gguf_writer_write, in declaration order, so a multi-GB model never
 * sits in memory whole. ctx is borrowed until then. Returns 0 or -EINVAL (bad shape for type). */
int md_gguf_w_tensor(struct md_gguf_writer *w, const char *name, uint32_t type,
		     uint32_t n_dims, const int64_t *ne, md_gguf_fill_cb fill, void *ctx);

/* Copy every key of an opened GGUF (all value types, arrays included) into w. */
struct md_gguf;
void md_gguf_w_copy_kv(struct md_gguf_writer *w, const struct md_gguf *src);
/* Same, only the keys that start with prefix (e.g. "tokenizer."). */
void md_gguf_w_copy_kv_prefix(struct md_gguf_writer *w, const struct md_gguf *src,
			      const char *prefix);

/* Write the file (alignment 32, or general.alignment if set). Returns 0 or -errno; on
 * failure err holds one line. */
int md_gguf_writer_write(struct md_gguf_writer *w, const char *path, char *err, size_t errlen);

#endif
