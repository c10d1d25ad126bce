/* A host emulator of the CUDA runtime and execution model, for running cuda/'s backend and
 * kernels in CI without a GPU (tests/cuda_emu/meson.build builds them against it).
 *
 * Memory: "device" allocations are host memory counted against a capacity
 * (MOED_CUDA_EMU_MB, default 2048), filled with NaN bytes when allocated, as a device's memory
 * holds whatever it held; copies check that their device side lies inside an allocation.
 * Streams and events: every operation runs when it is enqueued, so each stream is complete
 * at all times (a valid schedule of real streams, not the only one). Kernels: a launch runs
 * its blocks one after another; within a block every thread is a fiber with its own stack,
 * run until it finishes or reaches a collective: __syncthreads waits for every live thread
 * of the block, __shfl_xor_sync for every live lane of the warp, then each reads its partner's
 * value. That is enough to execute kernels whose threads meet only at those points, as
 * moed's do; it does not model memory ordering between blocks or races. Graphs: while a stream
 * is captured, the launches and copies enqueued on it are recorded (a kernel's arguments as
 * captured, a copy's pointers) instead of run, and a graph launch runs the record again; what a
 * GPU refuses during a capture (waiting, allocating, a pageable copy into the graph, a launch on
 * the legacy stream) fails here too and invalidates it (see emu_launch). x86-64 only (its
 * context switch is a few instructions of assembly). Test use only. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <map>
#include <vector>

#include <pthread.h>
#include <sys/mman.h>

#include "cuda_runtime.h"

#if !defined(__x86_64__)
#error "the CUDA emulator's fibers need x86-64"
#endif

/* ---- fibers ---- */

extern "C" void emu_ctx_switch(void **save_sp, void *new_sp);
__asm__(".text\n"
	".globl emu_ctx_switch\n"
	".type emu_ctx_switch,@function\n"
	"emu_ctx_switch:\n"
	"  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
	"  movq %rsp, (%rdi)\n"
	"  movq %rsi, %rsp\n"
	"  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
	"  ret\n"
	".size emu_ctx_switch, .-emu_ctx_switch\n");

enum { MAX_THREADS = 1024, STACK = 32 * 1024 }; /* kernels use a few hundred bytes of stack */

struct fiber {
	void *sp;
	uint3 tid;
	int warp, lane;
	bool done;
};

struct warp_state {
	int alive, count;
	unsigned gen;
	float vals[2][32];
};

static struct fiber fibers[MAX_THREADS];
static struct warp_state warps[MAX_THREADS / 32];
static char *stacks;
static void *sched_sp;
static struct fiber *cur;
static const std::function<void()> *body;
static int alive, bar_count;
static unsigned bar_gen;
static cudaError_t last_error = cudaSuccess;
static unsigned long launches;

uint3 emu_block_idx;
dim3 emu_block_dim, emu_grid_dim;

const uint3 &emu_thread_idx(void)
{
	return cur->tid;
}

static void to_scheduler(void)
{
	emu_ctx_switch(&cur->sp, sched_sp);
}

/* A thread left: it no longer counts at barriers, which may now be complete. */
static void release_waiters(void)
{
	if (bar_count > 0 && bar_count == alive) {
		bar_count = 0;
		bar_gen++;
	}
	struct warp_state *w = &warps[cur->warp];
	if (w->count > 0 && w->count == w->alive) {
		w->count = 0;
		w->gen++;
	}
}

static void fiber_main(void)
{
	(*body)();
	cur->done = true;
	alive--;
	warps[cur->warp].alive--;
	release_waiters();
	to_scheduler();
	abort(); /* never resumed */
}

void __syncthreads(void)
{
	unsigned g = bar_gen;
	if (++bar_count == alive) {
		bar_count = 0;
		bar_gen++;
		return;
	}
	while (bar_gen == g)
		to_scheduler();
}

float __shfl_xor_sync(unsigned mask, float v, int lane_mask)
{
	(void)mask;
	struct warp_state *w = &warps[cur->warp];
	unsigned g = w->gen;
	int lane = cur->lane;
	w->vals[g & 1][lane] = v;
	if (++w->count == w->alive) {
		w->count = 0;
		w->gen++;
	} else {
		while (w->gen == g)
			to_scheduler();
	}
	return w->vals[g & 1][lane ^ lane_mask];
}

int __shfl_xor_sync(unsigned mask, int v, int lane_mask)
{
	float f, r;
	memcpy(&f, &v, sizeof f); /* carried as bits: the exchange only copies them */
	r = __shfl_xor_sync(mask, f, lane_mask);
	memcpy(&v, &r, sizeof v);
	return v;
}

static void run_block(int n)
{
	for (int i = 0; i < n / 32 + 1; i++)
		warps[i] = warp_state{};
	for (int i = 0; i < n; i++) {
		struct fiber *f = &fibers[i];
		f->tid.x = (unsigned)i % emu_block_dim.x;
		f->tid.y = ((unsigned)i / emu_block_dim.x) % emu_block_dim.y;
		f->tid.z = (unsigned)i / (emu_block_dim.x * emu_block_dim.y);
		f->warp = i / 32;
		f->lane = i % 32;
		f->done = false;
		warps[f->warp].alive++;
		/* the new stack: six callee-saved registers, then fiber_main as the return address,
		 * leaving the stack as a call would (rsp % 16 == 8 at entry) */
		uintptr_t top = ((uintptr_t)(stacks + (size_t)(i + 1) * STACK)) & ~(uintptr_t)15;
		void **sp = (void **)top;
		*--sp = NULL;
		*--sp = (void *)fiber_main;
		for (int r = 0; r < 6; r++)
			*--sp = NULL;
		f->sp = sp;
	}
	alive = n;
	bar_count = 0;
	while (alive > 0)
		for (int i = 0; i < n; i++)
			if (!fibers[i].done) {
				cur = &fibers[i];
				emu_ctx_switch(&sched_sp, cur->sp);
			}
}

/* The graph being captured (NULL: none), and what it records. */
struct emu_graph {
	std::vector<std::function<void()>> ops;
};
/* Capture, as in cudaStreamCaptureModeThreadLocal: work enqueued on the captured stream is
 * recorded; on other streams it runs. On the capturing thread, the calls CUDA calls unsafe
 * during a capture (allocation and freeing, device or pinned) fail and invalidate it, as do a
 * launch on the legacy default stream and a copy on the captured stream whose host side is not
 * pinned (cudaHostAlloc): cudaStreamEndCapture then fails. */
static struct emu_graph *capturing;
static cudaStream_t cap_stream;
static pthread_t cap_thread;
static bool cap_invalid;
static unsigned long graph_launches;

static cudaError_t fail(cudaError_t e);

/* Whether the calling thread is capturing; then the capture is invalidated. */
static bool unsafe_in_capture(void)
{
	if (!capturing || !pthread_equal(pthread_self(), cap_thread))
		return false;
	cap_invalid = true;
	return true;
}

static void run_launch(dim3 grid, dim3 block, const std::function<void()> &fn);

void emu_launch(dim3 grid, dim3 block, cudaStream_t st, const std::function<void()> &fn)
{
	if (capturing && st == cap_stream) {
		std::function<void()> body_copy = fn;
		capturing->ops.push_back([grid, block, body_copy]() { run_launch(grid, block, body_copy); });
		return;
	}
	if (!st && unsafe_in_capture()) {
		fail(cudaErrorStreamCaptureUnsupported);
		return;
	}
	run_launch(grid, block, fn);
}

static void run_launch(dim3 grid, dim3 block, const std::function<void()> &fn)
{
	unsigned long threads = (unsigned long)block.x * block.y * block.z;
	if (threads == 0 || threads > MAX_THREADS || block.z > 64 || grid.x == 0 || grid.y == 0 ||
	    grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
		last_error = cudaErrorInvalidConfiguration;
		return;
	}
	if (!stacks) { /* a guard page at the low end of each stack: an overflow faults */
		void *p = mmap(NULL, (size_t)MAX_THREADS * STACK, PROT_READ | PROT_WRITE,
			       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (p == MAP_FAILED) {
			last_error = cudaErrorMemoryAllocation;
			return;
		}
		stacks = (char *)p;
		for (int i = 0; i < MAX_THREADS; i++)
			mprotect(stacks + (size_t)i * STACK, 4096, PROT_NONE);
	}
	launches++;
	body = &fn;
	emu_block_dim = block;
	emu_grid_dim = grid;
	for (unsigned z = 0; z < grid.z; z++)
		for (unsigned y = 0; y < grid.y; y++)
			for (unsigned x = 0; x < grid.x; x++) {
				emu_block_idx = uint3{ x, y, z };
				run_block((int)threads);
			}
}

/* ---- the runtime ---- */

struct emu_stream {
	int id;
};
struct emu_event {
	int recorded;
};

static std::map<uintptr_t, size_t> allocs; /* device allocations: start -> size */
static std::map<uintptr_t, size_t> pinned; /* cudaHostAlloc's: start -> size */
static size_t used;

static size_t capacity(void)
{
	const char *e = getenv("MOED_CUDA_EMU_MB");
	return (size_t)(e && atof(e) > 0 ? atof(e) : 2048.0) << 20;
}

static cudaError_t fail(cudaError_t e)
{
	last_error = e;
	return e;
}

/* Whether [p, p + n) lies inside one allocation of m. */
static bool inside(const std::map<uintptr_t, size_t> &m, const void *p, size_t n)
{
	auto it = m.upper_bound((uintptr_t)p);
	if (it == m.begin())
		return false;
	--it;
	return (uintptr_t)p + n <= it->first + it->second;
}

static bool on_device(const void *p, size_t n)
{
	return inside(allocs, p, n);
}

extern "C" {

cudaError_t cudaGetDeviceCount(int *n)
{
	*n = 1;
	return cudaSuccess;
}

cudaError_t cudaSetDevice(int dev)
{
	return dev == 0 ? cudaSuccess : fail(cudaErrorInvalidDevice);
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int dev)
{
	if (dev != 0)
		return fail(cudaErrorInvalidDevice);
	memset(p, 0, sizeof(*p));
	snprintf(p->name, sizeof(p->name), "moed CUDA emulator (host)");
	p->totalGlobalMem = capacity();
	p->major = 9;
	p->minor = 0;
	p->multiProcessorCount = 1;
	return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total)
{
	*total = capacity();
	*free_b = *total - used;
	return cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t n)
{
	*p = NULL;
	if (unsafe_in_capture())
		return fail(cudaErrorStreamCaptureUnsupported);
	if (n > capacity() - used)
		return fail(cudaErrorMemoryAllocation);
	void *q = aligned_alloc(256, (n + 255) & ~(size_t)255);
	if (!q)
		return fail(cudaErrorMemoryAllocation);
	memset(q, 0xff, n); /* NaN, as memory nobody wrote */
	allocs[(uintptr_t)q] = n;
	used += n;
	*p = q;
	return cudaSuccess;
}

cudaError_t cudaFree(void *p)
{
	if (unsafe_in_capture())
		return fail(cudaErrorStreamCaptureUnsupported);
	if (!p)
		return cudaSuccess;
	auto it = allocs.find((uintptr_t)p);
	if (it == allocs.end())
		return fail(cudaErrorInvalidDevicePointer);
	used -= it->second;
	allocs.erase(it);
	free(p);
	return cudaSuccess;
}

cudaError_t cudaHostAlloc(void **p, size_t n, unsigned flags)
{
	(void)flags;
	*p = NULL;
	if (unsafe_in_capture())
		return fail(cudaErrorStreamCaptureUnsupported);
	*p = aligned_alloc(256, (n + 255) & ~(size_t)255);
	if (!*p)
		return fail(cudaErrorMemoryAllocation);
	pinned[(uintptr_t)*p] = n;
	return cudaSuccess;
}

cudaError_t cudaFreeHost(void *p)
{
	if (unsafe_in_capture())
		return fail(cudaErrorStreamCaptureUnsupported);
	pinned.erase((uintptr_t)p);
	free(p);
	return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind,
			    cudaStream_t st)
{
	if (n == 0)
		return cudaSuccess;
	bool ok = true;
	const void *host = NULL;
	switch (kind) {
	case cudaMemcpyHostToDevice: ok = on_device(dst, n) && !on_device(src, n); host = src; break;
	case cudaMemcpyDeviceToHost: ok = on_device(src, n) && !on_device(dst, n); host = dst; break;
	case cudaMemcpyDeviceToDevice: ok = on_device(src, n) && on_device(dst, n); break;
	default: break;
	}
	if (!ok)
		return fail(cudaErrorInvalidValue);
	if (capturing && st == cap_stream && host && !inside(pinned, host, n)) {
		cap_invalid = true; /* a pageable copy cannot be a graph node */
		return fail(cudaErrorStreamCaptureUnsupported);
	}
	if (capturing && st == cap_stream) {
		capturing->ops.push_back([dst, src, n]() { memmove(dst, src, n); });
		return cudaSuccess;
	}
	memmove(dst, src, n);
	return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t st, enum cudaStreamCaptureMode mode)
{
	if (!st || capturing || mode != cudaStreamCaptureModeThreadLocal)
		return fail(cudaErrorInvalidValue); /* the one mode modelled */
	capturing = new emu_graph;
	cap_stream = st;
	cap_thread = pthread_self();
	cap_invalid = false;
	return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t st, cudaGraph_t *g)
{
	*g = NULL;
	if (!st || !capturing || st != cap_stream)
		return fail(cudaErrorInvalidValue);
	emu_graph *x = capturing;
	capturing = NULL;
	cap_stream = NULL;
	if (cap_invalid) {
		delete x;
		return fail(cudaErrorStreamCaptureInvalidated);
	}
	*g = x;
	return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t *x, cudaGraph_t g, unsigned long long flags)
{
	(void)flags;
	*x = new emu_graph(*g);
	return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t x, cudaStream_t st)
{
	if (!st || capturing)
		return fail(cudaErrorInvalidValue);
	for (auto &op : x->ops)
		op();
	graph_launches++;
	return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t x)
{
	delete x;
	return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t g)
{
	delete g;
	return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *st, unsigned flags)
{
	(void)flags;
	*st = (cudaStream_t)calloc(1, sizeof(struct emu_stream));
	return *st ? cudaSuccess : fail(cudaErrorMemoryAllocation);
}

cudaError_t cudaStreamDestroy(cudaStream_t st)
{
	free(st);
	return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t st)
{
	if (capturing) { /* waiting during a capture: illegal on a GPU too */
		unsafe_in_capture();
		return fail(cudaErrorStreamCaptureUnsupported);
	}
	return st ? cudaSuccess : fail(cudaErrorInvalidResourceHandle);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *ev, unsigned flags)
{
	(void)flags;
	*ev = (cudaEvent_t)calloc(1, sizeof(struct emu_event));
	return *ev ? cudaSuccess : fail(cudaErrorMemoryAllocation);
}

cudaError_t cudaEventDestroy(cudaEvent_t ev)
{
	free(ev);
	return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t ev, cudaStream_t st)
{
	(void)st;
	ev->recorded = 1;
	return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t ev)
{
	(void)ev;
	return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t ev)
{
	(void)ev;
	return cudaSuccess;
}

cudaError_t cudaGetLastError(void)
{
	cudaError_t e = last_error;
	last_error = cudaSuccess;
	return e;
}

const char *cudaGetErrorString(cudaError_t e)
{
	switch (e) {
	case cudaSuccess: return "no error";
	case cudaErrorInvalidValue: return "invalid argument";
	case cudaErrorMemoryAllocation: return "out of memory";
	case cudaErrorInvalidConfiguration: return "invalid configuration argument";
	default: return "emulated cuda error";
	}
}

size_t emu_cuda_used(void)
{
	return used;
}

unsigned long emu_cuda_launches(void)
{
	return launches;
}

unsigned long emu_cuda_graph_launches(void)
{
	return graph_launches;
}

} /* extern "C" */
