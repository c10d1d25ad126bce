/* AVX-512 (F, BW, VL, VNNI) kernels: kern_avx2.c compiled again with 512-bit float loops and
 * vpdpbusd for the q8_0 / q4_0 integer dots. */
#define KERN_AVX512 1
#include "engine/kern/kern_avx2.c"
