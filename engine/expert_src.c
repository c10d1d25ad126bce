/* The default expert source: every expert is already in memory, in the model's tensors. */
#include "engine/expert_src.h"

#include <errno.h>

static int map_get(struct md_expert_src *src, uint32_t layer, int32_t expert,
		   struct md_expert_w *out)
{
	const struct md_model *m = ((struct md_expert_src_map *)src)->m;
	if (layer >= m->hp.n_layer || expert < 0 || (uint32_t)expert >= m->hp.n_expert ||
	    !m->layers[layer].gate_exps) /* a layer with a dense FFN has no experts */
		return -EINVAL;
	const struct md_layer *L = &m->layers[layer];
	out->gate = md_mat_of(L->gate_exps, expert);
	out->up = md_mat_of(L->up_exps, expert);
	out->down = md_mat_of(L->down_exps, expert);
	out->dev = NULL;
	return 0;
}

static const struct md_expert_src_ops map_ops = {
	.name = "mmap",
	.plan = NULL,
	.get = map_get,
	.release = NULL,
};

void md_expert_src_map_init(struct md_expert_src_map *s, const struct md_model *m)
{
	s->base.ops = &map_ops;
	s->m = m;
}
