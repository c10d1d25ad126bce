/* CUDA matmul kernels that dequantize GGML weight blocks on the fly, one warp per output row. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda/launch.cuh"
#include "cuda/matmul_cuda.h"

extern "C" {
#include "engine/quant.h" /* only for the md_dtype ids */
}

/*
 * Work split: a thread block is MM_WARPS warps, each warp owns one output row and a tile of
 * NT tokens (blockIdx.y picks the tile; NT is MM_NT, or 1 where every tile has one token). The 32 lanes of a warp walk the row together so
 * each load instruction reads a contiguous run of the row (coalesced), each lane
 * dequantizes its few elements into registers, multiplies them with the matching activations
 * of every token of the tile, and the per-lane partial sums meet in a shuffle reduction.
 * Weights are read once per token tile: for decode (n_tok <= MM_NT) exactly once, which is
 * what matters for a bandwidth-bound GEMV. Large prefill batches re-read each row
 * n_tok / MM_NT times; a tiled GEMM (dequantize to shared memory, tensor cores) is the next
 * step there, and this kernel stays the reference it is checked against.
 *
 * Element values are computed in the same float expressions as engine/quant.c's dequantizer
 * (d * q, d*sc * q - dmin*m, d * sc * (q - 32)), so only the summation order differs from the
 * CPU reference (the compiler may also contract a multiply-add into one FMA).
 */

#define MM_WARPS 4 /* warps (= output rows) per thread block */
#define MM_NT 8    /* tokens per warp */

/* Activation tile: token t's row starts at x + rix[t] * n_in (rix[t] = t for a plain matmul,
 * the gathered input row for expert groups); rows beyond nt are never read. */
template <int NT> struct act {
	const float *x;
	int64_t n_in;
	int nt;
	int32_t rix[NT];
};

/* acc[t] += sum_i w[i] * x_t[idx + i] for i < 4, idx a multiple of 4 (16-byte aligned). */
template <int NT>
__device__ __forceinline__ void fma4(float *acc, const act<NT> &a, int64_t idx, float w0,
				     float w1, float w2, float w3)
{
#pragma unroll
	for (int t = 0; t < NT; t++) {
		if (t < a.nt) {
			float4 v = *(const float4 *)(a.x + (int64_t)a.rix[t] * a.n_in + idx);
			acc[t] += w0 * v.x + w1 * v.y + w2 * v.z + w3 * v.w;
		}
	}
}

/* acc[t] += w0 * x_t[idx] + w1 * x_t[idx + 1], idx even (8-byte aligned). */
template <int NT>
__device__ __forceinline__ void fma2(float *acc, const act<NT> &a, int64_t idx, float w0,
				     float w1)
{
#pragma unroll
	for (int t = 0; t < NT; t++) {
		if (t < a.nt) {
			float2 v = *(const float2 *)(a.x + (int64_t)a.rix[t] * a.n_in + idx);
			acc[t] += w0 * v.x + w1 * v.y;
		}
	}
}

template <int NT>
__device__ __forceinline__ void fma1(float *acc, const act<NT> &a, int64_t idx, float w0)
{
#pragma unroll
	for (int t = 0; t < NT; t++) {
		if (t < a.nt)
			acc[t] += w0 * a.x[(int64_t)a.rix[t] * a.n_in + idx];
	}
}

/*
 * Row walks: row_dot (after the types' steps below) adds lane's share of dot(row, x_t) to
 * acc[t], row being the row's first byte; each weight type is a step (what one step of a row
 * loads, and how it is used), which step_of names.
 *
 * Loads in flight: a walker goes through its row in steps (a block, a super-block, an
 * element) and reads MM_RUN steps (predicated to a step in range) before any of their
 * arithmetic, so a warp waits on memory once per MM_RUN steps, not once per step. A decode
 * product is one warp per row over a few hundred rows per matrix: the bytes the warps have in
 * flight, not arithmetic, bound it. The steps are then used in order, so each lane's sums are
 * those of a plain loop over the steps.
 */
#define MM_RUN 4

/* S: raw (what one step loads), run (steps loaded together), load(row, i, lane) and
 * use(raw, i, a, lane, acc) for step i. The lane's steps are first, first + step, ... below n. */
template <class S, int NT>
__device__ __forceinline__ void walk(const uint8_t *row, const act<NT> &a, int lane, float *acc,
				     int64_t first, int64_t step, int64_t n)
{
	for (int64_t i0 = first; i0 < n; i0 += step * S::run) {
		typename S::raw r[S::run];

#pragma unroll
		for (int u = 0; u < S::run; u++) {
			const int64_t i = i0 + u * step;

			r[u] = S::load(row, i < n ? i : i0, lane);
		}
#pragma unroll
		for (int u = 0; u < S::run; u++) {
			const int64_t i = i0 + u * step;

			if (i < n)
				S::use(r[u], i, a, lane, acc);
		}
	}
}

/* Float types: lane takes elements lane, lane + 32, ... (consecutive lanes, consecutive
 * elements); raw is the element's bits. */
template <int TYPE> struct float_step {
	typedef uint32_t raw;
	static constexpr int run = 2 * MM_RUN;
	static constexpr int side = 32, elems = 1;
	static __device__ raw load(const uint8_t *row, int64_t i, int lane)
	{
		return TYPE == MD_DT_F32 ? ((const uint32_t *)row)[i] : ((const uint16_t *)row)[i];
	}
	template <int NT>
	static __device__ void use(raw w, int64_t i, const act<NT> &a, int lane, float *acc)
	{
		const float v = TYPE == MD_DT_F32 ? __uint_as_float(w)
				: TYPE == MD_DT_F16 ? __half2float(__ushort_as_half((unsigned short)w))
						    : __uint_as_float(w << 16);

		fma1(acc, a, i, v);
	}
};

/* q8_0 (34-byte blocks of 32): 8 lanes per block, 4 blocks per step; lane k of a block takes
 * elements 4k .. 4k+3 (two 16-bit loads; blocks are only 2-byte aligned). */
struct q8_0_step {
	struct raw {
		uint16_t d, lo, hi;
	};
	static constexpr int run = MM_RUN;
	static constexpr int side = 4, elems = 32;
	static __device__ raw load(const uint8_t *row, int64_t ib, int lane)
	{
		const uint8_t *b = row + ib * 34;
		const uint16_t *q = (const uint16_t *)(b + 2 + 4 * (lane & 7));
		raw r;

		r.d = *(const uint16_t *)b;
		r.lo = q[0];
		r.hi = q[1];
		return r;
	}
	template <int NT>
	static __device__ void use(raw r, int64_t ib, const act<NT> &a, int lane, float *acc)
	{
		const float d = __half2float(__ushort_as_half(r.d));
		const uint32_t lo = r.lo, hi = r.hi;

		fma4(acc, a, ib * 32 + 4 * (lane & 7), (float)(int8_t)(lo & 0xff) * d,
		     (float)(int8_t)(lo >> 8) * d, (float)(int8_t)(hi & 0xff) * d,
		     (float)(int8_t)(hi >> 8) * d);
	}
};

/* q4_0 (18-byte blocks of 32): 8 lanes per block, 4 blocks per step; lane k reads qs[2k],
 * qs[2k+1]: elements 2k, 2k+1 (low nibbles) and 2k+16, 2k+17 (high nibbles). */
struct q4_0_step {
	struct raw {
		uint16_t d, q;
	};
	static constexpr int run = MM_RUN;
	static constexpr int side = 4, elems = 32;
	static __device__ raw load(const uint8_t *row, int64_t ib, int lane)
	{
		const uint8_t *b = row + ib * 18;
		raw r;

		r.d = *(const uint16_t *)b;
		r.q = *(const uint16_t *)(b + 2 + 2 * (lane & 7));
		return r;
	}
	template <int NT>
	static __device__ void use(raw r, int64_t ib, const act<NT> &a, int lane, float *acc)
	{
		const float d = __half2float(__ushort_as_half(r.d));
		const uint32_t q = r.q;
		const int64_t e = ib * 32 + 2 * (lane & 7);

		fma2(acc, a, e, (float)((int)(q & 0xf) - 8) * d, (float)((int)((q >> 8) & 0xf) - 8) * d);
		fma2(acc, a, e + 16, (float)((int)((q >> 4) & 0xf) - 8) * d,
		     (float)((int)(q >> 12) - 8) * d);
	}
};

/* Byte k < 12 of a q4_K / q5_K / q3_K super-block's packed scales, held as three words. */
__device__ __forceinline__ int k_byte(const uint32_t s[3], int k)
{
	return (int)(((k < 4 ? s[0] : k < 8 ? s[1] : s[2]) >> (8 * (k & 3))) & 0xff);
}

/* The 6-bit scale and min of sub-block j of a q4_K / q5_K super-block (scales in s). */
__device__ __forceinline__ void k_scale_min(const uint32_t s[3], int j, int *sc, int *m)
{
	if (j < 4) {
		*sc = k_byte(s, j) & 63;
		*m = k_byte(s, j + 4) & 63;
	} else {
		*sc = (k_byte(s, j + 4) & 0xf) | ((k_byte(s, j - 4) >> 6) << 4);
		*m = (k_byte(s, j + 4) >> 4) | ((k_byte(s, j) >> 6) << 4);
	}
}

/*
 * q4_K (144 B) and q5_K (176 B) super-blocks of 256: one super-block per step. Lane l reads
 * the 4 bytes qs[4l .. 4l+3]; they hold pair p = l / 8 at offsets j = 4 (l % 8) .. +3: low
 * nibbles are sub-block 2p, high nibbles 2p+1. For q5_K the fifth bit of element j of
 * sub-block s is bit s of qh[j]. Blocks are 4-byte aligned when the row is (checked by the
 * host), so d and dmin come as one word and the 12 scale bytes as three.
 */
template <bool Q5> struct q45_k_step {
	struct raw {
		uint32_t dm, s[3], q, h;
	};
	static constexpr int run = MM_RUN;
	static constexpr int side = 1, elems = 256;
	static __device__ raw load(const uint8_t *row, int64_t ib, int lane)
	{
		const uint8_t *b = row + ib * (Q5 ? 176 : 144);
		raw r;

		r.dm = *(const uint32_t *)b;
#pragma unroll
		for (int i = 0; i < 3; i++)
			r.s[i] = *(const uint32_t *)(b + 4 + 4 * i);
		r.q = *(const uint32_t *)(b + (Q5 ? 48 : 16) + 4 * lane);
		r.h = Q5 ? *(const uint32_t *)(b + 16 + 4 * (lane & 7)) : 0;
		return r;
	}
	template <int NT>
	static __device__ void use(const raw &r, int64_t ib, const act<NT> &a, int lane,
				   float *acc)
	{
		const int p = lane >> 3;
		const int j = 4 * (lane & 7);
		const float d = __half2float(__ushort_as_half((unsigned short)(r.dm & 0xffff)));
		const float dmin = __half2float(__ushort_as_half((unsigned short)(r.dm >> 16)));
		int sc0, m0, sc1, m1;

		k_scale_min(r.s, 2 * p, &sc0, &m0);
		k_scale_min(r.s, 2 * p + 1, &sc1, &m1);
		const float ds0 = d * (float)sc0, ms0 = dmin * (float)m0;
		const float ds1 = d * (float)sc1, ms1 = dmin * (float)m1;
		float w0[4], w1[4];

#pragma unroll
		for (int i = 0; i < 4; i++) {
			int v0 = (r.q >> (8 * i)) & 0xf;
			int v1 = (r.q >> (8 * i + 4)) & 0xf;

			if (Q5) {
				const uint32_t hb = r.h >> (8 * i);

				v0 |= (int)((hb >> (2 * p)) & 1) << 4;
				v1 |= (int)((hb >> (2 * p + 1)) & 1) << 4;
			}
			w0[i] = ds0 * (float)v0 - ms0;
			w1[i] = ds1 * (float)v1 - ms1;
		}
		const int64_t e = ib * 256 + 64 * p + j;

		fma4(acc, a, e, w0[0], w0[1], w0[2], w0[3]);
		fma4(acc, a, e + 32, w1[0], w1[1], w1[2], w1[3]);
	}
};

/*
 * q6_K (210 B: ql[128] | qh[64] | i8 scales[16] | f16 d) super-blocks of 256, one per step.
 * Element e = 128h + 32k + l (h < 2, k < 4, l < 32) has low bits in ql[64h + l + 32(k & 1)]
 * (low nibble for k < 2, high for k >= 2) and high bits (qh[32h + l] >> 2k) & 3. Lane takes
 * h = lane / 16 and l = 2 (lane % 16) + {0, 1}, all four k: three 16-bit loads (blocks are
 * only 2-byte aligned) give its 8 elements, and it needs 4 of the 16 scales.
 */
struct q6_k_step {
	struct raw {
		uint16_t d, qa, qb, qh;
		int8_t sc[4];
	};
	static constexpr int run = MM_RUN;
	static constexpr int side = 1, elems = 256;
	static __device__ raw load(const uint8_t *row, int64_t ib, int lane)
	{
		const uint8_t *b = row + ib * 210;
		const int h = lane >> 4, l = 2 * (lane & 15);
		const int8_t *sc = (const int8_t *)(b + 192) + 8 * h + (l >> 4);
		raw r;

		r.d = *(const uint16_t *)(b + 208);
		r.qa = *(const uint16_t *)(b + 64 * h + l);
		r.qb = *(const uint16_t *)(b + 64 * h + 32 + l);
		r.qh = *(const uint16_t *)(b + 128 + 32 * h + l);
#pragma unroll
		for (int k = 0; k < 4; k++)
			r.sc[k] = sc[2 * k];
		return r;
	}
	template <int NT>
	static __device__ void use(const raw &r, int64_t ib, const act<NT> &a, int lane,
				   float *acc)
	{
		const int h = lane >> 4, l = 2 * (lane & 15);
		const float d = __half2float(__ushort_as_half(r.d));
		const uint32_t qa = r.qa, qb = r.qb, qh = r.qh;

#pragma unroll
		for (int k = 0; k < 4; k++) {
			const uint32_t lo = (k & 1) ? qb : qa;
			const int shift = (k < 2) ? 0 : 4;
			const float ds = d * (float)r.sc[k];
			const int q0 = (int)(((lo >> shift) & 0xf) | (((qh >> (2 * k)) & 3) << 4));
			const int q1 = (int)(((lo >> (8 + shift)) & 0xf) | (((qh >> (8 + 2 * k)) & 3) << 4));

			fma2(acc, a, ib * 256 + 128 * h + 32 * k + l, ds * (float)(q0 - 32),
			     ds * (float)(q1 - 32));
		}
	}
};

/*
 * The other 32-element types (q4_1, q5_0, q5_1, iq4_nl, mxfp4): the q4_0 walk (8 lanes per
 * block, lane k takes qs[2k], qs[2k+1]: elements 2k, 2k+1 from the low nibbles and 2k+16,
 * 2k+17 from the high ones), every byte loaded on its own (these blocks are 17 to 24 bytes,
 * so rows keep no alignment a wider load could use). val(h, q, j) is element j's value from
 * its nibble q and the block's header h (its first qs bytes), in engine/quant.c's
 * expressions.
 */
__device__ __forceinline__ float ld_f16b(const uint8_t *p) /* any alignment */
{
	return __half2float(__ushort_as_half((unsigned short)(p[0] | (p[1] << 8))));
}

__device__ __forceinline__ uint32_t ld_u32b(const uint8_t *p)
{
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* 2^(e - 128) (engine/quant.c md_e8m0_half). */
__device__ __forceinline__ float e8m0_half(uint8_t e)
{
	return __uint_as_float(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23);
}

__constant__ int8_t c_iq4nl[16] = { -127, -104, -83, -65, -49, -35, -22, -10,
				     1, 13, 25, 38, 53, 69, 89, 113 };
__constant__ int8_t c_mxfp4[16] = { 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12 };

template <int TYPE> struct blk32;

template <> struct blk32<MD_DT_Q4_1> {
	static constexpr int bytes = 20, qs = 4;
	static __device__ float val(const uint8_t *b, int q, int j)
	{
		(void)j;
		return (float)q * ld_f16b(b) + ld_f16b(b + 2);
	}
};

template <> struct blk32<MD_DT_Q5_0> {
	static constexpr int bytes = 22, qs = 6;
	static __device__ float val(const uint8_t *b, int q, int j)
	{
		const int v = q | (int)((ld_u32b(b + 2) >> j) & 1) << 4;
		return (float)(v - 16) * ld_f16b(b);
	}
};

template <> struct blk32<MD_DT_Q5_1> {
	static constexpr int bytes = 24, qs = 8;
	static __device__ float val(const uint8_t *b, int q, int j)
	{
		const int v = q | (int)((ld_u32b(b + 4) >> j) & 1) << 4;
		return (float)v * ld_f16b(b) + ld_f16b(b + 2);
	}
};

template <> struct blk32<MD_DT_IQ4_NL> {
	static constexpr int bytes = 18, qs = 2;
	static __device__ float val(const uint8_t *b, int q, int j)
	{
		(void)j;
		return ld_f16b(b) * (float)c_iq4nl[q];
	}
};

template <> struct blk32<MD_DT_MXFP4> {
	static constexpr int bytes = 17, qs = 1;
	static __device__ float val(const uint8_t *b, int q, int j)
	{
		(void)j;
		return e8m0_half(b[0]) * (float)c_mxfp4[q];
	}
};

/* One block of a 32-element type: its header (the bytes before qs, at most 8) and the lane's
 * two qs bytes, val() reading the header from registers. */
template <int TYPE> struct blk32_step {
	typedef blk32<TYPE> B;
	struct raw {
		uint8_t h[8], q0, q1;
	};
	static constexpr int run = MM_RUN;
	static constexpr int side = 4, elems = 32;
	static __device__ raw load(const uint8_t *row, int64_t ib, int lane)
	{
		const uint8_t *b = row + ib * B::bytes;
		const int k = lane & 7;
		raw r;

#pragma unroll
		for (int i = 0; i < 8; i++)
			r.h[i] = i < B::qs ? b[i] : 0;
		r.q0 = b[B::qs + 2 * k];
		r.q1 = b[B::qs + 2 * k + 1];
		return r;
	}
	template <int NT>
	static __device__ void use(const raw &r, int64_t ib, const act<NT> &a, int lane,
				   float *acc)
	{
		const int k = lane & 7;
		const int64_t e = ib * 32 + 2 * k;

		fma2(acc, a, e, B::val(r.h, r.q0 & 0xf, 2 * k), B::val(r.h, r.q1 & 0xf, 2 * k + 1));
		fma2(acc, a, e + 16, B::val(r.h, r.q0 >> 4, 2 * k + 16),
		     B::val(r.h, r.q1 >> 4, 2 * k + 17));
	}
};


/* iq4_xs (136 B: f16 d | u16 scales_h | u8 scales_l[4] | qs[128]) super-blocks of 256, one per
 * step: lane l takes sub-block l / 4 and its qs bytes 4 (l % 4) .. +3 (elements 4 (l % 4) ..
 * +3 from the low nibbles, +16 from the high ones). Bytes are loaded one by one (rows keep no
 * alignment) and packed into words: d and scales_h, and the lane's four qs bytes. */
struct iq4_xs_step {
	struct raw {
		uint32_t hdr, q;
		uint8_t sl;
	};
	static constexpr int run = MM_RUN;
	static constexpr int side = 1, elems = 256;
	static __device__ raw load(const uint8_t *row, int64_t s, int lane)
	{
		const uint8_t *b = row + s * 136;
		const int ib = lane >> 2, j = 4 * (lane & 3);
		raw r;

		r.hdr = ld_u32b(b);
		r.sl = b[4 + ib / 2];
		r.q = ld_u32b(b + 8 + 16 * ib + j);
		return r;
	}
	template <int NT>
	static __device__ void use(const raw &r, int64_t s, const act<NT> &a, int lane, float *acc)
	{
		const int ib = lane >> 2, j = 4 * (lane & 3);
		const unsigned sh = r.hdr >> 16;
		const int ls = ((r.sl >> (4 * (ib % 2))) & 15) | (int)((sh >> (2 * ib)) & 3) << 4;
		const float dl = __half2float(__ushort_as_half((unsigned short)(r.hdr & 0xffff))) *
				 (float)(ls - 32);
		const int64_t e = s * 256 + 32 * ib + j;
		int q[4];

#pragma unroll
		for (int k = 0; k < 4; k++)
			q[k] = (int)((r.q >> (8 * k)) & 0xff);
		fma4(acc, a, e, dl * (float)c_iq4nl[q[0] & 0xf], dl * (float)c_iq4nl[q[1] & 0xf],
		     dl * (float)c_iq4nl[q[2] & 0xf], dl * (float)c_iq4nl[q[3] & 0xf]);
		fma4(acc, a, e + 16, dl * (float)c_iq4nl[q[0] >> 4], dl * (float)c_iq4nl[q[1] >> 4],
		     dl * (float)c_iq4nl[q[2] >> 4], dl * (float)c_iq4nl[q[3] >> 4]);
	}
};

/* q2_K (84 B: scales[16] | qs[64] | f16 d | f16 dmin) and q3_K (110 B: hmask[32] | qs[64] |
 * scales[12] | f16 d): element e = 128 h + 32 j + l has its two low bits at qs[32 h + l] >> 2j;
 * lane l takes l and all eight (h, j), so each load instruction of the warp reads 32
 * consecutive bytes and its activations are 32 consecutive floats. A lane's scale bytes are
 * packed into words as they are loaded. */
struct q2_k_step {
	struct raw {
		uint32_t dd, sc[2]; /* d | dmin; scales[8 h + 2 j + l / 16], byte j of word h */
		uint8_t qb[2];
	};
	static constexpr int run = MM_RUN;
	static constexpr int side = 1, elems = 256;
	static __device__ raw load(const uint8_t *row, int64_t s, int lane)
	{
		const uint8_t *b = row + s * 84;
		const int hl = lane >> 4;
		raw r;

		r.dd = ld_u32b(b + 80);
#pragma unroll
		for (int h = 0; h < 2; h++) {
			r.qb[h] = b[16 + 32 * h + lane];
			r.sc[h] = (uint32_t)b[8 * h + hl] | (uint32_t)b[8 * h + 2 + hl] << 8 |
				  (uint32_t)b[8 * h + 4 + hl] << 16 | (uint32_t)b[8 * h + 6 + hl] << 24;
		}
		return r;
	}
	template <int NT>
	static __device__ void use(const raw &r, int64_t s, const act<NT> &a, int lane, float *acc)
	{
		const float d = __half2float(__ushort_as_half((unsigned short)(r.dd & 0xffff)));
		const float dmin = __half2float(__ushort_as_half((unsigned short)(r.dd >> 16)));

#pragma unroll
		for (int h = 0; h < 2; h++) {
			const int qb = r.qb[h];

#pragma unroll
			for (int j = 0; j < 4; j++) {
				const int e = 128 * h + 32 * j + lane;
				const int sc = (int)((r.sc[h] >> (8 * j)) & 0xff);
				const float dl = d * (float)(sc & 15), ml = dmin * (float)(sc >> 4);

				fma1(acc, a, s * 256 + e, dl * (float)((qb >> (2 * j)) & 3) - ml);
			}
		}
	}
};

struct q3_k_step {
	struct raw {
		uint32_t s[3]; /* the 12 scale bytes */
		uint16_t d;
		uint8_t hm, qb[2];
	};
	static constexpr int run = MM_RUN;
	static constexpr int side = 1, elems = 256;
	static __device__ raw load(const uint8_t *row, int64_t s, int lane)
	{
		const uint8_t *b = row + s * 110;
		raw r;

#pragma unroll
		for (int k = 0; k < 3; k++)
			r.s[k] = ld_u32b(b + 96 + 4 * k);
		r.d = (uint16_t)(b[108] | b[109] << 8);
		r.hm = b[lane];
		r.qb[0] = b[32 + lane];
		r.qb[1] = b[64 + lane];
		return r;
	}
	template <int NT>
	static __device__ void use(const raw &r, int64_t s, const act<NT> &a, int lane, float *acc)
	{
		const float d = __half2float(__ushort_as_half(r.d));
		const int hm = r.hm;

#pragma unroll
		for (int h = 0; h < 2; h++) {
			const int qb = r.qb[h];

#pragma unroll
			for (int j = 0; j < 4; j++) {
				const int e = 128 * h + 32 * j + lane, i = e / 16;
				const int lo = i < 8 ? k_byte(r.s, i) & 15 : k_byte(r.s, i - 8) >> 4;
				const int hi = (k_byte(r.s, 8 + i % 4) >> (2 * (i / 4))) & 3;
				const int q = ((qb >> (2 * j)) & 3) | ((hm >> (e / 32)) & 1) << 2;

				fma1(acc, a, s * 256 + e,
				     d * (float)((lo | hi << 4) - 32) * (float)(q - 4));
			}
		}
	}
};

/* Each type's step: elems elements a step, side steps side by side across the warp (32 / side
 * lanes each, so lane's first step is lane / (32 / side)). */
template <int TYPE> struct step_of;
template <> struct step_of<MD_DT_F32> { typedef float_step<MD_DT_F32> type; };
template <> struct step_of<MD_DT_F16> { typedef float_step<MD_DT_F16> type; };
template <> struct step_of<MD_DT_BF16> { typedef float_step<MD_DT_BF16> type; };
template <> struct step_of<MD_DT_Q8_0> { typedef q8_0_step type; };
template <> struct step_of<MD_DT_Q4_0> { typedef q4_0_step type; };
template <> struct step_of<MD_DT_Q4_K> { typedef q45_k_step<false> type; };
template <> struct step_of<MD_DT_Q5_K> { typedef q45_k_step<true> type; };
template <> struct step_of<MD_DT_Q6_K> { typedef q6_k_step type; };
template <> struct step_of<MD_DT_Q4_1> { typedef blk32_step<MD_DT_Q4_1> type; };
template <> struct step_of<MD_DT_Q5_0> { typedef blk32_step<MD_DT_Q5_0> type; };
template <> struct step_of<MD_DT_Q5_1> { typedef blk32_step<MD_DT_Q5_1> type; };
template <> struct step_of<MD_DT_IQ4_NL> { typedef blk32_step<MD_DT_IQ4_NL> type; };
template <> struct step_of<MD_DT_MXFP4> { typedef blk32_step<MD_DT_MXFP4> type; };
template <> struct step_of<MD_DT_IQ4_XS> { typedef iq4_xs_step type; };
template <> struct step_of<MD_DT_Q2_K> { typedef q2_k_step type; };
template <> struct step_of<MD_DT_Q3_K> { typedef q3_k_step type; };

/* Lane's share of dot(row, x_t) added to acc[t], for every token of the tile. */
template <int TYPE, int NT>
__device__ __forceinline__ void row_dot(const uint8_t *row, const act<NT> &a, int lane, float *acc)
{
	typedef typename step_of<TYPE>::type S;

	walk<S>(row, a, lane, acc, lane / (32 / S::side), S::side, a.n_in / S::elems);
}

/* One warp per output row (blockIdx.x * MM_WARPS + warp), one tile of NT tokens per
 * blockIdx.y. The whole warp leaves together when its row is past the end, so the full-mask
 * shuffles below always see 32 lanes. NT is MM_NT, or 1 for one token (a decode step of one
 * sequence): a tile's accumulators and rows take registers, and the fewer a warp holds, the
 * more warps (and their loads) an SM keeps in flight. */
/* Output row r of w for the NT-token tile at t0 (the warp's share of mm_kernel). */
template <int TYPE, int NT>
__device__ __forceinline__ void mm_row(const uint8_t *__restrict__ w, int64_t n_in, int64_t n_out,
				       size_t nb1, const float *__restrict__ x, int n_tok,
				       float *__restrict__ y, int accumulate, int64_t r, int t0,
				       int lane)
{
	float acc[NT];
	act<NT> a;

	a.x = x + (int64_t)t0 * n_in;
	a.n_in = n_in;
	a.nt = min(NT, n_tok - t0);
#pragma unroll
	for (int t = 0; t < NT; t++) {
		acc[t] = 0.0f;
		a.rix[t] = t;
	}
	row_dot<TYPE>(w + r * (int64_t)nb1, a, lane, acc);
	/* Reduce only the tile's tokens: a.nt is the same for the whole warp, so the shuffles
	 * stay warp-uniform (a decode tile has one token: 5 shuffles, not 40). */
#pragma unroll
	for (int t = 0; t < NT; t++) {
		if (t >= a.nt)
			break;
		float v = acc[t];

#pragma unroll
		for (int off = 16; off > 0; off >>= 1)
			v += __shfl_xor_sync(0xffffffffu, v, off);
		if (lane == 0) {
			float *o = y + (int64_t)(t0 + t) * n_out + r;

			*o = accumulate ? *o + v : v;
		}
	}
}

template <int TYPE, int NT>
__global__ void __launch_bounds__(MM_WARPS * 32)
mm_kernel(const uint8_t *__restrict__ w, int64_t n_in, int64_t n_out, size_t nb1,
	  const float *__restrict__ x, int n_tok, float *__restrict__ y, int accumulate)
{
	md_pdl_enter();
	const int64_t r = (int64_t)blockIdx.x * MM_WARPS + (threadIdx.x >> 5);

	if (r >= n_out)
		return;
	mm_row<TYPE, NT>(w, n_in, n_out, nb1, x, n_tok, y, accumulate, r,
			 (int)blockIdx.y * NT, (int)(threadIdx.x & 31));
}

/* Several products of one input in one launch (md_backend_fwd.mm_multi: Q, K and V; an FFN's
 * gate and up): the matrices' row blocks one after another along blockIdx.x, matrix i's from
 * blk0[i], so that every block reads one matrix. */
struct mm_multi_args {
	const uint8_t *w[MD_CUDA_MM_MULTI];
	float *y[MD_CUDA_MM_MULTI];
	int64_t n_out[MD_CUDA_MM_MULTI];
	int64_t blk0[MD_CUDA_MM_MULTI + 1];
	int n;
};

template <int TYPE, int NT>
__global__ void __launch_bounds__(MM_WARPS * 32)
mm_multi_kernel(const mm_multi_args m, int64_t n_in, size_t nb1, const float *__restrict__ x,
		int n_tok)
{
	md_pdl_enter();
	const int64_t bx = blockIdx.x;
	int i = 0;

	while (i + 1 < m.n && bx >= m.blk0[i + 1])
		i++;
	const int64_t r = (bx - m.blk0[i]) * MM_WARPS + (threadIdx.x >> 5);

	if (r >= m.n_out[i])
		return;
	mm_row<TYPE, NT>(m.w[i], n_in, m.n_out[i], nb1, x, n_tok, m.y[i], 0, r,
			 (int)blockIdx.y * NT, (int)(threadIdx.x & 31));
}

/* The expert-grouped variant (md_backend_fwd.mm_experts): blockIdx.y is i * ng + g, weight i
 * (y0's or y1's, wtab[i * ng + g]) of group g, whose slots are off[g] .. off[g+1]-1 (both
 * weights of a group in one launch: a decode step's gate and up products are one kernel, not
 * two back to back), taken NT at a time in a loop
 * (a grid dimension per token tile would be sized for the largest group a routing on the
 * device may produce, and most of its blocks would find nothing to do). Slot s reads input row
 * src[s] (s when src is NULL) and writes y[s * n_out + r]. NT: as mm_kernel's (1 when no
 * group has more than one slot). */
template <int TYPE, int NT>
__global__ void __launch_bounds__(MM_WARPS * 32)
mmx_kernel(const void *const *__restrict__ wtab, int64_t n_in, int64_t n_out, size_t nb1,
	   int ng, const int32_t *__restrict__ off, const int32_t *__restrict__ src,
	   const float *__restrict__ x, float *__restrict__ y0, float *__restrict__ y1)
{
	md_pdl_enter();
	const int lane = (int)(threadIdx.x & 31);
	const int64_t r = (int64_t)blockIdx.x * MM_WARPS + (threadIdx.x >> 5);
	const int gi = (int)blockIdx.y, g = gi % ng;
	float *__restrict__ y = gi < ng ? y0 : y1;
	const int s1 = off[g + 1];

	if (r >= n_out || off[g] >= s1)
		return;
	const uint8_t *row = (const uint8_t *)wtab[gi] + r * (int64_t)nb1;

	for (int s0 = off[g]; s0 < s1; s0 += NT) {
		float acc[NT];
		act<NT> a;

		a.x = x;
		a.n_in = n_in;
		a.nt = min(NT, s1 - s0);
#pragma unroll
		for (int t = 0; t < NT; t++) {
			acc[t] = 0.0f;
			a.rix[t] = t < a.nt ? (src != NULL ? src[s0 + t] : s0 + t) : 0;
		}
		row_dot<TYPE>(row, a, lane, acc);
#pragma unroll
		for (int t = 0; t < NT; t++) {
			if (t >= a.nt) /* warp-uniform, as in mm_kernel */
				break;
			float v = acc[t];

#pragma unroll
			for (int o = 16; o > 0; o >>= 1)
				v += __shfl_xor_sync(0xffffffffu, v, o);
			if (lane == 0)
				y[(int64_t)(s0 + t) * n_out + r] = v;
		}
	}
}

template <int TYPE>
static cudaError_t launch_x(const void *const *wtab, int64_t n_in, int64_t n_out, size_t nb1,
			    int ng, int nw, const int32_t *off, const int32_t *src, const float *x,
			    int max_rows, float *y0, float *y1, cudaStream_t stream)
{
	const dim3 grid((unsigned)((n_out + MM_WARPS - 1) / MM_WARPS), (unsigned)(ng * nw), 1);

	if (max_rows == 1)
		md_launch(mmx_kernel<TYPE, 1>, grid, MM_WARPS * 32, 0, stream, wtab, n_in, n_out,
			  nb1, ng, off, src, x, y0, y1);
	else
		md_launch(mmx_kernel<TYPE, MM_NT>, grid, MM_WARPS * 32, 0, stream, wtab, n_in,
			  n_out, nb1, ng, off, src, x, y0, y1);
	return cudaGetLastError();
}

extern "C" cudaError_t md_cuda__matmul_experts(int type, const void *const *wtab, int64_t n_in,
					       int64_t n_out, size_t nb1, int ng, int nw,
					       const int32_t *off, const int32_t *src,
					       const float *x, int max_rows, float *y0,
					       float *y1, cudaStream_t stream)
{
	if (n_out <= 0 || ng <= 0 || max_rows <= 0 || nw < 1 || nw > 2 || ng * nw > 65535 ||
	    (n_out + MM_WARPS - 1) / MM_WARPS > 0x7fffffff)
		return cudaErrorInvalidValue;
	switch (type) {
	case MD_DT_F32: return launch_x<MD_DT_F32>(wtab, n_in, n_out, nb1, ng, nw, off, src, x, max_rows, y0, y1, stream);
	case MD_DT_F16: return launch_x<MD_DT_F16>(wtab, n_in, n_out, nb1, ng, nw, off, src, x, max_rows, y0, y1, stream);
	case MD_DT_BF16: return launch_x<MD_DT_BF16>(wtab, n_in, n_out, nb1, ng, nw, off, src, x, max_rows, y0, y1, stream);
	case MD_DT_Q8_0: return launch_x<MD_DT_Q8_0>(wtab, n_in, n_out, nb1, ng, nw, off, src, x, max_rows, y0, y1, stream);
	case MD_DT_Q4_0: return launch_x<MD_DT_Q4_0>(wtab, n_in, n_out, nb1, ng, nw, off, src, x, max_rows, y0, y1, stream);
	case MD_DT_Q4_K: return launch_x<MD_DT_Q4_K>(wtab, n_in, n_out, nb1, ng, nw, off, src, x, max_rows, y0, y1, stream);
	case MD_DT_Q5_K: return launch_x<MD_DT_Q5_K>(wtab, n_in, n_out, nb1, ng, nw, off, src, x, max_rows, y0, y1, stream);
	case MD_DT_Q6_K: return launch_x<MD_DT_Q6_K>(wtab, n_in, n_out, nb1, ng, nw, off, src, x, max_rows, y0, y1, stream);
	case MD_DT_Q4_1: return launch_x<MD_DT_Q4_1>(wtab, n_in, n_out, nb1, ng, nw, off, src, x, max_rows, y0, y1, stream);
	case MD_DT_Q5_0: return launch_x<MD_DT_Q5_0>(wtab, n_in, n_out, nb1, ng, nw, off, src, x, max_rows, y0, y1, stream);
	case MD_DT_Q5_1: return launch_x<MD_DT_Q5_1>(wtab, n_in, n_out, nb1, ng, nw, off, src, x, max_rows, y0, y1, stream);
	case MD_DT_IQ4_NL: return launch_x<MD_DT_IQ4_NL>(wtab, n_in, n_out, nb1, ng, nw, off, src, x, max_rows, y0, y1, stream);
	case MD_DT_IQ4_XS: return launch_x<MD_DT_IQ4_XS>(wtab, n_in, n_out, nb1, ng, nw, off, src, x, max_rows, y0, y1, stream);
	case MD_DT_MXFP4: return launch_x<MD_DT_MXFP4>(wtab, n_in, n_out, nb1, ng, nw, off, src, x, max_rows, y0, y1, stream);
	case MD_DT_Q2_K: return launch_x<MD_DT_Q2_K>(wtab, n_in, n_out, nb1, ng, nw, off, src, x, max_rows, y0, y1, stream);
	case MD_DT_Q3_K: return launch_x<MD_DT_Q3_K>(wtab, n_in, n_out, nb1, ng, nw, off, src, x, max_rows, y0, y1, stream);
	default: return cudaErrorInvalidValue;
	}
}

template <int TYPE>
static cudaError_t launch(const void *w, int64_t n_in, int64_t n_out, size_t nb1,
			  const float *x, int n_tok, float *y, int acc, cudaStream_t stream)
{
	const dim3 grid((unsigned)((n_out + MM_WARPS - 1) / MM_WARPS),
			(unsigned)((n_tok + MM_NT - 1) / MM_NT));

	if (n_tok == 1)
		md_launch(mm_kernel<TYPE, 1>, grid, MM_WARPS * 32, 0, stream, (const uint8_t *)w,
			  n_in, n_out, nb1, x, n_tok, y, acc);
	else
		md_launch(mm_kernel<TYPE, MM_NT>, grid, MM_WARPS * 32, 0, stream,
			  (const uint8_t *)w, n_in, n_out, nb1, x, n_tok, y, acc);
	return cudaGetLastError();
}

extern "C" cudaError_t md_cuda__matmul(int type, const void *w, int64_t n_in, int64_t n_out,
				       size_t nb1, const float *x, int n_tok, float *y,
				       int acc, cudaStream_t stream)
{
	/* Grid limits: x up to 2^31 - 1 blocks, y up to 65535. */
	if (n_out <= 0 || n_tok <= 0 || (n_out + MM_WARPS - 1) / MM_WARPS > 0x7fffffff ||
	    (n_tok + MM_NT - 1) / MM_NT > 65535)
		return cudaErrorInvalidValue;
	switch (type) {
	case MD_DT_F32: return launch<MD_DT_F32>(w, n_in, n_out, nb1, x, n_tok, y, acc, stream);
	case MD_DT_F16: return launch<MD_DT_F16>(w, n_in, n_out, nb1, x, n_tok, y, acc, stream);
	case MD_DT_BF16: return launch<MD_DT_BF16>(w, n_in, n_out, nb1, x, n_tok, y, acc, stream);
	case MD_DT_Q8_0: return launch<MD_DT_Q8_0>(w, n_in, n_out, nb1, x, n_tok, y, acc, stream);
	case MD_DT_Q4_0: return launch<MD_DT_Q4_0>(w, n_in, n_out, nb1, x, n_tok, y, acc, stream);
	case MD_DT_Q4_K: return launch<MD_DT_Q4_K>(w, n_in, n_out, nb1, x, n_tok, y, acc, stream);
	case MD_DT_Q5_K: return launch<MD_DT_Q5_K>(w, n_in, n_out, nb1, x, n_tok, y, acc, stream);
	case MD_DT_Q6_K: return launch<MD_DT_Q6_K>(w, n_in, n_out, nb1, x, n_tok, y, acc, stream);
	case MD_DT_Q4_1: return launch<MD_DT_Q4_1>(w, n_in, n_out, nb1, x, n_tok, y, acc, stream);
	case MD_DT_Q5_0: return launch<MD_DT_Q5_0>(w, n_in, n_out, nb1, x, n_tok, y, acc, stream);
	case MD_DT_Q5_1: return launch<MD_DT_Q5_1>(w, n_in, n_out, nb1, x, n_tok, y, acc, stream);
	case MD_DT_IQ4_NL: return launch<MD_DT_IQ4_NL>(w, n_in, n_out, nb1, x, n_tok, y, acc, stream);
	case MD_DT_IQ4_XS: return launch<MD_DT_IQ4_XS>(w, n_in, n_out, nb1, x, n_tok, y, acc, stream);
	case MD_DT_MXFP4: return launch<MD_DT_MXFP4>(w, n_in, n_out, nb1, x, n_tok, y, acc, stream);
	case MD_DT_Q2_K: return launch<MD_DT_Q2_K>(w, n_in, n_out, nb1, x, n_tok, y, acc, stream);
	case MD_DT_Q3_K: return launch<MD_DT_Q3_K>(w, n_in, n_out, nb1, x, n_tok, y, acc, stream);
	default: return cudaErrorInvalidValue;
	}
}

template <int TYPE>
static cudaError_t launch_multi(const mm_multi_args &m, int64_t n_in, size_t nb1, const float *x,
				int n_tok, cudaStream_t stream)
{
	const dim3 grid((unsigned)m.blk0[m.n], (unsigned)((n_tok + MM_NT - 1) / MM_NT));

	if (n_tok == 1)
		md_launch(mm_multi_kernel<TYPE, 1>, grid, MM_WARPS * 32, 0, stream, m, n_in, nb1,
			  x, n_tok);
	else
		md_launch(mm_multi_kernel<TYPE, MM_NT>, grid, MM_WARPS * 32, 0, stream, m, n_in,
			  nb1, x, n_tok);
	return cudaGetLastError();
}

extern "C" cudaError_t md_cuda__matmul_multi(int type, int n, const void *const *w,
					     const int64_t *n_out, float *const *y, int64_t n_in,
					     size_t nb1, const float *x, int n_tok,
					     cudaStream_t stream)
{
	mm_multi_args m;

	if (n < 1 || n > MD_CUDA_MM_MULTI || n_tok <= 0 || (n_tok + MM_NT - 1) / MM_NT > 65535)
		return cudaErrorInvalidValue;
	m.n = n;
	m.blk0[0] = 0;
	for (int i = 0; i < n; i++) {
		if (n_out[i] <= 0)
			return cudaErrorInvalidValue;
		m.w[i] = (const uint8_t *)w[i];
		m.y[i] = y[i];
		m.n_out[i] = n_out[i];
		m.blk0[i + 1] = m.blk0[i] + (n_out[i] + MM_WARPS - 1) / MM_WARPS;
	}
	if (m.blk0[n] > 0x7fffffff)
		return cudaErrorInvalidValue;
	switch (type) {
	case MD_DT_F32: return launch_multi<MD_DT_F32>(m, n_in, nb1, x, n_tok, stream);
	case MD_DT_F16: return launch_multi<MD_DT_F16>(m, n_in, nb1, x, n_tok, stream);
	case MD_DT_BF16: return launch_multi<MD_DT_BF16>(m, n_in, nb1, x, n_tok, stream);
	case MD_DT_Q8_0: return launch_multi<MD_DT_Q8_0>(m, n_in, nb1, x, n_tok, stream);
	case MD_DT_Q4_0: return launch_multi<MD_DT_Q4_0>(m, n_in, nb1, x, n_tok, stream);
	case MD_DT_Q4_K: return launch_multi<MD_DT_Q4_K>(m, n_in, nb1, x, n_tok, stream);
	case MD_DT_Q5_K: return launch_multi<MD_DT_Q5_K>(m, n_in, nb1, x, n_tok, stream);
	case MD_DT_Q6_K: return launch_multi<MD_DT_Q6_K>(m, n_in, nb1, x, n_tok, stream);
	case MD_DT_Q4_1: return launch_multi<MD_DT_Q4_1>(m, n_in, nb1, x, n_tok, stream);
	case MD_DT_Q5_0: return launch_multi<MD_DT_Q5_0>(m, n_in, nb1, x, n_tok, stream);
	case MD_DT_Q5_1: return launch_multi<MD_DT_Q5_1>(m, n_in, nb1, x, n_tok, stream);
	case MD_DT_IQ4_NL: return launch_multi<MD_DT_IQ4_NL>(m, n_in, nb1, x, n_tok, stream);
	case MD_DT_IQ4_XS: return launch_multi<MD_DT_IQ4_XS>(m, n_in, nb1, x, n_tok, stream);
	case MD_DT_MXFP4: return launch_multi<MD_DT_MXFP4>(m, n_in, nb1, x, n_tok, stream);
	case MD_DT_Q2_K: return launch_multi<MD_DT_Q2_K>(m, n_in, nb1, x, n_tok, stream);
	case MD_DT_Q3_K: return launch_multi<MD_DT_Q3_K>(m, n_in, nb1, x, n_tok, stream);
	default: return cudaErrorInvalidValue;
	}
}

extern "C" cudaError_t md_cuda__kernels_loadable(void)
{
	cudaFuncAttributes attr;

	return cudaFuncGetAttributes(&attr, mm_kernel<MD_DT_F32, MM_NT>);
}
