/* Architecture binding: read hyper-parameters and bind tensors of a GGUF model by name. */
#include "engine/model.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct arch_desc {
	enum md_arch arch;
	const char *name;
	enum md_rope_type rope;
	bool norm_topk;
	bool output_required; /* no tied embeddings */
};

static const struct arch_desc archs[] = {
	{ MD_ARCH_QWEN3MOE, "qwen3moe", MD_ROPE_NEOX, true, false },
	{ MD_ARCH_QWEN2MOE, "qwen2moe", MD_ROPE_NEOX, false, true },
	{ MD_ARCH_LLAMA, "llama", MD_ROPE_NORM, true, false },
	{ MD_ARCH_OLMOE, "olmoe", MD_ROPE_NEOX, false, true },
	{ MD_ARCH_QWEN2, "qwen2", MD_ROPE_NEOX, false, false },
	{ MD_ARCH_QWEN3, "qwen3", MD_ROPE_NEOX, false, false },
	{ MD_ARCH_GPT_OSS, "gpt-oss", MD_ROPE_NEOX, false, true },
	{ MD_ARCH_DEEPSEEK2, "deepseek2", MD_ROPE_NORM, false, false },
	{ MD_ARCH_GLM4MOE, "glm4moe", MD_ROPE_NEOX, false, false },
};

#define N_ARCHS (sizeof(archs) / sizeof(archs[0]))

const char *md_arch_name(enum md_arch a)
{
	for (size_t i = 0; i < N_ARCHS; i++)
		if (archs[i].arch == a)
			return archs[i].name;
	return "?";
}

bool md_layer_is_swa(const struct md_hparams *hp, uint32_t il)
{
	return hp->n_swa > 0 && (hp->swa_period == 0 || il % hp->swa_period < hp->swa_period - 1);
}

bool md_model_is_moe(const struct md_model *m)
{
	return m->hp.n_expert > 0;
}

struct md_kv_rows md_model_kv_rows(const struct md_model *m)
{
	const struct md_hparams *hp = &m->hp;
	struct md_kv_rows r;
	if (hp->kv_lora_rank) {
		r.k_dim = hp->kv_lora_rank + hp->n_rot;
		r.v_dim = 0;
		r.k_half = true;
	} else {
		r.k_dim = r.v_dim = hp->n_head_kv * hp->head_dim;
		r.k_half = false;
	}
	return r;
}

__attribute__((format(printf, 3, 4)))
static void seterr(char *err, size_t errlen, const char *fmt, ...)
{
	if (!err || !errlen)
		return;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(err, errlen, fmt, ap);
	va_end(ap);
}

/* ---------------------------------------------------------------- model-owned buffers */

struct md_model_buf {
	struct md_model_buf *next;
	void *data; /* owned: 64-byte aligned */
};

/* A zeroed buffer of n bytes owned by m (freed by md_model_free), or NULL. Tensor data
 * (data true) counts in m->owned_bytes, names do not. */
static void *model_alloc(struct md_model *m, size_t n, bool data)
{
	struct md_model_buf *b = malloc(sizeof(*b));
	size_t sz = (n + 63) & ~(size_t)63;
	if (!b || !(b->data = aligned_alloc(64, sz ? sz : 64))) {
		free(b);
		return NULL;
	}
	memset(b->data, 0, sz ? sz : 64);
	b->next = m->_bufs;
	m->_bufs = b;
	m->owned_bytes += data ? n : 0;
	return b->data;
}

static void free_bufs(struct md_model *m)
{
	while (m->_bufs) {
		struct md_model_buf *b = m->_bufs;
		m->_bufs = b->next;
		free(b->data);
		free(b);
	}
	m->owned_bytes = 0;
}

/* ---------------------------------------------------------------- binding */

struct binder {
	struct md_model *m;
	char *err;
	size_t errlen;
	int rc;
	uint8_t *used; /* owned (gguf.n_tensors): 1 once a binding consumed that tensor */
};

static void fmt_shape(char *buf, size_t len, const int64_t *ne, int n)
{
	size_t o = (size_t)snprintf(buf, len, "[");
	for (int i = 0; i < n && o < len; i++)
		o += (size_t)snprintf(buf + o, len - o, "%s%lld", i ? ", " : "", (long long)ne[i]);
	if (o < len)
		snprintf(buf + o, len - o, "]");
}

/* llama.cpp's rule (llama_model_loader::check_tensor_dims): the first n dims must equal
 * want[], every dim past them must be 1. So [n, 1] matches [n], and [a, b, 1, 1] [a, b]. */
static bool shape_matches(const struct md_gguf_tensor *gt, int n, const int64_t *want)
{
	for (int i = 0; i < MD_GGUF_MAX_DIMS; i++)
		if (gt->ne[i] != (i < n ? want[i] : 1))
			return false;
	return true;
}

static bool shape_error(struct binder *b, const char *name, const struct md_gguf_tensor *gt,
			int n, const int64_t *want)
{
	char got[96], exp[96];
	fmt_shape(got, sizeof(got), gt->ne, (int)gt->n_dims);
	fmt_shape(exp, sizeof(exp), want, n);
	seterr(b->err, b->errlen,
	       "model: tensor '%s' has shape %s, expected %s (arch %s; trailing dimensions of 1 are ignored)",
	       name, got, exp, b->m->hp.arch_name);
	b->rc = -EINVAL;
	return false;
}

/* Check shape and type of gt against want; on failure set b->rc and err. */
static bool check_tensor(struct binder *b, const char *name, const struct md_gguf_tensor *gt,
			 int n, const int64_t *want, bool vec)
{
	if (!shape_matches(gt, n, want))
		return shape_error(b, name, gt, n, want);
	const struct md_dtype_info *ti = md_dtype_info(gt->type);
	if (!ti || !ti->supported) {
		char names[256];
		seterr(b->err, b->errlen, "model: tensor '%s' has weight type %s, which moed does "
		       "not support (supported: %s)", name, ti ? ti->name : "(unknown)",
		       md_dtype_supported_names(names, sizeof(names)));
		b->rc = -ENOTSUP;
		return false;
	}
	/* Norm weights, biases and gate vectors are read as plain floats by the forward pass;
	 * llama.cpp takes them in f16/bf16 too, so those are converted at load. */
	if (vec && gt->type != MD_DT_F32 && gt->type != MD_DT_F16 && gt->type != MD_DT_BF16) {
		seterr(b->err, b->errlen, "model: %s tensor '%s' is %s, expected f32, f16 or bf16",
		       n == 1 ? "1-D" : "bias", name, ti->name);
		b->rc = -ENOTSUP;
		return false;
	}
	return true;
}

static void mark_used(struct binder *b, const struct md_gguf_tensor *gt)
{
	b->used[gt - b->m->gguf.tensors] = 1;
}

/* Bind tensor `name` with the expected shape [ne0 .. ne(n_dims-1)]. Missing + optional gives
 * NULL; missing + required fails naming the tensor. Vectors (1-D tensors, and with vec the
 * 2-D per-expert biases) must be float and come out as f32. */
static struct md_tensor *vbind(struct binder *b, bool required, bool vec, int n_dims, int64_t ne0,
			       int64_t ne1, int64_t ne2, const char *fmt, va_list ap)
{
	if (b->rc)
		return NULL;
	char name[128];
	vsnprintf(name, sizeof(name), fmt, ap);
	vec = vec || n_dims == 1;

	struct md_model *m = b->m;
	const struct md_gguf_tensor *gt = md_gguf_find_tensor(&m->gguf, name);
	if (!gt) {
		if (required) {
			seterr(b->err, b->errlen, "model: missing tensor '%s' (arch %s)", name,
			       m->hp.arch_name);
			b->rc = -EINVAL;
		}
		return NULL;
	}
	const int64_t want[3] = { ne0, ne1, ne2 };
	if (!check_tensor(b, name, gt, n_dims, want, vec))
		return NULL;
	mark_used(b, gt);
	struct md_tensor *t = &m->tensors[m->n_tensors++];
	t->name = gt->name.ptr;
	t->name_len = gt->name.len;
	t->type = (enum md_dtype)gt->type;
	for (int i = 0; i < 4; i++)
		t->ne[i] = gt->ne[i];
	t->data = gt->data;
	if (vec && t->type != MD_DT_F32) {
		int64_t rows = n_dims == 1 ? 1 : ne1;
		float *f = model_alloc(m, (size_t)(ne0 * rows) * sizeof(float), true);
		if (!f) {
			seterr(b->err, b->errlen, "model: out of memory converting '%s' to f32", name);
			b->rc = -ENOMEM;
			return NULL;
		}
		size_t rb = md_dtype_row_size(t->type, ne0);
		for (int64_t r = 0; r < rows; r++)
			md_dequant_row(t->type, (const uint8_t *)gt->data + (size_t)r * rb, f + r * ne0, ne0);
		t->type = MD_DT_F32;
		t->data = f;
	}
	t->nb1 = md_dtype_row_size(t->type, t->ne[0]);
	t->nb2 = t->nb1 * (size_t)t->ne[1];
	return t;
}

__attribute__((format(printf, 7, 8)))
static struct md_tensor *bind(struct binder *b, bool required, int n_dims, int64_t ne0,
			      int64_t ne1, int64_t ne2, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	struct md_tensor *t = vbind(b, required, false, n_dims, ne0, ne1, ne2, fmt, ap);
	va_end(ap);
	return t;
}

/* A required 2-D bias [ne0, ne1] (one row per expert), read as f32. */
__attribute__((format(printf, 4, 5)))
static struct md_tensor *bind_bias2(struct binder *b, int64_t ne0, int64_t ne1, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	struct md_tensor *t = vbind(b, true, true, 2, ne0, ne1, 0, fmt, ap);
	va_end(ap);
	return t;
}

/* Bind the 3-D expert tensor blk.<il>.ffn_<what>_exps.weight of shape [ne0, ne1, E]. Older
 * Mixtral files (llama.cpp's convert.py before the merged layout, and their quantizations)
 * hold E 2-D tensors blk.<il>.ffn_<what>.<e>.weight instead; llama.cpp merges those into one
 * tensor, and so does this: a view of the map when all E have one type and lie at a uniform
 * stride (as a writer emitting them in order does, padding included), else a copy into a
 * model-owned buffer. Either way the forward pass sees one tensor, experts nb2 bytes apart. */
static struct md_tensor *bind_experts(struct binder *b, uint32_t il, const char *what,
				      int64_t ne0, int64_t ne1, int64_t E)
{
	if (b->rc)
		return NULL;
	struct md_model *m = b->m;
	char merged[128], name[128];
	snprintf(merged, sizeof(merged), "blk.%u.ffn_%s_exps.weight", il, what);
	if (md_gguf_find_tensor(&m->gguf, merged))
		return bind(b, true, 3, ne0, ne1, E, "%s", merged);
	snprintf(name, sizeof(name), "blk.%u.ffn_%s.0.weight", il, what);
	if (!md_gguf_find_tensor(&m->gguf, name)) {
		seterr(b->err, b->errlen,
		       "model: missing tensor '%s' (arch %s; nor per-expert tensors '%s' .. 'blk.%u.ffn_%s.%lld.weight')",
		       merged, m->hp.arch_name, name, il, what, (long long)E - 1);
		b->rc = -EINVAL;
		return NULL;
	}

	const struct md_gguf_tensor **parts = calloc((size_t)E, sizeof(*parts));
	if (!parts) {
		seterr(b->err, b->errlen, "model: out of memory");
		b->rc = -ENOMEM;
		return NULL;
	}
	const int64_t want[2] = { ne0, ne1 };
	bool uniform = true;
	ptrdiff_t stride = 0;
	for (int64_t e = 0; e < E && !b->rc; e++) {
		snprintf(name, sizeof(name), "blk.%u.ffn_%s.%lld.weight", il, what, (long long)e);
		const struct md_gguf_tensor *gt = md_gguf_find_tensor(&m->gguf, name);
		if (!gt) {
			seterr(b->err, b->errlen,
			       "model: missing tensor '%s' (per-expert layout: experts 0..%lld of blk.%u.ffn_%s)",
			       name, (long long)E - 1, il, what);
			b->rc = -EINVAL;
			break;
		}
		if (!check_tensor(b, name, gt, 2, want, false))
			break;
		if (e > 0 && gt->type != parts[0]->type) {
			seterr(b->err, b->errlen,
			       "model: tensor '%s' is %s but expert 0 is %s (per-expert tensors merge into one, of one type)",
			       name, md_dtype_info(gt->type)->name, md_dtype_info(parts[0]->type)->name);
			b->rc = -EINVAL;
			break;
		}
		parts[e] = gt;
		if (e == 1)
			stride = (const uint8_t *)gt->data - (const uint8_t *)parts[0]->data;
		if (e >= 1 && (const uint8_t *)gt->data != (const uint8_t *)parts[0]->data + e * stride)
			uniform = false;
	}
	struct md_tensor *t = NULL;
	if (b->rc)
		goto out;
	enum md_dtype type = (enum md_dtype)parts[0]->type;
	size_t mat = md_dtype_row_size(type, ne0) * (size_t)ne1;
	if (E > 1 && stride < (ptrdiff_t)mat)
		uniform = false;

	/* The merged name, kept by the model (md_tensor names are not NUL-terminated). */
	size_t name_len = strlen(merged);
	char *tname = model_alloc(m, name_len + 1, false);
	const uint8_t *data = parts[0]->data;
	size_t nb2 = E > 1 && uniform ? (size_t)stride : mat;
	if (tname && !uniform) {
		uint8_t *buf = model_alloc(m, mat * (size_t)E, true);
		if (buf)
			for (int64_t e = 0; e < E; e++)
				memcpy(buf + (size_t)e * mat, parts[e]->data, mat);
		data = buf;
	}
	if (!tname || !data) {
		seterr(b->err, b->errlen, "model: out of memory merging '%s'", merged);
		b->rc = -ENOMEM;
		goto out;
	}
	memcpy(tname, merged, name_len + 1);
	for (int64_t e = 0; e < E; e++)
		mark_used(b, parts[e]);
	t = &m->tensors[m->n_tensors++];
	t->name = tname;
	t->name_len = name_len;
	t->type = type;
	t->ne[0] = ne0;
	t->ne[1] = ne1;
	t->ne[2] = E;
	t->ne[3] = 1;
	t->nb1 = md_dtype_row_size(type, ne0);
	t->nb2 = nb2;
	t->data = data;
out:
	free(parts);
	return t;
}

/* ---------------------------------------------------------------- metadata */

/* Read ARCH.suffix as a u32. A per-layer array (llama.cpp's get_key_or_arr) is accepted when
 * it has n_layer entries that are all equal: moed's layers share one shape. Absent: def, or
 * an error naming the key when required. */
static int get_u32(struct md_model *m, const char *suffix, bool required, uint32_t def,
		   uint32_t *out, char *err, size_t errlen)
{
	char key[128];
	snprintf(key, sizeof(key), "%s.%s", m->hp.arch_name, suffix);
	if (md_gguf_get_u32(&m->gguf, key, out))
		return 0;
	int64_t k = md_gguf_find_key(&m->gguf, key);
	if (k >= 0 && m->gguf.kv[k].type == MD_GGUF_ARRAY && m->hp.n_layer) {
		const struct md_gguf_kv *kv = &m->gguf.kv[k];
		int64_t v0 = -1, v = -1;
		if (kv->arr_n != m->hp.n_layer) {
			seterr(err, errlen, "model: metadata '%s' has %llu entries, expected %u (one per layer)",
			       key, (unsigned long long)kv->arr_n, m->hp.n_layer);
			return -EINVAL;
		}
		for (uint64_t i = 0; i < kv->arr_n; i++) {
			if (!md_gguf_arr_i64(kv, i, &v) || v < 0 || v > UINT32_MAX) {
				seterr(err, errlen, "model: metadata '%s' entry %llu is not a u32", key,
				       (unsigned long long)i);
				return -EINVAL;
			}
			if (i == 0)
				v0 = v;
			if (v != v0) {
				seterr(err, errlen,
				       "model: metadata '%s' differs per layer (%lld at layer 0, %lld at layer %llu); moed needs one value for every layer",
				       key, (long long)v0, (long long)v, (unsigned long long)i);
				return -ENOTSUP;
			}
		}
		*out = (uint32_t)v0;
		return 0;
	}
	if (k >= 0) {
		seterr(err, errlen, "model: metadata '%s' has type %s, expected an unsigned integer",
		       key, md_gguf_vtype_name(m->gguf.kv[k].type));
		return -EINVAL;
	}
	if (required) {
		seterr(err, errlen, "model: missing metadata '%s'", key);
		return -EINVAL;
	}
	*out = def;
	return 0;
}

/* Rope scaling, read once for every architecture as llama.cpp reads it (llama_model's
 * hparams, deepseek2's own loader, llama_context's YaRN set-up, the deepseek2 graph):
 * - rope.scaling.type (default "linear"), factor s from rope.scaling.factor or the older
 *   rope.scale_linear (0: none); type none, or s 0 or 1, leave the angles as they are. A
 *   linear s other than 1 is refused by name (no file of these architectures has one, and
 *   the reference does not check it); YaRN is computed (engine/rope.c): freq_scale 1/s,
 *   ext_factor 1, original_context_length (default n_ctx_train), beta_fast 32 and beta_slow
 *   1. llama.cpp reads the yarn_ext_factor, yarn_attn_factor and yarn_beta_* keys the
 *   converter writes only for other architectures, so they are not read here either (gpt-oss's
 *   and DeepSeek's configs say 32 and 1 anyway).
 * - The rope's magnitude yarn_attn_factor (llama_context): with YaRN, get_mscale(s, m) /
 *   get_mscale(s, m_all) where the file has a log multiplier m_all (deepseek2 takes m = m_all:
 *   1), else get_mscale(s, 1); then divided by 1 + 0.1 ln s, the factor GGML's rope_yarn
 *   multiplies back. Times rope.scaling.attn_factor (default 1), with or without YaRN. So a
 *   gpt-oss file's cos and sin come out times 1 + 0.1 ln s, a DeepSeek one's times 1.
 * - deepseek2's q.k scale (its graph pre-scales it): mscale^2 / sqrt(head_dim), mscale =
 *   yarn_attn_factor (1 + 0.1 ln s) (1 + 0.1 m_all ln s), where m_all is the file's
 *   yarn_log_multiplier / 0.1 (the converter writes 0.1 * mscale_all_dim). Every other arch:
 *   1 / sqrt(head_dim). A log multiplier on another arch is refused: llama.cpp reads none for
 *   it, Hugging Face's YaRN would scale the attention by it, and neither engine does. */
static int read_rope_scaling(struct md_model *m, char *err, size_t errlen)
{
	struct md_hparams *hp = &m->hp;
	char key[128], tkey[128];
	struct md_gguf_str type = { 0 };
	float rope_attn = 1.0f, factor = 0.0f, log_mul = 0.0f;
	hp->rope_freq_scale = 1.0f;
	hp->yarn_ext_factor = 0.0f;
	hp->yarn_beta_fast = 32.0f;
	hp->yarn_beta_slow = 1.0f;
	hp->rope_yarn_log_mul = 0.0f;
	hp->n_ctx_orig_yarn = hp->n_ctx_train;
	hp->attn_scale = 1.0f / sqrtf((float)hp->head_dim);
	snprintf(key, sizeof(key), "%s.rope.scaling.attn_factor", hp->arch_name);
	if (md_gguf_get_f32(&m->gguf, key, &rope_attn) && !(rope_attn > 0.0f && isfinite(rope_attn))) {
		seterr(err, errlen, "model: metadata '%s' is %g, expected a positive factor", key, (double)rope_attn);
		return -EINVAL;
	}
	hp->yarn_attn_factor = rope_attn;
	snprintf(key, sizeof(key), "%s.rope.scaling.yarn_log_multiplier", hp->arch_name);
	if (md_gguf_get_f32(&m->gguf, key, &log_mul) && log_mul != 0.0f) {
		if (hp->arch != MD_ARCH_DEEPSEEK2) {
			seterr(err, errlen, "model: metadata '%s' is %g; moed's YaRN applies a log multiplier (mscale_all_dim) only for deepseek2",
			       key, (double)log_mul);
			return -ENOTSUP;
		}
		if (!isfinite(log_mul)) {
			seterr(err, errlen, "model: metadata '%s' is not finite", key);
			return -EINVAL;
		}
		hp->rope_yarn_log_mul = log_mul / 0.1f;
	}
	snprintf(tkey, sizeof(tkey), "%s.rope.scaling.type", hp->arch_name);
	bool has_type = md_gguf_get_str(&m->gguf, tkey, &type);
	bool yarn = has_type && md_gguf_str_eq(type, "yarn");
	if (has_type && !yarn && !md_gguf_str_eq(type, "linear") && !md_gguf_str_eq(type, "none")) {
		seterr(err, errlen, "model: metadata '%s' is '%.*s'; moed supports rope scaling 'none', 'linear' with factor 1, and 'yarn'",
		       tkey, (int)(type.len > 32 ? 32 : type.len), type.ptr);
		return -ENOTSUP;
	}
	const char *const suffixes[] = { "rope.scaling.factor", "rope.scale_linear" };
	for (size_t i = 0; i < 2; i++) {
		snprintf(key, sizeof(key), "%s.%s", hp->arch_name, suffixes[i]);
		if (md_gguf_get_f32(&m->gguf, key, &factor))
			break;
	}
	bool none = has_type && md_gguf_str_eq(type, "none");
	if (!none && factor != 0.0f && factor != 1.0f) {
		if (!yarn) {
			seterr(err, errlen,
			       "model: metadata '%s' is %g (rope scaling 'linear'); moed computes linear rope only unscaled, expected 0 or 1",
			       key, (double)factor);
			return -ENOTSUP;
		}
		if (!(factor > 0.0f) || !isfinite(factor)) {
			seterr(err, errlen, "model: metadata '%s' is %g, expected a positive factor", key, (double)factor);
			return -EINVAL;
		}
		int rc = get_u32(m, "rope.scaling.original_context_length", false, hp->n_ctx_train,
				 &hp->n_ctx_orig_yarn, err, errlen);
		if (rc)
			return rc;
		if (hp->n_ctx_orig_yarn == 0) {
			seterr(err, errlen, "model: metadata '%s.rope.scaling.original_context_length' is 0", hp->arch_name);
			return -EINVAL;
		}
		hp->rope_freq_scale = 1.0f / factor;
		hp->yarn_ext_factor = 1.0f;
		/* get_mscale(s, k) = 1 + 0.1 k ln s (1 for s <= 1) */
		const float s = 1.0f / hp->rope_freq_scale, ls = logf(s);
#define MSCALE(k) (s <= 1.0f ? 1.0f : 0.1f * (k) * ls + 1.0f)
		const float m_all = hp->rope_yarn_log_mul;
		float a;
		if (m_all != 0.0f) {
			float mscale = hp->arch == MD_ARCH_DEEPSEEK2 && m_all != 1.0f ? m_all : 1.0f;
			a = MSCALE(mscale) / MSCALE(m_all);
		} else {
			a = MSCALE(1.0f);
		}
#undef MSCALE
		hp->yarn_attn_factor = a / (1.0f + 0.1f * ls) * rope_attn;
	}
	if (hp->arch == MD_ARCH_DEEPSEEK2) {
		const float ls = logf(1.0f / hp->rope_freq_scale);
		float mscale = hp->yarn_attn_factor * (1.0f + 0.1f * ls) *
			       (1.0f + 0.1f * hp->rope_yarn_log_mul * ls);
		hp->attn_scale = mscale * mscale / sqrtf((float)hp->head_dim);
	}
	return 0;
}

/* gpt-oss's own keys (llama.cpp's llama_model_openai_moe::load_arch_hparams): the sliding
 * window (required), its layer pattern (default 2: even layers slide, odd ones attend to all),
 * the sliding layers' rope base (default the global one). */
static int read_gpt_oss(struct md_model *m, char *err, size_t errlen)
{
	struct md_hparams *hp = &m->hp;
	int rc = get_u32(m, "attention.sliding_window", true, 0, &hp->n_swa, err, errlen);
	rc = rc ? rc : get_u32(m, "attention.sliding_window_pattern", false, 2, &hp->swa_period, err, errlen);
	if (rc)
		return rc;
	if (hp->n_swa == 0) {
		seterr(err, errlen, "model: metadata '%s.attention.sliding_window' is 0, expected the window length",
		       hp->arch_name);
		return -EINVAL;
	}
	char key[128];
	snprintf(key, sizeof(key), "%s.rope.freq_base_swa", hp->arch_name);
	if (!md_gguf_get_f32(&m->gguf, key, &hp->rope_freq_base_swa))
		hp->rope_freq_base_swa = hp->rope_freq_base;
	hp->ffn_act = MD_ACT_SWIGLU_OAI;
	return 0;
}

/* Multi-head latent attention sizes (deepseek2), as llama.cpp's converter writes them. Files
 * from today's converter carry key_length_mla/value_length_mla (the decompressed head sizes)
 * beside key_length = kv_lora_rank + rope dims and value_length = kv_lora_rank (the latent
 * row llama.cpp caches) and split attn_k_b/attn_v_b tensors; older files carry the head
 * sizes in key_length/value_length and one attn_kv_b. Either way head_dim becomes the
 * decompressed key width (nope + rope), head_dim_v the value width. vlen: value_length. */
static int read_mla(struct md_model *m, uint32_t vlen, char *err, size_t errlen)
{
	struct md_hparams *hp = &m->hp;
	uint32_t klen = hp->head_dim, kmla = 0, vmla = 0;
	int rc = get_u32(m, "attention.kv_lora_rank", true, 0, &hp->kv_lora_rank, err, errlen);
	rc = rc ? rc : get_u32(m, "attention.q_lora_rank", false, 0, &hp->q_lora_rank, err, errlen);
	rc = rc ? rc : get_u32(m, "attention.key_length_mla", false, 0, &kmla, err, errlen);
	rc = rc ? rc : get_u32(m, "attention.value_length_mla", false, 0, &vmla, err, errlen);
	if (rc)
		return rc;
	if (!kmla != !vmla) {
		seterr(err, errlen, "model: metadata '%s.attention.%s' present without '%s.attention.%s'",
		       hp->arch_name, kmla ? "key_length_mla" : "value_length_mla", hp->arch_name,
		       kmla ? "value_length_mla" : "key_length_mla");
		return -EINVAL;
	}
	if (kmla) {
		if (klen != hp->kv_lora_rank + hp->n_rot || vlen != hp->kv_lora_rank) {
			seterr(err, errlen,
			       "model: latent attention sizes disagree: key_length %u, value_length %u, expected kv_lora_rank + rope dims = %u and kv_lora_rank = %u",
			       klen, vlen, hp->kv_lora_rank + hp->n_rot, hp->kv_lora_rank);
			return -EINVAL;
		}
		hp->head_dim = kmla;
		hp->head_dim_v = vmla;
	} else {
		hp->head_dim_v = vlen;
	}
	if (hp->kv_lora_rank == 0 || hp->n_rot == 0 || hp->n_rot % 2 || hp->head_dim <= hp->n_rot ||
	    hp->head_dim_v == 0 || hp->kv_lora_rank > 65536 || hp->head_dim > 65536) {
		seterr(err, errlen,
		       "model: unsupported latent attention sizes (kv_lora_rank %u, key %u, value %u, rope dims %u; the key must be wider than the rope dims)",
		       hp->kv_lora_rank, hp->head_dim, hp->head_dim_v, hp->n_rot);
		return -ENOTSUP;
	}
	hp->head_dim_nope = hp->head_dim - hp->n_rot;
	char key[128];
	float f;
	snprintf(key, sizeof(key), "%s.attention.temperature_scale", hp->arch_name);
	if (md_gguf_get_f32(&m->gguf, key, &f) && f != 0.0f) {
		seterr(err, errlen, "model: metadata '%s' is %g; moed has no attention temperature tuning",
		       key, (double)f);
		return -ENOTSUP;
	}
	return 0;
}

/* The routing and layout keys deepseek2 and glm4moe add (llama.cpp's defaults): expert and
 * shared-expert widths, leading dense layers, gating function, weight scale, NextN layers. */
static int read_moe_extras(struct md_model *m, char *err, size_t errlen)
{
	struct md_hparams *hp = &m->hp;
	uint32_t gating = 0;
	int rc = get_u32(m, "expert_feed_forward_length", true, 0, &hp->n_ff_exp, err, errlen);
	rc = rc ? rc : get_u32(m, "expert_shared_count", true, 0, &hp->n_expert_shared, err, errlen);
	rc = rc ? rc : get_u32(m, "leading_dense_block_count", false, 0, &hp->n_layer_dense_lead, err, errlen);
	rc = rc ? rc : get_u32(m, "expert_gating_func", false, 0, &gating, err, errlen);
	rc = rc ? rc : get_u32(m, "nextn_predict_layers", false, 0, &hp->n_layer_nextn, err, errlen);
	rc = rc ? rc : get_u32(m, "expert_group_count", false, 0, &hp->n_expert_groups, err, errlen);
	rc = rc ? rc : get_u32(m, "expert_group_used_count", false, 0, &hp->n_group_used, err, errlen);
	if (rc)
		return rc;
	if (gating == 0) {
		/* Absent: glm4moe gates by sigmoid; deepseek2 files from before the key (V2, V2.5)
		 * by softmax, except GLM-4.7-Flash (47/48 layers, 154880 tokens), by sigmoid. */
		uint32_t n_vocab = 0;
		char key[128];
		snprintf(key, sizeof(key), "%s.vocab_size", hp->arch_name);
		if (!md_gguf_get_u32(&m->gguf, key, &n_vocab)) {
			int64_t k = md_gguf_find_key(&m->gguf, "tokenizer.ggml.tokens");
			if (k >= 0 && m->gguf.kv[k].type == MD_GGUF_ARRAY)
				n_vocab = (uint32_t)m->gguf.kv[k].arr_n;
		}
		gating = hp->arch == MD_ARCH_GLM4MOE ? 2
			 : (hp->n_layer == 47 || hp->n_layer == 48) && n_vocab == 154880 ? 2 : 1;
	}
	if (gating != 1 && gating != 2) {
		seterr(err, errlen, "model: metadata '%s.expert_gating_func' is %u; moed gates by softmax (1) or sigmoid (2)",
		       hp->arch_name, gating);
		return -ENOTSUP;
	}
	hp->gating = gating == 2 ? MD_GATING_SIGMOID : MD_GATING_SOFTMAX;
	char key[128];
	snprintf(key, sizeof(key), "%s.expert_weights_scale", hp->arch_name);
	if (!md_gguf_get_f32(&m->gguf, key, &hp->expert_weights_scale))
		hp->expert_weights_scale = 0.0f;
	hp->n_ff_shexp = hp->n_ff_exp * hp->n_expert_shared;
	const uint32_t G = hp->n_expert_groups;
	if (G > 1 && (hp->n_expert % G != 0 || hp->n_group_used == 0 || hp->n_group_used >= G ||
		      hp->n_expert_used > hp->n_group_used * (hp->n_expert / G))) {
		seterr(err, errlen,
		       "model: bad expert groups (%u groups of the %u experts, %u used, %u experts per token)",
		       G, hp->n_expert, hp->n_group_used, hp->n_expert_used);
		return -EINVAL;
	}
	if (hp->n_ff_exp == 0 || hp->n_ff_exp > (1u << 24) || hp->n_expert_shared > 64) {
		seterr(err, errlen, "model: bad expert widths (expert_feed_forward_length %u, %u shared experts)",
		       hp->n_ff_exp, hp->n_expert_shared);
		return -EINVAL;
	}
	return 0;
}

/* glm4moe with rope sections is a multimodal file (llama.cpp rotates by M-RoPE then). */
static int check_mrope(struct md_model *m, char *err, size_t errlen)
{
	char key[128];
	snprintf(key, sizeof(key), "%s.rope.dimension_sections", m->hp.arch_name);
	int64_t k = md_gguf_find_key(&m->gguf, key);
	if (k < 0)
		return 0;
	const struct md_gguf_kv *kv = &m->gguf.kv[k];
	int64_t s0 = 0, s1 = 0;
	if (kv->type == MD_GGUF_ARRAY && kv->arr_n >= 2 && md_gguf_arr_i64(kv, 0, &s0) &&
	    md_gguf_arr_i64(kv, 1, &s1) && (s0 <= 0 || s1 <= 0))
		return 0;
	seterr(err, errlen, "model: metadata '%s' asks for multimodal rope sections (M-RoPE), which moed does not compute",
	       key);
	return -ENOTSUP;
}

static int read_hparams(struct md_model *m, char *err, size_t errlen)
{
	struct md_hparams *hp = &m->hp;
	struct md_gguf_str s;
	if (!md_gguf_get_str(&m->gguf, "general.architecture", &s)) {
		seterr(err, errlen, "model: missing metadata 'general.architecture'");
		return -EINVAL;
	}
	const struct arch_desc *ad = NULL;
	for (size_t i = 0; i < N_ARCHS; i++)
		if (md_gguf_str_eq(s, archs[i].name))
			ad = &archs[i];
	if (!ad) {
		char names[256];
		size_t o = 0;
		for (size_t i = 0; i < N_ARCHS && o < sizeof(names); i++)
			o += (size_t)snprintf(names + o, sizeof(names) - o, "%s%s%s", i ? ", " : "",
					      archs[i].name,
					      archs[i].arch == MD_ARCH_LLAMA ? " (dense, or Mixtral with experts)" : "");
		seterr(err, errlen, "model: unsupported architecture '%.*s' (general.architecture; supported: %s)",
		       (int)(s.len > 64 ? 64 : s.len), s.ptr, names);
		return -ENOTSUP;
	}
	hp->arch = ad->arch;
	snprintf(hp->arch_name, sizeof(hp->arch_name), "%s", ad->name);
	hp->rope_type = ad->rope;
	hp->norm_topk = ad->norm_topk;

	/* Defaults as llama.cpp's: head_count_kv = head_count, key/value length n_embd/n_head,
	 * rope dims = key length, rope base 10000. context_length (required there) defaults
	 * to 4096 here: it only bounds the context. block_count first: the per-layer arrays are
	 * checked against it. */
	int rc = 0;
	rc = rc ? rc : get_u32(m, "block_count", true, 0, &hp->n_layer, err, errlen);
	rc = rc ? rc : get_u32(m, "embedding_length", true, 0, &hp->n_embd, err, errlen);
	rc = rc ? rc : get_u32(m, "context_length", false, 4096, &hp->n_ctx_train, err, errlen);
	rc = rc ? rc : get_u32(m, "attention.head_count", true, 0, &hp->n_head, err, errlen);
	rc = rc ? rc : get_u32(m, "attention.head_count_kv", false, hp->n_head, &hp->n_head_kv, err, errlen);
	rc = rc ? rc : get_u32(m, "feed_forward_length", false, 0, &hp->n_ff, err, errlen);
	rc = rc ? rc : get_u32(m, "expert_count", false, 0, &hp->n_expert, err, errlen);
	rc = rc ? rc : get_u32(m, "expert_used_count", false, 0, &hp->n_expert_used, err, errlen);
	if (rc)
		return rc;
	if (hp->n_head == 0 || hp->n_embd == 0 || hp->n_layer == 0 || hp->n_head_kv == 0 ||
	    hp->n_head % hp->n_head_kv != 0 || hp->n_layer > 4096 || hp->n_head > 4096) {
		seterr(err, errlen, "model: inconsistent attention sizes (n_embd %u, n_head %u, n_head_kv %u, n_layer %u)",
		       hp->n_embd, hp->n_head, hp->n_head_kv, hp->n_layer);
		return -EINVAL;
	}
	rc = get_u32(m, "attention.key_length", false, hp->n_embd / hp->n_head, &hp->head_dim, err, errlen);
	uint32_t vlen = 0;
	rc = rc ? rc : get_u32(m, "attention.value_length", false, hp->head_dim, &vlen, err, errlen);
	rc = rc ? rc : get_u32(m, "rope.dimension_count", false, hp->head_dim, &hp->n_rot, err, errlen);
	if (!rc && hp->arch == MD_ARCH_DEEPSEEK2)
		rc = read_mla(m, vlen, err, errlen); /* sets head_dim to the decompressed key */
	if (rc)
		return rc;
	if (hp->arch == MD_ARCH_DEEPSEEK2)
		vlen = hp->head_dim; /* its value width is head_dim_v, checked by read_mla */
	if (vlen != hp->head_dim || hp->head_dim == 0 || hp->n_rot > hp->head_dim || hp->n_rot % 2) {
		seterr(err, errlen, "model: unsupported head sizes (key_length %u, value_length %u, rope dims %u)",
		       hp->head_dim, vlen, hp->n_rot);
		return -ENOTSUP;
	}
	if (hp->n_expert) {
		if (hp->n_expert_used == 0 || hp->n_expert_used > hp->n_expert || hp->n_expert > 1024) {
			seterr(err, errlen, "model: bad expert counts (%u used of %u)", hp->n_expert_used,
			       hp->n_expert);
			return -EINVAL;
		}
		/* llama.cpp: n_ff_exp defaults to n_ff / n_expert_used (qwen2moe, qwen3moe);
		 * deepseek2 and glm4moe require it. */
		if (hp->arch == MD_ARCH_DEEPSEEK2 || hp->arch == MD_ARCH_GLM4MOE)
			rc = read_moe_extras(m, err, errlen);
		else if (hp->arch == MD_ARCH_QWEN3MOE || hp->arch == MD_ARCH_QWEN2MOE)
			rc = get_u32(m, "expert_feed_forward_length", false, hp->n_ff / hp->n_expert_used,
				     &hp->n_ff_exp, err, errlen);
		else if (hp->arch == MD_ARCH_GPT_OSS) /* required there */
			rc = get_u32(m, "expert_feed_forward_length", true, 0, &hp->n_ff_exp, err, errlen);
		else
			hp->n_ff_exp = hp->n_ff;
		if (!rc && hp->arch == MD_ARCH_QWEN2MOE)
			rc = get_u32(m, "expert_shared_feed_forward_length", false, hp->n_ff, &hp->n_ff_shexp, err, errlen);
		if (rc)
			return rc;
	} else if (hp->arch == MD_ARCH_QWEN3MOE || hp->arch == MD_ARCH_QWEN2MOE || hp->arch == MD_ARCH_OLMOE ||
		   hp->arch == MD_ARCH_GPT_OSS || hp->arch == MD_ARCH_DEEPSEEK2 || hp->arch == MD_ARCH_GLM4MOE) {
		seterr(err, errlen, "model: metadata '%s.expert_count' missing for an MoE architecture", hp->arch_name);
		return -EINVAL;
	}

	char key[128];
	snprintf(key, sizeof(key), "%s.rope.freq_base", hp->arch_name);
	if (!md_gguf_get_f32(&m->gguf, key, &hp->rope_freq_base))
		hp->rope_freq_base = 10000.0f;
	snprintf(key, sizeof(key), "%s.attention.layer_norm_rms_epsilon", hp->arch_name);
	if (!md_gguf_get_f32(&m->gguf, key, &hp->rms_eps)) {
		seterr(err, errlen, "model: missing metadata '%s'", key);
		return -EINVAL;
	}
	snprintf(key, sizeof(key), "%s.expert_weights_norm", hp->arch_name);
	bool b;
	if (md_gguf_get_bool(&m->gguf, key, &b))
		hp->norm_topk = b;
	hp->rope_freq_base_swa = hp->rope_freq_base;
	rc = read_rope_scaling(m, err, errlen);
	if (!rc && hp->arch == MD_ARCH_GPT_OSS)
		rc = read_gpt_oss(m, err, errlen);
	if (!rc && hp->arch == MD_ARCH_GLM4MOE)
		rc = check_mrope(m, err, errlen);
	if (rc)
		return rc;
	/* NextN/MTP layers are counted in block_count and follow the n_layer that run. */
	if (hp->n_layer_nextn >= hp->n_layer) {
		seterr(err, errlen, "model: metadata '%s.nextn_predict_layers' is %u, expected fewer than block_count %u",
		       hp->arch_name, hp->n_layer_nextn, hp->n_layer);
		return -EINVAL;
	}
	hp->n_layer -= hp->n_layer_nextn;
	if (hp->n_expert && hp->n_layer_dense_lead >= hp->n_layer) {
		seterr(err, errlen, "model: metadata '%s.leading_dense_block_count' is %u, expected fewer than the %u layers",
		       hp->arch_name, hp->n_layer_dense_lead, hp->n_layer);
		return -EINVAL;
	}
	return 0;
}

/* A model-owned f32 tensor (the first 3 of ne; name copied), or NULL with b->rc set. */
static struct md_tensor *owned_f32(struct binder *b, const char *name, int64_t ne0, int64_t ne1,
				   int64_t ne2)
{
	struct md_model *m = b->m;
	size_t name_len = strlen(name);
	char *tname = model_alloc(m, name_len + 1, false);
	float *data = model_alloc(m, (size_t)(ne0 * ne1 * ne2) * sizeof(float), true);
	if (!tname || !data) {
		seterr(b->err, b->errlen, "model: out of memory making '%s'", name);
		b->rc = -ENOMEM;
		return NULL;
	}
	memcpy(tname, name, name_len + 1);
	struct md_tensor *t = &m->tensors[m->n_tensors++];
	t->name = tname;
	t->name_len = name_len;
	t->type = MD_DT_F32;
	t->ne[0] = ne0;
	t->ne[1] = ne1;
	t->ne[2] = ne2;
	t->ne[3] = 1;
	t->nb1 = (size_t)ne0 * sizeof(float);
	t->nb2 = t->nb1 * (size_t)ne1;
	t->data = data;
	return t;
}

/* The latent attention tensors of layer i (deepseek2), as llama.cpp's converter writes them:
 * the query through q_lora_rank (attn_q_a, attn_q_a_norm, attn_q_b) or a plain attn_q,
 * attn_kv_a_mqa and attn_kv_a_norm, then either today's split attn_k_b [nope, C, H] and
 * attn_v_b [C, v, H], or an older file's one attn_kv_b [C, H * (nope + v)]. Of the latter,
 * the value rows become a view (head h's rows lie (nope + v) rows apart) and the key rows
 * are transposed once into a model-owned f32 attn_k_b, so the absorbed query is a plain
 * product either way (costs H * nope * C floats per layer: 4 MiB for V2-Lite's layers). */
static void bind_mla(struct binder *b, uint32_t i)
{
	struct md_model *m = b->m;
	const struct md_hparams *hp = &m->hp;
	struct md_layer *L = &m->layers[i];
	const int64_t N = hp->n_embd, H = hp->n_head, R = hp->n_rot, C = hp->kv_lora_rank;
	const int64_t Dn = hp->head_dim_nope, Dv = hp->head_dim_v, QL = hp->q_lora_rank;
	if (QL) {
		L->wq_a = bind(b, true, 2, N, QL, 0, "blk.%u.attn_q_a.weight", i);
		L->q_a_norm = bind(b, true, 1, QL, 0, 0, "blk.%u.attn_q_a_norm.weight", i);
		L->wq_b = bind(b, true, 2, QL, H * (Dn + R), 0, "blk.%u.attn_q_b.weight", i);
	} else {
		L->wq = bind(b, true, 2, N, H * (Dn + R), 0, "blk.%u.attn_q.weight", i);
	}
	L->wkv_a_mqa = bind(b, true, 2, N, C + R, 0, "blk.%u.attn_kv_a_mqa.weight", i);
	L->kv_a_norm = bind(b, true, 1, C, 0, 0, "blk.%u.attn_kv_a_norm.weight", i);
	L->wo = bind(b, true, 2, H * Dv, N, 0, "blk.%u.attn_output.weight", i);
	char name[96];
	snprintf(name, sizeof(name), "blk.%u.attn_kv_b.weight", i);
	if (!md_gguf_find_tensor(&m->gguf, name)) {
		L->wk_b = bind(b, true, 3, Dn, C, H, "blk.%u.attn_k_b.weight", i);
		L->wv_b = bind(b, true, 3, C, Dv, H, "blk.%u.attn_v_b.weight", i);
		return;
	}
	const struct md_tensor *kvb = bind(b, true, 2, C, H * (Dn + Dv), 0, "%s", name);
	if (!kvb)
		return;
	snprintf(name, sizeof(name), "blk.%u.attn_v_b.weight", i);
	size_t name_len = strlen(name);
	char *tname = model_alloc(m, name_len + 1, false);
	snprintf(name, sizeof(name), "blk.%u.attn_k_b.weight", i);
	struct md_tensor *kb = owned_f32(b, name, Dn, C, H);
	if (!tname || !kb) {
		if (!b->rc) {
			seterr(b->err, b->errlen, "model: out of memory splitting 'blk.%u.attn_kv_b.weight'", i);
			b->rc = -ENOMEM;
		}
		return;
	}
	float *row = malloc((size_t)C * sizeof(float));
	if (!row) {
		seterr(b->err, b->errlen, "model: out of memory splitting 'blk.%u.attn_kv_b.weight'", i);
		b->rc = -ENOMEM;
		return;
	}
	float *kd = (float *)kb->data;
	for (int64_t h = 0; h < H; h++)
		for (int64_t d = 0; d < Dn; d++) {
			const uint8_t *src = (const uint8_t *)kvb->data + (size_t)(h * (Dn + Dv) + d) * kvb->nb1;
			md_dequant_row(kvb->type, src, row, C);
			for (int64_t c = 0; c < C; c++) /* k_b[h][c][d]: row c of head h, Dn wide */
				kd[(size_t)(h * C + c) * Dn + d] = row[c];
		}
	free(row);
	L->wk_b = kb;
	snprintf(tname, name_len + 1, "blk.%u.attn_v_b.weight", i);
	struct md_tensor *vb = &m->tensors[m->n_tensors++];
	*vb = *kvb;
	vb->name = tname;
	vb->name_len = name_len;
	vb->ne[0] = C;
	vb->ne[1] = Dv;
	vb->ne[2] = H;
	vb->data = (const uint8_t *)kvb->data + (size_t)Dn * kvb->nb1;
	vb->nb2 = (size_t)(Dn + Dv) * kvb->nb1;
	L->wv_b = vb;
}

/* Accept every tensor of layer i without binding it (a NextN/MTP layer). */
static void skip_layer(struct binder *b, uint32_t i)
{
	const struct md_gguf *g = &b->m->gguf;
	char prefix[32];
	int n = snprintf(prefix, sizeof(prefix), "blk.%u.", i);
	for (uint64_t t = 0; t < g->n_tensors; t++)
		if (g->tensors[t].name.len > (size_t)n && memcmp(g->tensors[t].name.ptr, prefix, (size_t)n) == 0)
			b->used[t] = 1;
}

/* Bind every tensor of the architecture (hparams read, n_vocab set). Returns 0 or b->rc. */
static int bind_tensors(struct binder *b)
{
	struct md_model *m = b->m;
	struct md_hparams *hp = &m->hp;
	const int64_t n_vocab = hp->n_vocab;
	const int64_t N = hp->n_embd, H = hp->n_head, K = hp->n_head_kv, D = hp->head_dim;
	m->tok_embd = bind(b, true, 2, N, n_vocab, 0, "token_embd.weight");
	m->output_norm = bind(b, true, 1, N, 0, 0, "output_norm.weight");
	m->output = bind(b, false, 2, N, n_vocab, 0, "output.weight");
	if (!m->output && !b->rc) { /* llama.cpp ties it to token_embd where the arch allows */
		const struct arch_desc *ad = NULL;
		for (size_t i = 0; i < N_ARCHS; i++)
			if (archs[i].arch == hp->arch)
				ad = &archs[i];
		if (ad->output_required) {
			seterr(b->err, b->errlen, "model: missing tensor 'output.weight' (arch %s has no tied embeddings)",
			       hp->arch_name);
			return -EINVAL;
		}
		m->output = m->tok_embd;
		hp->tied_output = true;
	}

	for (uint32_t i = 0; i < hp->n_layer && !b->rc; i++) {
		struct md_layer *L = &m->layers[i];
		L->attn_norm = bind(b, true, 1, N, 0, 0, "blk.%u.attn_norm.weight", i);
		if (hp->kv_lora_rank) {
			bind_mla(b, i);
		} else {
			L->wq = bind(b, true, 2, N, H * D, 0, "blk.%u.attn_q.weight", i);
			L->wk = bind(b, true, 2, N, K * D, 0, "blk.%u.attn_k.weight", i);
			L->wv = bind(b, true, 2, N, K * D, 0, "blk.%u.attn_v.weight", i);
			L->wo = bind(b, true, 2, H * D, N, 0, "blk.%u.attn_output.weight", i);
			L->bq = bind(b, false, 1, H * D, 0, 0, "blk.%u.attn_q.bias", i);
			L->bk = bind(b, false, 1, K * D, 0, 0, "blk.%u.attn_k.bias", i);
			L->bv = bind(b, false, 1, K * D, 0, 0, "blk.%u.attn_v.bias", i);
		}
		if (hp->arch == MD_ARCH_GLM4MOE) {
			/* QK-norm per head where present (GLM-4.5; not GLM-4.5-Air) */
			L->q_norm = bind(b, false, 1, D, 0, 0, "blk.%u.attn_q_norm.weight", i);
			L->k_norm = bind(b, !!L->q_norm, 1, D, 0, 0, "blk.%u.attn_k_norm.weight", i);
			if (L->q_norm)
				hp->qk_norm = MD_QK_NORM_HEAD;
			else if (hp->qk_norm != MD_QK_NORM_NONE && !b->rc) {
				seterr(b->err, b->errlen, "model: layer %u has no attn_q_norm but layer 0 has (arch glm4moe)", i);
				b->rc = -EINVAL;
			}
		} else if (hp->arch == MD_ARCH_OLMOE) {
			L->q_norm = bind(b, true, 1, H * D, 0, 0, "blk.%u.attn_q_norm.weight", i);
			L->k_norm = bind(b, true, 1, K * D, 0, 0, "blk.%u.attn_k_norm.weight", i);
			hp->qk_norm = MD_QK_NORM_FULL;
		} else if (hp->arch == MD_ARCH_QWEN3MOE || hp->arch == MD_ARCH_QWEN3) {
			L->q_norm = bind(b, true, 1, D, 0, 0, "blk.%u.attn_q_norm.weight", i);
			L->k_norm = bind(b, true, 1, D, 0, 0, "blk.%u.attn_k_norm.weight", i);
			hp->qk_norm = MD_QK_NORM_HEAD;
		}
		if (hp->arch == MD_ARCH_GPT_OSS) { /* llama.cpp: create_tensor_qkv, wo_b, sinks */
			L->bo = bind(b, true, 1, N, 0, 0, "blk.%u.attn_output.bias", i);
			L->attn_sinks = bind(b, true, 1, H, 0, 0, "blk.%u.attn_sinks.weight", i);
		}
		/* gpt-oss's and glm4moe's FFN norm is llama.cpp's attn_post_norm
		 * (post_attention_layernorm) */
		L->ffn_norm = bind(b, true, 1, N, 0, 0,
				   hp->arch == MD_ARCH_GPT_OSS || hp->arch == MD_ARCH_GLM4MOE ?
				   "blk.%u.post_attention_norm.weight" : "blk.%u.ffn_norm.weight", i);
		if (hp->n_expert && i >= hp->n_layer_dense_lead) {
			const int64_t E = hp->n_expert, F = hp->n_ff_exp;
			if (F == 0) {
				seterr(b->err, b->errlen, "model: metadata '%s.%s' is 0 or missing, expected the experts' width",
				       hp->arch_name, hp->arch == MD_ARCH_QWEN3MOE || hp->arch == MD_ARCH_QWEN2MOE ||
				       hp->arch == MD_ARCH_GPT_OSS ? "expert_feed_forward_length" : "feed_forward_length");
				b->rc = -EINVAL;
				break;
			}
			L->gate_inp = bind(b, true, 2, N, E, 0, "blk.%u.ffn_gate_inp.weight", i);
			L->gate_exps = bind_experts(b, i, "gate", N, F, E);
			L->up_exps = bind_experts(b, i, "up", N, F, E);
			L->down_exps = bind_experts(b, i, "down", F, N, E);
			if (hp->arch == MD_ARCH_GPT_OSS) {
				L->gate_inp_b = bind(b, true, 1, E, 0, 0, "blk.%u.ffn_gate_inp.bias", i);
				L->gate_exps_b = bind_bias2(b, F, E, "blk.%u.ffn_gate_exps.bias", i);
				L->up_exps_b = bind_bias2(b, F, E, "blk.%u.ffn_up_exps.bias", i);
				L->down_exps_b = bind_bias2(b, N, E, "blk.%u.ffn_down_exps.bias", i);
			}
			if (hp->arch == MD_ARCH_QWEN2MOE) {
				const int64_t S = hp->n_ff_shexp;
				/* 1-D here; the converter writes it [n_embd, 1] (as llama.cpp reads it). */
				L->gate_inp_shexp = bind(b, true, 1, N, 0, 0, "blk.%u.ffn_gate_inp_shexp.weight", i);
				L->gate_shexp = bind(b, true, 2, N, S, 0, "blk.%u.ffn_gate_shexp.weight", i);
				L->up_shexp = bind(b, true, 2, N, S, 0, "blk.%u.ffn_up_shexp.weight", i);
				L->down_shexp = bind(b, true, 2, S, N, 0, "blk.%u.ffn_down_shexp.weight", i);
			} else if (hp->arch == MD_ARCH_DEEPSEEK2 || hp->arch == MD_ARCH_GLM4MOE) {
				/* selection bias: optional for deepseek2 (V2 has none), required for glm4moe */
				L->exp_probs_b = bind(b, hp->arch == MD_ARCH_GLM4MOE, 1, E, 0, 0,
						      "blk.%u.exp_probs_b.bias", i);
				const int64_t S = hp->n_ff_shexp;
				if (S == 0 && hp->arch == MD_ARCH_DEEPSEEK2 && !b->rc) {
					seterr(b->err, b->errlen, "model: metadata '%s.expert_shared_count' is 0; deepseek2 layers have a shared expert",
					       hp->arch_name);
					b->rc = -EINVAL;
				}
				if (S) {
					L->gate_shexp = bind(b, true, 2, N, S, 0, "blk.%u.ffn_gate_shexp.weight", i);
					L->up_shexp = bind(b, true, 2, N, S, 0, "blk.%u.ffn_up_shexp.weight", i);
					L->down_shexp = bind(b, true, 2, S, N, 0, "blk.%u.ffn_down_shexp.weight", i);
				}
			}
		} else {
			const int64_t FF = hp->n_ff;
			if (FF == 0) {
				seterr(b->err, b->errlen, "model: metadata '%s.feed_forward_length' is 0 or missing, expected the FFN width",
				       hp->arch_name);
				b->rc = -EINVAL;
				break;
			}
			L->ffn_gate = bind(b, true, 2, N, FF, 0, "blk.%u.ffn_gate.weight", i);
			L->ffn_up = bind(b, true, 2, N, FF, 0, "blk.%u.ffn_up.weight", i);
			L->ffn_down = bind(b, true, 2, FF, N, 0, "blk.%u.ffn_down.weight", i);
		}
	}
	/* NextN/MTP layers: accepted and left unused, as llama.cpp skips them at inference. */
	for (uint32_t i = hp->n_layer; i < hp->n_layer + hp->n_layer_nextn && !b->rc; i++)
		skip_layer(b, i);
	return b->rc;
}

/* llama.cpp refuses a file with tensors its architecture does not create ("wrong number of
 * tensors"); here such a tensor is one moed would silently skip (an output bias, rope
 * factors, per-layer MLP biases), so the file is refused by that tensor's name. */
static int check_all_used(struct binder *b)
{
	const struct md_gguf *g = &b->m->gguf;
	for (uint64_t i = 0; i < g->n_tensors; i++) {
		if (b->used[i])
			continue;
		const struct md_gguf_tensor *gt = &g->tensors[i];
		seterr(b->err, b->errlen,
		       "model: tensor '%.*s' is not supported for arch %s (moed would ignore it and compute a different result)",
		       (int)(gt->name.len > 96 ? 96 : gt->name.len), gt->name.ptr, b->m->hp.arch_name);
		return -ENOTSUP;
	}
	return 0;
}

int md_model_load(struct md_model *m, const char *path, char *err, size_t errlen)
{
	memset(m, 0, sizeof(*m));
	snprintf(m->path, sizeof(m->path), "%s", path);
	int rc = md_gguf_open(&m->gguf, path, err, errlen);
	if (rc)
		return rc;
	rc = read_hparams(m, err, errlen);
	if (rc)
		goto fail_gguf;

	struct md_hparams *hp = &m->hp;
	struct binder b = { m, err, errlen, 0, NULL };
	/* One per file tensor, plus the two an older deepseek2 file's attn_kv_b becomes. */
	m->tensors = calloc(m->gguf.n_tensors + 2 * (size_t)hp->n_layer + 1, sizeof(*m->tensors));
	m->layers = calloc(hp->n_layer, sizeof(*m->layers));
	b.used = calloc(m->gguf.n_tensors + 1, 1);
	if (!m->tensors || !m->layers || !b.used) {
		seterr(err, errlen, "model: out of memory");
		rc = -ENOMEM;
		goto fail_alloc;
	}

	const struct md_gguf_tensor *emb = md_gguf_find_tensor(&m->gguf, "token_embd.weight");
	if (!emb) {
		seterr(err, errlen, "model: missing tensor 'token_embd.weight' (arch %s)", hp->arch_name);
		rc = -EINVAL;
		goto fail_alloc;
	}
	int64_t n_vocab = emb->ne[1]; /* n_vocab is its row count, as in llama.cpp */
	if (n_vocab <= 0 || n_vocab > 0x7fffffff) {
		seterr(err, errlen, "model: tensor 'token_embd.weight' has %lld rows, expected 1 .. 2^31-1",
		       (long long)n_vocab);
		rc = -EINVAL;
		goto fail_alloc;
	}
	hp->n_vocab = (uint32_t)n_vocab;
	rc = bind_tensors(&b);
	if (rc)
		goto fail_alloc;
	rc = check_all_used(&b);
	if (rc)
		goto fail_alloc;
	free(b.used);
	return 0;

fail_alloc:
	free(b.used);
	free(m->tensors);
	free(m->layers);
	free_bufs(m);
	m->tensors = NULL;
	m->layers = NULL;
fail_gguf:
	md_gguf_close(&m->gguf);
	return rc;
}

void md_model_free(struct md_model *m)
{
	free(m->tensors);
	free(m->layers);
	free_bufs(m);
	md_gguf_close(&m->gguf);
	memset(m, 0, sizeof(*m));
}

struct md_mat md_mat_of(const struct md_tensor *t, int64_t expert)
{
	struct md_mat m = {
		.type = t->type,
		.n_in = t->ne[0],
		.n_out = t->ne[1],
		.nb1 = t->nb1,
		.data = (const uint8_t *)t->data + (size_t)expert * t->nb2,
	};
	return m;
}

