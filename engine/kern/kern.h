/* CPU compute kernels behind one table, chosen at runtime by CPU features (see cpu.h). */
#ifndef MD_KERN_H
#define MD_KERN_H

#include <stddef.h>
#include <stdint.h>

#include "engine/quant.h"

/*
 * Activations are quantized on the fly, once per matmul input, into one of two block formats
 * (moed-internal layouts, never stored in files):
 *   md_q8b: 32 elements, x ~= d * qs, s = sum(qs)    (paired with the 32-element block
 *           types: q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, mxfp4)
 *   md_q8k: 256 elements, bsums[g] = sum of qs[16g .. 16g+15]   (paired with the 256-element
 *           super-block types: q2_K .. q6_K, iq4_xs)
 * qs are in [-127, 127] so u8 x s8 pair sums never saturate 16 bits.
 * A row of n elements in md_q8b is n/32 blocks followed by their n/32 scales d again as a
 * float array (md_q8b_scales), so a kernel can load the scales of 8 blocks at once.
 */
struct md_q8b {
	float d;
	int32_t s;
	int8_t qs[32];
};

struct md_q8k {
	float d;
	int16_t bsums[16];
	int8_t qs[256];
};

/* Largest number of activation rows one dot call handles (the register tile width). */
#define MD_KERN_NT 8

/* The float array of block scales after the n/32 md_q8b blocks of a row (see above). */
static inline const float *md_q8b_scales(const void *row, int64_t n)
{
	return (const float *)((const struct md_q8b *)row + n / 32);
}

/*
 * Tokens in lanes (optional, per type): up to MD_KERN_LANES activation rows are repacked once
 * per product (pack_q8b_lanes, into md_kern_lanes_size(n) bytes) so that one register holds
 * the same few elements of every token of the group; a lanes kernel then dots nr weight rows
 * (row r at w + r * w_stride) with such a group of nt tokens, writing y[t * y_stride + r].
 * Every output has the same bits as the table's dot gives that token, so a product may mix
 * both freely. A group pays from lanes_min tokens on (fewer: use dot). The packed layout is
 * the table's own (only its pack_q8b_lanes writes it, only its lanes kernels read it), in at
 * most md_kern_lanes_size(n) bytes. AVX2's: per token, each run of 8 blocks transposed so
 * that one register holds the same 4 elements of 8 blocks (kern_avx2.c, lanes_q8_0). AVX-512's:
 * the same with runs of 16 blocks, bytes offset by 128 (kern_avx2.c, lanes_s8_k).
 */
#define MD_KERN_LANES 8
#define MD_KERN_LANES_MIN 2 /* no table packs groups of fewer tokens (scratch sizing) */
typedef void (*md_lanes_fn)(int64_t n, const void *w, size_t w_stride, int nr, const void *p,
			    int nt, float *y, size_t y_stride);

/* Which activation format a weight type pairs with. */
enum md_act_fmt {
	MD_ACT_F32 = 0, /* float activations (f32, f16, bf16 weights) */
	MD_ACT_Q8B = 1,
	MD_ACT_Q8K = 2,
	MD_ACT_NONE = -1, /* no kernel: use the dequantizing reference path */
};

/*
 * Dot one weight row (n elements of the weight type) with nt <= MD_KERN_NT activation rows:
 * a points at row 0, row t at a + t * a_stride bytes (in the pairing format); writes
 * y[t * y_stride] for t < nt. n is a multiple of the weight block size. Every token's sum is
 * formed in the same order whatever nt is, nt == 1 included, so a token's result does not
 * depend on its group (batch invariance: speculation's verification and steps that requests
 * share give each token the bits it gets alone).
 */
typedef void (*md_dot_fn)(int64_t n, const void *w, const void *a, size_t a_stride, int nt,
			  float *y, size_t y_stride);

/*
 * Dot nr weight rows (row r at w + r * w_stride bytes) with nt activation rows (any counts,
 * laid out as for md_dot_fn): writes y[t * y_stride + r] for r < nr, t < nt. Register-tiled:
 * each weight chunk is converted once for several tokens and each activation chunk is loaded
 * once for several rows. An output has the same bits however rows and tokens are grouped,
 * and as the table's dot gives that token alone, nt == 1 (decode) included.
 */
typedef void (*md_gemm_fn)(int64_t n, const void *w, size_t w_stride, int nr, const void *a,
			   size_t a_stride, int nt, float *y, size_t y_stride);

struct md_kern {
	const char *name; /* "scalar", "avx2", "avx512" */
	md_dot_fn dot[MD_DT_COUNT]; /* NULL where the type has no kernel */
	md_gemm_fn gemm[MD_DT_COUNT]; /* NULL where the type has none: callers use dot */
	int gemm_nt; /* tokens per gemm register tile: up to this many, weights pass once */
	/* The type's dot prefetches its own row stream with one token (decode): with one token
	 * the caller leaves prefetching to it (matmul.c row_prefetch_on). */
	bool own_pf[MD_DT_COUNT];
	/* matmul.c fetches a decode row's lines a row ahead unless $MOED_ROW_PREFETCH says
	 * otherwise: on where measured to pay with these kernels (matmul.c row_prefetch_on). */
	bool row_pf;
	md_lanes_fn lanes[MD_DT_COUNT]; /* NULL where the type has none */
	int lanes_min;                  /* >= MD_KERN_LANES_MIN */
	void (*pack_q8b_lanes)(const void *a, size_t a_stride, int nt, int64_t n, void *dst);
	/* Quantize n floats (n multiple of 32 / 256) into blocks. */
	void (*quant_q8b)(const float *x, struct md_q8b *y, int64_t n);
	void (*quant_q8k)(const float *x, struct md_q8k *y, int64_t n);
	/* Float vector helpers for attention and norms. */
	float (*dot_f32)(const float *a, const float *b, int64_t n);
	void (*axpy_f32)(float *y, float a, const float *x, int64_t n); /* y += a * x */
	/* The same against IEEE half rows (latent attention's cached rows): a . b, y += a * x. */
	float (*dot_f32_f16)(const float *a, const uint16_t *b, int64_t n);
	void (*axpy_f16)(float *y, float a, const uint16_t *x, int64_t n);
	float (*sumsq_f32)(const float *x, int64_t n);                  /* in double-ish order */
	void (*scale_mul_f32)(float *y, const float *x, float s, const float *w, int64_t n); /* y = x*s*w */
};

/* Unpacks the 8 six-bit scales and mins of a q4_K / q5_K super-block (12 bytes at s). */
void md_kern__k_scales(const uint8_t *s, uint8_t sc[8], uint8_t m[8]);

/* Activation format paired with weight type t, or MD_ACT_NONE. */
enum md_act_fmt md_kern_act_fmt(enum md_dtype t);
/* Bytes of one activation row of n elements in format f. */
size_t md_kern_act_row_size(enum md_act_fmt f, int64_t n);
/* Bytes of one packed lanes group of n elements (md_q8b activations). */
size_t md_kern_lanes_size(int64_t n);

/* The kernel tables; avx2/avx512 are NULL when not compiled in (non-x86 builds). */
extern const struct md_kern md_kern_scalar;
const struct md_kern *md_kern_avx2_table(void);
const struct md_kern *md_kern_avx512_table(void);

#endif
