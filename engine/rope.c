/* Rotary position embedding tables: plain rope and YaRN (see rope.h for the formula). */
#include "engine/rope.h"

#include <math.h>

/* YaRN's correction dim: the pair index whose rotation turns beta times over n_ctx_orig
 * positions, in float as GGML computes it (its floor/ceil decide the ramp's ends). */
static float corr_dim(int n_rot, uint32_t n_ctx_orig, float beta, float base)
{
	return (float)n_rot * logf((float)n_ctx_orig / (beta * 2.0f * (float)M_PI)) / (2.0f * logf(base));
}

void md_rope_init(struct md_rope *r, const struct md_hparams *hp, bool swa)
{
	r->n_rot = (int)hp->n_rot;
	r->type = hp->rope_type;
	r->freq_base = swa ? hp->rope_freq_base_swa : hp->rope_freq_base;
	r->freq_scale = hp->rope_freq_scale > 0.0f ? hp->rope_freq_scale : 1.0f;
	r->ext_factor = hp->yarn_ext_factor;
	r->mscale = hp->yarn_attn_factor > 0.0f ? hp->yarn_attn_factor : 1.0f;
	r->corr[0] = r->corr[1] = 0.0f;
	if (r->ext_factor == 0.0f)
		return;
	const float base = (float)r->freq_base;
	float lo = floorf(corr_dim(r->n_rot, hp->n_ctx_orig_yarn, hp->yarn_beta_fast, base));
	float hi = ceilf(corr_dim(r->n_rot, hp->n_ctx_orig_yarn, hp->yarn_beta_slow, base));
	r->corr[0] = lo > 0.0f ? lo : 0.0f;
	r->corr[1] = hi < (float)(r->n_rot - 1) ? hi : (float)(r->n_rot - 1);
	r->mscale *= 1.0f + 0.1f * logf(1.0f / r->freq_scale);
}

void md_rope_table(const struct md_rope *r, int32_t pos, float *cs)
{
	const int half = r->n_rot / 2;
	for (int i = 0; i < half; i++) {
		double extrap = (double)pos * pow(r->freq_base, -2.0 * i / (double)r->n_rot);
		double theta = extrap * r->freq_scale;
		if (r->ext_factor != 0.0f) {
			/* ramp 1 below corr[0] (keep the original angle), 0 above corr[1] */
			float y = ((float)i - r->corr[0]) / fmaxf(0.001f, r->corr[1] - r->corr[0]);
			double mix = (double)((1.0f - fminf(1.0f, fmaxf(0.0f, y))) * r->ext_factor);
			theta = theta * (1.0 - mix) + extrap * mix;
		}
		cs[2 * i] = (float)cos(theta) * r->mscale;
		cs[2 * i + 1] = (float)sin(theta) * r->mscale;
	}
}

void md_rope_apply(const struct md_rope *r, const float *cs, float *x)
{
	const int half = r->n_rot / 2;
	const bool neox = r->type == MD_ROPE_NEOX;
	for (int i = 0; i < half; i++) {
		float c = cs[2 * i], s = cs[2 * i + 1];
		int a = neox ? i : 2 * i;
		int b = neox ? i + half : 2 * i + 1;
		float x0 = x[a], x1 = x[b];
		x[a] = x0 * c - x1 * s;
		x[b] = x0 * s + x1 * c;
	}
}
