/* Test helper: one scenario of forward passes over a paged KV cache, run on the CPU or through
 * a device forward context (engine/forward_dev.h), every row's logits written out; and the
 * generated models it is run on. Shared by tests/unit/test_forward_dev.c (simulated device)
 * and tests/gpu/test_gpu.c (CUDA).
 *
 * The scenario, with fixed tokens (nothing sampled, so both runs see the same batches):
 *   1. sequences A (21 prompt tokens) and B (13) prefill together in chunks of up to 4 each;
 *   2. A and B decode 4 steps in one batch;
 *   3. E prefills A's first 20 tokens and ends, registering its blocks and its tail in the
 *      prefix cache; D attaches those 20 tokens (one whole block shared, the tail's rows
 *      copied into a block of D's own: a block copy), prefills one more and decodes 2 steps;
 *   4. C is forked from A at position 18 (A's second block shared), and A and C decode 3
 *      steps together: both write into the shared block, so both copy it first;
 *   5. B rolls back 2 positions and decodes 2 other tokens;
 *   6. a draft pass (1 expert per token, layer 1 skipped where there are 3 layers or more) of
 *      2 tokens for A, rolled back, then the exact pass of the same 2 tokens.
 * Every row asks for logits. */
#ifndef MD_TEST_FWD_SCENARIO_H
#define MD_TEST_FWD_SCENARIO_H

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "engine/backend.h"
#include "engine/forward.h"
#include "engine/forward_dev.h"
#include "engine/kv_cache.h"
#include "engine/model.h"

enum { FWS_BATCH = 8, FWS_MAX_ROWS = 128, FWS_BLOCKS = 40, FWS_SEQS = 6 };

/* Run through a device: the backend, whether the experts are uploaded, and (without) the
 * expert source (NULL: the model's mapping). err gets md_fwd_dev_new's reason on failure. */
struct fws_dev {
	struct md_backend *dev;
	bool resident;
	struct md_expert_src *src;
	char err[256];
	uint64_t n_fast, n_host; /* out: MoE layer passes routed on the device / on the host */
	uint64_t n_captures, n_graphs; /* out: passes captured as graphs, graph launches */
};

struct fws {
	struct md_forward_ctx *f;
	struct md_kv_cache kv;
	size_t V;
	float *out;
	int rows;
	int rc;
};

static int32_t fws_tok(int seq, int i, size_t V)
{
	return (int32_t)(((unsigned)seq * 131u + (unsigned)i * 97u + 11u) % (unsigned)V);
}

/* One batch of n rows: seq[i] at pos[i] with token tok[i]; logits appended. */
static void fws_step(struct fws *w, int n, const int32_t *tok, const int32_t *seq,
		     const int32_t *pos)
{
	if (w->rc < 0)
		return;
	bool want[FWS_BATCH];
	for (int i = 0; i < n; i++)
		want[i] = true;
	struct md_batch b = { n, tok, seq, pos, want, NULL };
	if (w->rows + n > FWS_MAX_ROWS) {
		w->rc = -ENOSPC;
		return;
	}
	int rc = md_forward(w->f, &w->kv, &b, w->out + (size_t)w->rows * w->V);
	if (rc < 0)
		w->rc = rc;
	else
		w->rows += rc;
}

/* Append one token of sequence s at its next position to a batch under construction. */
static void fws_add(struct fws *w, int s, int32_t t, int32_t *tok, int32_t *seq, int32_t *pos,
		    int *n)
{
	uint32_t len = md_kv_seq_len(&w->kv, s);
	for (int i = 0; i < *n; i++)
		if (seq[i] == s)
			len++;
	if (md_kv_reserve(&w->kv, s, len + 1))
		w->rc = -ENOSPC;
	tok[*n] = t;
	seq[*n] = s;
	pos[*n] = (int32_t)len;
	(*n)++;
}

/* The scenario (see the top) on m: on the CPU (dev NULL) or through dev. route_cb sees every
 * exact pass's routings. Returns the rows written to out (FWS_MAX_ROWS * n_vocab floats at
 * most) or a negative code. */
static int fws_run(const struct md_model *m, struct fws_dev *dev, struct md_expert_src *cpu_src,
		   md_forward_route_cb route_cb, void *route_ud, float *out)
{
	struct fws w = { .V = m->hp.n_vocab, .out = out };
	struct md_fwd_dev *d = NULL;
	if (md_kv_init_rows(&w.kv, m->hp.n_layer, md_model_kv_rows(m), FWS_BLOCKS, FWS_SEQS))
		return -ENOMEM;
	if (md_kv_prefix_enable(&w.kv)) {
		md_kv_release(&w.kv);
		return -ENOMEM;
	}
	w.f = md_forward_new(m, 2, FWS_BATCH);
	if (!w.f) {
		md_kv_release(&w.kv);
		return -ENOMEM;
	}
	if (cpu_src)
		md_forward_set_expert_src(w.f, cpu_src);
	if (dev) {
		int rc = md_fwd_dev_new(m, dev->dev, &w.kv, FWS_BATCH, dev->resident, &d, dev->err,
					sizeof dev->err);
		if (rc) {
			md_forward_free(w.f);
			md_kv_release(&w.kv);
			return rc;
		}
		md_forward_set_device(w.f, d);
		md_kv_drop_rows(&w.kv); /* as the engine does: the device's mirror holds the rows */
		if (dev->src)
			md_forward_set_expert_src(w.f, dev->src);
	}
	md_forward_set_route_cb(w.f, route_cb, route_ud);
	int32_t tok[FWS_BATCH], seq[FWS_BATCH], pos[FWS_BATCH];
	int n;
	const int A = md_kv_seq_new(&w.kv), B = md_kv_seq_new(&w.kv);

	/* 1. prefill A (21) and B (13) in chunks of up to 4 each */
	for (int c = 0; c < 6; c++) {
		n = 0;
		for (int i = 4 * c; i < 4 * c + 4 && i < 21; i++)
			fws_add(&w, A, fws_tok(A, i, w.V), tok, seq, pos, &n);
		for (int i = 4 * c; i < 4 * c + 4 && i < 13; i++)
			fws_add(&w, B, fws_tok(B, i, w.V), tok, seq, pos, &n);
		if (n)
			fws_step(&w, n, tok, seq, pos);
	}
	/* 2. decode A and B together */
	for (int i = 0; i < 4; i++) {
		n = 0;
		fws_add(&w, A, fws_tok(A, 21 + i, w.V), tok, seq, pos, &n);
		fws_add(&w, B, fws_tok(B, 13 + i, w.V), tok, seq, pos, &n);
		fws_step(&w, n, tok, seq, pos);
	}
	/* 3. prefix cache: E computes A's first 20 tokens and ends, registering its blocks and its
	 * tail; D attaches them (the first block shared, the tail's rows copied) */
	int32_t toks_a[32];
	for (int i = 0; i < 25; i++)
		toks_a[i] = fws_tok(A, i, w.V);
	const int E = md_kv_seq_new(&w.kv);
	for (int c = 0; c < 20; c += 8) {
		n = 0;
		for (int i = c; i < c + 8 && i < 20; i++)
			fws_add(&w, E, toks_a[i], tok, seq, pos, &n);
		fws_step(&w, n, tok, seq, pos);
	}
	md_kv_prefix_register_tail(&w.kv, E, toks_a, 20);
	md_kv_seq_free(&w.kv, E);
	const int D = md_kv_seq_new(&w.kv);
	uint32_t att = md_kv_prefix_attach(&w.kv, D, toks_a, 20);
	if (att != 20 && w.rc >= 0)
		w.rc = -EPROTO; /* the scenario did not exercise what it says */
	n = 0;
	fws_add(&w, D, toks_a[20], tok, seq, pos, &n);
	fws_step(&w, n, tok, seq, pos);
	for (int i = 0; i < 2; i++) {
		n = 0;
		fws_add(&w, D, fws_tok(D, 40 + i, w.V), tok, seq, pos, &n);
		fws_step(&w, n, tok, seq, pos);
	}
	/* 4. fork C from A at 18; both write into the shared block */
	const int C = md_kv_seq_fork(&w.kv, A, 18);
	if (C < 0 && w.rc >= 0)
		w.rc = C;
	for (int i = 0; i < 3 && C >= 0; i++) {
		n = 0;
		fws_add(&w, A, fws_tok(A, 25 + i, w.V), tok, seq, pos, &n);
		fws_add(&w, C, fws_tok(C, 60 + i, w.V), tok, seq, pos, &n);
		fws_step(&w, n, tok, seq, pos);
	}
	/* 5. B rolls back 2 and decodes other tokens */
	md_kv_truncate(&w.kv, B, md_kv_seq_len(&w.kv, B) - 2);
	for (int i = 0; i < 2; i++) {
		n = 0;
		fws_add(&w, B, fws_tok(B, 90 + i, w.V), tok, seq, pos, &n);
		fws_step(&w, n, tok, seq, pos);
	}
	/* 6. a draft pass of 2 tokens for A, rolled back, then the exact pass */
	if (m->hp.n_expert) {
		uint8_t skip[64] = { 0 };
		if (m->hp.n_layer >= 3)
			skip[1] = 1;
		struct md_forward_draft dr = { .n_used = 1, .skip = skip };
		uint32_t len = md_kv_seq_len(&w.kv, A);
		n = 0;
		fws_add(&w, A, fws_tok(A, 70, w.V), tok, seq, pos, &n);
		fws_add(&w, A, fws_tok(A, 71, w.V), tok, seq, pos, &n);
		md_forward_set_draft(w.f, &dr);
		fws_step(&w, n, tok, seq, pos);
		md_forward_set_draft(w.f, NULL);
		md_kv_truncate(&w.kv, A, len);
		fws_step(&w, n, tok, seq, pos);
	}
	md_forward_free(w.f);
	if (d) {
		md_fwd_dev_counts(d, &dev->n_fast, &dev->n_host);
		md_fwd_dev_graphs(d, &dev->n_captures, &dev->n_graphs);
	}
	md_fwd_dev_free(d);
	md_kv_release(&w.kv);
	return w.rc < 0 ? w.rc : w.rows;
}

/* The generated models (moed-gguf gen arguments): every architecture the device path takes,
 * the weight types the CUDA backend reads. exact: the simulated device must give the CPU
 * pass's logits bit for bit (not where the CPU sums in double: Qwen2-MoE's shared gate). */
struct fws_case {
	const char *label;
	const char *const *args;
	bool exact;
};

#define FWS_SMALL "--n-layer", "3", "--head-dim", "32", "--n-expert", "8", "--n-expert-used", "2"
#define FWS_K "--n-layer", "3", "--n-embd", "256", "--n-head", "8", "--n-head-kv", "2", \
	"--head-dim", "32", "--n-ff-exp", "256", "--n-ff", "256", "--n-ff-shexp", "256", \
	"--n-expert", "8", "--n-expert-used", "2"

static const char *const fws_a0[] = { "--arch", "qwen3moe", "--type", "f32", FWS_SMALL, NULL };
static const char *const fws_a1[] = { "--arch", "qwen3moe", "--type", "q8_0", FWS_SMALL, NULL };
static const char *const fws_a2[] = { "--arch", "qwen2moe", "--type", "q8_0", FWS_SMALL, NULL };
static const char *const fws_a3[] = { "--arch", "mixtral", "--type", "q4_0", FWS_SMALL, NULL };
static const char *const fws_a4[] = { "--arch", "olmoe", "--type", "q4_k", FWS_K, NULL };
static const char *const fws_a5[] = { "--arch", "gpt-oss", "--type", "q8_0", FWS_SMALL,
				      "--sliding-window", "8", NULL };
static const char *const fws_a6[] = { "--arch", "glm4moe", "--type", "q8_0", FWS_SMALL, NULL };
static const char *const fws_a7[] = { "--arch", "qwen3", "--type", "f16", "--n-layer", "2",
				      "--head-dim", "32", NULL };
static const char *const fws_a8[] = { "--arch", "llama", "--type", "bf16", "--n-layer", "2",
				      "--head-dim", "32", "--tied", NULL };
static const char *const fws_a9[] = { "--arch", "qwen3moe", "--type", "q5_k", FWS_K, NULL };
static const char *const fws_a10[] = { "--arch", "qwen3moe", "--type", "q6_k", FWS_K, NULL };
static const char *const fws_a11[] = { "--arch", "qwen2", "--type", "q8_0", "--n-layer", "2",
				       "--head-dim", "32", "--bias", NULL };
static const char *const fws_a12[] = { "--arch", "gpt-oss", "--type", "q8_0", "--exp-type", "mxfp4",
				       FWS_SMALL, "--sliding-window", "8", NULL };
static const char *const fws_a13[] = { "--arch", "qwen3moe", "--type", "q3_k", FWS_K, NULL };
static const char *const fws_a14[] = { "--arch", "mixtral", "--type", "q2_k", FWS_K, NULL };
static const char *const fws_a15[] = { "--arch", "olmoe", "--type", "iq4_xs", FWS_K, NULL };
static const char *const fws_a16[] = { "--arch", "qwen2moe", "--type", "q5_0", FWS_SMALL, NULL };
static const char *const fws_a17[] = { "--arch", "deepseek2", "--type", "f32", "--n-layer", "3",
				       "--n-expert", "8", "--n-expert-used", "2", "--n-expert-groups", "4",
				       "--n-group-used", "2", NULL };
static const char *const fws_a18[] = { "--arch", "deepseek2", "--type", "q8_0", "--n-layer", "3",
				       "--n-expert", "8", "--n-expert-used", "2", "--q-lora-rank", "0",
				       "--kv-b", "merged", "--head-dim", "32", "--kv-lora-rank", "64",
				       NULL };

static const struct fws_case fws_cases[] = {
	{ "qwen3moe f32", fws_a0, true },
	{ "qwen3moe q8_0", fws_a1, true },
	{ "qwen2moe q8_0 (gated shared expert)", fws_a2, false },
	{ "mixtral q4_0", fws_a3, true },
	{ "olmoe q4_k", fws_a4, true },
	{ "gpt-oss q8_0 (sinks, sliding window, biases)", fws_a5, true },
	{ "glm4moe q8_0 (scored routing, dense lead, shared expert)", fws_a6, true },
	{ "qwen3 dense f16", fws_a7, true },
	{ "llama dense bf16, tied output", fws_a8, true },
	{ "qwen3moe q5_k", fws_a9, true },
	{ "qwen3moe q6_k", fws_a10, true },
	{ "qwen2 dense q8_0, q/k/v biases", fws_a11, true },
	{ "gpt-oss, mxfp4 experts", fws_a12, true },
	{ "qwen3moe q3_k", fws_a13, true },
	{ "mixtral q2_k", fws_a14, true },
	{ "olmoe iq4_xs", fws_a15, true },
	{ "qwen2moe q5_0 (gated shared expert)", fws_a16, false },
	{ "deepseek2 f32 (latent attention, q lora, expert groups)", fws_a17, true },
	{ "deepseek2 q8_0 (V2-Lite layout: no q lora, merged kv_b)", fws_a18, true },
};
static const size_t fws_n_cases = sizeof(fws_cases) / sizeof(fws_cases[0]);

#endif
