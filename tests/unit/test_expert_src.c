/* Unit tests for the expert seam of the forward pass: sources other than the mapping give
 * bit-identical logits, the forward pass keeps the plan/get/release protocol of
 * engine/expert_src.h (and never reads weights after release), the route observer sees
 * what the source is asked for, and a failing source fails md_forward cleanly.
 *
 * usage: test_expert_src MOED_GGUF */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/expert_src.h"
#include "engine/forward.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "tests/check.h"
#include "gen_model.h"

#define MAX_E 16
#define MAX_L 4

/* A source that copies each expert into its own buffers on get and poisons and frees them
 * on release (what an expert store does with a slot, made hostile): a forward pass that
 * read weights after release, or before get, would change its logits. It also checks the
 * protocol and counts calls. fail_layer/fail_nth inject a get error. */
struct copy_src {
	struct md_expert_src base;
	struct md_expert_src_map map; /* where the copies come from */
	void *held[MAX_L][MAX_E][3];  /* owned: copies of the experts got and not released */
	int32_t planned[MAX_L][MAX_E];
	int n_planned[MAX_L], next_get[MAX_L];
	int n_plan, n_get, n_release, n_held, protocol_errors;
	int planned_tokens; /* sum of the tokens plan was told were routed to its experts */
	int fail_layer, fail_nth; /* -1: never */
	bool waves; /* plan reverses the order and calls the first half ready: two waves */
};

static size_t mat_bytes(const struct md_mat *m)
{
	return m->nb1 * (size_t)m->n_out;
}

static void *dup_mat(struct md_mat *m)
{
	void *p = malloc(mat_bytes(m));
	if (p) {
		memcpy(p, m->data, mat_bytes(m));
		m->data = p;
	}
	return p;
}

static int copy_plan(struct md_expert_src *s, uint32_t layer, const int32_t *experts,
		     const int32_t *tokens, int n, int32_t *order)
{
	struct copy_src *c = (struct copy_src *)s;
	c->n_plan++;
	if (layer >= MAX_L || n > MAX_E || !tokens) {
		c->protocol_errors++;
		return -EINVAL;
	}
	for (int i = 0; i < n; i++) {
		if (order[i] != i || tokens[i] < 1) /* arrives as the identity; experts used */
			c->protocol_errors++;
		c->planned_tokens += tokens[i];
		if (c->waves)
			order[i] = n - 1 - i;
		c->planned[layer][i] = experts[order[i]];
	}
	c->n_planned[layer] = n;
	c->next_get[layer] = 0;
	return c->waves ? n / 2 : 0;
}

static int copy_get(struct md_expert_src *s, uint32_t layer, int32_t e, struct md_expert_w *out)
{
	struct copy_src *c = (struct copy_src *)s;
	/* Gets follow the plan, in its order, once each. */
	if (layer >= MAX_L || c->next_get[layer] >= c->n_planned[layer] ||
	    c->planned[layer][c->next_get[layer]] != e || c->held[layer][e][0]) {
		c->protocol_errors++;
		return -EINVAL;
	}
	if ((int)layer == c->fail_layer && c->next_get[layer] == c->fail_nth)
		return -EIO;
	c->next_get[layer]++;
	int rc = md_expert_src_get(&c->map.base, layer, e, out);
	if (rc)
		return rc;
	c->held[layer][e][0] = dup_mat(&out->gate);
	c->held[layer][e][1] = dup_mat(&out->up);
	c->held[layer][e][2] = dup_mat(&out->down);
	c->n_get++;
	c->n_held++;
	return 0;
}

static void copy_release(struct md_expert_src *s, uint32_t layer, int32_t e)
{
	struct copy_src *c = (struct copy_src *)s;
	if (layer >= MAX_L || !c->held[layer][e][0]) {
		c->protocol_errors++;
		return;
	}
	struct md_expert_w w;
	md_expert_src_get(&c->map.base, layer, e, &w);
	const struct md_mat *m[3] = { &w.gate, &w.up, &w.down };
	for (int i = 0; i < 3; i++) {
		memset(c->held[layer][e][i], 0xff, mat_bytes(m[i])); /* NaNs, huge scales */
		free(c->held[layer][e][i]);
		c->held[layer][e][i] = NULL;
	}
	c->n_release++;
	c->n_held--;
}

static const struct md_expert_src_ops copy_ops = {
	.name = "test-copy",
	.plan = copy_plan,
	.get = copy_get,
	.release = copy_release,
};

static void copy_src_init(struct copy_src *c, const struct md_model *m)
{
	memset(c, 0, sizeof(*c));
	c->base.ops = &copy_ops;
	md_expert_src_map_init(&c->map, m);
	c->fail_layer = -1;
}

/* The route observer: what it saw per layer of the last pass. */
struct seen {
	int calls;
	int32_t active[MAX_L][MAX_E];
	int n_active[MAX_L], n_tokens[MAX_L];
};

static void on_route(void *ud, uint32_t layer, const struct md_routing *r)
{
	struct seen *s = ud;
	s->calls++;
	if (layer < MAX_L && r->n_active <= MAX_E) {
		memcpy(s->active[layer], r->active, (size_t)r->n_active * sizeof(int32_t));
		s->n_active[layer] = r->n_active;
		s->n_tokens[layer] = r->n_tokens;
	}
}

struct fw {
	struct md_model m;
	struct md_kv_cache kv;
	struct md_forward_ctx *f;
	size_t V;
};

/* Prefill n tokens then decode 3 on a fresh sequence; all logits rows into out. Returns
 * the total rows, or md_forward's first error. */
static int run(struct fw *w, const int32_t *tok, int n, float *out)
{
	int s = md_kv_seq_new(&w->kv);
	int32_t sq[64], ps[64];
	bool want[64];
	int rows = 0, rc = 0;
	if (s < 0 || md_kv_reserve(&w->kv, s, (uint32_t)n + 3))
		return -ENOSPC;
	for (int t = 0; t < n + 3; t++) {
		sq[t] = s;
		ps[t] = t;
		want[t] = true;
	}
	struct md_batch b = { n, tok, sq, ps, want, NULL };
	rc = md_forward(w->f, &w->kv, &b, out);
	for (int step = 0; rc >= 0 && step < 3; step++) {
		rows += rc;
		struct md_batch d = { 1, tok + step, sq, ps + n + step, want, NULL };
		rc = md_forward(w->f, &w->kv, &d, out + (size_t)rows * w->V);
	}
	if (rc >= 0)
		rows += rc;
	md_kv_seq_free(&w->kv, s);
	return rc < 0 ? rc : rows;
}

static void test_model(const char *moed_gguf, const char *type)
{
	const char *args[] = { "--arch", "qwen2moe", "--type", type, "--seed", "3", "--n-layer", "3",
			       "--n-embd", "256", "--head-dim", "64", "--n-ff-exp", "256",
			       "--n-ff-shexp", "256", "--n-expert", "12", "--n-expert-used", "3", NULL };
	char dir[512], path[600], err[256];
	if (gen_model(moed_gguf, args, "experts.gguf", dir, sizeof dir, path, sizeof path)) {
		failures++;
		return;
	}
	struct fw w;
	memset(&w, 0, sizeof(w));
	if (md_model_load(&w.m, path, err, sizeof err)) {
		fprintf(stderr, "load: %s\n", err);
		failures++;
		gen_model_cleanup(dir, path);
		return;
	}
	const struct md_hparams *hp = &w.m.hp;
	w.V = hp->n_vocab;
	CHECK_EQ_I(md_kv_init(&w.kv, hp->n_layer, hp->n_head_kv * hp->head_dim, 16, 4), 0);
	w.f = md_forward_new(&w.m, 1, 32);
	CHECK(w.f != NULL);
	enum { N = 19, ROWS = N + 3 };
	int32_t tok[N];
	for (int i = 0; i < N; i++)
		tok[i] = (int32_t)((i * 53 + 7) % (int)w.V);
	float *ref = calloc(ROWS * w.V, sizeof(float)), *got = calloc(ROWS * w.V, sizeof(float));

	/* The default source (the mapping). */
	CHECK_EQ_I(run(&w, tok, N, ref), ROWS);

	/* The copying source with an observer: the same logits bit for bit. */
	struct copy_src c;
	struct seen seen;
	memset(&seen, 0, sizeof(seen));
	copy_src_init(&c, &w.m);
	md_forward_set_expert_src(w.f, &c.base);
	md_forward_set_route_cb(w.f, on_route, &seen);
	CHECK_EQ_I(run(&w, tok, N, got), ROWS);
	CHECK(memcmp(got, ref, ROWS * w.V * sizeof(float)) == 0);
	CHECK_EQ_I(c.protocol_errors, 0);
	CHECK_EQ_I(c.n_held, 0);
	CHECK_EQ_I(c.n_plan, 4 * (int)hp->n_layer); /* 4 passes, once per layer each */
	/* every token routed to k experts in every layer */
	CHECK_EQ_I(c.planned_tokens, ROWS * (int)hp->n_expert_used * (int)hp->n_layer);
	CHECK_EQ_I(c.n_release, c.n_get);
	CHECK_EQ_I(seen.calls, 4 * (int)hp->n_layer);
	/* The last pass (one token): the observer saw k experts, the source was asked for them
	 * (in the identity order: the copying source keeps it). */
	for (uint32_t l = 0; l < hp->n_layer; l++) {
		CHECK_EQ_I(seen.n_tokens[l], 1);
		CHECK_EQ_I(seen.n_active[l], (int)hp->n_expert_used);
		CHECK_EQ_I(c.n_planned[l], seen.n_active[l]);
		CHECK(memcmp(c.planned[l], seen.active[l], (size_t)seen.n_active[l] * sizeof(int32_t)) == 0);
	}

	/* Gets in reversed order, the first half as a wave of its own: the same logits. */
	c.waves = true;
	memset(got, 0, ROWS * w.V * sizeof(float));
	CHECK_EQ_I(run(&w, tok, N, got), ROWS);
	CHECK(memcmp(got, ref, ROWS * w.V * sizeof(float)) == 0);
	CHECK_EQ_I(c.protocol_errors, 0);
	CHECK_EQ_I(c.n_held, 0);
	c.waves = false;

	/* A get that fails in layer 1: md_forward returns its code, holds nothing, commits
	 * nothing; the next pass with a working source gives the reference again. */
	c.fail_layer = 1;
	c.fail_nth = 1;
	int s = md_kv_seq_new(&w.kv);
	CHECK_EQ_I(md_kv_reserve(&w.kv, s, 4), 0);
	int32_t sq[4] = { s, s, s, s }, ps[4] = { 0, 1, 2, 3 };
	struct md_batch b = { 4, tok, sq, ps, NULL, NULL };
	CHECK_EQ_I(md_forward(w.f, &w.kv, &b, got), -EIO);
	CHECK_EQ_I(c.n_held, 0);
	CHECK_EQ_U(md_kv_seq_len(&w.kv, s), 0);
	md_kv_seq_free(&w.kv, s);
	c.fail_layer = -1;
	memset(got, 0, ROWS * w.V * sizeof(float));
	CHECK_EQ_I(run(&w, tok, N, got), ROWS);
	CHECK(memcmp(got, ref, ROWS * w.V * sizeof(float)) == 0);
	CHECK_EQ_I(c.protocol_errors, 0);

	/* Back to the default: the copying source is no longer called. */
	int gets = c.n_get;
	md_forward_set_expert_src(w.f, NULL);
	md_forward_set_route_cb(w.f, NULL, NULL);
	CHECK_EQ_I(run(&w, tok, N, got), ROWS);
	CHECK(memcmp(got, ref, ROWS * w.V * sizeof(float)) == 0);
	CHECK_EQ_I(c.n_get, gets);

	md_forward_free(w.f);
	md_kv_release(&w.kv);
	md_model_free(&w.m);
	free(ref);
	free(got);
	gen_model_cleanup(dir, path);
}

/* The default source's bounds. */
static void test_map_bounds(const char *moed_gguf)
{
	const char *args[] = { "--arch", "qwen3moe", "--n-layer", "2", "--n-expert", "4", NULL };
	char dir[512], path[600], err[256];
	if (gen_model(moed_gguf, args, "map.gguf", dir, sizeof dir, path, sizeof path)) {
		failures++;
		return;
	}
	struct md_model m;
	if (md_model_load(&m, path, err, sizeof err)) {
		fprintf(stderr, "load: %s\n", err);
		failures++;
		gen_model_cleanup(dir, path);
		return;
	}
	struct md_expert_src_map s;
	struct md_expert_w w;
	md_expert_src_map_init(&s, &m);
	CHECK_EQ_I(md_expert_src_get(&s.base, 1, 3, &w), 0);
	CHECK(w.gate.data == md_mat_of(m.layers[1].gate_exps, 3).data);
	CHECK(w.down.data == md_mat_of(m.layers[1].down_exps, 3).data);
	CHECK_EQ_I(w.gate.n_in, m.hp.n_embd);
	CHECK_EQ_I(w.down.n_out, m.hp.n_embd);
	CHECK_EQ_I(md_expert_src_get(&s.base, 2, 0, &w), -EINVAL);
	CHECK_EQ_I(md_expert_src_get(&s.base, 0, 4, &w), -EINVAL);
	CHECK_EQ_I(md_expert_src_get(&s.base, 0, -1, &w), -EINVAL);
	int32_t order[3] = { 7, 7, 7 };
	const int32_t ex[3] = { 0, 2, 3 };
	CHECK_EQ_I(md_expert_src_plan(&s.base, 0, ex, NULL, 3, order), 3); /* no plan op: all ready */
	CHECK(order[0] == 0 && order[1] == 1 && order[2] == 2);
	md_expert_src_release(&s.base, 1, 3);                  /* no release op: fine */
	md_model_free(&m);
	gen_model_cleanup(dir, path);
}

int main(int argc, char **argv)
{
	if (argc < 2) {
		fprintf(stderr, "usage: test_expert_src MOED_GGUF\n");
		return 2;
	}
	test_map_bounds(argv[1]);
	test_model(argv[1], "q8_0"); /* the grouped kernels */
	test_model(argv[1], "f32");
	if (failures) {
		fprintf(stderr, "expert_src: %d failures\n", failures);
		return 1;
	}
	printf("expert_src: ok\n");
	return 0;
}
