/* Unit tests for engine/quant.c: type table, F16/BF16 conversion, GGML block decoding, quantizer quality, reference dot. */
#include "engine/quant.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/check.h"

static float from_bits(uint32_t u)
{
	float f;

	memcpy(&f, &u, sizeof(f));
	return f;
}

static void put16(uint8_t *p, uint16_t v)
{
	p[0] = (uint8_t)(v & 0xff);
	p[1] = (uint8_t)(v >> 8);
}

/* xorshift64* and Box-Muller: reproducible N(0, 1) without libc rand. */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng_next(void)
{
	rng_state ^= rng_state >> 12;
	rng_state ^= rng_state << 25;
	rng_state ^= rng_state >> 27;
	return rng_state * 0x2545f4914f6cdd1dull;
}

static double rng_uniform(void)
{
	return ((double)(rng_next() >> 11) + 0.5) * 0x1p-53;
}

static float rng_normal(void)
{
	return (float)(sqrt(-2.0 * log(rng_uniform())) * cos(6.283185307179586 * rng_uniform()));
}

static void test_type_table(void)
{
	static const struct {
		uint32_t id;
		const char *name;
		int64_t blck;
		size_t size;
		bool supported;
	} want[] = {
		{ 0, "f32", 1, 4, true },     { 1, "f16", 1, 2, true },
		{ 2, "q4_0", 32, 18, true },  { 3, "q4_1", 32, 20, true },
		{ 6, "q5_0", 32, 22, true },  { 7, "q5_1", 32, 24, true },
		{ 8, "q8_0", 32, 34, true },  { 9, "q8_1", 32, 36, false },
		{ 10, "q2_K", 256, 84, true }, { 11, "q3_K", 256, 110, true },
		{ 12, "q4_K", 256, 144, true }, { 13, "q5_K", 256, 176, true },
		{ 14, "q6_K", 256, 210, true }, { 15, "q8_K", 256, 292, false },
		{ 24, "i8", 1, 1, false },    { 25, "i16", 1, 2, false },
		{ 26, "i32", 1, 4, false },   { 27, "i64", 1, 8, false },
		{ 28, "f64", 1, 8, false },   { 30, "bf16", 1, 2, true },
		{ 16, "iq2_xxs", 256, 66, false }, { 17, "iq2_xs", 256, 74, false },
		{ 18, "iq3_xxs", 256, 98, false }, { 19, "iq1_s", 256, 50, false },
		{ 21, "iq3_s", 256, 110, false },  { 22, "iq2_s", 256, 82, false },
		{ 29, "iq1_m", 256, 56, false },   { 20, "iq4_nl", 32, 18, true },
		{ 23, "iq4_xs", 256, 136, true },  { 39, "mxfp4", 32, 17, true },   { 34, "tq1_0", 256, 54, false },
		{ 35, "tq2_0", 256, 66, false },
	};

	for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
		const struct md_dtype_info *info = md_dtype_info(want[i].id);
		if (info == NULL) {
			fprintf(stderr, "type %u: no info\n", want[i].id);
			failures++;
			continue;
		}
		if (strcmp(info->name, want[i].name) != 0) {
			fprintf(stderr, "type %u: name '%s' != '%s'\n", want[i].id, info->name, want[i].name);
			failures++;
		}
		CHECK_EQ_U(info->blck, want[i].blck);
		CHECK_EQ_U(info->type_size, want[i].size);
		CHECK_EQ_U(info->supported, want[i].supported);
	}
	/* Removed ids (Q4_2, Q4_3), types we cannot size, and out of range. */
	CHECK(md_dtype_info(4) == NULL);
	CHECK(md_dtype_info(5) == NULL);
	CHECK(md_dtype_info(31) == NULL);
	CHECK(md_dtype_info(36) == NULL);
	CHECK(md_dtype_info(MD_DT_COUNT) == NULL);
	CHECK(md_dtype_info(0xffffffffu) == NULL);

	CHECK_EQ_U(md_dtype_row_size(MD_DT_Q4_K, 512), 288);
	CHECK_EQ_U(md_dtype_row_size(MD_DT_Q8_0, 4096), 4352);
	CHECK_EQ_U(md_dtype_row_size(MD_DT_F32, 7), 28);
	CHECK_EQ_U(md_dtype_row_size(MD_DT_BF16, 3), 6);
	CHECK_EQ_U(md_dtype_row_size(MD_DT_Q6_K, 100), 0);
	CHECK_EQ_U(md_dtype_row_size(MD_DT_Q4_0, 33), 0);
	CHECK_EQ_U(md_dtype_row_size((enum md_dtype)4, 32), 0);
	CHECK_EQ_U(md_dtype_row_size(MD_DT_Q4_0, 0), 0);

	/* The list the loader prints when it refuses a type names exactly the supported ones. */
	char names[256];
	md_dtype_supported_names(names, sizeof(names));
	CHECK(strstr(names, "f32, f16, q4_0, q4_1, q5_0, q5_1, q8_0, ") == names);
	CHECK(strstr(names, "q8_1") == NULL && strstr(names, "iq2_xxs") == NULL);
	CHECK(strstr(names, "bf16") != NULL);
	char tiny[8];
	md_dtype_supported_names(tiny, sizeof(tiny));
	CHECK(strlen(tiny) < sizeof(tiny));
}

static void test_f16(void)
{
	/* Decoding: zeros, subnormals, normals, extremes, specials. */
	CHECK_EQ_F(md_f16_to_f32(0x0000), 0.0f);
	CHECK_EQ_F(md_f16_to_f32(0x8000), -0.0f);
	CHECK_EQ_F(md_f16_to_f32(0x0001), 0x1p-24f);
	CHECK_EQ_F(md_f16_to_f32(0x8001), -0x1p-24f);
	CHECK_EQ_F(md_f16_to_f32(0x03ff), 1023.0f * 0x1p-24f);
	CHECK_EQ_F(md_f16_to_f32(0x0400), 0x1p-14f);
	CHECK_EQ_F(md_f16_to_f32(0x3c00), 1.0f);
	CHECK_EQ_F(md_f16_to_f32(0x3c01), 1.0f + 0x1p-10f);
	CHECK_EQ_F(md_f16_to_f32(0xc000), -2.0f);
	CHECK_EQ_F(md_f16_to_f32(0x3555), 0.333251953125f);
	CHECK_EQ_F(md_f16_to_f32(0x7bff), 65504.0f);
	CHECK_EQ_F(md_f16_to_f32(0x7c00), INFINITY);
	CHECK_EQ_F(md_f16_to_f32(0xfc00), -INFINITY);
	CHECK(isnan(md_f16_to_f32(0x7e00)));
	CHECK(isnan(md_f16_to_f32(0x7c01))); /* signalling NaN must not turn into inf */
	CHECK(isnan(md_f16_to_f32(0xfe00)));

	/* Encoding, round to nearest even at every boundary. */
	CHECK_EQ_U(md_f32_to_f16(0.0f), 0x0000);
	CHECK_EQ_U(md_f32_to_f16(-0.0f), 0x8000);
	CHECK_EQ_U(md_f32_to_f16(1.0f), 0x3c00);
	CHECK_EQ_U(md_f32_to_f16(-2.0f), 0xc000);
	CHECK_EQ_U(md_f32_to_f16(1.0f + 0x1p-11f), 0x3c00);       /* tie -> even */
	CHECK_EQ_U(md_f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02);   /* tie -> even (up) */
	CHECK_EQ_U(md_f32_to_f16(1.0f + 0x1p-11f + 0x1p-20f), 0x3c01);
	CHECK_EQ_U(md_f32_to_f16(2.0f - 0x1p-12f), 0x4000);       /* carry into exponent */
	CHECK_EQ_U(md_f32_to_f16(65504.0f), 0x7bff);
	CHECK_EQ_U(md_f32_to_f16(65519.996f), 0x7bff);
	CHECK_EQ_U(md_f32_to_f16(65520.0f), 0x7c00);              /* tie -> even = inf */
	CHECK_EQ_U(md_f32_to_f16(1e10f), 0x7c00);
	CHECK_EQ_U(md_f32_to_f16(-FLT_MAX), 0xfc00);
	CHECK_EQ_U(md_f32_to_f16(INFINITY), 0x7c00);
	CHECK_EQ_U(md_f32_to_f16(-INFINITY), 0xfc00);
	uint16_t hn = md_f32_to_f16(NAN);
	CHECK((hn & 0x7c00) == 0x7c00 && (hn & 0x3ff) != 0);
	hn = md_f32_to_f16(from_bits(0x7f800001)); /* payload only in low bits */
	CHECK((hn & 0x7c00) == 0x7c00 && (hn & 0x3ff) != 0);
	hn = md_f32_to_f16(from_bits(0xffc00000));
	CHECK(hn & 0x8000);
	CHECK((hn & 0x7c00) == 0x7c00 && (hn & 0x3ff) != 0);
	CHECK_EQ_U(md_f32_to_f16(0x1p-14f), 0x0400);
	CHECK_EQ_U(md_f32_to_f16(0x1p-24f), 0x0001);
	CHECK_EQ_U(md_f32_to_f16(-0x1p-24f), 0x8001);
	CHECK_EQ_U(md_f32_to_f16(0x1p-25f), 0x0000);              /* tie -> even = 0 */
	CHECK_EQ_U(md_f32_to_f16(-0x1p-25f), 0x8000);
	CHECK_EQ_U(md_f32_to_f16(nextafterf(0x1p-25f, 1.0f)), 0x0001);
	CHECK_EQ_U(md_f32_to_f16(3 * 0x1p-25f), 0x0002);          /* 1.5 units -> 2 */
	CHECK_EQ_U(md_f32_to_f16(5 * 0x1p-25f), 0x0002);          /* 2.5 units -> 2 */
	CHECK_EQ_U(md_f32_to_f16(1023.5f * 0x1p-24f), 0x0400);    /* largest subnormal + half */
	CHECK_EQ_U(md_f32_to_f16(1022.5f * 0x1p-24f), 0x03fe);
	CHECK_EQ_U(md_f32_to_f16(1e-30f), 0x0000);
	CHECK_EQ_U(md_f32_to_f16(from_bits(0x00000001)), 0x0000); /* f32 subnormal */

	/* Every non-NaN half survives f16 -> f32 -> f16; every NaN stays NaN. */
	for (uint32_t h = 0; h < 0x10000; h++) {
		float f = md_f16_to_f32((uint16_t)h);
		uint16_t back = md_f32_to_f16(f);
		bool is_nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0;

		if (is_nan ? !isnan(f) || (back & 0x7c00) != 0x7c00 || (back & 0x3ff) == 0
			   : back != h) {
			fprintf(stderr, "f16 round trip: 0x%04x -> %g -> 0x%04x\n", h, (double)f, back);
			failures++;
			break;
		}
	}

#ifdef __FLT16_MAX__
	/* The compiler's _Float16 conversion is IEEE round-to-nearest-even: compare on random
	 * f32 bit patterns concentrated in and around the half range. */
	for (int i = 0; i < 1000000; i++) {
		uint32_t u = (uint32_t)rng_next();
		if (i & 1) /* exponents 2^-30 .. 2^17 */
			u = (u & 0x807fffffu) | ((uint32_t)(97 + (u >> 23) % 48) << 23);
		float f = from_bits(u);
		if (isnan(f))
			continue;
		_Float16 r = (_Float16)f;
		uint16_t want;
		memcpy(&want, &r, sizeof(want));
		uint16_t got = md_f32_to_f16(f);
		if (got != want) {
			fprintf(stderr, "f32_to_f16(0x%08x = %g): 0x%04x != _Float16 0x%04x\n", u,
				(double)f, got, want);
			failures++;
			break;
		}
	}
#endif
}

static void test_bf16(void)
{
	CHECK_EQ_F(md_bf16_to_f32(0x3f80), 1.0f);
	CHECK_EQ_F(md_bf16_to_f32(0xc040), -3.0f);
	CHECK_EQ_F(md_bf16_to_f32(0x8000), -0.0f);
	CHECK_EQ_F(md_bf16_to_f32(0x0001), from_bits(0x00010000)); /* subnormal */
	CHECK_EQ_F(md_bf16_to_f32(0x7f80), INFINITY);
	CHECK_EQ_F(md_bf16_to_f32(0xff80), -INFINITY);
	CHECK(isnan(md_bf16_to_f32(0x7fc0)));
	CHECK(isnan(md_bf16_to_f32(0x7f81)));

	CHECK_EQ_U(md_f32_to_bf16(1.0f), 0x3f80);
	CHECK_EQ_U(md_f32_to_bf16(-0.0f), 0x8000);
	CHECK_EQ_U(md_f32_to_bf16(from_bits(0x3f808000)), 0x3f80); /* tie -> even (down) */
	CHECK_EQ_U(md_f32_to_bf16(from_bits(0x3f818000)), 0x3f82); /* tie -> even (up) */
	CHECK_EQ_U(md_f32_to_bf16(from_bits(0x3f808001)), 0x3f81);
	CHECK_EQ_U(md_f32_to_bf16(from_bits(0x3f807fff)), 0x3f80);
	CHECK_EQ_U(md_f32_to_bf16(from_bits(0x00010000)), 0x0001);
	CHECK_EQ_U(md_f32_to_bf16(from_bits(0x00018000)), 0x0002); /* subnormal tie -> even */
	CHECK_EQ_U(md_f32_to_bf16(FLT_MAX), 0x7f80);               /* rounds to inf */
	CHECK_EQ_U(md_f32_to_bf16(INFINITY), 0x7f80);
	CHECK_EQ_U(md_f32_to_bf16(-INFINITY), 0xff80);
	/* NaN stays NaN even when the payload lives only in the dropped low bits. */
	uint16_t b = md_f32_to_bf16(from_bits(0x7f800001));
	CHECK((b & 0x7f80) == 0x7f80 && (b & 0x7f) != 0);
	b = md_f32_to_bf16(from_bits(0xffc00000));
	CHECK_EQ_U(b, 0xffc0);
	CHECK(isnan(md_bf16_to_f32(md_f32_to_bf16(NAN))));

	for (uint32_t h = 0; h < 0x10000; h++) {
		bool is_nan = (h & 0x7f80) == 0x7f80 && (h & 0x7f) != 0;
		if (is_nan)
			continue;
		uint16_t back = md_f32_to_bf16(md_bf16_to_f32((uint16_t)h));
		if (back != h) {
			fprintf(stderr, "bf16 round trip: 0x%04x -> 0x%04x\n", h, back);
			failures++;
			break;
		}
	}
}

/* Row-level F16/BF16/F32 encode and decode through md_quantize_row / md_dequant_row. */
static void test_float_rows(void)
{
	const float src[4] = { 1.0f, -2.5f, 0x1p-24f, 65504.0f };
	uint8_t buf[16];
	float out[4];

	CHECK_EQ_U(md_quantize_row(MD_DT_F16, src, buf, 4), 8);
	CHECK_EQ_U(buf[0], 0x00); /* 1.0 = 0x3c00, little-endian */
	CHECK_EQ_U(buf[1], 0x3c);
	CHECK_EQ_U(buf[2] | (buf[3] << 8), 0xc100);
	md_dequant_row(MD_DT_F16, buf, out, 4);
	for (int i = 0; i < 4; i++)
		CHECK_EQ_F(out[i], src[i]);

	CHECK_EQ_U(md_quantize_row(MD_DT_BF16, src, buf, 4), 8);
	CHECK_EQ_U(buf[0] | (buf[1] << 8), 0x3f80);
	CHECK_EQ_U(buf[2] | (buf[3] << 8), 0xc020);
	md_dequant_row(MD_DT_BF16, buf, out, 4);
	CHECK_EQ_F(out[0], 1.0f);
	CHECK_EQ_F(out[1], -2.5f);
	CHECK_EQ_F(out[3], 65536.0f); /* 65504 = 0x477fe000 rounds up in bf16 */

	CHECK_EQ_U(md_quantize_row(MD_DT_F32, src, buf, 4), 16);
	md_dequant_row(MD_DT_F32, buf, out, 4);
	for (int i = 0; i < 4; i++)
		CHECK_EQ_F(out[i], src[i]);
}

static void test_q8_0_layout(void)
{
	uint8_t b[2 * 34];
	float y[64];

	/* Block 0: d = 0.5 (f16 0x3800), qs[j] = j - 16.  Block 1: d = -0.25 (0xb400), qs = -128..127 ends. */
	put16(b, 0x3800);
	for (int j = 0; j < 32; j++)
		b[2 + j] = (uint8_t)(int8_t)(j - 16);
	put16(b + 34, 0xb400);
	for (int j = 0; j < 32; j++)
		b[36 + j] = 0;
	b[36] = 0x80;  /* -128 */
	b[37] = 0x7f;  /* 127 */
	b[67] = 0xff;  /* -1 */
	md_dequant_row(MD_DT_Q8_0, b, y, 64);
	CHECK_EQ_F(y[0], -8.0f);
	CHECK_EQ_F(y[16], 0.0f);
	CHECK_EQ_F(y[31], 7.5f);
	CHECK_EQ_F(y[32], 32.0f);
	CHECK_EQ_F(y[33], -31.75f);
	CHECK_EQ_F(y[34], -0.0f);
	CHECK_EQ_F(y[63], 0.25f);
}

static void test_q4_0_layout(void)
{
	uint8_t b[18];
	float y[32];

	/* d = 2.0 (0x4000); byte j: low nibble j, high nibble 15 - j.
	 * Element j (j < 16) = (j - 8) * 2, element 16 + j = (15 - j - 8) * 2. */
	put16(b, 0x4000);
	for (int j = 0; j < 16; j++)
		b[2 + j] = (uint8_t)(j | ((15 - j) << 4));
	md_dequant_row(MD_DT_Q4_0, b, y, 32);
	CHECK_EQ_F(y[0], -16.0f);
	CHECK_EQ_F(y[8], 0.0f);
	CHECK_EQ_F(y[15], 14.0f);
	CHECK_EQ_F(y[16], 14.0f);
	CHECK_EQ_F(y[23], 0.0f);
	CHECK_EQ_F(y[24], -2.0f);
	CHECK_EQ_F(y[31], -16.0f);
}

static void put32(uint8_t *p, uint32_t v)
{
	for (int k = 0; k < 4; k++)
		p[k] = (uint8_t)(v >> (8 * k));
}

static void test_q4_1_layout(void)
{
	uint8_t b[20] = { 0 };
	float y[32];

	/* d = 0.5, m = -1; byte j: low nibble j, high nibble 15 - j.
	 * Element j (j < 16) = j * 0.5 - 1, element 16 + j = (15 - j) * 0.5 - 1. */
	put16(b, 0x3800);
	put16(b + 2, 0xbc00);
	for (int j = 0; j < 16; j++)
		b[4 + j] = (uint8_t)(j | ((15 - j) << 4));
	md_dequant_row(MD_DT_Q4_1, b, y, 32);
	CHECK_EQ_F(y[0], -1.0f);
	CHECK_EQ_F(y[2], 0.0f);
	CHECK_EQ_F(y[15], 6.5f);
	CHECK_EQ_F(y[16], 6.5f);
	CHECK_EQ_F(y[31], -1.0f);
}

static void test_q5_layout(void)
{
	uint8_t b[24] = { 0 };
	float y[32];

	/* q5_0: d = 0.25, qh bits 0, 17 and 31; qs[0] = 0x21, qs[15] = 0xf3.
	 * q = nibble | bit << 4, elem = (q - 16) * 0.25:
	 *   e0: 1|16 -> 0.25;  e16: 2 -> -3.5;  e1: 0 -> -4;  e17: 0|16 -> 0;
	 *   e15: 3 -> -3.25;   e31: 15|16 -> 3.75 */
	put16(b, 0x3400);
	put32(b + 2, 1u | 1u << 17 | 1u << 31);
	b[6] = 0x21;
	b[6 + 15] = 0xf3;
	md_dequant_row(MD_DT_Q5_0, b, y, 32);
	CHECK_EQ_F(y[0], 0.25f);
	CHECK_EQ_F(y[16], -3.5f);
	CHECK_EQ_F(y[1], -4.0f);
	CHECK_EQ_F(y[17], 0.0f);
	CHECK_EQ_F(y[15], -3.25f);
	CHECK_EQ_F(y[31], 3.75f);

	/* q5_1: d = 2, m = 0.5, same qh and nibbles one field later: elem = q * 2 + 0.5. */
	memset(b, 0, sizeof(b));
	put16(b, 0x4000);
	put16(b + 2, 0x3800);
	put32(b + 4, 1u | 1u << 17 | 1u << 31);
	b[8] = 0x21;
	b[8 + 15] = 0xf3;
	md_dequant_row(MD_DT_Q5_1, b, y, 32);
	CHECK_EQ_F(y[0], 34.5f);
	CHECK_EQ_F(y[16], 4.5f);
	CHECK_EQ_F(y[1], 0.5f);
	CHECK_EQ_F(y[17], 32.5f);
	CHECK_EQ_F(y[15], 6.5f);
	CHECK_EQ_F(y[31], 62.5f);
}

/*
 * GGML's reference rounding for q4_1 / q5_0 / q5_1 (what llama-quantize writes without an
 * importance matrix), on a block worked out by hand: x = 0, 1, ..., 31 scaled by 0.5.
 */
static void test_legacy_rounding(void)
{
	float x[32];
	uint8_t b[24];

	for (int j = 0; j < 32; j++)
		x[j] = 0.5f * (float)j;
	/* q4_1: min 0, d = 15.5 / 15; q = trunc(x / d + 0.5): x = 0.5 j -> j * 15 / 31 + 0.5. */
	md_quantize_row(MD_DT_Q4_1, x, b, 32);
	CHECK_EQ_U(b[0] | b[1] << 8, md_f32_to_f16(15.5f / 15.0f));
	CHECK_EQ_U(b[2] | b[3] << 8, 0);
	CHECK_EQ_U(b[4] & 15, 0);       /* j = 0 */
	CHECK_EQ_U(b[4 + 1] & 15, 0);   /* j = 1: 0.48 + 0.5 -> 0 */
	CHECK_EQ_U(b[4 + 2] & 15, 1);   /* j = 2: 0.97 + 0.5 -> 1 */
	CHECK_EQ_U(b[4 + 15] >> 4, 15); /* j = 31 */
	/* q5_0: max-magnitude element 15.5 -> -16: d = -0.96875, q = trunc(x / d + 16.5). */
	md_quantize_row(MD_DT_Q5_0, x, b, 32);
	CHECK_EQ_U(b[0] | b[1] << 8, md_f32_to_f16(-0.96875f));
	CHECK_EQ_U(b[6] & 15, 0);       /* j = 0: q = 16: low nibble 0, fifth bit set */
	CHECK_EQ_U((b[2] & 1), 1);
	CHECK_EQ_U(b[6 + 15] >> 4, 0);  /* j = 31: q = 0 */
	CHECK_EQ_U((b[5] >> 7) & 1, 0);
	/* q5_1: d = 15.5 / 31 = 0.5: exact, q = j. */
	md_quantize_row(MD_DT_Q5_1, x, b, 32);
	float y[32];
	md_dequant_row(MD_DT_Q5_1, b, y, 32);
	for (int j = 0; j < 32; j++)
		CHECK_EQ_F(y[j], x[j]);
}

/*
 * Scale bytes shared by the q4_K and q5_K blocks below, decoded by hand:
 *   bytes 0..3  = c1 42 03 84: sc0..3 = 1, 2, 3, 4 (low 6 bits); top bits 3, 1, 0, 2 go to sc4..7.
 *   bytes 4..7  = 45 06 c7 08: m0..3 = 5, 6, 7, 8; top bits 1, 0, 3, 0 go to m4..7.
 *   bytes 8..11 = 21 93 0f a0: low nibbles 1, 3, 15, 0 -> sc4..7 low; high 2, 9, 0, 10 -> m4..7 low.
 *   sc4..7 = 1|3<<4 = 49, 3|1<<4 = 19, 15|0 = 15, 0|2<<4 = 32
 *   m4..7  = 2|1<<4 = 18, 9|0 = 9, 0|3<<4 = 48, 10|0 = 10
 * d = 0.5 (0x3800), dmin = 0.25 (0x3400); qs[k] = k for k = 0..127.
 */
static const uint8_t kq_scales[12] = { 0xc1, 0x42, 0x03, 0x84, 0x45, 0x06, 0xc7, 0x08,
				       0x21, 0x93, 0x0f, 0xa0 };

static void test_q4_K_layout(void)
{
	uint8_t b[144];
	float y[256];

	put16(b, 0x3800);
	put16(b + 2, 0x3400);
	memcpy(b + 4, kq_scales, 12);
	for (int k = 0; k < 128; k++)
		b[16 + k] = (uint8_t)k;
	md_dequant_row(MD_DT_Q4_K, b, y, 256);
	/* elem = 0.5 * sc[s] * q - 0.25 * m[s]; sub-block s = e / 32 reads qs[32 * (s / 2) + e % 32],
	 * low nibble for even s, high nibble for odd s. */
	CHECK_EQ_F(y[0], -1.25f);   /* s0, qs[0]=0x00 lo 0:   0 - 1.25 */
	CHECK_EQ_F(y[31], 6.25f);   /* s0, qs[31]=0x1f lo 15: 7.5 - 1.25 */
	CHECK_EQ_F(y[32], -1.5f);   /* s1, qs[0] hi 0:        0 - 1.5 */
	CHECK_EQ_F(y[63], -0.5f);   /* s1, qs[31] hi 1:       1 - 1.5 */
	CHECK_EQ_F(y[100], 2.0f);   /* s3, qs[36]=0x24 hi 2:  4 - 2 */
	CHECK_EQ_F(y[130], 44.5f);  /* s4, qs[66]=0x42 lo 2:  49 - 4.5 */
	CHECK_EQ_F(y[170], 35.75f); /* s5, qs[74]=0x4a hi 4:  38 - 2.25 */
	CHECK_EQ_F(y[200], 48.0f);  /* s6, qs[104]=0x68 lo 8: 60 - 12 */
	CHECK_EQ_F(y[224], 93.5f);  /* s7, qs[96]=0x60 hi 6:  96 - 2.5 */
	CHECK_EQ_F(y[255], 109.5f); /* s7, qs[127]=0x7f hi 7: 112 - 2.5 */
}

static void test_q5_K_layout(void)
{
	uint8_t b[176];
	float y[256];

	put16(b, 0x3800);
	put16(b + 2, 0x3400);
	memcpy(b + 4, kq_scales, 12);
	memset(b + 16, 0, 32); /* qh: bit s of qh[l] is the fifth bit of element l of sub-block s */
	b[16 + 0] = 0x01;      /* s0 l0 */
	b[16 + 2] = 0x10;      /* s4 l2 */
	b[16 + 4] = 0x08;      /* s3 l4 */
	b[16 + 8] = 0x40;      /* s6 l8 */
	b[16 + 10] = 0x20;     /* s5 l10 */
	b[16 + 31] = 0x80;     /* s7 l31 */
	for (int k = 0; k < 128; k++)
		b[48 + k] = (uint8_t)k;
	md_dequant_row(MD_DT_Q5_K, b, y, 256);
	CHECK_EQ_F(y[0], 6.75f);    /* q = 0 + 16:  8 - 1.25 */
	CHECK_EQ_F(y[31], 6.25f);   /* q = 15 (qh[31] bit 0 clear) */
	CHECK_EQ_F(y[32], -1.5f);   /* q = 0 (qh[0] bit 1 clear) */
	CHECK_EQ_F(y[63], -0.5f);   /* q = 1 */
	CHECK_EQ_F(y[100], 34.0f);  /* q = 2 + 16:  0.5*4*18 - 2 */
	CHECK_EQ_F(y[130], 436.5f); /* q = 2 + 16:  0.5*49*18 - 4.5 */
	CHECK_EQ_F(y[170], 187.75f);/* q = 4 + 16:  0.5*19*20 - 2.25 */
	CHECK_EQ_F(y[200], 168.0f); /* q = 8 + 16:  0.5*15*24 - 12 */
	CHECK_EQ_F(y[224], 93.5f);  /* q = 6 (qh[0] bit 7 clear) */
	CHECK_EQ_F(y[255], 365.5f); /* q = 7 + 16:  0.5*32*23 - 2.5 */
}

static void test_q2_K_layout(void)
{
	uint8_t b[84] = { 0 };
	float y[256];

	/* d = 0.5, dmin = 0.25. qs[0] = 0xe4 holds q = 0, 1, 2, 3 for elements 0, 32, 64, 96
	 * (sub-blocks 0, 2, 4, 6); qs[32] = 3 is element 128 (sub-block 8); qs[47] = 0x80 gives
	 * element 239 (second half, l = 15, j = 3: sub-block 14) q = 2.
	 * Scale bytes (low nibble scale, high nibble min), elem = 0.5 * sc * q - 0.25 * m:
	 *   e0: 0x21 -> -0.5;  e32: 0x0f -> 7.5;  e64: 0x13 -> 2.75;  e96: 0xf2 -> -0.75;
	 *   e128: 0x01 -> 1.5; e239: 0x5a -> 0.5 * 10 * 2 - 1.25 = 8.75; e16 (all zero) -> 0 */
	b[0] = 0x21;
	b[2] = 0x0f;
	b[4] = 0x13;
	b[6] = 0xf2;
	b[8] = 0x01;
	b[14] = 0x5a;
	b[16 + 0] = 0xe4;
	b[16 + 32] = 0x03;
	b[16 + 47] = 0x80;
	put16(b + 80, 0x3800);
	put16(b + 82, 0x3400);
	md_dequant_row(MD_DT_Q2_K, b, y, 256);
	CHECK_EQ_F(y[0], -0.5f);
	CHECK_EQ_F(y[32], 7.5f);
	CHECK_EQ_F(y[64], 2.75f);
	CHECK_EQ_F(y[96], -0.75f);
	CHECK_EQ_F(y[128], 1.5f);
	CHECK_EQ_F(y[239], 8.75f);
	CHECK_EQ_F(y[16], 0.0f);
	CHECK_EQ_F(y[1], -0.5f); /* q = 0, same sub-block as e0 */
}

static void test_q3_K_layout(void)
{
	uint8_t b[110] = { 0 };
	float y[256];

	/* d = 0.5. Stored scales (value + 32): sc0 = 33 (+1), sc2 = 0 (-32), sc4 = 63 (+31),
	 * sc6 = 32 (0), sc8 = 40 (+8), sc15 = 17 (-15); the rest 0 (-32).
	 *   low nibbles: sc0 -> byte 0 low = 1, sc4 -> byte 4 low = 15, sc8 -> byte 0 high = 8,
	 *   sc15 -> byte 7 high = 1; top 2 bits at bits 2 * (i / 4) of byte 8 + i % 4:
	 *   sc0 2 -> byte 8 bits 0-1, sc4 3 -> byte 8 bits 2-3, sc6 2 -> byte 10 bits 2-3,
	 *   sc8 2 -> byte 8 bits 4-5, sc15 1 -> byte 11 bits 6-7.
	 * hmask all set (no -4) but bit 0 of bytes 0 and 1 and bit 7 of byte 31.
	 * qs[0] = 0xe4: low bits 0, 1, 2, 3 for elements 0, 32, 64, 96; qs[32] = 2: element 128;
	 * qs[63] = 0xc0: element 255 (h 1, j 3, l 31) low bits 3.
	 *   e0: (0 - 4) * 0.5 * 1 = -2;  e1: -2;  e32: 1 * 0.5 * -32 = -16;  e64: 2 * 15.5 = 31;
	 *   e96: 3 * 0 = 0;  e128: 2 * 4 = 8;  e255: hmask[31] bit 7 clear: (3 - 4) * -7.5 = 7.5 */
	memset(b, 0xff, 32);
	b[0] = 0xfe;
	b[1] = 0xfe;
	b[31] = 0x7f;
	b[32 + 0] = 0xe4;
	b[32 + 32] = 0x02;
	b[32 + 63] = 0xc0;
	b[96 + 0] = 0x81;
	b[96 + 4] = 0x0f;
	b[96 + 7] = 0x10;
	b[96 + 8] = 0x2e;
	b[96 + 10] = 0x08;
	b[96 + 11] = 0x40;
	put16(b + 108, 0x3800);
	md_dequant_row(MD_DT_Q3_K, b, y, 256);
	CHECK_EQ_F(y[0], -2.0f);
	CHECK_EQ_F(y[1], -2.0f);
	CHECK_EQ_F(y[32], -16.0f);
	CHECK_EQ_F(y[64], 31.0f);
	CHECK_EQ_F(y[96], 0.0f);
	CHECK_EQ_F(y[128], 8.0f);
	CHECK_EQ_F(y[255], 7.5f);
}

static void test_iq4_nl_layout(void)
{
	uint8_t b[2 * 18] = { 0 };
	float y[64];

	/* Block 0: d = 0.5; qs[0] = 0xf0: e0 = level 0 (-127) / 2, e16 = level 15 (113) / 2;
	 * qs[1] = 0x78: e1 = level 8 (1) / 2, e17 = level 7 (-10) / 2.  Block 1: d = -2;
	 * qs[15] = 0x3c: e47 = level 12 (53) * -2, e63 = level 3 (-65) * -2. */
	put16(b, 0x3800);
	b[2] = 0xf0;
	b[3] = 0x78;
	put16(b + 18, 0xc000);
	b[18 + 2 + 15] = 0x3c;
	md_dequant_row(MD_DT_IQ4_NL, b, y, 64);
	CHECK_EQ_F(y[0], -63.5f);
	CHECK_EQ_F(y[16], 56.5f);
	CHECK_EQ_F(y[1], 0.5f);
	CHECK_EQ_F(y[17], -5.0f);
	CHECK_EQ_F(y[2], -63.5f); /* index 0 */
	CHECK_EQ_F(y[47], -106.0f);
	CHECK_EQ_F(y[63], 130.0f);
	CHECK_EQ_F(y[32], 254.0f);
}

static void test_iq4_xs_layout(void)
{
	uint8_t b[136] = { 0 };
	float y[256];

	/* d = 0.25. Sub-block scales ls (value - 32 is the multiplier): ib 0 = 33 (low 1 in
	 * scales_l[0] low nibble, top 2 in scales_h bits 0-1), ib 3 = 63 (low 15 in scales_l[1]
	 * high nibble, top 3 in bits 6-7), ib 6 = 20 (low 4 in scales_l[3] low nibble, top 1 in
	 * bits 12-13); the rest 0 (-32, i.e. -8 after d).
	 *   e0 (qs[0] low 0: -127) = 0.25 * 1 * -127;  e16 (qs[0] high 15: 113) = 28.25
	 *   e96 (qs[48] low 8: 1) = 7.75;  e112 (qs[48] high 0) = 7.75 * -127
	 *   e200 (ib 6, qs[96 + 8] low 13: 69) = 0.25 * -12 * 69 = -207
	 *   e224 (ib 7, qs[112] low 8) = -8 */
	put16(b, 0x3400);
	put16(b + 2, 2 | 3 << 6 | 1 << 12);
	b[4] = 0x01;
	b[5] = 0xf0;
	b[7] = 0x04;
	b[8 + 0] = 0xf0;
	b[8 + 48] = 0x08;
	b[8 + 104] = 0x0d;
	b[8 + 112] = 0x88;
	md_dequant_row(MD_DT_IQ4_XS, b, y, 256);
	CHECK_EQ_F(y[0], -31.75f);
	CHECK_EQ_F(y[16], 28.25f);
	CHECK_EQ_F(y[96], 7.75f);
	CHECK_EQ_F(y[112], -984.25f);
	CHECK_EQ_F(y[200], -207.0f);
	CHECK_EQ_F(y[224], -8.0f);
	CHECK_EQ_F(y[32], 1016.0f); /* ib 1: -8 * -127 */
}

static void test_mxfp4_layout(void)
{
	uint8_t b[3 * 17] = { 0 };
	float y[96];

	/* Block 0: e = 128 (factor 1); qs[0] = 0x97: e0 = level 7 (12), e16 = level 9 (-1).
	 * Block 1: e = 0 (2^-128, a subnormal float); qs[0] = 0x01: e32 = level 1 = 2^-128,
	 * e48 = level 0 = 0.  Block 2: e = 130 (4); qs[15] = 0xe6: e79 = level 6 (8) * 4,
	 * e95 = level 14 (-8) * 4; e64 = level 0 = 0. */
	b[0] = 128;
	b[1] = 0x97;
	b[17] = 0;
	b[18] = 0x01;
	b[34] = 130;
	b[35 + 15] = 0xe6;
	md_dequant_row(MD_DT_MXFP4, b, y, 96);
	CHECK_EQ_F(y[0], 12.0f);
	CHECK_EQ_F(y[16], -1.0f);
	CHECK_EQ_F(y[32], 0x1p-128f);
	CHECK_EQ_F(y[48], 0.0f);
	CHECK_EQ_F(y[79], 32.0f);
	CHECK_EQ_F(y[95], -32.0f);
	CHECK_EQ_F(y[64], 0.0f);
	CHECK_EQ_F(md_e8m0_half(1), 0x1p-127f);
	CHECK_EQ_F(md_e8m0_half(2), 0x1p-126f);
	CHECK_EQ_F(md_e8m0_half(254), 0x1p126f);

	/* GGML's rounding: max |x| = 6.5 -> e = floor(log2 6.5) - 2 + 127 = 127, factor 0.5,
	 * so level k stands for half its doubled value (0, 0.5, 1, 1.5, 2, 3, 4, 6 and
	 * negatives). 5 lies halfway between 4 (level 6) and 6 (level 7): the first wins;
	 * -0.3 -> -0.5 (level 9); 0.2 -> 0 (level 0); -6.5 -> -6 (level 15). */
	float x[32] = { 0 };
	x[0] = 5.0f;
	x[1] = -0.3f;
	x[17] = 0.2f;
	x[18] = -6.5f;
	md_quantize_row(MD_DT_MXFP4, x, b, 32);
	CHECK_EQ_U(b[0], 127);
	CHECK_EQ_U(b[1] & 15, 6);
	CHECK_EQ_U(b[2] & 15, 9);
	CHECK_EQ_U(b[2] >> 4, 0);
	CHECK_EQ_U(b[3] >> 4, 15);
}

static void test_q6_K_layout(void)
{
	uint8_t b[210];
	float y[256];

	/* ql[k] = k; qh all zero except qh[0] = 0xe4 (2-bit fields 0,1,2,3 from the bottom) and
	 * qh[37] = 0x1b (fields 3,2,1,0); scales[s] = s - 7; d = 0.5.
	 * elem e: h = e/128, r = e%128, k = r/32, l = r%32; low 4 bits from
	 * ql[64h + l + 32(k&1)] (low nibble k<2, high nibble k>=2), high 2 bits = field k of
	 * qh[32h + l]; value = 0.5 * scales[e/16] * (q - 32). */
	for (int k = 0; k < 128; k++)
		b[k] = (uint8_t)k;
	memset(b + 128, 0, 64);
	b[128 + 0] = 0xe4;
	b[128 + 37] = 0x1b;
	for (int s = 0; s < 16; s++)
		b[192 + s] = (uint8_t)(int8_t)(s - 7);
	put16(b + 208, 0x3800);
	md_dequant_row(MD_DT_Q6_K, b, y, 256);
	CHECK_EQ_F(y[0], 112.0f);   /* q = 0:          0.5 * -7 * -32 */
	CHECK_EQ_F(y[15], 59.5f);   /* q = 15:         0.5 * -7 * -17 */
	CHECK_EQ_F(y[32], 40.0f);   /* q = 0 | 1<<4:   0.5 * -5 * -16 */
	CHECK_EQ_F(y[64], -0.0f);   /* q = 0 | 2<<4 = 32: 0.5 * -3 * 0 (negative zero, as GGML) */
	CHECK_EQ_F(y[96], -9.0f);   /* q = 2 | 3<<4:   0.5 * -1 * 18 */
	CHECK_EQ_F(y[133], 10.5f);  /* q = 5 | 3<<4:   0.5 * 1 * 21 */
	CHECK_EQ_F(y[165], 7.5f);   /* q = 5 | 2<<4:   0.5 * 3 * 5 */
	CHECK_EQ_F(y[197], -30.0f); /* q = 4 | 1<<4:   0.5 * 5 * -12 */
	CHECK_EQ_F(y[229], -91.0f); /* q = 6:          0.5 * 7 * -26 */
	CHECK_EQ_F(y[255], -100.0f);/* q = 7:          0.5 * 8 * -25 */
}

struct rt_case {
	enum md_dtype t;
	double max_rel_rmse;
};

/* Quantize -> dequantize on N(0,1) data; relative RMSE = rms(error) / rms(x). */
static void test_round_trip(void)
{
	static const struct rt_case cases[] = {
		{ MD_DT_F32, 0.0 },      { MD_DT_F16, 0.0005 },  { MD_DT_BF16, 0.003 },
		{ MD_DT_Q8_0, 0.01 },    { MD_DT_Q6_K, 0.02 },   { MD_DT_Q5_K, 0.04 },
		{ MD_DT_Q4_K, 0.08 },    { MD_DT_Q4_0, 0.12 },   { MD_DT_Q4_1, 0.13 },
		{ MD_DT_Q5_0, 0.06 },    { MD_DT_Q5_1, 0.07 },   { MD_DT_Q2_K, 0.30 },
		{ MD_DT_Q3_K, 0.17 },    { MD_DT_IQ4_NL, 0.10 },
		{ MD_DT_IQ4_XS, 0.10 },  { MD_DT_MXFP4, 0.16 },
	};
	enum { N = 256 * 64 };
	float *x = malloc(N * sizeof(float));
	float *y = malloc(N * sizeof(float));
	uint8_t *q = malloc(N * sizeof(float));

	if (x == NULL || y == NULL || q == NULL) {
		fprintf(stderr, "out of memory\n");
		exit(1);
	}
	for (int i = 0; i < N; i++)
		x[i] = rng_normal();
	for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
		enum md_dtype t = cases[c].t;
		size_t bytes = md_quantize_row(t, x, q, N);
		double se = 0, sx = 0;

		CHECK_EQ_U(bytes, md_dtype_row_size(t, N));
		md_dequant_row(t, q, y, N);
		for (int i = 0; i < N; i++) {
			se += ((double)y[i] - x[i]) * ((double)y[i] - x[i]);
			sx += (double)x[i] * x[i];
		}
		double rel = sqrt(se / sx);
		printf("round trip %-5s relative rmse %.5f (bound %.4f)\n", md_dtype_info(t)->name, rel,
		       cases[c].max_rel_rmse);
		if (!(rel <= cases[c].max_rel_rmse)) {
			fprintf(stderr, "%s: relative rmse %.5f > %.4f\n", md_dtype_info(t)->name, rel,
				cases[c].max_rel_rmse);
			failures++;
		}
	}

	/* Zero rows must decode to exact zeros; rows with wide dynamic range stay sane. */
	static const enum md_dtype qtypes[] = { MD_DT_Q8_0, MD_DT_Q4_0, MD_DT_Q4_K, MD_DT_Q5_K,
						MD_DT_Q6_K, MD_DT_Q4_1, MD_DT_Q5_0, MD_DT_Q5_1,
						MD_DT_Q2_K, MD_DT_Q3_K, MD_DT_IQ4_NL,
						MD_DT_IQ4_XS, MD_DT_MXFP4 };
	for (size_t c = 0; c < sizeof(qtypes) / sizeof(qtypes[0]); c++) {
		enum md_dtype t = qtypes[c];
		memset(x, 0, 512 * sizeof(float));
		md_quantize_row(t, x, q, 512);
		md_dequant_row(t, q, y, 512);
		for (int i = 0; i < 512; i++) {
			if (y[i] != 0.0f) {
				fprintf(stderr, "%s: zero row decodes to y[%d] = %g\n",
					md_dtype_info(t)->name, i, (double)y[i]);
				failures++;
				break;
			}
		}
		/* All positive with an offset (exercises the min path of K-quants), scaled per block. */
		for (int i = 0; i < 512; i++)
			x[i] = (3.0f + rng_normal()) * ((i / 32) % 2 ? 100.0f : 0.01f);
		md_quantize_row(t, x, q, 512);
		md_dequant_row(t, q, y, 512);
		double se = 0, sx = 0;
		for (int i = 0; i < 512; i++) {
			se += ((double)y[i] - x[i]) * ((double)y[i] - x[i]);
			sx += (double)x[i] * x[i];
			if (!isfinite(y[i])) {
				fprintf(stderr, "%s: non-finite y[%d]\n", md_dtype_info(t)->name, i);
				failures++;
				break;
			}
		}
		double rel = sqrt(se / sx);
		/* 2 and 3 bits cannot reach 10% on offset data (4 / 8 levels over max - min), nor
		 * E2M1's coarse top steps (4, 6) with a power-of-two scale. */
		double lim = t == MD_DT_Q2_K ? 0.2 : t == MD_DT_Q3_K || t == MD_DT_MXFP4 ? 0.15 : 0.1;
		if (!(rel < lim)) {
			fprintf(stderr, "%s: offset row relative rmse %.5f >= %g\n",
				md_dtype_info(t)->name, rel, lim);
			failures++;
		}
	}
	free(x);
	free(y);
	free(q);
}

/* md_vec_dot_ref must equal the double dot of the dequantized row, within 1e-5 of sum |w x|. */
static void test_vec_dot(void)
{
	static const enum md_dtype types[] = { MD_DT_F32, MD_DT_F16, MD_DT_BF16, MD_DT_Q8_0,
					       MD_DT_Q4_0, MD_DT_Q4_K, MD_DT_Q5_K, MD_DT_Q6_K,
					       MD_DT_Q4_1, MD_DT_Q5_0, MD_DT_Q5_1, MD_DT_Q2_K,
					       MD_DT_Q3_K, MD_DT_IQ4_NL, MD_DT_IQ4_XS,
					       MD_DT_MXFP4 };
	enum { N = 256 * 12 };
	float *w = malloc(N * sizeof(float));
	float *x = malloc(N * sizeof(float));
	float *wd = malloc(N * sizeof(float));
	uint8_t *q = malloc(N * sizeof(float));

	if (w == NULL || x == NULL || wd == NULL || q == NULL) {
		fprintf(stderr, "out of memory\n");
		exit(1);
	}
	for (int i = 0; i < N; i++) {
		w[i] = rng_normal();
		x[i] = rng_normal();
	}
	for (size_t c = 0; c < sizeof(types) / sizeof(types[0]); c++) {
		enum md_dtype t = types[c];
		/* Also a length that is not a multiple of 32 for the float types. */
		int64_t lens[2] = { N, (md_dtype_info(t)->blck == 1) ? N - 7 : N - 256 };

		for (int k = 0; k < 2; k++) {
			int64_t n = lens[k];
			md_quantize_row(t, w, q, n);
			md_dequant_row(t, q, wd, n);
			double ref = 0, mag = 0;
			for (int64_t i = 0; i < n; i++) {
				ref += (double)wd[i] * x[i];
				mag += fabs((double)wd[i] * x[i]);
			}
			float got = md_vec_dot_ref(t, q, x, n);
			if (!(fabs(got - ref) <= 1e-5 * mag)) {
				fprintf(stderr, "%s n=%lld: vec_dot_ref %.9g != %.9g (tol %.3g)\n",
					md_dtype_info(t)->name, (long long)n, (double)got, ref,
					1e-5 * mag);
				failures++;
			}
		}
	}
	free(w);
	free(x);
	free(wd);
	free(q);
}

int main(void)
{
	test_type_table();
	test_f16();
	test_bf16();
	test_float_rows();
	test_q8_0_layout();
	test_q4_0_layout();
	test_q4_1_layout();
	test_q5_layout();
	test_legacy_rounding();
	test_q4_K_layout();
	test_q5_K_layout();
	test_q6_K_layout();
	test_q2_K_layout();
	test_q3_K_layout();
	test_iq4_nl_layout();
	test_iq4_xs_layout();
	test_mxfp4_layout();
	test_round_trip();
	test_vec_dot();
	if (failures) {
		fprintf(stderr, "test_quant: %d failure(s)\n", failures);
		return 1;
	}
	printf("test_quant: ok\n");
	return 0;
}
