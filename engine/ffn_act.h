/* The FFN's gated activation of one element, shared by the CPU forward pass and the simulated
 * device so that both compute it with the same float expressions. */
#ifndef MD_FFN_ACT_H
#define MD_FFN_ACT_H

#include <math.h>

#include "engine/model.h"

static inline float md_silu(float x)
{
	return x / (1.0f + expf(-x));
}

/* silu(g) * u, or gpt-oss's clamped variant (enum md_ffn_act). */
static inline float md_glu(enum md_ffn_act act, float g, float u)
{
	if (act == MD_ACT_SWIGLU_OAI) {
		const float alpha = 1.702f, limit = 7.0f;
		float x = g < limit ? g : limit;
		float y = u < -limit ? -limit : u > limit ? limit : u;
		return x / (1.0f + expf(alpha * -x)) * (y + 1.0f);
	}
	return md_silu(g) * u;
}

#endif
