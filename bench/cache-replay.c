/* cache-replay: replay a routing trace against every expert-cache policy at budgets from 10% to
 * 100% of the experts, beside Belady's optimal, with the prefetch accuracy of simple
 * predictors; optionally draw hit rate against budget as an SVG.
 *
 * usage: cache-replay TRACE [--svg FILE] [--title TEXT] [--half-life STEPS]
 *
 * Columns: each policy's demand hit rate (accesses that found their unit resident; pred gets
 * cooc's hints), pred with cooc's predictions also read ahead (hit rate, and the share of
 * read-ahead units that their layer did not use); where the trace recorded pre-gating ("p"
 * lines), pred with pre-gating's predictions read ahead instead, as the store does with
 * prefetch on (as demand hints alone they change nothing: they speak of the layer about to
 * run, whose units are in use when it misses); the best fixed set in
 * hindsight, Belady's MIN, and the distance to Belady of the best demand policy and of the
 * best of all (prefetch included: it may pass Belady, which bounds demand fetching only);
 * with pre-gating, also Belady given the same reads ahead (md_csim_belady_pregate: the
 * offline reference for a prefetching store) and pred + pre-gating prefetch's distance to it.
 *
 * Traces come from `moed --trace-routing FILE` or `moed-bench -T FILE` (engine/route_trace.h);
 * the simulation is bench/cache_sim.h. A budget is a share of all expert units (layer x
 * expert), which is a share of expert bytes since every unit has the same size. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/cache_sim.h"

#define N_BUDGETS 10

static void usage(void)
{
	fprintf(stderr,
		"usage: cache-replay TRACE [--svg FILE] [--title TEXT] [--half-life STEPS]\n");
}

static double pct(uint64_t a, uint64_t b)
{
	return b ? 100.0 * (double)a / (double)b : 0.0;
}

struct curve {
	const char *name, *color, *dash;
	double y[N_BUDGETS];
};

/* The stroke-dasharray attribute of a curve ("" for a solid line) into buf. */
static const char *dash_attr(const struct curve *c, char *buf, size_t len)
{
	if (!c->dash)
		return "";
	snprintf(buf, len, " stroke-dasharray=\"%s\"", c->dash);
	return buf;
}

static void svg_line(FILE *f, double x1, double y1, double x2, double y2, const char *color,
		     int width, const char *extra)
{
	fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
		"stroke-width=\"%d\"%s/>\n", x1, y1, x2, y2, color, width, extra);
}

/* Opens a text element; the caller writes its content and </text>. */
static void svg_text(FILE *f, double x, double y, const char *anchor)
{
	fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"%s\">", x, y, anchor);
}

static void put_escaped(FILE *f, const char *t)
{
	for (; *t; t++) {
		if (*t == '<')
			fputs("&lt;", f);
		else if (*t == '&')
			fputs("&amp;", f);
		else
			fputc(*t, f);
	}
}

/* Hit rate (%) against budget (%) for every curve, 10..100% on x, 0..100% on y. */
static int write_svg(const char *path, const char *title, const struct curve *c, int n_curves)
{
	FILE *f = fopen(path, "w");
	if (!f)
		return -errno;
	const double W = 640, H = 420, x0 = 60, y0 = 360, pw = 540, ph = 300;
	char dash[64];
	fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
		"font-family=\"sans-serif\" font-size=\"12\">\n", W, H);
	fprintf(f, "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n");
	svg_text(f, W / 2, 24.0, "middle");
	put_escaped(f, title);
	fprintf(f, "</text>\n");
	for (int i = 0; i <= 10; i++) {
		double gx = x0 + pw * i / 10.0, gy = y0 - ph * i / 10.0;
		svg_line(f, x0, gy, x0 + pw, gy, "#ddd", 1, "");
		svg_line(f, gx, y0, gx, y0 - ph, "#ddd", 1, "");
		svg_text(f, x0 - 6, gy + 4, "end");
		fprintf(f, "%d%%</text>\n", i * 10);
		svg_text(f, gx, y0 + 18, "middle");
		fprintf(f, "%d%%</text>\n", i * 10);
	}
	fprintf(f, "<rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"%.0f\" fill=\"none\" "
		"stroke=\"black\"/>\n", x0, y0 - ph, pw, ph);
	svg_text(f, x0 + pw / 2, y0 + 40, "middle");
	fprintf(f, "cache budget (share of expert bytes)</text>\n");
	fprintf(f, "<text x=\"16\" y=\"%.0f\" text-anchor=\"middle\" "
		"transform=\"rotate(-90 16 %.0f)\">hit rate</text>\n", y0 - ph / 2, y0 - ph / 2);
	for (int k = 0; k < n_curves; k++) {
		fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\"%s points=\"",
			c[k].color, dash_attr(&c[k], dash, sizeof(dash)));
		for (int b = 0; b < N_BUDGETS; b++)
			fprintf(f, "%.1f,%.1f ", x0 + pw * (b + 1) / 10.0,
				y0 - ph * c[k].y[b] / 100.0);
		fprintf(f, "\"/>\n");
		double ly = y0 - ph + 18 + 18 * k;
		svg_line(f, x0 + 12, ly, x0 + 40, ly, c[k].color, 2,
			 dash_attr(&c[k], dash, sizeof(dash)));
		svg_text(f, x0 + 46, ly + 4, "start");
		put_escaped(f, c[k].name);
		fprintf(f, "</text>\n");
	}
	fprintf(f, "</svg>\n");
	return fclose(f) ? -errno : 0;
}

/* A simulation's result code: out of memory ends the program. */
static void need(int rc)
{
	if (rc) {
		fprintf(stderr, "cache-replay: out of memory\n");
		exit(1);
	}
}

static void print_pred(const char *name, const char *what, const struct md_csim_pred *p)
{
	printf("| %s | %s | %.1f%% | %.1f%% | %.1f%% |\n", name, what, pct(p->tok_hit, p->tok_used),
	       pct(p->grp_hit, p->grp_used), pct(p->grp_predicted - p->grp_hit, p->grp_predicted));
}

int main(int argc, char **argv)
{
	const char *trace = NULL, *svg = NULL, *title = NULL;
	uint64_t half_life_steps = 0;
	for (int i = 1; i < argc; i++) {
		if (argv[i][0] != '-') {
			if (trace) {
				usage();
				return 2;
			}
			trace = argv[i];
			continue;
		}
		if (i + 1 >= argc) {
			usage();
			return 2;
		}
		if (strcmp(argv[i], "--svg") == 0)
			svg = argv[++i];
		else if (strcmp(argv[i], "--title") == 0)
			title = argv[++i];
		else if (strcmp(argv[i], "--half-life") == 0)
			half_life_steps = strtoull(argv[++i], NULL, 10);
		else {
			usage();
			return 2;
		}
	}
	if (!trace) {
		usage();
		return 2;
	}
	char err[512];
	struct md_route_log log;
	if (md_route_log_read(&log, trace, err, sizeof(err))) {
		fprintf(stderr, "cache-replay: %s\n", err);
		return 1;
	}
	struct md_csim sim;
	struct md_csim_stats st;
	need(md_csim_build(&sim, &log, &st));
	uint64_t steps = 0, last = UINT64_MAX;
	for (uint64_t r = 0; r < log.n_rec; r++)
		if (log.rec[r].step != last) {
			steps++;
			last = log.rec[r].step;
		}
	uint64_t half_life = half_life_steps * sim.n_layer;
	printf("trace %s: %llu records, %llu steps, %u layers x %u experts (top-%u) = %u units; "
	       "%.2f distinct experts per layer and step\n", trace,
	       (unsigned long long)log.n_rec, (unsigned long long)steps, sim.n_layer, sim.n_expert,
	       sim.n_used, sim.n_units,
	       sim.n_groups ? (double)sim.start[sim.n_groups] / (double)sim.n_groups : 0.0);

	static const double shares[] = { 0.5, 0.9, 0.95, 0.99 };
	printf("hot set (the most-used units that serve a share of the accesses):");
	for (size_t i = 0; i < sizeof(shares) / sizeof(shares[0]); i++) {
		uint32_t h = md_csim_hot_set(&sim, shares[i]);
		printf("%s %.0f%%: %u units (%.1f%% of expert bytes)", i ? "," : "",
		       100 * shares[i], h, pct(h, sim.n_units));
	}
	printf("\n");

	struct curve cv[MD_EPOL_KIND_COUNT + 5];
	static const char *colors[] = { "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b" };
	int n_cv = 0;
	for (int k = 0; k < MD_EPOL_KIND_COUNT; k++, n_cv++) {
		cv[n_cv] = (struct curve){ md_epol_name((enum md_epol_kind)k), colors[k % 5], NULL,
					   { 0 } };
	}
	const bool pg = sim.has_pregate;
	int i_pf = n_cv++, i_pgf = -1;
	cv[i_pf] = (struct curve){ "pred + cooc prefetch", "#d62728", "2,3", {0} };
	if (pg) {
		i_pgf = n_cv++;
		cv[i_pgf] = (struct curve){ "pred + pre-gating prefetch", "#e377c2", "2,3", {0} };
	}
	int i_belpg = -1;
	if (pg) {
		i_belpg = n_cv++;
		cv[i_belpg] = (struct curve){ "Belady + pre-gating reads (offline)", "#bcbd22", "6,2",
					      {0} };
	}
	int i_static = n_cv++, i_bel = n_cv++;
	cv[i_static] = (struct curve){ "best fixed set in hindsight", "#7f7f7f", "1,4", {0} };
	cv[i_bel] = (struct curve){ "Belady (offline optimum, demand)", "black", "6,4", {0} };

	printf("\n| budget | units |");
	for (int k = 0; k < MD_EPOL_KIND_COUNT; k++)
		printf(" %s |", md_epol_name((enum md_epol_kind)k));
	printf(" pred + prefetch | prefetch wasted |");
	if (pg)
		printf(" pred + pre-gating prefetch | its waste |");
	printf(" best fixed set | Belady | best demand policy - Belady |");
	if (pg)
		printf(" best with prefetch - Belady | Belady + pre-gating reads | pred + pre-gating "
		       "prefetch - that |");
	printf("\n| ---: | ---: |");
	for (int k = 0; k < MD_EPOL_KIND_COUNT + 5 + (pg ? 5 : 0); k++)
		printf(" ---: |");
	printf("\n");
	for (int b = 0; b < N_BUDGETS; b++) {
		uint32_t cap = (uint32_t)(((uint64_t)sim.n_units * (uint64_t)(b + 1) + 5) / 10);
		printf("| %d%% | %u |", (b + 1) * 10, cap);
		double best = 0;
		for (int k = 0; k < MD_EPOL_KIND_COUNT; k++) {
			struct md_csim_result r;
			need(md_csim_replay(&sim, (enum md_epol_kind)k, cap, MD_CSIM_HINTS,
					    half_life, &r));
			cv[k].y[b] = pct(r.hits, r.accesses);
			if (cv[k].y[b] > best)
				best = cv[k].y[b];
			printf(" %.1f%% |", cv[k].y[b]);
		}
		struct md_csim_result r, rs, rb;
		need(md_csim_replay(&sim, MD_EPOL_PRED, cap, MD_CSIM_HINTS | MD_CSIM_PREFETCH,
				    half_life, &r));
		need(md_csim_static_best(&sim, cap, &rs));
		need(md_csim_belady(&sim, cap, &rb));
		cv[i_pf].y[b] = pct(r.hits, r.accesses);
		cv[i_static].y[b] = pct(rs.hits, rs.accesses);
		cv[i_bel].y[b] = pct(rb.hits, rb.accesses);
		double best_all = best > cv[i_pf].y[b] ? best : cv[i_pf].y[b];
		printf(" %.1f%% | %.0f%% |", cv[i_pf].y[b],
		       pct(r.prefetched - r.prefetch_used, r.prefetched));
		if (pg) {
			struct md_csim_result rf;
			need(md_csim_replay(&sim, MD_EPOL_PRED, cap,
					    MD_CSIM_HINTS | MD_CSIM_PREFETCH | MD_CSIM_PREGATE,
					    half_life, &rf));
			cv[i_pgf].y[b] = pct(rf.hits, rf.accesses);
			if (cv[i_pgf].y[b] > best_all)
				best_all = cv[i_pgf].y[b];
			printf(" %.1f%% | %.0f%% |", cv[i_pgf].y[b],
			       pct(rf.prefetched - rf.prefetch_used, rf.prefetched));
		}
		printf(" %.1f%% | %.1f%% | %+.1f |", cv[i_static].y[b], cv[i_bel].y[b],
		       best - cv[i_bel].y[b]);
		if (pg) {
			struct md_csim_result rbp;
			need(md_csim_belady_pregate(&sim, cap, &rbp));
			double bp = pct(rbp.hits, rbp.accesses);
			cv[i_belpg].y[b] = bp;
			printf(" %+.1f | %.1f%% | %+.1f |", best_all - cv[i_bel].y[b], bp,
			       cv[i_pgf].y[b] - bp);
		}
		printf("\n");
		fflush(stdout);
	}

	printf("\nprefetch accuracy (predicted and used / used; wasted: predicted units not used / "
	       "predicted units)\n\n| predictor | predicts | per token | per layer and step | "
	       "wasted |\n| --- | --- | ---: | ---: | ---: |\n");
	print_pred("prev", "the sequence's previous token's experts, same layer", &st.prev);
	print_pred("cooc", "co-occurrence with the token's experts one layer before", &st.cooc);
	if (pg)
		print_pred("pregate", "the layer's router on the residual leaving the layer before "
			   "(recorded)", &st.pregate);

	int rc = 0;
	if (svg) {
		char t[512];
		snprintf(t, sizeof(t), "%s", title ? title : trace);
		if (write_svg(svg, t, cv, n_cv)) {
			fprintf(stderr, "cache-replay: cannot write '%s'\n", svg);
			rc = 1;
		}
	}
	md_csim_release(&sim);
	md_route_log_release(&log);
	return rc;
}
