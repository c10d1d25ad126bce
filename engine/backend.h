/* Compute backends that hold weights in device memory, behind one ops table (CUDA today). */
#ifndef MD_BACKEND_H
#define MD_BACKEND_H

#include <stdbool.h>
#include <stddef.h>

#include "engine/kern/matmul.h"
#include "engine/quant.h"

/* What a backend reports about one of its devices. */
struct md_backend_device {
	char name[256];        /* e.g. "NVIDIA H100 80GB HBM3", NUL-terminated */
	int cc_major, cc_minor; /* compute capability */
	int n_sm;              /* streaming multiprocessors */
	size_t mem_total;      /* bytes */
	size_t mem_free;       /* bytes, when queried */
};

/*
 * A compute backend, as an ops table (like nginx's ngx_module_t): the engine calls through the
 * pointers and never includes a backend's own headers. One backend object is one device (the
 * first one today); every call comes from the engine thread, which owns the backend's streams.
 * Device pointers are opaque to the host: only the backend dereferences them, and a device
 * pointer plus a byte offset is a device pointer.
 *
 * Calls that return int return 0 or a negative errno-style code: -EINVAL (bad argument:
 * unsupported type, misaligned or mis-sized matrix), -ENOMEM (device memory exhausted),
 * -ENODEV (index out of range), -EIO (the device reported an error; a sticky device error
 * leaves the backend unusable).
 */
struct md_backend {
	const char *name; /* static string: "cuda" */

	/* Number of devices of this kind the process can see (>= 1 for a returned backend). */
	int (*device_count)(const struct md_backend *b);
	/* Fills *out for device dev (0 <= dev < device_count). */
	int (*device_info)(const struct md_backend *b, int dev, struct md_backend_device *out);

	/* Allocates size bytes of device memory (aligned to at least 256 bytes) into *dptr; on
	 * failure *dptr is NULL. free(b, NULL) does nothing. */
	int (*alloc)(struct md_backend *b, size_t size, void **dptr);
	void (*free)(struct md_backend *b, void *dptr);
	/* Host -> device and device -> host copies of size bytes; both return when the copy is
	 * complete and src may be reused. */
	int (*upload)(struct md_backend *b, void *dst_dev, const void *src_host, size_t size);
	int (*download)(struct md_backend *b, void *dst_host, const void *src_dev, size_t size);

	/* Whether matmul handles weights of type t. */
	bool (*supports)(const struct md_backend *b, enum md_dtype t);
	/*
	 * y[t][r] = dot(row r of w, x[t]) for t < n_tok, as md_matmul computes it on the CPU.
	 * w->data points at device memory (rows w->nb1 bytes apart, the GGML block layout of
	 * w->type, n_in a multiple of the block size; the data pointer and nb1 aligned to 4 bytes
	 * for q4_K / q5_K / f32, 2 bytes otherwise). x is host memory (n_tok, n_in) and y host
	 * memory (n_tok, n_out), both contiguous; the call returns when y is written. Weights are
	 * dequantized on the fly and products accumulate in float. On error y is unspecified.
	 */
	int (*matmul)(struct md_backend *b, const struct md_mat *w, const float *x, int n_tok,
		      float *y);

	void *_ctx; /* owned by the backend: its private state */
};

/*
 * The CUDA backend for the first CUDA device, created on first call and kept for the life of
 * the process (later calls return the same object). Returns NULL when moed was built without
 * CUDA or when no usable GPU is present (no driver, no device, init failure);
 * md_backend_cuda_error() then says why in one lowercase phrase. Thread-safe.
 *
 * MD_HAVE_CUDA is defined by the build only for the CUDA library and the code that links it
 * (its declared dependency); everyone else gets these stubs, so engine code calls
 * md_backend_cuda() unconditionally and never tests the macro itself.
 */
#ifdef MD_HAVE_CUDA
struct md_backend *md_backend_cuda(void);
const char *md_backend_cuda_error(void);
#else
static inline struct md_backend *md_backend_cuda(void)
{
	return NULL;
}

static inline const char *md_backend_cuda_error(void)
{
	return "built without cuda";
}
#endif

#endif
