/* Weight types: GGML-compatible block layouts, F16/BF16 conversion, scalar quantizers and reference kernels. */
#include "engine/quant.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/*
 * Block layouts (all little-endian, packed, as GGML stores them in GGUF files):
 *
 *   q4_0  (32 elems, 18 B):  f16 d | u8 qs[16]
 *         elem j = (lo nibble of qs[j] - 8) * d, elem j+16 = (hi nibble of qs[j] - 8) * d.
 *   q4_1  (32 elems, 20 B):  f16 d | f16 m | u8 qs[16]; nibbles as q4_0, elem = q * d + m.
 *   q5_0  (32 elems, 22 B):  f16 d | u32 qh | u8 qs[16]; q = nibble as q4_0 | bit e of qh << 4
 *         for element e, elem = (q - 16) * d.
 *   q5_1  (32 elems, 24 B):  f16 d | f16 m | u32 qh | u8 qs[16]; q as q5_0, elem = q * d + m.
 *   q8_0  (32 elems, 34 B):  f16 d | i8 qs[32];  elem j = qs[j] * d.
 *   iq4_nl (32 elems, 18 B): f16 d | u8 qs[16]; nibbles as q4_0 index md_iq4nl_levels,
 *         elem = d * level.
 *   mxfp4 (32 elems, 17 B):  u8 e | u8 qs[16]; nibbles as q4_0 index md_mxfp4_levels (E2M1
 *         values times two), elem = level * 2^(e - 128) (half the E8M0 scale 2^(e - 127)).
 *   iq4_xs (256 elems, 136 B): f16 d | u16 scales_h | u8 scales_l[4] | u8 qs[128]
 *         8 sub-blocks of 32, each an iq4_nl block (qs[16 ib ..]) with scale d * (ls - 32):
 *         ls = ((scales_l[ib / 2] >> 4 (ib % 2)) & 15) | ((scales_h >> 2 ib) & 3) << 4.
 *   q4_K  (256 elems, 144 B): f16 d | f16 dmin | u8 scales[12] | u8 qs[128]
 *   q5_K  (256 elems, 176 B): f16 d | f16 dmin | u8 scales[12] | u8 qh[32] | u8 qs[128]
 *         8 sub-blocks of 32 with 6-bit scale sc[s] and 6-bit min m[s]:
 *         elem = d * sc[s] * q - dmin * m[s].  Sub-blocks 2p and 2p+1 share qs[32p .. 32p+31]:
 *         low nibbles are sub-block 2p, high nibbles 2p+1.  For q5_K the fifth bit of element l
 *         of sub-block s is bit s of qh[l].
 *         scales[12]: for s < 4, sc[s] = scales[s] & 63 and m[s] = scales[s+4] & 63; for s >= 4,
 *         sc[s] = (scales[s+4] & 15) | (scales[s-4] >> 6) << 4 and
 *         m[s] = (scales[s+4] >> 4) | (scales[s] >> 6) << 4.
 *   q2_K  (256 elems, 84 B): u8 scales[16] | u8 qs[64] | f16 d | f16 dmin
 *         16 sub-blocks of 16: scales[e / 16] holds a 4-bit scale (low nibble) and 4-bit min
 *         (high nibble), elem = d * sc * q - dmin * m.  q is 2 bits: with h = e / 128,
 *         j = (e % 128) / 32, l = e % 32 it is bits 2j, 2j+1 of qs[32h + l].
 *   q3_K  (256 elems, 110 B): u8 hmask[32] | u8 qs[64] | u8 scales[12] | f16 d
 *         16 sub-blocks of 16 with signed 6-bit scales sc[i] - 32: the low 4 bits of sc[i] are
 *         the low nibble of scales[i] (i < 8) or the high nibble of scales[i - 8], the top 2
 *         bits are bits 2 * (i / 4) of scales[8 + i % 4].  The low 2 bits of q come from qs as
 *         in q2_K, the third is bit e / 32 of hmask[e % 32]; elem = d * (sc - 32) * (q - 4).
 *   q6_K  (256 elems, 210 B): u8 ql[128] | u8 qh[64] | i8 scales[16] | f16 d
 *         elem e = d * scales[e / 16] * (q - 32), q 6 bits.  With h = e / 128, r = e % 128,
 *         k = r / 32, l = r % 32: low 4 bits are ql[64h + l + 32(k & 1)] (low nibble when
 *         k < 2, high nibble otherwise), high 2 bits are (qh[32h + l] >> 2k) & 3.
 *
 * Dequantization gives the same float bits as GGML's for every type here (checked against
 * libggml's to_float on 262144 values per type). Quantizers: q4_1, q5_0, q5_1 and mxfp4 use
 * GGML's reference rounding and write the same blocks llama-quantize writes without an
 * importance matrix; q4_0, q8_0 and the K / IQ types use least-squares searches of their own
 * (equal or lower squared error than GGML's on N(0,1) rows, never the same bytes).
 */

#define Q4_0_BYTES 18
#define Q4_1_BYTES 20
#define Q5_0_BYTES 22
#define Q5_1_BYTES 24
#define Q8_0_BYTES 34
#define IQ4_NL_BYTES 18
#define IQ4_XS_BYTES 136
#define MXFP4_BYTES 17
#define Q2_K_BYTES 84
#define Q3_K_BYTES 110
#define Q4_K_BYTES 144
#define Q5_K_BYTES 176
#define Q6_K_BYTES 210

const int8_t md_iq4nl_levels[16] = { -127, -104, -83, -65, -49, -35, -22, -10,
				     1, 13, 25, 38, 53, 69, 89, 113 };

const int8_t md_mxfp4_levels[16] = { 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12 };

float md_e8m0_half(uint8_t e)
{
	/* 2^(e - 128): subnormal for e = 0, 1 (bit 21 + e of the mantissa), else exponent
	 * field e - 1. e = 255 (NaN in E8M0) gives 2^127, as GGML decodes it. */
	uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
	float f;

	memcpy(&f, &bits, sizeof(f));
	return f;
}

static const struct md_dtype_info dtype_table[MD_DT_COUNT] = {
	[0] = { "f32", 1, 4, true },
	[1] = { "f16", 1, 2, true },
	[2] = { "q4_0", 32, 18, true },
	[3] = { "q4_1", 32, 20, true },
	[6] = { "q5_0", 32, 22, true },
	[7] = { "q5_1", 32, 24, true },
	[8] = { "q8_0", 32, 34, true },
	[9] = { "q8_1", 32, 36, false },
	[10] = { "q2_K", 256, 84, true },
	[11] = { "q3_K", 256, 110, true },
	[12] = { "q4_K", 256, 144, true },
	[13] = { "q5_K", 256, 176, true },
	[14] = { "q6_K", 256, 210, true },
	[15] = { "q8_K", 256, 292, false },
	/* Types moed has no kernels for, sized so that files holding them still parse and the
	 * loader can name the type it refuses. */
	[16] = { "iq2_xxs", 256, 66, false },
	[17] = { "iq2_xs", 256, 74, false },
	[18] = { "iq3_xxs", 256, 98, false },
	[19] = { "iq1_s", 256, 50, false },
	[20] = { "iq4_nl", 32, 18, true },
	[21] = { "iq3_s", 256, 110, false },
	[22] = { "iq2_s", 256, 82, false },
	[23] = { "iq4_xs", 256, 136, true },
	[24] = { "i8", 1, 1, false },
	[25] = { "i16", 1, 2, false },
	[26] = { "i32", 1, 4, false },
	[27] = { "i64", 1, 8, false },
	[28] = { "f64", 1, 8, false },
	[29] = { "iq1_m", 256, 56, false },
	[30] = { "bf16", 1, 2, true },
	[34] = { "tq1_0", 256, 54, false },
	[35] = { "tq2_0", 256, 66, false },
	[39] = { "mxfp4", 32, 17, true },
};

static _Noreturn void quant_fail(const char *what, enum md_dtype t)
{
	fprintf(stderr, "moed: quant: %s: type %d\n", what, (int)t);
	abort();
}

const struct md_dtype_info *md_dtype_info(uint32_t type)
{
	if (type >= MD_DT_COUNT || dtype_table[type].name == NULL)
		return NULL;
	return &dtype_table[type];
}

const char *md_dtype_supported_names(char *buf, size_t len)
{
	size_t used = 0;

	if (len == 0)
		return buf;
	buf[0] = '\0';
	for (uint32_t t = 0; t < MD_DT_COUNT; t++) {
		if (dtype_table[t].name == NULL || !dtype_table[t].supported)
			continue;
		int w = snprintf(buf + used, len - used, "%s%s", used ? ", " : "", dtype_table[t].name);
		if (w < 0 || (size_t)w >= len - used)
			break;
		used += (size_t)w;
	}
	return buf;
}

size_t md_dtype_row_size(enum md_dtype t, int64_t n)
{
	const struct md_dtype_info *info = md_dtype_info((uint32_t)t);

	if (info == NULL || n < 0 || n % info->blck != 0)
		return 0;
	return (size_t)(n / info->blck) * info->type_size;
}

/* ---- F16 / BF16 ---- */

static inline uint32_t f32_bits(float f)
{
	uint32_t u;

	memcpy(&u, &f, sizeof(u));
	return u;
}

static inline float bits_f32(uint32_t u)
{
	float f;

	memcpy(&f, &u, sizeof(f));
	return f;
}

float md_f16_to_f32(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000) << 16;
	uint32_t exp = (h >> 10) & 0x1f;
	uint32_t mant = h & 0x3ff;

	if (exp == 0x1f) /* inf or NaN: payload moves to the top of the f32 mantissa */
		return bits_f32(sign | 0x7f800000u | (mant << 13));
	if (exp == 0) {
		/* Zero or subnormal: mant * 2^-24 is exact in f32. */
		float v = (float)mant * 0x1p-24f;
		return sign ? -v : v;
	}
	return bits_f32(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t md_f32_to_f16(float f)
{
	uint32_t x = f32_bits(f);
	uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
	uint32_t ax = x & 0x7fffffffu;
	uint32_t e = ax >> 23;

	if (ax > 0x7f800000u) /* NaN: keep the top payload bits, force quiet */
		return sign | 0x7e00 | (uint16_t)((ax >> 13) & 0x3ff);
	if (ax >= 0x477ff000u) /* >= 65520 rounds (ties to even) to infinity; also inf */
		return sign | 0x7c00;
	if (e >= 113) {
		/* Normal half: rebias the exponent, round the 13 dropped bits to nearest even.
		 * A carry out of the mantissa correctly bumps the exponent. */
		uint32_t h = ((e - 112) << 10) | ((ax >> 13) & 0x3ff);
		uint32_t rem = ax & 0x1fff;

		if (rem > 0x1000 || (rem == 0x1000 && (h & 1)))
			h++;
		return sign | (uint16_t)h;
	}
	if (e < 102) /* below 2^-25: rounds to zero */
		return sign;
	{
		/* Subnormal half: value is m * 2^(e-150), in units of 2^-24 that is m >> (126-e). */
		uint32_t m = (ax & 0x7fffff) | 0x800000;
		uint32_t s = 126 - e; /* 14 .. 24 */
		uint32_t h = m >> s;
		uint32_t rem = m & ((1u << s) - 1);
		uint32_t half = 1u << (s - 1);

		if (rem > half || (rem == half && (h & 1)))
			h++; /* may become 0x400, the smallest normal: still the right encoding */
		return sign | (uint16_t)h;
	}
}

float md_bf16_to_f32(uint16_t h)
{
	return bits_f32((uint32_t)h << 16);
}

uint16_t md_f32_to_bf16(float f)
{
	uint32_t x = f32_bits(f);

	if ((x & 0x7fffffffu) > 0x7f800000u) /* NaN: truncate, force quiet so it stays NaN */
		return (uint16_t)((x >> 16) | 0x40);
	x += 0x7fffu + ((x >> 16) & 1);
	return (uint16_t)(x >> 16);
}

static inline float load_f16(const uint8_t *p)
{
	return md_f16_to_f32((uint16_t)(p[0] | (p[1] << 8)));
}

static inline void store_f16(uint8_t *p, float v)
{
	uint16_t h = md_f32_to_f16(v);

	p[0] = (uint8_t)(h & 0xff);
	p[1] = (uint8_t)(h >> 8);
}

/* ---- dequantization, one block at a time ---- */

static void dequant_q4_0_block(const uint8_t *b, float *y)
{
	float d = load_f16(b);
	const uint8_t *qs = b + 2;

	for (int j = 0; j < 16; j++) {
		y[j] = (float)((qs[j] & 0xf) - 8) * d;
		y[j + 16] = (float)((qs[j] >> 4) - 8) * d;
	}
}

static void dequant_q8_0_block(const uint8_t *b, float *y)
{
	float d = load_f16(b);
	const int8_t *qs = (const int8_t *)(b + 2);

	for (int j = 0; j < 32; j++)
		y[j] = (float)qs[j] * d;
}

static inline uint32_t load_u32(const uint8_t *p)
{
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* q4_1 (qh == NULL) and q5_1: elem = q * d + m (product rounded, then the sum, as GGML). */
static void dequant_q45_1_block(const uint8_t *b, const uint8_t *qh, const uint8_t *qs, float *y)
{
	float d = load_f16(b), m = load_f16(b + 2);
	uint32_t h = qh != NULL ? load_u32(qh) : 0;

	for (int j = 0; j < 16; j++) {
		int lo = (qs[j] & 0xf) | (int)((h >> j) & 1) << 4;
		int hi = (qs[j] >> 4) | (int)((h >> (j + 16)) & 1) << 4;
		y[j] = (float)lo * d + m;
		y[j + 16] = (float)hi * d + m;
	}
}

static void dequant_q5_0_block(const uint8_t *b, float *y)
{
	float d = load_f16(b);
	uint32_t h = load_u32(b + 2);
	const uint8_t *qs = b + 6;

	for (int j = 0; j < 16; j++) {
		int lo = (qs[j] & 0xf) | (int)((h >> j) & 1) << 4;
		int hi = (qs[j] >> 4) | (int)((h >> (j + 16)) & 1) << 4;
		y[j] = (float)(lo - 16) * d;
		y[j + 16] = (float)(hi - 16) * d;
	}
}

/* 32 elements of 16 nibbles indexing a table of 16 levels, times d (iq4_nl, iq4_xs). */
static void dequant_nl32(const uint8_t *qs, const int8_t *levels, float d, float *y)
{
	for (int j = 0; j < 16; j++) {
		y[j] = d * (float)levels[qs[j] & 0xf];
		y[j + 16] = d * (float)levels[qs[j] >> 4];
	}
}

static void dequant_iq4_xs_block(const uint8_t *b, float *y)
{
	float d = load_f16(b);
	unsigned sh = (unsigned)(b[2] | b[3] << 8);

	for (int ib = 0; ib < 8; ib++) {
		int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 15) | (int)((sh >> (2 * ib)) & 3) << 4;
		dequant_nl32(b + 8 + 16 * ib, md_iq4nl_levels, d * (float)(ls - 32), y + 32 * ib);
	}
}

/* Unpacks the 8 six-bit scales and mins of a q4_K / q5_K super-block. */
static void kq_unpack_scales(const uint8_t *s, uint8_t sc[8], uint8_t m[8])
{
	for (int j = 0; j < 4; j++) {
		sc[j] = s[j] & 63;
		m[j] = s[j + 4] & 63;
		sc[j + 4] = (uint8_t)((s[j + 8] & 0xf) | ((s[j] >> 6) << 4));
		m[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
	}
}

static void kq_pack_scales(uint8_t s[12], const uint8_t sc[8], const uint8_t m[8])
{
	for (int j = 0; j < 4; j++) {
		s[j] = (uint8_t)((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
		s[j + 4] = (uint8_t)((m[j] & 63) | ((m[j + 4] >> 4) << 6));
		s[j + 8] = (uint8_t)((sc[j + 4] & 0xf) | ((m[j + 4] & 0xf) << 4));
	}
}

/* q4_K and q5_K share everything but the fifth bit (qh == NULL for q4_K). */
static void dequant_q45_K_block(const uint8_t *b, const uint8_t *qh, const uint8_t *qs, float *y)
{
	float d = load_f16(b);
	float dmin = load_f16(b + 2);
	uint8_t sc[8], m[8];

	kq_unpack_scales(b + 4, sc, m);
	for (int s = 0; s < 8; s++) {
		float ds = d * (float)sc[s];
		float ms = dmin * (float)m[s];
		const uint8_t *q = qs + 32 * (s / 2);
		int shift = (s & 1) ? 4 : 0;

		for (int l = 0; l < 32; l++) {
			int v = (q[l] >> shift) & 0xf;
			if (qh != NULL)
				v |= ((qh[l] >> s) & 1) << 4;
			y[32 * s + l] = ds * (float)v - ms;
		}
	}
}

static void dequant_q2_K_block(const uint8_t *b, float *y)
{
	const uint8_t *sc = b, *qs = b + 16;
	float d = load_f16(b + 80), dmin = load_f16(b + 82);

	for (int e = 0; e < 256; e++) {
		int h = e / 128, j = (e % 128) / 32, l = e % 32;
		int q = (qs[32 * h + l] >> (2 * j)) & 3;
		float dl = d * (float)(sc[e / 16] & 15), ml = dmin * (float)(sc[e / 16] >> 4);

		y[e] = dl * (float)q - ml;
	}
}

/* The 16 signed scales (sc - 32) of a q3_K block from its 12 scale bytes. */
static void q3_K_scales(const uint8_t *s, int sc[16])
{
	for (int i = 0; i < 16; i++) {
		int lo = i < 8 ? s[i] & 15 : s[i - 8] >> 4;
		int hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
		sc[i] = (lo | hi << 4) - 32;
	}
}

static void dequant_q3_K_block(const uint8_t *b, float *y)
{
	const uint8_t *hm = b, *qs = b + 32;
	float d = load_f16(b + 108);
	int sc[16];

	q3_K_scales(b + 96, sc);
	for (int e = 0; e < 256; e++) {
		int h = e / 128, j = (e % 128) / 32, l = e % 32;
		int q = ((qs[32 * h + l] >> (2 * j)) & 3) | ((hm[l] >> (e / 32)) & 1) << 2;

		y[e] = d * (float)sc[e / 16] * (float)(q - 4);
	}
}

static void dequant_q6_K_block(const uint8_t *b, float *y)
{
	const uint8_t *ql = b;
	const uint8_t *qh = b + 128;
	const int8_t *sc = (const int8_t *)(b + 192);
	float d = load_f16(b + 208);

	for (int e = 0; e < 256; e++) {
		int h = e / 128, r = e % 128, k = r / 32, l = r % 32;
		uint8_t lo = ql[64 * h + l + 32 * (k & 1)];
		int q = ((k < 2) ? (lo & 0xf) : (lo >> 4)) | (((qh[32 * h + l] >> (2 * k)) & 3) << 4);

		y[e] = d * (float)sc[e / 16] * (float)(q - 32);
	}
}

/* Dequantizes one block (or, for float types, blck == 1 element) of t at src into y. */
static void dequant_block(enum md_dtype t, const uint8_t *src, float *y)
{
	switch (t) {
	case MD_DT_F32: memcpy(y, src, 4); break;
	case MD_DT_F16: y[0] = load_f16(src); break;
	case MD_DT_BF16: y[0] = md_bf16_to_f32((uint16_t)(src[0] | (src[1] << 8))); break;
	case MD_DT_Q4_0: dequant_q4_0_block(src, y); break;
	case MD_DT_Q4_1: dequant_q45_1_block(src, NULL, src + 4, y); break;
	case MD_DT_Q5_0: dequant_q5_0_block(src, y); break;
	case MD_DT_Q5_1: dequant_q45_1_block(src, src + 4, src + 8, y); break;
	case MD_DT_Q8_0: dequant_q8_0_block(src, y); break;
	case MD_DT_IQ4_NL: dequant_nl32(src + 2, md_iq4nl_levels, load_f16(src), y); break;
	case MD_DT_IQ4_XS: dequant_iq4_xs_block(src, y); break;
	case MD_DT_MXFP4: dequant_nl32(src + 1, md_mxfp4_levels, md_e8m0_half(src[0]), y); break;
	case MD_DT_Q2_K: dequant_q2_K_block(src, y); break;
	case MD_DT_Q3_K: dequant_q3_K_block(src, y); break;
	case MD_DT_Q4_K: dequant_q45_K_block(src, NULL, src + 16, y); break;
	case MD_DT_Q5_K: dequant_q45_K_block(src, src + 16, src + 48, y); break;
	case MD_DT_Q6_K: dequant_q6_K_block(src, y); break;
	default: quant_fail("dequantize: unsupported type", t);
	}
}

static const struct md_dtype_info *checked_info(enum md_dtype t, int64_t n, const char *what)
{
	const struct md_dtype_info *info = md_dtype_info((uint32_t)t);

	if (info == NULL || !info->supported)
		quant_fail(what, t);
	if (n < 0 || n % info->blck != 0)
		quant_fail("row length not a multiple of the block size", t);
	return info;
}

void md_dequant_row(enum md_dtype t, const void *src, float *dst, int64_t n)
{
	const struct md_dtype_info *info = checked_info(t, n, "dequantize: unsupported type");
	const uint8_t *p = src;

	if (t == MD_DT_F32) {
		memcpy(dst, src, (size_t)n * sizeof(float));
		return;
	}
	for (int64_t i = 0; i < n; i += info->blck, p += info->type_size)
		dequant_block(t, p, dst + i);
}

float md_vec_dot_ref(enum md_dtype t, const void *w_row, const float *x, int64_t n)
{
	const struct md_dtype_info *info = checked_info(t, n, "vec_dot: unsupported type");
	const uint8_t *p = w_row;
	/* Float types have 1-element blocks; sum them in float groups of 32 like a q8_0 block. */
	int64_t group = info->blck > 1 ? info->blck : 32;
	float buf[MD_QK_K];
	double acc = 0.0;

	for (int64_t i = 0; i < n; i += group) {
		int64_t len = (n - i < group) ? n - i : group;
		float s = 0.0f;

		for (int64_t j = 0; j < len; j += info->blck, p += info->type_size)
			dequant_block(t, p, buf + j);
		for (int64_t j = 0; j < len; j++)
			s += buf[j] * x[i + j];
		acc += s;
	}
	return (float)acc;
}

/* ---- quantization ---- */

static inline int iround(float v)
{
	return (int)lrintf(v);
}

static inline int clampi(int v, int lo, int hi)
{
	return v < lo ? lo : (v > hi ? hi : v);
}

/*
 * Symmetric quantizer: finds d and L[i] in [-nmax, nmax-1] with x[i] ~ d * L[i].  The plain
 * choice maps the largest-magnitude element to -nmax; we also try nearby grid scales and, for
 * each, the least-squares d for the resulting integers, keeping the lowest squared error.
 * Returns d (0 when the block is all zero, with L all 0).
 */
static float quant_symmetric(const float *x, int n, int nmax, int8_t *L)
{
	float amax = 0.0f, vmax = 0.0f;

	for (int i = 0; i < n; i++) {
		if (fabsf(x[i]) > amax) {
			amax = fabsf(x[i]);
			vmax = x[i];
		}
	}
	if (amax < 1e-30f) {
		memset(L, 0, (size_t)n);
		return 0.0f;
	}
	float best_err = INFINITY, best_d = 0.0f;
	for (int step = -9; step <= 9; step++) {
		float iscale = -((float)nmax + 0.1f * (float)step) / vmax;
		double sxl = 0.0, sll = 0.0;
		int8_t Lt[256];

		for (int i = 0; i < n; i++) {
			int q = clampi(iround(iscale * x[i]), -nmax, nmax - 1);
			Lt[i] = (int8_t)q;
			sxl += (double)x[i] * q;
			sll += (double)q * q;
		}
		if (sll <= 0.0)
			continue;
		float d = (float)(sxl / sll);
		double err = 0.0;
		for (int i = 0; i < n; i++) {
			double e = x[i] - d * Lt[i];
			err += e * e;
		}
		if (err < best_err) {
			best_err = (float)err;
			best_d = d;
		}
	}
	/* Final integers for the chosen scale (re-rounding can only lower the error). */
	float id = best_d != 0.0f ? 1.0f / best_d : 0.0f;
	for (int i = 0; i < n; i++)
		L[i] = (int8_t)clampi(iround(x[i] * id), -nmax, nmax - 1);
	return best_d;
}

static void quantize_q8_0_block(const float *x, uint8_t *b)
{
	float amax = 0.0f;

	for (int j = 0; j < 32; j++)
		amax = fmaxf(amax, fabsf(x[j]));
	float d = amax / 127.0f;
	store_f16(b, d);
	float dq = load_f16(b);
	float id = dq != 0.0f ? 1.0f / dq : 0.0f;
	for (int j = 0; j < 32; j++)
		b[2 + j] = (uint8_t)(int8_t)clampi(iround(x[j] * id), -127, 127);
}

static void quantize_q4_0_block(const float *x, uint8_t *b)
{
	int8_t L[32];
	float d = quant_symmetric(x, 32, 8, L);

	store_f16(b, d);
	float dq = load_f16(b);
	float id = dq != 0.0f ? 1.0f / dq : 0.0f;
	for (int j = 0; j < 16; j++) {
		int lo = clampi(iround(x[j] * id), -8, 7) + 8;
		int hi = clampi(iround(x[j + 16] * id), -8, 7) + 8;
		b[2 + j] = (uint8_t)(lo | (hi << 4));
	}
}

/*
 * q4_1 / q5_1 (nmax 15 / 31) and q5_0, with GGML's reference rounding, so that the blocks are
 * the ones llama-quantize writes without an importance matrix: q4_1/q5_1 map [min, max] onto
 * [0, nmax] (d = (max - min) / nmax, m = min, q = trunc((x - min) / d + 0.5)); q5_0 maps the
 * largest-magnitude element to -16 (d = max / -16, q = trunc(x / d + 16.5), at most 31). The
 * inverse scale comes from the unrounded d, as in GGML.
 */
static void quantize_q45_1_block(const float *x, uint8_t *b, uint8_t *qh, uint8_t *qs, int nmax)
{
	float mn = INFINITY, mx = -INFINITY;

	for (int j = 0; j < 32; j++) {
		mn = fminf(mn, x[j]);
		mx = fmaxf(mx, x[j]);
	}
	float d = (mx - mn) / (float)nmax;
	float id = d != 0.0f ? 1.0f / d : 0.0f;
	uint32_t h = 0;

	store_f16(b, d);
	store_f16(b + 2, mn);
	for (int j = 0; j < 16; j++) {
		int lo = (int)((x[j] - mn) * id + 0.5f), hi = (int)((x[j + 16] - mn) * id + 0.5f);

		lo = lo < nmax ? lo : nmax;
		hi = hi < nmax ? hi : nmax;
		qs[j] = (uint8_t)((lo & 0xf) | (hi & 0xf) << 4);
		h |= (uint32_t)((lo >> 4) & 1) << j | (uint32_t)((hi >> 4) & 1) << (j + 16);
	}
	if (qh != NULL)
		for (int k = 0; k < 4; k++)
			qh[k] = (uint8_t)(h >> (8 * k));
}

static void quantize_q5_0_block(const float *x, uint8_t *b)
{
	float amax = 0.0f, vmax = 0.0f;
	uint32_t h = 0;

	for (int j = 0; j < 32; j++) {
		if (fabsf(x[j]) > amax) {
			amax = fabsf(x[j]);
			vmax = x[j];
		}
	}
	float d = vmax / -16.0f;
	float id = d != 0.0f ? 1.0f / d : 0.0f;

	store_f16(b, d);
	for (int j = 0; j < 16; j++) {
		int lo = (int)(x[j] * id + 16.5f), hi = (int)(x[j + 16] * id + 16.5f);

		lo = lo < 31 ? lo : 31;
		hi = hi < 31 ? hi : 31;
		b[6 + j] = (uint8_t)((lo & 0xf) | (hi & 0xf) << 4);
		h |= (uint32_t)(lo >> 4) << j | (uint32_t)(hi >> 4) << (j + 16);
	}
	for (int k = 0; k < 4; k++)
		b[2 + k] = (uint8_t)(h >> (8 * k));
}

/* Index of the level nearest to v in a table of 16 increasing levels: the number of
 * midpoints between neighbouring levels below v (branch-free; ties go to the lower level). */
static int nearest_level(const int8_t *levels, float v)
{
	int k = 0;

	for (int i = 0; i < 15; i++)
		k += v > 0.5f * (float)(levels[i] + levels[i + 1]);
	return k;
}

/*
 * Scale for n elements coded as d * levels[idx] (iq4_nl, iq4_xs sub-blocks): candidates map
 * the largest-magnitude element to either end level and 4 steps either side; for each the
 * nearest levels are taken and d refit by least squares; the lowest squared error wins.
 * Returns d (0 for an all-zero block); idx is not filled (the caller rounds d first).
 */
static float quant_nl_scale(const float *x, int n, const int8_t *levels)
{
	float amax = 0.0f, vmax = 0.0f;

	for (int i = 0; i < n; i++) {
		if (fabsf(x[i]) > amax) {
			amax = fabsf(x[i]);
			vmax = x[i];
		}
	}
	if (amax < 1e-30f)
		return 0.0f;
	float best_err = INFINITY, best_d = vmax / (float)levels[0];
	for (int end = 0; end < 2; end++) {
		float lv = (float)(end ? levels[15] : levels[0]);
		for (int step = -4; step <= 4; step++) {
			float id = (lv + (lv < 0 ? -1.0f : 1.0f) * (float)step) / vmax;
			double sxl = 0, sll = 0;
			for (int i = 0; i < n; i++) {
				float l = (float)levels[nearest_level(levels, x[i] * id)];
				sxl += (double)x[i] * l;
				sll += (double)l * l;
			}
			if (sll <= 0)
				continue;
			float d = (float)(sxl / sll), err = 0.0f;
			if (d == 0.0f)
				continue;
			float idd = 1.0f / d;
			for (int i = 0; i < n; i++) {
				float e = d * (float)levels[nearest_level(levels, x[i] * idd)] - x[i];
				err += e * e;
			}
			if (err < best_err) {
				best_err = err;
				best_d = d;
			}
		}
	}
	return best_d;
}

/* Nibbles of 32 elements for scale d (as stored) into qs[16]. */
static void pack_nl32(const float *x, const int8_t *levels, float d, uint8_t *qs)
{
	float id = d != 0.0f ? 1.0f / d : 0.0f;

	for (int j = 0; j < 16; j++) {
		int lo = nearest_level(levels, x[j] * id), hi = nearest_level(levels, x[j + 16] * id);
		qs[j] = (uint8_t)(lo | hi << 4);
	}
}

static void quantize_iq4_nl_block(const float *x, uint8_t *b)
{
	store_f16(b, quant_nl_scale(x, 32, md_iq4nl_levels));
	pack_nl32(x, md_iq4nl_levels, load_f16(b), b + 2);
}

/* Squared error of 32 elements coded with scale d and the nearest levels. */
static float nl32_error(const float *x, float d)
{
	float id = d != 0.0f ? 1.0f / d : 0.0f, err = 0.0f;

	for (int i = 0; i < 32; i++) {
		float e = d * (float)md_iq4nl_levels[nearest_level(md_iq4nl_levels, x[i] * id)] - x[i];
		err += e * e;
	}
	return err;
}

/*
 * iq4_xs: quant_nl_scale per 32-element sub-block, d mapping the largest-magnitude scale
 * to -32 (the extra negative step of the 6-bit range), each 6-bit scale chosen among the
 * rounded one and its neighbours for the least squared error.
 */
static void quantize_iq4_xs_block(const float *x, uint8_t *b)
{
	float scale[8], vmax = 0.0f, amax = 0.0f;
	int ls[8];

	for (int s = 0; s < 8; s++) {
		scale[s] = quant_nl_scale(x + 32 * s, 32, md_iq4nl_levels);
		if (fabsf(scale[s]) > amax) {
			amax = fabsf(scale[s]);
			vmax = scale[s];
		}
	}
	store_f16(b, vmax / -32.0f);
	float d = load_f16(b);
	unsigned sh = 0;

	memset(b + 4, 0, 4);
	for (int s = 0; s < 8; s++) {
		int l0 = d != 0.0f ? clampi(iround(scale[s] / d), -32, 31) : 0;
		float best = INFINITY;

		ls[s] = l0;
		for (int k = l0 - 1; k <= l0 + 1 && d != 0.0f; k++) {
			if (k < -32 || k > 31)
				continue;
			float err = nl32_error(x + 32 * s, d * (float)k);
			if (err < best) {
				best = err;
				ls[s] = k;
			}
		}
		int raw = ls[s] + 32;
		b[4 + s / 2] |= (uint8_t)((raw & 15) << (4 * (s % 2)));
		sh |= (unsigned)(raw >> 4) << (2 * s);
		pack_nl32(x + 32 * s, md_iq4nl_levels, d * (float)ls[s], b + 8 + 16 * s);
	}
	b[2] = (uint8_t)(sh & 0xff);
	b[3] = (uint8_t)(sh >> 8);
}

/*
 * mxfp4 with GGML's reference rounding (what llama-quantize writes): the shared exponent
 * e = floor(log2(max |x|)) - 2 + 127 (the largest E2M1 value 6 is 1.5 * 2^2), then each
 * element takes the first level whose value is nearest. e is clamped to 0..254 where GGML
 * would overflow its byte (|x| below 2^-125 or above 2^129).
 */
static void quantize_mxfp4_block(const float *x, uint8_t *b)
{
	float amax = 0.0f;

	for (int j = 0; j < 32; j++)
		amax = fmaxf(amax, fabsf(x[j]));
	int e = amax > 0.0f ? (int)(floorf(log2f(amax)) - 2.0f + 127.0f) : 0;
	e = clampi(e, 0, 254);
	b[0] = (uint8_t)e;
	float d = md_e8m0_half((uint8_t)e);
	for (int j = 0; j < 32; j++) {
		int best = 0;
		float be = fabsf((float)md_mxfp4_levels[0] * d - x[j]);
		for (int k = 1; k < 16; k++) {
			float err = fabsf((float)md_mxfp4_levels[k] * d - x[j]);
			if (err < be) {
				be = err;
				best = k;
			}
		}
		if (j < 16)
			b[1 + j] = (uint8_t)best;
		else
			b[1 + j - 16] |= (uint8_t)(best << 4);
	}
}

/*
 * Least-squares (a, m) for x[i] ~ a * L[i] - m with L[i] = round((x[i] + m0) / a0) clamped to
 * [0, nmax], m kept >= 0 because the layout cannot add a positive offset.  Returns false when
 * the fit is degenerate (no positive a).
 */
static bool asym_fit(const float *x, int n, int nmax, float a0, float m0, float *a, float *m)
{
	double sl = 0, sll = 0, sx = 0, sxl = 0;
	float ia = 1.0f / a0;

	for (int i = 0; i < n; i++) {
		int q = clampi(iround((x[i] + m0) * ia), 0, nmax);
		sl += q;
		sll += (double)q * q;
		sx += x[i];
		sxl += (double)x[i] * q;
	}
	double det = n * sll - sl * sl;
	double na = 0, nb = 0;
	if (det > 0) {
		na = (n * sxl - sl * sx) / det;
		nb = (sll * sx - sl * sxl) / det; /* intercept, i.e. -m */
	}
	if (det <= 0 || nb > 0) {
		nb = 0;
		na = sll > 0 ? sxl / sll : 0;
	}
	if (!(na > 0))
		return false;
	*a = (float)na;
	*m = (float)-nb;
	return true;
}

static float asym_error(const float *x, int n, int nmax, float a, float m)
{
	float ia = 1.0f / a, err = 0.0f;

	for (int i = 0; i < n; i++) {
		int q = clampi(iround((x[i] + m) * ia), 0, nmax);
		float e = a * (float)q - m - x[i];
		err += e * e;
	}
	return err;
}

/*
 * Asymmetric quantizer for one K-quant sub-block: finds scale a >= 0 and min m >= 0 with
 * x[i] ~ a * L[i] - m, L[i] in [0, nmax].  Tries a sweep of grid scales around
 * (max - min) / nmax, least-squares fits (a, m) to each integer assignment, then refines the
 * best by alternating re-rounding and re-fitting.  (A full alternating refinement of every
 * candidate was measured: about 4x slower for 0.5% lower error.)
 */
static void quant_asym(const float *x, int n, int nmax, float *out_a, float *out_m)
{
	float xmin = x[0], xmax = x[0];

	for (int i = 1; i < n; i++) {
		xmin = fminf(xmin, x[i]);
		xmax = fmaxf(xmax, x[i]);
	}
	if (xmin > 0.0f)
		xmin = 0.0f;
	if (xmax - xmin < 1e-30f) {
		*out_a = 0.0f;
		*out_m = -xmin;
		return;
	}

	float best_a = (xmax - xmin) / (float)nmax, best_m = -xmin;
	float best_err = asym_error(x, n, nmax, best_a, best_m);
	for (int step = -4; step <= 8; step++) {
		float a, m;

		if (!asym_fit(x, n, nmax, (xmax - xmin) / ((float)nmax + 0.2f * (float)step), -xmin,
			      &a, &m))
			continue;
		float err = asym_error(x, n, nmax, a, m);
		if (err < best_err) {
			best_err = err;
			best_a = a;
			best_m = m;
		}
	}
	for (int iter = 0; iter < 3; iter++) {
		float a, m;

		if (!asym_fit(x, n, nmax, best_a, best_m, &a, &m))
			break;
		float err = asym_error(x, n, nmax, a, m);
		if (!(err < best_err))
			break;
		best_err = err;
		best_a = a;
		best_m = m;
	}
	*out_a = best_a;
	*out_m = best_m;
}

/* Squared error of one n-element sub-block coded with effective scale ds and min ms. */
static float kq_sub_error(const float *x, int n, int nmax, float ds, float ms)
{
	float ids = ds > 0.0f ? 1.0f / ds : 0.0f;
	float err = 0.0f;

	for (int l = 0; l < n; l++) {
		int q = clampi(iround((x[l] + ms) * ids), 0, nmax);
		float e = ds * (float)q - ms - x[l];
		err += e * e;
	}
	return err;
}

/*
 * Quantizes one 256-element super-block to q4_K (qh == NULL, nmax 15) or q5_K (nmax 31).
 * b points at the block start; qs/qh at its quant arrays.
 */
static void quantize_q45_K_block(const float *x, uint8_t *b, uint8_t *qh, uint8_t *qs, int nmax)
{
	float a[8], m[8], amax = 0.0f, mmax = 0.0f;
	uint8_t sc[8], mq[8];

	for (int s = 0; s < 8; s++) {
		quant_asym(x + 32 * s, 32, nmax, &a[s], &m[s]);
		amax = fmaxf(amax, a[s]);
		mmax = fmaxf(mmax, m[s]);
	}
	store_f16(b, amax / 63.0f);
	store_f16(b + 2, mmax / 63.0f);
	float d = load_f16(b), dmin = load_f16(b + 2);
	for (int s = 0; s < 8; s++) {
		int sc0 = d > 0.0f ? clampi(iround(a[s] / d), 0, 63) : 0;
		int m0 = dmin > 0.0f ? clampi(iround(m[s] / dmin), 0, 63) : 0;
		float best = INFINITY;

		/* Rounding scale and min separately is not optimal: try the neighbours too. */
		for (int ds = -1; ds <= 1; ds++) {
			for (int dm = -1; dm <= 1; dm++) {
				int sci = sc0 + ds, mi = m0 + dm;
				if (sci < 0 || sci > 63 || mi < 0 || mi > 63)
					continue;
				float err = kq_sub_error(x + 32 * s, 32, nmax, d * (float)sci, dmin * (float)mi);
				if (err < best) {
					best = err;
					sc[s] = (uint8_t)sci;
					mq[s] = (uint8_t)mi;
				}
			}
		}
	}
	kq_pack_scales(b + 4, sc, mq);

	memset(qs, 0, 128);
	if (qh != NULL)
		memset(qh, 0, 32);
	for (int s = 0; s < 8; s++) {
		float ds = d * (float)sc[s], ms = dmin * (float)mq[s];
		float ids = ds > 0.0f ? 1.0f / ds : 0.0f;
		int shift = (s & 1) ? 4 : 0;

		for (int l = 0; l < 32; l++) {
			int q = clampi(iround((x[32 * s + l] + ms) * ids), 0, nmax);
			qs[32 * (s / 2) + l] |= (uint8_t)((q & 0xf) << shift);
			if (qh != NULL)
				qh[l] |= (uint8_t)(((q >> 4) & 1) << s);
		}
	}
}

/*
 * q2_K: an asymmetric (scale, min) fit per 16-element sub-block (quant_asym with q in 0..3),
 * the super-block d / dmin mapping the largest scale / min to 15, then for every sub-block
 * the 4-bit scale and min around the rounded ones with the least squared error (as for
 * q4_K). Not GGML's make_qkx2_quants (which weights errors by |x|): a plain least-squares
 * search.
 */
static void quantize_q2_K_block(const float *x, uint8_t *b)
{
	float a[16], m[16], amax = 0.0f, mmax = 0.0f;
	uint8_t *sc = b, *qs = b + 16;

	for (int s = 0; s < 16; s++) {
		quant_asym(x + 16 * s, 16, 3, &a[s], &m[s]);
		amax = fmaxf(amax, a[s]);
		mmax = fmaxf(mmax, m[s]);
	}
	store_f16(b + 80, amax / 15.0f);
	store_f16(b + 82, mmax / 15.0f);
	float d = load_f16(b + 80), dmin = load_f16(b + 82);
	for (int s = 0; s < 16; s++) {
		int sc0 = d > 0.0f ? clampi(iround(a[s] / d), 0, 15) : 0;
		int m0 = dmin > 0.0f ? clampi(iround(m[s] / dmin), 0, 15) : 0;
		float best = INFINITY;

		sc[s] = 0;
		for (int ds = -1; ds <= 1; ds++) {
			for (int dm = -1; dm <= 1; dm++) {
				int sci = sc0 + ds, mi = m0 + dm;
				if (sci < 0 || sci > 15 || mi < 0 || mi > 15)
					continue;
				float err = kq_sub_error(x + 16 * s, 16, 3, d * (float)sci, dmin * (float)mi);
				if (err < best) {
					best = err;
					sc[s] = (uint8_t)(sci | mi << 4);
				}
			}
		}
	}
	memset(qs, 0, 64);
	for (int e = 0; e < 256; e++) {
		float ds = d * (float)(sc[e / 16] & 15), ms = dmin * (float)(sc[e / 16] >> 4);
		int q = ds > 0.0f ? clampi(iround((x[e] + ms) / ds), 0, 3) : 0;
		int h = e / 128, j = (e % 128) / 32, l = e % 32;

		qs[32 * h + l] |= (uint8_t)(q << (2 * j));
	}
}

/* Squared error of 16 elements coded as ds * (q - 4), q in 0..7. */
static float q3_sub_error(const float *x, float ds)
{
	float ids = ds != 0.0f ? 1.0f / ds : 0.0f, err = 0.0f;

	for (int l = 0; l < 16; l++) {
		float e = ds * (float)clampi(iround(x[l] * ids), -4, 3) - x[l];
		err += e * e;
	}
	return err;
}

/*
 * q3_K: a symmetric fit per 16-element sub-block (quant_symmetric, q - 4 in -4..3), d mapping
 * the largest-magnitude scale to -32 (the extra negative step of the 6-bit range, as for
 * q6_K), then each 6-bit scale chosen among the rounded one and its neighbours for the least
 * squared error. A plain least-squares search, not GGML's make_q3_quants.
 */
static void quantize_q3_K_block(const float *x, uint8_t *b)
{
	float scale[16], vmax = 0.0f, amax = 0.0f;
	int8_t L[16];
	int sc[16];
	uint8_t *hm = b, *qs = b + 32, *sb = b + 96;

	for (int s = 0; s < 16; s++) {
		scale[s] = quant_symmetric(x + 16 * s, 16, 4, L);
		if (fabsf(scale[s]) > amax) {
			amax = fabsf(scale[s]);
			vmax = scale[s];
		}
	}
	store_f16(b + 108, vmax / -32.0f);
	float d = load_f16(b + 108);
	for (int s = 0; s < 16; s++) {
		int s0 = d != 0.0f ? clampi(iround(scale[s] / d), -32, 31) : 0;
		float best = INFINITY;

		sc[s] = s0;
		for (int k = s0 - 1; k <= s0 + 1 && d != 0.0f; k++) {
			if (k < -32 || k > 31)
				continue;
			float err = q3_sub_error(x + 16 * s, d * (float)k);
			if (err < best) {
				best = err;
				sc[s] = k;
			}
		}
	}
	memset(sb, 0, 12);
	for (int i = 0; i < 16; i++) {
		int raw = sc[i] + 32;
		sb[i % 8] |= (uint8_t)((raw & 15) << (i < 8 ? 0 : 4));
		sb[8 + i % 4] |= (uint8_t)((raw >> 4) << (2 * (i / 4)));
	}
	memset(hm, 0, 32);
	memset(qs, 0, 64);
	for (int e = 0; e < 256; e++) {
		float ds = d * (float)sc[e / 16];
		int q = (ds != 0.0f ? clampi(iround(x[e] / ds), -4, 3) : 0) + 4;
		int h = e / 128, j = (e % 128) / 32, l = e % 32;

		qs[32 * h + l] |= (uint8_t)((q & 3) << (2 * j));
		hm[l] |= (uint8_t)((q >> 2) << (e / 32));
	}
}

static void quantize_q6_K_block(const float *x, uint8_t *b)
{
	float scale[16], vmax = 0.0f, amax = 0.0f;
	int8_t L[16];
	uint8_t *ql = b, *qh = b + 128;
	int8_t *sc = (int8_t *)(b + 192);

	for (int s = 0; s < 16; s++) {
		scale[s] = quant_symmetric(x + 16 * s, 16, 32, L);
		if (fabsf(scale[s]) > amax) {
			amax = fabsf(scale[s]);
			vmax = scale[s];
		}
	}
	/* The largest-magnitude scale maps to -128 (the one extra negative step of int8). */
	store_f16(b + 208, vmax / -128.0f);
	float d = load_f16(b + 208);
	for (int s = 0; s < 16; s++)
		sc[s] = (int8_t)(d != 0.0f ? clampi(iround(scale[s] / d), -128, 127) : 0);

	memset(ql, 0, 128);
	memset(qh, 0, 64);
	for (int e = 0; e < 256; e++) {
		float ds = d * (float)sc[e / 16];
		int q = ds != 0.0f ? clampi(iround(x[e] / ds), -32, 31) + 32 : 32;
		int h = e / 128, r = e % 128, k = r / 32, l = r % 32;

		ql[64 * h + l + 32 * (k & 1)] |= (uint8_t)((q & 0xf) << ((k < 2) ? 0 : 4));
		qh[32 * h + l] |= (uint8_t)((q >> 4) << (2 * k));
	}
}

size_t md_quantize_row(enum md_dtype t, const float *src, void *dst, int64_t n)
{
	const struct md_dtype_info *info = md_dtype_info((uint32_t)t);
	uint8_t *p = dst;

	if (info == NULL || !info->supported || n < 0 || n % info->blck != 0)
		return 0;
	switch (t) {
	case MD_DT_F32:
		memcpy(dst, src, (size_t)n * sizeof(float));
		break;
	case MD_DT_F16:
		for (int64_t i = 0; i < n; i++)
			store_f16(p + 2 * i, src[i]);
		break;
	case MD_DT_BF16:
		for (int64_t i = 0; i < n; i++) {
			uint16_t h = md_f32_to_bf16(src[i]);
			p[2 * i] = (uint8_t)(h & 0xff);
			p[2 * i + 1] = (uint8_t)(h >> 8);
		}
		break;
	case MD_DT_Q8_0:
		for (int64_t i = 0; i < n; i += 32, p += Q8_0_BYTES)
			quantize_q8_0_block(src + i, p);
		break;
	case MD_DT_Q4_0:
		for (int64_t i = 0; i < n; i += 32, p += Q4_0_BYTES)
			quantize_q4_0_block(src + i, p);
		break;
	case MD_DT_IQ4_NL:
		for (int64_t i = 0; i < n; i += 32, p += IQ4_NL_BYTES)
			quantize_iq4_nl_block(src + i, p);
		break;
	case MD_DT_IQ4_XS:
		for (int64_t i = 0; i < n; i += 256, p += IQ4_XS_BYTES)
			quantize_iq4_xs_block(src + i, p);
		break;
	case MD_DT_MXFP4:
		for (int64_t i = 0; i < n; i += 32, p += MXFP4_BYTES)
			quantize_mxfp4_block(src + i, p);
		break;
	case MD_DT_Q4_1:
		for (int64_t i = 0; i < n; i += 32, p += Q4_1_BYTES)
			quantize_q45_1_block(src + i, p, NULL, p + 4, 15);
		break;
	case MD_DT_Q5_0:
		for (int64_t i = 0; i < n; i += 32, p += Q5_0_BYTES)
			quantize_q5_0_block(src + i, p);
		break;
	case MD_DT_Q5_1:
		for (int64_t i = 0; i < n; i += 32, p += Q5_1_BYTES)
			quantize_q45_1_block(src + i, p, p + 4, p + 8, 31);
		break;
	case MD_DT_Q2_K:
		for (int64_t i = 0; i < n; i += 256, p += Q2_K_BYTES)
			quantize_q2_K_block(src + i, p);
		break;
	case MD_DT_Q3_K:
		for (int64_t i = 0; i < n; i += 256, p += Q3_K_BYTES)
			quantize_q3_K_block(src + i, p);
		break;
	case MD_DT_Q4_K:
		for (int64_t i = 0; i < n; i += 256, p += Q4_K_BYTES)
			quantize_q45_K_block(src + i, p, NULL, p + 16, 15);
		break;
	case MD_DT_Q5_K:
		for (int64_t i = 0; i < n; i += 256, p += Q5_K_BYTES)
			quantize_q45_K_block(src + i, p, p + 16, p + 48, 31);
		break;
	case MD_DT_Q6_K:
		for (int64_t i = 0; i < n; i += 256, p += Q6_K_BYTES)
			quantize_q6_K_block(src + i, p);
		break;
	default:
		return 0;
	}
	return md_dtype_row_size(t, n);
}
