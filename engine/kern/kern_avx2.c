/* x86 SIMD kernels: AVX2+FMA+F16C here; kern_avx512.c compiles this file again for AVX-512.
 *
 * Integer dot products: weights stay in their blocks, activations come quantized (kern.h).
 * Unsigned weight nibbles meet signed activation bytes in maddubs (u8 x s8 -> s16 pairs), then
 * madd with the sub-block scale folds the scale in for free; signed weights (q8_0, and the
 * non-linear levels of iq4_nl / iq4_xs / mxfp4, looked up by byte shuffle) use the sign trick
 * (|w| x sign(a, w)) and, with VNNI, vpdpbusd; offsets (q5_0's 16, q3_K's 4) and mins (q4_1,
 * q5_1, q2_K) come out of the activation block sums. Each call decodes a weight block once and uses
 * it for up to MD_KERN_NT activation rows held in registers. Float weights have a gemm that
 * tiles GR rows x GT tokens of accumulators and, under many tokens, converts 16-bit weights
 * to float once per band of rows. */
#include "engine/kern/kern.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

#ifdef KERN_AVX512
#define KTABLE md_kern_avx512_table
#define KNAME "avx512"
#else
#define KTABLE md_kern_avx2_table
#define KNAME "avx2"
#endif

#define INLINE static inline __attribute__((always_inline))

/*
 * Decode's own prefetch (AVX2, one token): a kernel streaming a weight row alone fetches the
 * bytes it will read QPF_BYTES ahead, a line at a time as its loop goes (QPF), and tells
 * matmul.c not to prefetch whole rows ahead for it (the table's own_pf). A steady trickle
 * keeps lines in flight past the 4 KiB pages where the hardware prefetchers stop; a burst of
 * a row's lines per row (matmul.c row_prefetch_on) did less on the Zen 3: default-1g in q8_0,
 * tg64 medians of 6 alternating rounds, 180 tok/s against 147 with the burst, 150 with
 * neither, 161 with both (bench/README.md, "Decode prefetches its own rows").
 */
#define QPF_BYTES 4096
#ifdef KERN_AVX512
#define QPF(p, bytes) ((void)(p), (void)(bytes))
#else
#define QPF(p, bytes)                                                                          \
	do {                                                                                   \
		for (int o_ = 0; o_ < (bytes); o_ += 64)                                       \
			_mm_prefetch((const char *)(p) + QPF_BYTES + o_, _MM_HINT_T1);         \
	} while (0)
#endif
/* Token loops over accumulator arrays unrolled in full, so the accumulators stay in registers
 * (left as a loop, GCC kept 8 zmm accumulators on the stack and zeroed them with stores). */
#define KT_UNROLL _Pragma("GCC unroll 8")

INLINE float ld_f16(const uint8_t *p)
{
	uint16_t h;
	memcpy(&h, p, 2);
	return _cvtsh_ss(h);
}

INLINE __m256i ld256(const void *p)
{
	return _mm256_loadu_si256((const __m256i *)p);
}

INLINE float hsum8(__m256 v)
{
	__m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
	x = _mm_add_ps(x, _mm_movehl_ps(x, x));
	x = _mm_add_ss(x, _mm_movehdup_ps(x));
	return _mm_cvtss_f32(x);
}

#ifdef KERN_AVX512
/* The high 8 floats of v (AVX-512F alone: the 32x8 extract is AVX512DQ). */
INLINE __m256 hi256_ps(__m512 v)
{
	return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}
#endif

/* Sum of u8 x s8 products in 8 int32 lanes (lane i covers bytes 4i .. 4i+3). */
INLINE __m256i dot_us8(__m256i u, __m256i s)
{
#ifdef KERN_AVX512
	return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
	return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* Same, each int32 lane multiplied by the int16 scale of its half (sc16 lanes). */
INLINE __m256i dot_us8_scaled(__m256i u, __m256i s, __m256i sc16)
{
	return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), sc16);
}

/* ---- q8_0 / q4_0 against md_q8b ---- */

#ifndef KERN_AVX512
/*
 * q8_0 on AVX2, in one arithmetic for every token count (kern.h: a tile equals its single
 * token calls): per block b the integer dot P_b (exact in int32), then lane b mod 8 of a
 * float accumulator gets fma(dw_b * da_b, P_b); the result is the sum of the 8 lanes in
 * hsum8's order. Measured on the Zen 5 (one core, weights in L2, 1536-element rows) against
 * the per-token tile that converts and scales every 4-element partial sum: 3.1 against 4.1 ns
 * per block for one token. On the Zen 3 the integer multiplies (maddubs, madd) issue two per
 * cycle, but vphaddd takes 2.5 cycles, so red8_i32 sums with unpacks; even so the per-token
 * sum of each block's lanes costs a tile ~3 cycles per block and token, which is why groups
 * of two and more tokens go through lanes_q8_0 (below), which needs no such sum.
 */

/* P of one block: 8 int32 lanes, lane i = dot of elements 4i .. 4i+3. */
INLINE __m256i q8_0_part(const uint8_t *wb, const int8_t *qs)
{
	const __m256i q = ld256(wb + 2);
	return dot_us8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(ld256(qs), q));
}
#endif

/* Lane j of the result: the sum of the 8 lanes of pj (exact int32). */
INLINE __m256i red8_i32(__m256i p0, __m256i p1, __m256i p2, __m256i p3, __m256i p4, __m256i p5,
			__m256i p6, __m256i p7)
{
	const __m256i s01 = _mm256_add_epi32(_mm256_unpacklo_epi32(p0, p1), _mm256_unpackhi_epi32(p0, p1));
	const __m256i s23 = _mm256_add_epi32(_mm256_unpacklo_epi32(p2, p3), _mm256_unpackhi_epi32(p2, p3));
	const __m256i s45 = _mm256_add_epi32(_mm256_unpacklo_epi32(p4, p5), _mm256_unpackhi_epi32(p4, p5));
	const __m256i s67 = _mm256_add_epi32(_mm256_unpacklo_epi32(p6, p7), _mm256_unpackhi_epi32(p6, p7));
	const __m256i s03 = _mm256_add_epi32(_mm256_unpacklo_epi64(s01, s23), _mm256_unpackhi_epi64(s01, s23));
	const __m256i s47 = _mm256_add_epi32(_mm256_unpacklo_epi64(s45, s67), _mm256_unpackhi_epi64(s45, s67));
	return _mm256_add_epi32(_mm256_permute2x128_si256(s03, s47, 0x20),
				_mm256_permute2x128_si256(s03, s47, 0x31));
}

#ifndef KERN_AVX512
/* One block of a row's last nb % 8, in the 8-block loop's arithmetic for lane b mod 8:
 * *l += (dw_b * da) * P_b, P_b exact. */
INLINE void q8_0_tail_block(const uint8_t *wb, const int8_t *qs, float da, float *l)
{
	const __m256i p = q8_0_part(wb, qs);
	__m128i h = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
	h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
	h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
	*l = fmaf(ld_f16(wb) * da, (float)_mm_cvtsi128_si32(h), *l);
}
#endif

/* hsum8's order over 8 floats in memory. */
INLINE float sum8_lanes(const float *l)
{
	return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* The f16 scales of 8 consecutive blocks (bs bytes apart, the scale first) as floats. */
INLINE __m256 scales8(const uint8_t *wb, const int bs)
{
	uint16_t h[8];
	for (int i = 0; i < 8; i++)
		memcpy(&h[i], wb + bs * i, 2);
	return _mm256_cvtph_ps(_mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3],
					      (short)h[4], (short)h[5], (short)h[6], (short)h[7]));
}

#ifndef KERN_AVX512
INLINE void tile_q8_0(int64_t n, const uint8_t *w, const uint8_t *a, size_t as, float *y, size_t ys,
		      const int nt)
{
	__m256 acc[MD_KERN_NT];
	for (int t = 0; t < nt; t++)
		acc[t] = _mm256_setzero_ps();
	const int64_t nb = n / 32, nb8 = nb & ~(int64_t)7;
	for (int64_t b = 0; b < nb8; b += 8) {
		const uint8_t *wb = w + 34 * b;
		if (nt == 1)
			QPF(wb, 8 * 34);
		const __m256 dw = scales8(wb, 34);
		for (int t = 0; t < nt; t++) {
			const struct md_q8b *ab = (const struct md_q8b *)(a + (size_t)t * as) + b;
			const __m256i p = red8_i32(q8_0_part(wb, ab[0].qs), q8_0_part(wb + 34, ab[1].qs),
						   q8_0_part(wb + 68, ab[2].qs), q8_0_part(wb + 102, ab[3].qs),
						   q8_0_part(wb + 136, ab[4].qs), q8_0_part(wb + 170, ab[5].qs),
						   q8_0_part(wb + 204, ab[6].qs), q8_0_part(wb + 238, ab[7].qs));
			const __m256 s = _mm256_mul_ps(dw, _mm256_loadu_ps(md_q8b_scales(a + (size_t)t * as, n) + b));
			acc[t] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(p), acc[t]);
		}
	}
	for (int t = 0; t < nt; t++) {
		if (nb8 == nb) {
			y[(size_t)t * ys] = hsum8(acc[t]);
			continue;
		}
		/* The last nb % 8 blocks, lane by lane in the same arithmetic. */
		float l[8];
		_mm256_storeu_ps(l, acc[t]);
		const struct md_q8b *ab = (const struct md_q8b *)(a + (size_t)t * as);
		const float *da = md_q8b_scales(a + (size_t)t * as, n);
		for (int64_t b = nb8; b < nb; b++)
			q8_0_tail_block(w + 34 * b, ab[b].qs, da[b], &l[b & 7]);
		y[(size_t)t * ys] = sum8_lanes(l);
	}
}
#endif

/*
 * Tokens in lanes on AVX2 (kern.h): blocks in lanes, not tokens. tile_q8_0's cost past the
 * integer multiplies is red8_i32, the per-token sum of each block's 8 int32 lanes. Here the
 * group's weights are transposed instead, once for all its tokens: 8 blocks are loaded and
 * turned (tr8_i32) so that register j holds elements 4j .. 4j+3 of each of the 8 blocks, lane
 * i for block i. Each token's activation row was turned the same way by pack_q8b_lanes, so
 * the sum over j of maddubs/madd products leaves block i's integer dot P_i in lane i, and
 * the float step is tile_q8_0's: lane b mod 8 gets fma(dw_b * da_b, P_b), summed in hsum8's
 * order. The same bits as dot_q8_0, for any nt. Measured on the Zen 3 (one core, weights in
 * L2, 2048-element rows; cycles at 3.2 GHz per block and token, the tile's in brackets): 2
 * tokens 3.0 (3.5), 3 tokens 2.6 (3.1), 4 tokens 2.3 (3.1), 8 tokens 2.0 (3.1; the old
 * tokens-in-lanes kernel 2.4). So groups of two and more tokens take this kernel (lanes_min).
 *
 * Layout (md_kern_lanes_size(n) bytes): for each whole run of 8 blocks, for each of 8
 * token slots, 288 bytes: the 8 block scales (float), then 8 x 32 bytes, register j's
 * bytes; then, for each of the n / 32 % 8 blocks left, 288 bytes: the 8 tokens' scales,
 * then their 32 bytes as quantized. Slots past nt are not written (nor read).
 */
#define L8_TOK 288                /* bytes of one token's run of 8 blocks */
#define L8_RUN (8 * L8_TOK)        /* bytes of one run of 8 blocks, all slots */
#define L16_TOK (2 * L8_TOK)       /* AVX-512: one token's run of 16 blocks (below) */

/* 8 x 8 transpose of int32: r[j] lane i <- r[i] lane j. */
INLINE void tr8_i32(__m256i *r)
{
	const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
	const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
	const __m256i t4 = _mm256_unpacklo_epi32(r[4], r[5]), t5 = _mm256_unpackhi_epi32(r[4], r[5]);
	const __m256i t6 = _mm256_unpacklo_epi32(r[6], r[7]), t7 = _mm256_unpackhi_epi32(r[6], r[7]);
	const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
	const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
	const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
	const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
	r[0] = _mm256_permute2x128_si256(u0, u4, 0x20);
	r[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
	r[2] = _mm256_permute2x128_si256(u2, u6, 0x20);
	r[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
	r[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
	r[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
	r[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
	r[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

/* AVX-512 (tile_s8, lanes_s8 below) packs runs of 16 blocks while a row has them, each
 * token's slot 576 bytes: the 16 scales, then register j's 64 bytes, elements 4j .. 4j+3 of
 * blocks 0-7 and then of blocks 8-15; a run of 8 as above for the next 8 blocks left; its
 * transposed bytes unsigned, x ^ 0x80 = x + 128, for vpdpbusd. The blocks left after the
 * runs stay as quantized, as on AVX2. */
#ifdef KERN_AVX512
#define LANES_RUN16 1
#define LANES_X(v) _mm256_xor_si256((v), _mm256_set1_epi8((char)0x80))
#else
#define LANES_RUN16 0
#define LANES_X(v) (v)
#endif

static void pack_q8b_lanes(const void *av, size_t as, int nt, int64_t n, void *dst)
{
	const uint8_t *a = av;
	uint8_t *o = dst;
	const int64_t nb = n / 32, nb16 = LANES_RUN16 ? nb & ~(int64_t)15 : 0, nb8 = nb & ~(int64_t)7;
	for (int64_t b = 0; b < nb8;) {
		const int rb = b < nb16 ? 16 : 8; /* blocks in this run */
		for (int t = 0; t < nt; t++) {
			uint8_t *ot = o + (size_t)t * (rb == 16 ? L16_TOK : L8_TOK);
			const uint8_t *row = a + (size_t)t * as;
			const struct md_q8b *ab = (const struct md_q8b *)row + b;
			memcpy(ot, md_q8b_scales(row, n) + b, (size_t)rb * sizeof(float));
			for (int h = 0; h < rb / 8; h++) {
				__m256i r[8];
				for (int i = 0; i < 8; i++)
					r[i] = ld256(ab[8 * h + i].qs);
				tr8_i32(r);
				for (int j = 0; j < 8; j++)
					_mm256_storeu_si256((__m256i *)(ot + 4 * rb * (j + 1) + 32 * h), LANES_X(r[j]));
			}
		}
		o += rb == 16 ? 8 * L16_TOK : L8_RUN;
		b += rb;
	}
	for (int64_t b = nb8; b < nb; b++, o += L8_TOK) {
		for (int t = 0; t < nt; t++) {
			const uint8_t *row = a + (size_t)t * as;
			memcpy(o + sizeof(float) * (size_t)t, md_q8b_scales(row, n) + b, sizeof(float));
			memcpy(o + 32 + 32 * t, ((const struct md_q8b *)row)[b].qs, 32);
		}
	}
}

#ifndef KERN_AVX512
INLINE void lanes_q8_0_k(int64_t n, const uint8_t *w, const uint8_t *p, float *y, size_t ys,
			 const int nt)
{
	const __m256i ones = _mm256_set1_epi16(1);
	const int64_t nb = n / 32, nb8 = nb & ~(int64_t)7;
	__m256 acc[8];
	KT_UNROLL
	for (int t = 0; t < nt; t++)
		acc[t] = _mm256_setzero_ps();
	for (int64_t b = 0; b < nb8; b += 8, p += L8_RUN) {
		const uint8_t *wb = w + 34 * b;
		QPF(wb, 8 * 34);
		__m256i r[8];
		for (int i = 0; i < 8; i++)
			r[i] = ld256(wb + 2 + 34 * i);
		tr8_i32(r);
		const __m256 dw = scales8(wb, 34);
		__m256i pt[8];
		KT_UNROLL
		for (int t = 0; t < nt; t++)
			pt[t] = _mm256_setzero_si256();
		for (int j = 0; j < 8; j++) {
			const __m256i u = _mm256_sign_epi8(r[j], r[j]);
			KT_UNROLL
			for (int t = 0; t < nt; t++) {
				const __m256i x = ld256(p + (size_t)t * L8_TOK + 32 + 32 * j);
				pt[t] = _mm256_add_epi32(pt[t], _mm256_madd_epi16(
					_mm256_maddubs_epi16(u, _mm256_sign_epi8(x, r[j])), ones));
			}
		}
		KT_UNROLL
		for (int t = 0; t < nt; t++) {
			const __m256 s = _mm256_mul_ps(dw, _mm256_loadu_ps((const float *)(p + (size_t)t * L8_TOK)));
			acc[t] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(pt[t]), acc[t]);
		}
	}
	for (int t = 0; t < nt; t++) {
		if (nb8 == nb) {
			y[(size_t)t * ys] = hsum8(acc[t]);
			continue;
		}
		/* The last nb % 8 blocks, lane by lane, as tile_q8_0 does them. */
		float l[8];
		_mm256_storeu_ps(l, acc[t]);
		const uint8_t *q = p;
		for (int64_t b = nb8; b < nb; b++, q += L8_TOK) {
			float da;
			memcpy(&da, q + sizeof(float) * (size_t)t, sizeof(float));
			q8_0_tail_block(w + 34 * b, (const int8_t *)(q + 32 + 32 * t), da, &l[b & 7]);
		}
		y[(size_t)t * ys] = sum8_lanes(l);
	}
}

/* q8_0 rows against a packed group of nt tokens (the layout above). */
static void lanes_q8_0(int64_t n, const void *wv, size_t wst, int nr, const void *pv, int nt,
		       float *y, size_t ys)
{
	for (int r = 0; r < nr; r++) {
		const uint8_t *w = (const uint8_t *)wv + (size_t)r * wst;
		switch (nt) {
		case 1: lanes_q8_0_k(n, w, pv, y + r, ys, 1); break;
		case 2: lanes_q8_0_k(n, w, pv, y + r, ys, 2); break;
		case 3: lanes_q8_0_k(n, w, pv, y + r, ys, 3); break;
		case 4: lanes_q8_0_k(n, w, pv, y + r, ys, 4); break;
		case 5: lanes_q8_0_k(n, w, pv, y + r, ys, 5); break;
		case 6: lanes_q8_0_k(n, w, pv, y + r, ys, 6); break;
		case 7: lanes_q8_0_k(n, w, pv, y + r, ys, 7); break;
		default: lanes_q8_0_k(n, w, pv, y + r, ys, 8); break;
		}
	}
}
#else
/* The signed-byte types on AVX-512 (q8_0, q4_0, q5_0; tile_s8 below): signed weights against
 * unsigned activations (x ^ 0x80 = x + 128) in vpdpbusd, which adds 128 * sum(w) per int32
 * lane; the sum starts at minus that (neg_w128, once per block for every token), so the
 * integer dot is exactly sum(x * w) without the sign trick's two operations per token. */
INLINE __m256i neg_w128(__m256i q)
{
	return _mm256_sub_epi32(_mm256_setzero_si256(),
				_mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8((char)0x80), q));
}

INLINE __m512 set2_ps(float lo, float hi)
{
	return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(lo)),
						   _mm256_castps_pd(_mm256_set1_ps(hi)), 1));
}

#endif

/* The AVX-512 tiles of the 32-element types below accumulate even blocks in acc0 and odd ones
 * in acc1 (the sum is hsum8(acc0 + acc1)); the block loop runs in pairs so that each
 * accumulator stays in a register (indexed by b & 1 they lived on the stack, and every block
 * waited for a store to forward). */
#define PAIR_LOOP(nb, blk)                                                                 \
	do {                                                                               \
		int64_t b_ = 0;                                                            \
		for (; b_ + 2 <= (nb); b_ += 2) {                                          \
			blk(b_, acc0);                                                     \
			blk(b_ + 1, acc1);                                                 \
		}                                                                          \
		if (b_ < (nb))                                                             \
			blk(b_, acc0);                                                     \
	} while (0)

/* Byte i is 16 where bit i of h is set: the fifth bits of a q5_0 / q5_1 block. */
INLINE __m256i bit5_bytes(uint32_t h)
{
	const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
					      2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
	const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
	const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)h), shuf), bit);
	return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(16));
}

/* q4_1, q5_0 and q5_1 against md_q8b: unsigned 4/5-bit weights as q4_0; the min of q4_1 /
 * q5_1 adds m * da * sum(a) per block (kept in a float per token), q5_0's offset of 16
 * subtracts 16 * sum(a) from the integer sum. */
INLINE void blk_q451(const uint8_t *w, const uint8_t *a, size_t as, int64_t b, const int nt,
		     __m256 *acc, float *accm, const int type)
{
	const __m256i m4 = _mm256_set1_epi8(15);
	const int bs = type == MD_DT_Q4_1 ? 20 : type == MD_DT_Q5_0 ? 22 : 24;
	const int qso = type == MD_DT_Q4_1 ? 4 : type == MD_DT_Q5_0 ? 6 : 8;
	const uint8_t *wb = w + (size_t)bs * b;
	const __m128i x = _mm_loadu_si128((const __m128i *)(wb + qso));
	__m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), m4);
	if (type != MD_DT_Q4_1) {
		uint32_t h;
		memcpy(&h, wb + qso - 4, 4);
		q = _mm256_or_si256(q, bit5_bytes(h));
	}
	const float dw = ld_f16(wb);
	const float mw = type != MD_DT_Q5_0 ? ld_f16(wb + 2) : 0.0f;
	for (int t = 0; t < nt; t++) {
		const struct md_q8b *ab = (const struct md_q8b *)(a + (size_t)t * as) + b;
		__m256i p = dot_us8(q, ld256(ab->qs));
		if (type == MD_DT_Q5_0)
			p = _mm256_sub_epi32(p, _mm256_zextsi128_si256(_mm_cvtsi32_si128(16 * ab->s)));
		else
			accm[t] += mw * ab->d * (float)ab->s;
		acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ab->d), _mm256_cvtepi32_ps(p), acc[t]);
	}
}

/* q4_1, q5_0 and q5_1 against md_q8b: unsigned 4/5-bit weights as q4_0; the min of q4_1 /
 * q5_1 adds m * da * sum(a) per block (kept in a float per token), q5_0's offset of 16
 * subtracts 16 * sum(a) from the integer sum. */
INLINE void tile_q451(int64_t n, const uint8_t *w, const uint8_t *a, size_t as, float *y,
		      size_t ys, const int nt, const int type)
{
	__m256 acc0[MD_KERN_NT], acc1[MD_KERN_NT];
	float accm[MD_KERN_NT];
	for (int t = 0; t < nt; t++) {
		acc0[t] = acc1[t] = _mm256_setzero_ps();
		accm[t] = 0;
	}
#define BLK(b, acc) blk_q451(w, a, as, b, nt, acc, accm, type)
	PAIR_LOOP(n / 32, BLK);
#undef BLK
	for (int t = 0; t < nt; t++)
		y[(size_t)t * ys] = hsum8(_mm256_add_ps(acc0[t], acc1[t])) + accm[t];
}

#ifdef KERN_AVX512
/*
 * q8_0, q4_0 and q5_0 on AVX-512: AVX2's blocks in lanes (tile_q8_0 and lanes_q8_0 above),
 * each block's weights as 32 signed bytes (s8_weights: q8_0 as stored, q4_0 / q5_0 decoded
 * to u - 8 / u - 16) against unsigned activations in vpdpbusd (neg_w128). Per block b the
 * integer dot P_b, exact in int32; lane b mod 16 of a float accumulator gets
 * fma(dw_b * da_b, P_b), in block order; the result is hsum8(lanes 0-7 + lanes 8-15). The
 * tile sums each block's 8 int32 lanes per token (red8_i32); groups of 2 and more tokens go
 * through lanes_s8_k (packed by pack_q8b_lanes), whose transposed weights leave P_b in its
 * lane with no per-token sum: the same bits for any token count.
 *
 * Before, the pair kernels (two blocks per 512-bit register, a float fma per 4-element
 * partial sum) spent 4 floating-point operations per block pair and token; in lanes_s8_k a
 * token costs 8 vpdpbusd and 4 float operations per 16 blocks. Measured on the Zen 5:
 * bench/README.md, "AVX-512: blocks in lanes for the signed-byte types".
 */
INLINE __m256i s8_weights(const uint8_t *wb, const int type)
{
	if (type == MD_DT_Q8_0)
		return ld256(wb + 2);
	const int five = type == MD_DT_Q5_0;
	const __m128i x = _mm_loadu_si128((const __m128i *)(wb + (five ? 6 : 2)));
	__m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), _mm256_set1_epi8(15));
	if (five) {
		uint32_t h;
		memcpy(&h, wb + 2, 4);
		q = _mm256_or_si256(q, bit5_bytes(h));
	}
	return _mm256_sub_epi8(q, _mm256_set1_epi8(five ? 16 : 8));
}

/* P of one block (8 int32 lanes) of signed weights q, wn = neg_w128(q), against an
 * activation block's bytes qs. */
INLINE __m256i s8_part(__m256i q, __m256i wn, const int8_t *qs)
{
	return _mm256_dpbusd_epi32(wn, _mm256_xor_si256(ld256(qs), _mm256_set1_epi8((char)0x80)), q);
}

/* s8_part for two tokens in one register: q2, wn2 the block's q and wn in both halves, av
 * token t's activations in the low half and t + 1's in the high. */
INLINE __m512i s8_part2(__m512i q2, __m512i wn2, __m512i av)
{
	return _mm512_dpbusd_epi32(wn2, _mm512_xor_si512(av, _mm512_set1_epi8((char)0x80)), q2);
}

INLINE int s8_block_bytes(const int type)
{
	return type == MD_DT_Q8_0 ? 34 : type == MD_DT_Q5_0 ? 22 : 18;
}

/* A row's last r = nb % 8 blocks (0..7; r a constant here, s8_tail below picks it, so the
 * loop over blocks unrolls and the registers hold them) at wb, decoded once for nt tokens
 * (two tokens to a 512-bit register, an odd last one in 256 bits), into a third
 * accumulator of each token: at[t] = sum over i of fma(dw_i * da_i, the 8 int32 partial sums
 * of block i), in block order; the row's result is hsum8((lo + hi) + at). No lane sum per
 * block: rows of fewer than 8 blocks are all tail, and there a per-block sum (a masked run
 * through red8_i32) made one token 1.6-2.5x slower than the pair kernels before (bench/README.md,
 * "AVX-512: blocks in lanes for the signed-byte types"). Token t's bytes of block i are at
 * qs + t * qts + i * qbs, its scale at da + t * dts + i * dbs (bytes). */
INLINE void s8_tail_k(const uint8_t *wb, const int r, const int type, const int nt, const uint8_t *qs,
		      size_t qts, size_t qbs, const uint8_t *da, size_t dts, size_t dbs, __m256 *at)
{
	const int bs = s8_block_bytes(type);
	__m256i q[8], wn[8];
	float dw[8];
	for (int i = 0; i < r; i++) {
		q[i] = s8_weights(wb + bs * i, type);
		wn[i] = neg_w128(q[i]);
		dw[i] = ld_f16(wb + bs * i);
	}
	int t0 = 0;
	/* Two tokens per 512-bit register (the low half token t, the high t + 1), each lane
	 * through the same operations as the loop below, so the same bits. One token per
	 * register, rows of 4 and 6 blocks ran 1.15-1.5x slower at 8 tokens than the pair
	 * kernels before the lanes kernels; two to a register, 1.1-1.4x faster than one, and
	 * level with or faster than those (bench/README.md, "Short rows"). */
	__m512i q2[8], wn2[8];
	for (int i = 0; i < r; i++) {
		q2[i] = _mm512_broadcast_i64x4(q[i]);
		wn2[i] = _mm512_broadcast_i64x4(wn[i]);
	}
	KT_UNROLL
	for (; t0 + 2 <= nt; t0 += 2) {
		__m512 x = _mm512_setzero_ps();
		for (int i = 0; i < r; i++) {
			float e0, e1;
			memcpy(&e0, da + dts * t0 + dbs * i, sizeof(float));
			memcpy(&e1, da + dts * (t0 + 1) + dbs * i, sizeof(float));
			const uint8_t *a0 = qs + qts * t0 + qbs * i;
			const __m512i av = qts == 32 ? _mm512_loadu_si512(a0)
					   : _mm512_inserti64x4(_mm512_castsi256_si512(ld256(a0)),
								ld256(a0 + qts), 1);
			const __m512i pv = s8_part2(q2[i], wn2[i], av);
			const __m512 e = _mm512_mask_broadcastss_ps(_mm512_set1_ps(e0), 0xff00,
								    _mm_set_ss(e1));
			x = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(dw[i]), e),
					    _mm512_cvtepi32_ps(pv), x);
		}
		at[t0] = _mm512_castps512_ps256(x);
		at[t0 + 1] = hi256_ps(x);
	}
	KT_UNROLL
	for (int t = t0; t < nt; t++) {
		__m256 x = _mm256_setzero_ps();
		for (int i = 0; i < r; i++) {
			float e;
			memcpy(&e, da + dts * t + dbs * i, sizeof(float));
			const __m256i p = s8_part(q[i], wn[i], (const int8_t *)(qs + qts * t + qbs * i));
			x = _mm256_fmadd_ps(_mm256_set1_ps(dw[i] * e), _mm256_cvtepi32_ps(p), x);
		}
		at[t] = x;
	}
}

/* s8_tail_k for r = nb % 8 blocks left at wb (at[t] = 0 where r = 0). */
INLINE void s8_tail(const uint8_t *wb, const int r, const int type, const int nt, const uint8_t *qs,
		    size_t qts, size_t qbs, const uint8_t *da, size_t dts, size_t dbs, __m256 *at)
{
	switch (r) {
	case 1: s8_tail_k(wb, 1, type, nt, qs, qts, qbs, da, dts, dbs, at); break;
	case 2: s8_tail_k(wb, 2, type, nt, qs, qts, qbs, da, dts, dbs, at); break;
	case 3: s8_tail_k(wb, 3, type, nt, qs, qts, qbs, da, dts, dbs, at); break;
	case 4: s8_tail_k(wb, 4, type, nt, qs, qts, qbs, da, dts, dbs, at); break;
	case 5: s8_tail_k(wb, 5, type, nt, qs, qts, qbs, da, dts, dbs, at); break;
	case 6: s8_tail_k(wb, 6, type, nt, qs, qts, qbs, da, dts, dbs, at); break;
	case 7: s8_tail_k(wb, 7, type, nt, qs, qts, qbs, da, dts, dbs, at); break;
	default: s8_tail_k(wb, 0, type, nt, qs, qts, qbs, da, dts, dbs, at); break;
	}
}

/* One run of 8 blocks at block b for nt tokens: acc[t] lane i += (dw * da) * P of block b + i. */
INLINE void s8_run8(const uint8_t *wb, const uint8_t *a, size_t as, int64_t b, const float *const *da,
		    __m256 *acc, const int nt, const int type)
{
	const int bs = s8_block_bytes(type);
	__m256i q[8], wn[8];
	for (int i = 0; i < 8; i++) {
		q[i] = s8_weights(wb + bs * i, type);
		wn[i] = neg_w128(q[i]);
	}
	const __m256 dw = scales8(wb, bs);
	KT_UNROLL
	for (int t = 0; t < nt; t++) {
		const struct md_q8b *ab = (const struct md_q8b *)(a + (size_t)t * as) + b;
		const __m256i p = red8_i32(s8_part(q[0], wn[0], ab[0].qs), s8_part(q[1], wn[1], ab[1].qs),
					   s8_part(q[2], wn[2], ab[2].qs), s8_part(q[3], wn[3], ab[3].qs),
					   s8_part(q[4], wn[4], ab[4].qs), s8_part(q[5], wn[5], ab[5].qs),
					   s8_part(q[6], wn[6], ab[6].qs), s8_part(q[7], wn[7], ab[7].qs));
		acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_loadu_ps(da[t] + b)),
					 _mm256_cvtepi32_ps(p), acc[t]);
	}
}

/* The tile: blocks b with b mod 16 < 8 in lo, the others in hi (lane b mod 16 of the lanes
 * kernel's 16); the blocks past the runs of 8 as s8_tail says. */
INLINE void tile_s8(int64_t n, const uint8_t *w, const uint8_t *a, size_t as, float *y, size_t ys,
		    const int nt, const int type)
{
	const int bs = s8_block_bytes(type);
	__m256 lo[MD_KERN_NT], hi[MD_KERN_NT];
	const float *da[MD_KERN_NT];
	KT_UNROLL
	for (int t = 0; t < nt; t++) {
		lo[t] = hi[t] = _mm256_setzero_ps();
		da[t] = md_q8b_scales(a + (size_t)t * as, n);
	}
	const int64_t nb = n / 32, nb8 = nb & ~(int64_t)7;
	int64_t b = 0;
	for (; b + 16 <= nb8; b += 16) {
		s8_run8(w + (size_t)bs * b, a, as, b, da, lo, nt, type);
		s8_run8(w + (size_t)bs * (b + 8), a, as, b + 8, da, hi, nt, type);
	}
	if (b < nb8)
		s8_run8(w + (size_t)bs * b, a, as, b, da, lo, nt, type);
	__m256 at[MD_KERN_NT];
	s8_tail(w + (size_t)bs * nb8, (int)(nb - nb8), type, nt,
		(const uint8_t *)((const struct md_q8b *)a + nb8)->qs, as, sizeof(struct md_q8b),
		(const uint8_t *)(da[0] + nb8), as, sizeof(float), at);
	for (int t = 0; t < nt; t++)
		y[(size_t)t * ys] = hsum8(_mm256_add_ps(_mm256_add_ps(lo[t], hi[t]), at[t]));
}

/* Rows against a packed group of nt tokens (pack_q8b_lanes' layout): each run of 16 blocks
 * decoded and transposed once for all the tokens (register j: elements 4j .. 4j+3 of the 16
 * blocks, lane i for block i), its -128 sum(w) per block lane too; a token's products then
 * leave P_b in lane b mod 16, summed over j in two chains (j < 4, j >= 4: exact, and half the
 * dependent vpdpbusd for few tokens). A run of 8 left goes to the low lanes. */
INLINE void lanes_s8_k(int64_t n, const uint8_t *w, const uint8_t *p, float *y, size_t ys,
		       const int nt, const int type)
{
	const int bs = s8_block_bytes(type);
	const int64_t nb = n / 32, nb16 = nb & ~(int64_t)15, nb8 = nb & ~(int64_t)7;
	const __m512i x80 = _mm512_set1_epi8((char)0x80);
	__m512 acc[MD_KERN_LANES];
	KT_UNROLL
	for (int t = 0; t < nt; t++)
		acc[t] = _mm512_setzero_ps();
	for (int64_t b = 0; b < nb16; b += 16, p += 8 * L16_TOK) {
		const uint8_t *wb = w + (size_t)bs * b;
		/* The weights QPF_BYTES ahead, as AVX2's decode tiles fetch theirs (QPF): from
		 * memory the products of few tokens waited on each run's loads (bench/README.md,
		 * "AVX-512: blocks in lanes for the signed-byte types"). */
		for (int o = 0; o < 16 * bs; o += 64)
			_mm_prefetch((const char *)wb + QPF_BYTES + o, _MM_HINT_T0);
		__m256i ra[8], rb[8];
		for (int i = 0; i < 8; i++) {
			ra[i] = s8_weights(wb + bs * i, type);
			rb[i] = s8_weights(wb + bs * (8 + i), type);
		}
		tr8_i32(ra);
		tr8_i32(rb);
		__m512i r[8];
		__m512i wn = _mm512_setzero_si512();
		for (int j = 0; j < 8; j++) {
			r[j] = _mm512_inserti64x4(_mm512_castsi256_si512(ra[j]), rb[j], 1);
			wn = _mm512_dpbusd_epi32(wn, x80, r[j]);
		}
		wn = _mm512_sub_epi32(_mm512_setzero_si512(), wn);
		const __m512 dw = _mm512_castpd_ps(_mm512_insertf64x4(
			_mm512_castpd256_pd512(_mm256_castps_pd(scales8(wb, bs))),
			_mm256_castps_pd(scales8(wb + 8 * bs, bs)), 1));
		__m512i p0[MD_KERN_LANES], p1[MD_KERN_LANES];
		KT_UNROLL
		for (int t = 0; t < nt; t++) {
			p0[t] = wn;
			p1[t] = _mm512_setzero_si512();
		}
		if (nt <= 4) {
			for (int j = 0; j < 4; j++) {
				KT_UNROLL
				for (int t = 0; t < nt; t++) {
					const uint8_t *pt = p + (size_t)t * L16_TOK + 64;
					p0[t] = _mm512_dpbusd_epi32(p0[t], _mm512_loadu_si512(pt + 64 * j), r[j]);
					p1[t] = _mm512_dpbusd_epi32(p1[t], _mm512_loadu_si512(pt + 64 * (j + 4)),
								    r[j + 4]);
				}
			}
		} else { /* enough chains in the tokens; two per token would not fit the registers */
			for (int j = 0; j < 8; j++) {
				KT_UNROLL
				for (int t = 0; t < nt; t++)
					p0[t] = _mm512_dpbusd_epi32(p0[t], _mm512_loadu_si512(p + (size_t)t * L16_TOK + 64 + 64 * j),
								    r[j]);
			}
		}
		KT_UNROLL
		for (int t = 0; t < nt; t++) {
			const __m512 sc = _mm512_mul_ps(dw, _mm512_loadu_ps(p + (size_t)t * L16_TOK));
			acc[t] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(_mm512_add_epi32(p0[t], p1[t])), acc[t]);
		}
	}
	if (nb8 > nb16) {
		const uint8_t *wb = w + (size_t)bs * nb16;
		__m256i r[8];
		for (int i = 0; i < 8; i++)
			r[i] = s8_weights(wb + bs * i, type);
		tr8_i32(r);
		__m256i wn = _mm256_setzero_si256();
		for (int j = 0; j < 8; j++)
			wn = _mm256_dpbusd_epi32(wn, _mm512_castsi512_si256(x80), r[j]);
		wn = _mm256_sub_epi32(_mm256_setzero_si256(), wn);
		const __m256 dw = scales8(wb, bs);
		KT_UNROLL
		for (int t = 0; t < nt; t++) {
			const uint8_t *pt = p + (size_t)t * L8_TOK + 32;
			__m256i s0 = wn, s1 = _mm256_setzero_si256();
			for (int j = 0; j < 4; j++) {
				s0 = _mm256_dpbusd_epi32(s0, ld256(pt + 32 * j), r[j]);
				s1 = _mm256_dpbusd_epi32(s1, ld256(pt + 32 * (j + 4)), r[j + 4]);
			}
			const __m256 sc = _mm256_mul_ps(dw, _mm256_loadu_ps((const float *)(p + (size_t)t * L8_TOK)));
			acc[t] = _mm512_mask3_fmadd_ps(_mm512_castps256_ps512(sc),
						       _mm512_castps256_ps512(_mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1))),
						       acc[t], 0x00ff);
		}
		p += L8_RUN;
	}
	/* The packed blocks left: 288 bytes each, the 8 tokens' scales, then their bytes. */
	__m256 at[MD_KERN_LANES];
	s8_tail(w + (size_t)bs * nb8, (int)(nb - nb8), type, nt, p + 32, 32, L8_TOK, p, sizeof(float),
		L8_TOK, at);
	for (int t = 0; t < nt; t++) {
		const __m256 lo = _mm512_castps512_ps256(acc[t]);
		const __m256 hi = hi256_ps(acc[t]);
		y[(size_t)t * ys] = hsum8(_mm256_add_ps(_mm256_add_ps(lo, hi), at[t]));
	}
}

#define LANES_S8(name, type)                                                                       \
	static void name(int64_t n, const void *wv, size_t wst, int nr, const void *p, int nt,      \
			 float *y, size_t ys)                                                       \
	{                                                                                          \
		for (int r = 0; r < nr; r++) {                                                     \
			const uint8_t *w = (const uint8_t *)wv + (size_t)r * wst;                  \
			switch (nt) {                                                              \
			case 1: lanes_s8_k(n, w, p, y + r, ys, 1, type); break;                    \
			case 2: lanes_s8_k(n, w, p, y + r, ys, 2, type); break;                    \
			case 3: lanes_s8_k(n, w, p, y + r, ys, 3, type); break;                    \
			case 4: lanes_s8_k(n, w, p, y + r, ys, 4, type); break;                    \
			case 5: lanes_s8_k(n, w, p, y + r, ys, 5, type); break;                    \
			case 6: lanes_s8_k(n, w, p, y + r, ys, 6, type); break;                    \
			case 7: lanes_s8_k(n, w, p, y + r, ys, 7, type); break;                    \
			default: lanes_s8_k(n, w, p, y + r, ys, 8, type); break;                   \
			}                                                                          \
		}                                                                                  \
	}
LANES_S8(lanes_q8_0_512, MD_DT_Q8_0)
LANES_S8(lanes_q4_0_512, MD_DT_Q4_0)
LANES_S8(lanes_q5_0_512, MD_DT_Q5_0)
#endif

/* 32 signed bytes from 16 nibble indexes into a 16-entry level table (lut in both lanes):
 * low nibbles are elements 0-15, high nibbles 16-31. */
INLINE __m256i levels32(const uint8_t *qs, __m256i lut)
{
	const __m128i x = _mm_loadu_si128((const __m128i *)qs);
	const __m256i idx = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x),
					     _mm256_set1_epi8(15));
	return _mm256_shuffle_epi8(lut, idx);
}

/* md_e8m0_half inlined: 2^(e - 128). */
INLINE float e8m0_half(uint8_t e)
{
	const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
	float f;
	memcpy(&f, &bits, 4);
	return f;
}

/* iq4_nl (mxfp4 == 0) and mxfp4 against md_q8b: levels looked up with a byte shuffle, then
 * signed x signed as q8_0 does it (|w| x sign(a, w)). The block scale is an f16 (iq4_nl)
 * or an E8M0 exponent byte (mxfp4). */
#ifdef KERN_AVX512
/* iq4_nl / mxfp4 blocks b and b+1 at w0, w0 + bs in one 512-bit step, as blk_nl would do each
 * (block b in the low half): the 16 index bytes of each go to two 128-bit lanes, the second
 * shifted down a nibble, and the level table (in every lane) gives 64 signed bytes. */
INLINE void blk2_nl(const uint8_t *w, const uint8_t *a, size_t as, int64_t b, const int nt,
		    __m512 *acc, const __m512i lut, const int mxfp4)
{
	const int bs = mxfp4 ? 17 : 18, qo = mxfp4 ? 1 : 2;
	const uint8_t *w0 = w + (size_t)bs * b, *w1 = w0 + bs;
	const __m128i x0 = _mm_loadu_si128((const __m128i *)(w0 + qo));
	const __m128i x1 = _mm_loadu_si128((const __m128i *)(w1 + qo));
	const __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(x0, x0)),
					     _mm256_set_m128i(x1, x1), 1);
	const __m512i sh = _mm512_setr_epi64(0, 0, 0x0004000400040004ll, 0x0004000400040004ll, 0, 0,
					     0x0004000400040004ll, 0x0004000400040004ll);
	const __m512i idx = _mm512_and_si512(_mm512_srlv_epi16(x, sh), _mm512_set1_epi8(15));
	const __m512i q = _mm512_shuffle_epi8(lut, idx);
	const __m512i u = _mm512_abs_epi8(q);
	const __mmask64 neg = _mm512_movepi8_mask(q);
	const float d0 = mxfp4 ? e8m0_half(w0[0]) : ld_f16(w0);
	const float d1 = mxfp4 ? e8m0_half(w1[0]) : ld_f16(w1);
	for (int t = 0; t < nt; t++) {
		const struct md_q8b *ab = (const struct md_q8b *)(a + (size_t)t * as) + b;
		const __m512i xa = _mm512_inserti64x4(_mm512_castsi256_si512(ld256(ab[0].qs)),
						      ld256(ab[1].qs), 1);
		const __m512i sa = _mm512_mask_sub_epi8(xa, neg, _mm512_setzero_si512(), xa);
		const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, sa);
		acc[t] = _mm512_fmadd_ps(set2_ps(d0 * ab[0].d, d1 * ab[1].d), _mm512_cvtepi32_ps(p), acc[t]);
	}
}

#endif

INLINE void blk_nl(const uint8_t *w, const uint8_t *a, size_t as, int64_t b, const int nt,
		   __m256 *acc, const __m256i lut, const int mxfp4)
{
	const int bs = mxfp4 ? 17 : 18, qo = mxfp4 ? 1 : 2;
	const uint8_t *wb = w + (size_t)bs * b;
	const __m256i q = levels32(wb + qo, lut);
	const __m256i u = _mm256_sign_epi8(q, q);
	const float dw = mxfp4 ? e8m0_half(wb[0]) : ld_f16(wb);
	for (int t = 0; t < nt; t++) {
		const struct md_q8b *ab = (const struct md_q8b *)(a + (size_t)t * as) + b;
		const __m256i p = dot_us8(u, _mm256_sign_epi8(ld256(ab->qs), q));
		acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ab->d), _mm256_cvtepi32_ps(p), acc[t]);
	}
}

#ifdef KERN_AVX512
/* iq4_nl (mxfp4 == 0) and mxfp4 on AVX-512: blocks in pairs, one per 256-bit half (blk2_nl);
 * an odd last block goes to the low half. */
INLINE void tile_nl(int64_t n, const uint8_t *w, const uint8_t *a, size_t as, float *y,
		    size_t ys, const int nt, const int mxfp4)
{
	__m512 acc[MD_KERN_NT];
	for (int t = 0; t < nt; t++)
		acc[t] = _mm512_setzero_ps();
	const __m128i l = _mm_loadu_si128((const __m128i *)(mxfp4 ? md_mxfp4_levels : md_iq4nl_levels));
	const int64_t nb = n / 32;
	int64_t b = 0;
	for (; b + 2 <= nb; b += 2)
		blk2_nl(w, a, as, b, nt, acc, _mm512_broadcast_i32x4(l), mxfp4);
	__m256 lo[MD_KERN_NT], hi[MD_KERN_NT];
	for (int t = 0; t < nt; t++) {
		lo[t] = _mm512_castps512_ps256(acc[t]);
		hi[t] = hi256_ps(acc[t]);
	}
	if (b < nb)
		blk_nl(w, a, as, b, nt, lo, _mm256_broadcastsi128_si256(l), mxfp4);
	for (int t = 0; t < nt; t++)
		y[(size_t)t * ys] = hsum8(_mm256_add_ps(lo[t], hi[t]));
}

#endif

#ifndef KERN_AVX512
/* ---- 32-element block types on AVX2: two blocks per step ----
 *
 * The tiles above spend most of their time outside the multiplies: a float scale, a
 * conversion and an fma for every 32 weights, and (with the block parity indexing an array)
 * accumulators that live on the stack. Here blocks b and b+1 sit side by side, one per
 * 128-bit lane: the 16 quant bytes of each give the low nibbles (elements 0-15) in one
 * vector and the high nibbles (16-31) in another, the activation halves are paired the same
 * way, and so the two maddubs results of a block pair add up per lane before one madd, one
 * conversion and one fma serve both blocks (the 16-bit sums cannot overflow: |w| <= 31
 * unsigned or 12 for mxfp4; iq4_nl's levels reach 127, so its two halves are widened
 * apart). Every token keeps one accumulator, up to MD_KERN_NT tokens in one pass over the
 * weights, and its sum is formed in the same order whatever nt is, 1 included (kern.h), so a
 * token's result does not depend on the group matmul puts it in. Decode (one token) unrolls
 * to two pairs a step on that one accumulator: for mxfp4, 1.02x a version with two
 * accumulators (which would give a lone token of a batch other bits) and the plain loop
 * 0.94-0.98x it, in alternating runs on a shared machine. An odd last block pairs with itself
 * under a zero scale. The AVX-512 build keeps the tiles above (measured on that machine). */

/* 16 bytes at p in lane 0, 16 bytes at q in lane 1. */
INLINE __m256i ld_pair(const uint8_t *p, const uint8_t *q)
{
	return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
				       _mm_loadu_si128((const __m128i *)q), 1);
}

/* x0 in float lanes 0-3, x1 in lanes 4-7. */
INLINE __m256 pair_ps(float x0, float x1)
{
	return _mm256_set_m128(_mm_set1_ps(x1), _mm_set1_ps(x0));
}

/* Byte i of each lane is 16 where bit i (lo) or bit 16 + i (hi) of that lane's qh word is
 * set: the fifth bits of q5_0 / q5_1, with hv holding block b's word in lane 0 and block
 * b+1's in lane 1 (bytes 0-3). */
INLINE __m256i bit5_pair(__m256i hv, const int hi)
{
	const __m256i shuf = hi ? _mm256_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
						   2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3)
				: _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
						   0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
	const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
	const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(hv, shuf), bit);
	return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(16));
}

/* Layout of each type: block bytes, offset of the quant bytes. */
#define B32_BS(type)                                                                         \
	((type) == MD_DT_Q4_0 || (type) == MD_DT_IQ4_NL ? 18 : (type) == MD_DT_Q4_1 ? 20         \
	 : (type) == MD_DT_Q5_0 ? 22 : (type) == MD_DT_Q5_1 ? 24 : 17)
#define B32_QO(type)                                                                         \
	((type) == MD_DT_Q4_0 || (type) == MD_DT_IQ4_NL ? 2 : (type) == MD_DT_Q4_1 ? 4           \
	 : (type) == MD_DT_Q5_0 ? 6 : (type) == MD_DT_Q5_1 ? 8 : 1)
#define B32_SIGNED(type) ((type) == MD_DT_IQ4_NL || (type) == MD_DT_MXFP4)
#define B32_MIN(type) ((type) == MD_DT_Q4_1 || (type) == MD_DT_Q5_1)
/* q4_0 and q5_0 store q + 8 / q + 16: sum(q * a) comes out as sum(u * a) - off * sum(a). */
#define B32_OFF(type) ((type) == MD_DT_Q4_0 ? 3 : (type) == MD_DT_Q5_0 ? 4 : 0) /* log2 */

/* One block pair of weights, decoded once for every token. */
struct b32w {
	__m256i lo, hi;   /* elements 0-15 / 16-31 of each block: u (unsigned types) or the level */
	__m256i ulo, uhi; /* |level| (signed types) */
	__m256 dw;        /* block scales, 4 lanes each */
	__m256 mw;        /* mins (q4_1, q5_1) */
};

/* Blocks at w0 (lane 0) and w1 (lane 1); zero1: lane 1 gets scale 0 (odd tail, w1 == w0). */
INLINE struct b32w b32_decode(const uint8_t *w0, const uint8_t *w1, const int zero1,
			      const __m256i lut, const int type)
{
	const int qo = B32_QO(type);
	const __m256i m4 = _mm256_set1_epi8(15);
	struct b32w r;
	const __m256i x = ld_pair(w0 + qo, w1 + qo);
	r.lo = _mm256_and_si256(x, m4);
	r.hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
	if (type == MD_DT_Q5_0 || type == MD_DT_Q5_1) {
		uint32_t h0, h1;
		memcpy(&h0, w0 + qo - 4, 4);
		memcpy(&h1, w1 + qo - 4, 4);
		const __m256i hv = _mm256_set_m128i(_mm_cvtsi32_si128((int)h1), _mm_cvtsi32_si128((int)h0));
		r.lo = _mm256_or_si256(r.lo, bit5_pair(hv, 0));
		r.hi = _mm256_or_si256(r.hi, bit5_pair(hv, 1));
	}
	if (B32_SIGNED(type)) {
		r.lo = _mm256_shuffle_epi8(lut, r.lo);
		r.hi = _mm256_shuffle_epi8(lut, r.hi);
		r.ulo = _mm256_sign_epi8(r.lo, r.lo);
		r.uhi = _mm256_sign_epi8(r.hi, r.hi);
	} else {
		r.ulo = r.uhi = _mm256_setzero_si256();
	}
	const float d0 = type == MD_DT_MXFP4 ? e8m0_half(w0[0]) : ld_f16(w0);
	const float d1 = zero1 ? 0.0f : type == MD_DT_MXFP4 ? e8m0_half(w1[0]) : ld_f16(w1);
	r.dw = pair_ps(d0, d1);
	r.mw = B32_MIN(type) ? pair_ps(ld_f16(w0 + 2), zero1 ? 0.0f : ld_f16(w1 + 2))
			     : _mm256_setzero_ps();
	return r;
}

/* acc + this pair's contribution for one token: a0, a1 the activation blocks paired with
 * the weight blocks (a1 == a0 for the odd tail). */
INLINE __m256 b32_token(const struct b32w *q, const struct md_q8b *a0, const struct md_q8b *a1,
			__m256 acc, const int type)
{
	const __m256i ones = _mm256_set1_epi16(1);
	const __m256i alo = ld_pair((const uint8_t *)a0->qs, (const uint8_t *)a1->qs);
	const __m256i ahi = ld_pair((const uint8_t *)a0->qs + 16, (const uint8_t *)a1->qs + 16);
	__m256i p;
	if (type == MD_DT_IQ4_NL) {
		const __m256i plo = _mm256_maddubs_epi16(q->ulo, _mm256_sign_epi8(alo, q->lo));
		const __m256i phi = _mm256_maddubs_epi16(q->uhi, _mm256_sign_epi8(ahi, q->hi));
		p = _mm256_add_epi32(_mm256_madd_epi16(plo, ones), _mm256_madd_epi16(phi, ones));
	} else if (type == MD_DT_MXFP4) {
		const __m256i plo = _mm256_maddubs_epi16(q->ulo, _mm256_sign_epi8(alo, q->lo));
		const __m256i phi = _mm256_maddubs_epi16(q->uhi, _mm256_sign_epi8(ahi, q->hi));
		p = _mm256_madd_epi16(_mm256_add_epi16(plo, phi), ones);
	} else {
		const __m256i plo = _mm256_maddubs_epi16(q->lo, alo);
		const __m256i phi = _mm256_maddubs_epi16(q->hi, ahi);
		p = _mm256_madd_epi16(_mm256_add_epi16(plo, phi), ones);
	}
	const __m256 da = _mm256_set_m128(_mm_broadcast_ss(&a1->d), _mm_broadcast_ss(&a0->d));
	if (B32_OFF(type) || B32_MIN(type)) {
		/* The activation sums in int32 lanes 0 and 4. */
		const __m256i sv = _mm256_set_m128i(_mm_cvtsi32_si128(a1->s), _mm_cvtsi32_si128(a0->s));
		if (B32_OFF(type))
			p = _mm256_sub_epi32(p, _mm256_slli_epi32(sv, B32_OFF(type)));
		if (B32_MIN(type))
			return _mm256_fmadd_ps(da, _mm256_fmadd_ps(q->dw, _mm256_cvtepi32_ps(p),
					       _mm256_mul_ps(q->mw, _mm256_cvtepi32_ps(sv))), acc);
	}
	return _mm256_fmadd_ps(_mm256_mul_ps(q->dw, da), _mm256_cvtepi32_ps(p), acc);
}

INLINE void tile_b32(int64_t n, const uint8_t *w, const uint8_t *a, size_t as, float *y,
		     size_t ys, const int nt, const int type)
{
	const int bs = B32_BS(type);
	const int64_t nb = n / 32;
	const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(
		type == MD_DT_MXFP4 ? md_mxfp4_levels : md_iq4nl_levels)));
	if (nt == 1) {
		const struct md_q8b *a0 = (const struct md_q8b *)a;
		__m256 c = _mm256_setzero_ps();
		int64_t b = 0;
		for (; b + 4 <= nb; b += 4, w += 4 * bs) {
			const struct b32w q0 = b32_decode(w, w + bs, 0, lut, type);
			const struct b32w q1 = b32_decode(w + 2 * bs, w + 3 * bs, 0, lut, type);
			c = b32_token(&q0, a0 + b, a0 + b + 1, c, type);
			c = b32_token(&q1, a0 + b + 2, a0 + b + 3, c, type);
		}
		for (; b < nb; b += 2, w += 2 * bs) {
			const int odd = b + 1 == nb;
			const struct b32w q = b32_decode(w, odd ? w : w + bs, odd, lut, type);
			c = b32_token(&q, a0 + b, a0 + b + !odd, c, type);
		}
		y[0] = hsum8(c);
		return;
	}
	__m256 acc[MD_KERN_NT];
	for (int t = 0; t < nt; t++)
		acc[t] = _mm256_setzero_ps();
	for (int64_t b = 0; b < nb; b += 2, w += 2 * bs) {
		const int odd = b + 1 == nb;
		const struct b32w q = b32_decode(w, odd ? w : w + bs, odd, lut, type);
		for (int t = 0; t < nt; t++) {
			const struct md_q8b *at = (const struct md_q8b *)(a + (size_t)t * as) + b;
			acc[t] = b32_token(&q, at, at + !odd, acc[t], type);
		}
	}
	for (int t = 0; t < nt; t++)
		y[(size_t)t * ys] = hsum8(acc[t]);
}
#endif

/* ---- K-quants against md_q8k ---- */

/* The scales of 32-element group g of a K-quant block (two 16-element sub-blocks, bytes 2g
 * and 2g + 1 of a broadcast 16-byte vector) come to int16 lanes 0-7 and 8-15 (the halves of one
 * maddubs result) by one vpshufb with this control: unsigned zeroes the high byte of each lane,
 * signed puts the byte in both halves for an arithmetic shift by 8. Building the pair from
 * scalars (two loads, two broadcasts, an insert) took as many instructions at one token as the
 * dot itself. A table holds the controls: where the group loop does not unroll (8 tokens on
 * AVX-512) a control built from immediates took a dozen inserts per group. */
#define SPREAD8(x, y) x, y, x, y, x, y, x, y, x, y, x, y, x, y, x, y
#define SPREAD_U(g) { SPREAD8(2 * (g), 0x80), SPREAD8(2 * (g) + 1, 0x80) }
#define SPREAD_S(g) { SPREAD8(2 * (g), 2 * (g)), SPREAD8(2 * (g) + 1, 2 * (g) + 1) }
static const uint8_t spread_tab[2][8][32] __attribute__((aligned(32))) = {
	{ SPREAD_U(0), SPREAD_U(1), SPREAD_U(2), SPREAD_U(3), SPREAD_U(4), SPREAD_U(5), SPREAD_U(6), SPREAD_U(7) },
	{ SPREAD_S(0), SPREAD_S(1), SPREAD_S(2), SPREAD_S(3), SPREAD_S(4), SPREAD_S(5), SPREAD_S(6), SPREAD_S(7) },
};

INLINE __m256i spread_ctl(int g, int sign)
{
	return _mm256_load_si256((const __m256i *)spread_tab[sign][g]);
}

/* The same for one scale in all 16 lanes (byte s, zero-extended: a 32-element sub-block of
 * q4_K / q5_K), and for the mins of k_scales_v's bytes 8-15 in lanes 2s, 2s + 1 (both
 * 128-bit halves hold the 16 bytes). */
#define SPREAD_ONE(s) { SPREAD8(s, 0x80), SPREAD8(s, 0x80) }
static const uint8_t spread_one[8][32] __attribute__((aligned(32))) = {
	SPREAD_ONE(0), SPREAD_ONE(1), SPREAD_ONE(2), SPREAD_ONE(3), SPREAD_ONE(4), SPREAD_ONE(5),
	SPREAD_ONE(6), SPREAD_ONE(7),
};
static const uint8_t spread_mins[32] __attribute__((aligned(32))) = {
	8, 0x80, 8, 0x80, 9, 0x80, 9, 0x80, 10, 0x80, 10, 0x80, 11, 0x80, 11, 0x80,
	12, 0x80, 12, 0x80, 13, 0x80, 13, 0x80, 14, 0x80, 14, 0x80, 15, 0x80, 15, 0x80,
};

/* The 6-bit scales and mins of a q4_K / q5_K block as bytes [sc0..sc7 | m0..m7], from the
 * 12 packed bytes in 32-bit words: scales and mins 0-3 are the low 6 bits of words 0 and 1,
 * 4-7 the nibbles of word 2 with the top 2 bits of words 0 and 1 above them (the scalar
 * md_kern__k_scales byte by byte). */
INLINE __m128i k_scales_v(const uint8_t *s)
{
	uint32_t u0, u1, u2;
	memcpy(&u0, s, 4);
	memcpy(&u1, s + 4, 4);
	memcpy(&u2, s + 8, 4);
	const uint32_t sc_hi = (u2 & 0x0f0f0f0fu) | ((u0 >> 2) & 0x30303030u);
	const uint32_t m_hi = ((u2 >> 4) & 0x0f0f0f0fu) | ((u1 >> 2) & 0x30303030u);
	return _mm_setr_epi32((int)(u0 & 0x3f3f3f3fu), (int)sc_hi, (int)(u1 & 0x3f3f3f3fu), (int)m_hi);
}

INLINE void k_scales(const uint8_t *s, uint8_t sc[8], uint8_t m[8])
{
	uint8_t b[16];
	_mm_storeu_si128((__m128i *)b, k_scales_v(s));
	memcpy(sc, b, 8);
	memcpy(m, b + 8, 8);
}

/* int16 vector: lanes 2s, 2s+1 hold m[s] (pairs with the 16 bsums). */
INLINE __m256i mins_pairs(const uint8_t m[8])
{
	uint64_t mm;
	memcpy(&mm, m, 8);
	const __m128i dup = _mm_shuffle_epi8(_mm_cvtsi64_si128((long long)mm),
					     _mm_set_epi8(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0));
	return _mm256_cvtepu8_epi16(dup);
}

#ifdef KERN_AVX512
/* Block b of a q4_K / q5_K row, decoded into two sub-blocks per 512-bit register (qz, with
 * their scales sz and the mins mp), against every token: the per-token half of tile_qk45 and
 * tile_q4_K512. */
INLINE void qk_tokens512(const __m512i qz[4], const __m512i sz[4], __m256i mp, float dw,
			 float dmin, const uint8_t *a, size_t as, int64_t b, const int nt,
			 __m256 *acc)
{
	for (int t = 0; t < nt; t++) {
		const struct md_q8k *ab = (const struct md_q8k *)(a + (size_t)t * as) + b;
		__m512i iz = _mm512_setzero_si512();
		for (int p = 0; p < 4; p++)
			iz = _mm512_add_epi32(iz, _mm512_madd_epi16(_mm512_maddubs_epi16(qz[p],
				_mm512_loadu_si512(ab->qs + 64 * p)), sz[p]));
		const __m256i is = _mm256_add_epi32(_mm512_castsi512_si256(iz),
						    _mm512_extracti64x4_epi64(iz, 1));
		const __m256i mv = _mm256_madd_epi16(ld256(ab->bsums), mp);
		acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ab->d), _mm256_cvtepi32_ps(is), acc[t]);
		acc[t] = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * ab->d), _mm256_cvtepi32_ps(mv), acc[t]);
	}
}
#endif

/* q4_K (five == 0) and q5_K (five == 1). */
INLINE void tile_qk45(int64_t n, const uint8_t *w, const uint8_t *a, size_t as, float *y, size_t ys,
		      const int nt, const int five)
{
	__m256 acc[MD_KERN_NT];
	for (int t = 0; t < nt; t++)
		acc[t] = _mm256_setzero_ps();
	const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
	const size_t bs = five ? 176 : 144;
	const int64_t nb = n / 256;
	for (int64_t b = 0; b < nb; b++, w += bs) {
		if (nt == 1)
			QPF(w, (int)bs);
		const __m256i scb = _mm256_broadcastsi128_si256(k_scales_v(w + 4));
		const float dw = ld_f16(w), dmin = ld_f16(w + 2);
		const uint8_t *qs = w + (five ? 48 : 16);
		__m256i q[8];
		__m256i hb = five ? ld256(w + 16) : _mm256_setzero_si256();
		for (int p = 0; p < 4; p++) {
			const __m256i x = ld256(qs + 32 * p);
			q[2 * p] = _mm256_and_si256(x, m4);
			q[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
			if (five) {
				q[2 * p] = _mm256_or_si256(q[2 * p],
					_mm256_slli_epi16(_mm256_and_si256(hb, one), 4));
				hb = _mm256_srli_epi16(hb, 1);
				q[2 * p + 1] = _mm256_or_si256(q[2 * p + 1],
					_mm256_slli_epi16(_mm256_and_si256(hb, one), 4));
				hb = _mm256_srli_epi16(hb, 1);
			}
		}
		const __m256i mp = _mm256_shuffle_epi8(scb, ld256(spread_mins));
#ifdef KERN_AVX512
		/* Two sub-blocks per 512-bit op: weights [s | s+1], scales [sc[s] x16 | sc[s+1] x16]. */
		__m512i qz[4], sz[4];
		for (int p = 0; p < 4; p++) {
			qz[p] = _mm512_inserti64x4(_mm512_castsi256_si512(q[2 * p]), q[2 * p + 1], 1);
			sz[p] = _mm512_inserti64x4(_mm512_castsi256_si512(
				_mm256_shuffle_epi8(scb, ld256(spread_one[2 * p]))),
				_mm256_shuffle_epi8(scb, ld256(spread_one[2 * p + 1])), 1);
		}
		qk_tokens512(qz, sz, mp, dw, dmin, a, as, b, nt, acc);
#else
		for (int t = 0; t < nt; t++) {
			const struct md_q8k *ab = (const struct md_q8k *)(a + (size_t)t * as) + b;
			__m256i is0 = _mm256_setzero_si256(), is1 = _mm256_setzero_si256();
			for (int s = 0; s < 8; s += 2) {
				is0 = _mm256_add_epi32(is0, dot_us8_scaled(q[s], ld256(ab->qs + 32 * s),
					_mm256_shuffle_epi8(scb, ld256(spread_one[s]))));
				is1 = _mm256_add_epi32(is1, dot_us8_scaled(q[s + 1], ld256(ab->qs + 32 * s + 32),
					_mm256_shuffle_epi8(scb, ld256(spread_one[s + 1]))));
			}
			const __m256i mv = _mm256_madd_epi16(ld256(ab->bsums), mp);
			acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ab->d),
						 _mm256_cvtepi32_ps(_mm256_add_epi32(is0, is1)), acc[t]);
			acc[t] = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * ab->d), _mm256_cvtepi32_ps(mv), acc[t]);
		}
#endif
	}
	for (int t = 0; t < nt; t++)
		y[(size_t)t * ys] = hsum8(acc[t]);
}

#ifndef KERN_AVX512
/* q4_K (five == 0) and q5_K against 2..8 tokens on AVX2 (prefill): tile_qk45's sums, lane for lane, with the loops
 * the other way round. tile_qk45 decodes all eight sub-blocks and then walks the tokens, which
 * keeps 8 weight and 8 scale vectors live and spills on AVX2's 16 registers; here each pair of
 * sub-blocks is decoded and dotted with every token before the next, so an integer sum per
 * token stays in a register. The integer sums are exact and the float steps per block are
 * tile_qk45's, so the result has the same bits as a single-token call. */
INLINE void tile_qk45_tok(int64_t n, const uint8_t *w, const uint8_t *a, size_t as, float *y,
			  size_t ys, const int nt, const int five)
{
	__m256 acc[MD_KERN_NT];
	for (int t = 0; t < nt; t++)
		acc[t] = _mm256_setzero_ps();
	const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
	const size_t bs = five ? 176 : 144;
	const int64_t nb = n / 256;
	for (int64_t b = 0; b < nb; b++, w += bs) {
		QPF(w, (int)bs);
		const __m256i scb = _mm256_broadcastsi128_si256(k_scales_v(w + 4));
		const float dw = ld_f16(w), dmin = ld_f16(w + 2);
		const uint8_t *qs = w + (five ? 48 : 16);
		__m256i hb = five ? ld256(w + 16) : _mm256_setzero_si256();
		const struct md_q8k *ab[MD_KERN_NT];
		__m256i is[MD_KERN_NT];
		for (int t = 0; t < nt; t++) {
			ab[t] = (const struct md_q8k *)(a + (size_t)t * as) + b;
			is[t] = _mm256_setzero_si256();
		}
		for (int p = 0; p < 4; p++) {
			const __m256i x = ld256(qs + 32 * p);
			__m256i lo = _mm256_and_si256(x, m4);
			__m256i hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
			if (five) {
				lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(hb, one), 4));
				hb = _mm256_srli_epi16(hb, 1);
				hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(hb, one), 4));
				hb = _mm256_srli_epi16(hb, 1);
			}
			const __m256i sl = _mm256_shuffle_epi8(scb, ld256(spread_one[2 * p]));
			const __m256i sh = _mm256_shuffle_epi8(scb, ld256(spread_one[2 * p + 1]));
			for (int t = 0; t < nt; t++)
				is[t] = _mm256_add_epi32(is[t], _mm256_add_epi32(
					dot_us8_scaled(lo, ld256(ab[t]->qs + 64 * p), sl),
					dot_us8_scaled(hi, ld256(ab[t]->qs + 64 * p + 32), sh)));
		}
		const __m256i mp = _mm256_shuffle_epi8(scb, ld256(spread_mins));
		for (int t = 0; t < nt; t++) {
			const __m256i mv = _mm256_madd_epi16(ld256(ab[t]->bsums), mp);
			acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ab[t]->d), _mm256_cvtepi32_ps(is[t]),
						 acc[t]);
			acc[t] = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * ab[t]->d), _mm256_cvtepi32_ps(mv),
						  acc[t]);
		}
	}
	for (int t = 0; t < nt; t++)
		y[(size_t)t * ys] = hsum8(acc[t]);
}
#endif

#ifdef KERN_AVX512
/* q4_K on AVX-512, the integer sums of tile_qk45 built with fewer instructions per block
 * (nothing else changes, lane for lane): the 6-bit scales and mins unpacked four at a time in
 * 32-bit words, the per-pair scale vectors taken from them by one word permute each, and each
 * 32-byte quant chunk broadcast to both halves and shifted by 0 | 4 bits for its two
 * sub-blocks. With one token per call the weight decoding is most of the work: k_scales' byte
 * loop and 16 scalar broadcasts per block held q4_K to ~16 GB/s on one Zen 5 core, where q8_0
 * reaches the memory's ~28. */
INLINE void tile_q4_K512(int64_t n, const uint8_t *w, const uint8_t *a, size_t as, float *y,
			 size_t ys, const int nt)
{
	__m256 acc[MD_KERN_NT];
	for (int t = 0; t < nt; t++)
		acc[t] = _mm256_setzero_ps();
	const __m512i m4 = _mm512_set1_epi8(15);
	const __m512i sh = _mm512_setr_epi64(0, 0, 0, 0, 0x0004000400040004ll, 0x0004000400040004ll,
					     0x0004000400040004ll, 0x0004000400040004ll);
	__m512i sidx[4];
	for (int p = 0; p < 4; p++)
		sidx[p] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)(2 * p))),
					     _mm256_set1_epi16((short)(2 * p + 1)), 1);
	const int64_t nb = n / 256;
	for (int64_t b = 0; b < nb; b++, w += 144) {
		uint32_t u0, u1, u2;
		memcpy(&u0, w + 4, 4);
		memcpy(&u1, w + 8, 4);
		memcpy(&u2, w + 12, 4);
		const uint64_t sc = (uint64_t)(u0 & 0x3f3f3f3fu) |
			(uint64_t)((u2 & 0x0f0f0f0fu) | (((u0 >> 6) & 0x03030303u) << 4)) << 32;
		const uint64_t mn = (uint64_t)(u1 & 0x3f3f3f3fu) |
			(uint64_t)(((u2 >> 4) & 0x0f0f0f0fu) | (((u1 >> 6) & 0x03030303u) << 4)) << 32;
		const __m512i sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
		const __m256i mp = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_cvtsi64_si128((long long)mn),
			_mm_set_epi8(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0)));
		const float dw = ld_f16(w), dmin = ld_f16(w + 2);
		__m512i qz[4], sz[4];
		for (int p = 0; p < 4; p++) {
			const __m512i x = _mm512_broadcast_i64x4(ld256(w + 16 + 32 * p));
			qz[p] = _mm512_and_si512(_mm512_srlv_epi16(x, sh), m4);
			sz[p] = _mm512_permutexvar_epi16(sidx[p], sc16);
		}
		qk_tokens512(qz, sz, mp, dw, dmin, a, as, b, nt, acc);
	}
	for (int t = 0; t < nt; t++)
		y[(size_t)t * ys] = hsum8(acc[t]);
}
#endif

/* q2_K: the 2-bit planes of each 32-byte half give 32 consecutive elements (two sub-blocks)
 * per shift; the 4-bit scales fold into madd, the mins pair with the activation's bsums. */
INLINE void tile_q2_K(int64_t n, const uint8_t *w, const uint8_t *a, size_t as, float *y,
		      size_t ys, const int nt)
{
	__m256 acc[MD_KERN_NT];
	for (int t = 0; t < nt; t++)
		acc[t] = _mm256_setzero_ps();
	const __m256i m3 = _mm256_set1_epi8(3);
	const int64_t nb = n / 256;
	for (int64_t b = 0; b < nb; b++, w += 84) {
		const __m128i scv = _mm_loadu_si128((const __m128i *)w);
		const __m256i ls = _mm256_broadcastsi128_si256(_mm_and_si128(scv, _mm_set1_epi8(15)));
		const float dw = ld_f16(w + 80), dmin = ld_f16(w + 82);
		/* Each 32-element group is decoded and dotted with every token before the next:
		 * 8 groups and their scales waiting for the token loop spilled on AVX2. */
		const struct md_q8k *ab[MD_KERN_NT];
		__m256i is[MD_KERN_NT];
		for (int t = 0; t < nt; t++) {
			ab[t] = (const struct md_q8k *)(a + (size_t)t * as) + b;
			is[t] = _mm256_setzero_si256();
		}
		for (int h = 0; h < 2; h++) {
			const __m256i x = ld256(w + 16 + 32 * h);
			for (int j = 0; j < 4; j++) {
				const __m256i q = _mm256_and_si256(_mm256_srli_epi16(x, 2 * j), m3);
				const __m256i s16 = _mm256_shuffle_epi8(ls, spread_ctl(4 * h + j, 0));
				for (int t = 0; t < nt; t++)
					is[t] = _mm256_add_epi32(is[t], dot_us8_scaled(q,
						ld256(ab[t]->qs + 128 * h + 32 * j), s16));
			}
		}
		const __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(scv, 4),
									_mm_set1_epi8(15)));
		for (int t = 0; t < nt; t++) {
			const __m256i mv = _mm256_madd_epi16(ld256(ab[t]->bsums), mins);
			acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ab[t]->d), _mm256_cvtepi32_ps(is[t]),
						 acc[t]);
			acc[t] = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * ab[t]->d), _mm256_cvtepi32_ps(mv),
						  acc[t]);
		}
	}
	for (int t = 0; t < nt; t++)
		y[(size_t)t * ys] = hsum8(acc[t]);
}

/* The 16 signed scales of a q3_K block (as kern_scalar.c's q3k_scales) in int16 lanes: low nibbles
 * from bytes 0-7 (scales 0-7) and their high nibbles (8-15); the top 2 bits of scale i at bits
 * 2 (i / 4) of byte 8 + i % 4, i.e. 32-bit lane i / 4 of the broadcast bytes 8-11 shifted
 * right by 2 (i / 4). */
INLINE __m256i q3k_scales(const uint8_t *s)
{
	uint64_t lo;
	uint32_t hi;
	memcpy(&lo, s, 8);
	memcpy(&hi, s + 8, 4);
	const __m128i l = _mm_cvtsi64_si128((long long)lo);
	const __m128i low = _mm_and_si128(_mm_unpacklo_epi64(l, _mm_srli_epi16(l, 4)),
					  _mm_set1_epi8(15));
	const __m128i top = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)hi),
							 _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
	const __m128i sc = _mm_or_si128(low, _mm_slli_epi16(top, 4));
	return _mm256_sub_epi16(_mm256_cvtepu8_epi16(sc), _mm256_set1_epi16(32));
}

/* Bit s (0-7) of every byte of v moved to bit 2, in one 16-bit shift: no other bit reaches
 * bit 2 of either byte of a lane (the caller masks). */
INLINE __m256i hbit_to2(__m256i v, int s)
{
	return s < 2 ? _mm256_slli_epi16(v, 2 - s) : _mm256_srli_epi16(v, s - 2);
}

/* q3_K: the low 2 bits as q2_K, the third from hmask (bit 4h + j of each byte for the 32
 * elements at 128h + 32j); q = u - 4 with u unsigned, so the integer sum is
 * sum_g sc_g * (sum(u * a) - 4 * bsums[g]) with signed 6-bit scales in madd. */
INLINE void tile_q3_K(int64_t n, const uint8_t *w, const uint8_t *a, size_t as, float *y,
		      size_t ys, const int nt)
{
	__m256 acc[MD_KERN_NT];
	for (int t = 0; t < nt; t++)
		acc[t] = _mm256_setzero_ps();
	const __m256i m3 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
	const int64_t nb = n / 256;
	for (int64_t b = 0; b < nb; b++, w += 110) {
		const __m256i sc_all = q3k_scales(w + 96);
		const __m256i sb = _mm256_broadcastsi128_si256(_mm_packs_epi16(_mm256_castsi256_si128(sc_all),
									      _mm256_extracti128_si256(sc_all, 1)));
		const float dw = ld_f16(w + 108);
		const __m256i hm = ld256(w);
		/* Group by group against every token, as tile_q2_K. */
		const struct md_q8k *ab[MD_KERN_NT];
		__m256i is[MD_KERN_NT];
		for (int t = 0; t < nt; t++) {
			ab[t] = (const struct md_q8k *)(a + (size_t)t * as) + b;
			is[t] = _mm256_setzero_si256();
		}
		for (int h = 0; h < 2; h++) {
			const __m256i x = ld256(w + 32 + 32 * h);
			for (int j = 0; j < 4; j++) {
				const __m256i hb = _mm256_and_si256(hbit_to2(hm, 4 * h + j), four);
				const __m256i q = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(x, 2 * j), m3), hb);
				const __m256i s16 = _mm256_srai_epi16(_mm256_shuffle_epi8(sb, spread_ctl(4 * h + j, 1)), 8);
				for (int t = 0; t < nt; t++)
					is[t] = _mm256_add_epi32(is[t], dot_us8_scaled(q,
						ld256(ab[t]->qs + 128 * h + 32 * j), s16));
			}
		}
		for (int t = 0; t < nt; t++) {
			const __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(ld256(ab[t]->bsums), sc_all), 2);
			acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ab[t]->d),
						 _mm256_cvtepi32_ps(_mm256_sub_epi32(is[t], corr)), acc[t]);
		}
	}
	for (int t = 0; t < nt; t++)
		y[(size_t)t * ys] = hsum8(acc[t]);
}

/* iq4_xs: eight iq4_nl sub-blocks; |w| x sign(a, w) pairs in maddubs, the signed 6-bit
 * sub-block scale ls - 32 in madd. */
INLINE void tile_iq4_xs(int64_t n, const uint8_t *w, const uint8_t *a, size_t as, float *y,
			size_t ys, const int nt)
{
	__m256 acc[MD_KERN_NT];
	for (int t = 0; t < nt; t++)
		acc[t] = _mm256_setzero_ps();
	const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)md_iq4nl_levels));
	const int64_t nb = n / 256;
	for (int64_t b = 0; b < nb; b++, w += 136) {
		const unsigned sh = (unsigned)(w[2] | w[3] << 8);
		const float dw = ld_f16(w);
		/* Sub-block by sub-block against every token, as tile_q2_K (24 decoded vectors
		 * waiting for the token loop spilled). */
		const struct md_q8k *ab[MD_KERN_NT];
		__m256i is[MD_KERN_NT];
		for (int t = 0; t < nt; t++) {
			ab[t] = (const struct md_q8k *)(a + (size_t)t * as) + b;
			is[t] = _mm256_setzero_si256();
		}
		for (int ib = 0; ib < 8; ib++) {
			const int ls = ((w[4 + ib / 2] >> (4 * (ib % 2))) & 15) | (int)((sh >> (2 * ib)) & 3) << 4;
			const __m256i q = levels32(w + 8 + 16 * ib, lut);
			const __m256i u = _mm256_sign_epi8(q, q);
			const __m256i s16 = _mm256_set1_epi16((short)(ls - 32));
			for (int t = 0; t < nt; t++)
				is[t] = _mm256_add_epi32(is[t], dot_us8_scaled(u,
					_mm256_sign_epi8(ld256(ab[t]->qs + 32 * ib), q), s16));
		}
		for (int t = 0; t < nt; t++)
			acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ab[t]->d), _mm256_cvtepi32_ps(is[t]),
						 acc[t]);
	}
	for (int t = 0; t < nt; t++)
		y[(size_t)t * ys] = hsum8(acc[t]);
}

INLINE void tile_q6_K(int64_t n, const uint8_t *w, const uint8_t *a, size_t as, float *y, size_t ys,
		      const int nt)
{
	__m256 acc[MD_KERN_NT];
	for (int t = 0; t < nt; t++)
		acc[t] = _mm256_setzero_ps();
	const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
	const int64_t nb = n / 256;
#ifndef KERN_AVX512
	if (nt == 1) {
		/* One token (decode): each 32-weight group decoded, scaled and dotted at once, so
		 * no decoded block waits in registers (8 weights and 8 scales do not fit in 16
		 * and spilled: 35 ns per 256 weights against 26 this way, one core, weights in
		 * L2). The high bits come to bits 4-5 with one shift and one mask each. Same
		 * arithmetic as the tile below (integer sums, then one fma per block). */
		const __m256i m30 = _mm256_set1_epi8(0x30);
		for (int64_t b = 0; b < nb; b++, w += 210) {
			QPF(w, 210);
			const uint8_t *ql = w, *qh = w + 128;
			const int8_t *scp = (const int8_t *)(w + 192);
			const struct md_q8k *ab = (const struct md_q8k *)a + b;
			const __m128i sc_lo = _mm_loadu_si128((const __m128i *)scp);
			__m256i is0 = _mm256_setzero_si256(), is1 = _mm256_setzero_si256();
			for (int h = 0; h < 2; h++) {
				const __m256i w16 = _mm256_broadcastsi128_si256(
					_mm_cvtepi8_epi16(h ? _mm_srli_si128(sc_lo, 8) : sc_lo));
				const __m256i l0 = ld256(ql + 64 * h), l1 = ld256(ql + 64 * h + 32);
				const __m256i hh = ld256(qh + 32 * h);
				const __m256i q0 = _mm256_or_si256(_mm256_and_si256(l0, m4),
					_mm256_and_si256(_mm256_slli_epi16(hh, 4), m30));
				const __m256i q1 = _mm256_or_si256(_mm256_and_si256(l1, m4),
					_mm256_and_si256(_mm256_slli_epi16(hh, 2), m30));
				const __m256i q2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
					_mm256_and_si256(hh, m30));
				const __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
					_mm256_and_si256(_mm256_srli_epi16(hh, 2), m30));
				const __m256i qq[4] = { q0, q1, q2, q3 };
				for (int j = 0; j < 4; j++) {
					const char lo = (char)(4 * j), hi = (char)(4 * j + 2);
					const __m256i sh = _mm256_setr_epi8(lo, lo + 1, lo, lo + 1, lo, lo + 1, lo,
						lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, hi, hi + 1, hi,
						hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi,
						hi + 1);
					const __m256i p = dot_us8_scaled(qq[j], ld256(ab->qs + 128 * h + 32 * j),
									 _mm256_shuffle_epi8(w16, sh));
					if (j & 1)
						is1 = _mm256_add_epi32(is1, p);
					else
						is0 = _mm256_add_epi32(is0, p);
				}
			}
			const __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(ld256(ab->bsums),
							_mm256_cvtepi8_epi16(sc_lo)), 5);
			const __m256i is = _mm256_sub_epi32(_mm256_add_epi32(is0, is1), corr);
			acc[0] = _mm256_fmadd_ps(_mm256_set1_ps(ld_f16(w + 208) * ab->d),
						 _mm256_cvtepi32_ps(is), acc[0]);
		}
		y[0] = hsum8(acc[0]);
		return;
	}
#endif
	for (int64_t b = 0; b < nb; b++, w += 210) {
		const uint8_t *ql = w, *qh = w + 128;
		const int8_t *scp = (const int8_t *)(w + 192);
		const float dw = ld_f16(w + 208);
		__m256i q[8], s16[8];
		for (int h = 0; h < 2; h++) {
			const __m256i l0 = ld256(ql + 64 * h), l1 = ld256(ql + 64 * h + 32);
			const __m256i hh = ld256(qh + 32 * h);
			q[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, m4),
				_mm256_slli_epi16(_mm256_and_si256(hh, m3), 4));
			q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
				_mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 2), m3), 4));
			q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
				_mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 4), m3), 4));
			q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
				_mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 6), m3), 4));
		}
		/* s16[k]: scale 2k in the low lane, 2k+1 in the high lane, as int16 (for the madd
		 * after maddubs). Eight scales widened once and put in both lanes, then one byte
		 * shuffle per k (16 scalar broadcasts and 8 lane inserts cost 30% of the kernel). */
		const __m128i sc_lo = _mm_loadu_si128((const __m128i *)scp);
		for (int g = 0; g < 2; g++) {
			const __m256i w16 = _mm256_broadcastsi128_si256(
				_mm_cvtepi8_epi16(g ? _mm_srli_si128(sc_lo, 8) : sc_lo));
			for (int j = 0; j < 4; j++) {
				const char lo = (char)(4 * j), hi = (char)(4 * j + 2);
				const __m256i sh = _mm256_setr_epi8(lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1,
					lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, hi, hi + 1, hi, hi + 1, hi,
					hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1);
				s16[4 * g + j] = _mm256_shuffle_epi8(w16, sh);
			}
		}
		const __m256i sc_all = _mm256_cvtepi8_epi16(sc_lo);
#ifdef KERN_AVX512
		/* One token: the 256-bit loop below issues on more ports than packing 512-bit
		 * operands would save. */
		if (nt > 1) {
		__m512i qz[4], sz[4];
		for (int p = 0; p < 4; p++) {
			qz[p] = _mm512_inserti64x4(_mm512_castsi256_si512(q[2 * p]), q[2 * p + 1], 1);
			sz[p] = _mm512_inserti64x4(_mm512_castsi256_si512(s16[2 * p]), s16[2 * p + 1], 1);
		}
		for (int t = 0; t < nt; t++) {
			const struct md_q8k *ab = (const struct md_q8k *)(a + (size_t)t * as) + b;
			__m512i iz = _mm512_setzero_si512();
			for (int p = 0; p < 4; p++)
				iz = _mm512_add_epi32(iz, _mm512_madd_epi16(_mm512_maddubs_epi16(qz[p],
					_mm512_loadu_si512(ab->qs + 64 * p)), sz[p]));
			const __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(ld256(ab->bsums), sc_all), 5);
			const __m256i is = _mm256_sub_epi32(_mm256_add_epi32(_mm512_castsi512_si256(iz),
						_mm512_extracti64x4_epi64(iz, 1)), corr);
			acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ab->d), _mm256_cvtepi32_ps(is), acc[t]);
		}
		} else
#endif
		{
		for (int t = 0; t < nt; t++) {
			const struct md_q8k *ab = (const struct md_q8k *)(a + (size_t)t * as) + b;
			__m256i is0 = _mm256_setzero_si256(), is1 = _mm256_setzero_si256();
			for (int k = 0; k < 8; k += 2) {
				is0 = _mm256_add_epi32(is0, dot_us8_scaled(q[k], ld256(ab->qs + 32 * k), s16[k]));
				is1 = _mm256_add_epi32(is1, dot_us8_scaled(q[k + 1], ld256(ab->qs + 32 * k + 32),
									   s16[k + 1]));
			}
			/* q was stored without its -32 offset: subtract 32 * sum(scale * bsum). */
			const __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(ld256(ab->bsums), sc_all), 5);
			const __m256i is = _mm256_sub_epi32(_mm256_add_epi32(is0, is1), corr);
			acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ab->d), _mm256_cvtepi32_ps(is), acc[t]);
		}
		}
	}
	for (int t = 0; t < nt; t++)
		y[(size_t)t * ys] = hsum8(acc[t]);
}

#ifndef KERN_AVX512
/* q6_K against 2..8 tokens on AVX2 (prefill), as tile_qk45_tok: each 32-weight group is
 * decoded (as the one-token path does) and dotted with every token before the next, instead
 * of 8 decoded groups and 8 scale vectors waiting in registers. Same integer sums and float
 * step per block as tile_q6_K, so the same bits. */
INLINE void tile_q6_K_tok(int64_t n, const uint8_t *w, const uint8_t *a, size_t as, float *y,
			  size_t ys, const int nt)
{
	__m256 acc[MD_KERN_NT];
	for (int t = 0; t < nt; t++)
		acc[t] = _mm256_setzero_ps();
	const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
	const int64_t nb = n / 256;
	for (int64_t b = 0; b < nb; b++, w += 210) {
		QPF(w, 210);
		const uint8_t *ql = w, *qh = w + 128;
		const struct md_q8k *ab[MD_KERN_NT];
		__m256i is[MD_KERN_NT];
		for (int t = 0; t < nt; t++) {
			ab[t] = (const struct md_q8k *)(a + (size_t)t * as) + b;
			is[t] = _mm256_setzero_si256();
		}
		const __m128i sc_lo = _mm_loadu_si128((const __m128i *)(w + 192));
		for (int h = 0; h < 2; h++) {
			const __m256i w16 = _mm256_broadcastsi128_si256(
				_mm_cvtepi8_epi16(h ? _mm_srli_si128(sc_lo, 8) : sc_lo));
			const __m256i l0 = ld256(ql + 64 * h), l1 = ld256(ql + 64 * h + 32);
			const __m256i hh = ld256(qh + 32 * h);
			for (int j = 0; j < 4; j++) {
				const __m256i l = j & 1 ? l1 : l0;
				const __m256i lo4 = j < 2 ? l : _mm256_srli_epi16(l, 4);
				const __m256i hi2 = j == 0 ? _mm256_slli_epi16(hh, 4)
						  : j == 1 ? _mm256_slli_epi16(hh, 2)
						  : j == 2 ? hh : _mm256_srli_epi16(hh, 2);
				const __m256i q = _mm256_or_si256(_mm256_and_si256(lo4, m4),
								  _mm256_and_si256(hi2, m30));
				const char lo = (char)(4 * j), hi = (char)(4 * j + 2);
				const __m256i sh = _mm256_setr_epi8(lo, lo + 1, lo, lo + 1, lo, lo + 1, lo,
					lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, hi, hi + 1, hi,
					hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi,
					hi + 1);
				const __m256i sv = _mm256_shuffle_epi8(w16, sh);
				for (int t = 0; t < nt; t++)
					is[t] = _mm256_add_epi32(is[t], dot_us8_scaled(q,
						ld256(ab[t]->qs + 128 * h + 32 * j), sv));
			}
		}
		const __m256i sc_all = _mm256_cvtepi8_epi16(sc_lo);
		const float dw = ld_f16(w + 208);
		for (int t = 0; t < nt; t++) {
			/* q was stored without its -32 offset: subtract 32 * sum(scale * bsum). */
			const __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(ld256(ab[t]->bsums),
										 sc_all), 5);
			acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ab[t]->d),
						 _mm256_cvtepi32_ps(_mm256_sub_epi32(is[t], corr)), acc[t]);
		}
	}
	for (int t = 0; t < nt; t++)
		y[(size_t)t * ys] = hsum8(acc[t]);
}
#endif

/* ---- float weights (f32, f16, bf16) against float activations ---- */

#ifdef KERN_AVX512
#define VF __m512
#define VW 16
#define vzero() _mm512_setzero_ps()
#define vset1(x) _mm512_set1_ps(x)
#define vld(p) _mm512_loadu_ps(p)
#define vst(p, v) _mm512_storeu_ps(p, v)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vhsum(v) _mm512_reduce_add_ps(v)
#define vld_f16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define vld_bf16(p) _mm512_castsi512_ps(_mm512_slli_epi32( \
	_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#else
#define VF __m256
#define VW 8
#define vzero() _mm256_setzero_ps()
#define vset1(x) _mm256_set1_ps(x)
#define vld(p) _mm256_loadu_ps(p)
#define vst(p, v) _mm256_storeu_ps(p, v)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vhsum(v) hsum8(v)
#define vld_f16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define vld_bf16(p) _mm256_castsi256_ps(_mm256_slli_epi32( \
	_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#endif

INLINE VF ld_w(const uint8_t *w, int64_t i, const int type)
{
	if (type == MD_DT_F32)
		return vld((const float *)w + i);
	if (type == MD_DT_F16)
		return vld_f16(w + 2 * i);
	return vld_bf16(w + 2 * i);
}

INLINE float ld_w1(const uint8_t *w, int64_t i, const int type)
{
	if (type == MD_DT_F32) {
		float v;
		memcpy(&v, w + 4 * i, 4);
		return v;
	}
	if (type == MD_DT_F16)
		return ld_f16(w + 2 * i);
	uint16_t h;
	memcpy(&h, w + 2 * i, 2);
	return md_bf16_to_f32(h);
}

/* Register tile of the float gemm: GR weight rows x GT tokens, one accumulator each, so a
 * step of VW elements converts GR weight chunks and loads GT activation chunks for GR * GT
 * FMAs. AVX-512 (32 registers): 24 accumulators, 4 weight chunks, 1 activation chunk (3 x 8
 * and 2-accumulator 3 x 4 tiles measured slower). AVX2 (16 registers): 12 accumulators and 3
 * weight chunks. */
#ifdef KERN_AVX512
#define GR 4
#define GT 6
#else
#define GR 3
#define GT 4
#endif

/* R x T outputs (R <= GR, T <= GT are constants after inlining) of a product of nt >= 2
 * tokens. Output (r, t) is the lane sum of one fma chain over the full vectors, then the tail
 * element by element: the same operations in the same order whatever R and T are, so the
 * grouping of rows and tokens never changes a bit (kern.h). */
INLINE void tile_float(int64_t n, const uint8_t *w, size_t wst, const uint8_t *a, size_t as,
		       float *y, size_t ys, const int R, const int T, const int type)
{
	VF acc[GR][GT];
	for (int r = 0; r < R; r++)
		for (int t = 0; t < T; t++)
			acc[r][t] = vzero();
	int64_t i = 0;
	for (; i + VW <= n; i += VW) {
		VF wv[GR];
		for (int r = 0; r < R; r++)
			wv[r] = ld_w(w + (size_t)r * wst, i, type);
		for (int t = 0; t < T; t++) {
			const VF xv = vld((const float *)(a + (size_t)t * as) + i);
			for (int r = 0; r < R; r++)
				acc[r][t] = vfma(wv[r], xv, acc[r][t]);
		}
	}
	for (int t = 0; t < T; t++) {
		const float *x = (const float *)(a + (size_t)t * as);
		for (int r = 0; r < R; r++) {
			float s = vhsum(acc[r][t]);
			for (int64_t j = i; j < n; j++)
				s = fmaf(ld_w1(w + (size_t)r * wst, j, type), x[j], s);
			y[(size_t)t * ys + r] = s;
		}
	}
}

/* Dispatch to a tile with constant R x T; the min() keeps dead cases (R > GR, T > GT) from
 * instantiating tiles larger than the accumulator array. */
#define TILE_F(R, T) tile_float(n, wr, wst, at, as, yr, ys, R, T, type)
#define TILE_T1(R, T)                                                                            \
	case T:                                                                                  \
		if (T <= GT)                                                                     \
			TILE_F(R, (T <= GT ? T : 1));                                            \
		break;
#define TILE_TOKS(R)                                                                             \
	switch (tt) {                                                                            \
	TILE_T1(R, 1) TILE_T1(R, 2) TILE_T1(R, 3) TILE_T1(R, 4)                                  \
	TILE_T1(R, 5) TILE_T1(R, 6) TILE_T1(R, 7) TILE_T1(R, 8)                                  \
	}
#define TILE_R1(R)                                                                               \
	case R:                                                                                  \
		if (R <= GR)                                                                     \
			TILE_TOKS((R <= GR ? R : 1));                                            \
		break;
#define TILE_ROWS()                                                                              \
	switch (rr) {                                                                            \
	TILE_R1(1) TILE_R1(2) TILE_R1(3) TILE_R1(4)                                              \
	}
_Static_assert(GR <= 4 && GT <= 8, "TILE_ROWS covers 4 rows and 8 tokens");

/* rr <= GR rows x tt <= GT tokens at wr / at into yr. */
INLINE void tile_any(int64_t n, const uint8_t *wr, size_t wst, int rr, const uint8_t *at,
		     size_t as, int tt, float *yr, size_t ys, const int type)
{
	TILE_ROWS();
}

/* Token blocks outside, row blocks inside: a block's GT activation rows stay in L1 while the
 * weight rows (a chunk the caller sized for L2) pass under them once per block. */
INLINE void gemm_pass(int64_t n, const uint8_t *w, size_t wst, int nr, const uint8_t *a,
		      size_t as, int nt, float *y, size_t ys, const int type)
{
	for (int t0 = 0; t0 < nt; t0 += GT) {
		const int tt = nt - t0 < GT ? nt - t0 : GT;
		for (int r0 = 0; r0 < nr; r0 += GR)
			tile_any(n, w + (size_t)r0 * wst, wst, nr - r0 < GR ? nr - r0 : GR,
				 a + (size_t)t0 * as, as, tt, y + (size_t)t0 * ys + r0, ys, type);
	}
}

#ifndef PC_FLOATS
#define PC_FLOATS 16384 /* stack buffer of converted weights (64 KiB) */
#endif

/* Software prefetch distance of the decode dot: bytes ahead of the weights being read. The
 * stream runs on through consecutive rows (a matrix's rows are contiguous), so the next
 * row's first lines are in flight before it starts; prefetches past the end are harmless. */
#define DOT1_PF_BYTES 4096

/* Rows decode (one token) sums side by side on AVX2, a chain each (dec_rows; gemm_float
 * covers the rest of a call's rows, 1 to DEC_R - 1, case by case). */
#define DEC_R 8
_Static_assert(DEC_R == 8, "gemm_float's cases cover DEC_R - 1 rows");

/*
 * One token (decode), R <= DEC_R rows at w (wst apart) into y[0 .. R-1]: every weight row
 * streams from memory once, each summed in tile_float's order (one fma chain over the full
 * vectors, its lanes summed, then the tail element by element), so decode gives a token the
 * bits it gets in any batch (kern.h). Each 64-byte line is prefetched ahead as the loop
 * goes, a steady trickle that keeps more lines in flight than the hardware prefetchers do
 * (they restart at every 4 KiB page): measured on f16 decode of the bench model, 2 threads,
 * 28-30 tok/s against 22-24 without it, and ahead of one burst of prefetches per row (25-27).
 * Into L2 (T1), not L1: 32.6-33.8 tok/s against 30.7-31.5 with T0 in alternating runs (the
 * load itself brings the line to L1).
 *
 * AVX-512 sums one row at a time (R == 1), prefetching DOT1_PF_BYTES ahead in its stream:
 * one chain of 16-float FMAs keeps ahead of a core's share of memory bandwidth here: f16
 * default-1g, 2 threads, tg64 0.97-1.10x of four chains with a call per row
 * (bench/README.md, "Float weights: decode's bits are the batch's"). AVX2's 8-float chain
 * waits on FMA latency alone (0.59x of four chains on the same decode), so it runs DEC_R rows
 * side by side, a chain each, and prefetches each line in the row DEC_R ahead, which the next
 * call reads: on the Zen 3, f16 default-1g tg64 1.08-1.19x of the four chains per row, where
 * prefetching 4 KiB ahead in each row's own stream (mostly rows this call already reads) gave
 * 0.94-0.95x (bench/README.md, "2026-12-07: AVX2 too").
 */
INLINE void dec_rows(int64_t n, const uint8_t *w, size_t wst, const float *x, float *y,
		     const int R, const int type)
{
	const int esz = type == MD_DT_F32 ? 4 : 2;
	const int step = 64 / (VW * esz) > 1 ? 64 / (VW * esz) : 1; /* chunks per cache line */
	/* One row: DOT1_PF_BYTES ahead in its stream. Several: the same line of the rows R
	 * ahead, which the next call reads (a matrix's rows are contiguous). */
	const size_t pf_off = R == 1 ? DOT1_PF_BYTES : (size_t)R * wst;
	VF acc[DEC_R];
	for (int r = 0; r < R; r++)
		acc[r] = vzero();
	int64_t i = 0;
	for (; i + step * VW <= n; i += step * VW) {
		for (int r = 0; r < R; r++)
			for (int o = 0; o < step * VW * esz; o += 64)
				_mm_prefetch((const char *)w + (size_t)r * wst + i * esz + pf_off + o,
					     _MM_HINT_T1);
		for (int u = 0; u < step; u++) {
			const VF xv = vld(x + i + u * VW);
			for (int r = 0; r < R; r++)
				acc[r] = vfma(ld_w(w + (size_t)r * wst, i + u * VW, type), xv, acc[r]);
		}
	}
	for (; i + VW <= n; i += VW) {
		const VF xv = vld(x + i);
		for (int r = 0; r < R; r++)
			acc[r] = vfma(ld_w(w + (size_t)r * wst, i, type), xv, acc[r]);
	}
	for (int r = 0; r < R; r++) {
		float s = vhsum(acc[r]);
		for (int64_t j = i; j < n; j++)
			s = fmaf(ld_w1(w + (size_t)r * wst, j, type), x[j], s);
		y[r] = s;
	}
}

INLINE void gemm_float(int64_t n, const uint8_t *w, size_t wst, int nr, const uint8_t *a,
		       size_t as, int nt, float *y, size_t ys, const int type)
{
	if (nt == 1) {
		const float *x = (const float *)a;
#ifdef KERN_AVX512
		for (int r = 0; r < nr; r++)
			dec_rows(n, w + (size_t)r * wst, wst, x, y + r, 1, type);
#else
		int r = 0;
		for (; r + DEC_R <= nr; r += DEC_R)
			dec_rows(n, w + (size_t)r * wst, wst, x, y + r, DEC_R, type);
		switch (nr - r) { /* constant R for each: the chains stay in registers */
		case 1: dec_rows(n, w + (size_t)r * wst, wst, x, y + r, 1, type); break;
		case 2: dec_rows(n, w + (size_t)r * wst, wst, x, y + r, 2, type); break;
		case 3: dec_rows(n, w + (size_t)r * wst, wst, x, y + r, 3, type); break;
		case 4: dec_rows(n, w + (size_t)r * wst, wst, x, y + r, 4, type); break;
		case 5: dec_rows(n, w + (size_t)r * wst, wst, x, y + r, 5, type); break;
		case 6: dec_rows(n, w + (size_t)r * wst, wst, x, y + r, 6, type); break;
		case 7: dec_rows(n, w + (size_t)r * wst, wst, x, y + r, 7, type); break;
		}
#endif
		return;
	}
#if PC_FLOATS > 0
	/* 16-bit weights under several token tiles: convert a band of rows to float once, so
	 * the tiles run pure FMAs instead of converting every chunk once per tile (measured
	 * +5% on f16 prefill end to end). The values
	 * (and so the output bits) are the ones ld_w gives. */
	const int64_t band = PC_FLOATS / (n > 0 ? n : 1) / GR * GR;
	if (type != MD_DT_F32 && nt > GT && band > 0) {
		float buf[PC_FLOATS] __attribute__((aligned(64)));
		for (int r0 = 0; r0 < nr; r0 += (int)band) {
			const int m = nr - r0 < band ? nr - r0 : (int)band;
			for (int r = 0; r < m; r++) {
				const uint8_t *src = w + (size_t)(r0 + r) * wst;
				float *dst = buf + (size_t)r * n;
				int64_t i = 0;
				for (; i + VW <= n; i += VW)
					vst(dst + i, ld_w(src, i, type));
				for (; i < n; i++)
					dst[i] = ld_w1(src, i, type);
			}
			gemm_pass(n, (const uint8_t *)buf, (size_t)n * sizeof(float), m, a, as, nt,
				  y + r0, ys, MD_DT_F32);
		}
		return;
	}
#endif
	gemm_pass(n, w, wst, nr, a, as, nt, y, ys, type);
}

#define GEMM_ENTRY(gname, dname, type)                                                           \
	static void gname(int64_t n, const void *w, size_t wst, int nr, const void *a, size_t as, \
			  int nt, float *y, size_t ys)                                              \
	{                                                                                          \
		gemm_float(n, w, wst, nr, a, as, nt, y, ys, type);                                 \
	}                                                                                          \
	static void dname(int64_t n, const void *w, const void *a, size_t as, int nt, float *y,    \
			  size_t ys)                                                                \
	{                                                                                          \
		gname(n, w, 0, 1, a, as, nt, y, ys);                                               \
	}

GEMM_ENTRY(gemm_f32, dot_f32, MD_DT_F32)
GEMM_ENTRY(gemm_f16, dot_f16, MD_DT_F16)
GEMM_ENTRY(gemm_bf16, dot_bf16, MD_DT_BF16)

/* Entry points: dispatch on nt so each tile width compiles with constant bounds. AVX2 has 16
 * vector registers: its widest tile is 4 tokens for most types, wider requests run as two
 * tiles (ENTRY); tiles that keep only an accumulator per token take all MD_KERN_NT in one
 * (ENTRY8). So do the K-quant tiles that decode a group and dot it with every token before
 * the next (q3_K, iq4_xs, q4_K, q5_K, q6_K): a float accumulator per token then lives on the
 * stack, touched once per 256-weight block, which costs less than decoding every block twice
 * (bench_kernels -t 8 on AVX2: q4_K +16%, q5_K +17-21%, q6_K +4-6%, q3_K +6-9%, iq4_xs
 * +8-9%; q2_K lost 3-4% and stays split). */
#define ENTRY8(name, call)                                                                        \
	static void name(int64_t n, const void *wv, const void *av, size_t as, int nt, float *y,   \
			 size_t ys)                                                                 \
	{                                                                                          \
		const uint8_t *w = wv, *a = av;                                                    \
		switch (nt) {                                                                      \
		case 1: call(1); break;                                                            \
		case 2: call(2); break;                                                            \
		case 3: call(3); break;                                                            \
		case 4: call(4); break;                                                            \
		case 5: call(5); break;                                                            \
		case 6: call(6); break;                                                            \
		case 7: call(7); break;                                                            \
		default: call(8); break;                                                           \
		}                                                                                  \
	}
#ifdef KERN_AVX512
#define ENTRY(name, call) ENTRY8(name, call)
#else
#define ENTRY(name, call)                                                                        \
	static void name(int64_t n, const void *wv, const void *av, size_t as, int nt, float *y,   \
			 size_t ys)                                                                 \
	{                                                                                          \
		const uint8_t *w = wv, *a = av;                                                    \
		if (nt > 4) {                                                                      \
			call(4);                                                                   \
			a += 4 * as;                                                               \
			y += 4 * ys;                                                               \
			nt -= 4;                                                                   \
		}                                                                                  \
		switch (nt) {                                                                      \
		case 1: call(1); break;                                                            \
		case 2: call(2); break;                                                            \
		case 3: call(3); break;                                                            \
		default: call(4); break;                                                           \
		}                                                                                  \
	}
#endif

#ifdef KERN_AVX512
#define C_Q8_0(k) tile_s8(n, w, a, as, y, ys, k, MD_DT_Q8_0)
#define C_Q4_0(k) tile_s8(n, w, a, as, y, ys, k, MD_DT_Q4_0)
#define C_Q4_1(k) tile_q451(n, w, a, as, y, ys, k, MD_DT_Q4_1)
#define C_Q5_0(k) tile_s8(n, w, a, as, y, ys, k, MD_DT_Q5_0)
#define C_Q5_1(k) tile_q451(n, w, a, as, y, ys, k, MD_DT_Q5_1)
#define C_IQ4_NL(k) tile_nl(n, w, a, as, y, ys, k, 0)
#define C_MXFP4(k) tile_nl(n, w, a, as, y, ys, k, 1)
#define ENTRY_B32 ENTRY
#else
#define C_Q8_0(k) tile_q8_0(n, w, a, as, y, ys, k)
#define C_Q4_0(k) tile_b32(n, w, a, as, y, ys, k, MD_DT_Q4_0)
#define C_Q4_1(k) tile_b32(n, w, a, as, y, ys, k, MD_DT_Q4_1)
#define C_Q5_0(k) tile_b32(n, w, a, as, y, ys, k, MD_DT_Q5_0)
#define C_Q5_1(k) tile_b32(n, w, a, as, y, ys, k, MD_DT_Q5_1)
#define C_IQ4_NL(k) tile_b32(n, w, a, as, y, ys, k, MD_DT_IQ4_NL)
#define C_MXFP4(k) tile_b32(n, w, a, as, y, ys, k, MD_DT_MXFP4)
#define ENTRY_B32 ENTRY8
#endif
#define C_Q2_K(k) tile_q2_K(n, w, a, as, y, ys, k)
#define C_Q3_K(k) tile_q3_K(n, w, a, as, y, ys, k)
#define C_IQ4_XS(k) tile_iq4_xs(n, w, a, as, y, ys, k)
#ifdef KERN_AVX512
#define C_Q4_K(k) tile_q4_K512(n, w, a, as, y, ys, k)
#else /* the two-token-and-more tile keeps its sums in registers: see tile_qk45_tok */
#define C_Q4_K(k) ((k) == 1 ? tile_qk45(n, w, a, as, y, ys, 1, 0) : tile_qk45_tok(n, w, a, as, y, ys, k, 0))
#endif
#ifdef KERN_AVX512
#define C_Q5_K(k) tile_qk45(n, w, a, as, y, ys, k, 1)
#else
#define C_Q5_K(k) ((k) == 1 ? tile_qk45(n, w, a, as, y, ys, 1, 1) : tile_qk45_tok(n, w, a, as, y, ys, k, 1))
#endif
#ifdef KERN_AVX512
#define C_Q6_K(k) tile_q6_K(n, w, a, as, y, ys, k)
#else
#define C_Q6_K(k) ((k) == 1 ? tile_q6_K(n, w, a, as, y, ys, 1) : tile_q6_K_tok(n, w, a, as, y, ys, k))
#endif

ENTRY(dot_q8_0, C_Q8_0)
ENTRY_B32(dot_q4_0, C_Q4_0)
ENTRY_B32(dot_q4_1, C_Q4_1)
ENTRY_B32(dot_q5_0, C_Q5_0)
ENTRY_B32(dot_q5_1, C_Q5_1)
ENTRY(dot_q2_K, C_Q2_K)
ENTRY8(dot_q3_K, C_Q3_K)
ENTRY_B32(dot_iq4_nl, C_IQ4_NL)
ENTRY8(dot_iq4_xs, C_IQ4_XS)
ENTRY_B32(dot_mxfp4, C_MXFP4)
ENTRY8(dot_q4_K, C_Q4_K)
ENTRY8(dot_q5_K, C_Q5_K)
ENTRY8(dot_q6_K, C_Q6_K)

/* ---- activation quantizers (same rounding as the scalar ones: bit-identical output) ---- */

INLINE __m256 vabs8(__m256 v)
{
	return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
}

/* Quantize 32 floats with multiplier id into 32 int8 (round to nearest even, clamp 127). */
INLINE __m256i q32(const float *x, float id)
{
	const __m256 m = _mm256_set1_ps(id);
	__m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), m));
	__m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), m));
	__m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), m));
	__m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), m));
	__m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
	p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
	return _mm256_max_epi8(p, _mm256_set1_epi8(-127));
}

INLINE float amax_n(const float *x, int n)
{
	__m256 mx = _mm256_setzero_ps();
	for (int i = 0; i < n; i += 8)
		mx = _mm256_max_ps(mx, vabs8(_mm256_loadu_ps(x + i)));
	__m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
	h = _mm_max_ps(h, _mm_movehl_ps(h, h));
	h = _mm_max_ss(h, _mm_movehdup_ps(h));
	return _mm_cvtss_f32(h);
}

INLINE int hsum_i8(__m256i q)
{
	__m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
	__m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
	h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
	h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
	return _mm_cvtsi128_si32(h);
}

static void quant_q8b(const float *x, struct md_q8b *y, int64_t n)
{
	for (int64_t b = 0; b < n / 32; b++, x += 32) {
		const float amax = amax_n(x, 32);
		const float id = amax > 0 ? 127.0f / amax : 0.0f;
		const __m256i q = q32(x, id);
		_mm256_storeu_si256((__m256i *)y[b].qs, q);
		y[b].d = amax / 127.0f;
		y[b].s = hsum_i8(q);
		((float *)(y + n / 32))[b] = y[b].d;
	}
}

static void quant_q8k(const float *x, struct md_q8k *y, int64_t n)
{
	for (int64_t b = 0; b < n / 256; b++, x += 256) {
		const float amax = amax_n(x, 256);
		const float id = amax > 0 ? 127.0f / amax : 0.0f;
		y[b].d = amax / 127.0f;
		for (int j = 0; j < 8; j++) {
			const __m256i q = q32(x + 32 * j, id);
			_mm256_storeu_si256((__m256i *)(y[b].qs + 32 * j), q);
			/* Sums of 16-byte groups: 8-byte sums from maddubs + madd, then pairs. */
			__m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q),
						      _mm256_set1_epi16(1));
			s = _mm256_hadd_epi32(s, s); /* per 128-bit lane: [s01 s23 s01 s23] */
			s = _mm256_hadd_epi32(s, s);
			y[b].bsums[2 * j] = (int16_t)_mm256_extract_epi32(s, 0);
			y[b].bsums[2 * j + 1] = (int16_t)_mm256_extract_epi32(s, 4);
		}
	}
}

/* ---- float helpers ---- */

static float vdot(const float *a, const float *b, int64_t n)
{
	VF acc0 = vzero(), acc1 = vzero();
	int64_t i = 0;
	for (; i + 2 * VW <= n; i += 2 * VW) {
		acc0 = vfma(vld(a + i), vld(b + i), acc0);
		acc1 = vfma(vld(a + i + VW), vld(b + i + VW), acc1);
	}
	float s = vhsum(vadd(acc0, acc1));
	for (; i < n; i++)
		s += a[i] * b[i];
	return s;
}

static void vaxpy(float *y, float a, const float *x, int64_t n)
{
	int64_t i = 0;
	const __m256 va = _mm256_set1_ps(a);
	for (; i + 8 <= n; i += 8)
		_mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
	for (; i < n; i++)
		y[i] += a * x[i];
}

static float vdot_f16(const float *a, const uint16_t *b, int64_t n)
{
	VF acc0 = vzero(), acc1 = vzero();
	int64_t i = 0;
	for (; i + 2 * VW <= n; i += 2 * VW) {
		acc0 = vfma(vld(a + i), vld_f16(b + i), acc0);
		acc1 = vfma(vld(a + i + VW), vld_f16(b + i + VW), acc1);
	}
	float s = vhsum(vadd(acc0, acc1));
	for (; i < n; i++)
		s += a[i] * md_f16_to_f32(b[i]);
	return s;
}

static void vaxpy_f16(float *y, float a, const uint16_t *x, int64_t n)
{
	int64_t i = 0;
	const VF va = vset1(a);
	for (; i + VW <= n; i += VW)
		vst(y + i, vfma(va, vld_f16(x + i), vld(y + i)));
	for (; i < n; i++)
		y[i] += a * md_f16_to_f32(x[i]);
}

static float vsumsq(const float *x, int64_t n)
{
	return vdot(x, x, n);
}

static void vscale_mul(float *y, const float *x, float s, const float *w, int64_t n)
{
	int64_t i = 0;
	const __m256 vs = _mm256_set1_ps(s);
	for (; i + 8 <= n; i += 8)
		_mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vs),
						      _mm256_loadu_ps(w + i)));
	for (; i < n; i++)
		y[i] = x[i] * s * w[i];
}

static const struct md_kern table = {
	.name = KNAME,
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
	.gemm = {
		[MD_DT_F32] = gemm_f32,
		[MD_DT_F16] = gemm_f16,
		[MD_DT_BF16] = gemm_bf16,
	},
	.gemm_nt = GT,
#ifndef KERN_AVX512
	.own_pf = { [MD_DT_Q8_0] = true, [MD_DT_Q4_K] = true, [MD_DT_Q5_K] = true,
		    [MD_DT_Q6_K] = true }, /* QPF */
	.row_pf = true,
	.lanes = { [MD_DT_Q8_0] = lanes_q8_0 },
	.lanes_min = 2,
	.pack_q8b_lanes = pack_q8b_lanes,
#else
	.lanes = {
		[MD_DT_Q8_0] = lanes_q8_0_512,
		[MD_DT_Q4_0] = lanes_q4_0_512,
		[MD_DT_Q5_0] = lanes_q5_0_512,
	},
	.lanes_min = 2,
	.pack_q8b_lanes = pack_q8b_lanes,
#endif
	.quant_q8b = quant_q8b,
	.quant_q8k = quant_q8k,
	.dot_f32 = vdot,
	.axpy_f32 = vaxpy,
	.dot_f32_f16 = vdot_f16,
	.axpy_f16 = vaxpy_f16,
	.sumsq_f32 = vsumsq,
	.scale_mul_f32 = vscale_mul,
};

const struct md_kern *KTABLE(void)
{
	return &table;
}
