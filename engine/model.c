/* Architecture binding: read hyper-parameters and bind tensors of a GGUF model by name. */
#include "engine/model.h"

#include <errno.h>
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
};

const char *md_arch_name(enum md_arch a)
{
	for (size_t i = 0; i < sizeof(archs) / sizeof(archs[0]); i++)
		if (archs[i].arch == a)
			return archs[i].name;
	return "?";
}

bool md_model_is_moe(const struct md_model *m)
{
	return m->hp.n_expert > 0;
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

struct binder {
	struct md_model *m;
	char *err;
	size_t errlen;
	int rc;
};

/* Bind tensor `name` with the expected shape (ne[i] == 0 means "any"; n_dims expected dims).
 * Missing + optional gives NULL; missing + required fails naming the tensor. */
__attribute__((format(printf, 7, 8)))
static struct md_tensor *bind(struct binder *b, bool required, int n_dims, int64_t ne0,
			      int64_t ne1, int64_t ne2, const char *fmt, ...)
{
	if (b->rc)
		return NULL;
	char name[128];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(name, sizeof(name), fmt, ap);
	va_end(ap);

	const struct md_gguf_tensor *gt = md_gguf_find_tensor(&b->m->gguf, name);
	if (!gt) {
		if (required) {
			seterr(b->err, b->errlen, "model: missing tensor '%s' (arch %s)", name,
			       b->m->hp.arch_name);
			b->rc = -EINVAL;
		}
		return NULL;
	}
	int64_t want[3] = { ne0, ne1, ne2 };
	bool ok = (int)gt->n_dims == n_dims;
	for (int i = 0; ok && i < n_dims; i++)
		ok = want[i] == 0 || gt->ne[i] == want[i];
	if (!ok) {
		seterr(b->err, b->errlen,
		       "model: tensor '%s' has shape [%lld, %lld, %lld] (%u dims), expected [%lld, %lld, %lld] (%d dims)",
		       name, (long long)gt->ne[0], (long long)gt->ne[1], (long long)gt->ne[2],
		       gt->n_dims, (long long)ne0, (long long)ne1, (long long)ne2, n_dims);
		b->rc = -EINVAL;
		return NULL;
	}
	const struct md_dtype_info *ti = md_dtype_info(gt->type);
	if (!ti || !ti->supported) {
		seterr(b->err, b->errlen, "model: tensor '%s' has unsupported type %s", name,
		       ti ? ti->name : "(unknown)");
		b->rc = -ENOTSUP;
		return NULL;
	}
	/* Norm weights, biases and gate vectors are read as plain floats by the forward pass. */
	if (n_dims == 1 && gt->type != MD_DT_F32) {
		seterr(b->err, b->errlen, "model: 1-D tensor '%s' must be f32, is %s", name, ti->name);
		b->rc = -ENOTSUP;
		return NULL;
	}
	struct md_tensor *t = &b->m->tensors[b->m->n_tensors++];
	t->name = gt->name.ptr;
	t->name_len = gt->name.len;
	t->type = (enum md_dtype)gt->type;
	for (int i = 0; i < 4; i++)
		t->ne[i] = gt->ne[i];
	t->nb1 = md_dtype_row_size(t->type, gt->ne[0]);
	t->nb2 = t->nb1 * (size_t)gt->ne[1];
	t->data = gt->data;
	return t;
}

static int get_u32(struct md_model *m, const char *suffix, bool required, uint32_t def,
		   uint32_t *out, char *err, size_t errlen)
{
	char key[128];
	snprintf(key, sizeof(key), "%s.%s", m->hp.arch_name, suffix);
	if (md_gguf_get_u32(&m->gguf, key, out))
		return 0;
	if (md_gguf_find_key(&m->gguf, key) >= 0) {
		seterr(err, errlen, "model: metadata '%s' has the wrong type or range", key);
		return -EINVAL;
	}
	if (required) {
		seterr(err, errlen, "model: missing metadata '%s'", key);
		return -EINVAL;
	}
	*out = def;
	return 0;
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
	for (size_t i = 0; i < sizeof(archs) / sizeof(archs[0]); i++)
		if (md_gguf_str_eq(s, archs[i].name))
			ad = &archs[i];
	if (!ad) {
		seterr(err, errlen,
		       "model: unsupported architecture '%.*s' (supported: qwen3moe, qwen2moe, llama/mixtral, olmoe, qwen2, qwen3)",
		       (int)(s.len > 64 ? 64 : s.len), s.ptr);
		return -ENOTSUP;
	}
	hp->arch = ad->arch;
	snprintf(hp->arch_name, sizeof(hp->arch_name), "%s", ad->name);
	hp->rope_type = ad->rope;
	hp->norm_topk = ad->norm_topk;

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
	if (rc)
		return rc;
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
		if (hp->arch == MD_ARCH_QWEN3MOE || hp->arch == MD_ARCH_QWEN2MOE)
			rc = get_u32(m, "expert_feed_forward_length", false, hp->n_ff, &hp->n_ff_exp, err, errlen);
		else
			hp->n_ff_exp = hp->n_ff;
		if (!rc && hp->arch == MD_ARCH_QWEN2MOE)
			rc = get_u32(m, "expert_shared_feed_forward_length", false, hp->n_ff, &hp->n_ff_shexp, err, errlen);
		if (rc)
			return rc;
	} else if (hp->arch == MD_ARCH_QWEN3MOE || hp->arch == MD_ARCH_QWEN2MOE || hp->arch == MD_ARCH_OLMOE) {
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
	m->tensors = calloc(m->gguf.n_tensors + 1, sizeof(*m->tensors));
	m->layers = calloc(hp->n_layer, sizeof(*m->layers));
	if (!m->tensors || !m->layers) {
		seterr(err, errlen, "model: out of memory");
		rc = -ENOMEM;
		goto fail_alloc;
	}

	struct binder b = { m, err, errlen, 0 };
	const struct md_gguf_tensor *emb = md_gguf_find_tensor(&m->gguf, "token_embd.weight");
	int64_t n_vocab = emb && emb->n_dims == 2 ? emb->ne[1] : 0;
	if (n_vocab <= 0 || n_vocab > 0x7fffffff) {
		seterr(err, errlen, "model: missing or malformed tensor 'token_embd.weight'");
		rc = -EINVAL;
		goto fail_alloc;
	}
	hp->n_vocab = (uint32_t)n_vocab;
	const int64_t N = hp->n_embd, H = hp->n_head, K = hp->n_head_kv, D = hp->head_dim;
	m->tok_embd = bind(&b, true, 2, N, n_vocab, 0, "token_embd.weight");
	m->output_norm = bind(&b, true, 1, N, 0, 0, "output_norm.weight");
	m->output = bind(&b, false, 2, N, n_vocab, 0, "output.weight");
	if (!m->output && !b.rc) {
		const struct arch_desc *ad = NULL;
		for (size_t i = 0; i < sizeof(archs) / sizeof(archs[0]); i++)
			if (archs[i].arch == hp->arch)
				ad = &archs[i];
		if (ad->output_required) {
			seterr(err, errlen, "model: missing tensor 'output.weight' (arch %s has no tied embeddings)",
			       hp->arch_name);
			rc = -EINVAL;
			goto fail_alloc;
		}
		m->output = m->tok_embd;
		hp->tied_output = true;
	}

	for (uint32_t i = 0; i < hp->n_layer && !b.rc; i++) {
		struct md_layer *L = &m->layers[i];
		L->attn_norm = bind(&b, true, 1, N, 0, 0, "blk.%u.attn_norm.weight", i);
		L->wq = bind(&b, true, 2, N, H * D, 0, "blk.%u.attn_q.weight", i);
		L->wk = bind(&b, true, 2, N, K * D, 0, "blk.%u.attn_k.weight", i);
		L->wv = bind(&b, true, 2, N, K * D, 0, "blk.%u.attn_v.weight", i);
		L->wo = bind(&b, true, 2, H * D, N, 0, "blk.%u.attn_output.weight", i);
		L->bq = bind(&b, false, 1, H * D, 0, 0, "blk.%u.attn_q.bias", i);
		L->bk = bind(&b, false, 1, K * D, 0, 0, "blk.%u.attn_k.bias", i);
		L->bv = bind(&b, false, 1, K * D, 0, 0, "blk.%u.attn_v.bias", i);
		if (hp->arch == MD_ARCH_OLMOE) {
			L->q_norm = bind(&b, true, 1, H * D, 0, 0, "blk.%u.attn_q_norm.weight", i);
			L->k_norm = bind(&b, true, 1, K * D, 0, 0, "blk.%u.attn_k_norm.weight", i);
			hp->qk_norm = MD_QK_NORM_FULL;
		} else if (hp->arch == MD_ARCH_QWEN3MOE || hp->arch == MD_ARCH_QWEN3) {
			L->q_norm = bind(&b, true, 1, D, 0, 0, "blk.%u.attn_q_norm.weight", i);
			L->k_norm = bind(&b, true, 1, D, 0, 0, "blk.%u.attn_k_norm.weight", i);
			hp->qk_norm = MD_QK_NORM_HEAD;
		}
		L->ffn_norm = bind(&b, true, 1, N, 0, 0, "blk.%u.ffn_norm.weight", i);
		if (hp->n_expert) {
			const int64_t E = hp->n_expert, F = hp->n_ff_exp;
			if (F == 0) {
				seterr(err, errlen, "model: expert feed-forward length is 0");
				b.rc = -EINVAL;
				break;
			}
			L->gate_inp = bind(&b, true, 2, N, E, 0, "blk.%u.ffn_gate_inp.weight", i);
			L->gate_exps = bind(&b, true, 3, N, F, E, "blk.%u.ffn_gate_exps.weight", i);
			L->up_exps = bind(&b, true, 3, N, F, E, "blk.%u.ffn_up_exps.weight", i);
			L->down_exps = bind(&b, true, 3, F, N, E, "blk.%u.ffn_down_exps.weight", i);
			if (hp->arch == MD_ARCH_QWEN2MOE) {
				const int64_t S = hp->n_ff_shexp;
				L->gate_inp_shexp = bind(&b, true, 1, N, 0, 0, "blk.%u.ffn_gate_inp_shexp.weight", i);
				L->gate_shexp = bind(&b, true, 2, N, S, 0, "blk.%u.ffn_gate_shexp.weight", i);
				L->up_shexp = bind(&b, true, 2, N, S, 0, "blk.%u.ffn_up_shexp.weight", i);
				L->down_shexp = bind(&b, true, 2, S, N, 0, "blk.%u.ffn_down_shexp.weight", i);
			}
		} else {
			const int64_t FF = hp->n_ff;
			if (FF == 0) {
				seterr(err, errlen, "model: metadata '%s.feed_forward_length' missing", hp->arch_name);
				b.rc = -EINVAL;
				break;
			}
			L->ffn_gate = bind(&b, true, 2, N, FF, 0, "blk.%u.ffn_gate.weight", i);
			L->ffn_up = bind(&b, true, 2, N, FF, 0, "blk.%u.ffn_up.weight", i);
			L->ffn_down = bind(&b, true, 2, FF, N, 0, "blk.%u.ffn_down.weight", i);
		}
	}
	if (b.rc) {
		rc = b.rc;
		goto fail_alloc;
	}
	return 0;

fail_alloc:
	free(m->tensors);
	free(m->layers);
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

