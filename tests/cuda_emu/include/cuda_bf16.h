/* bf16 as moed's kernels use it (they read the bits themselves), for the CUDA emulator. */
#ifndef MD_CUDA_EMU_BF16_H
#define MD_CUDA_EMU_BF16_H
#include "cuda_fp16.h"
#endif
