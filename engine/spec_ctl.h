/* The speculation controller: how many tokens each sequence drafts in a step (0 included),
 * from its acceptance history and the measured cost of a step. */
#ifndef MD_SPEC_CTL_H
#define MD_SPEC_CTL_H

/*
 * DESIGN
 * Cost model. A decode step of n tokens reads the dense weights once and every expert its
 * tokens route to once (engine/forward.c groups tokens by expert), so with uniform routing
 * of K of E experts per layer its bytes are
 *
 *     R(n) = W_dense + L * E * (1 - (1 - K/E)^n) * W_expert
 *
 * (W_dense: attention, norms, router, shared expert and output matrix; W_expert: one expert's
 * gate+up+down in one layer; L MoE layers). u(n) = E (1 - (1 - K/E)^n) is the expected number
 * of distinct experts n tokens touch: it grows almost linearly while n K << E and saturates at
 * E, which is why short drafts cost an MoE the most per token and long ones little more than
 * the whole model. Where decode is bound by memory traffic the step's time follows R(n); but
 * every token also costs its own multiply-adds over the dense weights and its K experts, and
 * on a CPU like this project's that work, n times one token's, can pass R(n) after a few
 * tokens: the step turns compute-bound and t(n) grows almost linearly (bench/README.md,
 * "Speculative decoding": on default-1g's q8_0 and 2 cores, 2 and 3 tokens now cost what
 * their bytes do, and consecutive tokens of real text touch more distinct experts than
 * uniform routing says). Where decode is bound by per-step overhead (a tiny model) it is
 * nearly flat. The controller assumes none of these: it measures the cost of decode-only
 * steps per token count and uses R and straight lines only between and beyond measured sizes.
 *
 * Measuring. A step's cost is its critical path: the CPU seconds of the busiest thread of
 * the pool over the pass (md_spec_watch), not the wall clock and not the process's CPU time.
 * On a machine shared with other processes the wall time of a step varies 2x with what the
 * scheduler does; a thread's CPU clock stops while it is preempted. The process's CPU time
 * (used before) counts every thread, so it charged a step by how busy it kept the pool, not by
 * how long it took: at one stream of default-1g a one-token step kept the second thread busy
 * 28-100 % of the time, a multi-token step all of it, and the CPU-time ratio of 2 tokens to 1
 * read 2.7 where the wall time's was 1.6-1.9. (With the forward pass on a device the work is
 * the device's, so there the clock is the wall clock; $MOED_SPEC_PROCESS_CPU brings the
 * process's CPU time back, for A/B.) Each size keeps the mean of its last 9 times, an outlier
 * (a preempted step) counted as their median; sizes are compared only while each was
 * measured lately (RECENT_STEPS), and a speculating engine still runs a plain step every
 * REF_STEPS steps, so the two times a decision weighs are never far apart in time. Between
 * measured sizes the
 * time is interpolated linearly in n; beyond the largest it follows the secant over the
 * measured range (linear from zero with one size measured), never less than R's ratio says:
 * the controller does not count on a speedup it has not seen. A draft model adds its rounds'
 * measured critical paths, each by the rows it runs (md_spec_rounds). The engine measures the sizes one sequence needs (1..k+1 tokens)
 * before it serves (md_spec_ctl_calibrate), and a calibrated size not measured lately is estimated
 * from the calibrated shape scaled by the nearest size measured lately: so a request's first
 * drafts are weighed against known times, not against probes it would pay for.
 *
 * Acceptance model. Each sequence keeps decayed counts of its draft tokens judged and accepted;
 * alpha = (accepted + 1) / (judged + 2) is the chance that a draft token is accepted given the
 * previous one was, so k drafts yield E(k) = alpha + ... + alpha^k extra tokens. The n-gram
 * drafter's counts are kept per class of proposal (engine/spec.h, md_spec_ngram: a phrase
 * seen before, matched on 2, 3 or 4 tokens; a text that already repeated whole; a long
 * agreement), whose acceptance differs (0.70, 0.90, 0.90, 0.95, 0.985 on default-1g's
 * loops): one history would start a loop at the
 * acceptance of the phrases before it and take ~20 steps to learn it, a fifth of a 256-token
 * answer's loop. A class a sequence has not judged yet borrows the counts of the class
 * below it (acceptance rises with the class), and a new sequence starts each class from the
 * engine-wide one. Judgements
 * come from verifications and, for the n-gram drafter, for free: a proposal that was not
 * verified (k = 0) is compared, token by token up to its first mismatch, with the tokens the
 * sequence emits in the next steps (the shadow), and fades the history once, as one
 * verification of it would (judged one token at a time, the history would fade per token and
 * alpha could not pass ~0.88, which is too low for long drafts ever to pay, even in a loop).
 * A new sequence starts from its drafter's engine-wide acceptance, weighted as a few
 * judgements.
 *
 * Choice. One step emits B tokens for its B decoding sequences in time C(B). Sequences are
 * taken best alpha first; each gets the k (0..its room) that most raises the step's tokens per
 * second (B + sum E_i(k_i)) / (C(B + sum k_i) + D), D the drafters' rounds (round j of a
 * drafter has a row for each of its sequences drafting j or more; while the plan grows each
 * drafted position is charged a row's share of a round of all the drafter's candidates, and
 * the finished plan its rounds' own costs), every step size charged one standard error above its mean time (the machine's relative noise over
 * the samples behind it: picking the best of several noisy estimates would otherwise favour
 * the one measured too fast), and never less than plain decode's time plus 0.8 of the measured
 * curve's per-token slope over its upper half for each token the plan adds (step times only
 * grow with their tokens, and that slope is a curve's flattest where it flattens; sizes
 * measured in different stretches of load otherwise show a larger step cheaper than plain
 * decode's, spec_ctl.c tok_floor). A draft model that has not seen a sequence's latest tokens
 * must first catch up on them (its prefill: the whole prompt at a request's first draft);
 * a plan pays that once, spread over the tokens the request may still generate, and a probe
 * pays it whole (md_spec_seq.catchup, horizon). The plan is kept only when it beats plain
 * decode, B / C(B), by a margin (3%); the margin applies to the whole step, so under load
 * many small gains can add up, and a stream is not pushed below plain decode by noise. Under
 * load B is large and C(B + k) - C(B) is what a draft costs everyone: the rule speculates only
 * while that still gains, which on a compute-bound step is never.
 *
 * Probes (what costs when speculation does not pay, so each is gated by could_pay: the
 * drafts could beat plain decode if the unmeasured sizes are as cheap as plausible, cost_opt).
 * An n-gram sequence needs no probe for its acceptance (the shadow); a step size it would
 * need is measured by a frontier probe, one engine-wide per FRONTIER_GAP steps, of the
 * smallest size not measured well. A draft-model sequence is probed with drafts reaching that
 * size, or twice the drafts of its last probe when every one of those held (PROBE_GROW in
 * spec_ctl.c), after probe_gap steps (doubling while probes do not lead to speculation), while it
 * could pay with an optimistic acceptance (its estimate plus 1.5 standard deviations), else
 * only at the longest gap (a new sequence's first probe too), and never where no acceptance
 * could pay; only where its cost (the draft's catch-up included) could be saved over the
 * tokens the request may still generate, were the drafter as good as that optimistic
 * acceptance; and only while an engine-wide credit of 2% of the time of the steps of such
 * sequences covers it (its accepted drafts refunded), so probing a drafter that never pays
 * costs at most that. While speculating, every
 * 8th step of a sequence adds one draft when the next size is not measured well (and every
 * 32nd anyway), which is how k grows where verification is cheap, and sequences left out of
 * a speculating step are probed now and then. tests/unit/test_spec_ctl.c runs it on simulated
 * cost curves (compute-, memory-, overhead- and this CPU's bound) against the best fixed k.
 *
 * Engine thread only.
 */

#include <stdbool.h>
#include <stdint.h>

#include "engine/model.h"
#include "engine/spec.h"

struct md_pool;

#define MD_SPEC_CTL_MAXN 1024 /* token counts measured per step */
#define MD_SPEC_CTL_WINDOW 9  /* step times per size behind its estimate (odd: a median) */
#define MD_SPEC_CTL_DRAFTERS 8 /* drafters (enum md_spec_drafter) with engine-wide acceptance */

/* A drafter's round time by the rows it runs (one per drafting sequence). A round of the
 * draft model or of self-speculation is a forward pass of one row per sequence, and costs
 * more the more sequences draft together, as the target's steps do. The controller once kept
 * one smoothed time per round, whatever its rows, and charged every round that: at 16 streams
 * of default-1g in Q4_K_M on AVX2 (loop workload, bench_spec.py with MOED_SPEC_TRACE) the
 * self-draft passes took 617 ms of wall time where about 265 ms had been charged; charged by
 * rows they took 339 ms against 330 charged. Each drafter times its rounds into one of these
 * (md_spec_rounds_observe); the controller charges a plan's rounds by their rows
 * (md_spec_ctl_round_cost). A row is a token the round feeds: one per drafting sequence, and
 * in the draft model's round 0 also the tokens it catches up on (md_draft_catchup_rows),
 * which a sequence's catch-up is charged as. Engine thread only. */
#define MD_SPEC_ROUND_ROWS 256
struct md_spec_rounds {
	float t[MD_SPEC_ROUND_ROWS + 1]; /* seconds of a round of n rows, smoothed; 0: none timed */
	uint64_t n;                      /* rounds timed */
};

/* A round of rows rows took dt seconds (md_spec_watch). Rows beyond MD_SPEC_ROUND_ROWS are
 * not kept. */
void md_spec_rounds_observe(struct md_spec_rounds *r, uint32_t rows, double dt);
/* The time of a round of one row: measured, or the fewest rows measured (0: none timed). */
double md_spec_rounds_one(const struct md_spec_rounds *r);

struct md_spec_ctl {
	bool fixed;                       /* always draft the most (tests; $MOED_SPEC_FIXED) */
	bool trace;                       /* $MOED_SPEC_TRACE: each decision (spec-ctl) and each
					     judgement of acceptance (spec-judge) on stderr */
	bool one_class;                   /* $MOED_SPEC_ONE_CLASS: n-gram proposals all class 0 */
	double w_dense, w_expert;         /* bytes (see DESIGN) */
	uint32_t n_moe_layers, n_expert, n_used;
	double t[MD_SPEC_CTL_MAXN + 1];   /* CPU seconds of a decode-only step of n tokens: the
					     mean of its last MD_SPEC_CTL_WINDOW times, outliers
					     as their median (spec_ctl.c, window_mean) */
	float win[MD_SPEC_CTL_MAXN + 1][MD_SPEC_CTL_WINDOW]; /* those times, a ring */
	uint8_t win_n[MD_SPEC_CTL_MAXN + 1], win_at[MD_SPEC_CTL_MAXN + 1];
	double rvar;                      /* smoothed squared relative deviation of step times
					     from their size's mean (the machine's noise) */
	uint32_t nobs[MD_SPEC_CTL_MAXN + 1];
	uint64_t last_obs[MD_SPEC_CTL_MAXN + 1]; /* chosen_steps at each size's last measurement */
	uint64_t next_frontier;           /* no frontier probe before this step */
	uint32_t max_n;                   /* the largest size measured */
	double r[MD_SPEC_CTL_MAXN + 1];   /* R(n), bytes */
	double cal[MD_SPEC_CTL_MAXN + 1]; /* CPU seconds measured before serving (0: not) */
	uint64_t chosen_steps, spec_steps; /* steps decided, and those that speculated */
	double probe_credit;              /* seconds the probes of drafters without a shadow may
					     still spend (PROBE_SHARE of the steps; spec_ctl.c) */
	bool credit_open;                 /* probe_credit was opened (full, at the first choice
					     with a plain time: the first probes' catch-up) */
	double g_acc_w[MD_SPEC_CTL_DRAFTERS][MD_SPEC_CLASSES]; /* per drafter and class, decayed */
	double g_acc_n[MD_SPEC_CTL_DRAFTERS][MD_SPEC_CLASSES];
	double round_cost[MD_SPEC_CTL_DRAFTERS][MD_SPEC_ROUND_ROWS + 1]; /* md_spec_ctl_choose's
					     scratch: each drafter's rounds by their rows */
};

void md_spec_ctl_init(struct md_spec_ctl *c, const struct md_model *m, bool fixed);

/* R(n) of the DESIGN, in bytes (from a table; n beyond MD_SPEC_CTL_MAXN as MD_SPEC_CTL_MAXN). */
double md_spec_ctl_bytes(const struct md_spec_ctl *c, uint32_t n);
/* Set the byte model's parameters (md_spec_ctl_init does, from the model; simulations call it
 * with their own) and its table. */
void md_spec_ctl_set_bytes(struct md_spec_ctl *c, double w_dense, double w_expert,
			   uint32_t n_moe_layers, uint32_t n_expert, uint32_t n_used);
/* Predicted seconds of a decode step of n tokens; 0 when nothing is measured yet. */
double md_spec_ctl_cost(const struct md_spec_ctl *c, uint32_t n);
/* The same plus one standard error of the measurement it rests on: what a step of n tokens
 * is charged when choosing to draft, so noisy timings do not make drafting look cheap. */
double md_spec_ctl_cost_hi(const struct md_spec_ctl *c, uint32_t n);
/* A decode-only step of n tokens took dt seconds (md_spec_ctl_clock) in the forward pass. */
void md_spec_ctl_observe(struct md_spec_ctl *c, uint32_t n, double dt);
/* A step of n tokens measured before serving (the engine's calibration): kept as the shape
 * of the cost curve, t(n) = cal(n) * t(m) / cal(m) from the nearest size m measured lately,
 * for a size not measured lately itself; only n = 1 is also observed as above (calibration
 * times and serving times are compared only through their ratios). */
void md_spec_ctl_calibrate(struct md_spec_ctl *c, uint32_t n, double dt);
/* The process's CPU seconds, or the wall clock after md_spec_ctl_use_wall_clock(true): with
 * the forward pass on a device the host waits for the device, asleep or spinning as the
 * runtime likes, so its CPU time says nothing of the step's cost (the engine turns it on when
 * its forward pass runs on a device). Passes are timed with md_spec_watch, which follows the
 * same switch. */
double md_spec_ctl_clock(void);
void md_spec_ctl_use_wall_clock(bool on);

/* A pass's cost as the controller counts it: the wall time after md_spec_ctl_use_wall_clock
 * (true), else the busiest thread of the pool's CPU seconds over the pass (its critical path:
 * preemption by other processes does not count, and a thread idle for lack of work does not
 * add to it, as it would to the process's CPU time). Start it and read it on the thread that
 * runs the pass. */
#define MD_SPEC_WATCH_THREADS 64
struct md_spec_watch {
	const struct md_pool *pool;
	int n;
	double t0[MD_SPEC_WATCH_THREADS];
};
void md_spec_watch_start(struct md_spec_watch *w, const struct md_pool *pool);
double md_spec_watch_read(const struct md_spec_watch *w);

/* The acceptance estimate of a sequence's proposal of class ss->cls. */
double md_spec_ctl_alpha(const struct md_spec_seq *ss);
/* After a step: n_draft drafts (of class ss->cls) were verified and n_acc accepted (n_draft
 * 0: none); first is the first token the step emitted for the sequence (judges the n-gram
 * shadow, of class ss->shadow_cls). Updates the sequence's and its drafter's engine-wide
 * acceptance of that class. */
void md_spec_ctl_feedback(struct md_spec_ctl *c, struct md_spec_seq *ss, uint32_t n_draft,
			  uint32_t n_acc, int32_t first);
/* A new sequence's acceptance history: its drafter's engine-wide acceptance per class,
 * weighted as a few judgements (nothing for a class the drafter has none of). */
void md_spec_ctl_prior(const struct md_spec_ctl *c, struct md_spec_seq *ss);

/* What the controller charges a round of rows rows of the drafter whose rounds are r: as
 * timed; between two timed row counts, linearly; beyond them, the nearest timed one scaled as
 * the target's step of that many tokens is; 0 where r has none timed (or r is NULL). */
double md_spec_ctl_round_cost(const struct md_spec_ctl *c, const struct md_spec_rounds *r,
			      uint32_t rows);
/* What the controller charges a sequence's catch-up of rows tokens (the last one included) in
 * the round 0 of a drafter whose rounds are r: what those rows add to a round of one, 0 for
 * one row or while nothing is timed. */
double md_spec_ctl_catchup_cost(const struct md_spec_ctl *c, const struct md_spec_rounds *r,
				uint32_t rows);
/* What the controller charges a drafter's pass drafting k[i] positions for each of n
 * sequences: its rounds, round j with a row for each sequence drafting j or more. */
double md_spec_ctl_pass_cost(const struct md_spec_ctl *c, const struct md_spec_rounds *r,
			     const uint32_t *k, uint32_t n);

/*
 * Choose k for the n sequences with drafters in a step of B decoding sequences: on entry
 * k[i] is the most sequence i may draft (its room, and for the n-gram drafter the proposal's
 * length), on return what it drafts. The n-gram drafter's proposals cost nothing; any other
 * drafter d runs rounds, one per drafted position, batched over its sequences: round j has a
 * row for each sequence drafting j or more, and costs what rounds[d] says a round of that
 * many rows costs (rounds has MD_SPEC_CTL_DRAFTERS entries, by enum md_spec_drafter; NULL or
 * nothing timed: free, so that the first drafts time it).
 */
void md_spec_ctl_choose(struct md_spec_ctl *c, struct md_spec_seq *const *ss, uint32_t *k,
			const struct md_spec_rounds *const *rounds, uint32_t n, uint32_t B);

#endif
