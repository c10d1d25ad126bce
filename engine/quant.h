/* Weight types: block layouts bit-compatible with GGML's, scalar reference kernels. */
#ifndef MD_QUANT_H
#define MD_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Type ids are GGML's (they are stored in GGUF tensor infos). */
enum md_dtype {
	MD_DT_F32 = 0,
	MD_DT_F16 = 1,
	MD_DT_Q4_0 = 2,
	MD_DT_Q4_1 = 3,
	MD_DT_Q5_0 = 6,
	MD_DT_Q5_1 = 7,
	MD_DT_Q8_0 = 8,
	MD_DT_Q8_1 = 9,
	MD_DT_Q2_K = 10,
	MD_DT_Q3_K = 11,
	MD_DT_Q4_K = 12,
	MD_DT_Q5_K = 13,
	MD_DT_Q6_K = 14,
	MD_DT_Q8_K = 15,
	MD_DT_IQ2_XXS = 16,
	MD_DT_IQ2_XS = 17,
	MD_DT_IQ3_XXS = 18,
	MD_DT_IQ1_S = 19,
	MD_DT_IQ4_NL = 20,
	MD_DT_IQ3_S = 21,
	MD_DT_IQ2_S = 22,
	MD_DT_IQ4_XS = 23,
	MD_DT_IQ1_M = 29,
	MD_DT_BF16 = 30,
	MD_DT_TQ1_0 = 34,
	MD_DT_TQ2_0 = 35,
	MD_DT_MXFP4 = 39,
	MD_DT_COUNT = 40, /* upper bound on ids we know the size of */
};

#define MD_QK8_0 32
#define MD_QK4_0 32
#define MD_QK_K 256

/* The 16 non-linear levels of iq4_nl and iq4_xs (GGML's kvalues_iq4nl). */
extern const int8_t md_iq4nl_levels[16];

/* mxfp4's 16 levels: the E2M1 values times two (GGML's kvalues_mxfp4). */
extern const int8_t md_mxfp4_levels[16];

/* An mxfp4 block's scale byte (E8M0) as the factor of the doubled levels: 2^(e - 128). */
float md_e8m0_half(uint8_t e);

struct md_dtype_info {
	const char *name;   /* "f32", "q4_K", ... as GGML names them */
	int64_t blck;       /* elements per block */
	size_t type_size;   /* bytes per block */
	bool supported;     /* has dequant + dot kernels in moed */
};

/* Returns NULL for an id GGML does not define (or that moed cannot size). The result may
 * have supported == false (known layout, no kernels): loaders must check. */
const struct md_dtype_info *md_dtype_info(uint32_t type);

/* Writes the names of the supported types, comma-separated ("f32, f16, ..."), into buf (always
 * NUL-terminated when len > 0); returns buf. For error messages. */
const char *md_dtype_supported_names(char *buf, size_t len);

/* Bytes taken by n elements of type t; n must be a multiple of the block size.
 * Returns 0 when n is not a multiple or the type is unknown. */
size_t md_dtype_row_size(enum md_dtype t, int64_t n);

/* Scalar F16 / BF16 conversion (IEEE half; BF16 rounds to nearest even, NaN kept). */
float md_f16_to_f32(uint16_t h);
uint16_t md_f32_to_f16(float f);
float md_bf16_to_f32(uint16_t h);
uint16_t md_f32_to_bf16(float f);

/* Dequantize n elements (n multiple of the block size) of a supported type into dst. */
void md_dequant_row(enum md_dtype t, const void *src, float *dst, int64_t n);

/* Quantize n elements of src into dst (for the tools); returns bytes written.
 * Supported targets: every type with supported == true. */
size_t md_quantize_row(enum md_dtype t, const float *src, void *dst, int64_t n);

/* Reference dot product of one weight row (n elements of type t) with float x.
 * Scalar, dequantizes block by block, accumulates in float per block and double overall. */
float md_vec_dot_ref(enum md_dtype t, const void *w_row, const float *x, int64_t n);

#endif
