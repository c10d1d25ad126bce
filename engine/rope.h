/* Rotary position embedding: the per-position cos/sin table, plain or YaRN-scaled. */
#ifndef MD_ROPE_H
#define MD_ROPE_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/model.h"

/* The rope of one kind of layer (sliding-window layers may have their own base). */
struct md_rope {
	uint32_t n_rot;      /* rotary dims (pairs: n_rot / 2) */
	double freq_base;
	bool yarn;
	double freq_scale;   /* 1 / factor */
	double ext_factor;
	double mscale;       /* YaRN's magnitude scale of cos and sin (1 + 0.1 ln factor) times
			      * rope.scaling.attn_factor; 1 without YaRN */
	double corr_lo, corr_hi; /* YaRN's ramp between these pair indices */
};

/* The rope of layer kind swa (sliding-window layers use rope_freq_base_swa). */
void md_rope_init(struct md_rope *r, const struct md_hparams *hp, bool swa);

/* cs[2i] = cos, cs[2i+1] = sin of rotary pair i at position pos, for i < n_rot / 2, already
 * multiplied by mscale. Computed once per token and shared by all its heads.
 *
 * YaRN as llama.cpp's ggml_rope_yarn computes it: theta_extrap = pos * base^(-2i/n_rot),
 * theta_interp = freq_scale * theta_extrap, mixed by a ramp over the pair index between the
 * correction dims floor(d(beta_fast)) and ceil(d(beta_slow)) (clamped to [0, n_rot - 1]),
 * d(b) = n_rot ln(n_ctx_orig / (2 pi b)) / (2 ln base): theta = interp (1 - mix) + extrap mix,
 * mix = ext_factor (1 - clamp((i - lo) / max(0.001, hi - lo), 0, 1)). (Hugging Face's
 * gpt-oss config says truncate: false, i.e. no floor/ceil; llama.cpp rounds, and so does
 * this, to compute what llama.cpp computes.) */
void md_rope_table(const struct md_rope *r, int32_t pos, float *cs);

#endif
