/* Compute backends that hold weights in device memory, behind one ops table (CUDA today). */
#ifndef MD_BACKEND_H
#define MD_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/backend_fwd.h"
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
 * Streams: every backend has MD_BACKEND_STREAMS ordered work queues, named by index. Stream 0
 * (MD_BACKEND_STREAM_COMPUTE) is the one the synchronous ops (upload, download, matmul) use.
 * The others run concurrently with it and with each other, so a copy enqueued on
 * MD_BACKEND_STREAM_COPY overlaps compute on stream 0. Work on one stream runs in the order it
 * was enqueued; nothing orders two streams except a fence that the host waits for.
 */
#define MD_BACKEND_STREAMS 4
#define MD_BACKEND_STREAM_COMPUTE 0
#define MD_BACKEND_STREAM_COPY 1

/*
 * A compute backend, as an ops table (like nginx's ngx_module_t): the engine calls through the
 * pointers and never includes a backend's own headers. One backend object is one device (the
 * first one today); every call comes from the engine thread, which owns the backend's streams.
 * Device pointers are opaque to the host: only the backend dereferences them, and a device
 * pointer plus a byte offset is a device pointer.
 *
 * Calls that return int return 0 or a negative errno-style code: -EINVAL (bad argument:
 * unsupported type, misaligned or mis-sized matrix, unknown stream or fence), -ENOMEM (device
 * or pinned host memory exhausted), -ENODEV (index out of range), -EIO (the device reported an
 * error; a sticky device error leaves the backend unusable).
 *
 * Fences: a fence is a point recorded on one stream; it has passed when everything enqueued on
 * that stream before it is complete. Fence ids increase with every record, are never reused
 * for the life of the backend and are never 0 (callers may use 0 for "no fence"); any id the
 * backend returned may be queried or waited for any number of times, in any order, and an id
 * long passed stays passed. The intended use, by the expert cache: upload_async the next
 * layer's experts on MD_BACKEND_STREAM_COPY from pinned staging buffers, fence_record, run this
 * layer's matmuls on stream 0, then fence_done (to choose between waiting and computing the
 * expert elsewhere) or fence_wait before the first matmul that reads the uploaded weights and
 * before reusing the staging buffers.
 */
struct md_backend {
	const char *name; /* static string: "cuda" */

	/* Number of devices of this kind the process can see (>= 1 for a returned backend). */
	int (*device_count)(const struct md_backend *b);
	/* Fills *out for device dev (0 <= dev < device_count). */
	int (*device_info)(const struct md_backend *b, int dev, struct md_backend_device *out);

	/* Allocates size bytes of device memory (aligned to at least 256 bytes) into *dptr; on
	 * failure *dptr is NULL. free(b, NULL) does nothing. free first waits for all work
	 * enqueued on any stream (so it is no call for the hot path). */
	int (*alloc)(struct md_backend *b, size_t size, void **dptr);
	void (*free)(struct md_backend *b, void *dptr);
	/* Host -> device and device -> host copies of size bytes on stream 0; both return when
	 * the copy is complete and src may be reused. */
	int (*upload)(struct md_backend *b, void *dst_dev, const void *src_host, size_t size);
	int (*download)(struct md_backend *b, void *dst_host, const void *src_dev, size_t size);

	/*
	 * Allocates size bytes of page-locked (pinned) host memory into *hptr, aligned to at least
	 * 256 bytes; on failure *hptr is NULL (-EINVAL for size 0, -ENOMEM when the system refuses
	 * to lock more). Only copies from pinned memory run asynchronously at full bus speed. To
	 * the CPU it is ordinary memory. host_free(b, NULL) does nothing; host_free first waits
	 * for all work enqueued on any stream, so a pending copy never reads freed memory.
	 * Pinning costs milliseconds and pinned memory is scarce: allocate staging buffers once
	 * and reuse them.
	 */
	int (*host_alloc)(struct md_backend *b, size_t size, void **hptr);
	void (*host_free)(struct md_backend *b, void *hptr);
	/*
	 * Enqueues a host -> device copy of size bytes on stream (0 <= stream <
	 * MD_BACKEND_STREAMS) and returns without waiting for it. src_host is borrowed: it must
	 * stay valid and unmodified, and dst_dev must not be read by other streams or the host,
	 * until a fence recorded on the same stream after this call has passed. src_host should
	 * come from host_alloc: from pageable memory the copy is still correct, but the runtime
	 * stages it through its own buffer and may return only once it is done, so it does not
	 * overlap. size 0 enqueues nothing. On error nothing was enqueued.
	 */
	int (*upload_async)(struct md_backend *b, void *dst_dev, const void *src_host, size_t size,
			    int stream);
	/*
	 * Records a fence after all work enqueued so far on stream and stores its id in *fence
	 * (left unchanged on error). Does not wait, except when more than a few dozen fences are
	 * outstanding at once: then it waits for the oldest one to pass. No allocation per call.
	 */
	int (*fence_record)(struct md_backend *b, int stream, uint64_t *fence);
	/* Blocks the calling thread until fence has passed. Returns 0, -EINVAL for an id this
	 * backend never returned (0 included), or -EIO when the device failed. */
	int (*fence_wait)(struct md_backend *b, uint64_t fence);
	/* Non-blocking query: 1 when fence has passed, 0 when not yet, -EINVAL for an id this
	 * backend never returned (0 included), -EIO when the device failed. */
	int (*fence_done)(struct md_backend *b, uint64_t fence);

	/* Whether matmul handles weights of type t. */
	bool (*supports)(const struct md_backend *b, enum md_dtype t);
	/*
	 * y[t][r] = dot(row r of w, x[t]) for t < n_tok, as md_matmul computes it on the CPU.
	 * w->data points at device memory (rows w->nb1 bytes apart, the GGML block layout of
	 * w->type, n_in a multiple of the block size; the data pointer and nb1 aligned to 4 bytes
	 * for q4_K / q5_K / f32, 2 bytes otherwise). x is host memory (n_tok, n_in) and y host
	 * memory (n_tok, n_out), both contiguous. Runs on stream 0 and returns when y is written;
	 * weights uploaded on another stream must have passed their fence before the call. Weights
	 * are dequantized on the fly and products accumulate in float. On error y is unspecified.
	 */
	int (*matmul)(struct md_backend *b, const struct md_mat *w, const float *x, int n_tok,
		      float *y);

	/* Device-resident compute for a forward pass on the device (engine/backend_fwd.h), or
	 * NULL where the backend has none. */
	const struct md_backend_fwd *fwd;

	void *_ctx; /* owned by the backend: its private state */
};

/*
 * The CUDA backend for the first CUDA device, created on first call and kept for the life of
 * the process (later calls return the same object). Returns NULL when no usable GPU is present
 * (no driver, no device, init failure) or when moed was built without CUDA;
 * md_backend_cuda_error() then says why in one lowercase phrase ("built without cuda" for the
 * latter), and "" once the backend is up. Thread-safe.
 *
 * Which of the two is linked is decided by the build, not by a macro: cuda/backend_cuda.c
 * defines these in a CUDA build and engine/backend_none.c otherwise (engine/meson.build puts
 * exactly one behind engine_dep), so every caller, engine code included, gets the same answer.
 */
struct md_backend *md_backend_cuda(void);
const char *md_backend_cuda_error(void);

#endif
