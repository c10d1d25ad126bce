/* Loader conformance with llama.cpp's GGUF conventions: each case writes a small model file the
 * way some writer of llama.cpp's world lays it out (or breaks it), loads it with md_model_load
 * and checks what was bound, or that the error names the tensor or key and what was expected.
 *
 * usage: test_model [CASE]   (no CASE: every case; meson registers one test per case)
 * TEST_MODEL_VERBOSE=1 prints each refusal's error line.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <unistd.h>

#include "engine/model.h"
#include "engine/quant.h"
#include "tools/gguf_writer.h"

#include "tests/check.h"

/* A failed setup step (writing the file) is a broken test, not a finding: stop. */
#define SETUP(c)                                                                         \
	do {                                                                             \
		if (!(c)) {                                                              \
			fprintf(stderr, "%s:%d: setup failed: %s\n", __FILE__, __LINE__, #c); \
			exit(2);                                                         \
		}                                                                        \
	} while (0)

/* ---------------------------------------------------------------- model specs */

/* Dimensions of every generated model: small, but each width distinct so a transposed or
 * mixed-up shape cannot pass. */
enum { N = 64, H = 4, K = 2, D = 16, E = 4, USED = 2, F = 32, S = 48, FF = 96, V = 300, NL = 2 };

struct tspec {
	char name[64];
	uint32_t type;
	uint32_t n_dims;
	int64_t ne[4];
};

struct spec {
	const char *arch;     /* general.architecture */
	bool moe;
	struct tspec t[160];
	int n;
	const char *omit[8];  /* metadata suffixes (after "ARCH.") not to write */
	void (*kv)(struct md_gguf_writer *w, const char *arch); /* extra keys (replace) */
};

static struct tspec *add(struct spec *s, uint32_t type, uint32_t n_dims, int64_t ne0, int64_t ne1,
			 int64_t ne2, const char *fmt, int a, int b)
{
	struct tspec *t = &s->t[s->n++];
	SETUP(s->n <= (int)(sizeof(s->t) / sizeof(s->t[0])));
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral"
	snprintf(t->name, sizeof(t->name), fmt, a, b); /* fmt takes at most two ints */
#pragma GCC diagnostic pop
	t->type = type;
	t->n_dims = n_dims;
	t->ne[0] = ne0;
	t->ne[1] = ne1;
	t->ne[2] = ne2;
	t->ne[3] = 1;
	return t;
}

static struct tspec *find(struct spec *s, const char *name)
{
	for (int i = 0; i < s->n; i++)
		if (strcmp(s->t[i].name, name) == 0)
			return &s->t[i];
	fprintf(stderr, "test bug: no tensor '%s' in the spec\n", name);
	exit(2);
}

static void drop(struct spec *s, const char *name)
{
	struct tspec *t = find(s, name);
	memmove(t, t + 1, (size_t)(s->t + s->n - t - 1) * sizeof(*t));
	s->n--;
}

/* The tensors of arch `a` (moed-gguf's arch names: mixtral = llama with experts) as
 * llama.cpp's loader expects them, merged expert tensors, everything f32. */
static void spec_init(struct spec *s, const char *a)
{
	memset(s, 0, sizeof(*s));
	bool mixtral = strcmp(a, "mixtral") == 0;
	s->arch = mixtral ? "llama" : a;
	s->moe = mixtral || strstr(a, "moe") != NULL;
	bool qwen2moe = strcmp(a, "qwen2moe") == 0, oss = strcmp(a, "gpt-oss") == 0;
	bool bias = qwen2moe || strcmp(a, "qwen2") == 0 || oss;
	s->moe = s->moe || oss;
	const int64_t QD = H * D, KD = K * D, FE = s->moe ? F : FF;
	add(s, MD_DT_F32, 2, N, V, 1, "token_embd.weight", 0, 0);
	add(s, MD_DT_F32, 1, N, 1, 1, "output_norm.weight", 0, 0);
	add(s, MD_DT_F32, 2, N, V, 1, "output.weight", 0, 0);
	for (int i = 0; i < NL; i++) {
		add(s, MD_DT_F32, 1, N, 1, 1, "blk.%d.attn_norm.weight", i, 0);
		add(s, MD_DT_F32, 2, N, QD, 1, "blk.%d.attn_q.weight", i, 0);
		add(s, MD_DT_F32, 2, N, KD, 1, "blk.%d.attn_k.weight", i, 0);
		add(s, MD_DT_F32, 2, N, KD, 1, "blk.%d.attn_v.weight", i, 0);
		add(s, MD_DT_F32, 2, QD, N, 1, "blk.%d.attn_output.weight", i, 0);
		if (bias) {
			add(s, MD_DT_F32, 1, QD, 1, 1, "blk.%d.attn_q.bias", i, 0);
			add(s, MD_DT_F32, 1, KD, 1, 1, "blk.%d.attn_k.bias", i, 0);
			add(s, MD_DT_F32, 1, KD, 1, 1, "blk.%d.attn_v.bias", i, 0);
		}
		if (strcmp(a, "qwen3moe") == 0 || strcmp(a, "qwen3") == 0) {
			add(s, MD_DT_F32, 1, D, 1, 1, "blk.%d.attn_q_norm.weight", i, 0);
			add(s, MD_DT_F32, 1, D, 1, 1, "blk.%d.attn_k_norm.weight", i, 0);
		} else if (strcmp(a, "olmoe") == 0) {
			add(s, MD_DT_F32, 1, QD, 1, 1, "blk.%d.attn_q_norm.weight", i, 0);
			add(s, MD_DT_F32, 1, KD, 1, 1, "blk.%d.attn_k_norm.weight", i, 0);
		}
		if (oss) { /* llama.cpp's llama_model_openai_moe::load_arch_tensors */
			add(s, MD_DT_F32, 1, N, 1, 1, "blk.%d.attn_output.bias", i, 0);
			add(s, MD_DT_F32, 1, H, 1, 1, "blk.%d.attn_sinks.weight", i, 0);
			add(s, MD_DT_F32, 1, N, 1, 1, "blk.%d.post_attention_norm.weight", i, 0);
			add(s, MD_DT_F32, 1, E, 1, 1, "blk.%d.ffn_gate_inp.bias", i, 0);
			add(s, MD_DT_F32, 2, FE, E, 1, "blk.%d.ffn_gate_exps.bias", i, 0);
			add(s, MD_DT_F32, 2, FE, E, 1, "blk.%d.ffn_up_exps.bias", i, 0);
			add(s, MD_DT_F32, 2, N, E, 1, "blk.%d.ffn_down_exps.bias", i, 0);
		} else {
			add(s, MD_DT_F32, 1, N, 1, 1, "blk.%d.ffn_norm.weight", i, 0);
		}
		if (s->moe) {
			add(s, MD_DT_F32, 2, N, E, 1, "blk.%d.ffn_gate_inp.weight", i, 0);
			add(s, MD_DT_F32, 3, N, FE, E, "blk.%d.ffn_gate_exps.weight", i, 0);
			add(s, MD_DT_F32, 3, N, FE, E, "blk.%d.ffn_up_exps.weight", i, 0);
			add(s, MD_DT_F32, 3, FE, N, E, "blk.%d.ffn_down_exps.weight", i, 0);
			if (qwen2moe) {
				add(s, MD_DT_F32, 1, N, 1, 1, "blk.%d.ffn_gate_inp_shexp.weight", i, 0);
				add(s, MD_DT_F32, 2, N, S, 1, "blk.%d.ffn_gate_shexp.weight", i, 0);
				add(s, MD_DT_F32, 2, N, S, 1, "blk.%d.ffn_up_shexp.weight", i, 0);
				add(s, MD_DT_F32, 2, S, N, 1, "blk.%d.ffn_down_shexp.weight", i, 0);
			}
		} else {
			add(s, MD_DT_F32, 2, N, FF, 1, "blk.%d.ffn_gate.weight", i, 0);
			add(s, MD_DT_F32, 2, N, FF, 1, "blk.%d.ffn_up.weight", i, 0);
			add(s, MD_DT_F32, 2, FF, N, 1, "blk.%d.ffn_down.weight", i, 0);
		}
	}
}

/* Replace layer i's merged expert tensors by per-expert 2-D tensors, expert by expert
 * (gate.e, down.e, up.e), as llama.cpp's old convert.py wrote Mixtral. */
static void split_experts(struct spec *s, int i, uint32_t type)
{
	char nm[64];
	const char *what[3] = { "gate", "up", "down" };
	for (int w = 0; w < 3; w++) {
		snprintf(nm, sizeof(nm), "blk.%d.ffn_%s_exps.weight", i, what[w]);
		drop(s, nm);
	}
	for (int e = 0; e < E; e++) {
		add(s, type, 2, N, F, 1, "blk.%d.ffn_gate.%d.weight", i, e);
		add(s, type, 2, F, N, 1, "blk.%d.ffn_down.%d.weight", i, e);
		add(s, type, 2, N, F, 1, "blk.%d.ffn_up.%d.weight", i, e);
	}
}

/* ---------------------------------------------------------------- writing and loading */

/* Tensor data: a deterministic function of the name and element index, quantized to the
 * tensor's type, so two tensors never hold the same bytes. */
static int fill(void *ctx, void *dst, size_t nbytes)
{
	const struct tspec *t = ctx;
	int64_t rows = t->ne[1] * t->ne[2] * t->ne[3];
	size_t rb = md_dtype_row_size((enum md_dtype)t->type, t->ne[0]);
	if (rb * (size_t)rows != nbytes)
		return -EINVAL;
	uint32_t h = 2166136261u;
	for (const char *p = t->name; *p; p++)
		h = (h ^ (uint8_t)*p) * 16777619u;
	float *row = malloc((size_t)t->ne[0] * sizeof(float));
	if (!row)
		return -ENOMEM;
	for (int64_t r = 0; r < rows; r++) {
		for (int64_t j = 0; j < t->ne[0]; j++)
			row[j] = 0.5f * sinf((float)(h % 1000) + 0.37f * (float)(r * t->ne[0] + j));
		if (!md_quantize_row((enum md_dtype)t->type, row, (uint8_t *)dst + (size_t)r * rb,
				     t->ne[0]))
			memset((uint8_t *)dst + (size_t)r * rb, 0, rb); /* a type moed cannot write */
	}
	free(row);
	return 0;
}

static bool omitted(const struct spec *s, const char *suffix)
{
	for (int i = 0; i < 8 && s->omit[i]; i++)
		if (strcmp(s->omit[i], suffix) == 0)
			return true;
	return false;
}

static void kv_u32(struct md_gguf_writer *w, const struct spec *s, const char *suffix, uint32_t v)
{
	char key[128];
	snprintf(key, sizeof(key), "%s.%s", s->arch, suffix);
	if (!omitted(s, suffix))
		md_gguf_w_u32(w, key, v);
}

static char path[512];

static void write_spec(struct spec *s)
{
	const char *dir = getenv("TMPDIR");
	snprintf(path, sizeof(path), "%s/test_model_%ld.gguf", dir && *dir ? dir : "/tmp",
		 (long)getpid());
	struct md_gguf_writer *w = md_gguf_writer_new();
	SETUP(w);
	md_gguf_w_str(w, "general.architecture", s->arch);
	bool oss = strcmp(s->arch, "gpt-oss") == 0;
	bool qwenmoe = strcmp(s->arch, "qwen3moe") == 0 || strcmp(s->arch, "qwen2moe") == 0 || oss;
	kv_u32(w, s, "block_count", NL);
	kv_u32(w, s, "context_length", 512);
	kv_u32(w, s, "embedding_length", N);
	kv_u32(w, s, "feed_forward_length", s->moe && !qwenmoe ? F : FF);
	kv_u32(w, s, "attention.head_count", H);
	kv_u32(w, s, "attention.head_count_kv", K);
	kv_u32(w, s, "attention.key_length", D);
	kv_u32(w, s, "attention.value_length", D);
	char key[128];
	snprintf(key, sizeof(key), "%s.attention.layer_norm_rms_epsilon", s->arch);
	if (!omitted(s, "attention.layer_norm_rms_epsilon"))
		md_gguf_w_f32(w, key, 1e-6f);
	snprintf(key, sizeof(key), "%s.rope.freq_base", s->arch);
	if (!omitted(s, "rope.freq_base"))
		md_gguf_w_f32(w, key, 500000.0f);
	if (s->moe) {
		kv_u32(w, s, "expert_count", E);
		kv_u32(w, s, "expert_used_count", USED);
		if (qwenmoe)
			kv_u32(w, s, "expert_feed_forward_length", F);
		if (strcmp(s->arch, "qwen2moe") == 0)
			kv_u32(w, s, "expert_shared_feed_forward_length", S);
	}
	if (oss) /* as convert_hf_to_gguf.py writes gpt-oss-20b's config (window shortened) */
		kv_u32(w, s, "attention.sliding_window", 8);
	if (s->kv)
		s->kv(w, s->arch);
	for (int i = 0; i < s->n; i++)
		SETUP(md_gguf_w_tensor(w, s->t[i].name, s->t[i].type, s->t[i].n_dims,
						s->t[i].ne, fill, &s->t[i]) == 0);
	char err[256];
	int rc = md_gguf_writer_write(w, path, err, sizeof(err));
	if (rc)
		fprintf(stderr, "write %s: %s\n", path, err);
	SETUP(rc == 0);
	md_gguf_writer_free(w);
}

static struct md_model model;
static char err[512];

/* Write s and load it; returns md_model_load's code (err holds its line). The model stays
 * loaded on success until the next load_spec or unload. */
static int load_spec(struct spec *s)
{
	write_spec(s);
	err[0] = 0;
	int rc = md_model_load(&model, path, err, sizeof(err));
	unlink(path);
	return rc;
}

static void unload(void)
{
	md_model_free(&model);
}

/* The file loads; prints its error otherwise. */
#define EXPECT_LOADS(s)                                                                  \
	do {                                                                             \
		int rc_ = load_spec(s);                                                  \
		if (rc_ != 0) {                                                          \
			fprintf(stderr, "%s:%d: load failed (%d): %s\n", __FILE__, __LINE__, rc_, err); \
			failures++;                                                      \
			return;                                                          \
		}                                                                        \
	} while (0)

/* The file is refused with code `code` and an error line holding each of the strings. */
static void expect_refused_(int line, struct spec *s, int code, const char *const *subs)
{
	int rc = load_spec(s);
	if (rc == 0) {
		fprintf(stderr, "test_model.c:%d: load succeeded, expected an error\n", line);
		failures++;
		unload();
		return;
	}
	if (getenv("TEST_MODEL_VERBOSE"))
		printf("  refused (%d): %s\n", rc, err);
	if (rc != code) {
		fprintf(stderr, "test_model.c:%d: code %d, expected %d (%s)\n", line, rc, code, err);
		failures++;
	}
	for (; *subs; subs++) {
		if (!strstr(err, *subs)) {
			fprintf(stderr, "test_model.c:%d: error \"%s\" does not say \"%s\"\n", line, err, *subs);
			failures++;
		}
	}
	if (model.tensors || model.layers || model.owned_bytes) {
		fprintf(stderr, "test_model.c:%d: failed load left state behind\n", line);
		failures++;
	}
}
#define EXPECT_REFUSED(s, code, ...) \
	expect_refused_(__LINE__, s, code, (const char *const[]){ __VA_ARGS__, NULL })

static bool in_map(const void *p)
{
	const uint8_t *b = model.gguf.base;
	return (const uint8_t *)p >= b && (const uint8_t *)p < b + model.gguf.size;
}

static const struct md_gguf_tensor *file_tensor(const char *name)
{
	const struct md_gguf_tensor *gt = md_gguf_find_tensor(&model.gguf, name);
	SETUP(gt);
	return gt;
}

/* The bound vector t holds exactly the f32 values of the file's tensor `name`. */
static void check_vector_equals_file(const struct md_tensor *t, const char *name, int64_t n)
{
	const struct md_gguf_tensor *gt = file_tensor(name);
	float *want = malloc((size_t)n * sizeof(float));
	md_dequant_row((enum md_dtype)gt->type, gt->data, want, n);
	CHECK_EQ_U(t->type, MD_DT_F32);
	CHECK(memcmp(t->data, want, (size_t)n * sizeof(float)) == 0);
	free(want);
}

/* Expert e's matrix of the bound expert tensor t has the bytes of file tensor `name`. */
static void check_expert_bytes(const struct md_tensor *t, int e, const char *name)
{
	const struct md_gguf_tensor *gt = file_tensor(name);
	struct md_mat m = md_mat_of(t, e);
	CHECK_EQ_U(m.n_in, gt->ne[0]);
	CHECK_EQ_U(m.n_out, gt->ne[1]);
	CHECK(memcmp(m.data, gt->data, gt->nbytes) == 0);
}

/* ---------------------------------------------------------------- cases */

/* The case: convert_hf_to_gguf.py writes Qwen2-MoE's shared-expert gate as a 2-D
 * {n_embd, 1} tensor (f32). llama.cpp ignores trailing 1s, so must moed. */
static void t_qwen2moe_shexp_gate_2d(void)
{
	struct spec s;
	spec_init(&s, "qwen2moe");
	for (int i = 0; i < NL; i++) {
		char nm[64];
		snprintf(nm, sizeof(nm), "blk.%d.ffn_gate_inp_shexp.weight", i);
		struct tspec *t = find(&s, nm);
		t->n_dims = 2;
		t->ne[1] = 1;
	}
	EXPECT_LOADS(&s);
	const struct md_tensor *g = model.layers[1].gate_inp_shexp;
	CHECK(g != NULL);
	CHECK_EQ_I(g->ne[0], N);
	CHECK_EQ_I(g->ne[1], 1);
	CHECK(in_map(g->data)); /* f32 already: borrowed, not copied */
	check_vector_equals_file(g, "blk.1.ffn_gate_inp_shexp.weight", N);
	unload();
}

/* Older converters wrote that gate in the file's float type: f16 [n_embd, 1] converts to f32. */
static void t_qwen2moe_shexp_gate_2d_f16(void)
{
	struct spec s;
	spec_init(&s, "qwen2moe");
	for (int i = 0; i < NL; i++) {
		char nm[64];
		snprintf(nm, sizeof(nm), "blk.%d.ffn_gate_inp_shexp.weight", i);
		struct tspec *t = find(&s, nm);
		t->n_dims = 2;
		t->ne[1] = 1;
		t->type = MD_DT_F16;
	}
	EXPECT_LOADS(&s);
	const struct md_tensor *g = model.layers[0].gate_inp_shexp;
	CHECK(!in_map(g->data));
	CHECK(model.owned_bytes >= NL * N * sizeof(float));
	check_vector_equals_file(g, "blk.0.ffn_gate_inp_shexp.weight", N);
	unload();
}

/* Norms and biases in f16 / bf16 (llama.cpp accepts them) are converted to f32 at load. */
static void t_vectors_f16_bf16(void)
{
	struct spec s;
	spec_init(&s, "qwen2");
	for (int i = 0; i < s.n; i++)
		if (s.t[i].n_dims == 1)
			s.t[i].type = strstr(s.t[i].name, "bias") ? MD_DT_BF16 : MD_DT_F16;
	EXPECT_LOADS(&s);
	check_vector_equals_file(model.output_norm, "output_norm.weight", N);
	check_vector_equals_file(model.layers[1].attn_norm, "blk.1.attn_norm.weight", N);
	check_vector_equals_file(model.layers[1].bk, "blk.1.attn_k.bias", K * D);
	CHECK_EQ_U(model.layers[0].wq->type, MD_DT_F32); /* matrices untouched */
	CHECK(in_map(model.layers[0].wq->data));
	unload();
}

/* A quantized vector is refused, naming it and the types accepted. */
static void t_vector_quantized_refused(void)
{
	struct spec s;
	spec_init(&s, "qwen3moe");
	find(&s, "blk.1.ffn_norm.weight")->type = MD_DT_Q8_0;
	EXPECT_REFUSED(&s, -ENOTSUP, "'blk.1.ffn_norm.weight'", "q8_0", "expected f32, f16 or bf16");
}

/* A weight of a type moed has no kernels for (q8_1: GGML sizes it, files never carry it) is
 * refused at load, naming the tensor, the type and every supported type. */
static void t_weight_type_refused(void)
{
	struct spec s;
	spec_init(&s, "qwen3moe");
	find(&s, "blk.0.attn_q.weight")->type = MD_DT_Q8_1;
	EXPECT_REFUSED(&s, -ENOTSUP, "'blk.0.attn_q.weight'", "weight type q8_1",
		       "supported: f32, f16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_K, q3_K, q4_K, q5_K, q6_K, iq4_nl, iq4_xs, bf16, mxfp4");
}

/* Trailing dimensions of 1 on any tensor: [a, b, 1] and [a, b, 1, 1] match [a, b]. */
static void t_trailing_ones(void)
{
	struct spec s;
	spec_init(&s, "qwen3moe");
	find(&s, "blk.0.attn_q.weight")->n_dims = 3;
	find(&s, "token_embd.weight")->n_dims = 4;
	find(&s, "blk.1.ffn_gate_inp.weight")->n_dims = 3;
	struct tspec *t = find(&s, "blk.0.attn_norm.weight");
	t->n_dims = 4;
	EXPECT_LOADS(&s);
	CHECK_EQ_I(model.layers[0].wq->ne[1], H * D);
	CHECK_EQ_U(model.hp.n_vocab, V);
	unload();
}

/* A dimension that is not 1 past the expected ones, or a wrong size, is refused naming the
 * tensor, its shape and the expected shape. */
static void t_wrong_shape_refused(void)
{
	struct spec s;
	spec_init(&s, "qwen2moe");
	struct tspec *t = find(&s, "blk.0.ffn_gate_inp_shexp.weight");
	t->n_dims = 2;
	t->ne[1] = 2;
	EXPECT_REFUSED(&s, -EINVAL, "'blk.0.ffn_gate_inp_shexp.weight'", "shape [64, 2]",
		       "expected [64]");
	spec_init(&s, "qwen3moe");
	find(&s, "blk.1.attn_k.weight")->ne[1] = H * D;
	EXPECT_REFUSED(&s, -EINVAL, "'blk.1.attn_k.weight'", "shape [64, 64]", "expected [64, 32]");
	spec_init(&s, "mixtral");
	find(&s, "blk.1.ffn_down_exps.weight")->ne[2] = E + 1;
	EXPECT_REFUSED(&s, -EINVAL, "'blk.1.ffn_down_exps.weight'", "expected [32, 64, 4]");
}

/* Old Mixtral files: per-expert tensors in expert order are evenly spaced in the file, so the
 * merged tensor is a view of the map with nb2 the spacing (three matrices here). */
static void t_mixtral_split_experts_view(void)
{
	struct spec s;
	spec_init(&s, "mixtral");
	for (int i = 0; i < NL; i++)
		split_experts(&s, i, MD_DT_Q8_0);
	EXPECT_LOADS(&s);
	const struct md_tensor *g = model.layers[1].gate_exps;
	size_t mat = md_dtype_row_size(MD_DT_Q8_0, N) * F;
	CHECK(in_map(g->data));
	CHECK_EQ_U(g->nb2, 3 * mat); /* gate.e, down.e, up.e: 32-byte aligned sizes, no padding */
	CHECK_EQ_I(g->ne[2], E);
	CHECK(g->name_len == strlen("blk.1.ffn_gate_exps.weight") &&
	      memcmp(g->name, "blk.1.ffn_gate_exps.weight", g->name_len) == 0);
	char nm[64];
	for (int e = 0; e < E; e++) {
		snprintf(nm, sizeof(nm), "blk.1.ffn_gate.%d.weight", e);
		check_expert_bytes(model.layers[1].gate_exps, e, nm);
		snprintf(nm, sizeof(nm), "blk.1.ffn_down.%d.weight", e);
		check_expert_bytes(model.layers[1].down_exps, e, nm);
		snprintf(nm, sizeof(nm), "blk.1.ffn_up.%d.weight", e);
		check_expert_bytes(model.layers[1].up_exps, e, nm);
	}
	CHECK_EQ_U(model.owned_bytes, 0); /* nothing copied */
	unload();
}

/* Per-expert tensors not evenly spaced (experts written out of order): merged into one
 * model-owned buffer, experts one matrix apart. */
static void t_mixtral_split_experts_copy(void)
{
	struct spec s;
	spec_init(&s, "mixtral");
	split_experts(&s, 0, MD_DT_F16);
	/* swap expert 1 and 2 of layer 0 in file order */
	struct tspec *a = find(&s, "blk.0.ffn_gate.1.weight"), tmp[3];
	struct tspec *b = find(&s, "blk.0.ffn_gate.2.weight");
	memcpy(tmp, a, sizeof(tmp));
	memcpy(a, b, sizeof(tmp));
	memcpy(b, tmp, sizeof(tmp));
	EXPECT_LOADS(&s);
	const struct md_tensor *g = model.layers[0].up_exps;
	size_t mat = md_dtype_row_size(MD_DT_F16, N) * F;
	CHECK(!in_map(g->data));
	CHECK_EQ_U(g->nb2, mat);
	CHECK(model.owned_bytes >= 3 * E * mat);
	char nm[64];
	for (int e = 0; e < E; e++) {
		snprintf(nm, sizeof(nm), "blk.0.ffn_up.%d.weight", e);
		check_expert_bytes(g, e, nm);
		snprintf(nm, sizeof(nm), "blk.0.ffn_down.%d.weight", e);
		check_expert_bytes(model.layers[0].down_exps, e, nm);
	}
	CHECK(in_map(model.layers[1].gate_exps->data)); /* layer 1 stays merged in the file */
	unload();
}

static void t_mixtral_split_experts_refused(void)
{
	struct spec s;
	spec_init(&s, "mixtral");
	split_experts(&s, 1, MD_DT_F32);
	drop(&s, "blk.1.ffn_up.3.weight");
	EXPECT_REFUSED(&s, -EINVAL, "missing tensor 'blk.1.ffn_up.3.weight'", "experts 0..3");
	spec_init(&s, "mixtral");
	split_experts(&s, 1, MD_DT_F32);
	find(&s, "blk.1.ffn_down.2.weight")->type = MD_DT_F16;
	EXPECT_REFUSED(&s, -EINVAL, "'blk.1.ffn_down.2.weight' is f16 but expert 0 is f32");
	spec_init(&s, "mixtral");
	drop(&s, "blk.0.ffn_gate_exps.weight");
	EXPECT_REFUSED(&s, -EINVAL, "missing tensor 'blk.0.ffn_gate_exps.weight'",
		       "per-expert tensors 'blk.0.ffn_gate.0.weight'");
}

/* output.weight absent: tied to token_embd where llama.cpp allows it (llama, qwen2, qwen3,
 * qwen3moe), refused by name where it is required (qwen2moe, olmoe). */
static void t_output_absent(void)
{
	const char *tied[] = { "qwen3moe", "mixtral", "llama", "qwen2", "qwen3" };
	struct spec s;
	for (size_t i = 0; i < sizeof(tied) / sizeof(tied[0]); i++) {
		spec_init(&s, tied[i]);
		drop(&s, "output.weight");
		EXPECT_LOADS(&s);
		CHECK(model.hp.tied_output);
		CHECK(model.output == model.tok_embd);
		unload();
	}
	const char *req[] = { "qwen2moe", "olmoe" };
	for (size_t i = 0; i < 2; i++) {
		spec_init(&s, req[i]);
		drop(&s, "output.weight");
		EXPECT_REFUSED(&s, -EINVAL, "missing tensor 'output.weight'");
	}
}

/* q/k/v biases are optional for every arch in llama.cpp (create_tensor_qkv). */
static void t_optional_biases(void)
{
	struct spec s;
	spec_init(&s, "qwen3moe");
	for (int i = 0; i < NL; i++) {
		add(&s, MD_DT_F32, 1, H * D, 1, 1, "blk.%d.attn_q.bias", i, 0);
		add(&s, MD_DT_F32, 1, K * D, 1, 1, "blk.%d.attn_k.bias", i, 0);
		add(&s, MD_DT_F32, 1, K * D, 1, 1, "blk.%d.attn_v.bias", i, 0);
	}
	EXPECT_LOADS(&s);
	CHECK(model.layers[1].bq && model.layers[1].bk && model.layers[1].bv);
	unload();
	spec_init(&s, "qwen2");
	for (int i = 0; i < NL; i++) {
		char nm[64];
		snprintf(nm, sizeof(nm), "blk.%d.attn_v.bias", i);
		drop(&s, nm);
	}
	EXPECT_LOADS(&s);
	CHECK(model.layers[0].bq && !model.layers[0].bv);
	unload();
}

/* A tensor llama.cpp would read but moed would skip changes the output: refused by name. */
static void t_unused_tensor_refused(void)
{
	struct spec s;
	spec_init(&s, "llama");
	add(&s, MD_DT_F32, 1, N, 1, 1, "blk.%d.attn_output.bias", 1, 0);
	EXPECT_REFUSED(&s, -ENOTSUP, "'blk.1.attn_output.bias' is not supported for arch llama");
	spec_init(&s, "llama");
	add(&s, MD_DT_F32, 1, D / 2, 1, 1, "rope_freqs.weight", 0, 0);
	EXPECT_REFUSED(&s, -ENOTSUP, "'rope_freqs.weight'");
}

static void t_missing_tensor_refused(void)
{
	struct spec s;
	spec_init(&s, "olmoe");
	drop(&s, "blk.1.attn_k_norm.weight");
	EXPECT_REFUSED(&s, -EINVAL, "missing tensor 'blk.1.attn_k_norm.weight'", "arch olmoe");
	spec_init(&s, "qwen3");
	drop(&s, "token_embd.weight");
	EXPECT_REFUSED(&s, -EINVAL, "missing tensor 'token_embd.weight'");
}

/* Optional keys take llama.cpp's defaults. */
static void t_metadata_defaults(void)
{
	struct spec s;
	spec_init(&s, "qwen3moe");
	s.omit[0] = "attention.key_length";   /* n_embd / n_head = 16 */
	s.omit[1] = "attention.value_length";
	s.omit[2] = "rope.freq_base";         /* 10000 */
	s.omit[3] = "context_length";
	EXPECT_LOADS(&s);
	CHECK_EQ_U(model.hp.head_dim, N / H);
	CHECK_EQ_U(model.hp.n_rot, N / H);
	CHECK_EQ_F(model.hp.rope_freq_base, 10000.0f);
	unload();

	/* head_count_kv absent: = head_count (so the k/v projections are H * D wide). */
	spec_init(&s, "llama");
	s.omit[0] = "attention.head_count_kv";
	for (int i = 0; i < NL; i++) {
		char nm[64];
		snprintf(nm, sizeof(nm), "blk.%d.attn_k.weight", i);
		find(&s, nm)->ne[1] = H * D;
		snprintf(nm, sizeof(nm), "blk.%d.attn_v.weight", i);
		find(&s, nm)->ne[1] = H * D;
	}
	EXPECT_LOADS(&s);
	CHECK_EQ_U(model.hp.n_head_kv, H);
	unload();
}

/* expert_feed_forward_length absent: llama.cpp takes n_ff / n_expert_used. */
static void kv_ff_for_default(struct md_gguf_writer *w, const char *arch)
{
	char key[128];
	snprintf(key, sizeof(key), "%s.feed_forward_length", arch);
	md_gguf_w_u32(w, key, F * USED);
}

static void t_expert_ff_default(void)
{
	struct spec s;
	spec_init(&s, "qwen3moe");
	s.omit[0] = "expert_feed_forward_length";
	s.kv = kv_ff_for_default;
	EXPECT_LOADS(&s);
	CHECK_EQ_U(model.hp.n_ff_exp, F);
	unload();
	/* Without the key and with feed_forward_length the experts' width, the shapes disagree
	 * with llama.cpp's default and the error names the tensor and the width expected. */
	spec_init(&s, "qwen3moe");
	s.omit[0] = "expert_feed_forward_length";
	EXPECT_REFUSED(&s, -EINVAL, "'blk.0.ffn_gate_exps.weight'", "expected [64, 48, 4]");
}

static void t_metadata_required(void)
{
	struct spec s;
	spec_init(&s, "qwen2moe");
	s.omit[0] = "attention.layer_norm_rms_epsilon";
	EXPECT_REFUSED(&s, -EINVAL, "missing metadata 'qwen2moe.attention.layer_norm_rms_epsilon'");
	spec_init(&s, "olmoe");
	s.omit[0] = "block_count";
	EXPECT_REFUSED(&s, -EINVAL, "missing metadata 'olmoe.block_count'");
	spec_init(&s, "qwen3moe");
	s.omit[0] = "expert_count";
	EXPECT_REFUSED(&s, -EINVAL, "'qwen3moe.expert_count' missing");
}

static void kv_head_str(struct md_gguf_writer *w, const char *arch)
{
	char key[128];
	snprintf(key, sizeof(key), "%s.attention.head_count", arch);
	md_gguf_w_str(w, key, "4");
}

static void kv_arrays_uniform(struct md_gguf_writer *w, const char *arch)
{
	char key[128];
	const int32_t kv[NL] = { K, K }, ff[NL] = { FF, FF };
	snprintf(key, sizeof(key), "%s.attention.head_count_kv", arch);
	md_gguf_w_arr_i32(w, key, kv, NL);
	snprintf(key, sizeof(key), "%s.feed_forward_length", arch);
	md_gguf_w_arr_i32(w, key, ff, NL);
}

static void kv_arrays_differ(struct md_gguf_writer *w, const char *arch)
{
	char key[128];
	const int32_t kv[NL] = { K, H };
	snprintf(key, sizeof(key), "%s.attention.head_count_kv", arch);
	md_gguf_w_arr_i32(w, key, kv, NL);
}

static void kv_arrays_short(struct md_gguf_writer *w, const char *arch)
{
	char key[128];
	const int32_t kv[1] = { K };
	snprintf(key, sizeof(key), "%s.attention.head_count_kv", arch);
	md_gguf_w_arr_i32(w, key, kv, 1);
}

/* Per-layer arrays (llama.cpp's get_key_or_arr): equal values load, others are named. */
static void t_metadata_arrays(void)
{
	struct spec s;
	spec_init(&s, "qwen3");
	s.kv = kv_arrays_uniform;
	EXPECT_LOADS(&s);
	CHECK_EQ_U(model.hp.n_head_kv, K);
	CHECK_EQ_U(model.hp.n_ff, FF);
	unload();
	spec_init(&s, "qwen3");
	s.kv = kv_arrays_differ;
	EXPECT_REFUSED(&s, -ENOTSUP, "'qwen3.attention.head_count_kv' differs per layer",
		       "2 at layer 0, 4 at layer 1");
	spec_init(&s, "qwen3");
	s.kv = kv_arrays_short;
	EXPECT_REFUSED(&s, -EINVAL, "'qwen3.attention.head_count_kv' has 1 entries, expected 2");
	spec_init(&s, "qwen3");
	s.kv = kv_head_str;
	EXPECT_REFUSED(&s, -EINVAL, "'qwen3.attention.head_count' has type string",
		       "expected an unsigned integer");
}

static void kv_rope_linear4(struct md_gguf_writer *w, const char *arch)
{
	char key[128];
	snprintf(key, sizeof(key), "%s.rope.scaling.type", arch);
	md_gguf_w_str(w, key, "linear");
	snprintf(key, sizeof(key), "%s.rope.scaling.factor", arch);
	md_gguf_w_f32(w, key, 4.0f);
}

static void kv_rope_yarn1(struct md_gguf_writer *w, const char *arch)
{
	char key[128];
	snprintf(key, sizeof(key), "%s.rope.scaling.type", arch);
	md_gguf_w_str(w, key, "yarn");
	snprintf(key, sizeof(key), "%s.rope.scaling.factor", arch);
	md_gguf_w_f32(w, key, 1.0f);
}

static void kv_rope_none4(struct md_gguf_writer *w, const char *arch)
{
	char key[128];
	snprintf(key, sizeof(key), "%s.rope.scaling.type", arch);
	md_gguf_w_str(w, key, "none");
	snprintf(key, sizeof(key), "%s.rope.scaling.factor", arch);
	md_gguf_w_f32(w, key, 4.0f);
}

/* Rope scaling that changes the angles is refused by key; scaling that is the identity loads. */
static void t_rope_scaling(void)
{
	struct spec s;
	spec_init(&s, "qwen3moe");
	s.kv = kv_rope_linear4;
	EXPECT_REFUSED(&s, -ENOTSUP, "'qwen3moe.rope.scaling.factor' is 4", "expected 0 or 1");
	spec_init(&s, "qwen3moe");
	s.kv = kv_rope_yarn1;
	EXPECT_LOADS(&s);
	unload();
	spec_init(&s, "qwen3moe");
	s.kv = kv_rope_none4;
	EXPECT_LOADS(&s);
	unload();
}

static void kv_yarn32(struct md_gguf_writer *w, const char *arch)
{
	char key[128];
	snprintf(key, sizeof(key), "%s.rope.scaling.type", arch);
	md_gguf_w_str(w, key, "yarn");
	snprintf(key, sizeof(key), "%s.rope.scaling.factor", arch);
	md_gguf_w_f32(w, key, 32.0f);
	snprintf(key, sizeof(key), "%s.rope.scaling.original_context_length", arch);
	md_gguf_w_u32(w, key, 4096);
}

static void kv_yarn_log_mul(struct md_gguf_writer *w, const char *arch)
{
	kv_yarn32(w, arch);
	char key[128];
	snprintf(key, sizeof(key), "%s.rope.scaling.yarn_log_multiplier", arch);
	md_gguf_w_f32(w, key, 0.1f);
}

static void kv_oss_pattern3(struct md_gguf_writer *w, const char *arch)
{
	kv_yarn32(w, arch);
	char key[128];
	snprintf(key, sizeof(key), "%s.attention.sliding_window_pattern", arch);
	md_gguf_w_u32(w, key, 3);
	snprintf(key, sizeof(key), "%s.rope.freq_base_swa", arch);
	md_gguf_w_f32(w, key, 10000.0f);
}

/* gpt-oss as the converter writes it: sinks, post_attention_norm as the FFN norm, biases on
 * the output projection, router and experts (the 2-D expert biases f16 here: read as f32),
 * the window, YaRN; llama.cpp's default pattern: even layers slide. */
static void t_gpt_oss(void)
{
	struct spec s;
	spec_init(&s, "gpt-oss");
	s.kv = kv_yarn32;
	find(&s, "blk.1.ffn_up_exps.bias")->type = MD_DT_F16;
	EXPECT_LOADS(&s);
	const struct md_hparams *hp = &model.hp;
	CHECK_EQ_U(hp->arch, MD_ARCH_GPT_OSS);
	CHECK_EQ_U(hp->n_swa, 8);
	CHECK(md_layer_is_swa(hp, 0) && !md_layer_is_swa(hp, 1));
	CHECK(hp->yarn_ext_factor == 1.0f);
	CHECK(fabsf(hp->rope_freq_scale - 1.0f / 32) < 1e-9f);
	/* llama.cpp's cparams.yarn_attn_factor: get_mscale(32) / (1 + 0.1 ln 32) = 1, so the
	 * rope's magnitude is GGML's own 1 + 0.1 ln 32; q.k unscaled. */
	CHECK(fabsf(hp->yarn_attn_factor - 1.0f) < 1e-6f);
	CHECK(fabsf(hp->attn_scale - 1.0f / sqrtf((float)D)) < 1e-9f);
	CHECK_EQ_U(hp->n_ctx_orig_yarn, 4096);
	CHECK(hp->rope_freq_base_swa == hp->rope_freq_base);
	CHECK_EQ_U(hp->ffn_act, MD_ACT_SWIGLU_OAI);
	CHECK_EQ_U(hp->n_ff_exp, F);
	const struct md_layer *L = &model.layers[1];
	CHECK(L->attn_sinks && L->bo && L->gate_inp_b && L->gate_exps_b && L->down_exps_b);
	check_vector_equals_file(L->attn_sinks, "blk.1.attn_sinks.weight", H);
	check_vector_equals_file(L->ffn_norm, "blk.1.post_attention_norm.weight", N);
	check_vector_equals_file(L->up_exps_b, "blk.1.ffn_up_exps.bias", F * E);
	CHECK_EQ_U(L->up_exps_b->type, MD_DT_F32);
	CHECK_EQ_U(L->down_exps_b->ne[0], N);
	CHECK_EQ_U(L->down_exps_b->ne[1], E);
	CHECK_EQ_U(model.n_tensors, (size_t)s.n);
	unload();
	/* A pattern from the file, and the sliding layers' own rope base. */
	spec_init(&s, "gpt-oss");
	s.kv = kv_oss_pattern3;
	EXPECT_LOADS(&s);
	CHECK(md_layer_is_swa(&model.hp, 0) && md_layer_is_swa(&model.hp, 1));
	CHECK(model.hp.rope_freq_base_swa == 10000.0f);
	unload();
}

/* What gpt-oss needs and a file may lack or get wrong, each named. */
static void t_gpt_oss_refused(void)
{
	struct spec s;
	spec_init(&s, "gpt-oss");
	drop(&s, "blk.1.attn_sinks.weight");
	EXPECT_REFUSED(&s, -EINVAL, "missing tensor 'blk.1.attn_sinks.weight'", "arch gpt-oss");
	spec_init(&s, "gpt-oss");
	drop(&s, "blk.0.ffn_down_exps.bias");
	EXPECT_REFUSED(&s, -EINVAL, "missing tensor 'blk.0.ffn_down_exps.bias'");
	spec_init(&s, "gpt-oss");
	find(&s, "blk.0.ffn_gate_exps.bias")->type = MD_DT_Q8_0;
	EXPECT_REFUSED(&s, -ENOTSUP, "bias tensor 'blk.0.ffn_gate_exps.bias' is q8_0",
		       "expected f32, f16 or bf16");
	spec_init(&s, "gpt-oss");
	s.omit[0] = "attention.sliding_window";
	EXPECT_REFUSED(&s, -EINVAL, "missing metadata 'gpt-oss.attention.sliding_window'");
	spec_init(&s, "gpt-oss");
	s.kv = kv_yarn_log_mul;
	EXPECT_REFUSED(&s, -ENOTSUP, "'gpt-oss.rope.scaling.yarn_log_multiplier' is 0.1");
}

/* An architecture moed does not know is named, with every one it does. */
static void t_arch_unsupported(void)
{
	struct spec s;
	spec_init(&s, "qwen3");
	s.arch = "bogus-arch";
	EXPECT_REFUSED(&s, -ENOTSUP, "unsupported architecture 'bogus-arch'", "general.architecture",
		       "supported: qwen3moe, qwen2moe, llama (dense, or Mixtral with experts), olmoe, qwen2, qwen3, gpt-oss, deepseek2, glm4moe");
}

/* Every arch in its plain layout loads, with the shapes bound as the forward pass reads them. */
static void t_plain_all_archs(void)
{
	const char *archs[] = { "qwen3moe", "qwen2moe", "mixtral", "olmoe", "llama", "qwen2", "qwen3",
				"gpt-oss" };
	struct spec s;
	for (size_t i = 0; i < sizeof(archs) / sizeof(archs[0]); i++) {
		spec_init(&s, archs[i]);
		EXPECT_LOADS(&s);
		CHECK_EQ_U(model.owned_bytes, 0);
		CHECK(!model.hp.tied_output);
		CHECK_EQ_U(model.n_tensors, (size_t)s.n);
		unload();
	}
}

static const struct {
	const char *name;
	void (*fn)(void);
} cases[] = {
	{ "plain-all-archs", t_plain_all_archs },
	{ "qwen2moe-shexp-gate-2d", t_qwen2moe_shexp_gate_2d },
	{ "qwen2moe-shexp-gate-2d-f16", t_qwen2moe_shexp_gate_2d_f16 },
	{ "vectors-f16-bf16", t_vectors_f16_bf16 },
	{ "vector-quantized-refused", t_vector_quantized_refused },
	{ "weight-type-refused", t_weight_type_refused },
	{ "trailing-ones", t_trailing_ones },
	{ "wrong-shape-refused", t_wrong_shape_refused },
	{ "mixtral-split-experts-view", t_mixtral_split_experts_view },
	{ "mixtral-split-experts-copy", t_mixtral_split_experts_copy },
	{ "mixtral-split-experts-refused", t_mixtral_split_experts_refused },
	{ "output-absent", t_output_absent },
	{ "optional-biases", t_optional_biases },
	{ "unused-tensor-refused", t_unused_tensor_refused },
	{ "missing-tensor-refused", t_missing_tensor_refused },
	{ "metadata-defaults", t_metadata_defaults },
	{ "expert-ff-default", t_expert_ff_default },
	{ "metadata-required", t_metadata_required },
	{ "metadata-arrays", t_metadata_arrays },
	{ "rope-scaling", t_rope_scaling },
	{ "gpt-oss", t_gpt_oss },
	{ "gpt-oss-refused", t_gpt_oss_refused },
	{ "arch-unsupported", t_arch_unsupported },
};

int main(int argc, char **argv)
{
	int ran = 0;
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		if (argc > 1 && strcmp(argv[1], cases[i].name) != 0)
			continue;
		int before = failures;
		cases[i].fn();
		printf("%-32s %s\n", cases[i].name, failures == before ? "ok" : "FAIL");
		ran++;
	}
	if (!ran) {
		fprintf(stderr, "test_model: no case '%s'\n", argc > 1 ? argv[1] : "");
		return 2;
	}
	return failures ? 1 : 0;
}
