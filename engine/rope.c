/* Rotary position embedding with frequency scaling: plain, linear and YaRN, GGML-compatible. */
#include "engine/rope.h"

#include <math.h>

/* The pair count at which a rotation of base^(-2i / n_dims) turns n_rot times over n_ctx_orig
 * positions (YaRN's correction dim), as GGML computes it in float. */
static float corr_dim(int n_dims, uint32_t n_ctx_orig, float n_rot, float base)
{
	return (float)n_dims * logf((float)n_ctx_orig / (n_rot * 2.0f * (float)M_PI)) /
	       (2.0f * logf(base));
}

void md_rope_init(struct md_rope *r, const struct md_hparams *hp, int n_rot)
{
	r->n_rot = n_rot;
	r->type = hp->rope_type;
	r->base = hp->rope_freq_base;
	r->freq_scale = hp->rope_freq_scale > 0.0f ? hp->rope_freq_scale : 1.0f;
	r->ext_factor = hp->yarn_ext_factor;
	r->mscale = hp->yarn_attn_factor > 0.0f ? hp->yarn_attn_factor : 1.0f;
	r->corr[0] = r->corr[1] = 0.0f;
	if (r->ext_factor != 0.0f) {
		float start = floorf(corr_dim(n_rot, hp->n_ctx_orig, hp->yarn_beta_fast, hp->rope_freq_base));
		float end = ceilf(corr_dim(n_rot, hp->n_ctx_orig, hp->yarn_beta_slow, hp->rope_freq_base));
		r->corr[0] = start > 0.0f ? start : 0.0f;
		r->corr[1] = end < (float)(n_rot - 1) ? end : (float)(n_rot - 1);
		r->mscale *= 1.0f + 0.1f * logf(1.0f / r->freq_scale);
	}
}

void md_rope_table(const struct md_rope *r, int32_t pos, float *cs)
{
	const int half = r->n_rot / 2;
	for (int i = 0; i < half; i++) {
		double extrap = (double)pos * pow(r->base, -2.0 * i / (double)r->n_rot);
		double theta = extrap * r->freq_scale;
		if (r->ext_factor != 0.0f) {
			/* ramp 1 below corr[0] (keep the original angle), 0 above corr[1] */
			float y = ((float)i - r->corr[0]) / fmaxf(0.001f, r->corr[1] - r->corr[0]);
			float ramp = 1.0f - fminf(1.0f, fmaxf(0.0f, y));
			double mix = (double)(ramp * r->ext_factor);
			theta = theta * (1.0 - mix) + extrap * mix;
		}
		cs[2 * i] = (float)cos(theta) * r->mscale;
		cs[2 * i + 1] = (float)sin(theta) * r->mscale;
	}
}

void md_rope_apply(const struct md_rope *r, const float *cs, float *x)
{
	const int half = r->n_rot / 2;
	for (int i = 0; i < half; i++) {
		float c = cs[2 * i], s = cs[2 * i + 1];
		int a = r->type == MD_ROPE_NEOX ? i : 2 * i;
		int b = r->type == MD_ROPE_NEOX ? i + half : 2 * i + 1;
		float x0 = x[a], x1 = x[b];
		x[a] = x0 * c - x1 * s;
		x[b] = x0 * s + x1 * c;
	}
}
