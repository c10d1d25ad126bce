/* The compute-where-it-lives cost model and its rate estimator (expert_cost.h). */
#include "engine/expert_cost.h"

#include <stdlib.h>
#include <string.h>

#define MIB 1048576.0
#define FORGET 0.99      /* weight kept by an observation per newer one: ~100 recent ones */
#define PRIOR_W 1.0      /* weight of the ridge that keeps the prior split (see fit_init) */
#define UP_FORGET 0.9    /* copies: the average over ~10 recent ones */

/* The fit (DESIGN, Rates) in the parameters a and d = k - a / tau: seconds = a * z1 + d * z2
 * with z1 = x1 + x2 / tau (the cost if arithmetic kept its prior share) and z2 = x2, and a
 * ridge term that pulls d to 0 with the weight of one 16-MiB-token observation. So
 * observations at one token count (collinear x1, x2) fix the cost at that count and the
 * prior's tau the split; observations at several counts override tau. Until the first
 * observation the prior's a stands. */
static void fit_init(struct md_xcost_fit *f, double bps, double tau)
{
	memset(f, 0, sizeof(*f));
	f->tau = tau;
	f->a = MIB / bps * tau / (tau + 1); /* a + a / tau = seconds per MiB at one token */
	f->k = f->a / tau;
}

static void fit_solve(struct md_xcost_fit *f)
{
	const double mu = PRIOR_W * 16.0 * 16.0;
	double s11 = f->s11, s12 = f->s12, s22 = f->s22 + mu;
	double det = s11 * s22 - s12 * s12;
	if (s11 <= 0 || det <= 0)
		return;
	double a = (f->s1y * s22 - f->s2y * s12) / det, d = (f->s2y * s11 - f->s1y * s12) / det;
	double k = a / f->tau + d;
	if (a < 0 || k < 0) { /* outside the model: the prior's split, scaled to the data */
		a = f->s1y / s11 > 0 ? f->s1y / s11 : 0;
		k = a / f->tau;
	}
	f->a = a;
	f->k = k;
}

static void fit_add(struct md_xcost_fit *f, double x1, double x2, double y)
{
	double z1 = x1 + x2 / f->tau, z2 = x2;
	f->s11 = f->s11 * FORGET + z1 * z1;
	f->s12 = f->s12 * FORGET + z1 * z2;
	f->s22 = f->s22 * FORGET + z2 * z2;
	f->s1y = f->s1y * FORGET + z1 * y;
	f->s2y = f->s2y * FORGET + z2 * y;
	f->n++;
	fit_solve(f);
}

void md_xcost_init(struct md_xcost *c, double host_bps, double dev_bps, double up_bps)
{
	memset(c, 0, sizeof(*c));
	fit_init(&c->host, host_bps > 0 ? host_bps : 8e9, 16);
	fit_init(&c->dev, dev_bps > 0 ? dev_bps : 200e9, 256);
	c->up_s_per_mib = MIB / (up_bps > 0 ? up_bps : 8e9);
}

void md_xcost_set_dev(struct md_xcost *c, uint64_t bytes, int t1, double s1, int t2, double s2)
{
	struct md_xcost_fit *f = &c->dev;
	double x1 = (double)bytes / MIB;
	if (x1 <= 0 || t2 <= t1 || s1 <= 0 || s2 <= 0)
		return;
	/* the two points, solved exactly, as the new prior */
	double k = (s2 - s1) / (x1 * (t2 - t1)), a = s1 / x1 - k * t1;
	if (k < 0)
		k = 0;
	if (a < 0)
		a = 0;
	double tau = k > 0 && a / k < 1e9 ? a / k : 1e9;
	fit_init(f, MIB / (a + k), tau);
	f->a = a;
	f->k = k;
}

void md_xcost_observe(struct md_xcost *c, bool dev, uint64_t bytes, uint64_t tok_bytes,
		      double seconds)
{
	if (bytes == 0 || seconds <= 0)
		return;
	fit_add(dev ? &c->dev : &c->host, (double)bytes / MIB, (double)tok_bytes / MIB, seconds);
}

void md_xcost_observe_up(struct md_xcost *c, uint64_t bytes, double seconds)
{
	if (bytes == 0 || seconds <= 0)
		return;
	double v = seconds / ((double)bytes / MIB);
	c->up_s_per_mib = c->n_up ? c->up_s_per_mib * UP_FORGET + v * (1 - UP_FORGET) : v;
	c->n_up++;
}

double md_xcost_host(const struct md_xcost *c, uint64_t bytes, int tokens)
{
	return (double)bytes / MIB * (c->host.a + tokens * c->host.k);
}

double md_xcost_dev(const struct md_xcost *c, uint64_t bytes, int tokens)
{
	return (double)bytes / MIB * (c->dev.a + tokens * c->dev.k);
}

double md_xcost_up(const struct md_xcost *c, uint64_t bytes)
{
	return (double)bytes / MIB * c->up_s_per_mib;
}

/* The layer's end with the first n_up of order[] copied up (in that order) and the rest on
 * the CPU (DESIGN). */
static double layer_end(const struct md_xcost *c, double w0, const struct md_xcost_item *it,
			int n, const uint8_t *up, const int32_t *order, int n_up)
{
	double w = w0;
	for (int i = 0; i < n; i++)
		if (!up[i])
			w += md_xcost_host(c, it[i].bytes, it[i].tokens);
	double end = w, copied = 0;
	for (int j = 0; j < n_up; j++) {
		const struct md_xcost_item *x = &it[order[j]];
		copied += md_xcost_up(c, x->bytes);
		end = (end > copied ? end : copied) + md_xcost_dev(c, x->bytes, x->tokens);
	}
	return end;
}

struct cand {
	int32_t i;
	double saving;
};

static int by_saving(const void *a, const void *b)
{
	const struct cand *x = a, *y = b;
	return x->saving > y->saving ? -1 : x->saving < y->saving ? 1 : x->i - y->i;
}

int md_xcost_choose(const struct md_xcost *c, double w0, const struct md_xcost_item *items,
		    int n, int max_up, uint8_t *up, int32_t *order, double *end)
{
	memset(up, 0, (size_t)(n > 0 ? n : 0));
	struct cand *cd = n > 0 ? malloc(sizeof(*cd) * (size_t)n) : NULL;
	int nc = 0;
	for (int i = 0; cd && i < n; i++) {
		double s = md_xcost_host(c, items[i].bytes, items[i].tokens) -
			   md_xcost_dev(c, items[i].bytes, items[i].tokens);
		if (s > 0)
			cd[nc++] = (struct cand){ i, s };
	}
	if (nc > 1)
		qsort(cd, (size_t)nc, sizeof(*cd), by_saving);
	int n_up = 0;
	double best = layer_end(c, w0, items, n, up, order, 0);
	for (int j = 0; j < nc && n_up < max_up; j++) {
		int32_t i = cd[j].i;
		up[i] = 1;
		order[n_up] = i;
		double e = layer_end(c, w0, items, n, up, order, n_up + 1);
		if (e < best) {
			best = e;
			n_up++;
		} else {
			up[i] = 0;
		}
	}
	free(cd);
	int k = n_up;
	for (int i = 0; i < n; i++)
		if (!up[i])
			order[k++] = i;
	if (end)
		*end = best;
	return n_up;
}
