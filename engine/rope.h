/* Rotary position embedding: the per-position cos/sin table, plain or YaRN-scaled as GGML
 * computes it, and the rotation of one head. */
#ifndef MD_ROPE_H
#define MD_ROPE_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/model.h"

/*
 * Pair i (i < n_rot / 2) of a head turns by theta_i(pos) = pos * base^(-2i / n_rot). With
 * YaRN (ext_factor != 0) the angle is interpolated to freq_scale * theta (freq_scale =
 * 1 / rope.scaling.factor) and mixed with the original one by a ramp over the pair index:
 * theta = interp (1 - mix) + extrap mix, mix = ext_factor (1 - clamp((i - lo) / max(0.001,
 * hi - lo), 0, 1)), between the correction dims lo = floor(d(beta_fast)) and hi =
 * ceil(d(beta_slow)) clamped to [0, n_rot - 1], d(b) = n_rot ln(n_ctx_orig / (2 pi b)) /
 * (2 ln base) (in float, as ggml_rope_yarn_corr_dims). cos and sin are multiplied by the
 * model's yarn_attn_factor and, wherever ext_factor != 0, by 1 + 0.1 ln(1 / freq_scale)
 * (GGML's rope_yarn): what the two come to per architecture (gpt-oss: 1 + 0.1 ln factor;
 * DeepSeek: 1, its q.k scale carrying the mscale instead) is read_rope_scaling's business in
 * model.c. The angles are computed in double (GGML: float products), which changes the
 * tables by float rounding only. (Hugging Face's gpt-oss config says truncate: false, i.e. no
 * floor/ceil; llama.cpp rounds, and so does this, to compute what llama.cpp computes.)
 */
struct md_rope {
	int n_rot;                /* rotary dims (pairs: n_rot / 2) */
	enum md_rope_type type;
	double freq_base;
	float freq_scale;         /* 1 / factor; 1 unscaled */
	float ext_factor;         /* YaRN's ramp weight; 0: no ramp */
	float mscale;             /* magnitude of cos and sin (1 for plain rope) */
	float corr[2];            /* YaRN's ramp ends, in pairs */
};

/* The rope of layer kind swa (sliding-window layers use rope_freq_base_swa) of the model's
 * hparams (n_rot, rope type, base, the rope scaling read_rope_scaling put there). */
void md_rope_init(struct md_rope *r, const struct md_hparams *hp, bool swa);

/* cs[2i] = cos, cs[2i+1] = sin of rotary pair i at position pos, for i < n_rot / 2, already
 * multiplied by mscale. Computed once per token and shared by all its heads. */
void md_rope_table(const struct md_rope *r, int32_t pos, float *cs);

/* Rotate the first n_rot dims of one head in place with a table of md_rope_table: pairs
 * (2i, 2i + 1) for MD_ROPE_NORM, (i, i + n_rot / 2) for MD_ROPE_NEOX. */
void md_rope_apply(const struct md_rope *r, const float *cs, float *x);

#endif
