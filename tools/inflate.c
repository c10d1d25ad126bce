/* Inflate a model: rewrite a GGUF into a larger one that computes the same function. */
#include "tools/inflate.h"

#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine/gguf.h"
#include "engine/quant.h"
#include "tools/gguf_writer.h"

/* What happens along one axis of a tensor. */
enum axis {
	AX_KEEP,    /* unchanged */
	AX_TILE_A,  /* the residual stream: A copies */
	AX_TILE_C,  /* attention heads: C copies */
	AX_PAD_B,   /* FFN units: zero-padded to B times */
};

/* How a tensor widens: ne0 (the input of a matrix) and ne1 (its rows). A matrix that reads k
 * copies of its input (scale_in) reads the first one only: the other columns are zero. */
struct rule {
	const char *suffix;  /* tensor name after "blk.N." (or the whole name) */
	enum axis ax0, ax1;
	bool scale_in;
	bool keep_type;      /* never converted (norms, router: llama.cpp keeps them too) */
};

static const struct rule rules[] = {
	{ "token_embd.weight", AX_TILE_A, AX_KEEP, false, false },
	{ "output.weight", AX_TILE_A, AX_KEEP, true, false },
	{ "output_norm.weight", AX_TILE_A, AX_KEEP, false, true },
	{ "attn_norm.weight", AX_TILE_A, AX_KEEP, false, true },
	{ "ffn_norm.weight", AX_TILE_A, AX_KEEP, false, true },
	{ "attn_q.weight", AX_TILE_A, AX_TILE_C, true, false },
	{ "attn_k.weight", AX_TILE_A, AX_TILE_C, true, false },
	{ "attn_v.weight", AX_TILE_A, AX_TILE_C, true, false },
	{ "attn_q.bias", AX_TILE_C, AX_KEEP, false, true },
	{ "attn_k.bias", AX_TILE_C, AX_KEEP, false, true },
	{ "attn_v.bias", AX_TILE_C, AX_KEEP, false, true },
	{ "attn_output.weight", AX_TILE_C, AX_TILE_A, true, false },
	{ "attn_output.bias", AX_TILE_A, AX_KEEP, false, true },
	/* q/k norms: per head (head_dim long, kept) or over all heads (tiled); see widen_rule */
	{ "attn_q_norm.weight", AX_TILE_C, AX_KEEP, false, true },
	{ "attn_k_norm.weight", AX_TILE_C, AX_KEEP, false, true },
	{ "ffn_gate_inp.weight", AX_TILE_A, AX_KEEP, true, true },
	{ "ffn_gate_exps.weight", AX_TILE_A, AX_PAD_B, true, false },
	{ "ffn_up_exps.weight", AX_TILE_A, AX_PAD_B, true, false },
	{ "ffn_down_exps.weight", AX_PAD_B, AX_TILE_A, false, false },
	{ "ffn_gate_shexp.weight", AX_TILE_A, AX_PAD_B, true, false },
	{ "ffn_up_shexp.weight", AX_TILE_A, AX_PAD_B, true, false },
	{ "ffn_down_shexp.weight", AX_PAD_B, AX_TILE_A, false, false },
	{ "ffn_gate_inp_shexp.weight", AX_TILE_A, AX_KEEP, true, true },
	{ "ffn_gate.weight", AX_TILE_A, AX_PAD_B, true, false },
	{ "ffn_up.weight", AX_TILE_A, AX_PAD_B, true, false },
	{ "ffn_down.weight", AX_PAD_B, AX_TILE_A, false, false },
};

/* One tensor of the output: where it comes from and how it widens. */
struct job {
	const struct md_inflate_opts *o;
	const struct md_gguf_tensor *src;
	struct rule r;
	uint32_t type;          /* output type */
	int64_t ne[4];          /* output shape */
	uint32_t n_dims;
	char name[96];
};

static uint32_t mult(const struct md_inflate_opts *o, enum axis a)
{
	switch (a) {
	case AX_TILE_A:
		return o->embd_mult;
	case AX_TILE_C:
		return o->head_mult;
	case AX_PAD_B:
		return o->ff_mult;
	default:
		return 1;
	}
}

/* Output row r of the widened matrix: its source row, or -1 for a zero row. */
static int64_t src_row(const struct job *j, int64_t r)
{
	int64_t n_old = j->src->ne[1];
	if (j->r.ax1 == AX_PAD_B)
		return r < n_old ? r : -1;
	return r % n_old; /* tiled or kept */
}

/* Widen one row (src: n_old floats) into dst (n_new floats). */
static void widen_row(const struct job *j, const float *src, float *dst)
{
	int64_t n_old = j->src->ne[0], n_new = j->ne[0];
	/* padded, or read by a matrix: the first copy is the row, the rest zero */
	if (j->r.ax0 == AX_PAD_B || j->r.scale_in) {
		memcpy(dst, src, sizeof(float) * (size_t)n_old);
		memset(dst + n_old, 0, sizeof(float) * (size_t)(n_new - n_old));
		return;
	}
	for (int64_t c = 0; c < n_new / n_old; c++)
		memcpy(dst + c * n_old, src, sizeof(float) * (size_t)n_old);
}

/* The same in raw bytes, for a row kept in its type (n_old a multiple of the block size):
 * all-zero bytes are zeros in every GGML type. */
static void widen_row_raw(const struct job *j, const uint8_t *src, size_t src_bytes, uint8_t *dst,
			  size_t dst_bytes)
{
	if (j->r.ax0 == AX_PAD_B || j->r.scale_in) {
		memcpy(dst, src, src_bytes);
		memset(dst + src_bytes, 0, dst_bytes - src_bytes);
		return;
	}
	for (size_t off = 0; off < dst_bytes; off += src_bytes)
		memcpy(dst + off, src, src_bytes);
}

static int fill(void *vctx, void *dst, size_t nbytes)
{
	const struct job *j = vctx;
	const struct md_gguf_tensor *t = j->src;
	size_t src_row_bytes = md_dtype_row_size((enum md_dtype)t->type, t->ne[0]);
	size_t dst_row_bytes = md_dtype_row_size((enum md_dtype)j->type, j->ne[0]);
	float *in = malloc(sizeof(float) * (size_t)t->ne[0]);
	float *out = malloc(sizeof(float) * (size_t)j->ne[0]);
	if (!in || !out) {
		free(in);
		free(out);
		return -ENOMEM;
	}
	uint8_t *d = dst;
	int64_t rows = j->ne[1], mats = j->ne[2] * j->ne[3];
	const struct md_dtype_info *si = md_dtype_info(t->type);
	bool raw = j->type == t->type && t->ne[0] % si->blck == 0;
	for (int64_t m = 0; m < mats; m++) {
		const uint8_t *base = (const uint8_t *)t->data + (size_t)m * t->ne[1] * src_row_bytes;
		for (int64_t r = 0; r < rows; r++) {
			int64_t sr = src_row(j, r);
			if (raw) {
				if (sr < 0)
					memset(d, 0, dst_row_bytes);
				else
					widen_row_raw(j, base + (size_t)sr * src_row_bytes, src_row_bytes, d,
						      dst_row_bytes);
				d += dst_row_bytes;
				continue;
			}
			if (sr < 0) {
				memset(out, 0, sizeof(float) * (size_t)j->ne[0]);
			} else {
				md_dequant_row((enum md_dtype)t->type, base + (size_t)sr * src_row_bytes, in,
					       t->ne[0]);
				widen_row(j, in, out);
			}
			md_quantize_row((enum md_dtype)j->type, out, d, j->ne[0]);
			d += dst_row_bytes;
		}
	}
	free(in);
	free(out);
	return (size_t)(d - (uint8_t *)dst) == nbytes ? 0 : -EIO;
}

static void set_err(char *err, size_t errlen, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

static void set_err(char *err, size_t errlen, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(err, errlen, fmt, ap);
	va_end(ap);
}

/* The rule for a tensor name ("blk.N." stripped), or NULL. */
static const struct rule *rule_for(const char *name)
{
	const char *s = name;
	if (strncmp(s, "blk.", 4) == 0) {
		const char *dot = strchr(s + 4, '.');
		if (dot)
			s = dot + 1;
	}
	for (size_t i = 0; i < sizeof(rules) / sizeof(rules[0]); i++)
		if (strcmp(s, rules[i].suffix) == 0)
			return &rules[i];
	return NULL;
}

/* Multiply a u32 hyperparameter key by k where the file has it. */
static void scale_key(struct md_gguf_writer *w, const struct md_gguf *g, const char *arch,
		      const char *what, uint32_t k)
{
	char key[128];
	uint32_t v;
	snprintf(key, sizeof(key), "%s.%s", arch, what);
	if (md_gguf_get_u32(g, key, &v))
		md_gguf_w_u32(w, key, v * k);
}

/* Plan one tensor: output shape, type and rule. Returns 0 or -EINVAL with err set. */
static int plan(struct job *j, const struct md_gguf_tensor *t, const struct md_inflate_opts *o,
		uint32_t head_dim, char *err, size_t errlen)
{
	memset(j, 0, sizeof(*j));
	j->o = o;
	j->src = t;
	snprintf(j->name, sizeof(j->name), "%.*s", (int)t->name.len, t->name.ptr);
	const struct rule *r = rule_for(j->name);
	if (!r) {
		set_err(err, errlen, "tensor '%s': no inflation rule for it", j->name);
		return -EINVAL;
	}
	j->r = *r;
	/* Per-head q/k norms are head_dim long and shared by all heads: nothing to widen. */
	if ((strstr(j->name, "attn_q_norm") || strstr(j->name, "attn_k_norm")) &&
	    t->ne[0] == head_dim)
		j->r.ax0 = AX_KEEP;
	j->n_dims = t->n_dims;
	for (int d = 0; d < 4; d++)
		j->ne[d] = t->ne[d];
	j->ne[0] *= mult(o, j->r.ax0);
	if (t->n_dims >= 2)
		j->ne[1] *= mult(o, j->r.ax1);
	j->type = t->type;
	if (o->type >= 0 && !j->r.keep_type && t->n_dims >= 2)
		j->type = (uint32_t)o->type;
	const struct md_dtype_info *ti = md_dtype_info(j->type);
	const struct md_dtype_info *si = md_dtype_info(t->type);
	if (!si || !si->supported) {
		set_err(err, errlen, "tensor '%s': type %u cannot be read", j->name, t->type);
		return -EINVAL;
	}
	if (!ti || !ti->supported || j->ne[0] % ti->blck != 0) {
		set_err(err, errlen, "tensor '%s': rows of %lld cannot be written as %s (block %lld)",
			j->name, (long long)j->ne[0], ti ? ti->name : "?", ti ? (long long)ti->blck : 0LL);
		return -EINVAL;
	}
	return 0;
}

int md_inflate(const char *in_path, const char *out_path, const struct md_inflate_opts *o,
	       char *err, size_t errlen)
{
	if (o->embd_mult < 1 || o->head_mult < 1 || o->ff_mult < 1) {
		set_err(err, errlen, "multiples must be >= 1");
		return -EINVAL;
	}
	struct stat si, so;
	if (stat(in_path, &si) == 0 && stat(out_path, &so) == 0 && si.st_dev == so.st_dev &&
	    si.st_ino == so.st_ino) {
		set_err(err, errlen, "'%s' is the input: write the inflated model elsewhere", out_path);
		return -EINVAL;
	}
	struct md_gguf g;
	char why[256];
	int rc = md_gguf_open(&g, in_path, why, sizeof(why));
	if (rc) {
		set_err(err, errlen, "cannot open '%s': %s", in_path, why);
		return rc;
	}
	struct md_gguf_writer *w = md_gguf_writer_new();
	struct job *jobs = calloc(g.n_tensors + 1, sizeof(*jobs));
	if (!w || !jobs) {
		rc = -ENOMEM;
		set_err(err, errlen, "out of memory");
		goto out;
	}
	struct md_gguf_str a;
	char arch[64];
	if (!md_gguf_get_str(&g, "general.architecture", &a) || a.len >= sizeof(arch)) {
		rc = -EINVAL;
		set_err(err, errlen, "'%s' has no general.architecture", in_path);
		goto out;
	}
	memcpy(arch, a.ptr, a.len);
	arch[a.len] = 0;
	char key[128];
	uint32_t n_embd = 0, n_head = 0, head_dim = 0;
	snprintf(key, sizeof(key), "%s.embedding_length", arch);
	md_gguf_get_u32(&g, key, &n_embd);
	snprintf(key, sizeof(key), "%s.attention.head_count", arch);
	md_gguf_get_u32(&g, key, &n_head);
	snprintf(key, sizeof(key), "%s.attention.key_length", arch);
	if (!md_gguf_get_u32(&g, key, &head_dim) && n_head)
		head_dim = n_embd / n_head;

	md_gguf_w_copy_kv(w, &g);
	scale_key(w, &g, arch, "embedding_length", o->embd_mult);
	scale_key(w, &g, arch, "attention.head_count", o->head_mult);
	scale_key(w, &g, arch, "attention.head_count_kv", o->head_mult);
	scale_key(w, &g, arch, "feed_forward_length", o->ff_mult);
	scale_key(w, &g, arch, "expert_feed_forward_length", o->ff_mult);
	scale_key(w, &g, arch, "expert_shared_feed_forward_length", o->ff_mult);
	/* key_length / value_length stay: head_dim does not change */
	if (!md_gguf_find_tensor(&g, "output.weight")) {
		/* Tied output: write it untied (the embedding is copied unscaled, the output reads
		 * the stream scaled). The last job is the output, from the embedding. */
		const struct md_gguf_tensor *te = md_gguf_find_tensor(&g, "token_embd.weight");
		if (!te) {
			rc = -EINVAL;
			set_err(err, errlen, "'%s' has no token_embd.weight", in_path);
			goto out;
		}
	}

	uint64_t n_jobs = 0;
	for (uint64_t i = 0; i < g.n_tensors; i++) {
		rc = plan(&jobs[n_jobs], &g.tensors[i], o, head_dim, err, errlen);
		if (rc)
			goto out;
		n_jobs++;
	}
	if (!md_gguf_find_tensor(&g, "output.weight")) {
		const struct md_gguf_tensor *te = md_gguf_find_tensor(&g, "token_embd.weight");
		rc = plan(&jobs[n_jobs], te, o, head_dim, err, errlen);
		if (rc)
			goto out;
		jobs[n_jobs].r = *rule_for("output.weight");
		snprintf(jobs[n_jobs].name, sizeof(jobs[n_jobs].name), "output.weight");
		n_jobs++;
	}
	for (uint64_t i = 0; i < n_jobs; i++) {
		rc = md_gguf_w_tensor(w, jobs[i].name, jobs[i].type, jobs[i].n_dims, jobs[i].ne, fill,
				      &jobs[i]);
		if (rc) {
			set_err(err, errlen, "tensor '%s': cannot declare it", jobs[i].name);
			goto out;
		}
	}
	rc = md_gguf_writer_write(w, out_path, err, errlen);
out:
	free(jobs);
	md_gguf_writer_free(w);
	md_gguf_close(&g);
	return rc;
}

static const struct { const char *name; enum md_dtype t; } type_names[] = {
	{ "f32", MD_DT_F32 }, { "f16", MD_DT_F16 }, { "bf16", MD_DT_BF16 }, { "q8_0", MD_DT_Q8_0 },
	{ "q4_0", MD_DT_Q4_0 }, { "q4_k", MD_DT_Q4_K }, { "q5_k", MD_DT_Q5_K }, { "q6_k", MD_DT_Q6_K },
	{ "q4_1", MD_DT_Q4_1 }, { "q5_0", MD_DT_Q5_0 }, { "q5_1", MD_DT_Q5_1 }, { "q2_k", MD_DT_Q2_K },
	{ "q3_k", MD_DT_Q3_K }, { "iq4_nl", MD_DT_IQ4_NL }, { "iq4_xs", MD_DT_IQ4_XS },
	{ "mxfp4", MD_DT_MXFP4 },
};

static bool parse_mult(const char *s, uint32_t *out)
{
	char *end;
	unsigned long v = strtoul(s, &end, 10);
	if (*s == 0 || *end != 0 || v < 1 || v > 1024)
		return false;
	*out = (uint32_t)v;
	return true;
}

int md_inflate_main(int argc, char **argv)
{
	struct md_inflate_opts o = { 1, 1, 1, -1 };
	const char *paths[2];
	int n_paths = 0;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		bool has_val = i + 1 < argc;
		if (strcmp(a, "--embd") == 0 && has_val) {
			if (!parse_mult(argv[++i], &o.embd_mult))
				goto bad;
		} else if (strcmp(a, "--heads") == 0 && has_val) {
			if (!parse_mult(argv[++i], &o.head_mult))
				goto bad;
		} else if (strcmp(a, "--ff") == 0 && has_val) {
			if (!parse_mult(argv[++i], &o.ff_mult))
				goto bad;
		} else if (strcmp(a, "--type") == 0 && has_val) {
			const char *t = argv[++i];
			o.type = -2;
			for (size_t k = 0; k < sizeof(type_names) / sizeof(type_names[0]); k++)
				if (strcmp(t, type_names[k].name) == 0)
					o.type = (int32_t)type_names[k].t;
			if (o.type == -2) {
				fprintf(stderr, "moed-gguf inflate: unknown type '%s'\n", t);
				return 2;
			}
		} else if (a[0] != '-' && n_paths < 2) {
			paths[n_paths++] = a;
		} else {
			goto bad;
		}
	}
	if (n_paths != 2)
		goto bad;
	char err[512] = "";
	int rc = md_inflate(paths[0], paths[1], &o, err, sizeof(err));
	if (rc) {
		fprintf(stderr, "moed-gguf inflate: %s\n", err);
		return 1;
	}
	return 0;
bad:
	fprintf(stderr, "usage: moed-gguf inflate [--embd N] [--heads N] [--ff N] [--type T] IN OUT\n");
	return 2;
}
