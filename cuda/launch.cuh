/* Kernel launches, with Programmatic Dependent Launch when asked for (MOED_PDL=1).
 *
 * DESIGN
 * A decode step is a chain of a few hundred short kernels, each reading what the one before
 * wrote. In a stream (and in a graph captured from one) a kernel starts only once the one
 * before has finished and its writes are flushed, so every link of the chain pays the launch
 * and the ramp-up of its blocks on top of its work: about 2.7 us a launch on an H100 (the
 * first GPU run, bench/README.md), against 1-15 us of work. Programmatic Dependent Launch
 * (Hopper, sm_90) lets the next kernel be launched, and its blocks placed, while the one
 * before still runs: each kernel, first thing, waits until the kernel before it has completed
 * with its memory visible (griddepcontrol.wait), then lets the next one launch
 * (griddepcontrol.launch_dependents: so at most two kernels of the chain are placed at once,
 * one running and one waiting). Because the wait comes before any load or store,
 * a kernel sees exactly what it saw without PDL (read-after-write and write-after-read both
 * stay ordered, transitively along the chain); only the launch overlaps. Without the launch
 * attribute, or on a device older than sm_90, both instructions do nothing.
 * md_cuda_pdl (cuda/backend_cuda.c, from MOED_PDL at start-up) chooses, per process, between
 * launching with the attribute (cudaLaunchKernelEx) and the plain <<<>>> launch: off by
 * default until a GPU run has measured it (tests/gpu/run.sh runs the GPU tests and the batch-1
 * bench with it on). The CUDA emulator (tests/cuda_emu) runs kernels one after another, so it
 * takes the plain launch, written out as cu2cpp.py writes one.
 */
#ifndef MD_CUDA_LAUNCH_CUH
#define MD_CUDA_LAUNCH_CUH

#include <cuda_runtime.h>

#ifdef MD_CUDA_EMU_RUNTIME_H
#include <tuple>
#endif

extern "C" int md_cuda_pdl;

/* First statement of every kernel: see above. */
__device__ __forceinline__ void md_pdl_enter(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
	asm volatile("griddepcontrol.wait;" ::: "memory");
	asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* kernel<<<grid, block, smem, stream>>>(args), with the PDL attribute when md_cuda_pdl is set.
 * Errors are left for cudaGetLastError, as a <<<>>> launch leaves them. */
template <typename... P, typename... A>
static inline void md_launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
			     cudaStream_t stream, A... args)
{
#ifdef MD_CUDA_EMU_RUNTIME_H
	auto a = std::make_tuple((P)args...);

	(void)smem;
	emu_launch(grid, block, stream, [kernel, a]() { std::apply(kernel, a); });
#else
	if (md_cuda_pdl) {
		cudaLaunchAttribute at[1];
		cudaLaunchConfig_t cfg = {};

		at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
		at[0].val.programmaticStreamSerializationAllowed = 1;
		cfg.gridDim = grid;
		cfg.blockDim = block;
		cfg.dynamicSmemBytes = smem;
		cfg.stream = stream;
		cfg.attrs = at;
		cfg.numAttrs = 1;
		(void)cudaLaunchKernelEx(&cfg, kernel, (P)args...);
		return;
	}
	kernel<<<grid, block, smem, stream>>>((P)args...);
#endif
}

#endif
