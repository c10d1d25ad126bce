/* Compute where it lives: the cost model by which the expert store decides, per expert and
 * step, whether an expert that is in host RAM but not on the device runs on the CPU from host
 * memory or is copied up and runs on the device; and the estimator of its rates.
 *
 * DESIGN
 * Model. An expert of b weight bytes with t tokens routed to it costs
 *   on the host (CPU):  T_h = b * (a_h + t * k_h)
 *   on the device:      T_d = b * (a_d + t * k_d), after a copy of b / B_up seconds
 * where a is seconds per weight byte read once (the memory-bound part, what a decode token
 * pays) and k seconds per weight byte per token (the arithmetic, what a long prefill chunk
 * pays). A layer's experts run one after another on the engine thread (the device's matmul is
 * synchronous): first those already on the device, then those the CPU computes, then those
 * copied up for this step, each as soon as its copy is done; the copies are queued on the
 * copy stream when the layer is planned, so they overlap all the work before them. With
 * copies done at C_1 <= C_2 <= ... (cumulative), the layer ends at
 *   end = W, then for each uploaded expert j in order: end = max(end, C_j) + T_d(j)
 * where W is the time of the work before the uploads (device-resident experts plus the CPU
 * ones). The planner starts with every candidate on the CPU and moves them to the device one
 * at a time, the largest compute saving T_h - T_d first, keeping each move that brings the
 * layer's end forward. So a long prefill chunk (large t: the CPU's arithmetic dominates) goes
 * to the device, and a decode token (t = 1) goes there only when the bus copies it faster
 * than the CPU reads it from RAM. Not modelled: what a copy buys later steps (residency is
 * the device policy's business; experts computed on the CPU are still copied up in the
 * background, as before), and contention of the copy stream with those background copies
 * (they are queued after this layer's copies).
 *
 * Rates. a and k of each place are fitted by least squares over recent observations (the
 * forward pass times each run of CPU experts and each device expert and reports their bytes,
 * token-bytes and seconds: md_expert_src observe), each observation's weight decaying by
 * FORGET per new one, with a weak prior on the split between a and k (k = a / tau) that holds
 * while every observation has the same t (single-stream decode). B_up is an average over copies the engine waited for. Priors: host 8 GB/s and a
 * 16-token crossover (k = a / 16), device 200 GB/s and k = a / 256, bus 8 GB/s; a backend
 * probe at start-up (timed copies and matmuls) replaces the device's. Pure functions,
 * unit-tested on their own. */
#ifndef MD_EXPERT_COST_H
#define MD_EXPERT_COST_H

#include <stdbool.h>
#include <stdint.h>

/* Least-squares fit of seconds = a * bytes + k * bytes * tokens (bytes in MiB inside). */
struct md_xcost_fit {
	double s11, s12, s22, s1y, s2y; /* decayed sums of the fit's features (expert_cost.c) */
	double tau;                     /* the prior's crossover: k = a / tau */
	double a, k;                    /* current solution, seconds per MiB (per token) */
	uint64_t n;                     /* observations */
};

struct md_xcost {
	struct md_xcost_fit host, dev;
	double up_s_per_mib;             /* copy time per MiB host -> device */
	uint64_t n_up;                   /* copies measured */
};

/* Priors as in DESIGN; host_bps / dev_bps / up_bps: prior rates in weight bytes per second
 * for one token (0: the defaults). */
void md_xcost_init(struct md_xcost *c, double host_bps, double dev_bps, double up_bps);
/* Replace the device prior by two measured points (probe at start-up): seconds for bytes at
 * t1 and at t2 > t1 tokens. */
void md_xcost_set_dev(struct md_xcost *c, uint64_t bytes, int t1, double s1, int t2, double s2);

/* One observation: experts of bytes weight bytes in total and tok_bytes = sum of bytes * tokens
 * took seconds. dev: on the device, else on the CPU. Observations of 0 bytes or seconds <= 0
 * are ignored. */
void md_xcost_observe(struct md_xcost *c, bool dev, uint64_t bytes, uint64_t tok_bytes,
		      double seconds);
/* A copy of bytes host -> device took seconds. */
void md_xcost_observe_up(struct md_xcost *c, uint64_t bytes, double seconds);

/* Modelled seconds of one expert of bytes with tokens routed to it. */
double md_xcost_host(const struct md_xcost *c, uint64_t bytes, int tokens);
double md_xcost_dev(const struct md_xcost *c, uint64_t bytes, int tokens);
double md_xcost_up(const struct md_xcost *c, uint64_t bytes);

/* A device miss: an expert in host RAM, not on the device. */
struct md_xcost_item {
	uint64_t bytes;
	int tokens;
};

/* The plan of one layer (DESIGN): w0 = seconds of the layer's work that does not depend on
 * the choice (its device-resident experts), items[0..n) the candidates, at most max_up of
 * which may be copied up (free or evictable device slots). Sets up[i] = 1 for those to copy
 * and compute on the device, 0 for the CPU; order[] (n entries) receives the chosen ones'
 * indices in the order their copies should be queued (the rest follow, unspecified). Returns
 * how many were chosen; *end (may be NULL) the modelled end of the layer's expert work. */
int md_xcost_choose(const struct md_xcost *c, double w0, const struct md_xcost_item *items,
		    int n, int max_up, uint8_t *up, int32_t *order, double *end);

#endif
