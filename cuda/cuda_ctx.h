/* The CUDA backend's private state and helpers shared by its host files (backend_cuda.c:
 * devices, memory, copies, fences, matmul; backend_cuda_fwd.c: the device forward pass's
 * ops). Private to cuda/. */
#ifndef MD_CUDA_CTX_H
#define MD_CUDA_CTX_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "engine/backend.h"

#define FENCE_RING 64

struct cuda_fence {
	cudaEvent_t ev; /* owned */
	uint64_t id;    /* the fence recorded last in this slot, 0 for none */
};

struct cuda_ctx {
	int dev;              /* the device every call runs on */
	int n_dev;            /* devices visible at init */
	cudaStream_t stream[MD_BACKEND_STREAMS]; /* owned; [0] is the compute stream */
	struct cuda_fence fence[FENCE_RING];     /* owned: the fence ring */
	uint64_t fence_last;  /* id of the last fence recorded, 0 before the first */
	float *x_dev;         /* owned: device scratch for matmul inputs, x_cap bytes */
	size_t x_cap;
	float *y_dev;         /* owned: device scratch for matmul outputs, y_cap bytes */
	size_t y_cap;
	int no_fuse;          /* MOED_NO_FUSE: one launch per op as before fusing (an A/B) */
};

/* The ops table's code for a CUDA runtime error (0, -ENOMEM, -EINVAL, -ENODEV, -EIO). */
int md_cuda__errno(cudaError_t e);
/* Block size in elements, bytes per block and the alignment the kernels need of rows, per
 * type; blck 0 for types the kernels do not handle. */
void md_cuda__type_layout(enum md_dtype t, int64_t *blck, size_t *bytes, size_t *align);
/* Nonzero: kernels launch with Programmatic Dependent Launch (cuda/launch.cuh, MOED_PDL). */
extern int md_cuda_pdl;
/* The device forward pass's ops (backend_cuda_fwd.c). */
extern const struct md_backend_fwd md_cuda__fwd_ops;

#endif
