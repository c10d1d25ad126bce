/* A simulated device backend: host memory behind the md_backend ops table (engine/backend.h),
 * with a device capacity and a copy bandwidth set by the caller, so that the expert store's
 * device tier (residency, eviction, copies overlapping compute, identical outputs) runs in CI
 * on machines without a GPU.
 *
 * DESIGN
 * Device memory is malloc'd host memory counted against the capacity (alloc fails with
 * -ENOMEM past it). A copy is done at once (memcpy) but is not "complete" before the time it
 * would take at the given bandwidth: each stream is a queue whose busy-until time advances by
 * size / bandwidth per copy, a fence records its stream's busy-until time, fence_done compares
 * it with the clock and fence_wait sleeps until it. So a reader who skips a fence is not caught
 * by wrong data, only by the tier's own rule (it never reads before the fence has passed), and
 * the timing a scheduler sees is that of a bus of that bandwidth. matmul computes on the CPU
 * (taking no less than its weights' bytes at the compute rate, when one is set)
 * with the same kernels as the forward pass (md_matmul_experts where the kernels take the
 * weights, else md_matmul), so outputs equal the host path's bit for bit. It also implements
 * the device-resident compute ops (engine/backend_fwd.h) on the host, the reference the CUDA
 * kernels are checked against and what lets CI run the device forward pass
 * (engine/forward_dev.h) without a GPU.
 *
 * Thread-safety as the ops table says: one thread (the engine thread) calls it. */
#ifndef MD_BACKEND_SIM_H
#define MD_BACKEND_SIM_H

#include <stddef.h>

#include "engine/backend.h"
#include "engine/kern/threadpool.h"

/* A backend with capacity bytes of "device" memory and copies at bytes_per_s (0: instant).
 * NULL on allocation failure. */
struct md_backend *md_backend_sim_new(size_t capacity, double bytes_per_s);
void md_backend_sim_free(struct md_backend *b);

/* Set the copy rate (bytes per second) and the compute rate (weight bytes per second a matmul
 * reads: it returns no sooner than its weights' bytes at that rate take; its math is still the
 * host's, so outputs do not change); 0: instant copies, matmuls as fast as the host does them.
 * Between forward passes. */
void md_backend_sim_set_rates(struct md_backend *b, double copy_bps, double compute_bps);

/* Compute on pool's threads instead of the backend's own single thread (which is freed); pool
 * is borrowed and must outlive the backend. The forward pass on the device uses a simulated
 * backend this way as its host executor: experts that live in host memory are computed with
 * the same ops, on the CPU forward pass's threads (engine/forward_dev.c). */
void md_backend_sim_set_pool(struct md_backend *b, struct md_pool *pool);

/* Bytes of device memory allocated now, and copies enqueued so far (for tests). */
size_t md_backend_sim_used(const struct md_backend *b);
unsigned long md_backend_sim_copies(const struct md_backend *b);

#endif
