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

static inline unsigned short __half_as_ushort(__half h)
{
	return h.x;
}

/* float to IEEE binary16, rounded to nearest even (overflow to infinity, NaN kept a NaN). */
static inline __half __float2half_rn(float f)
{
	union {
		float f;
		uint32_t u;
	} c;
	c.f = f;
	const uint32_t x = c.u, sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
	__half h;
	if (ax > 0x7f800000u) {
		h.x = (unsigned short)(sign | 0x7e00u);
		return h;
	}
	if (ax >= 0x477ff000u) { /* rounds to 65520 or more: infinity */
		h.x = (unsigned short)(sign | 0x7c00u);
		return h;
	}
	if (ax < 0x38800000u) { /* below 2^-14: a subnormal half, or zero */
		const float a = c.f < 0 ? -c.f : c.f;
		const float v = a * 16777216.0f; /* in units of 2^-24 */
		float r = nearbyintf(v);         /* to nearest even, the default rounding mode */
		h.x = (unsigned short)(sign | (unsigned)r);
		return h;
	}
	uint32_t mant = ax & 0x7fffffu, e = (ax >> 23) - 127 + 15;
	uint32_t hm = mant >> 13, rest = mant & 0x1fffu;
	uint32_t v = (e << 10) | hm;
	if (rest > 0x1000u || (rest == 0x1000u && (hm & 1)))
		v++;
	h.x = (unsigned short)(sign | v);
	return h;
}

#endif
