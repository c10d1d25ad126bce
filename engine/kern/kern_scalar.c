/* Portable kernels over on-the-fly quantized activations: the scalar table and shared helpers. */
#include "engine/kern/kern.h"

#include <math.h>
#include <string.h>

enum md_act_fmt md_kern_act_fmt(enum md_dtype t)
{
	switch (t) {
	case MD_DT_F32:
	case MD_DT_F16:
	case MD_DT_BF16:
		return MD_ACT_F32;
	case MD_DT_Q8_0:
	case MD_DT_Q4_0:
	case MD_DT_Q4_1:
	case MD_DT_Q5_0:
	case MD_DT_Q5_1:
	case MD_DT_IQ4_NL:
	case MD_DT_MXFP4:
		return MD_ACT_Q8B;
	case MD_DT_Q2_K:
	case MD_DT_Q3_K:
	case MD_DT_IQ4_XS:
	case MD_DT_Q4_K:
	case MD_DT_Q5_K:
	case MD_DT_Q6_K:
		return MD_ACT_Q8K;
	default:
		return MD_ACT_NONE;
	}
}

size_t md_kern_act_row_size(enum md_act_fmt f, int64_t n)
{
	switch (f) {
	case MD_ACT_F32:
		return (size_t)n * sizeof(float);
	case MD_ACT_Q8B:
		return (size_t)(n / 32) * (sizeof(struct md_q8b) + sizeof(float));
	case MD_ACT_Q8K:
		return (size_t)(n / 256) * sizeof(struct md_q8k);
	default:
		return 0;
	}
}

size_t md_kern_lanes_size(int64_t n)
{
	/* AVX2's and AVX-512's layout (kern.h): per block and token slot 32 bytes and a scale,
	 * whether the block is in a run of 8 or 16 or left over; the rest is slack. */
	return (size_t)(n / 32) * (MD_KERN_LANES * sizeof(float) + MD_KERN_LANES * 32) +
	       MD_KERN_LANES * 96;
}

static inline float ld_f16(const uint8_t *p)
{
	return md_f16_to_f32((uint16_t)(p[0] | (p[1] << 8)));
}

static inline int8_t q8_round(float v)
{
	int q = (int)lrintf(v);
	return (int8_t)(q > 127 ? 127 : q < -127 ? -127 : q);
}

static void quant_q8b(const float *x, struct md_q8b *y, int64_t n)
{
	for (int64_t b = 0; b < n / 32; b++, x += 32) {
		float amax = 0;
		for (int i = 0; i < 32; i++)
			amax = fmaxf(amax, fabsf(x[i]));
		float d = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
		int s = 0;
		for (int i = 0; i < 32; i++) {
			y[b].qs[i] = q8_round(x[i] * id);
			s += y[b].qs[i];
		}
		y[b].d = d;
		y[b].s = s;
		((float *)(y + n / 32))[b] = d;
	}
}

static void quant_q8k(const float *x, struct md_q8k *y, int64_t n)
{
	for (int64_t b = 0; b < n / 256; b++, x += 256) {
		float amax = 0;
		for (int i = 0; i < 256; i++)
			amax = fmaxf(amax, fabsf(x[i]));
		float id = amax > 0 ? 127.0f / amax : 0.0f;
		y[b].d = amax / 127.0f;
		for (int g = 0; g < 16; g++) {
			int s = 0;
			for (int i = 16 * g; i < 16 * g + 16; i++) {
				y[b].qs[i] = q8_round(x[i] * id);
				s += y[b].qs[i];
			}
			y[b].bsums[g] = (int16_t)s;
		}
	}
}

/* One-row dot products; the tile entry points below loop over tokens. */

static float dot1_q8_0(int64_t n, const uint8_t *w, const struct md_q8b *a)
{
	float acc = 0;
	for (int64_t b = 0; b < n / 32; b++, w += 34) {
		const int8_t *q = (const int8_t *)(w + 2);
		int s = 0;
		for (int i = 0; i < 32; i++)
			s += q[i] * a[b].qs[i];
		acc += ld_f16(w) * a[b].d * (float)s;
	}
	return acc;
}

static float dot1_q4_0(int64_t n, const uint8_t *w, const struct md_q8b *a)
{
	float acc = 0;
	for (int64_t b = 0; b < n / 32; b++, w += 18) {
		const uint8_t *q = w + 2;
		int s = 0;
		for (int i = 0; i < 16; i++)
			s += (q[i] & 15) * a[b].qs[i] + (q[i] >> 4) * a[b].qs[i + 16];
		acc += ld_f16(w) * a[b].d * (float)(s - 8 * a[b].s);
	}
	return acc;
}

static inline uint32_t ld_u32(const uint8_t *p)
{
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* q4_1 (bs 20), q5_0 (bs 22, no min), q5_1 (bs 24): integer sum of q * a per block, then
 * d * da * sum (- 16 * d * da * s for q5_0) (+ m * da * s for the types with a min). */
static float dot1_q451(int64_t n, const uint8_t *w, const struct md_q8b *a, enum md_dtype t)
{
	const int bs = t == MD_DT_Q4_1 ? 20 : t == MD_DT_Q5_0 ? 22 : 24;
	const int qso = t == MD_DT_Q4_1 ? 4 : t == MD_DT_Q5_0 ? 6 : 8;
	float acc = 0;
	for (int64_t b = 0; b < n / 32; b++, w += bs) {
		const uint8_t *q = w + qso;
		const uint32_t h = t == MD_DT_Q4_1 ? 0 : ld_u32(w + qso - 4);
		int s = 0;
		for (int i = 0; i < 16; i++) {
			int lo = (q[i] & 15) | (int)((h >> i) & 1) << 4;
			int hi = (q[i] >> 4) | (int)((h >> (i + 16)) & 1) << 4;
			s += lo * a[b].qs[i] + hi * a[b].qs[i + 16];
		}
		if (t == MD_DT_Q5_0)
			acc += ld_f16(w) * a[b].d * (float)(s - 16 * a[b].s);
		else
			acc += ld_f16(w) * a[b].d * (float)s + ld_f16(w + 2) * a[b].d * (float)a[b].s;
	}
	return acc;
}

/* 32 nibble indexes into a level table (signed 8-bit) against one q8b block. */
static int dot32_levels(const uint8_t *qs, const int8_t *levels, const int8_t *a)
{
	int s = 0;
	for (int i = 0; i < 16; i++)
		s += levels[qs[i] & 15] * a[i] + levels[qs[i] >> 4] * a[i + 16];
	return s;
}

static float dot1_iq4_nl(int64_t n, const uint8_t *w, const struct md_q8b *a)
{
	float acc = 0;
	for (int64_t b = 0; b < n / 32; b++, w += 18)
		acc += ld_f16(w) * a[b].d * (float)dot32_levels(w + 2, md_iq4nl_levels, a[b].qs);
	return acc;
}

static float dot1_mxfp4(int64_t n, const uint8_t *w, const struct md_q8b *a)
{
	float acc = 0;
	for (int64_t b = 0; b < n / 32; b++, w += 17)
		acc += md_e8m0_half(w[0]) * a[b].d * (float)dot32_levels(w + 1, md_mxfp4_levels, a[b].qs);
	return acc;
}

/* iq4_xs: eight iq4_nl sub-blocks with 6-bit scales ls - 32, all against one q8k block. */
static float dot1_iq4_xs(int64_t n, const uint8_t *w, const struct md_q8k *a)
{
	float acc = 0;
	for (int64_t b = 0; b < n / 256; b++, w += 136) {
		const unsigned sh = (unsigned)(w[2] | w[3] << 8);
		int sumi = 0;
		for (int ib = 0; ib < 8; ib++) {
			int ls = ((w[4 + ib / 2] >> (4 * (ib % 2))) & 15) | (int)((sh >> (2 * ib)) & 3) << 4;
			sumi += (ls - 32) * dot32_levels(w + 8 + 16 * ib, md_iq4nl_levels, a[b].qs + 32 * ib);
		}
		acc += ld_f16(w) * a[b].d * (float)sumi;
	}
	return acc;
}

void md_kern__k_scales(const uint8_t *s, uint8_t sc[8], uint8_t m[8])
{
	for (int j = 0; j < 4; j++) {
		sc[j] = s[j] & 63;
		m[j] = s[j + 4] & 63;
		sc[j + 4] = (uint8_t)((s[j + 8] & 15) | ((s[j] >> 6) << 4));
		m[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
	}
}

/* q4_K (qh == NULL, 144-byte blocks) and q5_K (176-byte blocks). */
static float dot1_qk45(int64_t n, const uint8_t *w, const struct md_q8k *a, int five)
{
	float acc = 0;
	const size_t bs = five ? 176 : 144;
	for (int64_t b = 0; b < n / 256; b++, w += bs) {
		uint8_t sc[8], m[8];
		md_kern__k_scales(w + 4, sc, m);
		const uint8_t *qh = five ? w + 16 : NULL, *qs = w + (five ? 48 : 16);
		int sumi = 0, summ = 0;
		for (int s = 0; s < 8; s++) {
			const int p = s / 2, hi = s & 1;
			int si = 0;
			for (int l = 0; l < 32; l++) {
				int q = hi ? qs[32 * p + l] >> 4 : qs[32 * p + l] & 15;
				if (qh)
					q |= ((qh[l] >> s) & 1) << 4;
				si += q * a[b].qs[32 * s + l];
			}
			sumi += sc[s] * si;
			summ += m[s] * (a[b].bsums[2 * s] + a[b].bsums[2 * s + 1]);
		}
		acc += ld_f16(w) * a[b].d * (float)sumi - ld_f16(w + 2) * a[b].d * (float)summ;
	}
	return acc;
}

/* q2_K: per 16-element sub-block g, sc_g * sum(q * a) and m_g * bsums[g]. */
static float dot1_q2_K(int64_t n, const uint8_t *w, const struct md_q8k *a)
{
	float acc = 0;
	for (int64_t b = 0; b < n / 256; b++, w += 84) {
		const uint8_t *sc = w, *qs = w + 16;
		int sumi = 0, summ = 0;
		for (int g = 0; g < 16; g++) {
			int si = 0;
			for (int e = 16 * g; e < 16 * g + 16; e++) {
				int h = e / 128, j = (e % 128) / 32, l = e % 32;
				si += ((qs[32 * h + l] >> (2 * j)) & 3) * a[b].qs[e];
			}
			sumi += (sc[g] & 15) * si;
			summ += (sc[g] >> 4) * a[b].bsums[g];
		}
		acc += ld_f16(w + 80) * a[b].d * (float)sumi - ld_f16(w + 82) * a[b].d * (float)summ;
	}
	return acc;
}

/* The 16 signed 6-bit scales (stored value - 32) of a q3_K block (12 bytes at s). */
static void q3k_scales(const uint8_t *s, int16_t sc[16])
{
	for (int i = 0; i < 16; i++) {
		int lo = i < 8 ? s[i] & 15 : s[i - 8] >> 4;
		int hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
		sc[i] = (int16_t)((lo | hi << 4) - 32);
	}
}

/* q3_K: q = u - 4 with u = low 2 bits | hmask bit << 2; per sub-block g,
 * sc_g * (sum(u * a) - 4 * bsums[g]). */
static float dot1_q3_K(int64_t n, const uint8_t *w, const struct md_q8k *a)
{
	float acc = 0;
	for (int64_t b = 0; b < n / 256; b++, w += 110) {
		const uint8_t *hm = w, *qs = w + 32;
		int16_t sc[16];
		q3k_scales(w + 96, sc);
		int sumi = 0;
		for (int g = 0; g < 16; g++) {
			int si = 0;
			for (int e = 16 * g; e < 16 * g + 16; e++) {
				int h = e / 128, j = (e % 128) / 32, l = e % 32;
				int u = ((qs[32 * h + l] >> (2 * j)) & 3) | ((hm[l] >> (e / 32)) & 1) << 2;
				si += u * a[b].qs[e];
			}
			sumi += sc[g] * (si - 4 * a[b].bsums[g]);
		}
		acc += ld_f16(w + 108) * a[b].d * (float)sumi;
	}
	return acc;
}

static float dot1_q6_K(int64_t n, const uint8_t *w, const struct md_q8k *a)
{
	float acc = 0;
	for (int64_t b = 0; b < n / 256; b++, w += 210) {
		const uint8_t *ql = w, *qh = w + 128;
		const int8_t *sc = (const int8_t *)(w + 192);
		int sumi = 0;
		for (int e0 = 0; e0 < 256; e0 += 16) {
			int si = 0;
			for (int e = e0; e < e0 + 16; e++) {
				int h = e / 128, r = e % 128, k = r / 32, l = r % 32;
				int lo = ql[64 * h + l + 32 * (k & 1)];
				lo = k < 2 ? lo & 15 : lo >> 4;
				int q = lo | (((qh[32 * h + l] >> (2 * k)) & 3) << 4);
				si += (q - 32) * a[b].qs[e];
			}
			sumi += sc[e0 / 16] * si;
		}
		acc += ld_f16(w + 208) * a[b].d * (float)sumi;
	}
	return acc;
}

static float dot1_float(enum md_dtype t, int64_t n, const uint8_t *w, const float *x)
{
	float acc[8] = { 0 };
	for (int64_t i = 0; i < n; i++) {
		float v;
		if (t == MD_DT_F32)
			memcpy(&v, w + 4 * i, 4);
		else if (t == MD_DT_F16)
			v = ld_f16(w + 2 * i);
		else
			v = md_bf16_to_f32((uint16_t)(w[2 * i] | (w[2 * i + 1] << 8)));
		acc[i & 7] += v * x[i];
	}
	return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

#define TILE(name, expr)                                                                         \
	static void name(int64_t n, const void *w, const void *a, size_t as, int nt, float *y,     \
			 size_t ys)                                                                 \
	{                                                                                          \
		for (int t = 0; t < nt; t++) {                                                     \
			const void *at = (const uint8_t *)a + (size_t)t * as;                      \
			y[(size_t)t * ys] = (expr);                                                \
		}                                                                                  \
	}

TILE(dot_f32, dot1_float(MD_DT_F32, n, w, at))
TILE(dot_f16, dot1_float(MD_DT_F16, n, w, at))
TILE(dot_bf16, dot1_float(MD_DT_BF16, n, w, at))
TILE(dot_q8_0, dot1_q8_0(n, w, at))
TILE(dot_q4_0, dot1_q4_0(n, w, at))
TILE(dot_q4_1, dot1_q451(n, w, at, MD_DT_Q4_1))
TILE(dot_q5_0, dot1_q451(n, w, at, MD_DT_Q5_0))
TILE(dot_q5_1, dot1_q451(n, w, at, MD_DT_Q5_1))
TILE(dot_q2_K, dot1_q2_K(n, w, at))
TILE(dot_q3_K, dot1_q3_K(n, w, at))
TILE(dot_iq4_nl, dot1_iq4_nl(n, w, at))
TILE(dot_iq4_xs, dot1_iq4_xs(n, w, at))
TILE(dot_mxfp4, dot1_mxfp4(n, w, at))
TILE(dot_q4_K, dot1_qk45(n, w, at, 0))
TILE(dot_q5_K, dot1_qk45(n, w, at, 1))
TILE(dot_q6_K, dot1_q6_K(n, w, at))

static float vdot(const float *a, const float *b, int64_t n)
{
	float acc[8] = { 0 };
	int64_t i = 0;
	for (; i + 8 <= n; i += 8)
		for (int j = 0; j < 8; j++)
			acc[j] += a[i + j] * b[i + j];
	float s = 0;
	for (; i < n; i++)
		s += a[i] * b[i];
	return s + ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

static void vaxpy(float *y, float a, const float *x, int64_t n)
{
	for (int64_t i = 0; i < n; i++)
		y[i] += a * x[i];
}

static float vdot_f16(const float *a, const uint16_t *b, int64_t n)
{
	float acc[8] = { 0 };
	int64_t i = 0;
	for (; i + 8 <= n; i += 8)
		for (int j = 0; j < 8; j++)
			acc[j] += a[i + j] * md_f16_to_f32(b[i + j]);
	float s = 0;
	for (; i < n; i++)
		s += a[i] * md_f16_to_f32(b[i]);
	return s + ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

static void vaxpy_f16(float *y, float a, const uint16_t *x, int64_t n)
{
	for (int64_t i = 0; i < n; i++)
		y[i] += a * md_f16_to_f32(x[i]);
}

static float vsumsq(const float *x, int64_t n)
{
	return vdot(x, x, n);
}

static void vscale_mul(float *y, const float *x, float s, const float *w, int64_t n)
{
	for (int64_t i = 0; i < n; i++)
		y[i] = x[i] * s * w[i];
}

const struct md_kern md_kern_scalar = {
	.name = "scalar",
	.dot = {
		[MD_DT_F32] = dot_f32,
		[MD_DT_F16] = dot_f16,
		[MD_DT_BF16] = dot_bf16,
		[MD_DT_Q8_0] = dot_q8_0,
		[MD_DT_Q4_0] = dot_q4_0,
		[MD_DT_Q4_1] = dot_q4_1,
		[MD_DT_Q5_0] = dot_q5_0,
		[MD_DT_Q5_1] = dot_q5_1,
		[MD_DT_Q2_K] = dot_q2_K,
		[MD_DT_Q3_K] = dot_q3_K,
		[MD_DT_IQ4_NL] = dot_iq4_nl,
		[MD_DT_IQ4_XS] = dot_iq4_xs,
		[MD_DT_MXFP4] = dot_mxfp4,
		[MD_DT_Q4_K] = dot_q4_K,
		[MD_DT_Q5_K] = dot_q5_K,
		[MD_DT_Q6_K] = dot_q6_K,
	},
	.quant_q8b = quant_q8b,
	.quant_q8k = quant_q8k,
	.dot_f32 = vdot,
	.axpy_f32 = vaxpy,
	.dot_f32_f16 = vdot_f16,
	.axpy_f16 = vaxpy_f16,
	.sumsq_f32 = vsumsq,
	.scale_mul_f32 = vscale_mul,
};

#if !defined(__x86_64__)
const struct md_kern *md_kern_avx2_table(void)
{
	return NULL;
}

const struct md_kern *md_kern_avx512_table(void)
{
	return NULL;
}
#endif
