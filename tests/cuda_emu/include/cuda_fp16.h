/* __half as moed's kernels use it, for the CUDA emulator. */
#ifndef MD_CUDA_EMU_FP16_H
#define MD_CUDA_EMU_FP16_H

#include <math.h>
#include <stdint.h>

struct __half {
	unsigned short x;
};

static inline __half __ushort_as_half(unsigned short u)
{
	__half h;
	h.x = u;
	return h;
}

/* IEEE binary16 to float, exactly (subnormals, infinities and NaN included). */
static inline float __half2float(__half h)
{
	const unsigned s = (h.x >> 15) & 1, e = (h.x >> 10) & 0x1f, m = h.x & 0x3ff;
	float v;
	if (e == 0)
		v = ldexpf((float)m, -24);
	else if (e == 31)
		v = m ? NAN : INFINITY;
	else
		v = ldexpf((float)(m | 0x400), (int)e - 25);
	return s ? -v : v;
}

#endif
