/* The device's streaming bandwidth as the benchmarks quote it: the bound of a decode on the
 * device. */
#ifndef MD_BENCH_DEV_COPY_BW_H
#define MD_BENCH_DEV_COPY_BW_H

#include <stddef.h>

#include "engine/backend.h"

/* Bytes per second of device-to-device copies of n bytes through b's forward ops (a copy reads
 * and writes each byte, so 2 n per copy), the best of 5 after one warm-up. 0 when it cannot be
 * measured (no room for two buffers of n, or a failed copy). */
double md_bench_dev_copy_bw(struct md_backend *b, size_t n);

#endif
