/* The device side of CUDA C++ as moed's kernels use it, for the CUDA emulator: built-in
 * variables, qualifiers, vector types, warp shuffles and block barriers, and the launch that
 * tests/cuda_emu/cu2cpp.py writes for each <<<...>>>. Each thread of a block is a fiber; a
 * block runs to completion before the next, its threads switching only at collectives
 * (__syncthreads, __shfl_xor_sync), so __shared__ (a static here) is the running block's. */
#ifndef MD_CUDA_EMU_RUNTIME_H
#define MD_CUDA_EMU_RUNTIME_H

#include <math.h>
#include <stdint.h>

#include <functional>
#include <tuple>

#include "cuda_runtime_api.h"

struct uint3 {
	unsigned x, y, z;
};

struct dim3 {
	unsigned x, y, z;
	dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

struct __attribute__((aligned(16))) float4 {
	float x, y, z, w;
};

struct __attribute__((aligned(8))) float2 {
	float x, y;
};

/* The running thread and block (emu.cpp). */
const uint3 &emu_thread_idx(void);
extern uint3 emu_block_idx;
extern dim3 emu_block_dim, emu_grid_dim;

#define threadIdx (emu_thread_idx())
#define blockIdx emu_block_idx
#define blockDim emu_block_dim
#define gridDim emu_grid_dim

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __constant__ static const

float __shfl_xor_sync(unsigned mask, float v, int lane_mask);
int __shfl_xor_sync(unsigned mask, int v, int lane_mask);
void __syncthreads(void);

/* A thread runs until it reaches a collective, so no other thread of the block can come
 * between the read and the write. */
static inline int atomicAdd(int *p, int v)
{
	int old = *p;
	*p = old + v;
	return old;
}

static inline int min(int a, int b)
{
	return a < b ? a : b;
}

static inline int max(int a, int b)
{
	return a > b ? a : b;
}

static inline float __uint_as_float(unsigned u)
{
	union {
		unsigned u;
		float f;
	} c;
	c.u = u;
	return c.f;
}

/* Runs body once per thread of every block of grid (a launch error, when the configuration
 * is one CUDA refuses, is what cudaGetLastError returns next). */
void emu_launch(dim3 grid, dim3 block, cudaStream_t st, const std::function<void()> &body);

#endif
