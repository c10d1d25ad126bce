/* The device forward pass's FFN sub-layer (forward_dev_int.h): the dense SwiGLU, and the MoE
 * layer, routed on the host (the router's logits down, engine/router.c, the layout up; experts
 * got from a source in waves and run where they live: grouped launches on the device, the
 * host executor on the CPU) or on the device (resident experts: route, layout and the grouped
 * products without a host round trip); then the combine in the routing's slot order, the
 * shared expert, the residual. See engine/forward_dev.c for the whole pass. */
#include <errno.h>
#include <math.h>
#include <string.h>
#include <time.h>

#include "engine/backend_sim.h"
#include "engine/forward_dev_int.h"

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* y (rows, n) += the bias row b (n) in every row, on the host. */
static void add_bias_h(float *y, const float *b, int rows, uint32_t n)
{
	for (int r = 0; r < rows; r++)
		for (uint32_t i = 0; i < n; i++)
			y[(size_t)r * n + i] += b[i];
}

/* ---- the MoE FFN ----
 *
 * Layout: the layer's experts that were got, in waves (plan's n_ready first), each wave's
 * device experts before its host ones; entry L of the layout is get-order entry lay_g[L], its
 * weights lay_w[L], its slots lay_off[L] .. lay_off[L+1]-1 (token lay_tok, expert lay_eid of
 * each slot), and ex_pos maps the routing's slots there (-1: an expert whose get failed). A
 * run is a stretch of layout entries on one side (device or host) with one type and shape. */

static bool same_shape(const struct md_expert_w *a, const struct md_expert_w *b)
{
	return a->gate.type == b->gate.type && a->up.type == b->up.type &&
	       a->down.type == b->down.type && a->gate.n_in == b->gate.n_in &&
	       a->gate.n_out == b->gate.n_out && a->up.n_out == b->up.n_out &&
	       a->down.n_in == b->down.n_in && a->down.n_out == b->down.n_out &&
	       a->gate.nb1 == b->gate.nb1 && a->up.nb1 == b->up.nb1 && a->down.nb1 == b->down.nb1;
}

/* Expert bytes of layout entries l0 .. l1-1, and each one's bytes times its tokens. */
static void run_bytes(const struct md_fwd_dev *d, int l0, int l1, uint64_t *bytes,
		      uint64_t *tok_bytes)
{
	*bytes = *tok_bytes = 0;
	for (int l = l0; l < l1; l++) {
		uint64_t bb = md_expert_w_bytes(&d->lay_w[l]);
		*bytes += bb;
		*tok_bytes += bb * (uint64_t)(d->lay_off[l + 1] - d->lay_off[l]);
	}
}

/* A bias tensor as the executor B reads it: its device copy, or its host data. */
static const float *bias_of(const struct md_fwd_dev *d, const struct md_tensor *t, bool on_dev)
{
	return on_dev ? dptr(d, t) : t->data;
}

/* Layout entries l0 .. l1-1 (one run) on B: the device (on_dev: tables uploaded, buffers the
 * device's) or the host executor (tables in host memory, the host buffers). Slots
 * lay_off[l0] .. lay_off[l1]-1 of ye get the experts' outputs for input rows lay_tok of x. */
static int run_experts(struct md_fwd_dev *d, uint32_t il, int l0, int l1, bool on_dev)
{
	struct md_backend *B = on_dev ? d->b : d->host;
	const struct md_backend_fwd *op = B->fwd;
	const struct md_layer *L = &d->m->layers[il];
	const int ng = l1 - l0, base = d->lay_off[l0], rows = d->lay_off[l1] - base;
	const struct md_expert_w *x0 = &d->lay_w[l0];
	const int F = (int)x0->gate.n_out, N = (int)x0->down.n_out;
	float *ge = on_dev ? d->ge : d->ge_h, *ue = on_dev ? d->ue : d->ue_h;
	float *ye = on_dev ? d->ye : d->ye_h;
	const float *x = on_dev ? d->xn : d->xn_h;
	int max_rows = 0;
	for (int l = l0; l < l1; l++)
		if (d->lay_off[l + 1] - d->lay_off[l] > max_rows)
			max_rows = d->lay_off[l + 1] - d->lay_off[l];
	/* the table: gate, up and down pointers (ng each), offsets, input rows, expert ids */
	size_t np = 3 * (size_t)ng, ni = (size_t)ng + 1 + 2 * (size_t)rows;
	size_t bytes = np * sizeof(void *) + ni * sizeof(int32_t);
	char *h = md_fwd_dev__stage(d, bytes);
	if (!h)
		return -ENOMEM;
	const void **pw = (const void **)h;
	int32_t *off = (int32_t *)(pw + np), *src = off + ng + 1, *eid = src + rows;
	for (int l = l0; l < l1; l++) {
		pw[l - l0] = d->lay_w[l].gate.data;
		pw[ng + l - l0] = d->lay_w[l].up.data;
		pw[2 * ng + l - l0] = d->lay_w[l].down.data;
		off[l - l0] = d->lay_off[l] - base;
	}
	off[ng] = rows;
	memcpy(src, d->lay_tok + base, (size_t)rows * sizeof(int32_t));
	memcpy(eid, d->lay_eid + base, (size_t)rows * sizeof(int32_t));
	const char *t = h;
	int rc = 0;
	if (on_dev) {
		rc = md_fwd_dev__dgrow(d, &d->drun, &d->drun_cap, bytes);
		if (!rc)
			rc = md_fwd_dev__upload(d, d->drun, h, bytes);
		if (rc)
			return rc;
		t = d->drun;
	}
	const void *const *tw = (const void *const *)t;
	const int32_t *toff = (const int32_t *)(tw + np), *tsrc = toff + ng + 1;
	const int32_t *teid = tsrc + rows;
	struct md_dev_experts e = {
		.type = x0->gate.type, .n_in = x0->gate.n_in, .n_out = F, .nb1 = x0->gate.nb1,
		.nw = 2, .ng = ng, .w = tw, .off = toff, .src = tsrc, .x = x, .n_x = d->n_x,
		.y = { ge + (size_t)base * F, ue + (size_t)base * F }, .n_slots = rows,
		.max_rows = max_rows,
	};
	if (x0->gate.type == x0->up.type && x0->gate.nb1 == x0->up.nb1) {
		rc = op->mm_experts(B, &e);
	} else { /* gate and up of different types: one launch each */
		e.nw = 1;
		rc = op->mm_experts(B, &e);
		e.type = x0->up.type;
		e.nb1 = x0->up.nb1;
		e.w = tw + ng;
		e.y[0] = ue + (size_t)base * F;
		if (!rc)
			rc = op->mm_experts(B, &e);
	}
	if (!rc && L->gate_exps_b)
		rc = op->add_rows(B, ge + (size_t)base * F, bias_of(d, L->gate_exps_b, on_dev), teid,
				  rows, F);
	if (!rc && L->up_exps_b)
		rc = op->add_rows(B, ue + (size_t)base * F, bias_of(d, L->up_exps_b, on_dev), teid,
				  rows, F);
	if (!rc)
		rc = op->glu(B, ge + (size_t)base * F, ue + (size_t)base * F, (size_t)rows * F,
			     d->m->hp.ffn_act);
	struct md_dev_experts dn = {
		.type = x0->down.type, .n_in = x0->down.n_in, .n_out = N, .nb1 = x0->down.nb1,
		.nw = 1, .ng = ng, .w = tw + 2 * ng, .off = toff, .src = NULL,
		.x = ge + (size_t)base * F, .n_x = rows, .y = { ye + (size_t)base * N, NULL },
		.n_slots = rows, .max_rows = max_rows,
	};
	if (!rc)
		rc = op->mm_experts(B, &dn);
	if (!rc && L->down_exps_b)
		rc = op->add_rows(B, ye + (size_t)base * N, bias_of(d, L->down_exps_b, on_dev), teid,
				  rows, N);
	if (!rc && !on_dev) /* the host rows into the device's ye */
		rc = d->b->upload(d->b, d->ye + (size_t)base * N, ye + (size_t)base * N,
				  (size_t)rows * N * sizeof(float));
	return rc;
}

/* Layout entries l0 .. l1-1, split into runs and computed; timed for a source that observes
 * (a device run is waited for then, so that its time is its own). */
static int run_range(struct md_fwd_dev *d, const struct md_fwd_dev_pass *p,
		     struct md_expert_src *src, uint32_t il, int l0, int l1)
{
	for (int l = l0; l < l1;) {
		const bool dev = d->lay_w[l].dev != NULL;
		int h = l + 1;
		while (h < l1 && (d->lay_w[h].dev != NULL) == dev && same_shape(&d->lay_w[h], &d->lay_w[l]))
			h++;
		if (!dev && !d->xn_h_valid) {
			int rc = md_fwd_dev__download(d, d->xn_h, d->xn,
					  (size_t)d->n_x * d->m->hp.n_embd * sizeof(float));
			if (rc)
				return rc;
			d->xn_h_valid = true;
		}
		if (!dev)
			md_backend_sim_set_pool(d->host, p->pool);
		bool timed = src->ops->observe != NULL;
		if (timed && dev && d->op->sync(d->b))
			return -EIO;
		double t0 = timed ? now_s() : 0;
		int rc = run_experts(d, il, l, h, dev);
		if (rc)
			return rc;
		if (timed) {
			if (dev && (rc = d->op->sync(d->b)))
				return rc;
			uint64_t bb, tb;
			run_bytes(d, l, h, &bb, &tb);
			src->ops->observe(src, dev, bb, tb, now_s() - t0);
		}
		l = h;
	}
	return 0;
}

/* Place get-order entries g0 .. g1-1 (got) in the layout after lay_n entries: device ones
 * first, then host ones. */
static void layout_wave(struct md_fwd_dev *d, const struct md_routing *r, int g0, int g1)
{
	for (int pass = 0; pass < 2; pass++)
		for (int g = g0; g < g1; g++) {
			if (d->ex_st[g] != EX_RUN || (d->ex_got[g].dev != NULL) != (pass == 0))
				continue;
			int l = d->lay_n++;
			int32_t e = r->active[d->ex_order[g]], p = d->lay_off[l];
			d->lay_w[l] = d->ex_got[g];
			for (int32_t s = r->off[e]; s < r->off[e + 1]; s++, p++) {
				d->lay_tok[p] = r->tok[s];
				d->lay_eid[p] = e;
				d->ex_pos[s] = p;
			}
			d->lay_off[l + 1] = p;
		}
}

/* Release the first n_got get-order entries whose get succeeded (device work on them waited
 * for first: a source may reuse their memory once released). */
static int experts_release(struct md_fwd_dev *d, struct md_expert_src *src, uint32_t il,
			   const struct md_routing *r, int n_got)
{
	if (!src->ops->release)
		return 0;
	int rc = d->op->sync(d->b);
	for (int i = 0; i < n_got; i++)
		if (d->ex_st[i] != EX_FAILED)
			md_expert_src_release(src, il, r->active[d->ex_order[i]]);
	return rc;
}

/* Step 3 of the MoE layer: plan, get in waves, lay out, run. */
static int moe_experts(struct md_fwd_dev *d, const struct md_fwd_dev_pass *p,
		       struct md_expert_src *src, uint32_t il, const struct md_routing *r,
		       int32_t *tok_err)
{
	const int na = r->n_active;
	for (int i = 0; i < na; i++)
		d->ex_ntok[i] = r->off[r->active[i] + 1] - r->off[r->active[i]];
	int n_ready = md_expert_src_plan(src, il, r->active, d->ex_ntok, na, d->ex_order);
	if (n_ready < 0)
		return n_ready;
	if (n_ready == 0 || n_ready > na)
		n_ready = na;
	memset(d->ex_st, EX_RUN, (size_t)na);
	for (int s = 0; s < r->off[r->n_expert]; s++)
		d->ex_pos[s] = -1;
	d->lay_n = 0;
	d->lay_off[0] = 0;
	int got = 0;
	for (int g0 = 0; g0 < na;) {
		int g1 = g0 == 0 ? n_ready : na;
		for (; got < g1; got++) {
			int32_t e = r->active[d->ex_order[got]];
			int rc = md_expert_src_get(src, il, e, &d->ex_got[got]);
			if (!rc && d->ex_got[got].dev && d->ex_got[got].dev != d->b) {
				md_expert_src_release(src, il, e);
				rc = -EINVAL; /* another device's memory: cannot read it here */
			}
			if (rc && tok_err) {
				d->ex_st[got] = EX_FAILED;
				for (int32_t s = r->off[e]; s < r->off[e + 1]; s++)
					if (!tok_err[r->tok[s]])
						tok_err[r->tok[s]] = rc;
			} else if (rc) {
				experts_release(d, src, il, r, got);
				return rc;
			}
		}
		int l0 = d->lay_n;
		layout_wave(d, r, g0, g1);
		int rc = run_range(d, p, src, il, l0, d->lay_n);
		if (rc) {
			experts_release(d, src, il, r, got);
			return rc;
		}
		g0 = g1;
	}
	return 0;
}

/* Pre-gating (engine/forward.c prefetch_next): layer il+1's router on the residual leaving
 * layer il, for a source that prefetches or an observer. */
static int prefetch_next(struct md_fwd_dev *d, const struct md_fwd_dev_pass *p,
			 struct md_expert_src *src, uint32_t il, int n)
{
	const struct md_hparams *hp = &d->m->hp;
	bool observe = p->pregate_cb && !p->draft;
	if ((!src->ops->prefetch && !observe) || il + 1 >= hp->n_layer)
		return 0;
	const struct md_layer *L = &d->m->layers[il + 1];
	if (!L->gate_inp)
		return 0;
	struct md_mat wr = dmat(d, L->gate_inp, 0);
	int rc = d->op->rmsnorm(d->b, d->tmp, d->x, dptr(d, L->ffn_norm), n, (int)hp->n_embd, (int)hp->n_embd,
				hp->rms_eps);
	if (!rc)
		rc = d->op->mm(d->b, &wr, d->tmp, n, d->rl);
	if (!rc)
		rc = md_fwd_dev__download(d, d->pre_router.logits, d->rl, (size_t)n * hp->n_expert * sizeof(float));
	if (rc)
		return rc;
	if (L->gate_inp_b)
		add_bias_h(d->pre_router.logits, L->gate_inp_b->data, n, hp->n_expert);
	const struct md_routing *pr = md_router_route_bias(&d->pre_router, n,
							   L->exp_probs_b ? L->exp_probs_b->data : NULL);
	if (observe)
		p->pregate_cb(p->pregate_ud, il + 1, pr);
	if (src->ops->prefetch)
		md_expert_src_prefetch(src, il + 1, pr->active, pr->n_active);
	return 0;
}

/* The layer's combine: into tmp, or (into_x) added to the residual stream x in the same
 * launch (combine_add, where no shared expert joins the sum before the residual add). */
static int combine_out(struct md_fwd_dev *d, bool into_x, const int32_t *slot, const float *w,
		       int n, int k)
{
	const int N = (int)d->m->hp.n_embd;
	return into_x ? d->op->combine_add(d->b, d->x, d->ye, slot, w, n, k, N)
		      : d->op->combine(d->b, d->tmp, d->ye, slot, w, n, k, N);
}

/* Steps 1-4 routed on the host: the router's logits down, the routing and layout up. The
 * routed experts' sum into tmp (into_x: added to x). */
static int moe_host(struct md_fwd_dev *d, const struct md_fwd_dev_pass *p,
		    struct md_expert_src *src, int n, uint32_t il, int32_t *tok_err, bool into_x)
{
	const struct md_hparams *hp = &d->m->hp;
	const struct md_layer *L = &d->m->layers[il];
	const int E = (int)hp->n_expert;

	/* 1-2. Route on the host. */
	struct md_mat wr = dmat(d, L->gate_inp, 0);
	int rc = d->op->mm(d->b, &wr, d->xn, n, d->rl);
	if (!rc)
		rc = md_fwd_dev__download(d, d->router.logits, d->rl, (size_t)n * E * sizeof(float));
	if (rc)
		return rc;
	if (L->gate_inp_b)
		add_bias_h(d->router.logits, L->gate_inp_b->data, n, E);
	const struct md_forward_draft *dp = p->draft;
	if (dp) {
		const uint8_t *allow = NULL;
		if (dp->resident_only && src->ops->resident) {
			for (int e = 0; e < E; e++)
				d->allow[e] = md_expert_src_resident(src, il, e);
			allow = d->allow;
		}
		md_router_set_draft(&d->router, (int)dp->n_used, allow);
	}
	const struct md_routing *r = md_router_route_bias(&d->router, n,
							  L->exp_probs_b ? L->exp_probs_b->data : NULL);
	if (dp && dp->predict)
		md_router_note_topk(&d->router, n, d->allow, dp->predict + (size_t)il * E);
	if (dp)
		md_router_set_draft(&d->router, 0, NULL);
	if (p->route_cb && !dp)
		p->route_cb(p->route_ud, il, r);

	/* 3. The experts. */
	d->xn_h_valid = false;
	d->n_x = n;
	rc = moe_experts(d, p, src, il, r, tok_err);
	if (rc)
		return rc;

	/* 4. Combine in the routing's slot order, per token. */
	const int k = r->n_used;
	size_t bytes = (size_t)n * k * (sizeof(int32_t) + sizeof(float));
	int32_t *h = md_fwd_dev__stage(d, bytes);
	if (!h)
		rc = -ENOMEM;
	if (!rc) {
		int32_t *slot = h;
		float *w = (float *)(h + (size_t)n * k);
		for (int t = 0; t < n; t++)
			d->cmb_n[t] = 0;
		for (int s = 0; s < r->off[r->n_expert]; s++) {
			int t = r->tok[s], j = d->cmb_n[t]++;
			slot[(size_t)t * k + j] = d->ex_pos[s];
			w[(size_t)t * k + j] = r->tok_w[s];
		}
		rc = md_fwd_dev__dgrow(d, &d->drun, &d->drun_cap, bytes);
		if (!rc)
			rc = md_fwd_dev__upload(d, d->drun, h, bytes);
		const int32_t *ts = d->drun;
		if (!rc)
			rc = combine_out(d, into_x, ts, (const float *)(ts + (size_t)n * k), n, k);
	}
	d->r_last = r;
	return rc;
}

/* Whether layer il's routing can run on the device this pass (engine/backend_fwd.h route):
 * experts resident, an exact pass without a pre-gating observer, and a batch the layout
 * buffers hold. */
bool md_fwd_dev__fast_route(const struct md_fwd_dev *d, const struct md_fwd_dev_pass *p, int n,
		       const struct md_layer *L)
{
	(void)L;
	return d->fast_ok && !p->draft && !p->pregate_cb && n <= FAST_MAX_TOK;
}

/* Steps 1-4 on the device: router, route, layout, the experts' grouped products, combine into
 * tmp (into_x: added to x); the routing is kept in rec for the observers (fwd_observe, after the pass). */
static int moe_fast(struct md_fwd_dev *d, int n, uint32_t il, bool into_x)
{
	const struct md_backend_fwd *op = d->op;
	struct md_backend *B = d->b;
	const struct md_hparams *hp = &d->m->hp;
	const struct md_layer *L = &d->m->layers[il];
	const int N = (int)hp->n_embd, E = (int)hp->n_expert, K = (int)hp->n_expert_used;
	const int NK = n * K, G = NK < E ? NK : E;
	struct md_mat wr = dmat(d, L->gate_inp, 0);
	int rc = d->op->mm(d->b, &wr, d->xn, n, d->rl);
	if (!rc && L->gate_inp_b)
		rc = op->add_rows(B, d->rl, dptr(d, L->gate_inp_b), NULL, n, E);
	int32_t *ids = d->rec_ids + (size_t)il * n * K;
	float *w = d->rec_w + (size_t)il * n * K;
	struct md_dev_route rt = { .logits = d->rl, .n = n, .bias = dptr(d, L->exp_probs_b),
				   .ids = ids, .w = w };
	md_route_params_of(hp, &rt.p);
	if (!rc)
		rc = op->route(B, &rt);
	/* the layout buffer: wtab (3 G pointers), off (G + 1), tok, eid, cslot (n K each), cw */
	const void **wtab = d->lay;
	int32_t *off = (int32_t *)(wtab + 3 * FAST_MAX_TOK * K), *tok = off + FAST_MAX_TOK * K + 1;
	int32_t *eid = tok + NK, *cslot = eid + NK;
	float *cw = (float *)(cslot + NK);
	struct md_mat gm = dmat(d, L->gate_exps, 0), um = dmat(d, L->up_exps, 0);
	struct md_mat dm = dmat(d, L->down_exps, 0);
	struct md_dev_layout ly = {
		.ids = ids, .w = w, .n = n, .K = K, .E = E, .G = G,
		.base = { gm.data, um.data, dm.data },
		.nb2 = { L->gate_exps->nb2, L->up_exps->nb2, L->down_exps->nb2 },
		.off = off, .tok = tok, .eid = eid, .cslot = cslot, .cw = cw, .wtab = wtab,
	};
	if (!rc)
		rc = op->moe_layout(B, &ly);
	const int F = (int)gm.n_out;
	struct md_dev_experts e = {
		.type = gm.type, .n_in = gm.n_in, .n_out = F, .nb1 = gm.nb1, .nw = 2, .ng = G,
		.w = wtab, .off = off, .src = tok, .x = d->xn, .n_x = n, .y = { d->ge, d->ue },
		.n_slots = NK, .max_rows = n,
	};
	if (!rc && gm.type == um.type && gm.nb1 == um.nb1) {
		rc = op->mm_experts(B, &e);
	} else if (!rc) {
		e.nw = 1;
		rc = op->mm_experts(B, &e);
		e.type = um.type;
		e.nb1 = um.nb1;
		e.w = wtab + G;
		e.y[0] = d->ue;
		if (!rc)
			rc = op->mm_experts(B, &e);
	}
	if (!rc && L->gate_exps_b)
		rc = op->add_rows(B, d->ge, dptr(d, L->gate_exps_b), eid, NK, F);
	if (!rc && L->up_exps_b)
		rc = op->add_rows(B, d->ue, dptr(d, L->up_exps_b), eid, NK, F);
	if (!rc)
		rc = op->glu(B, d->ge, d->ue, (size_t)NK * F, hp->ffn_act);
	struct md_dev_experts dn = {
		.type = dm.type, .n_in = dm.n_in, .n_out = N, .nb1 = dm.nb1, .nw = 1, .ng = G,
		.w = wtab + 2 * G, .off = off, .src = NULL, .x = d->ge, .n_x = NK,
		.y = { d->ye, NULL }, .n_slots = NK, .max_rows = n,
	};
	if (!rc)
		rc = op->mm_experts(B, &dn);
	if (!rc && L->down_exps_b)
		rc = op->add_rows(B, d->ye, dptr(d, L->down_exps_b), eid, NK, N);
	if (!rc)
		rc = combine_out(d, into_x, cslot, cw, n, K);
	d->fast_layer[il] = 1;
	d->n_fast++;
	return rc;
}

/* The MoE FFN of layer il on xn; output in tmp (into_x: the routed experts' sum added to x,
 * for a layer without a shared expert). */
static int moe(struct md_fwd_dev *d, const struct md_fwd_dev_pass *p, struct md_expert_src *src,
	       int n, uint32_t il, int32_t *tok_err, bool into_x)
{
	const struct md_backend_fwd *op = d->op;
	struct md_backend *B = d->b;
	const struct md_hparams *hp = &d->m->hp;
	const struct md_layer *L = &d->m->layers[il];
	const int N = (int)hp->n_embd;
	int rc;
	d->r_last = NULL;
	if (md_fwd_dev__fast_route(d, p, n, L)) {
		rc = moe_fast(d, n, il, into_x);
	} else {
		rc = moe_host(d, p, src, n, il, tok_err, into_x);
		d->n_host++;
	}

	/* The shared expert: with its sigmoid gate (Qwen2-MoE), or ungated (DeepSeek, GLM). */
	if (!rc && L->gate_shexp) {
		struct md_mat g = dmat(d, L->gate_shexp, 0), u = dmat(d, L->up_shexp, 0);
		struct md_mat dn = dmat(d, L->down_shexp, 0);
		rc = md_fwd_dev__mm3(d, &g, &u, NULL, d->xn, n, d->ge, d->ue, NULL);
		if (!rc)
			rc = op->glu(B, d->ge, d->ue, (size_t)n * g.n_out, hp->ffn_act);
		if (!rc)
			rc = op->mm(B, &dn, d->ge, n, d->ye);
		const float *gate = NULL;
		if (!rc && L->gate_inp_shexp) {
			struct md_mat gw = { MD_DT_F32, N, 1, (size_t)N * sizeof(float),
					     dptr(d, L->gate_inp_shexp) };
			rc = op->mm(B, &gw, d->xn, n, d->gsh);
			gate = d->gsh;
		}
		if (!rc)
			rc = op->gate_add(B, d->tmp, d->ye, gate, n, N);
	}
	int rr = d->r_last ? experts_release(d, src, il, d->r_last, d->r_last->n_active) : 0;
	return rc ? rc : rr;
}

int md_fwd_dev__ffn(struct md_fwd_dev *d, const struct md_fwd_dev_pass *p, struct md_expert_src *src,
	       int n, uint32_t il, int32_t *tok_err)
{
	const struct md_hparams *hp = &d->m->hp;
	const struct md_layer *L = &d->m->layers[il];
	const int N = (int)hp->n_embd;
	bool added = false; /* the residual add done (in the down product or the combine) */
	int rc = d->op->rmsnorm(d->b, d->xn, d->x, dptr(d, L->ffn_norm), n, N, N, hp->rms_eps);
	if (rc)
		return rc;
	if (L->gate_inp) {
		/* without a shared expert the combine adds the residual itself */
		added = !L->gate_shexp && md_fwd_dev__fuse(d, combine_add);
		rc = moe(d, p, src, n, il, tok_err, added);
	} else {
		struct md_mat g = dmat(d, L->ffn_gate, 0), u = dmat(d, L->ffn_up, 0);
		struct md_mat dn = dmat(d, L->ffn_down, 0);
		rc = md_fwd_dev__mm3(d, &g, &u, NULL, d->xn, n, d->ge, d->ue, NULL);
		if (!rc)
			rc = d->op->glu(d->b, d->ge, d->ue, (size_t)n * g.n_out, hp->ffn_act);
		if (!rc && md_fwd_dev__fuse(d, mm_add)) {
			rc = d->op->mm_add(d->b, &dn, d->ge, n, d->x); /* the residual in the product */
			added = true;
		} else if (!rc) {
			rc = d->op->mm(d->b, &dn, d->ge, n, d->tmp);
		}
	}
	if (!rc && !added)
		rc = d->op->add(d->b, d->x, d->tmp, (size_t)n * N);
	if (!rc && hp->n_expert)
		rc = prefetch_next(d, p, src, il, n);
	return rc;
}

/* The route observer of the layers routed on the device this pass, in layer order, from one
 * download of their routings. */
int md_fwd_dev__observe_fast(struct md_fwd_dev *d, const struct md_fwd_dev_pass *p, int n)
{
	const struct md_hparams *hp = &d->m->hp;
	const int K = (int)hp->n_expert_used;
	uint32_t last = 0;
	bool any = false;
	for (uint32_t il = 0; il < hp->n_layer; il++)
		if (d->fast_layer[il]) {
			last = il;
			any = true;
		}
	if (!any || !p->route_cb)
		return 0;
	size_t cnt = (size_t)(last + 1) * n * K;
	int rc = md_fwd_dev__download(d, d->rec_ids_h, d->rec_ids, cnt * sizeof(int32_t));
	if (!rc)
		rc = md_fwd_dev__download(d, d->rec_w_h, d->rec_w, cnt * sizeof(float));
	for (uint32_t il = 0; il <= last && !rc; il++) {
		if (!d->fast_layer[il])
			continue;
		const struct md_routing *r = md_router_from_ids(&d->router, n, K,
								d->rec_ids_h + (size_t)il * n * K,
								d->rec_w_h + (size_t)il * n * K);
		if (r)
			p->route_cb(p->route_ud, il, r);
	}
	return rc;
}

