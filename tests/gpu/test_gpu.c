/* GPU tests of the device forward pass (tests/gpu/run.sh runs them on a machine with a GPU;
 * without one they exit 77, skipped; every build compiles them).
 *
 *   ops:     every op of md_backend_fwd (engine/backend_fwd.h) on CUDA against the simulated
 *            device's reference of the same op on the same inputs, every weight type for the
 *            products;
 *   parity:  the forward-pass scenario of tests/unit/fwd_scenario.h on CUDA against the CPU
 *            pass, on every generated model there: the greedy choice of every row equal, the
 *            log-probabilities of the CPU's top 5 within LOGP_TOL; experts resident, and
 *            experts computed on the CPU from the mapping;
 *   tier:    the expert store with CUDA as its device tier at 10% to 100% of the expert bytes:
 *            the same greedy choices;
 *   oom:     a device without room for the model: md_fwd_dev_new fails with -ENOMEM and the
 *            reason, holds nothing, and works once the room is back.
 * The CPU reference runs with MOED_KERNELS=ref (weights dequantized, dots in float, as the GPU
 * computes them), so what differs is summation order. */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/backend.h"
#include "engine/backend_sim.h"
#include "engine/expert_cost.h"
#include "engine/experts.h"
#include "engine/forward.h"
#include "engine/forward_dev.h"
#include "engine/quant.h"
#include "tests/check.h"
#include "tests/unit/frand.h"
#include "tests/unit/fwd_scenario.h"
#include "tests/unit/gen_model.h"

#define OP_TOL 1e-9   /* NMSE of the float ops against the reference */
#define MM_TOL 1e-7   /* NMSE of the products (test_cuda.c's bound) */
#define LOGP_TOL 2e-3 /* log-probabilities of the reference's top 5 */

static struct md_backend *cu, *sim;

/* ---- one buffer on both backends ---- */

struct pair {
	void *c, *s;
	size_t n;
};

static struct pair pnew(const void *host, size_t n)
{
	struct pair p = { NULL, NULL, n };
	CHECK_EQ_I(cu->alloc(cu, n, &p.c), 0);
	CHECK_EQ_I(sim->alloc(sim, n, &p.s), 0);
	/* Without contents both sides start zeroed: an op that writes part of its output (mm of
	 * one token into a buffer of nine rows) leaves the rest equal on both. */
	void *zero = host ? NULL : calloc(1, n);
	if (!host)
		host = zero;
	if (p.c && p.s) {
		CHECK_EQ_I(cu->upload(cu, p.c, host, n), 0);
		CHECK_EQ_I(sim->upload(sim, p.s, host, n), 0);
	}
	free(zero);
	return p;
}

static void pfree(struct pair *p)
{
	cu->free(cu, p->c);
	sim->free(sim, p->s);
}

static float *frnd(size_t n, float scale)
{
	float *x = malloc(n * sizeof(float));
	for (size_t i = 0; i < n; i++)
		x[i] = frand() * scale;
	return x;
}

/* NMSE of the CUDA copy of p against the simulated one (floats); NaN on either side fails. */
static double pcmp(const struct pair *p, const char *what, double tol)
{
	size_t n = p->n / sizeof(float);
	float *a = malloc(p->n), *b = malloc(p->n);
	CHECK_EQ_I(cu->download(cu, a, p->c, p->n), 0);
	CHECK_EQ_I(sim->download(sim, b, p->s, p->n), 0);
	double err = 0, ref = 0;
	int nan = 0;
	for (size_t i = 0; i < n; i++) {
		if (isnan(a[i]) != isnan(b[i]))
			nan++;
		if (isnan(a[i]) || isnan(b[i]))
			continue;
		err += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
		ref += (double)b[i] * b[i];
	}
	double nmse = ref > 0 ? err / ref : err;
	CHECK_MSG(nan == 0 && nmse <= tol, "%s: nmse %.3g (tolerance %.3g), %d NaN mismatches", what,
		  nmse, tol, nan);
	free(a);
	free(b);
	return nmse;
}

/* The bytes of p equal on both sides. */
static void pcmp_bytes(const struct pair *p, const char *what)
{
	unsigned char *a = malloc(p->n), *b = malloc(p->n);
	CHECK_EQ_I(cu->download(cu, a, p->c, p->n), 0);
	CHECK_EQ_I(sim->download(sim, b, p->s, p->n), 0);
	size_t bad = 0;
	for (size_t i = 0; i < p->n; i++)
		bad += a[i] != b[i];
	CHECK_MSG(bad == 0, "%s: %zu of %zu bytes differ", what, bad, p->n);
	free(a);
	free(b);
}

/* Latent attention's ops: the strided copy between layouts, cache rows stored as halves, and
 * the attention over half and float rows (DeepSeek-V3's widths, and a small one). */
static void check_mla(void)
{
	const int n0 = 5, n1 = 7, w = 13;
	float *src = frnd((size_t)n0 * n1 * 20, 1.0f);
	struct pair ps = pnew(src, (size_t)n0 * n1 * 20 * 4), pd = pnew(NULL, (size_t)n1 * n0 * w * 4);
	CHECK_EQ_I(cu->fwd->copy2d(cu, pd.c, w, (size_t)n0 * w, ps.c, (size_t)n1 * 20, 20, n0, n1, w), 0);
	CHECK_EQ_I(sim->fwd->copy2d(sim, pd.s, w, (size_t)n0 * w, ps.s, (size_t)n1 * 20, 20, n0, n1, w), 0);
	pcmp(&pd, "copy2d", 0);
	int32_t rows[5] = { 7, 2, 9, 0, 4 };
	struct pair pr = pnew(rows, sizeof(rows)), ph = pnew(NULL, (size_t)10 * 40 * 2);
	CHECK_EQ_I(cu->fwd->rows_store_f16(cu, ph.c, pr.c, ps.c, 5, 40), 0);
	CHECK_EQ_I(sim->fwd->rows_store_f16(sim, ph.s, pr.s, ps.s, 5, 40), 0);
	pcmp_bytes(&ph, "rows_store_f16");
	struct pair *all0[] = { &ps, &pd, &pr, &ph };
	for (size_t i = 0; i < 4; i++)
		pfree(all0[i]);
	free(src);

	const struct { int C, R, H; } shapes[] = { { 512, 64, 4 }, { 32, 8, 3 } };
	for (size_t si = 0; si < 2; si++)
		for (int half = 0; half < 2; half++) {
			const int C = shapes[si].C, W = C + shapes[si].R, H = shapes[si].H, n_tok = 4;
			const int n_blocks = 12, eb = half ? 2 : 4;
			float *rf = frnd((size_t)n_blocks * 16 * W, 1.0f), *q = frnd((size_t)n_tok * H * W, 0.2f);
			void *rows_h = rf;
			uint16_t *r16 = NULL;
			if (half) {
				r16 = malloc((size_t)n_blocks * 16 * W * 2);
				for (size_t i = 0; i < (size_t)n_blocks * 16 * W; i++)
					r16[i] = md_f32_to_f16(rf[i]);
				rows_h = r16;
			}
			int32_t blocks[20], pos[4] = { 70, 71, 3, 150 }, tab[4] = { 0, 0, 10, 10 };
			for (int i = 0; i < 20; i++)
				blocks[i] = (int32_t)((i * 5 + 1) % n_blocks);
			struct pair pk = pnew(rows_h, (size_t)n_blocks * 16 * W * eb);
			struct pair pq = pnew(q, (size_t)n_tok * H * W * 4), pb = pnew(blocks, sizeof(blocks));
			struct pair pp = pnew(pos, sizeof(pos)), pt = pnew(tab, sizeof(tab));
			struct pair po = pnew(NULL, (size_t)H * n_tok * C * 4);
			struct md_dev_mla_attn a = { .half = half, .n_tok = n_tok, .n_head = H, .w = W,
						     .c = C, .scale = 0.07f, .max_pos = 150 };
			a.out = po.c, a.q = pq.c, a.rows = pk.c, a.pos = pp.c, a.tab = pt.c, a.blocks = pb.c;
			CHECK_EQ_I(cu->fwd->attention_mla(cu, &a), 0);
			a.out = po.s, a.q = pq.s, a.rows = pk.s, a.pos = pp.s, a.tab = pt.s, a.blocks = pb.s;
			CHECK_EQ_I(sim->fwd->attention_mla(sim, &a), 0);
			char what[80];
			snprintf(what, sizeof what, "attention_mla C %d R %d, %s rows", C, shapes[si].R,
				 half ? "half" : "float");
			pcmp(&po, what, OP_TOL);
			struct pair *all[] = { &pk, &pq, &pb, &pp, &pt, &po };
			for (size_t i = 0; i < 6; i++)
				pfree(all[i]);
			free(rf);
			free(q);
			free(r16);
		}
	printf("gpu: latent attention, strided copies, half rows: ok\n");
}

static void check_elementwise(void)
{
	const int rows = 7, n = 1000;
	float *x = frnd((size_t)rows * n, 2.0f), *w = frnd(n, 1.0f), *g = frnd(rows, 3.0f);
	int32_t idx[7] = { 3, 0, 2, 2, 1, 3, 0 };
	float *bias = frnd((size_t)4 * n, 1.0f);
	struct pair px = pnew(x, (size_t)rows * n * 4), pw = pnew(w, (size_t)n * 4);
	struct pair py = pnew(NULL, (size_t)rows * n * 4), pb = pnew(bias, (size_t)4 * n * 4);
	struct pair pi = pnew(idx, sizeof(idx)), pg = pnew(g, (size_t)rows * 4);
	const struct md_backend_fwd *C = cu->fwd, *S = sim->fwd;

	CHECK_EQ_I(C->rmsnorm(cu, py.c, px.c, pw.c, rows, n, n, 1e-6f), 0);
	CHECK_EQ_I(S->rmsnorm(sim, py.s, px.s, pw.s, rows, n, n, 1e-6f), 0);
	pcmp(&py, "rmsnorm", OP_TOL);
	CHECK_EQ_I(C->rmsnorm(cu, px.c, px.c, pw.c, rows * 10, n / 20, n / 10, 1e-5f), 0); /* in place */
	CHECK_EQ_I(S->rmsnorm(sim, px.s, px.s, pw.s, rows * 10, n / 20, n / 10, 1e-5f), 0);
	pcmp(&px, "rmsnorm in place, strided rows", OP_TOL);
	CHECK_EQ_I(C->add(cu, py.c, px.c, (size_t)rows * n), 0);
	CHECK_EQ_I(S->add(sim, py.s, px.s, (size_t)rows * n), 0);
	pcmp(&py, "add", OP_TOL);
	CHECK_EQ_I(C->add_rows(cu, py.c, pb.c, NULL, rows, n), 0);
	CHECK_EQ_I(S->add_rows(sim, py.s, pb.s, NULL, rows, n), 0);
	CHECK_EQ_I(C->add_rows(cu, py.c, pb.c, pi.c, rows, n), 0);
	CHECK_EQ_I(S->add_rows(sim, py.s, pb.s, pi.s, rows, n), 0);
	pcmp(&py, "add_rows (one bias, indexed biases)", OP_TOL);
	for (int act = 0; act < 2; act++) {
		CHECK_EQ_I(C->glu(cu, py.c, px.c, (size_t)rows * n, act ? MD_ACT_SWIGLU_OAI : MD_ACT_SWIGLU), 0);
		CHECK_EQ_I(S->glu(sim, py.s, px.s, (size_t)rows * n, act ? MD_ACT_SWIGLU_OAI : MD_ACT_SWIGLU), 0);
		pcmp(&py, act ? "glu (gpt-oss)" : "glu (silu)", OP_TOL);
	}
	CHECK_EQ_I(C->gate_add(cu, py.c, px.c, pg.c, rows, n), 0);
	CHECK_EQ_I(S->gate_add(sim, py.s, px.s, pg.s, rows, n), 0);
	CHECK_EQ_I(C->gate_add(cu, py.c, px.c, NULL, rows, n), 0);
	CHECK_EQ_I(S->gate_add(sim, py.s, px.s, NULL, rows, n), 0);
	pcmp(&py, "gate_add (gated, ungated)", 1e-8);
	/* rows: store rows 3, 0, 2 of an 4-row table, gather them back in another order */
	int32_t r3[3] = { 3, 0, 2 };
	struct pair pr = pnew(r3, sizeof(r3)), pt = pnew(NULL, (size_t)4 * n * 4);
	CHECK_EQ_I(C->copy(cu, pt.c, pb.c, (size_t)4 * n * 4), 0);
	CHECK_EQ_I(S->copy(sim, pt.s, pb.s, (size_t)4 * n * 4), 0);
	CHECK_EQ_I(C->rows_store(cu, pt.c, pr.c, px.c, 3, n), 0);
	CHECK_EQ_I(S->rows_store(sim, pt.s, pr.s, px.s, 3, n), 0);
	pcmp(&pt, "copy, rows_store", OP_TOL); /* px was normed in place by each backend */
	CHECK_EQ_I(C->rows_gather(cu, py.c, pt.c, pi.c, rows, n), 0);
	CHECK_EQ_I(S->rows_gather(sim, py.s, pt.s, pi.s, rows, n), 0);
	pcmp(&py, "rows_gather", OP_TOL);
	/* combine: 7 tokens, k 3, slots into 12 rows, some -1 */
	int32_t slot[21];
	float wt[21];
	for (int i = 0; i < 21; i++) {
		slot[i] = i % 5 == 4 ? -1 : (i * 7) % 12;
		wt[i] = frand();
	}
	float *ye = frnd((size_t)12 * n, 1.0f);
	struct pair ps = pnew(slot, sizeof(slot)), pwt = pnew(wt, sizeof(wt));
	struct pair pye = pnew(ye, (size_t)12 * n * 4);
	CHECK_EQ_I(C->combine(cu, py.c, pye.c, ps.c, pwt.c, rows, 3, n), 0);
	CHECK_EQ_I(S->combine(sim, py.s, pye.s, ps.s, pwt.s, rows, 3, n), 0);
	pcmp(&py, "combine", OP_TOL);
	/* combine_add: the same sums added to what py holds */
	CHECK_EQ_I(C->combine_add(cu, py.c, pye.c, ps.c, pwt.c, rows, 3, n), 0);
	CHECK_EQ_I(S->combine_add(sim, py.s, pye.s, ps.s, pwt.s, rows, 3, n), 0);
	pcmp(&py, "combine_add", OP_TOL);
	CHECK_EQ_I(C->sync(cu), 0);
	struct pair *all[] = { &px, &pw, &py, &pb, &pi, &pg, &pr, &pt, &ps, &pwt, &pye };
	for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
		pfree(all[i]);
	free(x);
	free(w);
	free(g);
	free(bias);
	free(ye);
	printf("gpu: elementwise ops, norms, rows, combine: ok\n");
}

static void check_rope(void)
{
	const int n_tok = 5, H = 6, D = 64;
	for (int neox = 0; neox < 2; neox++)
		for (int n_rot = 32; n_rot <= D; n_rot += 32) {
			float *x = frnd((size_t)n_tok * H * D, 1.0f), *cs = frnd((size_t)n_tok * n_rot, 1.0f);
			struct pair px = pnew(x, (size_t)n_tok * H * D * 4);
			struct pair pc = pnew(cs, (size_t)n_tok * n_rot * 4);
			CHECK_EQ_I(cu->fwd->rope(cu, px.c, n_tok, H, D, n_rot, neox, pc.c), 0);
			CHECK_EQ_I(sim->fwd->rope(sim, px.s, n_tok, H, D, n_rot, neox, pc.s), 0);
			char what[64];
			snprintf(what, sizeof what, "rope %s n_rot %d", neox ? "neox" : "norm", n_rot);
			pcmp(&px, what, OP_TOL);
			pfree(&px);
			pfree(&pc);
			free(x);
			free(cs);
		}
	printf("gpu: rope: ok\n");
}

/* qkv_rows, attention's norms, rope and cache stores in one launch: every norm (none, per
 * head, whole rows), both rope layouts, no rope, head sizes of 64, 128 and 320 (past the
 * 256 threads of a row's norm), GQA; q and k in place and the cache rows against the
 * reference. */
static void check_qkv_rows(void)
{
	const int dims[] = { 64, 128, 320 };
	int cases = 0;
	for (size_t di = 0; di < sizeof(dims) / sizeof(dims[0]); di++)
		for (int norm = MD_QK_NORM_NONE; norm <= MD_QK_NORM_FULL; norm++)
			for (int rope = 0; rope < 3; rope++) {
				const int n = 5, H = 6, K = 2, D = dims[di], rows = 12;
				const int n_rot = rope == 0 ? 0 : rope == 1 ? D : D / 2, neox = rope == 2;
				const size_t QD = (size_t)H * D, KD = (size_t)K * D;
				float *q = frnd(n * QD, 1.0f), *k = frnd(n * KD, 1.0f);
				float *v = frnd(n * KD, 1.0f), *cs = frnd((size_t)n * (n_rot + 2), 1.0f);
				float *wq = frnd(norm == MD_QK_NORM_FULL ? QD : (size_t)D, 1.0f);
				float *wk = frnd(norm == MD_QK_NORM_FULL ? KD : (size_t)D, 1.0f);
				int32_t wrow[5] = { 7, 0, 11, 3, 5 };
				struct pair pq = pnew(q, n * QD * 4), pk = pnew(k, n * KD * 4);
				struct pair pv = pnew(v, n * KD * 4), pc = pnew(cs, (size_t)n * (n_rot + 2) * 4);
				struct pair pwq = pnew(wq, (norm == MD_QK_NORM_FULL ? QD : (size_t)D) * 4);
				struct pair pwk = pnew(wk, (norm == MD_QK_NORM_FULL ? KD : (size_t)D) * 4);
				struct pair pr = pnew(wrow, sizeof(wrow));
				struct pair pkc = pnew(NULL, rows * KD * 4), pvc = pnew(NULL, rows * KD * 4);
				struct md_dev_qkv a = {
					.q = pq.c, .k = pk.c, .v = pv.c, .kc = pkc.c, .vc = pvc.c,
					.wrow = pr.c, .q_norm = pwq.c, .k_norm = pwk.c, .norm = norm,
					.eps = 1e-6f, .n = n, .n_head = H, .n_head_kv = K, .head_dim = D,
					.n_rot = n_rot, .neox = neox, .cs = pc.c,
				};
				CHECK_EQ_I(cu->fwd->qkv_rows(cu, &a), 0);
				a.q = pq.s, a.k = pk.s, a.v = pv.s, a.kc = pkc.s, a.vc = pvc.s;
				a.wrow = pr.s, a.q_norm = pwq.s, a.k_norm = pwk.s, a.cs = pc.s;
				CHECK_EQ_I(sim->fwd->qkv_rows(sim, &a), 0);
				char what[96];
				snprintf(what, sizeof what, "qkv_rows D %d norm %d n_rot %d %s", D, norm,
					 n_rot, neox ? "neox" : "norm");
				pcmp(&pq, what, OP_TOL);
				pcmp(&pk, what, OP_TOL);
				pcmp(&pkc, what, OP_TOL);
				pcmp(&pvc, what, 0);
				struct pair *all[] = { &pq, &pk, &pv, &pc, &pwq, &pwk, &pr, &pkc, &pvc };
				for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
					pfree(all[i]);
				free(q);
				free(k);
				free(v);
				free(cs);
				free(wq);
				free(wk);
				cases++;
			}
	printf("gpu: attention rows (norms, rope, cache stores in one launch), %d cases: ok\n",
	       cases);
}

/* Attention over a paged cache with a shuffled block table: GQA, a sliding window, sinks,
 * head sizes that are and are not multiples of 32. */
static void check_attention(void)
{
	const int n_blocks = 24, max_pos = 150;
	const int dims[] = { 32, 64, 80, 128, 256 };
	for (size_t di = 0; di < sizeof(dims) / sizeof(dims[0]); di++)
		for (int variant = 0; variant < 3; variant++) {
			const int D = dims[di], H = 8, K = variant == 2 ? 8 : 2, n_tok = 6;
			const int KD = K * D;
			float *kc = frnd((size_t)n_blocks * 16 * KD, 1.0f);
			float *vc = frnd((size_t)n_blocks * 16 * KD, 1.0f);
			float *q = frnd((size_t)n_tok * H * D, 1.0f), *sinks = frnd(H, 2.0f);
			int32_t blocks[2 * 10], pos[6], tab[6];
			for (int i = 0; i < 20; i++)
				blocks[i] = (int32_t)((i * 7 + 3) % n_blocks);
			for (int t = 0; t < n_tok; t++) { /* two sequences, three tokens each */
				tab[t] = t < 3 ? 0 : 10;
				pos[t] = t < 3 ? 140 + t : 20 + t;
			}
			struct pair pk = pnew(kc, (size_t)n_blocks * 16 * KD * 4);
			struct pair pv = pnew(vc, (size_t)n_blocks * 16 * KD * 4);
			struct pair pq = pnew(q, (size_t)n_tok * H * D * 4), ps = pnew(sinks, (size_t)H * 4);
			struct pair pb = pnew(blocks, sizeof(blocks)), pp = pnew(pos, sizeof(pos));
			struct pair pt = pnew(tab, sizeof(tab)), po = pnew(NULL, (size_t)n_tok * H * D * 4);
			struct md_dev_attn a = { .n_tok = n_tok, .n_head = H, .n_head_kv = K, .head_dim = D,
						 .swa = variant == 1 ? 16 : 0, .scale = 1.0f / sqrtf((float)D),
						 .max_pos = max_pos };
			a.out = po.c, a.q = pq.c, a.k = pk.c, a.v = pv.c, a.pos = pp.c, a.tab = pt.c;
			a.blocks = pb.c, a.sinks = variant ? ps.c : NULL;
			CHECK_EQ_I(cu->fwd->attention(cu, &a), 0);
			a.out = po.s, a.q = pq.s, a.k = pk.s, a.v = pv.s, a.pos = pp.s, a.tab = pt.s;
			a.blocks = pb.s, a.sinks = variant ? ps.s : NULL;
			CHECK_EQ_I(sim->fwd->attention(sim, &a), 0);
			char what[96];
			snprintf(what, sizeof what, "attention D %d, %s", D,
				 variant == 0 ? "GQA 8/2" : variant == 1 ? "sliding window 16, sinks" : "MHA, sinks");
			pcmp(&po, what, OP_TOL);
			struct pair *all[] = { &pk, &pv, &pq, &ps, &pb, &pp, &pt, &po };
			for (size_t i = 0; i < 8; i++)
				pfree(all[i]);
			free(kc);
			free(vc);
			free(q);
			free(sinks);
		}
	printf("gpu: attention: ok\n");
}

/* The products: mm with device activations (9 tokens, and one), and mm_experts (5 groups, one
 * of them empty, gathered input rows, one and two weights per group; up to nine rows a group,
 * and one), every type CUDA reads. */
static void check_products(void)
{
	const enum md_dtype types[] = { MD_DT_F32, MD_DT_F16, MD_DT_BF16, MD_DT_Q8_0, MD_DT_Q4_0,
					MD_DT_Q4_K, MD_DT_Q5_K, MD_DT_Q6_K, MD_DT_Q4_1, MD_DT_Q5_0,
					MD_DT_Q5_1, MD_DT_IQ4_NL, MD_DT_IQ4_XS, MD_DT_MXFP4, MD_DT_Q2_K,
					MD_DT_Q3_K };
	const int64_t n_in = 512, n_out = 96;
	const int ng = 5, n_x = 9;
	const int32_t off[6] = { 0, 3, 3, 7, 16, 19 }; /* group 1 empty, group 3 nine rows */
	const int32_t off1[6] = { 0, 1, 1, 2, 3, 4 };   /* group 1 empty, the others one row */
	for (size_t ti = 0; ti < sizeof(types) / sizeof(types[0]); ti++) {
		enum md_dtype t = types[ti];
		size_t rb = md_dtype_row_size(t, n_in);
		size_t wbytes = rb * (size_t)n_out;
		uint8_t *w = malloc(wbytes * 2 * ng);
		float *src = frnd((size_t)n_in, 1.0f);
		for (int m = 0; m < 2 * ng; m++)
			for (int64_t r = 0; r < n_out; r++) {
				for (int64_t i = 0; i < n_in; i++)
					src[i] = frand() * (0.3f + 0.2f * (float)(r % 5));
				md_quantize_row(t, src, w + (size_t)m * wbytes + rb * (size_t)r, n_in);
			}
		float *x = frnd((size_t)n_x * n_in, 1.0f);
		int32_t gat[19];
		for (int i = 0; i < 19; i++)
			gat[i] = (i * 5 + 2) % n_x;
		struct pair pw = pnew(w, wbytes * 2 * ng), px = pnew(x, (size_t)n_x * n_in * 4);
		struct pair py = pnew(NULL, (size_t)19 * n_out * 4), py2 = pnew(NULL, (size_t)19 * n_out * 4);
		struct pair po = pnew(off, sizeof(off)), pg = pnew(gat, sizeof(gat));
		struct pair po1 = pnew(off1, sizeof(off1));
		/* the pointer tables: weight-major, ng gate then ng up */
		const void *tc[10], *ts[10];
		for (int i = 0; i < 2 * ng; i++) {
			tc[i] = (const char *)pw.c + (size_t)i * wbytes;
			ts[i] = (const char *)pw.s + (size_t)i * wbytes;
		}
		struct pair ptab = pnew(NULL, sizeof(tc));
		CHECK_EQ_I(cu->upload(cu, ptab.c, tc, sizeof(tc)), 0);
		CHECK_EQ_I(sim->upload(sim, ptab.s, ts, sizeof(ts)), 0);
		/* mm: weight 0, device x */
		struct md_mat mc = { t, n_in, n_out, rb, pw.c }, ms = { t, n_in, n_out, rb, pw.s };
		CHECK_EQ_I(cu->fwd->mm(cu, &mc, px.c, n_x, py.c), 0);
		CHECK_EQ_I(sim->fwd->mm(sim, &ms, px.s, n_x, py.s), 0);
		char what[96];
		snprintf(what, sizeof what, "mm %s", md_dtype_info(t)->name);
		pcmp(&py, what, MM_TOL);
		/* one token: the kernels' one-token variant */
		CHECK_EQ_I(cu->fwd->mm(cu, &mc, px.c, 1, py.c), 0);
		CHECK_EQ_I(sim->fwd->mm(sim, &ms, px.s, 1, py.s), 0);
		snprintf(what, sizeof what, "mm %s, one token", md_dtype_info(t)->name);
		pcmp(&py, what, MM_TOL);
		/* mm_multi: three weights' products of one input in one launch (Q, K, V), at 9
		 * tokens and at one; the third with fewer rows */
		for (int nt = n_x; nt >= 1; nt -= n_x - 1) {
			struct pair pm[3];
			struct md_mat c3[3], s3[3];
			const struct md_mat *cp[3], *sp[3];
			float *cy[3], *sy[3];
			for (int i = 0; i < 3; i++) {
				int64_t rows = i == 2 ? n_out / 3 : n_out;
				pm[i] = pnew(NULL, (size_t)n_x * rows * 4);
				c3[i] = (struct md_mat){ t, n_in, rows, rb, (const char *)pw.c + i * wbytes };
				s3[i] = (struct md_mat){ t, n_in, rows, rb, (const char *)pw.s + i * wbytes };
				cp[i] = &c3[i], sp[i] = &s3[i], cy[i] = pm[i].c, sy[i] = pm[i].s;
			}
			CHECK_EQ_I(cu->fwd->mm_multi(cu, 3, cp, px.c, nt, cy), 0);
			CHECK_EQ_I(sim->fwd->mm_multi(sim, 3, sp, px.s, nt, sy), 0);
			for (int i = 0; i < 3; i++) {
				snprintf(what, sizeof what, "mm_multi %s, %d tokens, weight %d",
					 md_dtype_info(t)->name, nt, i);
				pcmp(&pm[i], what, MM_TOL);
				pfree(&pm[i]);
			}
		}
		/* mm_add: the products added to what y holds (the two above) */
		CHECK_EQ_I(cu->fwd->mm_add(cu, &mc, px.c, n_x, py.c), 0);
		CHECK_EQ_I(sim->fwd->mm_add(sim, &ms, px.s, n_x, py.s), 0);
		snprintf(what, sizeof what, "mm_add %s", md_dtype_info(t)->name);
		pcmp(&py, what, MM_TOL);
		/* the layout above, and one slot a group (a decode step of one sequence) */
		for (int nw = 1; nw <= 4; nw++) {
			const int one = nw > 2;
			struct md_dev_experts e = { .type = t, .n_in = n_in, .n_out = n_out, .nb1 = rb,
						    .nw = 2 - nw % 2, .ng = ng, .n_x = n_x,
						    .n_slots = one ? 4 : 19, .max_rows = one ? 1 : 9 };
			e.w = ptab.c, e.off = one ? po1.c : po.c, e.src = pg.c, e.x = px.c;
			e.y[0] = py.c, e.y[1] = py2.c;
			CHECK_EQ_I(cu->fwd->mm_experts(cu, &e), 0);
			e.w = ptab.s, e.off = one ? po1.s : po.s, e.src = pg.s, e.x = px.s;
			e.y[0] = py.s, e.y[1] = py2.s;
			CHECK_EQ_I(sim->fwd->mm_experts(sim, &e), 0);
			snprintf(what, sizeof what, "mm_experts %s, %d weight(s) per group%s",
				 md_dtype_info(t)->name, e.nw, one ? ", one slot a group" : "");
			pcmp(&py, what, MM_TOL);
			if (e.nw == 2)
				pcmp(&py2, what, MM_TOL);
		}
		struct pair *all[] = { &pw, &px, &py, &py2, &po, &po1, &pg, &ptab };
		for (size_t i = 0; i < 8; i++)
			pfree(all[i]);
		free(w);
		free(src);
		free(x);
	}
	printf("gpu: products of every type: ok\n");
}

/* Routing and its layout on the device against the host's (the simulated device runs
 * router.c's own code): the same experts for every token, weights within float rounding,
 * the same layout tables. */
static void check_routing(void)
{
	const int K = 8;
	float *bias = frnd(384, 0.3f);
	struct pair pbias = pnew(bias, (size_t)384 * 4);
	/* softmax top-k, softmax over the top-k, then scored top-k: GLM's (sigmoid, a selection
	 * bias), DeepSeek-V3's (sigmoid, bias, 8 groups of which 4, weights scaled 2.5) and
	 * DeepSeek-V2's (softmax, no bias, not renormalised) */
	static const int ns[4] = { 1, 16, 31, 64 };
	/* 64 experts, and Kimi-K2's 384 (several per thread in the layout's scan); 5 functions;
	 * 4 batch sizes */
	for (int ci = 0; ci < 2 * 5 * 4; ci++) {
		const int E = ci >= 20 ? 384 : 64, fn = ci / 4 % 5, n = ns[ci % 4];
		float *lg = frnd((size_t)n * E, 3.0f);
		if (n > 1) /* a tie: the lower id must win on both */
			lg[E + 5] = lg[E + 9] = 50.0f;
		struct pair pl = pnew(lg, (size_t)n * E * 4), pi = pnew(NULL, (size_t)n * K * 4);
		struct pair pw = pnew(NULL, (size_t)n * K * 4);
		struct md_dev_route r = { .n = n };
		r.p = (struct md_route_params){
			.fn = fn == 0 ? MD_ROUTE_SOFTMAX_TOPK : fn == 1 ? MD_ROUTE_SOFTMAX_WEIGHT
							  : MD_ROUTE_SCORED_TOPK,
			.E = E, .K = K, .norm_topk = fn != 4, .w_scale = fn == 3 ? 2.5f : 1.0f,
			.gating = fn == 4 ? MD_GATING_SOFTMAX : MD_GATING_SIGMOID,
			.n_groups = fn == 3 ? 8 : 0, .n_group_used = fn == 3 ? 4 : 0,
		};
		r.logits = pl.c, r.ids = pi.c, r.w = pw.c, r.bias = fn == 2 || fn == 3 ? pbias.c : NULL;
		CHECK_EQ_I(cu->fwd->route(cu, &r), 0);
		r.logits = pl.s, r.ids = pi.s, r.w = pw.s, r.bias = fn == 2 || fn == 3 ? pbias.s : NULL;
		CHECK_EQ_I(sim->fwd->route(sim, &r), 0);
		static const char *const names[] = { "softmax_topk", "softmax_weight",
						     "scored (GLM)", "scored (DeepSeek-V3)",
						     "scored (DeepSeek-V2)" };
		char what[96];
		snprintf(what, sizeof what, "route %s, %d experts, %d tokens", names[fn], E, n);
		pcmp(&pi, what, 0); /* the ids' bits as floats: exact */
		pcmp(&pw, what, 1e-10);
		/* the layout of the (common) routing, weights from the simulated one */
		const int NK = n * K, G = NK < E ? NK : E;
		size_t nb2[3] = { 4096, 8192, 4096 };
		struct pair pb = pnew(NULL, (size_t)E * 8192), po = pnew(NULL, (size_t)(G + 1) * 4);
		struct pair pt = pnew(NULL, (size_t)NK * 4), pe = pnew(NULL, (size_t)NK * 4);
		struct pair ps = pnew(NULL, (size_t)NK * 4), pc = pnew(NULL, (size_t)NK * 4);
		struct pair pt3 = pnew(NULL, (size_t)3 * G * sizeof(void *));
		int32_t *ids = malloc((size_t)NK * 4);
		float *w = malloc((size_t)NK * 4);
		CHECK_EQ_I(sim->download(sim, ids, pi.s, (size_t)NK * 4), 0);
		CHECK_EQ_I(sim->download(sim, w, pw.s, (size_t)NK * 4), 0);
		CHECK_EQ_I(cu->upload(cu, pi.c, ids, (size_t)NK * 4), 0);
		CHECK_EQ_I(cu->upload(cu, pw.c, w, (size_t)NK * 4), 0);
		struct md_dev_layout l = { .n = n, .K = K, .E = E, .G = G };
		memcpy(l.nb2, nb2, sizeof nb2);
		void *tabs[2][3];
		for (int side = 0; side < 2; side++) {
			struct md_backend *b = side ? sim : cu;
			char *base = side ? pb.s : pb.c;
			l.ids = side ? pi.s : pi.c, l.w = side ? pw.s : pw.c;
			l.base[0] = base, l.base[1] = base + 1000, l.base[2] = base + 2000;
			l.off = side ? po.s : po.c, l.tok = side ? pt.s : pt.c;
			l.eid = side ? pe.s : pe.c, l.cslot = side ? ps.s : ps.c;
			l.cw = side ? pc.s : pc.c, l.wtab = side ? pt3.s : pt3.c;
			CHECK_EQ_I(b->fwd->moe_layout(b, &l), 0);
			tabs[side][0] = base;
		}
		snprintf(what, sizeof what, "moe_layout, %d experts, %d tokens", E, n);
		pcmp(&po, what, 0);
		pcmp(&pt, what, 0);
		pcmp(&pe, what, 0);
		pcmp(&ps, what, 0);
		pcmp(&pc, what, 0);
		/* the pointer tables, as offsets from each side's base */
		uintptr_t *a = malloc((size_t)3 * G * sizeof(void *)), *c = malloc((size_t)3 * G * sizeof(void *));
		CHECK_EQ_I(cu->download(cu, a, pt3.c, (size_t)3 * G * sizeof(void *)), 0);
		CHECK_EQ_I(sim->download(sim, c, pt3.s, (size_t)3 * G * sizeof(void *)), 0);
		int bad = 0;
		for (int i = 0; i < 3 * G; i++)
			bad += a[i] - (uintptr_t)tabs[0][0] != c[i] - (uintptr_t)tabs[1][0];
		CHECK_MSG(bad == 0, "%s: %d pointer table entries differ", what, bad);
		free(a);
		free(c);
		free(ids);
		free(w);
		free(lg);
		struct pair *all[] = { &pl, &pi, &pw, &pb, &po, &pt, &pe, &ps, &pc, &pt3 };
		for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
			pfree(all[i]);
	}
	pfree(&pbias);
	free(bias);
	printf("gpu: routing and expert layout: ok\n");
}

/* ---- whole passes ---- */

/* Greedy choices equal, and the log-probabilities of the reference's top 5 within LOGP_TOL.
 * Returns the largest difference. */
static double cmp_rows(const char *what, const float *ref, const float *got, int rows, size_t V)
{
	int argmax_diff = 0;
	double worst = 0;
	for (int r = 0; r < rows; r++) {
		const float *a = ref + (size_t)r * V, *b = got + (size_t)r * V;
		double ma = -INFINITY, mb = -INFINITY, sa = 0, sb = 0;
		size_t ia = 0, ib = 0;
		for (size_t i = 0; i < V; i++) {
			if (a[i] > ma)
				ma = a[i], ia = i;
			if (b[i] > mb)
				mb = b[i], ib = i;
		}
		for (size_t i = 0; i < V; i++) {
			sa += exp(a[i] - ma);
			sb += exp(b[i] - mb);
		}
		argmax_diff += ia != ib;
		uint8_t taken[4096] = { 0 };
		for (int k = 0; k < 5 && V <= sizeof taken; k++) {
			size_t best = 0;
			double bv = -INFINITY;
			for (size_t i = 0; i < V; i++)
				if (!taken[i] && a[i] > bv)
					bv = a[i], best = i;
			taken[best] = 1;
			double la = a[best] - ma - log(sa), lb = b[best] - mb - log(sb);
			if (fabs(la - lb) > worst || isnan(lb))
				worst = isnan(lb) ? INFINITY : fabs(la - lb);
		}
	}
	CHECK_MSG(argmax_diff == 0, "%s: greedy choice differs in %d of %d rows", what, argmax_diff,
		  rows);
	CHECK_MSG(worst <= LOGP_TOL, "%s: top-5 log-probabilities differ by %.3g (tolerance %.3g)",
		  what, worst, LOGP_TOL);
	return worst;
}

static void check_parity(const char *moed_gguf, bool emulated)
{
	printf("| model | experts | rows | greedy equal | top-5 logprob max diff | MoE layer passes routed on the device / host | passes as graphs (captures) |\n"
	       "| --- | --- | ---: | --- | ---: | ---: | ---: |\n");
	for (size_t c = 0; c < fws_n_cases; c++) {
		char dir[512], path[600], err[256];
		if (gen_model(moed_gguf, fws_cases[c].args, "m.gguf", dir, sizeof dir, path, sizeof path)) {
			failures++;
			continue;
		}
		struct md_model m;
		if (md_model_load(&m, path, err, sizeof err)) {
			CHECK_MSG(0, "%s: %s", fws_cases[c].label, err);
			gen_model_cleanup(dir, path);
			continue;
		}
		size_t V = m.hp.n_vocab;
		float *ref = calloc(FWS_MAX_ROWS * V, sizeof(float)), *got = calloc(FWS_MAX_ROWS * V, sizeof(float));
		int n = fws_run(&m, NULL, NULL, NULL, NULL, ref);
		CHECK_MSG(n > 0, "%s: CPU run %d", fws_cases[c].label, n);
		for (int mode = 0; mode < 2 && n > 0; mode++) {
			/* experts on the CPU: the host executor, the same on any device (and slow
			 * on the emulator) */
			if (mode && (!m.hp.n_expert || emulated))
				break;
			struct fws_dev fd = { .dev = cu, .resident = mode == 0 };
			int g = fws_run(&m, &fd, NULL, NULL, NULL, got);
			CHECK_MSG(g == n, "%s: CUDA run %d rows (%s)", fws_cases[c].label, g, fd.err);
			char what[160];
			snprintf(what, sizeof what, "%s, %s", fws_cases[c].label,
				 mode ? "experts on the CPU" : "resident");
			int f0 = failures;
			double d = g == n ? cmp_rows(what, ref, got, n, V) : INFINITY;
			/* Resident experts (or dense): decode and prefill chunks of up to 64 tokens run
			 * as graphs where the backend has them. */
			if (mode == 0 && cu->fwd->capture_begin)
				CHECK_MSG(fd.n_graphs > 0 && fd.n_captures > 0, "%s: no graph launched", what);
			printf("| %s | %s | %d | %s | %.2g | %llu / %llu | %llu (%llu) |\n",
			       fws_cases[c].label, mode ? "CPU (mapping)" : "resident", n,
			       failures == f0 ? "yes" : "NO", d, (unsigned long long)fd.n_fast,
			       (unsigned long long)fd.n_host, (unsigned long long)fd.n_graphs,
			       (unsigned long long)fd.n_captures);
		}
		free(ref);
		free(got);
		md_model_free(&m);
		gen_model_cleanup(dir, path);
	}
}

/* The store with CUDA as its device tier at 10% .. 100% of the expert bytes. */
static void check_tier(const char *moed_gguf, bool emulated)
{
	static const char *const args[] = { "--arch", "qwen3moe", "--type", "q8_0", "--n-layer", "4",
					    "--n-embd", "256", "--head-dim", "32", "--n-ff-exp", "256",
					    "--n-expert", "32", "--n-expert-used", "4", NULL };
	char dir[512], path[600], err[256];
	if (gen_model(moed_gguf, args, "tier.gguf", dir, sizeof dir, path, sizeof path)) {
		failures++;
		return;
	}
	struct md_model m;
	CHECK_EQ_I(md_model_load(&m, path, err, sizeof err), 0);
	size_t V = m.hp.n_vocab, slot = md_expert_store_slot_bytes(&m);
	uint32_t units = m.hp.n_layer * m.hp.n_expert;
	float *ref = calloc(FWS_MAX_ROWS * V, sizeof(float)), *got = calloc(FWS_MAX_ROWS * V, sizeof(float));
	int n = fws_run(&m, NULL, NULL, NULL, NULL, ref);
	/* the budgets, then 25% again with every device miss copied up (on-demand copying: the
	 * cost model's CPU rate fixed at nothing), so that path runs too */
	const int pct[] = { 10, 25, 50, 75, 100, 25 };
	static struct md_xcost copy_up;
	md_xcost_init(&copy_up, 1.0, 0, 0);
	for (size_t i = 0; i < sizeof(pct) / sizeof(pct[0]); i++) {
		const bool up = i == sizeof(pct) / sizeof(pct[0]) - 1;
		if (emulated && (pct[i] == 10 || pct[i] == 50 || pct[i] == 75))
			continue; /* the emulator is slow: 25%, 100% and the copy-up pass */
		size_t dev_units = units * (size_t)pct[i] / 100;
		size_t min_units = md_expert_store_min_bytes(&m, FWS_BATCH) / slot;
		if (dev_units < min_units)
			dev_units = min_units;
		struct md_expert_store_config c = {
			.host_bytes = (size_t)units * slot + 64 * slot, .policy = MD_EPOL_LRU,
			.max_tokens = FWS_BATCH, .dev = cu, .dev_bytes = dev_units * slot,
			.rates = up ? &copy_up : NULL,
		};
		struct md_expert_store *s = NULL;
		CHECK_EQ_I(md_expert_store_new(&s, &m, &c, err, sizeof err), 0);
		if (!s)
			continue;
		struct fws_dev fd = { .dev = cu, .resident = false, .src = md_expert_store_src(s) };
		int g = fws_run(&m, &fd, NULL, NULL, NULL, got);
		char what[96];
		snprintf(what, sizeof what, "device tier at %d%% of the expert bytes%s", pct[i],
			 up ? ", misses copied up" : "");
		CHECK_MSG(g == n, "%s: %d rows of %d (%s)", what, g, n, fd.err);
		if (g == n)
			cmp_rows(what, ref, got, n, V);
		struct md_expert_store_stats st;
		md_expert_store_get_stats(s, &st);
		if (up)
			CHECK_MSG(st.dev_compute_dev > 0, "%s: nothing copied up", what);
		printf("gpu: %s: %llu device hits, %llu misses (%llu copied up, %llu on the CPU)\n", what,
		       (unsigned long long)st.dev_hits, (unsigned long long)st.dev_misses,
		       (unsigned long long)st.dev_compute_dev, (unsigned long long)st.dev_compute_host);
		md_expert_store_free(s);
	}
	free(ref);
	free(got);
	md_model_free(&m);
	gen_model_cleanup(dir, path);
}

/* No room on the device: a clear error, nothing held, and fine once the room is back. */
static void check_oom(const char *moed_gguf)
{
	static const char *const args[] = { "--arch", "qwen3moe", "--type", "f32", "--head-dim", "32",
					    "--n-embd", "512", "--n-ff-exp", "512", "--n-layer", "4", NULL };
	char dir[512], path[600], err[256] = "";
	if (gen_model(moed_gguf, args, "oom.gguf", dir, sizeof dir, path, sizeof path)) {
		failures++;
		return;
	}
	struct md_model m;
	CHECK_EQ_I(md_model_load(&m, path, err, sizeof err), 0);
	struct md_kv_cache kv;
	CHECK_EQ_I(md_kv_init_rows(&kv, m.hp.n_layer, md_model_kv_rows(&m), 64, 4), 0);
	/* Hold all but ~4 MiB of the device in 256 MiB, then 1 MiB pieces. */
	void *hog[200000];
	size_t nh = 0;
	for (size_t piece = (size_t)256 << 20; piece >= ((size_t)1 << 20); piece /= 16)
		while (nh < sizeof(hog) / sizeof(hog[0]) && cu->alloc(cu, piece, &hog[nh]) == 0)
			nh++;
	for (int i = 0; i < 4 && nh; i++)
		cu->free(cu, hog[--nh]);
	struct md_fwd_dev *d = NULL;
	int rc = md_fwd_dev_new(&m, cu, &kv, 64, true, &d, err, sizeof err);
	CHECK_MSG(rc == -ENOMEM && d == NULL && err[0], "no room: rc %d, '%s'", rc, err);
	printf("gpu: no room on the device: %s\n", err);
	while (nh)
		cu->free(cu, hog[--nh]);
	rc = md_fwd_dev_new(&m, cu, &kv, 64, true, &d, err, sizeof err);
	CHECK_MSG(rc == 0, "room back: rc %d (%s)", rc, err);
	md_fwd_dev_free(d);
	md_kv_release(&kv);
	md_model_free(&m);
	gen_model_cleanup(dir, path);
}

int main(int argc, char **argv)
{
	if (argc < 2) {
		fprintf(stderr, "usage: test_gpu MOED_GGUF\n");
		return 2;
	}
	setvbuf(stdout, NULL, _IOLBF, 0);
	setenv("MOED_KERNELS", "ref", 1); /* the CPU reference dequantizes as the GPU does */
	cu = md_backend_cuda();
	if (!cu) {
		printf("gpu: skipped: %s\n", md_backend_cuda_error());
		return 77;
	}
	struct md_backend_device info = { .name = "" };
	if (cu->device_info(cu, 0, &info) == 0)
		printf("gpu: %s, cc %d.%d, %.1f GiB\n", info.name, info.cc_major, info.cc_minor,
		       info.mem_total / 1073741824.0);
	sim = md_backend_sim_new((size_t)8 << 30, 0);
	check_elementwise();
	check_rope();
	check_qkv_rows();
	check_attention();
	check_products();
	check_routing();
	check_mla();
	/* the CUDA emulator (tests/cuda_emu) is a thousand times slower than a GPU */
	const bool emulated = strstr(info.name, "emulator") != NULL;
	check_parity(argv[1], emulated);
	check_tier(argv[1], emulated);
	check_oom(argv[1]);
	md_backend_sim_free(sim);
	if (failures) {
		fprintf(stderr, "gpu: %d failures\n", failures);
		return 1;
	}
	printf("gpu: ok\n");
	return 0;
}
