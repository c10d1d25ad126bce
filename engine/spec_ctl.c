/* The speculation controller (see the DESIGN in spec_ctl.h). */
#include "engine/spec_ctl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DECAY 0.85      /* per verification: how fast acceptance history fades */
#define MARGIN 1.03     /* predicted gain needed to speculate */
#define PROBE_MIN 4
#define PROBE_MAX 128
/* A draft model's probe costs its rounds and a catch-up on what it missed (up to
 * MD_DRAFT_CATCHUP tokens): probe it 4x less often (measured: at 4 streams of moe64-2g with
 * acceptance 0.4, probing as often as n-gram lookup cost a quarter of the throughput). */
#define PROBE_COSTLY 4
#define EXPLORE 8       /* every this many speculating steps, try one more draft token */

static double tensor_bytes(const struct md_tensor *t)
{
	if (!t)
		return 0;
	return (double)t->ne[1] * (double)t->nb1 * (double)t->ne[2] * (double)t->ne[3];
}

/* One expert's matrix (3-D expert tensors: ne[2] experts). */
static double expert_bytes(const struct md_tensor *t)
{
	return t ? (double)t->ne[1] * (double)t->nb1 : 0;
}

void md_spec_ctl_init(struct md_spec_ctl *c, const struct md_model *m, bool fixed)
{
	memset(c, 0, sizeof(*c));
	c->fixed = fixed;
	c->load = 1;
	c->trace = getenv("MOED_SPEC_TRACE") != NULL;
	c->rvar = 0.0625; /* until measured: a quarter of a step */
	const struct md_hparams *hp = &m->hp;
	c->w_dense = tensor_bytes(m->output ? m->output : m->tok_embd);
	for (uint32_t l = 0; l < hp->n_layer; l++) {
		const struct md_layer *L = &m->layers[l];
		const struct md_tensor *dense[] = { L->wq, L->wk, L->wv, L->wo, L->ffn_gate, L->ffn_up,
						    L->ffn_down, L->gate_inp, L->gate_shexp,
						    L->up_shexp, L->down_shexp,
						    /* latent attention (deepseek2) */
						    L->wq_a, L->wq_b, L->wkv_a_mqa, L->wk_b, L->wv_b };
		for (size_t i = 0; i < sizeof(dense) / sizeof(dense[0]); i++)
			c->w_dense += tensor_bytes(dense[i]);
		if (L->gate_exps) {
			c->n_moe_layers++;
			c->w_expert += (expert_bytes(L->gate_exps) + expert_bytes(L->up_exps) +
					expert_bytes(L->down_exps));
		}
	}
	if (c->n_moe_layers)
		c->w_expert /= c->n_moe_layers;
	c->n_expert = hp->n_expert;
	c->n_used = hp->n_expert_used;
}

double md_spec_ctl_bytes(const struct md_spec_ctl *c, uint32_t n)
{
	if (!c->n_moe_layers || !c->n_expert)
		return c->w_dense + 1;
	double E = c->n_expert, K = c->n_used;
	double u = E * (1 - pow(1 - K / E, (double)n));
	return c->w_dense + c->n_moe_layers * u * c->w_expert + 1;
}

/* The step time of n tokens at load factor 1 (see md_spec_ctl_observe). */
static double shape_cost(const struct md_spec_ctl *c, uint32_t n)
{
	if (n > MD_SPEC_CTL_MAXN)
		n = MD_SPEC_CTL_MAXN;
	if (n == 0)
		n = 1;
	if (c->nobs[n] >= 2)
		return c->t[n];
	/* The nearest measured sizes below and above, scaled by the byte model between. */
	int lo = -1, hi = -1;
	for (int i = (int)n - 1; i >= 1; i--)
		if (c->nobs[i] >= 2) {
			lo = i;
			break;
		}
	for (int i = (int)n + 1; i <= MD_SPEC_CTL_MAXN; i++)
		if (c->nobs[i] >= 2) {
			hi = i;
			break;
		}
	/* Between two measured sizes: along the byte model (the distinct experts). Beyond the
	 * largest: as if every token cost as much as a whole step (compute-bound, the worst
	 * case), never less than the byte model says, so sizes not measured yet look no cheaper
	 * than they can be; the frontier is measured by exploring (md_spec_ctl_choose). Below
	 * the smallest: the smallest's time. */
	double r = md_spec_ctl_bytes(c, n);
	if (lo > 0 && hi > 0) {
		double rl = md_spec_ctl_bytes(c, (uint32_t)lo), rh = md_spec_ctl_bytes(c, (uint32_t)hi);
		double f = rh > rl ? (r - rl) / (rh - rl) : 0.5;
		return c->t[lo] + f * (c->t[hi] - c->t[lo]);
	}
	if (lo > 0) {
		double by_bytes = c->t[lo] * r / md_spec_ctl_bytes(c, (uint32_t)lo);
		double linear = c->t[lo] * n / lo;
		return linear > by_bytes ? linear : by_bytes;
	}
	if (hi > 0)
		return c->t[hi];
	return 0;
}

double md_spec_ctl_cost(const struct md_spec_ctl *c, uint32_t n)
{
	return c->load * shape_cost(c, n);
}

double md_spec_ctl_cost_hi(const struct md_spec_ctl *c, uint32_t n)
{
	if (n > MD_SPEC_CTL_MAXN)
		n = MD_SPEC_CTL_MAXN;
	double t = md_spec_ctl_cost(c, n);
	/* The standard error of the nearest measured size at or below n: the machine's relative
	 * noise over the samples behind it (about 9 in the smoother's window). */
	for (int i = (int)n; i >= 1; i--)
		if (c->nobs[i] >= 2) {
			uint32_t m = c->nobs[i] < 9 ? c->nobs[i] : 9;
			return t * (1 + sqrt(c->rvar / m));
		}
	return t;
}

void md_spec_ctl_observe(struct md_spec_ctl *c, uint32_t n, double dt)
{
	if (n == 0 || n > MD_SPEC_CTL_MAXN || !(dt > 0))
		return;
	/* Times are load x shape: the machine's load (other processes, frequency) drifts far
	 * more between the moments two step sizes are measured than the sizes differ, so a fast
	 * load factor follows every observation and the per-size shape learns slowly from
	 * normalised times; comparing sizes then compares like with like. Deviations are capped
	 * at 2x (a preempted thread) so one outlier moves either by a bounded step. */
	if (c->load <= 0)
		c->load = 1;
	if (c->nobs[n] == 0) {
		c->t[n] = dt / c->load;
	} else {
		double pred = c->load * c->t[n];
		double x = dt > 2 * pred ? 2 * pred : dt < pred / 2 ? pred / 2 : dt;
		double d = x / pred - 1;
		c->rvar = 0.95 * c->rvar + 0.05 * d * d;
		c->load *= 1 + 0.2 * d;
		c->t[n] += 0.3 * (x / c->load - c->t[n]);
	}
	if (c->nobs[n] < UINT32_MAX)
		c->nobs[n]++;
}

double md_spec_ctl_alpha(const struct md_spec_seq *ss)
{
	return (ss->acc_w + 1) / (ss->acc_n + 2);
}

static void judge(struct md_spec_seq *ss, double ok, double trials)
{
	ss->acc_w = ss->acc_w * DECAY + ok;
	ss->acc_n = ss->acc_n * DECAY + trials;
}

void md_spec_ctl_feedback(struct md_spec_seq *ss, uint32_t n_draft, uint32_t n_acc, int32_t first)
{
	if (n_draft) {
		/* n_acc successes, then one failure unless every draft held. */
		judge(ss, n_acc, n_acc + (n_acc < n_draft));
	} else if (ss->shadow >= 0 && first >= 0) {
		judge(ss, first == ss->shadow, 1);
	}
	ss->shadow = -1;
}

/* E(k) = alpha + ... + alpha^k */
static double expect(double a, uint32_t k)
{
	double e = 0, p = 1;
	for (uint32_t j = 0; j < k; j++) {
		p *= a;
		e += p;
	}
	return e;
}

void md_spec_ctl_choose(struct md_spec_ctl *c, struct md_spec_seq *const *ss, uint32_t *k,
			const bool *free_draft, uint32_t n, uint32_t B, double t_round)
{
	c->chosen_steps++;
	if (c->fixed)
		return;
	/* Best acceptance first (selection order over at most max_seqs entries). */
	uint32_t order[256], room[256], m = 0;
	for (uint32_t i = 0; i < n && m < 256; i++)
		order[m++] = i;
	for (uint32_t a = 0; a < m; a++)
		for (uint32_t b = a + 1; b < m; b++)
			if (md_spec_ctl_alpha(ss[order[b]]) > md_spec_ctl_alpha(ss[order[a]])) {
				uint32_t t = order[a];
				order[a] = order[b];
				order[b] = t;
			}
	for (uint32_t i = 0; i < n; i++) {
		room[i < 256 ? i : 255] = i < 256 ? k[i] : 0;
		k[i] = 0;
	}
	/* Grow the plan sequence by sequence while the step's rate rises, every size charged
	 * its upper estimate; then keep it only if it beats plain decode by the margin. */
	double gain = 0, plain = md_spec_ctl_cost(c, B);
	uint32_t extra = 0, rounds = 0;
	for (uint32_t oi = 0; oi < m && plain > 0; oi++) {
		uint32_t i = order[oi];
		double a = md_spec_ctl_alpha(ss[i]);
		double best_rate = (B + gain) / (md_spec_ctl_cost_hi(c, B + extra) + rounds * t_round);
		uint32_t best = 0;
		for (uint32_t kk = 1; kk <= room[i]; kk++) {
			uint32_t r = free_draft[i] || kk < rounds ? rounds : kk;
			double cost = md_spec_ctl_cost_hi(c, B + extra + kk) + r * t_round;
			double rate = (B + gain + expect(a, kk)) / cost;
			if (cost > 0 && rate > best_rate) {
				best_rate = rate;
				best = kk;
			}
		}
		k[i] = best;
		gain += expect(a, best);
		extra += best;
		if (!free_draft[i] && best > rounds)
			rounds = best;
	}
	bool spec = extra > 0 && (B + gain) / (md_spec_ctl_cost_hi(c, B + extra) + rounds * t_round) >
				 MARGIN * B / plain;
	for (uint32_t oi = 0; oi < m; oi++) {
		uint32_t i = order[oi];
		struct md_spec_seq *s = ss[i];
		if (!spec)
			k[i] = 0;
		if (k[i] == 0) {
			/* Probe now and then: one draft re-measures alpha and a step size; the gap
			 * doubles while probes do not lead to speculation. */
			if (s->probe_wait > 0) {
				s->probe_wait--;
			} else if (room[i] > 0) {
				k[i] = 1;
				uint32_t f = free_draft[i] ? 1 : PROBE_COSTLY;
				s->probe_gap = s->probe_gap ? s->probe_gap * 2 : PROBE_MIN * f;
				if (s->probe_gap > PROBE_MAX * f)
					s->probe_gap = PROBE_MAX * f;
				s->probe_wait = s->probe_gap;
			}
			continue;
		}
		s->probe_gap = 0;
		s->probe_wait = PROBE_MIN;
		/* Explore the frontier: a step one token larger than any measured is predicted
		 * pessimistically, so measure it now and then. */
		if (k[i] < room[i] && ++s->explore >= EXPLORE) {
			uint32_t next = B + extra + 1 <= MD_SPEC_CTL_MAXN ? B + extra + 1 : MD_SPEC_CTL_MAXN;
			if (c->nobs[next] < 9) {
				k[i]++;
				extra++;
			}
			s->explore = 0;
		}
	}
	c->spec_steps += spec;
	if (c->trace) {
		fprintf(stderr, "spec-ctl B=%u plain=%.2fms spec=%d extra=%u gain=%.2f cost_hi=%.2fms "
			"rvar=%.3f k0=%u alpha0=%.2f\n", B, plain * 1e3, spec, extra, gain,
			md_spec_ctl_cost_hi(c, B + extra) * 1e3, c->rvar, m ? k[order[0]] : 0,
			m ? md_spec_ctl_alpha(ss[order[0]]) : 0);
		if (c->chosen_steps % 100 == 0)
			for (uint32_t i = 1; i <= 12; i++)
				fprintf(stderr, "spec-ctl   t[%u]=%.2fms n=%u (load %.2f)\n", i,
					c->t[i] * 1e3, c->nobs[i], c->load);
	}
}
