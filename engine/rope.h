/* Rotary position embedding with frequency scaling: plain, linear and YaRN, GGML-compatible. */
#ifndef MD_ROPE_H
#define MD_ROPE_H

#include <stdint.h>

#include "engine/model.h"

/*
 * Pair i (i < n_rot / 2) of a head turns by theta_i(pos) = pos * base^(-2i / n_rot). With a
 * frequency scale s (1 / rope.scaling.factor) the angle is interpolated to s * theta_i; YaRN
 * (ext_factor != 0) mixes the interpolated and the original angle per pair with a ramp
 * between the correction dims (the pairs whose wavelength fits beta_fast resp. beta_slow
 * times into n_ctx_orig) and multiplies cos and sin by 1 + 0.1 ln(1 / s), on top of
 * attn_factor. As GGML's rope_yarn computes it (ggml-cpu ops.cpp), the angles here in double.
 */
struct md_rope {
	int n_rot;
	enum md_rope_type type;
	double base;
	float freq_scale, ext_factor, mscale; /* mscale: attn_factor, times YaRN's own factor */
	float corr[2];                        /* YaRN ramp ends, in pairs */
};

/* Set up a rope of n_rot dims (even) from the model's scaling parameters (engine/model.h). */
void md_rope_init(struct md_rope *r, const struct md_hparams *hp, int n_rot);

/* cs[2i], cs[2i+1] = cos, sin of pair i at position pos, magnitude factor included
 * (n_rot floats; shared by every head of a token). */
void md_rope_table(const struct md_rope *r, int32_t pos, float *cs);

/* Rotate the first n_rot dims of one head in place with a table of md_rope_table: pairs
 * (2i, 2i + 1) for MD_ROPE_NORM, (i, i + n_rot / 2) for MD_ROPE_NEOX. */
void md_rope_apply(const struct md_rope *r, const float *cs, float *x);

#endif
