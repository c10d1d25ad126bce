/* Rotary position embedding tables: plain rope and YaRN (see rope.h for the formula). */
#include "engine/rope.h"

#include <math.h>

static double corr_dim(double n_rot, double n_ctx_orig, double beta, double base)
{
	return n_rot * log(n_ctx_orig / (beta * 2.0 * M_PI)) / (2.0 * log(base));
}

void md_rope_init(struct md_rope *r, const struct md_hparams *hp, bool swa)
{
	r->n_rot = hp->n_rot;
	r->freq_base = swa ? hp->rope_freq_base_swa : hp->rope_freq_base;
	r->yarn = hp->rope_yarn;
	r->freq_scale = hp->rope_yarn ? hp->rope_freq_scale : 1.0;
	r->ext_factor = hp->rope_yarn ? hp->yarn_ext_factor : 0.0;
	r->mscale = 1.0;
	r->corr_lo = r->corr_hi = 0;
	if (!r->yarn)
		return;
	/* llama.cpp: attn_factor = get_mscale(factor) / (1 + 0.1 ln factor) * rope.scaling.
	 * attn_factor (the first two cancel), then rope_yarn multiplies by 1 + 0.1 ln factor
	 * wherever ext_factor != 0. */
	double factor = 1.0 / r->freq_scale;
	r->mscale = hp->rope_attn_factor;
	if (r->ext_factor != 0.0)
		r->mscale *= 1.0 + 0.1 * log(factor);
	double lo = floor(corr_dim(r->n_rot, hp->n_ctx_orig_yarn, hp->yarn_beta_fast, r->freq_base));
	double hi = ceil(corr_dim(r->n_rot, hp->n_ctx_orig_yarn, hp->yarn_beta_slow, r->freq_base));
	r->corr_lo = lo > 0 ? lo : 0;
	r->corr_hi = hi < r->n_rot - 1 ? hi : r->n_rot - 1;
}

void md_rope_table(const struct md_rope *r, int32_t pos, float *cs)
{
	const int half = (int)r->n_rot / 2;
	for (int i = 0; i < half; i++) {
		double theta = (double)pos * pow(r->freq_base, -2.0 * i / (double)r->n_rot);
		if (r->yarn) {
			double interp = r->freq_scale * theta;
			double y = (i - r->corr_lo) / fmax(0.001, r->corr_hi - r->corr_lo);
			double mix = (1.0 - fmin(1.0, fmax(0.0, y))) * r->ext_factor;
			theta = interp * (1.0 - mix) + theta * mix;
		}
		cs[2 * i] = (float)(cos(theta) * r->mscale);
		cs[2 * i + 1] = (float)(sin(theta) * r->mscale);
	}
}
