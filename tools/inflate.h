/* Inflate a model: rewrite a GGUF into a larger one that computes the same function. */
#ifndef MD_INFLATE_H
#define MD_INFLATE_H

/*
 * DESIGN
 * Benchmarks of memory-bound decoding need models as large as the ones users run, routing and
 * drafting like a trained model. Inflation makes one from a small trained model:
 *
 * - n_embd x A by duplication: the residual stream becomes [x, x, ..] (A copies), which keeps
 *   every RMSNorm exact without touching eps (the mean of squares is unchanged). Embedding
 *   rows and norm weights are copied A times; every matrix that writes the stream gets its
 *   rows copied A times; every matrix that reads it reads the first copy, [W, 0, .., 0]. The
 *   rejected alternatives: zero channels with norm weights scaled by sqrt(d_old/d_new) and eps
 *   by d_old/d_new is exact for the stream's norms but not for QK-norm, which shares the eps
 *   key and normalises over head_dim; reading all copies with weights W/A rounds (f16
 *   subnormals, requantized blocks) and moved logits by up to 1.2 at A = 8 in a test.
 * - heads x C by duplication: query and key/value heads are copied (C*H and C*K heads, the
 *   GQA group unchanged, so head h + j*H reads kv head kvh + j*K: a copy of its original), the
 *   output projection reads the first copy. Per-head and full QK-norm stay exact.
 * - FFN units x B by zero padding (expert, shared-expert and dense FFNs): extra gate/up rows
 *   and down columns are zero, and silu(0) * 0 adds nothing.
 *
 * Every weight keeps its values: kept in its type (row lengths a multiple of the block size),
 * a weight's blocks are copied byte for byte and the added ones are zero bytes (zero in every
 * GGML type), so an inflated Q4_K file holds the original's blocks. Converted to another type
 * (--type), weights are requantized like any quantization. A tied output (no output.weight)
 * is written untied: the embedding is copied whole, the output reads the first copy. What
 * remains is float rounding of longer sums (and of activation quantization on wider rows).
 */

#include <stddef.h>
#include <stdint.h>

struct md_inflate_opts {
	uint32_t embd_mult;   /* A >= 1 */
	uint32_t head_mult;   /* C >= 1 */
	uint32_t ff_mult;     /* B >= 1 */
	int32_t type;         /* enum md_dtype of every 2-D/3-D weight, or -1: keep each one's */
};

/* Read in_path, write the inflated model to out_path. Returns 0 or a negative code with one
 * line in err (unknown architecture, a tensor it does not know how to widen, a row length the
 * target type cannot hold, I/O). */
int md_inflate(const char *in_path, const char *out_path, const struct md_inflate_opts *o,
	       char *err, size_t errlen);

/* The "moed-gguf inflate" command: argv[0] is "inflate". Returns the process exit status. */
int md_inflate_main(int argc, char **argv);
#define MD_INFLATE_USAGE \
	"inflate   rewrite IN into a larger OUT that computes the same function (see\n" \
	"          tools/inflate.h): moed-gguf inflate [--embd N] [--heads N] [--ff N]\n" \
	"          [--type T] IN OUT; n_embd and heads are multiplied by copying (powers of\n" \
	"          two keep quantized weights exact), FFN units by zero padding [1 1 1];\n" \
	"          T: f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 q2_k q3_k q4_k q5_k q6_k iq4_nl\n" \
	"          iq4_xs mxfp4 for 2-D/3-D weights [keep]\n"

#endif
