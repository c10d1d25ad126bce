/* bench_sched: what expert-aware batching costs the scheduler per step, without a model.
 *
 * S decoding sequences, room for R per step, a model shape of L MoE layers x E experts, top-K
 * (default 64, 16, Qwen3-30B-A3B's 48 x 128, top-8): each step plans, reports a routing (every
 * sequence's token picks K random experts per layer, drawn from one of 8 topic pools of 2K
 * experts so sequences on a topic overlap), commits and appends a token. Prints microseconds
 * per step (plan + routing note + commit) with expert-batching off and on, alternating runs,
 * medians, and the difference: the time the selection adds to every engine step, to set
 * against the step times bench_expert_batching.py measures.
 *
 * usage: bench_sched [SEQS=64] [ROOM=16] [LAYERS=48] [EXPERTS=128] [TOPK=8] [STEPS=2000] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/kv_cache.h"
#include "engine/sched.h"

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static uint64_t rng = 88172645463325252ull;

static uint32_t rnd(uint32_t n)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return (uint32_t)(rng % n);
}

/* Microseconds per step over steps steps. */
static double run(bool aware, uint32_t S, uint32_t R, uint32_t L, uint32_t E, uint32_t K,
		  uint32_t steps)
{
	struct md_kv_cache kv;
	struct md_sched sc;
	uint32_t ctx = steps + 8;
	if (md_kv_init(&kv, 1, 4, S * (ctx / MD_KV_BLOCK_TOKENS + 2), S))
		return -1;
	struct md_sched_config c = { .max_seqs = S, .step_tokens = R, .n_ctx = ctx, .n_layer = L,
				     .n_expert = E, .expert_aware = aware };
	if (md_sched_init(&sc, &c, &kv))
		return -1;
	md_owner_claim(&sc.owner, "engine");
	for (uint32_t i = 0; i < S; i++) {
		struct md_engine_req *r = calloc(1, sizeof(*r));
		r->id = i;
		r->n_prompt = 1;
		r->prompt = malloc(sizeof(int32_t));
		r->prompt[0] = 1;
		r->max_tokens = ctx;
		md_sampling_default(&r->sampling);
		md_sched_enqueue(&sc, md_seq_new(r, ctx, 8, i));
	}
	int32_t *ids = malloc(sizeof(int32_t) * R * K);
	double t0 = now_s();
	for (uint32_t st = 0; st < steps; st++) {
		md_sched_plan(&sc);
		struct md_plan *p = &sc.plan;
		for (uint32_t l = 0; l < L; l++) {
			for (uint32_t i = 0; i < p->n_items; i++) {
				uint32_t topic = (uint32_t)(p->items[i].seq->req->id % 8);
				for (uint32_t j = 0; j < K; j++)
					ids[p->items[i].row * K + j] =
						(int32_t)((topic * 2 * K + rnd(2 * K)) % E);
			}
			struct md_routing r = { .n_tokens = (int)p->n_tokens, .n_expert = (int)E,
						.n_used = (int)K, .ids = ids };
			md_sched_note_routing(&sc, l, &r);
		}
		md_sched_commit(&sc, NULL);
		for (uint32_t i = 0; i < p->n_items; i++)
			md_sched_append(&sc, p->items[i].seq, 7);
	}
	double us = (now_s() - t0) * 1e6 / steps;
	free(ids);
	md_sched_release(&sc);
	md_kv_release(&kv);
	return us;
}

int main(int argc, char **argv)
{
	uint32_t v[6] = { 64, 16, 48, 128, 8, 2000 };
	for (int i = 1; i < argc && i <= 6; i++)
		v[i - 1] = (uint32_t)strtoul(argv[i], NULL, 10);
	uint32_t S = v[0], R = v[1], L = v[2], E = v[3], K = v[4], steps = v[5];
	if (!S || !R || !L || !E || !K || K > E || !steps) {
		fprintf(stderr,
			"usage: bench_sched [SEQS] [ROOM] [LAYERS] [EXPERTS] [TOPK] [STEPS]\n");
		return 2;
	}
	enum { REPS = 5 };
	double off[REPS], on[REPS];
	for (int r = 0; r < REPS; r++) {
		off[r] = run(false, S, R, L, E, K, steps);
		on[r] = run(true, S, R, L, E, K, steps);
		if (off[r] < 0 || on[r] < 0) {
			fprintf(stderr, "bench_sched: out of memory\n");
			return 1;
		}
	}
	qsort(off, REPS, sizeof(double), cmp_d);
	qsort(on, REPS, sizeof(double), cmp_d);
	printf("%u decoding sequences, room %u, %u layers x %u experts, top-%u, %u steps, %d "
	       "alternating runs\n", S, R, L, E, K, steps, REPS);
	printf("| expert-batching | us per step (median) | spread |\n| --- | ---: | ---: |\n");
	printf("| off | %.1f | %.1f..%.1f |\n", off[REPS / 2], off[0], off[REPS - 1]);
	printf("| on | %.1f | %.1f..%.1f |\n", on[REPS / 2], on[0], on[REPS - 1]);
	printf("selection adds %.1f us per step\n", on[REPS / 2] - off[REPS / 2]);
	return 0;
}
