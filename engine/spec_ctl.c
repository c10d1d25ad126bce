/* The speculation controller (see the DESIGN in spec_ctl.h). */
#include "engine/spec_ctl.h"
#include "engine/kern/threadpool.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define DECAY 0.85      /* per verification: how fast acceptance history fades */
#define MARGIN 1.03     /* predicted gain needed to speculate */
#define PROBE_MIN 4
#define PROBE_MAX 128
/* A draft model's probe costs its rounds and a catch-up on what it missed (up to
 * MD_DRAFT_CATCHUP tokens): probe it 4x less often (measured: at 4 streams of moe64-2g with
 * acceptance 0.4, probing as often as n-gram lookup cost a quarter of the throughput). */
#define PROBE_COSTLY 4
#define EXPLORE 8       /* every this many speculating steps, try one more draft token */
#define EXPLORE_ANYWAY 4 /* ... even where that size is measured, every this many times */
/* Frontier probes for free drafters (n-gram: acceptance is judged for free by the shadow, so
 * only a step size needs measuring): at most one per FRONTIER_GAP steps engine-wide, of the
 * smallest size that could pay (cost_opt) and is not measured well (fresh: FRESH_OBS
 * measurements, the last within RECENT_STEPS). */
#define FRONTIER_GAP 32
#define FRESH_OBS 9
/* A drafter without a shadow (the draft model) is probed only while it could pay with an
 * optimistic acceptance: its estimate plus UCB_SD standard deviations of the Beta posterior
 * behind it (decayed counts), at most ALPHA_MAX. */
#define UCB_SD 1.5
#define ALPHA_MAX 0.95
/* Such a probe judges as many drafts as it sends, and one draft at a time a drafter that is
 * right for long runs (a memorised text) took the whole request to look good enough: at
 * default-1g's step costs a draft must hold with alpha >= 0.8 to pay, which four single
 * accepted drafts (with the prior) only reach as the request ends. So a probe whose drafts
 * were all accepted is followed, PROBE_MIN steps later, by one with PROBE_GROW times as many
 * (up to the k that would pay best were the acceptance ALPHA_MAX), and any rejection starts
 * again from one: a wrong guess costs the length of the last run that held, at most. */
#define PROBE_GROW 2
/* What such probes cost is bounded engine-wide: each step earns PROBE_SHARE of its time as
 * credit, times the share of its sequences whose drafter is probed (a step of plain decode
 * earns none: in a server alternating drafters, as bench_spec.py runs it, the draft model's
 * requests spent the credit the others' steps had filled, more than PROBE_SHARE of their
 * own time), up to PROBE_CREDIT_MAX plain steps, which is also what the engine starts with,
 * so that its first probes need not wait for it), and a probe is sent only when the credit covers
 * its estimate: what its drafts add to the step's time, its draft rounds, and the draft's
 * catch-up on the tokens it missed (md_spec_seq.catchup: the prompt at a request's first
 * probe, the plain steps' tokens since; a plain step's share per sequence when not known).
 * A plan that takes a sequence is charged its catch-up too, spread over the steps the
 * sequence may still run (catchup_share): paid once, it serves all of them. A probe's
 * accepted drafts are refunded (each saved a plain step's share), so the credit bounds the
 * net cost of the probes that fail, probes that hold (growing, PROBE_GROW) pay for
 * themselves, and where the drafter pays a probe leads to speculation, which needs no
 * credit. Measured on default-1g with its draft (which agrees with it on 0-33% of the
 * drafts of the bench's workloads), 48 alternating greedy requests of each: the draft
 * against plain decode 0.97x in tokens per CPU-second on memorised verses without the credit
 * (63 steps verified probes), 0.98x with it (34); with the catch-up charged, 0.99-1.04x at 4
 * and 16 streams where it had been 0.94-0.95x (bench/README.md). */
#define PROBE_SHARE 0.02
/* The most steps a catch-up is spread over in a plan (catchup_share). */
#define CATCHUP_STEPS 32
#define PROBE_CREDIT_MAX 8
/* A new sequence starts from its drafter's engine-wide acceptance (decayed by GLOBAL_DECAY
 * per judgement) as PRIOR_TRIALS judgements: requests are short, and learning acceptance
 * from nothing costs each one its probes. */
#define GLOBAL_DECAY 0.995
#define PRIOR_TRIALS 3.0
/* The n-gram drafter's repeat and long classes hold so reliably (0.96 and 0.995 per token
 * on default-1g's loops) that their engine-wide values are trusted more: a loop's first long
 * proposal starts near its class's 0.995 (weighted as 16 judgements: 0.94), not at 0.8, and
 * drafts long at once; a sequence's own judgements (a shadow of 16 tokens is 16) take over
 * within a few proposals. The short class keeps PRIOR_TRIALS (in the simulation of 16
 * streams at acceptance 0.6, tests/unit/test_spec_ctl.c, a weight of 12-16 there lost 3-4%). */
#define PRIOR_TRIALS_NGRAM 16.0
#define RECENT_STEPS 256 /* a size's time is trusted this many steps after it was measured */
#define REF_STEPS 32    /* a speculating engine runs a plain step at least this often */

static _Atomic int wall_clock; /* md_spec_ctl_use_wall_clock */

void md_spec_ctl_use_wall_clock(bool on)
{
	wall_clock = on;
}

double md_spec_ctl_clock(void)
{
	struct timespec ts;
	clock_gettime(wall_clock ? CLOCK_MONOTONIC : CLOCK_PROCESS_CPUTIME_ID, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int process_cpu = -1; /* $MOED_SPEC_PROCESS_CPU: the process's CPU time (A/B) */

void md_spec_watch_start(struct md_spec_watch *w, const struct md_pool *pool)
{
	w->pool = pool;
	if (process_cpu < 0)
		process_cpu = getenv("MOED_SPEC_PROCESS_CPU") != NULL;
	if (wall_clock || process_cpu) {
		w->n = 0;
		w->t0[0] = md_spec_ctl_clock();
		return;
	}
	w->n = md_pool_thread_cpu(pool, w->t0, MD_SPEC_WATCH_THREADS);
}

double md_spec_watch_read(const struct md_spec_watch *w)
{
	if (w->n == 0)
		return md_spec_ctl_clock() - w->t0[0];
	double now[MD_SPEC_WATCH_THREADS], most = 0;
	int n = md_pool_thread_cpu(w->pool, now, w->n);
	for (int i = 0; i < n; i++)
		if (now[i] - w->t0[i] > most)
			most = now[i] - w->t0[i];
	return most;
}

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
	/* $MOED_SPEC_FIXED: every sequence drafts all it may, every step (the controller's
	 * reference in benchmarks: what always speculating gives) */
	c->fixed = fixed || getenv("MOED_SPEC_FIXED") != NULL;
	c->trace = getenv("MOED_SPEC_TRACE") != NULL;
	/* $MOED_SPEC_ONE_CLASS: one acceptance history for every n-gram proposal (the A/B
	 * reference of the classes) */
	c->one_class = getenv("MOED_SPEC_ONE_CLASS") != NULL;
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
	md_spec_ctl_set_bytes(c, c->w_dense, c->w_expert, c->n_moe_layers, hp->n_expert,
			      hp->n_expert_used);
}

void md_spec_ctl_set_bytes(struct md_spec_ctl *c, double w_dense, double w_expert,
			   uint32_t n_moe_layers, uint32_t n_expert, uint32_t n_used)
{
	c->w_dense = w_dense;
	c->w_expert = w_expert;
	c->n_moe_layers = n_moe_layers;
	c->n_expert = n_expert;
	c->n_used = n_used;
	for (uint32_t n = 0; n <= MD_SPEC_CTL_MAXN; n++) {
		double u = 0;
		if (n_moe_layers && n_expert)
			u = n_expert * (1 - pow(1 - (double)n_used / n_expert, (double)n));
		c->r[n] = w_dense + n_moe_layers * u * w_expert + 1;
	}
}

double md_spec_ctl_bytes(const struct md_spec_ctl *c, uint32_t n)
{
	return c->r[n < MD_SPEC_CTL_MAXN ? n : MD_SPEC_CTL_MAXN];
}

/* The step time of n tokens from the sizes measured lately (see md_spec_ctl_observe). */
/* A size's time is trusted while measured at least twice and lately (see observe). */
static bool measured(const struct md_spec_ctl *c, uint32_t n)
{
	return c->nobs[n] >= 2 && c->chosen_steps - c->last_obs[n] <= RECENT_STEPS;
}

static double shape_cost(const struct md_spec_ctl *c, uint32_t n)
{
	if (n > MD_SPEC_CTL_MAXN)
		n = MD_SPEC_CTL_MAXN;
	if (n == 0)
		n = 1;
	if (measured(c, n))
		return c->t[n];
	/* Calibrated: its measured shape, scaled by the nearest calibrated size measured
	 * lately (below first: plain decode's size is measured all the time). */
	if (c->cal[n] > 0) {
		for (int i = (int)n - 1; i >= 1; i--)
			if (c->cal[i] > 0 && measured(c, (uint32_t)i))
				return c->cal[n] * c->t[i] / c->cal[i];
		for (uint32_t i = n + 1; i <= c->max_n; i++)
			if (c->cal[i] > 0 && measured(c, i))
				return c->cal[n] * c->t[i] / c->cal[i];
	}
	/* The nearest measured sizes below and above, scaled by the byte model between. */
	int lo = -1, hi = -1;
	for (int i = (int)n - 1; i >= 1; i--)
		if (measured(c, (uint32_t)i)) {
			lo = i;
			break;
		}
	for (int i = (int)n + 1; i <= (int)c->max_n; i++)
		if (measured(c, (uint32_t)i)) {
			hi = i;
			break;
		}
	/* Between two measured sizes: linearly in n (what a compute-bound step does; a
	 * memory-bound one is concave, so this never makes a size look cheaper than its
	 * neighbours say). Beyond the largest: along the secant over the measured range (a
	 * concave curve only flattens further; a compute-bound one goes on straight), or with
	 * one size measured as if every token cost as much as a whole step (compute-bound,
	 * the worst case); never less than the byte model says. So sizes not measured yet look
	 * no cheaper than what was seen; the frontier is measured by probes
	 * (md_spec_ctl_choose). Below the smallest: the smallest's time. */
	double r = md_spec_ctl_bytes(c, n);
	if (lo > 0 && hi > 0)
		return c->t[lo] + (double)(n - (uint32_t)lo) / (double)(hi - lo) * (c->t[hi] - c->t[lo]);
	if (lo > 0) {
		double by_bytes = c->t[lo] * r / md_spec_ctl_bytes(c, (uint32_t)lo);
		int s0 = -1;
		for (int i = 1; i < lo; i++)
			if (measured(c, (uint32_t)i)) {
				s0 = i;
				break;
			}
		double ext = c->t[lo] * n / lo;
		if (s0 > 0) {
			double slope = (c->t[lo] - c->t[s0]) / (double)(lo - s0);
			ext = c->t[lo] + (double)(n - (uint32_t)lo) * (slope > 0 ? slope : 0);
		}
		return ext > by_bytes ? ext : by_bytes;
	}
	if (hi > 0)
		return c->t[hi];
	return 0;
}

static bool fresh(const struct md_spec_ctl *c, uint32_t n);

/* The cheapest a step of n tokens may plausibly turn out: a size measured often and lately
 * as measured; any other (a few noisy samples say little) no dearer than the curve of the
 * well-measured sizes continued at half its slope (it may flatten: bound by memory
 * traffic), nor than the byte model from the largest such size below; with one size measured
 * well there is no slope to continue, and the byte model alone says it (a step of as many
 * tokens as every stream's drafts could cost what its bytes do). Probes walk the sizes up
 * while this says they could pay, and stop one size past where the measured curve says not.
 * (With one size the curve was once continued at half a step's time per token, as if
 * compute-bound: with B streams all decoding, plain decode's B is the one size measured, and
 * a draft model's probes then never ran where drafts were cheap and right: a simulated 16
 * streams of a memory-bound model, drafts right 90% of the time, stayed at 1.00x plain decode
 * against 2.88x with the byte model, tests/unit/test_spec_ctl.c.) */
static double cost_opt(const struct md_spec_ctl *c, uint32_t n)
{
	if (n > MD_SPEC_CTL_MAXN)
		n = MD_SPEC_CTL_MAXN;
	double est = shape_cost(c, n);
	if (fresh(c, n))
		return est;
	uint32_t f = 0, f0 = 0;
	for (uint32_t i = n - 1; i >= 1; i--)
		if (fresh(c, i)) {
			if (!f)
				f = i;
			f0 = i;
		}
	if (!f)
		return est;
	double by_bytes = c->t[f] * md_spec_ctl_bytes(c, n) / md_spec_ctl_bytes(c, f);
	if (f0 == f)
		return est > 0 && est < by_bytes ? est : by_bytes;
	double slope = (c->t[f] - c->t[f0]) / (double)(f - f0);
	double opt = c->t[f] + 0.5 * (slope > 0 ? slope : 0) * (double)(n - f);
	if (opt < by_bytes)
		opt = by_bytes;
	return (est > 0 && est < opt ? est : opt);
}

/* The least a plan is charged per token it adds to a step: FLOOR_SHARE of the slope of the
 * measured curve over its upper half (the largest size measured lately, and the one measured
 * lately nearest half of it, at least FLOOR_SPAN below), 0 without two such sizes. Step times
 * only grow with their tokens, and on a curve that flattens (bound by memory traffic: the
 * experts' union saturates) the upper half's slope is the smallest, so a real step's added
 * tokens cost at least that. Sizes measured at different times are not: at 16 streams of
 * default-1g in Q4_K_M on the Zen 3 (bench/README.md) plain decode's 11 tokens stood at 29.8 ms
 * from a slow stretch while 12 tokens, measured since, read 25.4-27.1, and the plan drafted a
 * token for 11 sequences in turn, each step "gaining" by a larger step costing less. */
#define FLOOR_SHARE 0.8
#define FLOOR_SPAN 4
static double tok_floor(const struct md_spec_ctl *c)
{
	uint32_t top = 0, mid = 0;
	for (uint32_t i = c->max_n; i >= 1 && !top; i--)
		if (measured(c, i))
			top = i;
	if (top <= FLOOR_SPAN)
		return 0;
	/* outward from half of it, the smaller size first */
	const uint32_t h = top / 2;
	for (uint32_t d = 0; d <= h && !mid; d++)
		if (d < h && h - d + FLOOR_SPAN <= top && measured(c, h - d))
			mid = h - d;
		else if (h + d + FLOOR_SPAN <= top && measured(c, h + d))
			mid = h + d;
	if (!mid)
		return 0;
	double slope = (c->t[top] - c->t[mid]) / (double)(top - mid);
	return slope > 0 ? FLOOR_SHARE * slope : 0;
}

double md_spec_ctl_cost(const struct md_spec_ctl *c, uint32_t n)
{
	return shape_cost(c, n);
}

double md_spec_ctl_cost_hi(const struct md_spec_ctl *c, uint32_t n)
{
	if (n > MD_SPEC_CTL_MAXN)
		n = MD_SPEC_CTL_MAXN;
	double t = md_spec_ctl_cost(c, n);
	/* The standard error of the nearest measured size at or below n: the machine's relative
	 * noise over the samples behind it (at most the window's MD_SPEC_CTL_WINDOW). */
	for (int i = (int)n; i >= 1; i--)
		if (measured(c, (uint32_t)i)) {
			uint32_t m = c->nobs[i] < MD_SPEC_CTL_WINDOW ? c->nobs[i] : MD_SPEC_CTL_WINDOW;
			return t * (1 + sqrt(c->rvar / m));
		}
	return t;
}

/* A size's time from its window: the mean of its times, each beyond 1.5x the median (or
 * below 1/1.5 of it) counted as the median (a preempted step says nothing of the size). */
static double window_mean(const float *w, uint32_t n)
{
	float s[MD_SPEC_CTL_WINDOW];
	for (uint32_t i = 0; i < n; i++) {
		uint32_t j = i;
		for (; j > 0 && s[j - 1] > w[i]; j--)
			s[j] = s[j - 1];
		s[j] = w[i];
	}
	double med = n % 2 ? s[n / 2] : 0.5 * ((double)s[n / 2 - 1] + s[n / 2]), sum = 0;
	for (uint32_t i = 0; i < n; i++)
		sum += s[i] > 1.5 * med || s[i] < med / 1.5 ? med : s[i];
	return sum / n;
}

static void window_push(struct md_spec_ctl *c, uint32_t n, double dt)
{
	c->win[n][c->win_at[n]] = (float)dt;
	c->win_at[n] = (uint8_t)((c->win_at[n] + 1) % MD_SPEC_CTL_WINDOW);
	if (c->win_n[n] < MD_SPEC_CTL_WINDOW)
		c->win_n[n]++;
}

void md_spec_ctl_observe(struct md_spec_ctl *c, uint32_t n, double dt)
{
	if (n == 0 || n > MD_SPEC_CTL_MAXN || !(dt > 0))
		return;
	/* Each size's time is the mean of its own last MD_SPEC_CTL_WINDOW raw times, those
	 * beyond 1.5x their median counted as the median (window_mean). The clock is a thread's
	 * CPU time (md_spec_watch), so other processes sharing the cores show in it little;
	 * frequency and memory
	 * contention still drift, and a worker preempted mid-step makes the others wait: one
	 * step at twice the usual time (4 streams of default-1g with the bench's client on the
	 * same cores: 51 ms among 21-28) moved a running mean of gain 0.2 by a fifth, and while
	 * the engine speculated, plain decode's size was measured only every REF_STEPS steps,
	 * so the inflated plain time stood for 32 steps and made drafts that lose look 15%
	 * ahead (tests/unit/test_spec_ctl.c, the cases with spikes: 0.97x where this gives
	 * 0.99-1.00x). Sizes are compared only while each was measured lately (measured():
	 * within RECENT_STEPS), and a speculating engine still runs a plain step every
	 * REF_STEPS steps (md_spec_ctl_choose), so the two times a decision weighs are never
	 * far apart. (A load factor times a per-size shape, learned from the same residuals,
	 * was tried: the split drifts, and a size established in other units locked the plan
	 * in: a 36-token step believed as cheap as a 16-token one that cost 2.2x.) */
	if (c->nobs[n] == 0 || c->chosen_steps - c->last_obs[n] > RECENT_STEPS) {
		/* stale: the old value counts once beside the new time */
		c->win_n[n] = c->win_at[n] = 0;
		if (c->nobs[n])
			window_push(c, n, c->t[n]);
	} else {
		double pred = c->t[n];
		double x = dt > 2 * pred ? 2 * pred : dt < pred / 2 ? pred / 2 : dt;
		double d = x / pred - 1;
		c->rvar = 0.95 * c->rvar + 0.05 * d * d;
	}
	window_push(c, n, dt);
	c->t[n] = window_mean(c->win[n], c->win_n[n]);
	if (c->nobs[n] < UINT32_MAX)
		c->nobs[n]++;
	c->last_obs[n] = c->chosen_steps;
	if (n > c->max_n)
		c->max_n = n;
}

void md_spec_ctl_calibrate(struct md_spec_ctl *c, uint32_t n, double dt)
{
	if (n == 0 || n > MD_SPEC_CTL_MAXN || !(dt > 0))
		return;
	c->cal[n] = c->cal[n] > 0 ? 0.5 * (c->cal[n] + dt) : dt;
	/* Only plain decode's size is observed: the others count through their ratio to it.
	 * Back-to-back calibration steps cost more CPU time than serving steps of the same
	 * size (default-1g, 1 token: 6.7-7.8 ms against a serving median of 5.6-5.8), so
	 * calibrated times beside live ones made every draft look up to 1.4x dearer than the
	 * calibration's own shape says. */
	if (n == 1)
		for (int i = 0; i < 2; i++) /* a median of passes: as measured() wants it */
			md_spec_ctl_observe(c, n, dt);
}

static bool fresh(const struct md_spec_ctl *c, uint32_t n)
{
	if (n > MD_SPEC_CTL_MAXN)
		return true;
	return c->nobs[n] >= FRESH_OBS && measured(c, n);
}

/* The counts behind class cls's estimate: its own, or while it has none, the class below's. */
static uint32_t counts_of(const struct md_spec_seq *ss, uint32_t cls)
{
	if (cls >= MD_SPEC_CLASSES)
		cls = 0;
	while (cls > 0 && ss->acc_n[cls] <= 0)
		cls--;
	return cls;
}

double md_spec_ctl_alpha(const struct md_spec_seq *ss)
{
	uint32_t c = counts_of(ss, ss->cls);
	return (ss->acc_w[c] + 1) / (ss->acc_n[c] + 2);
}

/* cls < MD_SPEC_CLASSES (md_spec_ctl_feedback checks it) */
static void judge(struct md_spec_seq *ss, uint32_t cls, double ok, double trials, double decay)
{
	uint32_t from = counts_of(ss, cls); /* a class's first judgement starts from the borrowed */
	ss->acc_w[cls] = ss->acc_w[from] * decay + ok;
	ss->acc_n[cls] = ss->acc_n[from] * decay + trials;
}

void md_spec_ctl_feedback(struct md_spec_ctl *c, struct md_spec_seq *ss, uint32_t n_draft,
			  uint32_t n_acc, int32_t first)
{
	double ok = 0, trials = 0, decay = DECAY;
	uint32_t cls = ss->cls;
	if (n_draft) {
		/* n_acc successes, then one failure unless every draft held. */
		ok = n_acc;
		trials = n_acc + (n_acc < n_draft);
		ss->n_shadow = 0;
	} else if (ss->n_shadow && first >= 0) {
		/* A shadow is judged as a verification of the whole proposal would have been,
		 * up to its first mismatch, one token per step as the sequence emits them:
		 * the history fades once per proposal (as once per verification), and each
		 * token counts when it comes. */
		bool held = first == ss->shadow[ss->shadow_at];
		decay = ss->shadow_at == 0 ? DECAY : 1;
		cls = ss->shadow_cls;
		ok = held;
		trials = 1;
		ss->shadow_at += held;
		if (!held || ss->shadow_at == ss->n_shadow)
			ss->n_shadow = 0;
	}
	if (ss->probe_sent) {
		/* Probes of a drafter without a shadow grow while they hold (PROBE_GROW). */
		ss->probe_sent = false;
		c->probe_credit += n_acc * ss->probe_value;
		if (n_draft && n_acc == n_draft) {
			ss->probe_k = PROBE_GROW * n_draft;
			ss->probe_wait = PROBE_MIN;
		} else {
			ss->probe_k = 0;
		}
	}
	if (trials == 0)
		return;
	if (cls >= MD_SPEC_CLASSES)
		cls = 0;
	judge(ss, cls, ok, trials, decay);
	if (c->trace)
		fprintf(stderr, "spec-judge cls=%u ok=%.0f trials=%.0f verify=%d\n", cls, ok, trials,
			n_draft > 0);
	if (ss->drafter < MD_SPEC_CTL_DRAFTERS) {
		double *gw = &c->g_acc_w[ss->drafter][cls], *gn = &c->g_acc_n[ss->drafter][cls];
		*gw = *gw * GLOBAL_DECAY + ok;
		*gn = *gn * GLOBAL_DECAY + trials;
	}
}

void md_spec_ctl_prior(const struct md_spec_ctl *c, struct md_spec_seq *ss)
{
	if (ss->drafter >= MD_SPEC_CTL_DRAFTERS)
		return;
	for (uint32_t cl = 0; cl < MD_SPEC_CLASSES; cl++) {
		double n = c->g_acc_n[ss->drafter][cl];
		if (n < 1)
			continue;
		/* Smoothed, and weighted by no more judgements than it rests on: one rejected
		 * probe does not start every later request at alpha 0.2. */
		double a = (c->g_acc_w[ss->drafter][cl] + 1) / (n + 2);
		double cap = ss->drafter == MD_SPEC_NGRAM && cl > MD_SPEC_CLS_SHORT
			     ? PRIOR_TRIALS_NGRAM : PRIOR_TRIALS;
		double w = n < cap ? n : cap;
		ss->acc_w[cl] = a * w;
		ss->acc_n[cl] = w;
	}
}

static double alpha_ucb(const struct md_spec_seq *ss)
{
	double m = md_spec_ctl_alpha(ss);
	double u = m + UCB_SD * sqrt(m * (1 - m) / (ss->acc_n[counts_of(ss, ss->cls)] + 3));
	return u < ALPHA_MAX ? u : ALPHA_MAX;
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

/* The n-gram drafter's proposals cost nothing and are judged without verification. */
static bool is_free(const struct md_spec_seq *ss)
{
	return ss->drafter == MD_SPEC_NGRAM;
}

static unsigned drafter_of(const struct md_spec_seq *ss)
{
	return (unsigned)ss->drafter < MD_SPEC_CTL_DRAFTERS ? (unsigned)ss->drafter : 0;
}

void md_spec_rounds_observe(struct md_spec_rounds *r, uint32_t rows, double dt)
{
	if (rows == 0 || rows > MD_SPEC_ROUND_ROWS || !(dt > 0))
		return;
	r->t[rows] = r->t[rows] > 0 ? (float)(0.8 * r->t[rows] + 0.2 * dt) : (float)dt;
	r->n++;
}

double md_spec_rounds_one(const struct md_spec_rounds *r)
{
	if (!r || r->n == 0)
		return 0;
	for (uint32_t i = 1; i <= MD_SPEC_ROUND_ROWS; i++)
		if (r->t[i] > 0)
			return r->t[i];
	return 0;
}

/* What a drafter's round of rows rows costs: as timed; between two timed row counts, linearly;
 * beyond those timed, the nearest timed one scaled as the target's step of that many tokens
 * is (a draft round is a forward pass of one row per sequence, and self-speculation's is the
 * target's own with fewer experts): above the largest timed by the step costs the controller
 * predicts (shape_cost, never below the timed one), below the smallest by the steps' measured
 * or calibrated shape, else by the byte model (never above the timed one: a round of fewer
 * rows is not charged a larger one's time, which would keep the drafter from a lone
 * sequence's drafts and so from ever timing one). 0 where the drafter has timed no round:
 * free, so the first drafts time it. */
double md_spec_ctl_round_cost(const struct md_spec_ctl *c, const struct md_spec_rounds *r,
			      uint32_t rows)
{
	if (!r || r->n == 0 || rows == 0)
		return 0;
	if (rows > MD_SPEC_ROUND_ROWS)
		rows = MD_SPEC_ROUND_ROWS;
	if (r->t[rows] > 0)
		return r->t[rows];
	uint32_t lo = 0, hi = 0;
	for (uint32_t i = rows - 1; i >= 1 && !lo; i--)
		if (r->t[i] > 0)
			lo = i;
	for (uint32_t i = rows + 1; i <= MD_SPEC_ROUND_ROWS && !hi; i++)
		if (r->t[i] > 0)
			hi = i;
	if (lo && hi)
		return r->t[lo] + (double)(rows - lo) / (double)(hi - lo) * (r->t[hi] - r->t[lo]);
	if (lo) {
		double a = shape_cost(c, rows), b = shape_cost(c, lo);
		double g = a > 0 && b > 0 ? a / b : (double)rows / (double)lo;
		return r->t[lo] * (g > 1 ? g : 1);
	}
	if (!hi)
		return 0;
	double g;
	if (measured(c, rows) && measured(c, hi))
		g = c->t[rows] / c->t[hi];
	else if (c->cal[rows] > 0 && c->cal[hi] > 0)
		g = c->cal[rows] / c->cal[hi];
	else
		g = md_spec_ctl_bytes(c, rows) / md_spec_ctl_bytes(c, hi);
	return r->t[hi] * (g < 1 ? g : 1);
}

double md_spec_ctl_pass_cost(const struct md_spec_ctl *c, const struct md_spec_rounds *r,
			     const uint32_t *k, uint32_t n)
{
	double t = 0;
	for (uint32_t j = 1;; j++) {
		uint32_t rows = 0;
		for (uint32_t i = 0; i < n; i++)
			rows += k[i] >= j;
		if (rows == 0)
			return t;
		t += md_spec_ctl_round_cost(c, r, rows);
	}
}

double md_spec_ctl_catchup_cost(const struct md_spec_ctl *c, const struct md_spec_rounds *r,
				uint32_t rows)
{
	if (rows <= 1)
		return 0;
	double more = md_spec_ctl_round_cost(c, r, rows) - md_spec_ctl_round_cost(c, r, 1);
	return more > 0 ? more : 0;
}

/* The best rate (tokens per second of a step of B sequences) that drafting k = 1..room for one
 * sequence with acceptance a could reach, every unmeasured size as cheap as the byte model
 * allows (cost_opt), drafts at t_round seconds a round; the k that reaches it in *k (1 when
 * none does). */
static double best_rate(const struct md_spec_ctl *c, double a, uint32_t room, uint32_t B,
			double t_round, uint32_t *k)
{
	double best = 0;
	*k = 1;
	for (uint32_t kk = 1; kk <= room; kk++) {
		double cost = cost_opt(c, B + kk) + kk * t_round;
		double rate = cost > 0 ? (B + expect(a, kk)) / cost : 0;
		if (rate > best) {
			best = rate;
			*k = kk;
		}
	}
	return best;
}

/* What a plan is charged per step for the catch-up drafting this sequence needs first: the
 * catch-up is paid once and serves every step it drafts in after, so it is spread over the
 * steps the sequence may still run (at most CATCHUP_STEPS: a request may end before its
 * max_tokens). */
static double catchup_share(const struct md_spec_seq *s)
{
	uint32_t h = s->horizon ? s->horizon : 1;
	return s->catchup / (h < CATCHUP_STEPS ? h : CATCHUP_STEPS);
}

/* What the plan charges a step of B + x tokens: its upper estimate, and for x > 0 no less than
 * plain decode's B tokens (plain, their measured time) plus per_tok per added token (tok_floor). */
static double step_hi(const struct md_spec_ctl *c, uint32_t B, uint32_t x, double plain,
		      double per_tok)
{
	double t = md_spec_ctl_cost_hi(c, B + x);
	return x > 0 && t < plain + x * per_tok ? plain + x * per_tok : t;
}

/* Whether drafting for a sequence with acceptance a could beat plain decode at all. */
static bool could_pay(const struct md_spec_ctl *c, double a, uint32_t room, bool free_draft,
		      uint32_t B, double t_round, double plain)
{
	uint32_t k;
	return best_rate(c, a, room, B, free_draft ? 0 : t_round, &k) > MARGIN * B / plain;
}

void md_spec_ctl_choose(struct md_spec_ctl *c, struct md_spec_seq *const *ss, uint32_t *k,
			const struct md_spec_rounds *const *rounds_of, uint32_t n, uint32_t B)
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
	uint32_t n_probing = 0; /* sequences whose drafter is probed (no shadow) */
	for (uint32_t i = 0; i < n; i++) {
		room[i < 256 ? i : 255] = i < 256 ? k[i] : 0;
		n_probing += k[i] > 0 && !is_free(ss[i]);
		k[i] = 0;
	}
	/* Nothing measured yet: plain steps first (they measure C(B)). */
	double plain = md_spec_ctl_cost(c, B);
	if (!(plain > 0))
		return;
	if (!c->credit_open) {
		c->probe_credit = PROBE_CREDIT_MAX * plain;
		c->credit_open = true;
	}
	/* Earned by the sequences that may be probed, in proportion to their share of the step:
	 * a step of plain or n-gram sequences earns nothing for the draft model's probes. */
	c->probe_credit += PROBE_SHARE * plain * n_probing / (B ? B : 1);
	if (c->probe_credit > PROBE_CREDIT_MAX * plain)
		c->probe_credit = PROBE_CREDIT_MAX * plain;
	/* Grow the plan sequence by sequence while the step's rate rises, every size charged
	 * its upper estimate; then keep it only if it beats plain decode by the margin. */
	double gain = 0;
	/* Draft rounds: each drafter runs max(its k) of them, batched over its sequences,
	 * round j with a row for each sequence drafting j or more (rows[d][j - 1]). A round
	 * of r rows costs rc[d][r] (0 for an untimed drafter). While the plan grows, each
	 * drafted position is charged a row's share of a round with every sequence of its
	 * drafter that may draft (share[d]): a round costs less per row the more rows it has,
	 * and charged at the margin the first sequence would pay for the whole round and none
	 * would join. The plan is then judged at what its rounds cost (t_exact). */
	uint32_t extra = 0, rows[MD_SPEC_CTL_DRAFTERS][MD_SPEC_MAX_K] = { { 0 } };
	double t_rounds = 0; /* the rounds' cost while growing, summed over the drafters */
	double (*rc)[MD_SPEC_ROUND_ROWS + 1] = c->round_cost;
	double share[MD_SPEC_CTL_DRAFTERS] = { 0 };
	uint32_t cands[MD_SPEC_CTL_DRAFTERS] = { 0 };
	for (uint32_t i = 0; i < m; i++)
		if (!is_free(ss[i]) && room[i] > 0)
			cands[drafter_of(ss[i])]++;
	for (unsigned d = 0; d < MD_SPEC_CTL_DRAFTERS; d++) {
		if (!cands[d])
			continue;
		for (uint32_t r = 0; r <= cands[d]; r++)
			rc[d][r] = md_spec_ctl_round_cost(c, rounds_of ? rounds_of[d] : NULL, r);
		share[d] = rc[d][cands[d]] / cands[d];
	}
	const double per_tok = tok_floor(c);
	double cu_plan = 0; /* the catch-up shares of the sequences in the plan */
	for (uint32_t oi = 0; oi < m; oi++) {
		uint32_t i = order[oi];
		double a = md_spec_ctl_alpha(ss[i]);
		const unsigned dr = drafter_of(ss[i]);
		const double tr = is_free(ss[i]) ? 0 : share[dr];
		double best_rate = (B + gain) / (step_hi(c, B, extra, plain, per_tok) + t_rounds);
		uint32_t best = 0;
		for (uint32_t kk = 1; kk <= room[i]; kk++) {
			double more = kk * tr + catchup_share(ss[i]);
			double cost = step_hi(c, B, extra + kk, plain, per_tok) + t_rounds + more;
			double rate = (B + gain + expect(a, kk)) / cost;
			if (cost > 0 && rate > best_rate) {
				best_rate = rate;
				best = kk;
			}
		}
		k[i] = best;
		gain += expect(a, best);
		extra += best;
		if (best > 0) {
			t_rounds += best * tr + catchup_share(ss[i]);
			cu_plan += catchup_share(ss[i]);
			for (uint32_t j = 0; j < best && j < MD_SPEC_MAX_K; j++)
				rows[dr][j]++;
		}
	}
	double t_exact = cu_plan;
	for (unsigned d = 0; d < MD_SPEC_CTL_DRAFTERS; d++)
		for (uint32_t j = 0; cands[d] && j < MD_SPEC_MAX_K && rows[d][j]; j++)
			t_exact += rc[d][rows[d][j]];
	bool spec = extra > 0 && (B + gain) / (step_hi(c, B, extra, plain, per_tok) + t_exact) >
				 MARGIN * B / plain;
	/* Keep plain decode's time current: the reference every decision compares with. */
	if (spec && c->chosen_steps - c->last_obs[B < MD_SPEC_CTL_MAXN ? B : MD_SPEC_CTL_MAXN] > REF_STEPS)
		spec = false;
	/* A free sequence whose speculation could pay with a step size not measured lately:
	 * probes the smallest such size. */
	int frontier = -1;
	uint32_t frontier_k = 0;
	for (uint32_t oi = 0; oi < m; oi++) {
		uint32_t i = order[oi];
		struct md_spec_seq *s = ss[i];
		if (!spec)
			k[i] = 0;
		if (k[i] == 0) {
			if (room[i] == 0)
				continue;
			if (is_free(s) && spec) {
				/* In a step that speculates anyway, a sequence left out is probed
				 * now and then (one draft more on an already larger step): that
				 * measures the sizes around the plan. */
				if (s->probe_wait > 0) {
					s->probe_wait--;
				} else if (could_pay(c, md_spec_ctl_alpha(s), room[i], true, B + extra, 0, plain)) {
					k[i] = 1;
					s->probe_gap = s->probe_gap ? s->probe_gap * 2 : PROBE_MIN;
					if (s->probe_gap > PROBE_MAX)
						s->probe_gap = PROBE_MAX;
					s->probe_wait = s->probe_gap;
				}
				continue;
			}
			if (is_free(s)) {
				/* The shadow judges its proposals; only a step size may need measuring. */
				if (frontier < 0 && c->chosen_steps >= c->next_frontier &&
				    could_pay(c, md_spec_ctl_alpha(s), room[i], true, B, 0, plain)) {
					uint32_t kk = 1;
					while (kk <= room[i] && fresh(c, B + kk))
						kk++;
					if (kk <= room[i]) {
						frontier = (int)i;
						frontier_k = kk;
					}
				}
				continue;
			}
			/* No shadow: a probe (one draft) re-measures alpha, now and then, while
			 * drafting could pay with a good acceptance at all; the gap doubles while
			 * probes do not lead to speculation. */
			const double tr = md_spec_ctl_round_cost(c, rounds_of ? rounds_of[drafter_of(s)] : NULL, 1);
			/* the acceptance the probe hopes for: what this sequence has shown, at
			 * its upper estimate, or for the rare re-check the most any drafter gets */
			double hope = alpha_ucb(s);
			if (!could_pay(c, hope, room[i], false, B, tr, plain)) {
				/* Not by what this sequence has shown: only the rare re-check (its text
				 * may change), and not at all where no acceptance could pay. */
				hope = ALPHA_MAX;
				if (!could_pay(c, hope, room[i], false, B, tr, plain))
					continue;
				/* A new sequence waits that long for its first probe too: a probe
				 * at a request's first step pays the draft's catch-up on the whole
				 * prompt (default-1g's draft: 19 rows, 4-7 ms, 1.5 plain steps), and
				 * one per 64-token request cost the draft model 3-4% of plain decode
				 * where its engine-wide acceptance (0.45) says it cannot pay. */
				if (s->drafted == 0 && s->probe_gap == 0)
					s->probe_wait = PROBE_MAX * PROBE_COSTLY / 2;
				s->probe_gap = PROBE_MAX * PROBE_COSTLY / 2;
				if (s->probe_wait > PROBE_MAX * PROBE_COSTLY)
					s->probe_wait = PROBE_MAX * PROBE_COSTLY;
			}
			if (s->probe_wait > 0) {
				s->probe_wait--;
			} else {
				/* One draft, or as many as reach the smallest size not measured well
				 * (the size the plan would need next). */
				uint32_t kk = 1;
				while (kk < room[i] && fresh(c, B + kk))
					kk++;
				kk = fresh(c, B + kk) ? 1 : kk;
				if (s->probe_k > kk) {
					/* the grown probe, no longer than would pay best */
					uint32_t top;
					best_rate(c, ALPHA_MAX, room[i], B, tr, &top);
					uint32_t want = s->probe_k < top ? s->probe_k : top;
					kk = want > kk ? want : kk;
				}
				/* A draft that must first catch up (a long prompt) is probed with one
				 * draft: the catch-up is most of the probe's price, and the next
				 * probes, grown or at a larger size, find it caught up. */
				if (s->catchup > plain && s->probe_k <= 1)
					kk = 1;
				const uint32_t base = B + (spec ? extra : 0);
				const double cu = s->catchup > 0 ? s->catchup : plain / B;
				double est;
				/* Fewer drafts where the credit does not cover these: a catch-up grows
				 * every step the draft waits, faster than the credit, so a smaller
				 * probe now beats a larger one never. */
				for (;; kk--) {
					est = md_spec_ctl_cost(c, base + kk) - md_spec_ctl_cost(c, base) +
					      kk * tr + cu;
					if (kk == 1 || est <= c->probe_credit)
						break;
				}
				/* No probe that could not pay for itself even if the drafter
				 * turned out as good as hoped (hope): over the tokens the request
				 * may still generate, each a sequence's share of a plain step made
				 * cheaper by the best gain that acceptance allows. A catch-up grows
				 * while the draft waits and the horizon shrinks: at 3 streams of
				 * default-1g, probes 40-60 tokens into 64-token requests caught up on
				 * 100 rows (28-37 ms) to save at most ~15 ms. */
				uint32_t top;
				double g = best_rate(c, hope, room[i], B, tr, &top) * plain / B - 1;
				double h = s->horizon ? s->horizon : CATCHUP_STEPS;
				if (!(g > 0) || est > h * plain / B * g / (1 + g)) {
					s->probe_wait = s->probe_gap;
					continue;
				}
				/* A probe dearer than the most credit can hold (a long prompt to
				 * catch up on) goes only with the credit full, and leaves it in debt. */
				double cap = PROBE_CREDIT_MAX * plain;
				if (est > c->probe_credit && !(est > cap && c->probe_credit >= cap))
					continue; /* the next step, with more credit */
				c->probe_credit -= est;
				k[i] = kk;
				s->probe_sent = true;
				s->probe_value = plain / B;
				s->probe_gap = s->probe_gap ? s->probe_gap * 2 : PROBE_MIN * PROBE_COSTLY;
				if (s->probe_gap > PROBE_MAX * PROBE_COSTLY)
					s->probe_gap = PROBE_MAX * PROBE_COSTLY;
				s->probe_wait = s->probe_gap;
				if (c->trace)
					fprintf(stderr, "spec-probe drafter=%u B=%u k=%u alpha=%.2f "
						"hope=%.2f est=%.2fms credit=%.2fms catchup=%.2fms "
						"next_gap=%u\n", drafter_of(s), B, kk,
						md_spec_ctl_alpha(s), hope, est * 1e3,
						c->probe_credit * 1e3, s->catchup * 1e3, s->probe_gap);
			}
			continue;
		}
		s->probe_gap = 0;
		s->probe_wait = PROBE_MIN;
		/* Explore the frontier: a step one token larger than any measured is predicted
		 * pessimistically, so measure it now and then. */
		if (k[i] < room[i] && ++s->explore % EXPLORE == 0) {
			/* The next size while it is not measured well, and every EXPLORE_ANYWAY-th
			 * time anyway (a size estimated too dear by noise would stay untried). */
			uint32_t next = B + extra + 1 <= MD_SPEC_CTL_MAXN ? B + extra + 1 : MD_SPEC_CTL_MAXN;
			if (!fresh(c, next) || s->explore % (EXPLORE * EXPLORE_ANYWAY) == 0) {
				k[i]++;
				extra++;
			}
		}
	}
	if (!spec && frontier >= 0) {
		k[frontier] = frontier_k;
		c->next_frontier = c->chosen_steps + FRONTIER_GAP;
	}
	c->spec_steps += spec;
	if (c->trace) {
		fprintf(stderr, "spec-ctl B=%u plain=%.2fms spec=%d extra=%u gain=%.2f cost_hi=%.2fms "
			"rvar=%.3f k0=%u cls0=%u alpha0=%.2f room0=%u hi+1=%.2fms hi+4=%.2fms\n", B,
			plain * 1e3, spec, extra, gain, md_spec_ctl_cost_hi(c, B + extra) * 1e3, c->rvar,
			m ? k[order[0]] : 0, m ? ss[order[0]]->cls : 0,
			m ? md_spec_ctl_alpha(ss[order[0]]) : 0,
			m ? room[order[0]] : 0, md_spec_ctl_cost_hi(c, B + 1) * 1e3,
			md_spec_ctl_cost_hi(c, B + 4) * 1e3);
		if (c->chosen_steps % 100 == 0)
			for (uint32_t i = 1; i <= 12; i++)
				fprintf(stderr, "spec-ctl   t[%u]=%.2fms n=%u\n", i, c->t[i] * 1e3,
					c->nobs[i]);
	}
}
