/* The CUDA backend's host side: device detection, buffers, copies and matmul dispatch. */
#include "engine/backend.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "cuda/cuda_ctx.h"
#include "cuda/matmul_cuda.h"

/*
 * One backend object per process, bound to device 0 and created on first use. Each of the
 * ops table's MD_BACKEND_STREAMS streams is one non-blocking CUDA stream owned by the backend
 * (non-blocking: no implicit ordering with the legacy default stream, so a copy on stream 1
 * really overlaps a kernel on stream 0). Every call that the ops table documents as complete
 * on return synchronizes stream 0 only, so pending prefetches keep running. The input and
 * output of matmul pass through two device scratch buffers that grow to the largest call seen
 * (rounded up to a power of two) and are kept: the engine's batch sizes are bounded, so they
 * reach a ceiling quickly. Until then a growth waits for the whole device (cudaFree does),
 * prefetches included; free and host_free always do.
 *
 * Fences are CUDA events from a ring of FENCE_RING, created at init with timing off (cheaper
 * to record and query). Fence id n lives in slot n % FENCE_RING, which remembers the id it
 * holds; recording into a slot whose previous fence is still pending first waits for that
 * fence, so an id no longer found in its slot is known to have passed. That bounds the events
 * while keeping any old id answerable, with no allocation per fence.
 *
 * Rejected: one stream per call (creation cost on the hot path); an event created and
 * destroyed per fence (driver calls on the hot path, and a leak whenever a caller forgets an
 * id); and pinned host staging for matmul (the engine's activations live in its own memory; a
 * pinned copy would add a host memcpy to save little at decode batch sizes). The last may come
 * back with device-resident activations.
 */
static struct cuda_ctx cuda_state;

/* Launch kernels with Programmatic Dependent Launch (cuda/launch.cuh): MOED_PDL=1 at start-up,
 * an A/B until a GPU run has measured it. Read by the kernel launchers of the .cu files. */
int md_cuda_pdl;
static struct md_backend cuda_backend;
static struct md_backend *cuda_ready; /* &cuda_backend once init succeeded */
static char cuda_why[192] = "cuda backend not initialised";
static pthread_once_t cuda_once = PTHREAD_ONCE_INIT;

/* Maps a CUDA runtime error to the ops table's codes. */
int md_cuda__errno(cudaError_t e)
{
	switch (e) {
	case cudaSuccess: return 0;
	case cudaErrorMemoryAllocation: return -ENOMEM;
	case cudaErrorInvalidValue:
	case cudaErrorInvalidDevicePointer:
	case cudaErrorInvalidMemcpyDirection: return -EINVAL;
	case cudaErrorInvalidDevice: return -ENODEV;
	default: return -EIO;
	}
}

static int cuda_device_count(const struct md_backend *b)
{
	const struct cuda_ctx *c = b->_ctx;

	return c->n_dev;
}

static int cuda_device_info(const struct md_backend *b, int dev, struct md_backend_device *out)
{
	const struct cuda_ctx *c = b->_ctx;
	struct cudaDeviceProp prop;
	size_t mem_free = 0, mem_total = 0;
	cudaError_t e;

	if (dev < 0 || dev >= c->n_dev)
		return -ENODEV;
	e = cudaGetDeviceProperties(&prop, dev);
	if (e != cudaSuccess)
		return md_cuda__errno(e);
	memset(out, 0, sizeof(*out));
	snprintf(out->name, sizeof(out->name), "%s", prop.name);
	out->cc_major = prop.major;
	out->cc_minor = prop.minor;
	out->n_sm = prop.multiProcessorCount;
	out->mem_total = prop.totalGlobalMem;
	/* cudaMemGetInfo reports the current device only: switch there and back. */
	if (dev != c->dev && cudaSetDevice(dev) != cudaSuccess)
		return 0;
	if (cudaMemGetInfo(&mem_free, &mem_total) == cudaSuccess)
		out->mem_free = mem_free;
	if (dev != c->dev)
		cudaSetDevice(c->dev);
	return 0;
}

static int cuda_alloc(struct md_backend *b, size_t size, void **dptr)
{
	cudaError_t e;

	*dptr = NULL;
	if (size == 0)
		return -EINVAL;
	e = cudaMalloc(dptr, size);
	if (e != cudaSuccess) {
		*dptr = NULL;
		cudaGetLastError(); /* an allocation failure is not sticky: clear it */
		return md_cuda__errno(e);
	}
	return 0;
}

static void cuda_free(struct md_backend *b, void *dptr)
{
	if (dptr != NULL)
		cudaFree(dptr);
}

static int cuda_copy(struct cuda_ctx *c, void *dst, const void *src, size_t size,
		     enum cudaMemcpyKind kind)
{
	cudaError_t e;

	if (size == 0)
		return 0;
	e = cudaMemcpyAsync(dst, src, size, kind, c->stream[0]);
	if (e == cudaSuccess)
		e = cudaStreamSynchronize(c->stream[0]);
	return md_cuda__errno(e);
}

static int cuda_upload(struct md_backend *b, void *dst_dev, const void *src_host, size_t size)
{
	return cuda_copy(b->_ctx, dst_dev, src_host, size, cudaMemcpyHostToDevice);
}

static int cuda_download(struct md_backend *b, void *dst_host, const void *src_dev, size_t size)
{
	return cuda_copy(b->_ctx, dst_host, src_dev, size, cudaMemcpyDeviceToHost);
}

static int cuda_host_alloc(struct md_backend *b, size_t size, void **hptr)
{
	cudaError_t e;

	*hptr = NULL;
	if (size == 0)
		return -EINVAL;
	/* Portable: pinned for every device context, should more devices come. */
	e = cudaHostAlloc(hptr, size, cudaHostAllocPortable);
	if (e != cudaSuccess) {
		*hptr = NULL;
		cudaGetLastError(); /* a refused pinning is not sticky */
		return e == cudaErrorMemoryAllocation ? -ENOMEM : md_cuda__errno(e);
	}
	return 0;
}

static void cuda_host_free(struct md_backend *b, void *hptr)
{
	struct cuda_ctx *c = b->_ctx;

	if (hptr == NULL)
		return;
	/* The contract lets callers free a buffer a copy may still read: drain every stream. */
	for (int i = 0; i < MD_BACKEND_STREAMS; i++)
		cudaStreamSynchronize(c->stream[i]);
	cudaFreeHost(hptr);
}

static int cuda_upload_async(struct md_backend *b, void *dst_dev, const void *src_host,
			     size_t size, int stream)
{
	struct cuda_ctx *c = b->_ctx;

	if (stream < 0 || stream >= MD_BACKEND_STREAMS || dst_dev == NULL || src_host == NULL)
		return -EINVAL;
	if (size == 0)
		return 0;
	return md_cuda__errno(cudaMemcpyAsync(dst_dev, src_host, size, cudaMemcpyHostToDevice,
					  c->stream[stream]));
}

static int cuda_fence_record(struct md_backend *b, int stream, uint64_t *fence)
{
	struct cuda_ctx *c = b->_ctx;
	struct cuda_fence *f;
	uint64_t id;
	cudaError_t e;

	if (stream < 0 || stream >= MD_BACKEND_STREAMS)
		return -EINVAL;
	id = c->fence_last + 1;
	f = &c->fence[id % FENCE_RING];
	/* The slot's previous fence must pass before its event is re-recorded (see DESIGN). */
	if (f->id != 0) {
		e = cudaEventSynchronize(f->ev);
		if (e != cudaSuccess)
			return md_cuda__errno(e);
	}
	e = cudaEventRecord(f->ev, c->stream[stream]);
	if (e != cudaSuccess)
		return md_cuda__errno(e);
	f->id = id;
	c->fence_last = id;
	*fence = id;
	return 0;
}

/* The slot holding fence, or NULL when fence has passed for certain (its slot was reused);
 * *err is -EINVAL for ids never returned. */
static struct cuda_fence *fence_slot(struct cuda_ctx *c, uint64_t fence, int *err)
{
	struct cuda_fence *f;

	*err = 0;
	if (fence == 0 || fence > c->fence_last) {
		*err = -EINVAL;
		return NULL;
	}
	f = &c->fence[fence % FENCE_RING];
	return f->id == fence ? f : NULL;
}

static int cuda_fence_wait(struct md_backend *b, uint64_t fence)
{
	struct cuda_fence *f;
	int err;

	f = fence_slot(b->_ctx, fence, &err);
	if (f == NULL)
		return err;
	return md_cuda__errno(cudaEventSynchronize(f->ev));
}

static int cuda_fence_done(struct md_backend *b, uint64_t fence)
{
	struct cuda_fence *f;
	cudaError_t e;
	int err;

	f = fence_slot(b->_ctx, fence, &err);
	if (f == NULL)
		return err < 0 ? err : 1;
	e = cudaEventQuery(f->ev);
	if (e == cudaErrorNotReady)
		return 0;
	return e == cudaSuccess ? 1 : md_cuda__errno(e);
}

/* Block size in elements and the alignment (bytes) the kernels need of rows, per type;
 * blck 0 for types the kernels do not handle. */
void md_cuda__type_layout(enum md_dtype t, int64_t *blck, size_t *bytes, size_t *align)
{
	*blck = 0;
	*bytes = 0;
	*align = 1;
	switch (t) {
	case MD_DT_F32: *blck = 1; *bytes = 4; *align = 4; break;
	case MD_DT_F16:
	case MD_DT_BF16: *blck = 1; *bytes = 2; *align = 2; break;
	case MD_DT_Q8_0: *blck = 32; *bytes = 34; *align = 2; break;
	case MD_DT_Q4_0: *blck = 32; *bytes = 18; *align = 2; break;
	case MD_DT_Q4_K: *blck = 256; *bytes = 144; *align = 4; break;
	case MD_DT_Q5_K: *blck = 256; *bytes = 176; *align = 4; break;
	case MD_DT_Q6_K: *blck = 256; *bytes = 210; *align = 2; break;
	/* read byte by byte (matmul.cu): any alignment */
	case MD_DT_Q4_1: *blck = 32; *bytes = 20; break;
	case MD_DT_Q5_0: *blck = 32; *bytes = 22; break;
	case MD_DT_Q5_1: *blck = 32; *bytes = 24; break;
	case MD_DT_IQ4_NL: *blck = 32; *bytes = 18; break;
	case MD_DT_MXFP4: *blck = 32; *bytes = 17; break;
	case MD_DT_IQ4_XS: *blck = 256; *bytes = 136; break;
	case MD_DT_Q2_K: *blck = 256; *bytes = 84; break;
	case MD_DT_Q3_K: *blck = 256; *bytes = 110; break;
	default: break;
	}
}

static bool cuda_supports(const struct md_backend *b, enum md_dtype t)
{
	int64_t blck;
	size_t bytes, align;

	md_cuda__type_layout(t, &blck, &bytes, &align);
	return blck != 0;
}

/* Makes *buf hold at least need bytes (contents not kept). */
static int cuda_reserve(float **buf, size_t *cap, size_t need)
{
	size_t n = 4096;
	cudaError_t e;

	if (*cap >= need)
		return 0;
	while (n < need && n <= SIZE_MAX / 2)
		n *= 2;
	if (n < need)
		n = need;
	cudaFree(*buf);
	*buf = NULL;
	*cap = 0;
	e = cudaMalloc((void **)buf, n);
	if (e != cudaSuccess) {
		*buf = NULL;
		cudaGetLastError();
		return md_cuda__errno(e);
	}
	*cap = n;
	return 0;
}

static int cuda_matmul(struct md_backend *b, const struct md_mat *w, const float *x, int n_tok,
		       float *y)
{
	struct cuda_ctx *c = b->_ctx;
	int64_t blck;
	size_t bytes, align, xb, yb;
	int rc;
	cudaError_t e, s;

	md_cuda__type_layout(w->type, &blck, &bytes, &align);
	if (blck == 0 || w->data == NULL || n_tok <= 0 || w->n_in <= 0 || w->n_out <= 0 ||
	    w->n_in % blck != 0 || w->nb1 < (size_t)(w->n_in / blck) * bytes ||
	    (uintptr_t)w->data % align != 0 || w->nb1 % align != 0)
		return -EINVAL;
	if ((size_t)w->n_in > SIZE_MAX / sizeof(float) / (size_t)n_tok ||
	    (size_t)w->n_out > SIZE_MAX / sizeof(float) / (size_t)n_tok)
		return -EINVAL;
	xb = (size_t)n_tok * (size_t)w->n_in * sizeof(float);
	yb = (size_t)n_tok * (size_t)w->n_out * sizeof(float);
	rc = cuda_reserve(&c->x_dev, &c->x_cap, xb);
	if (rc == 0)
		rc = cuda_reserve(&c->y_dev, &c->y_cap, yb);
	if (rc != 0)
		return rc;
	e = cudaMemcpyAsync(c->x_dev, x, xb, cudaMemcpyHostToDevice, c->stream[0]);
	if (e == cudaSuccess)
		e = md_cuda__matmul((int)w->type, w->data, w->n_in, w->n_out, w->nb1, c->x_dev,
				    n_tok, c->y_dev, 0, c->stream[0]);
	if (e == cudaSuccess)
		e = cudaMemcpyAsync(y, c->y_dev, yb, cudaMemcpyDeviceToHost, c->stream[0]);
	/* Synchronize even after a failed step so no copy is still reading x or writing y. */
	s = cudaStreamSynchronize(c->stream[0]);
	if (e == cudaSuccess)
		e = s;
	return md_cuda__errno(e);
}

static void cuda_fail(const char *what, cudaError_t e)
{
	snprintf(cuda_why, sizeof(cuda_why), "%s: %s (cuda error %d)", what,
		 cudaGetErrorString(e), (int)e);
	cudaGetLastError();
}

/* Runs once: finds device 0 and prepares the backend, or records why not in cuda_why. Error
 * 35 (cudaErrorInsufficientDriver) is what a machine without an NVIDIA driver reports: it
 * counts as zero GPUs like the others. */
static void cuda_init(void)
{
	struct cuda_ctx *c = &cuda_state;
	int n = 0, n_stream = 0, n_event = 0;
	cudaError_t e;

	e = cudaGetDeviceCount(&n);
	if (e != cudaSuccess) {
		cuda_fail("no usable cuda device", e);
		return;
	}
	if (n <= 0) {
		snprintf(cuda_why, sizeof(cuda_why), "no cuda device");
		return;
	}
	c->dev = 0;
	c->n_dev = n;
	c->no_fuse = getenv("MOED_NO_FUSE") != NULL;
	md_cuda_pdl = getenv("MOED_PDL") != NULL && strcmp(getenv("MOED_PDL"), "0") != 0;
	e = cudaSetDevice(c->dev);
	if (e != cudaSuccess) {
		cuda_fail("cannot select cuda device 0", e);
		return;
	}
	e = md_cuda__kernels_loadable();
	if (e != cudaSuccess) {
		cuda_fail("cuda device 0 cannot run moed's kernels", e);
		return;
	}
	for (int i = 0; i < MD_BACKEND_STREAMS; i++) {
		e = cudaStreamCreateWithFlags(&c->stream[i], cudaStreamNonBlocking);
		if (e != cudaSuccess) {
			cuda_fail("cannot create a cuda stream", e);
			goto out_streams;
		}
		n_stream++;
	}
	for (int i = 0; i < FENCE_RING; i++) {
		e = cudaEventCreateWithFlags(&c->fence[i].ev, cudaEventDisableTiming);
		if (e != cudaSuccess) {
			cuda_fail("cannot create a cuda event", e);
			goto out_events;
		}
		c->fence[i].id = 0;
		n_event++;
	}
	c->fence_last = 0;
	cuda_backend = (struct md_backend){
		.name = "cuda",
		.device_count = cuda_device_count,
		.device_info = cuda_device_info,
		.alloc = cuda_alloc,
		.free = cuda_free,
		.upload = cuda_upload,
		.download = cuda_download,
		.host_alloc = cuda_host_alloc,
		.host_free = cuda_host_free,
		.upload_async = cuda_upload_async,
		.fence_record = cuda_fence_record,
		.fence_wait = cuda_fence_wait,
		.fence_done = cuda_fence_done,
		.supports = cuda_supports,
		.matmul = cuda_matmul,
		.fwd = &md_cuda__fwd_ops,
		._ctx = c,
	};
	cuda_ready = &cuda_backend;
	cuda_why[0] = '\0';
	return;

out_events:
	while (n_event > 0)
		cudaEventDestroy(c->fence[--n_event].ev);
out_streams:
	while (n_stream > 0)
		cudaStreamDestroy(c->stream[--n_stream]);
}

struct md_backend *md_backend_cuda(void)
{
	pthread_once(&cuda_once, cuda_init);
	return cuda_ready;
}

const char *md_backend_cuda_error(void)
{
	pthread_once(&cuda_once, cuda_init);
	return cuda_ready != NULL ? "" : cuda_why;
}
