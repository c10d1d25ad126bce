/* bench_grammar: tokens/s of constrained (grammar-masked) streams against unconstrained ones
 * on the same engine, prompt and sampling settings, interleaved within one run.
 *
 * A constrained stream ends when its JSON closes, so each repetition first runs its B
 * constrained requests once unmeasured to learn their lengths (seeded sampling makes the rerun
 * identical); then, measured and in alternating order, the same constrained requests and B
 * unconstrained ones, stream i with max_tokens set to constrained stream i's length. Both
 * kinds generate the same number of tokens after the same prompt, so their rates,
 * tokens / (last DONE - submit), compare the same work with and without the grammar. Reported: median
 * tokens/s of each kind over the repetitions, the spread, and the ratio of the medians.
 * The default grammar is generic JSON (what response_format json_object compiles to); -g FILE
 * reads another. Sampling is seeded (temperature 1), so the constrained streams visit many
 * grammar states, and every request starts with a fresh matcher (no cached masks).
 *
 * On a machine shared with other work the rates swing from run to run, so each repetition's
 * pair (adjacent in time) also gives a ratio, and their median is reported; and each run is
 * also measured in tokens per CPU-second of the whole process (engine thread and compute
 * pool), which other processes' load disturbs far less than wall time. Last, the
 * grammar's own cost is timed alone: the constrained streams' tokens are replayed through
 * fresh matchers (mask, then accept, per token), which is exactly the work the engine thread
 * adds per token, and compared with the time per token of the unconstrained streams; and the
 * whole sampling step with the grammar (mask, masked sample, accept) is timed against plain
 * sampling on the same logits, the complete difference a token pays on the engine thread. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/engine.h"

static const char default_grammar[] =
	"root   ::= object\n"
	"value  ::= object | array | string | number | (\"true\" | \"false\" | \"null\")\n"
	"object ::= \"{\" ws ( string \":\" ws value (\",\" ws string \":\" ws value)* )? \"}\"\n"
	"array  ::= \"[\" ws ( value (\",\" ws value)* )? \"]\"\n"
	"string ::= \"\\\"\" ( [^\"\\\\\\x00-\\x1f] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" [0-9a-fA-F]{4}) )* "
	"\"\\\"\"\n"
	"number ::= \"-\"? ([0-9] | [1-9] [0-9]*) (\".\" [0-9]+)? ([eE] [-+]? [0-9]+)?\n"
	"ws     ::= \" \"?\n";

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int woken;

static void on_wake(void *arg)
{
	pthread_mutex_lock(&mu);
	woken = 1;
	pthread_cond_signal(&cv);
	pthread_mutex_unlock(&mu);
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double cpu_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double last_cpu_rate; /* tokens per CPU-second of the last run */

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

#define MAX_B 64
#define MAX_REC 4096

/* Tokens of the constrained streams, for the replay. */
static int32_t rec[MAX_REC];
static uint32_t rec_len[256], n_rec, rec_total;
static bool recording;

/* Run B streams (constrained when g != NULL), stream i with max_tokens[i]; n_out[i] receives
 * its token count. Returns the aggregate tokens/s from submission to the last DONE. */
static double run(struct md_engine *e, const int32_t *prompt, uint32_t n_prompt, int b,
		  const uint32_t *max_tokens, struct md_grammar *g, uint64_t seed, uint32_t *n_out)
{
	static uint64_t next_id = 1;
	uint64_t base = next_id;
	double t0 = now_s(), c0 = cpu_s();
	for (int i = 0; i < b; i++)
		n_out[i] = 0;
	for (int i = 0; i < b; i++) {
		struct md_engine_req *r = calloc(1, sizeof(*r));
		r->id = next_id++;
		r->prompt = malloc(sizeof(int32_t) * n_prompt);
		memcpy(r->prompt, prompt, sizeof(int32_t) * n_prompt);
		r->n_prompt = n_prompt;
		r->max_tokens = max_tokens[i];
		r->ignore_eos = true;
		md_sampling_default(&r->sampling);
		r->sampling.seed = seed + (uint64_t)i;
		r->sampling.has_seed = true;
		r->grammar = g ? md_grammar_ref(g) : NULL;
		int rc = md_engine_submit(e, r);
		if (rc) {
			fprintf(stderr, "submit failed (%d)\n", rc);
			exit(1);
		}
	}
	int left = b;
	while (left > 0) {
		pthread_mutex_lock(&mu);
		while (!woken)
			pthread_cond_wait(&cv, &mu);
		woken = 0;
		pthread_mutex_unlock(&mu);
		struct md_engine_event *l = md_engine_poll(e);
		for (struct md_engine_event *ev = l; ev; ev = ev->next) {
			if (ev->req_id < base || ev->req_id >= base + (uint64_t)b)
				continue;
			if (ev->kind == MD_EV_TOKEN) {
				uint32_t k = (uint32_t)(ev->req_id - base);
				if (recording && k == 0 && n_rec < 256 && rec_total < MAX_REC) {
					rec[rec_total++] = ev->token;
					rec_len[n_rec]++;
				}
				n_out[k]++;
			} else if (ev->kind == MD_EV_DONE) {
				if (ev->finish == MD_FINISH_ERROR) {
					fprintf(stderr, "a stream failed (%d)\n", ev->err);
					exit(1);
				}
				left--;
			}
		}
		md_engine_events_free(l);
	}
	if (recording && n_rec < 256)
		n_rec++;
	double dt = now_s() - t0, dc = cpu_s() - c0, tokens = 0;
	for (int i = 0; i < b; i++)
		tokens += n_out[i];
	last_cpu_rate = dc > 0 ? tokens / dc : 0;
	return dt > 0 ? tokens / dt : 0;
}

static char *read_file(const char *path, size_t *len)
{
	FILE *f = fopen(path, "rb");
	if (!f)
		return NULL;
	fseek(f, 0, SEEK_END);
	long n = ftell(f);
	fseek(f, 0, SEEK_SET);
	char *s = malloc((size_t)n + 1);
	if (s && fread(s, 1, (size_t)n, f) != (size_t)n) {
		free(s);
		s = NULL;
	}
	fclose(f);
	if (s)
		*len = (size_t)n;
	return s;
}

int main(int argc, char **argv)
{
	const char *model = NULL, *gpath = NULL;
	int threads = 2, reps = 9, b = 1, opt;
	uint32_t n_gen = 128;
	while ((opt = getopt(argc, argv, "m:t:n:r:b:g:")) != -1) {
		switch (opt) {
		case 'm': model = optarg; break;
		case 't': threads = atoi(optarg); break;
		case 'n': n_gen = (uint32_t)atoi(optarg); break;
		case 'r': reps = atoi(optarg); break;
		case 'b': b = atoi(optarg); break;
		case 'g': gpath = optarg; break;
		default: model = NULL; optind = argc; break;
		}
	}
	if (!model || b < 1 || b > MAX_B || reps < 1 || n_gen < 2) {
		fprintf(stderr, "usage: bench_grammar -m MODEL.gguf [-t THREADS] [-n MAX_TOKENS] "
			"[-r REPS] [-b STREAMS] [-g GRAMMAR_FILE]\n");
		return 2;
	}
	size_t glen = strlen(default_grammar);
	char *gtext = gpath ? read_file(gpath, &glen) : strdup(default_grammar);
	if (!gtext) {
		fprintf(stderr, "cannot read '%s'\n", gpath);
		return 1;
	}
	char err[256];
	struct md_grammar *g;
	if (md_grammar_parse(gtext, glen, &g, err, sizeof(err))) {
		fprintf(stderr, "grammar: %s\n", err);
		return 1;
	}
	struct md_engine_config cfg = {
		.model_path = model, .n_threads = threads, .kv_mem_mb = 256,
		.max_seqs = (uint32_t)b, .step_tokens = 512, .max_queue = 64,
	};
	struct md_engine *e;
	if (md_engine_new(&e, &cfg, on_wake, NULL) || md_engine_start(e)) {
		fprintf(stderr, "cannot start the engine\n");
		return 1;
	}
	while (md_engine_state(e) == MD_ENGINE_LOADING)
		usleep(10000);
	if (md_engine_state(e) != MD_ENGINE_READY) {
		fprintf(stderr, "%s\n", md_engine_error(e));
		return 1;
	}
	struct md_engine_msg msg = { .role = "user",
				     .content = "Reply with a JSON object describing a king." };
	int32_t *prompt;
	int np = md_engine_chat_tokenize(e, &msg, 1, &prompt);
	if (np <= 0) {
		fprintf(stderr, "cannot tokenize the prompt\n");
		return 1;
	}
	uint32_t room = md_engine_n_ctx(e) - (uint32_t)np;
	if (n_gen > room)
		n_gen = room;
	printf("model %s, %d thread(s), %d stream(s), max_tokens %u, %d repetitions, grammar %s "
	       "(%u rules, %u elements)\n", md_engine_model_name(e), threads, b, n_gen, reps,
	       gpath ? gpath : "JSON (built in)", md_grammar_n_rules(g), md_grammar_n_elements(g));
	double *plain = calloc((size_t)reps, sizeof(double));
	double *gram = calloc((size_t)reps, sizeof(double));
	double *ratio = calloc((size_t)reps, sizeof(double));
	double *cpu_plain = calloc((size_t)reps, sizeof(double));
	double *cpu_gram = calloc((size_t)reps, sizeof(double));
	double tokens = 0;
	uint32_t maxt[MAX_B], n_g[MAX_B], n_p[MAX_B];
	for (int i = 0; i < b; i++)
		maxt[i] = n_gen;
	/* warm-up */
	run(e, prompt, (uint32_t)np, b, maxt, g, 999, n_g);
	run(e, prompt, (uint32_t)np, b, n_g, NULL, 999, n_p);
	for (int r = 0; r < reps; r++) {
		uint64_t seed = 1000 + (uint64_t)r * 77;
		recording = true;
		run(e, prompt, (uint32_t)np, b, maxt, g, seed, n_g);
		recording = false;
		for (int i = 0; i < b; i++)
			if (n_g[i] == 0)
				n_g[i] = 1;
		if (r % 2) {
			gram[r] = run(e, prompt, (uint32_t)np, b, n_g, g, seed, n_p);
			cpu_gram[r] = last_cpu_rate;
			plain[r] = run(e, prompt, (uint32_t)np, b, n_g, NULL, seed, n_p);
			cpu_plain[r] = last_cpu_rate;
		} else {
			plain[r] = run(e, prompt, (uint32_t)np, b, n_g, NULL, seed, n_p);
			cpu_plain[r] = last_cpu_rate;
			gram[r] = run(e, prompt, (uint32_t)np, b, n_g, g, seed, n_p);
			cpu_gram[r] = last_cpu_rate;
		}
		ratio[r] = plain[r] > 0 ? gram[r] / plain[r] : 0;
		for (int i = 0; i < b; i++)
			tokens += n_p[i];
	}
	qsort(plain, (size_t)reps, sizeof(double), cmp_d);
	qsort(gram, (size_t)reps, sizeof(double), cmp_d);
	qsort(ratio, (size_t)reps, sizeof(double), cmp_d);
	qsort(cpu_plain, (size_t)reps, sizeof(double), cmp_d);
	qsort(cpu_gram, (size_t)reps, sizeof(double), cmp_d);
	double mp = plain[reps / 2], mg = gram[reps / 2];
	printf("tokens per stream (both kinds): %.1f on average\n", tokens / reps / b);
	printf("%-14s %10s %22s\n", "stream", "tok/s", "spread (min..max)");
	printf("%-14s %10.1f %10.1f..%-11.1f\n", "unconstrained", mp, plain[0], plain[reps - 1]);
	printf("%-14s %10.1f %10.1f..%-11.1f\n", "constrained", mg, gram[0], gram[reps - 1]);
	printf("ratio constrained/unconstrained (medians): %.3f\n", mp > 0 ? mg / mp : 0);
	printf("ratio per adjacent pair: median %.3f (min %.3f, max %.3f)\n", ratio[reps / 2],
	       ratio[0], ratio[reps - 1]);
	printf("tokens per CPU-second (median, spread): unconstrained %.1f (%.1f..%.1f), "
	       "constrained %.1f (%.1f..%.1f), ratio %.3f\n", cpu_plain[reps / 2], cpu_plain[0],
	       cpu_plain[reps - 1], cpu_gram[reps / 2], cpu_gram[0], cpu_gram[reps - 1],
	       cpu_plain[reps / 2] > 0 ? cpu_gram[reps / 2] / cpu_plain[reps / 2] : 0);
	/* the grammar's own work per token, replayed */
	const struct md_gvocab *gv = md_engine_gvocab(e);
	double best = 1e300;
	for (int pass = 0; pass < 5; pass++) {
		double t0 = now_s();
		uint32_t at = 0;
		for (uint32_t k = 0; k < n_rec; k++) {
			struct md_gmatch *m;
			if (md_gmatch_new(&m, g, gv))
				return 1;
			for (uint32_t i = 0; i < rec_len[k]; i++) {
				const uint32_t *bits;
				if (md_gmatch_mask(m, &bits) || md_gmatch_accept(m, rec[at + i])) {
					fprintf(stderr, "replay: token %u of stream %u refused\n", i, k);
					return 1;
				}
			}
			at += rec_len[k];
			md_gmatch_free(m);
		}
		double dt = now_s() - t0;
		if (dt < best)
			best = dt;
	}
	double us_tok = rec_total ? best * 1e6 / rec_total : 0;
	/* against the fastest unconstrained run: the least disturbed, so the largest share */
	double fast = plain[reps - 1];
	printf("grammar work alone (replay of %u tokens, fresh matchers, best of 5): %.2f us/token "
	       "= %.2f%% of the fastest unconstrained run's %.0f us/token\n", rec_total, us_tok,
	       fast > 0 ? us_tok * fast / 1e4 : 0, fast > 0 ? 1e6 / fast : 0);

	/* The whole difference on the engine thread, per token: sampling with the mask (mask,
	 * masked sample, accept) against plain sampling, on the same pseudo-random logits rows;
	 * the accepted token is the recorded one (the sample itself is discarded). */
	uint32_t V = md_engine_n_vocab(e);
	float *rows = malloc(sizeof(float) * V * 16);
	uint64_t x = 12345;
	for (uint32_t i = 0; i < V * 16; i++) {
		x = x * 6364136223846793005ull + 1442695040888963407ull;
		rows[i] = (float)((x >> 40) & 0xffff) / 4096.0f;
	}
	struct md_sampler sm;
	struct md_sampling sp;
	md_sampling_default(&sp);
	md_sampler_init(&sm, V, 7);
	struct md_sample_out so;
	double best_plain = 1e300, best_masked = 1e300;
	for (int pass = 0; pass < 5; pass++) {
		double t0 = now_s();
		for (uint32_t i = 0; i < rec_total; i++)
			md_sampler_sample(&sm, &sp, rows + (size_t)(i % 16) * V, NULL, 0, NULL, 0, &so);
		double t1 = now_s();
		uint32_t at = 0;
		for (uint32_t k = 0; k < n_rec; k++) {
			struct md_gmatch *m;
			if (md_gmatch_new(&m, g, gv))
				return 1;
			for (uint32_t i = 0; i < rec_len[k]; i++) {
				const uint32_t *bits;
				md_gmatch_mask(m, &bits);
				struct md_sampler_ctx ctx = { .allowed = bits };
				md_sampler_sample_ctx(&sm, &sp, rows + (size_t)((at + i) % 16) * V, &ctx, &so);
				md_gmatch_accept(m, rec[at + i]);
			}
			at += rec_len[k];
			md_gmatch_free(m);
		}
		double t2 = now_s();
		if (t1 - t0 < best_plain)
			best_plain = t1 - t0;
		if (t2 - t1 < best_masked)
			best_masked = t2 - t1;
	}
	md_sampler_release(&sm);
	free(rows);
	double over = rec_total ? (best_masked - best_plain) * 1e6 / rec_total : 0;
	printf("sampling per token on the engine thread (best of 5): plain %.2f us, with the grammar "
	       "%.2f us: +%.2f us = %.2f%% of the fastest unconstrained run's token\n",
	       rec_total ? best_plain * 1e6 / rec_total : 0,
	       rec_total ? best_masked * 1e6 / rec_total : 0, over,
	       fast > 0 ? over * fast / 1e4 : 0);
	free(ratio);
	free(cpu_plain);
	free(cpu_gram);
	free(plain);
	free(gram);
	free(prompt);
	md_grammar_unref(g);
	free(gtext);
	md_engine_free(e);
	return 0;
}
