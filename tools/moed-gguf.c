/* moed-gguf: inspect GGUF files, generate seeded random-weight models, and requantize. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <unistd.h>

#include "engine/gguf.h"
#include "engine/quant.h"
#include "tools/gguf_writer.h"
#include "tools/inflate.h"

/* llama.cpp's general.file_type values (enum llama_ftype). */
enum {
	FTYPE_F32 = 0,
	FTYPE_F16 = 1,
	FTYPE_Q4_0 = 2,
	FTYPE_Q4_1 = 3,
	FTYPE_Q8_0 = 7,
	FTYPE_Q5_0 = 8,
	FTYPE_Q5_1 = 9,
	FTYPE_Q2_K = 10,
	FTYPE_Q3_K_M = 12,
	FTYPE_Q4_K_M = 15,
	FTYPE_Q5_K_M = 17,
	FTYPE_Q6_K = 18,
	FTYPE_IQ4_NL = 25,
	FTYPE_IQ4_XS = 30,
	FTYPE_MXFP4_MOE = 38,
	FTYPE_BF16 = 32,
};

static void usage(FILE *f)
{
	fprintf(f,
"usage: moed-gguf info FILE\n"
"       moed-gguf gen [options] OUT\n"
"       moed-gguf quantize IN OUT MIX\n"
"\n"
"info      print version, alignment, every metadata key and the tensor table of FILE\n"
"\n"
"gen       write a seeded random-weight model (weights N(0,std), norms 1+N(0,0.1),\n"
"          biases N(0,std)); options (defaults in brackets):\n"
"  --arch A            qwen3moe|qwen2moe|llama|mixtral|olmoe|qwen2|qwen3|gpt-oss\n"
"                      |deepseek2|glm4moe [qwen3moe]\n"
"                      (mixtral = arch \"llama\" with experts; llama = dense)\n"
"  --type T            f32|f16|bf16|q8_0|q4_0|q4_1|q5_0|q5_1|q2_k|q3_k|q4_k|q5_k\n"
"                      |q6_k|iq4_nl|iq4_xs|mxfp4 for 2-D/3-D weights [f32];\n"
"                      1-D tensors are f32, the router f32 unless T is a float type;\n"
"                      K types need every row length to be a multiple of 256\n"
"  --seed N [1]  --n-layer N [2]  --n-embd N [64]  --n-head N [4]  --n-head-kv N [2]\n"
"  --head-dim N [16]  --n-ff N [128] (dense)  --n-expert N [4]  --n-expert-used N [2]\n"
"  --n-ff-exp N [64]  --n-ff-shexp N [128]  --n-vocab N [512]  --n-ctx N [4096]\n"
"  --rope-base F [1e6; 1e4 for llama, olmoe; 150000 for gpt-oss]  --rms-eps F [1e-6]\n"
"  --std F [0.02]  --exp-type T: type of the 3-D expert tensors [--type]\n"
"  --yarn-factor F    YaRN rope scaling [gpt-oss: 32; others 0: none]\n"
"  --yarn-orig-ctx N  its original context [gpt-oss: 4096; others: n-ctx / factor]\n"
"  gpt-oss: --sliding-window N [128] (attention sinks N(0,1), q/k/v/o, router and\n"
"                      expert biases)\n"
"  --tied              omit output.weight (not for qwen2moe, olmoe)\n"
"  --layout L          tensor layout as a writer of llama.cpp's world lays it out [moed]:\n"
"                      moed: merged expert tensors, 1-D shared-expert gate\n"
"                      converter: as convert_hf_to_gguf.py writes it: the shared-expert\n"
"                        gate 2-D [n_embd, 1] (of --vec-type), routers f32 at every type\n"
"                      split-experts: as the old convert.py wrote Mixtral: per-expert\n"
"                        2-D tensors blk.N.ffn_{gate,down,up}.E.weight, expert by expert\n"
"  --vec-type T        f32|f16|bf16: type of the 1-D tensors (norms, biases) and of the\n"
"                      shared-expert gate [f32]\n"
"  --bias              add q/k/v biases to an arch that has none (optional in llama.cpp)\n"
"  --tokenizer-gguf F  copy all tokenizer.* keys from F (n_vocab = its token count);\n"
"                      default: a synthetic byte-level \"gpt2\" vocabulary\n"
"  deepseek2 and glm4moe (names, shapes and keys as convert_hf_to_gguf.py writes them;\n"
"  --n-ff is the leading dense layers' width, the shared experts n-ff-exp each):\n"
"  --q-lora-rank N [32]  deepseek2: 0 = a plain attn_q (V2-Lite)\n"
"  --kv-lora-rank N [32] --v-head-dim N [head-dim]  deepseek2 (head-dim = qk_nope_head_dim)\n"
"  --rope-dim N        rotary dims [deepseek2: 8; glm4moe: head-dim / 2]\n"
"  --kv-b L            deepseek2: split (attn_k_b/attn_v_b, today's converter) | merged\n"
"                      (one attn_kv_b and the older head-size keys) [split]\n"
"  --n-dense-lead N [1]  --n-shared N [1]  --n-expert-groups N [0]  --n-group-used N [0]\n"
"  --gating G          softmax|sigmoid|none (none: key not written) [sigmoid]\n"
"  --no-probs-bias     no exp_probs_b (deepseek2 only; V2)\n"
"  --weights-scale F [2.5; 0: key not written]  --no-weights-norm\n"
"  --yarn-mscale-all F [1] (deepseek2 with --yarn-factor: written as yarn_log_multiplier\n"
"                      0.1 * F)\n"
"  --nextn N [0]       NextN/MTP layers appended after the n-layer (their tensors unused)\n"
"  --no-qk-norm        glm4moe without attn_q_norm/attn_k_norm (GLM-4.5-Air)\n"
"\n"
"quantize  requantize every 2-D/3-D weight of IN into OUT; 1-D tensors, ffn_gate_inp* and\n"
"          tensors whose name does not end in \"weight\" (biases) are kept as they are.\n"
"          MIX: f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 q2_k q3_k_m q4_k_m q5_k_m q6_k\n"
"          iq4_nl iq4_xs mxfp4_moe\n"
"          mxfp4_moe: mxfp4 for the 3-D expert tensors, q8_0 for every other weight and\n"
"          for output.weight (gpt-oss's MXFP4_MOE files);\n"
"          q2_k: q2_K, with q3_K for ffn_down* and attn_output (q5_K with 8 experts), attn_v\n"
"          q4_K when head_count >= 4 * head_count_kv else q3_K (q8_0 with 8 experts);\n"
"          q3_k_m: q3_K, with q4_K for ffn_down* (q5_K in the first n_layer/16 layers) and\n"
"          attn_output (q5_K with 8 experts), attn_v q5_K in layers 0-1 else q4_K;\n"
"          iq4_nl/iq4_xs: that type, with q5_K for attn_v when head_count >=\n"
"          4 * head_count_kv, for ffn_down* in the first n_layer/8 layers and (8 experts)\n"
"          for attn_output;\n"
"          every mix: attn_v and attn_k q8_0 with exactly 8 experts;\n"
"          q4_k_m/q5_k_m: q4_K/q5_K, with q6_K for output.weight and for attn_v and\n"
"          ffn_down* in the first and last n_layer/8 layers and every third between\n"
"          (llama.cpp's use_more_bits); q4_0/q4_1/q5_0/q5_1: q6_K for output.weight.\n"
"          Fallbacks as llama-quantize's: a tensor whose ne[0] is not a multiple of 256\n"
"          gets q5_0 for q4_K, q5_1 for q5_K, q8_0 for q6_K, q4_0 for q2_K/q3_K, iq4_nl\n"
"          for iq4_xs; f16 where ne[0] is not even a multiple of 32.\n"
"\n"
MD_INFLATE_USAGE);
}

/* ---------------------------------------------------------------- small helpers */

static const char *dtype_name(uint32_t t)
{
	const struct md_dtype_info *ti = md_dtype_info(t);
	return ti ? ti->name : "?";
}

static bool is_quantized(uint32_t t)
{
	return t != MD_DT_F32 && t != MD_DT_F16 && t != MD_DT_BF16;
}

/* The type llama-quantize writes instead of a 256-block type for rows that are not a
 * multiple of 256 (tensor_type_fallback in llama.cpp 34af94cd; older versions gave iq4_nl
 * for q2_K/q3_K); t itself for other types. */
static uint32_t k_fallback(uint32_t t)
{
	switch (t) {
	case MD_DT_Q4_K: return MD_DT_Q5_0;
	case MD_DT_Q5_K: return MD_DT_Q5_1;
	case MD_DT_Q6_K: return MD_DT_Q8_0;
	case MD_DT_Q2_K:
	case MD_DT_Q3_K: return MD_DT_Q4_0;
	case MD_DT_IQ4_XS: return MD_DT_IQ4_NL;
	default: return t;
	}
}

static void print_escaped(const char *s, size_t n, size_t max)
{
	putchar('"');
	for (size_t i = 0; i < n && i < max; i++) {
		unsigned char c = (unsigned char)s[i];
		if (c == '"' || c == '\\')
			printf("\\%c", c);
		else if (c == '\n')
			fputs("\\n", stdout);
		else if (c == '\t')
			fputs("\\t", stdout);
		else if (c < 0x20 || c == 0x7f)
			printf("\\x%02x", c);
		else
			putchar(c);
	}
	putchar('"');
	if (n > max)
		printf("... (%zu bytes)", n);
}

static size_t vsize(uint32_t t)
{
	switch (t) {
	case MD_GGUF_UINT8: case MD_GGUF_INT8: case MD_GGUF_BOOL: return 1;
	case MD_GGUF_UINT16: case MD_GGUF_INT16: return 2;
	case MD_GGUF_UINT32: case MD_GGUF_INT32: case MD_GGUF_FLOAT32: return 4;
	case MD_GGUF_UINT64: case MD_GGUF_INT64: case MD_GGUF_FLOAT64: return 8;
	default: return 0;
	}
}

/* Print one fixed-size value stored little-endian at p. */
static void print_num(uint32_t t, const uint8_t *p)
{
	union { uint8_t u8; int8_t i8; uint16_t u16; int16_t i16; uint32_t u32; int32_t i32;
		float f32; uint64_t u64; int64_t i64; double f64; } v;
	memcpy(&v, p, vsize(t));
	switch (t) {
	case MD_GGUF_UINT8: printf("%u", v.u8); break;
	case MD_GGUF_INT8: printf("%d", v.i8); break;
	case MD_GGUF_UINT16: printf("%u", v.u16); break;
	case MD_GGUF_INT16: printf("%d", v.i16); break;
	case MD_GGUF_UINT32: printf("%" PRIu32, v.u32); break;
	case MD_GGUF_INT32: printf("%" PRId32, v.i32); break;
	case MD_GGUF_FLOAT32: printf("%.9g", v.f32); break;
	case MD_GGUF_BOOL: fputs(v.u8 ? "true" : "false", stdout); break;
	case MD_GGUF_UINT64: printf("%" PRIu64, v.u64); break;
	case MD_GGUF_INT64: printf("%" PRId64, v.i64); break;
	case MD_GGUF_FLOAT64: printf("%.17g", v.f64); break;
	default: fputs("?", stdout);
	}
}

static void fmt_shape(char *buf, size_t len, const int64_t *ne, uint32_t n_dims)
{
	size_t o = 0;
	o += (size_t)snprintf(buf + o, len - o, "[");
	for (uint32_t d = 0; d < n_dims && o < len; d++)
		o += (size_t)snprintf(buf + o, len - o, "%s%" PRId64, d ? ", " : "", ne[d]);
	if (o < len)
		snprintf(buf + o, len - o, "]");
}

static double gib(uint64_t b)
{
	return (double)b / (1024.0 * 1024.0 * 1024.0);
}

/* ---------------------------------------------------------------- info */

static int cmd_info(const char *path)
{
	struct md_gguf g;
	char err[512];
	int rc = md_gguf_open(&g, path, err, sizeof(err));
	if (rc) {
		fprintf(stderr, "moed-gguf: %s\n", err);
		return 1;
	}
	printf("%s: GGUF v%" PRIu32 ", alignment %" PRIu64 ", %" PRIu64 " keys, %" PRIu64
	       " tensors, data at offset %" PRIu64 ", file %zu bytes\n",
	       path, g.version, g.alignment, g.n_kv, g.n_tensors, g.data_offset, g.size);

	printf("\nmetadata:\n");
	for (uint64_t i = 0; i < g.n_kv; i++) {
		const struct md_gguf_kv *kv = &g.kv[i];
		printf("  %-44.*s ", (int)kv->key.len, kv->key.ptr);
		if (kv->type == MD_GGUF_STRING) {
			char key[256];
			struct md_gguf_str s = { 0 };
			snprintf(key, sizeof(key), "%.*s", (int)kv->key.len, kv->key.ptr);
			printf("string ");
			if (md_gguf_get_str(&g, key, &s))
				print_escaped(s.ptr, s.len, 80);
		} else if (kv->type == MD_GGUF_ARRAY) {
			printf("[%s x %" PRIu64 "]", md_gguf_vtype_name(kv->arr_type), kv->arr_n);
			uint64_t show = kv->arr_type == MD_GGUF_STRING ? 4 : 8;
			for (uint64_t j = 0; j < kv->arr_n && j < show; j++) {
				fputs(j ? ", " : " ", stdout);
				if (kv->arr_type == MD_GGUF_STRING) {
					struct md_gguf_str s = { 0 };
					if (md_gguf_arr_str(kv, j, &s))
						print_escaped(s.ptr, s.len, 40);
				} else if (vsize(kv->arr_type)) {
					print_num(kv->arr_type, kv->data + j * vsize(kv->arr_type));
				}
			}
			if (kv->arr_n > show)
				fputs(", ...", stdout);
		} else {
			printf("%s ", md_gguf_vtype_name(kv->type));
			print_num(kv->type, kv->data);
		}
		putchar('\n');
	}

	uint32_t ftype = UINT32_MAX;
	md_gguf_get_u32(&g, "general.file_type", &ftype);
	bool k_mix = (ftype >= 10 && ftype <= 18) || ftype == 30;

	printf("\ntensors:\n  %5s  %-36s %-6s %-22s %14s %14s\n", "#", "name", "type", "shape",
	       "bytes", "offset");
	uint64_t tot_params = 0, tot_bytes = 0, n_fallback = 0;
	uint64_t per_n[MD_DT_COUNT] = { 0 }, per_params[MD_DT_COUNT] = { 0 },
		 per_bytes[MD_DT_COUNT] = { 0 };
	for (uint64_t i = 0; i < g.n_tensors; i++) {
		const struct md_gguf_tensor *t = &g.tensors[i];
		char shape[96];
		uint64_t n = 1;
		for (int d = 0; d < MD_GGUF_MAX_DIMS; d++)
			n *= (uint64_t)t->ne[d];
		fmt_shape(shape, sizeof(shape), t->ne, t->n_dims);
		printf("  %5" PRIu64 "  %-36.*s %-6s %-22s %14" PRIu64 " %14" PRIu64 "\n", i,
		       (int)t->name.len, t->name.ptr, dtype_name(t->type), shape, t->nbytes,
		       t->offset);
		tot_params += n;
		tot_bytes += t->nbytes;
		if (t->type < MD_DT_COUNT) {
			per_n[t->type]++;
			per_params[t->type] += n;
			per_bytes[t->type] += t->nbytes;
		}
		if (k_mix && t->n_dims >= 2 && t->ne[0] % MD_QK_K != 0 &&
		    md_dtype_info(t->type) && md_dtype_info(t->type)->blck == 32)
			n_fallback++;
	}
	printf("\ntotal: %" PRIu64 " parameters (%.4g B), %" PRIu64 " bytes (%.3f GiB), %.3f "
	       "bits/weight\n", tot_params, (double)tot_params / 1e9, tot_bytes, gib(tot_bytes),
	       tot_params ? 8.0 * (double)tot_bytes / (double)tot_params : 0.0);
	for (uint32_t t = 0; t < MD_DT_COUNT; t++) {
		if (!per_n[t])
			continue;
		printf("  %-6s %5" PRIu64 " tensors %14" PRIu64 " parameters %14" PRIu64
		       " bytes\n", dtype_name(t), per_n[t], per_params[t], per_bytes[t]);
	}
	if (n_fallback)
		printf("note: %" PRIu64 " tensor(s) whose ne[0] is not a multiple of 256 have a "
		       "32-element block type (K-quant fallback)\n", n_fallback);
	md_gguf_close(&g);
	return 0;
}

/* ---------------------------------------------------------------- PRNG */

/* xoshiro256** seeded through splitmix64; Box-Muller for normals (both values used). */
struct rng {
	uint64_t s[4];
	double spare;
	bool has_spare;
};

static uint64_t splitmix64(uint64_t *x)
{
	uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

static void rng_seed(struct rng *r, uint64_t seed)
{
	for (int i = 0; i < 4; i++)
		r->s[i] = splitmix64(&seed);
	r->spare = 0.0;
	r->has_spare = false;
}

static inline uint64_t rotl(uint64_t x, int k)
{
	return (x << k) | (x >> (64 - k));
}

static inline uint64_t rng_next(struct rng *r)
{
	uint64_t *s = r->s;
	uint64_t out = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
	s[2] ^= s[0];
	s[3] ^= s[1];
	s[1] ^= s[2];
	s[0] ^= s[3];
	s[2] ^= t;
	s[3] = rotl(s[3], 45);
	return out;
}

static inline double rng_normal(struct rng *r)
{
	if (r->has_spare) {
		r->has_spare = false;
		return r->spare;
	}
	/* u1 in (0, 1] so log() is finite; u2 in [0, 1). */
	double u1 = (double)((rng_next(r) >> 11) + 1) * 0x1.0p-53;
	double u2 = (double)(rng_next(r) >> 11) * 0x1.0p-53;
	double rad = sqrt(-2.0 * log(u1)), th = 6.283185307179586 * u2;
	r->spare = rad * sin(th);
	r->has_spare = true;
	return rad * cos(th);
}

static uint64_t fnv1a(const char *s)
{
	uint64_t h = 0xcbf29ce484222325ULL;
	for (; *s; s++)
		h = (h ^ (uint8_t)*s) * 0x100000001b3ULL;
	return h;
}

/* ---------------------------------------------------------------- gen */

enum qk_norm { QK_NONE, QK_HEAD, QK_FULL };

struct arch_def {
	const char *opt;   /* --arch value */
	const char *name;  /* general.architecture */
	bool moe, shexp, bias, always_output;
	enum qk_norm qk;
	bool exp_ff_key;   /* expert width in ARCH.expert_feed_forward_length (qwen*moe) */
	double rope_base;
	bool oss;          /* gpt-oss: sinks, biases, post_attention_norm, sliding window, YaRN */
};

static const struct arch_def archs[] = {
	{ "qwen3moe", "qwen3moe", true, false, false, false, QK_HEAD, true, 1e6, false },
	{ "qwen2moe", "qwen2moe", true, true, true, true, QK_NONE, true, 1e6, false },
	{ "llama", "llama", false, false, false, false, QK_NONE, false, 1e4, false },
	{ "mixtral", "llama", true, false, false, false, QK_NONE, false, 1e6, false },
	{ "olmoe", "olmoe", true, false, false, true, QK_FULL, false, 1e4, false },
	{ "qwen2", "qwen2", false, false, true, false, QK_NONE, false, 1e6, false },
	{ "qwen3", "qwen3", false, false, false, false, QK_HEAD, false, 1e6, false },
	{ "gpt-oss", "gpt-oss", true, false, true, true, QK_NONE, true, 150000, true },
	/* deepseek2 and glm4moe have their own tensor lists (build_deepseek2, build_glm4moe) */
	{ "deepseek2", "deepseek2", true, false, false, false, QK_NONE, true, 1e4, false },
	{ "glm4moe", "glm4moe", true, false, true, false, QK_HEAD, true, 1e6, false },
};

struct wtype_def {
	const char *name;
	uint32_t type;
	uint32_t ftype;
};

static const struct wtype_def gen_types[] = {
	{ "f32", MD_DT_F32, FTYPE_F32 },     { "f16", MD_DT_F16, FTYPE_F16 },
	{ "bf16", MD_DT_BF16, FTYPE_BF16 },  { "q8_0", MD_DT_Q8_0, FTYPE_Q8_0 },
	{ "q4_0", MD_DT_Q4_0, FTYPE_Q4_0 },  { "q4_1", MD_DT_Q4_1, FTYPE_Q4_1 },
	{ "q5_0", MD_DT_Q5_0, FTYPE_Q5_0 },  { "q5_1", MD_DT_Q5_1, FTYPE_Q5_1 },
	{ "q2_k", MD_DT_Q2_K, FTYPE_Q2_K },  { "q3_k", MD_DT_Q3_K, FTYPE_Q3_K_M },
	{ "q4_k", MD_DT_Q4_K, FTYPE_Q4_K_M },
	{ "q5_k", MD_DT_Q5_K, FTYPE_Q5_K_M }, { "q6_k", MD_DT_Q6_K, FTYPE_Q6_K },
	{ "iq4_nl", MD_DT_IQ4_NL, FTYPE_IQ4_NL }, { "iq4_xs", MD_DT_IQ4_XS, FTYPE_IQ4_XS },
	{ "mxfp4", MD_DT_MXFP4, FTYPE_MXFP4_MOE },
};

enum init_kind { INIT_WEIGHT, INIT_NORM, INIT_BIAS, INIT_SINK };

struct gen_tensor {
	char name[64];
	uint32_t type;
	uint32_t n_dims;
	int64_t ne[3];
	enum init_kind kind;
	float std;
	uint64_t seed;     /* per tensor: seed mixed with the name's hash */
	size_t idx, total; /* for progress output */
};

static int gen_fill(void *vctx, void *dst, size_t nbytes)
{
	struct gen_tensor *t = vctx;
	int64_t n0 = t->ne[0], rows = 1;
	for (uint32_t d = 1; d < t->n_dims; d++)
		rows *= t->ne[d];
	size_t row_bytes = md_dtype_row_size((enum md_dtype)t->type, n0);
	if (row_bytes * (size_t)rows != nbytes)
		return -EINVAL;
	float *row = malloc((size_t)n0 * sizeof(float));
	if (!row)
		return -ENOMEM;
	fprintf(stderr, "[%4zu/%4zu] %-32s %s\n", t->idx + 1, t->total, t->name,
		dtype_name(t->type));
	struct rng r;
	rng_seed(&r, t->seed);
	uint8_t *out = dst;
	for (int64_t i = 0; i < rows; i++) {
		for (int64_t j = 0; j < n0; j++) {
			double z = rng_normal(&r);
			row[j] = t->kind == INIT_NORM ? (float)(1.0 + 0.1 * z)
				 : t->kind == INIT_SINK ? (float)z : (float)(t->std * z);
		}
		md_quantize_row((enum md_dtype)t->type, row, out, n0);
		out += row_bytes;
	}
	free(row);
	return 0;
}

struct gen_opts {
	const struct arch_def *arch;
	const struct wtype_def *wt;
	uint64_t seed;
	uint32_t n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff;
	uint32_t n_expert, n_expert_used, n_ff_exp, n_ff_shexp, n_vocab, n_ctx;
	double rope_base, rms_eps, std;
	bool rope_base_set, tied, bias;
	const struct wtype_def *exp_wt; /* type of the 3-D expert tensors (NULL: wt) */
	uint32_t n_swa;                 /* gpt-oss sliding window */
	double yarn_factor;             /* YaRN factor (0 or 1: none; < 0: the arch's default) */
	uint32_t yarn_orig_ctx;         /* UINT32_MAX: the arch's default */
	enum { LAYOUT_MOED, LAYOUT_CONVERTER, LAYOUT_SPLIT } layout;
	uint32_t vec_type;  /* type of 1-D tensors */
	const char *tokenizer;
	const char *out;
	/* deepseek2 / glm4moe */
	uint32_t q_lora_rank, kv_lora_rank, v_head_dim, rope_dim, n_dense_lead, n_shared;
	uint32_t n_expert_groups, n_group_used, nextn;
	int gating;         /* 0: key not written, 1 softmax, 2 sigmoid */
	bool kv_b_merged, no_probs_bias, no_weights_norm, no_qk_norm;
	double weights_scale, yarn_mscale_all;
};

struct gen_list {
	struct gen_tensor *v; /* owned */
	size_t n, cap;
};

static struct gen_tensor *add_tensor(struct gen_list *l, const struct gen_opts *o,
				     const char *name, enum init_kind kind, uint32_t n_dims,
				     int64_t ne0, int64_t ne1, int64_t ne2)
{
	if (l->n == l->cap) {
		l->cap = l->cap ? l->cap * 2 : 256;
		l->v = realloc(l->v, l->cap * sizeof(*l->v));
		if (!l->v) {
			fprintf(stderr, "moed-gguf: out of memory\n");
			exit(1);
		}
	}
	struct gen_tensor *t = &l->v[l->n++];
	memset(t, 0, sizeof(*t));
	snprintf(t->name, sizeof(t->name), "%s", name);
	t->n_dims = n_dims;
	t->ne[0] = ne0;
	t->ne[1] = ne1;
	t->ne[2] = ne2;
	t->kind = kind;
	t->std = (float)o->std;
	t->seed = o->seed ^ fnv1a(name);
	/* The shared-expert gate is a vector whatever its layout (2-D [n_embd, 1] from the
	 * converter); today's converter keeps it and the router f32, older ones wrote it in the
	 * file's float type: --vec-type picks. */
	size_t nl = strlen(name);
	bool bias = nl > 5 && strcmp(name + nl - 5, ".bias") == 0;
	if (n_dims == 1 || strstr(name, "ffn_gate_inp_shexp") || bias)
		t->type = bias && n_dims > 1 ? MD_DT_F32 : o->vec_type; /* the converter: biases f32 */
	else if (n_dims == 3 && o->exp_wt)
		t->type = o->exp_wt->type;
	else if (strstr(name, "ffn_gate_inp") &&
		 (is_quantized(o->wt->type) || o->layout == LAYOUT_CONVERTER || o->arch->oss))
		t->type = MD_DT_F32;
	else
		t->type = o->wt->type;
	return t;
}

static void add_blk(struct gen_list *l, const struct gen_opts *o, uint32_t i, const char *what,
		    enum init_kind kind, uint32_t n_dims, int64_t ne0, int64_t ne1, int64_t ne2)
{
	char name[64];
	snprintf(name, sizeof(name), "blk.%u.%s", i, what);
	add_tensor(l, o, name, kind, n_dims, ne0, ne1, ne2);
}

static bool is_arch(const struct gen_opts *o, const char *name)
{
	return strcmp(o->arch->name, name) == 0;
}

/* The routed and shared experts of an MoE layer of deepseek2 / glm4moe, or its dense FFN. */
static void add_ffn_ds(struct gen_list *l, const struct gen_opts *o, uint32_t i)
{
	int64_t N = o->n_embd, E = o->n_expert, F = o->n_ff_exp, FF = o->n_ff;
	int64_t S = (int64_t)o->n_ff_exp * o->n_shared;
	if (i < o->n_dense_lead) {
		add_blk(l, o, i, "ffn_gate.weight", INIT_WEIGHT, 2, N, FF, 1);
		add_blk(l, o, i, "ffn_down.weight", INIT_WEIGHT, 2, FF, N, 1);
		add_blk(l, o, i, "ffn_up.weight", INIT_WEIGHT, 2, N, FF, 1);
		return;
	}
	add_blk(l, o, i, "ffn_gate_inp.weight", INIT_WEIGHT, 2, N, E, 1);
	if (!o->no_probs_bias)
		add_blk(l, o, i, "exp_probs_b.bias", INIT_BIAS, 1, E, 1, 1);
	add_blk(l, o, i, "ffn_down_exps.weight", INIT_WEIGHT, 3, F, N, E);
	add_blk(l, o, i, "ffn_gate_exps.weight", INIT_WEIGHT, 3, N, F, E);
	add_blk(l, o, i, "ffn_up_exps.weight", INIT_WEIGHT, 3, N, F, E);
	if (S) {
		add_blk(l, o, i, "ffn_gate_shexp.weight", INIT_WEIGHT, 2, N, S, 1);
		add_blk(l, o, i, "ffn_down_shexp.weight", INIT_WEIGHT, 2, S, N, 1);
		add_blk(l, o, i, "ffn_up_shexp.weight", INIT_WEIGHT, 2, N, S, 1);
	}
}

/* A NextN/MTP layer's own tensors (after its ordinary layer tensors). */
static void add_nextn(struct gen_list *l, const struct gen_opts *o, uint32_t i)
{
	int64_t N = o->n_embd;
	add_blk(l, o, i, "nextn.eh_proj.weight", INIT_WEIGHT, 2, 2 * N, N, 1);
	add_blk(l, o, i, "nextn.enorm.weight", INIT_NORM, 1, N, 1, 1);
	add_blk(l, o, i, "nextn.hnorm.weight", INIT_NORM, 1, N, 1, 1);
	add_blk(l, o, i, "nextn.shared_head_norm.weight", INIT_NORM, 1, N, 1, 1);
}

/* deepseek2 as DeepseekV2Model.modify_tensors writes it: latent attention, then the FFN. */
static void build_deepseek2(struct gen_list *l, const struct gen_opts *o)
{
	int64_t N = o->n_embd, H = o->n_head, Dn = o->head_dim, R = o->rope_dim;
	int64_t Dv = o->v_head_dim, C = o->kv_lora_rank, QL = o->q_lora_rank;
	for (uint32_t i = 0; i < o->n_layer + o->nextn; i++) {
		add_blk(l, o, i, "attn_norm.weight", INIT_NORM, 1, N, 1, 1);
		if (QL)
			add_blk(l, o, i, "attn_q_a_norm.weight", INIT_NORM, 1, QL, 1, 1);
		add_blk(l, o, i, "attn_kv_a_norm.weight", INIT_NORM, 1, C, 1, 1);
		if (QL) {
			add_blk(l, o, i, "attn_q_a.weight", INIT_WEIGHT, 2, N, QL, 1);
			add_blk(l, o, i, "attn_q_b.weight", INIT_WEIGHT, 2, QL, H * (Dn + R), 1);
		} else {
			add_blk(l, o, i, "attn_q.weight", INIT_WEIGHT, 2, N, H * (Dn + R), 1);
		}
		add_blk(l, o, i, "attn_kv_a_mqa.weight", INIT_WEIGHT, 2, N, C + R, 1);
		if (o->kv_b_merged) {
			add_blk(l, o, i, "attn_kv_b.weight", INIT_WEIGHT, 2, C, H * (Dn + Dv), 1);
		} else {
			add_blk(l, o, i, "attn_k_b.weight", INIT_WEIGHT, 3, Dn, C, H);
			add_blk(l, o, i, "attn_v_b.weight", INIT_WEIGHT, 3, C, Dv, H);
		}
		add_blk(l, o, i, "attn_output.weight", INIT_WEIGHT, 2, H * Dv, N, 1);
		add_blk(l, o, i, "ffn_norm.weight", INIT_NORM, 1, N, 1, 1);
		add_ffn_ds(l, o, i);
		if (i >= o->n_layer)
			add_nextn(l, o, i);
	}
}

/* glm4moe as Glm4MoeModel writes it: biased q/k/v, optional per-head QK-norm,
 * post_attention_norm before the FFN, NextN layers at the end. */
static void build_glm4moe(struct gen_list *l, const struct gen_opts *o)
{
	int64_t N = o->n_embd, D = o->head_dim;
	int64_t QD = (int64_t)o->n_head * D, KD = (int64_t)o->n_head_kv * D;
	for (uint32_t i = 0; i < o->n_layer + o->nextn; i++) {
		add_blk(l, o, i, "attn_norm.weight", INIT_NORM, 1, N, 1, 1);
		add_blk(l, o, i, "attn_q.weight", INIT_WEIGHT, 2, N, QD, 1);
		add_blk(l, o, i, "attn_q.bias", INIT_BIAS, 1, QD, 1, 1);
		add_blk(l, o, i, "attn_k.weight", INIT_WEIGHT, 2, N, KD, 1);
		add_blk(l, o, i, "attn_k.bias", INIT_BIAS, 1, KD, 1, 1);
		add_blk(l, o, i, "attn_v.weight", INIT_WEIGHT, 2, N, KD, 1);
		add_blk(l, o, i, "attn_v.bias", INIT_BIAS, 1, KD, 1, 1);
		add_blk(l, o, i, "attn_output.weight", INIT_WEIGHT, 2, QD, N, 1);
		if (!o->no_qk_norm) {
			add_blk(l, o, i, "attn_q_norm.weight", INIT_NORM, 1, D, 1, 1);
			add_blk(l, o, i, "attn_k_norm.weight", INIT_NORM, 1, D, 1, 1);
		}
		add_blk(l, o, i, "post_attention_norm.weight", INIT_NORM, 1, N, 1, 1);
		add_ffn_ds(l, o, i);
		if (i >= o->n_layer)
			add_nextn(l, o, i);
	}
}

static void build_tensors(struct gen_list *l, const struct gen_opts *o)
{
	const struct arch_def *a = o->arch;
	int64_t N = o->n_embd, V = o->n_vocab, D = o->head_dim;
	int64_t QD = (int64_t)o->n_head * D, KD = (int64_t)o->n_head_kv * D;
	int64_t E = o->n_expert, F = o->n_ff_exp, S = o->n_ff_shexp, FF = o->n_ff;

	add_tensor(l, o, "token_embd.weight", INIT_WEIGHT, 2, N, V, 1);
	bool own = is_arch(o, "deepseek2") || is_arch(o, "glm4moe"); /* their own tensor lists */
	if (is_arch(o, "deepseek2"))
		build_deepseek2(l, o);
	else if (is_arch(o, "glm4moe"))
		build_glm4moe(l, o);
	for (uint32_t i = 0; i < o->n_layer && !own; i++) {
		add_blk(l, o, i, "attn_norm.weight", INIT_NORM, 1, N, 1, 1);
		add_blk(l, o, i, "attn_q.weight", INIT_WEIGHT, 2, N, QD, 1);
		add_blk(l, o, i, "attn_k.weight", INIT_WEIGHT, 2, N, KD, 1);
		add_blk(l, o, i, "attn_v.weight", INIT_WEIGHT, 2, N, KD, 1);
		if (a->bias || o->bias) {
			add_blk(l, o, i, "attn_q.bias", INIT_BIAS, 1, QD, 1, 1);
			add_blk(l, o, i, "attn_k.bias", INIT_BIAS, 1, KD, 1, 1);
			add_blk(l, o, i, "attn_v.bias", INIT_BIAS, 1, KD, 1, 1);
		}
		if (a->oss) {
			add_blk(l, o, i, "attn_output.bias", INIT_BIAS, 1, N, 1, 1);
			add_blk(l, o, i, "attn_sinks.weight", INIT_SINK, 1, o->n_head, 1, 1);
		}
		if (a->qk == QK_HEAD) {
			add_blk(l, o, i, "attn_q_norm.weight", INIT_NORM, 1, D, 1, 1);
			add_blk(l, o, i, "attn_k_norm.weight", INIT_NORM, 1, D, 1, 1);
		} else if (a->qk == QK_FULL) {
			add_blk(l, o, i, "attn_q_norm.weight", INIT_NORM, 1, QD, 1, 1);
			add_blk(l, o, i, "attn_k_norm.weight", INIT_NORM, 1, KD, 1, 1);
		}
		add_blk(l, o, i, "attn_output.weight", INIT_WEIGHT, 2, QD, N, 1);
		add_blk(l, o, i, a->oss ? "post_attention_norm.weight" : "ffn_norm.weight", INIT_NORM, 1,
			N, 1, 1);
		if (a->moe) {
			add_blk(l, o, i, "ffn_gate_inp.weight", INIT_WEIGHT, 2, N, E, 1);
			if (o->layout == LAYOUT_SPLIT) {
				for (int64_t e = 0; e < E; e++) {
					char nm[48];
					snprintf(nm, sizeof(nm), "ffn_gate.%" PRId64 ".weight", e);
					add_blk(l, o, i, nm, INIT_WEIGHT, 2, N, F, 1);
					snprintf(nm, sizeof(nm), "ffn_down.%" PRId64 ".weight", e);
					add_blk(l, o, i, nm, INIT_WEIGHT, 2, F, N, 1);
					snprintf(nm, sizeof(nm), "ffn_up.%" PRId64 ".weight", e);
					add_blk(l, o, i, nm, INIT_WEIGHT, 2, N, F, 1);
				}
			} else {
				add_blk(l, o, i, "ffn_gate_exps.weight", INIT_WEIGHT, 3, N, F, E);
				add_blk(l, o, i, "ffn_up_exps.weight", INIT_WEIGHT, 3, N, F, E);
				add_blk(l, o, i, "ffn_down_exps.weight", INIT_WEIGHT, 3, F, N, E);
			}
			if (a->oss) {
				add_blk(l, o, i, "ffn_gate_inp.bias", INIT_BIAS, 1, E, 1, 1);
				add_blk(l, o, i, "ffn_gate_exps.bias", INIT_BIAS, 2, F, E, 1);
				add_blk(l, o, i, "ffn_up_exps.bias", INIT_BIAS, 2, F, E, 1);
				add_blk(l, o, i, "ffn_down_exps.bias", INIT_BIAS, 2, N, E, 1);
			}
			if (a->shexp && o->layout == LAYOUT_CONVERTER) {
				add_blk(l, o, i, "ffn_gate_inp_shexp.weight", INIT_WEIGHT, 2, N, 1, 1);
			} else if (a->shexp) {
				add_blk(l, o, i, "ffn_gate_inp_shexp.weight", INIT_WEIGHT, 1, N, 1, 1);
			}
			if (a->shexp) {
				add_blk(l, o, i, "ffn_gate_shexp.weight", INIT_WEIGHT, 2, N, S, 1);
				add_blk(l, o, i, "ffn_up_shexp.weight", INIT_WEIGHT, 2, N, S, 1);
				add_blk(l, o, i, "ffn_down_shexp.weight", INIT_WEIGHT, 2, S, N, 1);
			}
		} else {
			add_blk(l, o, i, "ffn_gate.weight", INIT_WEIGHT, 2, N, FF, 1);
			add_blk(l, o, i, "ffn_up.weight", INIT_WEIGHT, 2, N, FF, 1);
			add_blk(l, o, i, "ffn_down.weight", INIT_WEIGHT, 2, FF, N, 1);
		}
	}
	add_tensor(l, o, "output_norm.weight", INIT_NORM, 1, N, 1, 1);
	if (!o->tied || a->always_output)
		add_tensor(l, o, "output.weight", INIT_WEIGHT, 2, N, V, 1);
	for (size_t k = 0; k < l->n; k++) {
		l->v[k].idx = k;
		l->v[k].total = l->n;
	}
}

/* GPT-2's byte-to-unicode table: printable Latin-1 bytes map to themselves, the rest to
 * U+0100 upwards in byte order. Token i (i < 256) is the symbol of byte order[i], with the
 * printable bytes first as in GPT-2's vocabulary. */
static int byte_symbols(char sym[256][4])
{
	int n = 0, extra = 0;
	uint32_t cp[256];
	for (int b = 0; b < 256; b++)
		if ((b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff))
			cp[n++] = (uint32_t)b;
	for (int b = 0; b < 256; b++)
		if (!((b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff)))
			cp[n++] = 256u + (uint32_t)extra++;
	for (int i = 0; i < 256; i++) {
		uint32_t c = cp[i];
		if (c < 0x80) {
			sym[i][0] = (char)c;
			sym[i][1] = 0;
		} else {
			sym[i][0] = (char)(0xc0 | (c >> 6));
			sym[i][1] = (char)(0x80 | (c & 0x3f));
			sym[i][2] = 0;
		}
	}
	return n;
}

/* Merges "a b" applied in this order; each result is appended to the vocabulary, and each
 * side is a byte symbol or an earlier result. "\xc4\xa0" is U+0120 (space), "\xc4\x8a" U+010A
 * (newline). */
#define G "\xc4\xa0"
#define NL "\xc4\x8a"
static const char *const merges[] = {
	G " t", G " a", "h e", "i n", "r e", "o n", G "t he", "e r", G " s", "a t", "e n", "o r",
	G " w", "i s", "a n", G " c", "e s", G " o", "i t", G " b", "in g", G " f", G " p", "o u",
	G " m", G " d", "l l", G "a n", G "an d", G " " G, NL " " NL, G " i", G "i s", G " h",
	G "h e",
};
#undef G
#undef NL
#define N_MERGES (sizeof(merges) / sizeof(merges[0]))
#define N_SYNTH_MIN (256 + N_MERGES + 2)

static int synth_tokenizer(struct md_gguf_writer *w, uint32_t n_vocab)
{
	char sym[256][4];
	char **tok = calloc(n_vocab, sizeof(*tok));
	int32_t *type = calloc(n_vocab, sizeof(*type));
	if (!tok || !type) {
		free(tok);
		free(type);
		return -ENOMEM;
	}
	byte_symbols(sym);
	uint32_t n = 0;
	for (; n < 256; n++) {
		tok[n] = strdup(sym[n]);
		type[n] = 1;
	}
	for (size_t m = 0; m < N_MERGES; m++, n++) {
		const char *sp = strchr(merges[m], ' ');
		size_t la = (size_t)(sp - merges[m]);
		tok[n] = malloc(strlen(merges[m]));
		memcpy(tok[n], merges[m], la);
		strcpy(tok[n] + la, sp + 1);
		type[n] = 1;
	}
	for (; n < n_vocab - 2; n++) {
		char buf[32];
		snprintf(buf, sizeof(buf), "<|tok_%u|>", n);
		tok[n] = strdup(buf);
		type[n] = 4;
	}
	tok[n_vocab - 2] = strdup("<|endoftext|>");
	tok[n_vocab - 1] = strdup("<|im_end|>");
	type[n_vocab - 2] = type[n_vocab - 1] = 3;

	md_gguf_w_str(w, "tokenizer.ggml.model", "gpt2");
	md_gguf_w_str(w, "tokenizer.ggml.pre", "default");
	md_gguf_w_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)tok, NULL, n_vocab);
	md_gguf_w_arr_i32(w, "tokenizer.ggml.token_type", type, n_vocab);
	md_gguf_w_arr_str(w, "tokenizer.ggml.merges", merges, NULL, N_MERGES);
	md_gguf_w_u32(w, "tokenizer.ggml.bos_token_id", n_vocab - 2);
	md_gguf_w_u32(w, "tokenizer.ggml.eos_token_id", n_vocab - 2);
	md_gguf_w_u32(w, "tokenizer.ggml.padding_token_id", n_vocab - 2);
	md_gguf_w_bool(w, "tokenizer.ggml.add_bos_token", false);
	for (uint32_t i = 0; i < n_vocab; i++)
		free(tok[i]);
	free(tok);
	free(type);
	return 0;
}

static bool parse_u32(const char *s, uint32_t *out)
{
	char *end;
	errno = 0;
	unsigned long long v = strtoull(s, &end, 0);
	if (errno || end == s || *end || v > UINT32_MAX || s[0] == '-')
		return false;
	*out = (uint32_t)v;
	return true;
}

static bool parse_f64(const char *s, double *out)
{
	char *end;
	errno = 0;
	double v = strtod(s, &end);
	if (errno || end == s || *end || !isfinite(v))
		return false;
	*out = v;
	return true;
}

/* The metadata deepseek2 / glm4moe add, as their converters write it: head sizes (deepseek2:
 * the latent row in key_length/value_length and the head sizes in the _mla keys, or an older
 * file's head sizes alone), rope dims, experts and their routing, YaRN, NextN layers. */
static void meta_own(struct md_gguf_writer *w, const struct gen_opts *o)
{
	char key[128];
#define AK(suffix) (snprintf(key, sizeof(key), "%s." suffix, o->arch->name), key)
	const bool ds = is_arch(o, "deepseek2");
	if (ds && !o->kv_b_merged) {
		md_gguf_w_u32(w, AK("attention.key_length"), o->kv_lora_rank + o->rope_dim);
		md_gguf_w_u32(w, AK("attention.value_length"), o->kv_lora_rank);
		md_gguf_w_u32(w, AK("attention.key_length_mla"), o->head_dim + o->rope_dim);
		md_gguf_w_u32(w, AK("attention.value_length_mla"), o->v_head_dim);
	} else if (ds) {
		md_gguf_w_u32(w, AK("attention.key_length"), o->head_dim + o->rope_dim);
		md_gguf_w_u32(w, AK("attention.value_length"), o->v_head_dim);
	} else {
		md_gguf_w_u32(w, AK("attention.key_length"), o->head_dim);
		md_gguf_w_u32(w, AK("attention.value_length"), o->head_dim);
	}
	md_gguf_w_u32(w, AK("rope.dimension_count"), o->rope_dim);
	if (ds) {
		md_gguf_w_u32(w, AK("vocab_size"), o->n_vocab);
		if (o->q_lora_rank)
			md_gguf_w_u32(w, AK("attention.q_lora_rank"), o->q_lora_rank);
		md_gguf_w_u32(w, AK("attention.kv_lora_rank"), o->kv_lora_rank);
	}
	md_gguf_w_u32(w, AK("leading_dense_block_count"), o->n_dense_lead);
	md_gguf_w_u32(w, AK("expert_shared_count"), o->n_shared);
	if (o->weights_scale != 0)
		md_gguf_w_f32(w, AK("expert_weights_scale"), (float)o->weights_scale);
	if (!ds || !o->no_weights_norm) /* deepseek2's converter writes it only when true */
		md_gguf_w_bool(w, AK("expert_weights_norm"), !o->no_weights_norm);
	if (o->gating || !ds)
		md_gguf_w_u32(w, AK("expert_gating_func"), ds ? (uint32_t)o->gating : 2);
	if (o->n_expert_groups) {
		md_gguf_w_u32(w, AK("expert_group_count"), o->n_expert_groups);
		md_gguf_w_u32(w, AK("expert_group_used_count"), o->n_group_used);
	}
	if (o->nextn)
		md_gguf_w_u32(w, AK("nextn_predict_layers"), o->nextn);
	if (o->yarn_factor >= 1) {
		md_gguf_w_str(w, AK("rope.scaling.type"), "yarn");
		md_gguf_w_f32(w, AK("rope.scaling.factor"), (float)o->yarn_factor);
		md_gguf_w_u32(w, AK("rope.scaling.original_context_length"),
			      o->yarn_orig_ctx ? o->yarn_orig_ctx : (uint32_t)(o->n_ctx / o->yarn_factor));
		if (ds)
			md_gguf_w_f32(w, AK("rope.scaling.yarn_log_multiplier"),
				      (float)(0.1 * o->yarn_mscale_all));
	}
#undef AK
}

static int cmd_gen(int argc, char **argv)
{
	struct gen_opts o = {
		.arch = &archs[0], .wt = &gen_types[0], .seed = 1,
		.n_layer = 2, .n_embd = 64, .n_head = 4, .n_head_kv = 2, .head_dim = 16,
		.n_ff = 128, .n_expert = 4, .n_expert_used = 2, .n_ff_exp = 64, .n_ff_shexp = 128,
		.n_vocab = 512, .n_ctx = 4096, .rms_eps = 1e-6, .std = 0.02,
		.layout = LAYOUT_MOED, .vec_type = MD_DT_F32,
		.n_swa = 128, .yarn_factor = -1, .yarn_orig_ctx = UINT32_MAX,
		.q_lora_rank = 32, .kv_lora_rank = 32, .n_dense_lead = 1, .n_shared = 1, .gating = 2,
		.weights_scale = 2.5, .yarn_mscale_all = 1.0,
	};
	bool vocab_set = false;
	struct {
		const char *name;
		uint32_t *v;
	} u32opts[] = {
		{ "n-layer", &o.n_layer }, { "n-embd", &o.n_embd }, { "n-head", &o.n_head },
		{ "n-head-kv", &o.n_head_kv }, { "head-dim", &o.head_dim }, { "n-ff", &o.n_ff },
		{ "n-expert", &o.n_expert }, { "n-expert-used", &o.n_expert_used },
		{ "n-ff-exp", &o.n_ff_exp }, { "n-ff-shexp", &o.n_ff_shexp },
		{ "n-vocab", &o.n_vocab }, { "n-ctx", &o.n_ctx },
		{ "sliding-window", &o.n_swa }, { "yarn-orig-ctx", &o.yarn_orig_ctx },
		{ "q-lora-rank", &o.q_lora_rank }, { "kv-lora-rank", &o.kv_lora_rank },
		{ "v-head-dim", &o.v_head_dim }, { "rope-dim", &o.rope_dim },
		{ "n-dense-lead", &o.n_dense_lead }, { "n-shared", &o.n_shared },
		{ "n-expert-groups", &o.n_expert_groups }, { "n-group-used", &o.n_group_used },
		{ "nextn", &o.nextn },
	};

	for (int i = 0; i < argc; i++) {
		const char *arg = argv[i];
		if (strncmp(arg, "--", 2) != 0) {
			if (o.out) {
				fprintf(stderr, "moed-gguf gen: unexpected argument '%s'\n", arg);
				return 2;
			}
			o.out = arg;
			continue;
		}
		char name[64];
		const char *val = NULL, *eq = strchr(arg + 2, '=');
		snprintf(name, sizeof(name), "%.*s",
			 (int)(eq ? (size_t)(eq - arg - 2) : strlen(arg + 2)), arg + 2);
		if (strcmp(name, "tied") == 0) {
			o.tied = true;
			continue;
		}
		if (strcmp(name, "bias") == 0) {
			o.bias = true;
			continue;
		}
		if (strcmp(name, "no-probs-bias") == 0 || strcmp(name, "no-weights-norm") == 0 ||
		    strcmp(name, "no-qk-norm") == 0) {
			*(name[3] == 'p' ? &o.no_probs_bias : name[3] == 'w' ? &o.no_weights_norm
									  : &o.no_qk_norm) = true;
			continue;
		}
		if (strcmp(name, "help") == 0) {
			usage(stdout);
			return 0;
		}
		if (eq)
			val = eq + 1;
		else if (i + 1 < argc)
			val = argv[++i];
		else {
			fprintf(stderr, "moed-gguf gen: option '--%s' needs a value\n", name);
			return 2;
		}
		bool ok = false, known = false;
		for (size_t k = 0; k < sizeof(u32opts) / sizeof(u32opts[0]); k++) {
			if (strcmp(name, u32opts[k].name) == 0) {
				known = true;
				ok = parse_u32(val, u32opts[k].v);
				if (u32opts[k].v == &o.n_vocab)
					vocab_set = true;
			}
		}
		if (known) {
		} else if (strcmp(name, "arch") == 0) {
			known = true;
			for (size_t k = 0; k < sizeof(archs) / sizeof(archs[0]); k++)
				if (strcmp(val, archs[k].opt) == 0)
					o.arch = &archs[k], ok = true;
		} else if (strcmp(name, "type") == 0 || strcmp(name, "exp-type") == 0) {
			known = true;
			for (size_t k = 0; k < sizeof(gen_types) / sizeof(gen_types[0]); k++)
				if (strcasecmp(val, gen_types[k].name) == 0) {
					if (name[0] == 't')
						o.wt = &gen_types[k];
					else
						o.exp_wt = &gen_types[k];
					ok = true;
				}
		} else if (strcmp(name, "seed") == 0) {
			char *end;
			known = true;
			errno = 0;
			o.seed = strtoull(val, &end, 0);
			ok = !errno && end != val && !*end;
		} else if (strcmp(name, "rope-base") == 0) {
			known = true;
			ok = parse_f64(val, &o.rope_base) && o.rope_base > 0;
			o.rope_base_set = true;
		} else if (strcmp(name, "rms-eps") == 0) {
			known = true;
			ok = parse_f64(val, &o.rms_eps) && o.rms_eps > 0;
		} else if (strcmp(name, "std") == 0) {
			known = true;
			ok = parse_f64(val, &o.std) && o.std >= 0;
		} else if (strcmp(name, "layout") == 0) {
			known = true;
			const char *const lnames[] = { "moed", "converter", "split-experts" };
			for (int k = 0; k < 3; k++)
				if (strcmp(val, lnames[k]) == 0)
					o.layout = k, ok = true;
		} else if (strcmp(name, "vec-type") == 0) {
			known = true;
			for (size_t k = 0; k < 3; k++)
				if (strcasecmp(val, gen_types[k].name) == 0)
					o.vec_type = gen_types[k].type, ok = true;
		} else if (strcmp(name, "kv-b") == 0) {
			known = true;
			ok = strcmp(val, "split") == 0 || strcmp(val, "merged") == 0;
			o.kv_b_merged = strcmp(val, "merged") == 0;
		} else if (strcmp(name, "gating") == 0) {
			known = true;
			const char *const gnames[] = { "none", "softmax", "sigmoid" };
			for (int k = 0; k < 3; k++)
				if (strcmp(val, gnames[k]) == 0)
					o.gating = k, ok = true;
		} else if (strcmp(name, "weights-scale") == 0) {
			known = true;
			ok = parse_f64(val, &o.weights_scale) && o.weights_scale >= 0;
		} else if (strcmp(name, "yarn-factor") == 0) {
			known = true;
			ok = parse_f64(val, &o.yarn_factor) && (o.yarn_factor == 0 || o.yarn_factor >= 1);
		} else if (strcmp(name, "yarn-mscale-all") == 0) {
			known = true;
			ok = parse_f64(val, &o.yarn_mscale_all) && o.yarn_mscale_all > 0;
		} else if (strcmp(name, "tokenizer-gguf") == 0) {
			known = ok = true;
			o.tokenizer = val;
		}
		if (!known) {
			fprintf(stderr, "moed-gguf gen: unknown option '--%s' (see --help)\n", name);
			return 2;
		}
		if (!ok) {
			fprintf(stderr, "moed-gguf gen: bad value '%s' for --%s\n", val, name);
			return 2;
		}
	}
	if (!o.out) {
		fprintf(stderr, "moed-gguf gen: missing OUT file (see --help)\n");
		return 2;
	}
	const struct arch_def *a = o.arch;
	if (!o.rope_base_set)
		o.rope_base = a->rope_base;

	struct md_gguf_writer *w = md_gguf_writer_new();
	if (!w) {
		fprintf(stderr, "moed-gguf: out of memory\n");
		return 1;
	}
	int ret = 1;
	struct gen_list l = { 0 };
	char err[512];

	/* Tokenizer first: it may decide n_vocab. */
	if (o.tokenizer) {
		struct md_gguf tg;
		if (md_gguf_open(&tg, o.tokenizer, err, sizeof(err))) {
			fprintf(stderr, "moed-gguf gen: %s\n", err);
			goto out;
		}
		int64_t k = md_gguf_find_key(&tg, "tokenizer.ggml.tokens");
		if (k < 0 || tg.kv[k].type != MD_GGUF_ARRAY || tg.kv[k].arr_type != MD_GGUF_STRING ||
		    tg.kv[k].arr_n == 0 || tg.kv[k].arr_n > UINT32_MAX) {
			fprintf(stderr, "moed-gguf gen: '%s' has no tokenizer.ggml.tokens string "
				"array\n", o.tokenizer);
			md_gguf_close(&tg);
			goto out;
		}
		if (vocab_set && o.n_vocab != tg.kv[k].arr_n)
			fprintf(stderr, "moed-gguf gen: note: --n-vocab %u replaced by the "
				"tokenizer's %" PRIu64 " tokens\n", o.n_vocab, tg.kv[k].arr_n);
		o.n_vocab = (uint32_t)tg.kv[k].arr_n;
		md_gguf_w_copy_kv_prefix(w, &tg, "tokenizer.");
		md_gguf_close(&tg);
	} else if (o.n_vocab < N_SYNTH_MIN) {
		fprintf(stderr, "moed-gguf gen: --n-vocab %u is too small for the synthetic "
			"vocabulary (at least %zu)\n", o.n_vocab, (size_t)N_SYNTH_MIN);
		goto out;
	}

	/* Shape checks. */
	if (!o.n_layer || !o.n_embd || !o.n_head || !o.n_head_kv || !o.head_dim || !o.n_ctx) {
		fprintf(stderr, "moed-gguf gen: sizes must be positive\n");
		goto out;
	}
	if (o.n_head % o.n_head_kv) {
		fprintf(stderr, "moed-gguf gen: --n-head %u is not a multiple of --n-head-kv %u\n",
			o.n_head, o.n_head_kv);
		goto out;
	}
	if (a->moe && (!o.n_expert || !o.n_expert_used || o.n_expert_used > o.n_expert ||
		       !o.n_ff_exp || (a->shexp && !o.n_ff_shexp))) {
		fprintf(stderr, "moed-gguf gen: need 0 < --n-expert-used <= --n-expert and positive "
			"expert widths\n");
		goto out;
	}
	if (!a->moe && !o.n_ff) {
		fprintf(stderr, "moed-gguf gen: --n-ff must be positive\n");
		goto out;
	}
	if (o.yarn_factor < 0)
		o.yarn_factor = a->oss ? 32 : 0;
	if (o.yarn_orig_ctx == UINT32_MAX)
		o.yarn_orig_ctx = a->oss ? 4096 : 0;
	if (a->oss && (!o.n_swa || !o.yarn_orig_ctx)) {
		fprintf(stderr, "moed-gguf gen: --sliding-window and --yarn-orig-ctx must be positive\n");
		goto out;
	}
	if (o.exp_wt && !a->moe) {
		fprintf(stderr, "moed-gguf gen: --exp-type needs an MoE arch\n");
		goto out;
	}
	if (o.layout == LAYOUT_SPLIT && !a->moe) {
		fprintf(stderr, "moed-gguf gen: --layout split-experts needs an MoE arch\n");
		goto out;
	}
	if (o.tied && a->always_output)
		fprintf(stderr, "moed-gguf gen: note: %s always has output.weight; --tied "
			"ignored\n", a->opt);
	const bool own = is_arch(&o, "deepseek2") || is_arch(&o, "glm4moe");
	if (own) {
		if (!o.v_head_dim)
			o.v_head_dim = o.head_dim;
		if (!o.rope_dim)
			o.rope_dim = is_arch(&o, "deepseek2") ? 8 : o.head_dim / 2;
		if (is_arch(&o, "deepseek2"))
			o.n_head_kv = o.kv_b_merged ? o.n_head : 1; /* as the converter writes it */
		else
			o.no_probs_bias = false; /* glm4moe always has the selection bias */
		uint32_t G = o.n_expert_groups;
		if (o.rope_dim % 2 || (is_arch(&o, "glm4moe") && o.rope_dim > o.head_dim) ||
		    (is_arch(&o, "deepseek2") && (!o.kv_lora_rank || !o.rope_dim)) ||
		    o.n_dense_lead >= o.n_layer || !o.n_ff || (is_arch(&o, "deepseek2") && !o.n_shared) ||
		    (G > 1 && (o.n_expert % G || !o.n_group_used || o.n_group_used >= G ||
			       o.n_expert_used > o.n_group_used * (o.n_expert / G)))) {
			fprintf(stderr, "moed-gguf gen: %s needs an even --rope-dim (<= head-dim for glm4moe; "
				"> 0 and --kv-lora-rank > 0 for deepseek2), --n-dense-lead < --n-layer, --n-ff > 0, "
				"--n-shared > 0 (deepseek2) and expert groups that divide the experts\n", a->opt);
			goto out;
		}
	}

	build_tensors(&l, &o);
	const struct md_dtype_info *wi = md_dtype_info(o.wt->type);
	for (size_t k = 0; k < l.n; k++) {
		struct gen_tensor *t = &l.v[k];
		if (t->ne[0] % md_dtype_info(t->type)->blck != 0) {
			fprintf(stderr, "moed-gguf gen: --type %s needs every row length to be a "
				"multiple of %" PRId64 ", but %s has ne[0] = %" PRId64 "\n",
				o.wt->name, wi->blck, t->name, t->ne[0]);
			goto out;
		}
	}

	/* Metadata. */
	char key[128];
#define AK(suffix) (snprintf(key, sizeof(key), "%s." suffix, a->name), key)
	md_gguf_w_str(w, "general.architecture", a->name);
	snprintf(err, sizeof(err), "moed-gen-%s", a->opt);
	md_gguf_w_str(w, "general.name", err);
	/* Experts in mxfp4 beside float or q8_0 weights: llama.cpp's MXFP4_MOE file type. */
	md_gguf_w_u32(w, "general.file_type", o.exp_wt && o.exp_wt->type == MD_DT_MXFP4
		      ? FTYPE_MXFP4_MOE : o.wt->ftype);
	if (is_quantized(o.wt->type) || (o.exp_wt && is_quantized(o.exp_wt->type)))
		md_gguf_w_u32(w, "general.quantization_version", 2);
	md_gguf_w_u32(w, AK("block_count"), o.n_layer + o.nextn);
	md_gguf_w_u32(w, AK("context_length"), o.n_ctx);
	md_gguf_w_u32(w, AK("embedding_length"), o.n_embd);
	/* gpt-oss's converter writes intermediate_size as both widths. */
	md_gguf_w_u32(w, AK("feed_forward_length"),
		      a->moe && (!a->exp_ff_key || a->oss) ? o.n_ff_exp : o.n_ff);
	md_gguf_w_u32(w, AK("attention.head_count"), o.n_head);
	md_gguf_w_u32(w, AK("attention.head_count_kv"), o.n_head_kv);
	if (own) {
		meta_own(w, &o);
	} else {
		md_gguf_w_u32(w, AK("attention.key_length"), o.head_dim);
		md_gguf_w_u32(w, AK("attention.value_length"), o.head_dim);
		md_gguf_w_u32(w, AK("rope.dimension_count"), o.head_dim);
	}
	md_gguf_w_f32(w, AK("rope.freq_base"), (float)o.rope_base);
	md_gguf_w_f32(w, AK("attention.layer_norm_rms_epsilon"), (float)o.rms_eps);
	if (a->moe) {
		md_gguf_w_u32(w, AK("expert_count"), o.n_expert);
		md_gguf_w_u32(w, AK("expert_used_count"), o.n_expert_used);
		if (a->exp_ff_key)
			md_gguf_w_u32(w, AK("expert_feed_forward_length"), o.n_ff_exp);
		if (a->shexp)
			md_gguf_w_u32(w, AK("expert_shared_feed_forward_length"), o.n_ff_shexp);
	}
	if (a->oss) { /* as convert_hf_to_gguf.py writes gpt-oss's config */
		md_gguf_w_u32(w, AK("attention.sliding_window"), o.n_swa);
		if (o.yarn_factor != 0 && o.yarn_factor != 1) {
			md_gguf_w_str(w, AK("rope.scaling.type"), "yarn");
			md_gguf_w_f32(w, AK("rope.scaling.factor"), (float)o.yarn_factor);
			md_gguf_w_u32(w, AK("rope.scaling.original_context_length"), o.yarn_orig_ctx);
			md_gguf_w_f32(w, AK("rope.scaling.yarn_beta_fast"), 32.0f);
			md_gguf_w_f32(w, AK("rope.scaling.yarn_beta_slow"), 1.0f);
		}
	}
#undef AK
	if (!o.tokenizer && synth_tokenizer(w, o.n_vocab)) {
		fprintf(stderr, "moed-gguf: out of memory\n");
		goto out;
	}

	uint64_t n_params = 0;
	for (size_t k = 0; k < l.n; k++) {
		struct gen_tensor *t = &l.v[k];
		int rc = md_gguf_w_tensor(w, t->name, t->type, t->n_dims, t->ne, gen_fill, t);
		if (rc) {
			fprintf(stderr, "moed-gguf gen: cannot declare tensor '%s': %s\n", t->name,
				strerror(-rc));
			goto out;
		}
		n_params += (uint64_t)(t->ne[0] * t->ne[1] * t->ne[2]);
	}
	if (md_gguf_writer_write(w, o.out, err, sizeof(err))) {
		fprintf(stderr, "moed-gguf gen: %s\n", err);
		goto out;
	}
	fprintf(stderr, "wrote %s: arch %s (%s), %zu tensors, %" PRIu64 " parameters (%.4g B), "
		"type %s\n", o.out, a->name, a->opt, l.n, n_params, (double)n_params / 1e9,
		o.wt->name);
	ret = 0;
out:
	free(l.v);
	md_gguf_writer_free(w);
	return ret;
}

/* ---------------------------------------------------------------- quantize */

struct mix_def {
	const char *name;
	uint32_t base;   /* type of ordinary weights */
	uint32_t ftype;
};

static const struct mix_def mixes[] = {
	{ "f32", MD_DT_F32, FTYPE_F32 },       { "f16", MD_DT_F16, FTYPE_F16 },
	{ "bf16", MD_DT_BF16, FTYPE_BF16 },    { "q8_0", MD_DT_Q8_0, FTYPE_Q8_0 },
	{ "q4_0", MD_DT_Q4_0, FTYPE_Q4_0 },    { "q4_1", MD_DT_Q4_1, FTYPE_Q4_1 },
	{ "q5_0", MD_DT_Q5_0, FTYPE_Q5_0 },    { "q5_1", MD_DT_Q5_1, FTYPE_Q5_1 },
	{ "q2_k", MD_DT_Q2_K, FTYPE_Q2_K },    { "q3_k_m", MD_DT_Q3_K, FTYPE_Q3_K_M },
	{ "q4_k_m", MD_DT_Q4_K, FTYPE_Q4_K_M },
	{ "q5_k_m", MD_DT_Q5_K, FTYPE_Q5_K_M }, { "q6_k", MD_DT_Q6_K, FTYPE_Q6_K },
	{ "iq4_nl", MD_DT_IQ4_NL, FTYPE_IQ4_NL }, { "iq4_xs", MD_DT_IQ4_XS, FTYPE_IQ4_XS },
	{ "mxfp4_moe", MD_DT_MXFP4, FTYPE_MXFP4_MOE },
};

/* llama.cpp's use_more_bits: first and last eighth of the layers, every third in between. */
static bool use_more_bits(int i, int n)
{
	return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
}

/* What the type rules need to know about the model (llama.cpp's hparams). */
struct q_model {
	int n_layer;
	int n_expert; /* 0 for dense models */
	int n_gqa;    /* head_count / head_count_kv, 1 when unknown */
};

static bool name_has(const char *name, const char *part)
{
	return strstr(name, part) != NULL;
}

/*
 * Type of one tensor under a mix, following llama.cpp's llama_tensor_get_type for the
 * archs moed loads (no importance matrix, not Falcon): output.weight q6_K (q8_0 for
 * mxfp4_moe and for rows not a multiple of the base block); mxfp4_moe: 3-D expert tensors
 * mxfp4, every other weight q8_0. attn_v: q2_k q4_K when n_gqa >= 4 else q3_K; q3_k_m q5_K
 * in layers 0-1 else q4_K; iq4_nl/iq4_xs q5_K when n_gqa >= 4; q4_k_m/q5_k_m q6_K in
 * use_more_bits layers; q8_0 for any mix with exactly 8 experts (attn_k too).
 * ffn_down*: q2_k q3_K; q3_k_m q5_K in the first n_layer/16 layers else q4_K; q4_k_m/q5_k_m
 * q6_K in use_more_bits layers; iq4_nl/iq4_xs q5_K in the first n_layer/8. attn_output:
 * with 8 experts q5_K for q2_k/q3_k_m/q4_k_m/iq4_*; otherwise q3_K for q2_k, q4_K for
 * q3_k_m. Then llama-quantize's fallbacks (k_fallback; f16 where even those do not fit).
 * *why is set to a note for fallbacks.
 */
static uint32_t pick_type(const struct mix_def *m, const struct md_gguf_tensor *t,
			  const char *name, const struct q_model *qm, const char **why)
{
	*why = NULL;
	size_t nl = strlen(name);
	/* llama-quantize quantizes only tensors whose name ends in "weight" (not gpt-oss's 2-D
	 * expert biases). */
	if (t->n_dims < 2 || name_has(name, "ffn_gate_inp") || nl < 6 || strcmp(name + nl - 6, "weight"))
		return t->type;
	const uint32_t base = m->base;
	if (!is_quantized(base))
		return base;
	const bool more_bits_mix = base == MD_DT_Q4_K || base == MD_DT_Q5_K;
	const bool iq4 = base == MD_DT_IQ4_NL || base == MD_DT_IQ4_XS;
	int layer = -1;
	sscanf(name, "blk.%d.", &layer);
	uint32_t ty = base;
	if (strcmp(name, "output.weight") == 0) {
		if (base == MD_DT_MXFP4 || t->ne[0] % md_dtype_info(base)->blck != 0)
			ty = MD_DT_Q8_0;
		else if (base != MD_DT_Q8_0)
			ty = MD_DT_Q6_K;
	} else if (base == MD_DT_MXFP4) {
		ty = t->n_dims >= 3 && t->ne[2] > 1 ? MD_DT_MXFP4 : MD_DT_Q8_0;
	} else if (name_has(name, "attn_v.weight")) {
		if (base == MD_DT_Q2_K)
			ty = qm->n_gqa >= 4 ? MD_DT_Q4_K : MD_DT_Q3_K;
		else if (base == MD_DT_Q3_K)
			ty = layer >= 0 && layer < 2 ? MD_DT_Q5_K : MD_DT_Q4_K;
		else if (iq4 && qm->n_gqa >= 4)
			ty = MD_DT_Q5_K;
		else if (more_bits_mix && layer >= 0 && use_more_bits(layer, qm->n_layer))
			ty = MD_DT_Q6_K;
		if (qm->n_expert == 8)
			ty = MD_DT_Q8_0;
	} else if (name_has(name, "attn_k.weight")) {
		if (qm->n_expert == 8)
			ty = MD_DT_Q8_0;
	} else if (name_has(name, "ffn_down")) {
		if (base == MD_DT_Q2_K)
			ty = MD_DT_Q3_K;
		else if (base == MD_DT_Q3_K)
			ty = layer >= 0 && layer < qm->n_layer / 16 ? MD_DT_Q5_K : MD_DT_Q4_K;
		else if (more_bits_mix && layer >= 0 && use_more_bits(layer, qm->n_layer))
			ty = MD_DT_Q6_K;
		else if (iq4 && layer >= 0 && layer < qm->n_layer / 8)
			ty = MD_DT_Q5_K;
	} else if (name_has(name, "attn_output.weight")) {
		if (qm->n_expert == 8) {
			if (base == MD_DT_Q2_K || base == MD_DT_Q3_K || base == MD_DT_Q4_K || iq4)
				ty = MD_DT_Q5_K;
		} else if (base == MD_DT_Q2_K) {
			ty = MD_DT_Q3_K;
		} else if (base == MD_DT_Q3_K) {
			ty = MD_DT_Q4_K;
		}
	}
	if (md_dtype_info(ty)->blck == MD_QK_K && t->ne[0] % MD_QK_K != 0) {
		ty = k_fallback(ty);
		*why = ty == MD_DT_Q5_0 ? "ne[0] not a multiple of 256: q5_0 fallback" :
		       ty == MD_DT_Q5_1 ? "ne[0] not a multiple of 256: q5_1 fallback" :
		       ty == MD_DT_IQ4_NL ? "ne[0] not a multiple of 256: iq4_nl fallback" :
		       ty == MD_DT_Q4_0 ? "ne[0] not a multiple of 256: q4_0 fallback" :
					    "ne[0] not a multiple of 256: q8_0 fallback";
	}
	if (t->ne[0] % md_dtype_info(ty)->blck != 0) {
		ty = MD_DT_F16;
		*why = "ne[0] not a multiple of 32: f16 fallback";
	}
	return ty;
}

struct q_tensor {
	const struct md_gguf *g;
	const struct md_gguf_tensor *src;
	char *name;        /* owned */
	uint32_t type;     /* target */
	const char *why;   /* static string or NULL */
	size_t idx, total;
};

/* Drop the source pages of a tensor from this process once converted (bounded RSS). */
static void drop_pages(const struct md_gguf *g, const void *p, uint64_t n)
{
	long ps = sysconf(_SC_PAGESIZE);
	uintptr_t lo = (uintptr_t)p & ~(uintptr_t)(ps - 1);
	uintptr_t hi = ((uintptr_t)p + n) & ~(uintptr_t)(ps - 1);
	if (!g->_mapped || hi <= lo)
		return;
	madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

static int q_fill(void *vctx, void *dst, size_t nbytes)
{
	struct q_tensor *q = vctx;
	const struct md_gguf_tensor *s = q->src;
	char shape[96];
	fmt_shape(shape, sizeof(shape), s->ne, s->n_dims);
	fprintf(stderr, "[%4zu/%4zu] %-32s %-22s %-5s -> %s%s%s\n", q->idx + 1, q->total,
		q->name, shape, dtype_name(s->type), dtype_name(q->type), q->why ? "  " : "",
		q->why ? q->why : "");
	if (q->type == s->type) {
		if (nbytes != s->nbytes)
			return -EINVAL;
		memcpy(dst, s->data, nbytes);
		drop_pages(q->g, s->data, s->nbytes);
		return 0;
	}
	int64_t n0 = s->ne[0], rows = s->ne[1] * s->ne[2] * s->ne[3];
	size_t in_row = md_dtype_row_size((enum md_dtype)s->type, n0);
	size_t out_row = md_dtype_row_size((enum md_dtype)q->type, n0);
	if (out_row * (size_t)rows != nbytes || in_row * (size_t)rows != s->nbytes)
		return -EINVAL;
	float *row = malloc((size_t)n0 * sizeof(float));
	if (!row)
		return -ENOMEM;
	const uint8_t *in = s->data;
	uint8_t *out = dst;
	for (int64_t r = 0; r < rows; r++) {
		md_dequant_row((enum md_dtype)s->type, in + (size_t)r * in_row, row, n0);
		md_quantize_row((enum md_dtype)q->type, row, out + (size_t)r * out_row, n0);
	}
	free(row);
	drop_pages(q->g, s->data, s->nbytes);
	return 0;
}

static int cmd_quantize(const char *in, const char *out, const char *mix)
{
	const struct mix_def *m = NULL;
	for (size_t k = 0; k < sizeof(mixes) / sizeof(mixes[0]); k++)
		if (strcasecmp(mix, mixes[k].name) == 0)
			m = &mixes[k];
	if (!m) {
		fprintf(stderr, "moed-gguf quantize: unknown MIX '%s' (f32 f16 bf16 q8_0 q4_0 "
			"q4_1 q5_0 q5_1 q2_k q3_k_m q4_k_m q5_k_m q6_k iq4_nl iq4_xs mxfp4_moe)\n", mix);
		return 2;
	}
	if (strcmp(in, out) == 0) {
		fprintf(stderr, "moed-gguf quantize: IN and OUT are the same file\n");
		return 2;
	}
	struct md_gguf g;
	char err[512];
	if (md_gguf_open(&g, in, err, sizeof(err))) {
		fprintf(stderr, "moed-gguf quantize: %s\n", err);
		return 1;
	}
	int ret = 1;
	struct md_gguf_writer *w = md_gguf_writer_new();
	struct q_tensor *qs = calloc(g.n_tensors ? g.n_tensors : 1, sizeof(*qs));
	if (!w || !qs) {
		fprintf(stderr, "moed-gguf: out of memory\n");
		goto out;
	}

	/* n_layer from ARCH.block_count, else from the highest blk.N seen. */
	int n_layer = 0;
	struct md_gguf_str arch;
	if (md_gguf_get_str(&g, "general.architecture", &arch)) {
		char key[160];
		uint32_t v;
		snprintf(key, sizeof(key), "%.*s.block_count", (int)(arch.len < 100 ? arch.len : 100),
			 arch.ptr);
		if (md_gguf_get_u32(&g, key, &v) && v < 100000)
			n_layer = (int)v;
	}
	struct q_model qm = { .n_gqa = 1 };
	if (md_gguf_get_str(&g, "general.architecture", &arch)) {
		char key[160];
		uint32_t v, hkv;
		int al = (int)(arch.len < 100 ? arch.len : 100);
		snprintf(key, sizeof(key), "%.*s.expert_count", al, arch.ptr);
		if (md_gguf_get_u32(&g, key, &v) && v < 100000)
			qm.n_expert = (int)v;
		snprintf(key, sizeof(key), "%.*s.attention.head_count", al, arch.ptr);
		if (md_gguf_get_u32(&g, key, &v)) {
			snprintf(key, sizeof(key), "%.*s.attention.head_count_kv", al, arch.ptr);
			if (md_gguf_get_u32(&g, key, &hkv) && hkv > 0 && v >= hkv)
				qm.n_gqa = (int)(v / hkv);
		}
	}
	for (uint64_t i = 0; i < g.n_tensors && n_layer == 0; i++) {
		int li;
		char buf[32];
		snprintf(buf, sizeof(buf), "%.*s", (int)g.tensors[i].name.len, g.tensors[i].name.ptr);
		if (sscanf(buf, "blk.%d.", &li) == 1 && li + 1 > n_layer)
			n_layer = li + 1;
	}
	qm.n_layer = n_layer;

	md_gguf_w_copy_kv(w, &g);
	md_gguf_w_u32(w, "general.file_type", m->ftype);
	if (is_quantized(m->base))
		md_gguf_w_u32(w, "general.quantization_version", 2);

	uint64_t in_bytes = 0, out_bytes = 0;
	for (uint64_t i = 0; i < g.n_tensors; i++) {
		const struct md_gguf_tensor *t = &g.tensors[i];
		struct q_tensor *q = &qs[i];
		q->g = &g;
		q->src = t;
		q->idx = i;
		q->total = g.n_tensors;
		q->name = strndup(t->name.ptr, t->name.len);
		if (!q->name) {
			fprintf(stderr, "moed-gguf: out of memory\n");
			goto out;
		}
		q->type = pick_type(m, t, q->name, &qm, &q->why);
		const struct md_dtype_info *si = md_dtype_info(t->type);
		if (q->type != t->type && (!si || !si->supported)) {
			fprintf(stderr, "moed-gguf quantize: tensor '%s' has type %s, which moed "
				"cannot dequantize\n", q->name, dtype_name(t->type));
			goto out;
		}
		int rc = md_gguf_w_tensor(w, q->name, q->type, t->n_dims, t->ne, q_fill, q);
		if (rc) {
			fprintf(stderr, "moed-gguf quantize: cannot declare tensor '%s' as %s: %s\n",
				q->name, dtype_name(q->type), strerror(-rc));
			goto out;
		}
		in_bytes += t->nbytes;
		out_bytes += md_dtype_row_size((enum md_dtype)q->type, t->ne[0]) *
			     (uint64_t)(t->ne[1] * t->ne[2] * t->ne[3]);
	}
	if (md_gguf_writer_write(w, out, err, sizeof(err))) {
		fprintf(stderr, "moed-gguf quantize: %s\n", err);
		goto out;
	}
	fprintf(stderr, "wrote %s: mix %s, %" PRIu64 " tensors, %.3f GiB -> %.3f GiB\n", out,
		m->name, g.n_tensors, gib(in_bytes), gib(out_bytes));
	ret = 0;
out:
	if (qs)
		for (uint64_t i = 0; i < g.n_tensors; i++)
			free(qs[i].name);
	free(qs);
	md_gguf_writer_free(w);
	md_gguf_close(&g);
	return ret;
}

int main(int argc, char **argv)
{
	if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
	    strcmp(argv[1], "help") == 0) {
		usage(argc < 2 ? stderr : stdout);
		return argc < 2 ? 2 : 0;
	}
	if (strcmp(argv[1], "info") == 0) {
		if (argc != 3) {
			fprintf(stderr, "usage: moed-gguf info FILE\n");
			return 2;
		}
		return cmd_info(argv[2]);
	}
	if (strcmp(argv[1], "gen") == 0)
		return cmd_gen(argc - 2, argv + 2);
	if (strcmp(argv[1], "quantize") == 0) {
		if (argc != 5) {
			fprintf(stderr, "usage: moed-gguf quantize IN OUT MIX\n");
			return 2;
		}
		return cmd_quantize(argv[2], argv[3], argv[4]);
	}
	if (strcmp(argv[1], "inflate") == 0)
		return md_inflate_main(argc - 1, argv + 1);
	fprintf(stderr, "moed-gguf: unknown command '%s' (info, gen, quantize, inflate)\n", argv[1]);
	return 2;
}
