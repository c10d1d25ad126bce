/* Runtime CPU feature detection and the choice of compute kernels (env MOED_KERNELS). */
#ifndef MD_CPU_H
#define MD_CPU_H

#include <stdbool.h>

#include "engine/kern/kern.h"

struct md_cpu_features {
	bool avx2, fma, f16c;
	bool avx512f, avx512bw, avx512vl, avx512vnni, avx512bf16;
};

/* Features of the running CPU (all false off x86). */
const struct md_cpu_features *md_cpu_features(void);

/*
 * The kernels to use, chosen once per process (thread-safe): the best table the CPU runs,
 * unless MOED_KERNELS says otherwise: "ref" (NULL: the portable dequantize-and-dot path),
 * "scalar", "avx2", "avx512" or "auto". A level the CPU cannot run falls back to the best
 * lower one, with one warning on stderr.
 */
const struct md_kern *md_kern_active(void);

/* Replace the active kernels (NULL: reference path). For tests and benchmarks only: call it
 * while no matmul runs. */
void md_kern_set_active(const struct md_kern *k);

/* The table for a level name ("scalar", "avx2", "avx512"), NULL when this CPU or build lacks
 * it. For tests and benchmarks. */
const struct md_kern *md_kern_by_name(const char *name);

#endif
