/* moed-bench: prefill (pp) and decode (tg) tokens/s of the engine on a GGUF, llama-bench style.
 *
 * pp N: one micro-batch of N prompt tokens at positions 0..N-1 of a fresh sequence, logits for
 * the last token only. tg N: N single-token steps at positions 0..N-1 (so like llama-bench the
 * context grows from empty). With -b B, B sequences decode together (B tokens per step) and
 * the aggregate rate is reported. Each test runs once to warm up, then -r times; the table
 * shows the median and the spread (min..max) of the repetitions. Token ids are pseudo-random
 * with a fixed seed. With -T FILE every MoE layer's routing goes to a routing trace
 * (engine/route_trace.h): a sequence is named run * 1024 + its KV slot, run counting the
 * pp and tg runs from 1, warm-ups included, and steps count every forward pass. Random tokens route unlike text: for cache studies
 * trace the server on real prompts (bench/README.md). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "bench/dev_copy_bw.h"
#include "engine/backend_sim.h"
#include "engine/expert_cost.h"
#include "engine/experts.h"
#include "engine/kern/cpu.h"
#include "engine/forward.h"
#include "engine/forward_dev.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "engine/route_trace.h"
#include "engine/spec_ctl.h"
#include "engine/tokenizer.h"

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

static void usage(void)
{
	fprintf(stderr,
		"usage: moed-bench -m MODEL.gguf [-t THREADS] [-p N_PROMPT] [-n N_GEN] [-r REPS] [-b SEQS]\n"
		"  -p  prompt tokens per pp test (default 128; 0 skips)\n"
		"  -n  generated tokens per tg test (default 64; 0 skips)\n"
		"  -r  repetitions after one warm-up run (default 5)\n"
		"  -b  sequences decoding together in tg (default 1)\n"
		"  -T  write a routing trace to FILE (--trace-routing FILE too)\n"
		"  -c  MiB: routed experts through the expert store with this host budget\n"
		"      (default: the plain mapping)\n"
		"  -v  K1,K2,..: verification steps instead of pp/tg: one sequence with -p tokens of\n"
		"      context, steps of K tokens (logits for all, rolled back after each), the sizes\n"
		"      alternating; -n steps per size and round, -r rounds\n"
		"  -i  N: with -v, N untimed one-token steps before each timed step (a verification\n"
		"      step in serving follows plain decode steps; default 0: back to back)\n"
		"  -D  cuda|sim: the forward pass on that device (engine/forward_dev.h), every weight\n"
		"      resident; prints the device's measured copy bandwidth and each tg rate against\n"
		"      the bound it sets (bytes read per token / bandwidth)\n"
		"  -X  MiB: with -D, the routed experts through the expert store (host RAM holds them\n"
		"      all) with a device tier of MiB; the cost model picks CPU or copy for misses\n"
		"  -O  1: with -X, on-demand copying: every miss copied up and run on the device\n"
		"  -P  lru|lfu|pred: with -X, the device tier's eviction policy (default pred, the\n"
		"      server's)\n"
		"  env MOED_KERNELS=ref|scalar|avx2|avx512 selects the kernels\n");
}

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

struct bench {
	struct md_model *m;
	struct md_kv_cache kv;
	struct md_forward_ctx *fw;
	float *logits;
	int32_t *tok, *seq, *pos;
	uint64_t rng;
	struct md_route_trace *trace; /* owned, NULL: no -T */
	uint64_t distinct;            /* distinct experts summed over MoE layers and steps */
	uint64_t *trace_seq;          /* owned (max tokens): sequence of each row */
	uint64_t step, run;
	int32_t *text;                /* owned: -v's tokens (TEXT through the model's tokenizer) */
	int n_text, text_pos;
};

/* -v's tokens: consecutive tokens of real text touch the experts real text touches (on
 * default-1g two of them reach 3.75 of the 4 experts a layer they could, where two
 * pseudo-random ids reached 2.99, so a step of random ids read fewer bytes than a verifying
 * step of served text does). Genesis 1, King James Version (public domain). */
static const char TEXT[] =
	"In the beginning God created the heaven and the earth. And the earth was without form, "
	"and void; and darkness was upon the face of the deep. And the Spirit of God moved upon "
	"the face of the waters. And God said, Let there be light: and there was light. And God "
	"saw the light, that it was good: and God divided the light from the darkness. And God "
	"called the light Day, and the darkness he called Night. And the evening and the morning "
	"were the first day. And God said, Let there be a firmament in the midst of the waters, "
	"and let it divide the waters from the waters. And God made the firmament, and divided "
	"the waters which were under the firmament from the waters which were above the "
	"firmament: and it was so. And God called the firmament Heaven. And the evening and the "
	"morning were the second day. And God said, Let the waters under the heaven be gathered "
	"together unto one place, and let the dry land appear: and it was so. And God called the "
	"dry land Earth; and the gathering together of the waters called he Seas: and God saw "
	"that it was good. And God said, Let the earth bring forth grass, the herb yielding "
	"seed, and the fruit tree yielding fruit after his kind, whose seed is in itself, upon "
	"the earth: and it was so.";

static void on_route(void *ud, uint32_t layer, const struct md_routing *r)
{
	struct bench *b = ud;
	b->distinct += (uint64_t)r->n_active;
	if (b->trace)
		md_route_trace_layer(b->trace, layer, r);
}

static void on_pregate(void *ud, uint32_t layer, const struct md_routing *r)
{
	struct bench *b = ud;
	md_route_trace_pregate(b->trace, layer, r);
}

/* md_forward, traced when -T asked for it; sequence numbers are the KV slots. */
static int forward(struct bench *b, int n)
{
	if (b->trace) {
		for (int i = 0; i < n; i++)
			b->trace_seq[i] = b->run * 1024 + (uint64_t)b->seq[i];
		md_route_trace_step(b->trace, ++b->step, (uint32_t)n, b->trace_seq, b->pos);
	}
	struct md_batch batch = { n, b->tok, b->seq, b->pos, NULL, NULL };
	int rc = md_forward(b->fw, &b->kv, &batch, b->logits);
	if (b->trace)
		md_route_trace_flush(b->trace);
	return rc;
}

static int32_t rand_tok(struct bench *b)
{
	b->rng = b->rng * 6364136223846793005ull + 1442695040888963407ull;
	return (int32_t)((b->rng >> 33) % b->m->hp.n_vocab);
}

/* The next of -v's tokens: the text's, in order and round again, or pseudo-random ids for a
 * model without a tokenizer. */
static int32_t text_tok(struct bench *b)
{
	if (b->n_text == 0)
		return rand_tok(b);
	int32_t t = b->text[b->text_pos];
	b->text_pos = (b->text_pos + 1) % b->n_text;
	return t;
}

/* One pp run: seconds, or a negative value on error. */
static double run_pp(struct bench *b, int n)
{
	b->run++;
	int s = md_kv_seq_new(&b->kv);
	if (s < 0 || md_kv_reserve(&b->kv, s, (uint32_t)n))
		return -1;
	for (int i = 0; i < n; i++) {
		b->tok[i] = rand_tok(b);
		b->seq[i] = s;
		b->pos[i] = i;
	}
	double t0 = now_s();
	int rc = forward(b, n);
	double t = now_s() - t0;
	md_kv_seq_free(&b->kv, s);
	return rc < 0 ? -1 : t;
}

/*
 * Verification steps (-v): what a speculative step of k tokens of one sequence costs. One
 * sequence gets n_ctx tokens of context; then, for each round, each size k in turn runs n
 * steps of k tokens at positions n_ctx .. n_ctx+k-1 with logits for every row (as a step
 * verifying k-1 drafts), each rolled back to n_ctx after, so every step sees the same
 * context. The sizes alternate within a round so that a drifting machine load falls on all
 * of them alike. Printed per size: the median ms per step over the rounds, its ratio to k = 1,
 * the distinct experts per MoE layer, and the bytes the step must read (dense weights once,
 * each distinct expert once) against k = 1's. With n_iso > 0 each timed step follows n_iso
 * untimed one-token steps at the same position, as a verification step in serving follows
 * plain decode: only the timed steps count. The tokens are consecutive tokens of TEXT (its
 * first n_ctx the context, then on along it), where the model has a tokenizer.
 */
static int run_verify(struct bench *b, const int *ks, int nk, int n_ctx, int n, int reps, int n_iso)
{
	struct md_spec_ctl ctl;
	md_spec_ctl_init(&ctl, b->m, false);
	int s = md_kv_seq_new(&b->kv);
	int kmax = 0;
	for (int i = 0; i < nk; i++)
		kmax = ks[i] > kmax ? ks[i] : kmax;
	if (s < 0 || md_kv_reserve(&b->kv, s, (uint32_t)(n_ctx + kmax)))
		return -1;
	bool *want = malloc(sizeof(bool) * (size_t)kmax);
	double *ms = malloc(sizeof(double) * (size_t)(nk * reps));
	double *cms = malloc(sizeof(double) * (size_t)(nk * reps));
	double *dist = calloc((size_t)nk, sizeof(double));
	if (!want || !ms || !cms || !dist)
		return -1;
	for (int i = 0; i < kmax; i++)
		want[i] = true;
	if (n_ctx > 0) {
		for (int i = 0; i < n_ctx; i++) {
			b->tok[i] = text_tok(b);
			b->seq[i] = s;
			b->pos[i] = i;
		}
		if (forward(b, n_ctx) < 0)
			return -1;
	}
	md_forward_set_route_cb(b->fw, on_route, b);
	for (int r = -1; r < reps; r++) {
		for (int i = 0; i < nk; i++) {
			const int k = ks[i];
			uint64_t d0 = b->distinct;
			double t = 0, c = 0;
			for (int st = 0; st < n; st++) {
				for (int it = 0; it <= n_iso; it++) {
					const int kk = it < n_iso ? 1 : k;
					for (int j = 0; j < kk; j++) {
						b->tok[j] = text_tok(b);
						b->seq[j] = s;
						b->pos[j] = n_ctx + j;
					}
					struct md_batch batch = { kk, b->tok, b->seq, b->pos, want, NULL };
					uint64_t dd = b->distinct;
					double t0 = now_s(), c0 = cpu_s();
					if (md_kv_reserve(&b->kv, s, (uint32_t)(n_ctx + kk)) ||
					    md_forward(b->fw, &b->kv, &batch, b->logits) != kk)
						return -1;
					if (it < n_iso) {
						b->distinct = dd; /* untimed: not counted */
					} else {
						t += now_s() - t0;
						c += cpu_s() - c0;
					}
					md_kv_truncate(&b->kv, s, (uint32_t)n_ctx);
				}
			}
			if (r >= 0) {
				ms[i * reps + r] = t * 1e3 / n;
				cms[i * reps + r] = c * 1e3 / n;
				dist[i] += (double)(b->distinct - d0) / n;
			}
		}
	}
	const double L = ctl.n_moe_layers ? ctl.n_moe_layers : 1;
	double base = 0, cbase = 0, base_bytes = 0;
	printf("| k | ms/step (median) | min..max | x k=1 | CPU ms/step (median) | x k=1 | distinct experts/layer | MB read | x k=1 bytes | GB/s (wall) |\n");
	printf("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
	for (int i = 0; i < nk; i++) {
		double *v = ms + i * reps, *cv = cms + i * reps;
		qsort(v, (size_t)reps, sizeof(double), cmp_d);
		qsort(cv, (size_t)reps, sizeof(double), cmp_d);
		double med = reps % 2 ? v[reps / 2] : 0.5 * (v[reps / 2 - 1] + v[reps / 2]);
		double cmed = reps % 2 ? cv[reps / 2] : 0.5 * (cv[reps / 2 - 1] + cv[reps / 2]);
		double u = dist[i] / reps / L;
		double bytes = ctl.w_dense + L * u * ctl.w_expert;
		if (i == 0) {
			base = med;
			cbase = cmed;
			base_bytes = bytes;
		}
		printf("| %d | %.2f | %.2f..%.2f | %.2f | %.2f | %.2f | %.2f | %.1f | %.2f | %.1f |\n", ks[i],
		       med, v[0], v[reps - 1], med / base, cmed, cmed / cbase, u, bytes / 1e6,
		       bytes / base_bytes, bytes / med / 1e6);
		fflush(stdout);
	}
	free(want);
	free(ms);
	free(cms);
	free(dist);
	md_kv_seq_free(&b->kv, s);
	return 0;
}

/* One tg run over n_seq sequences: seconds for n steps. */
static double run_tg(struct bench *b, int n, int n_seq)
{
	int ids[256];
	b->run++;
	for (int s = 0; s < n_seq; s++) {
		ids[s] = md_kv_seq_new(&b->kv);
		if (ids[s] < 0 || md_kv_reserve(&b->kv, ids[s], (uint32_t)n))
			return -1;
	}
	double t0 = now_s();
	int rc = 0;
	for (int step = 0; step < n && rc >= 0; step++) {
		for (int s = 0; s < n_seq; s++) {
			b->tok[s] = rand_tok(b);
			b->seq[s] = ids[s];
			b->pos[s] = step;
		}
		rc = forward(b, n_seq);
	}
	double t = now_s() - t0;
	for (int s = 0; s < n_seq; s++)
		md_kv_seq_free(&b->kv, ids[s]);
	return rc < 0 ? -1 : t;
}

/* -D: the forward pass on a device. */
struct dev_run {
	struct md_backend *b;     /* CUDA's (the process's) or a simulated one (owned) */
	bool owned;
	struct md_fwd_dev *fd;
	struct md_expert_store *store; /* -X */
	double bound;             /* the HBM bound of one stream, tok/s (0: unknown) */
};

/* Weight bytes one decode token reads: every weight but the token embedding (one row) and the
 * routed experts (k of E per MoE layer). */
static uint64_t bytes_per_token(const struct md_model *m)
{
	uint64_t sum = 0;
	for (size_t i = 0; i < m->n_tensors; i++) {
		const struct md_tensor *t = &m->tensors[i];
		if (t == m->tok_embd && t != m->output)
			continue;
		uint64_t bytes = (uint64_t)t->ne[1] * t->nb1 * (uint64_t)(t->ne[2] > 1 ? t->ne[2] : 1);
		if (t->ne[2] > 1 && m->hp.n_expert)
			bytes = bytes / (uint64_t)t->ne[2] * m->hp.n_expert_used;
		sum += bytes;
	}
	return sum;
}

static int dev_setup(struct dev_run *dr, struct bench *b, const struct md_model *m,
		     const char *name, double tier_mb, int on_demand, enum md_epol_kind policy,
		     int max_tok)
{
	char err[512];
	if (strcmp(name, "cuda") == 0) {
		dr->b = md_backend_cuda();
		if (!dr->b) {
			fprintf(stderr, "moed-bench: no CUDA device: %s\n", md_backend_cuda_error());
			return -1;
		}
	} else if (strcmp(name, "sim") == 0) {
		dr->b = md_backend_sim_new((size_t)64 << 30, 0);
		dr->owned = true;
	} else {
		fprintf(stderr, "moed-bench: -D cuda or sim\n");
		return -1;
	}
	struct md_backend_device info;
	if (dr->b->device_info(dr->b, 0, &info))
		snprintf(info.name, sizeof(info.name), "%s", dr->b->name);
	if (tier_mb > 0) {
		static struct md_xcost fixed; /* on-demand copying: the CPU "costs" forever */
		md_xcost_init(&fixed, 1.0, 0, 0);
		struct md_expert_store_config sc = {
			.host_bytes = md_expert_store_expert_bytes(m) + (size_t)64 * md_expert_store_slot_bytes(m),
			.max_tokens = max_tok, .dev = dr->b, .dev_bytes = (size_t)(tier_mb * 1048576.0),
			.rates = on_demand ? &fixed : NULL, .policy = policy,
		};
		if (md_expert_store_new(&dr->store, m, &sc, err, sizeof(err))) {
			fprintf(stderr, "moed-bench: %s\n", err);
			return -1;
		}
		md_forward_set_expert_src(b->fw, md_expert_store_src(dr->store));
	}
	if (md_fwd_dev_new(m, dr->b, &b->kv, max_tok, tier_mb <= 0, &dr->fd, err, sizeof(err))) {
		fprintf(stderr, "moed-bench: the forward pass on %s: %s\n", info.name, err);
		return -1;
	}
	md_forward_set_device(b->fw, dr->fd);
	uint64_t bpt = bytes_per_token(m);
	double bw = dr->owned ? 0 : md_bench_dev_copy_bw(dr->b, (size_t)512 << 20);
	dr->bound = bw > 0 ? bw / (double)bpt : 0;
	printf("device: %s, %.0f MiB; %.1f MB read per token; device copy bandwidth %.0f GB/s; "
	       "bound %.1f tok/s%s\n\n", info.name, info.mem_total / 1048576.0, bpt / 1e6, bw / 1e9,
	       dr->bound, tier_mb > 0 ? (on_demand ? "; experts: device tier, misses copied "
					 "up on demand" : "; experts: device tier, misses by the cost model")
					 : "; every weight resident");
	return 0;
}

static void dev_release(struct dev_run *dr)
{
	if (dr->store) {
		struct md_expert_store_stats es;
		md_expert_store_get_stats(dr->store, &es);
		printf("\ndevice tier: %u experts, %llu hits, %llu misses (%llu on the device, %llu on "
		       "the CPU), %.1f MiB copied up (%.1f GB/s measured), stall %.2f s\n",
		       es.dev_slots, (unsigned long long)es.dev_hits,
		       (unsigned long long)es.dev_misses, (unsigned long long)es.dev_compute_dev,
		       (unsigned long long)es.dev_compute_host, es.dev_bytes_uploaded / 1048576.0,
		       es.dev_up_bps / 1e9, es.dev_stall_ns / 1e9);
	}
	md_fwd_dev_free(dr->fd);
	md_expert_store_free(dr->store);
	if (dr->owned)
		md_backend_sim_free(dr->b);
}

int main(int argc, char **argv)
{
	const char *path = NULL, *trace_path = NULL;
	int n_threads = 2, n_prompt = 128, n_gen = 64, reps = 5, n_seq = 1;
	double cache_mb = 0, tier_mb = 0;
	const char *dev_name = NULL;
	int on_demand = 0;
	enum md_epol_kind policy = MD_EPOL_PRED; /* the server's default */
	int vks[64], nvk = 0, n_iso = 0;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (i + 1 >= argc) {
			usage();
			return 2;
		}
		const char *v = argv[++i];
		if (strcmp(a, "-m") == 0)
			path = v;
		else if (strcmp(a, "-t") == 0)
			n_threads = atoi(v);
		else if (strcmp(a, "-p") == 0)
			n_prompt = atoi(v);
		else if (strcmp(a, "-n") == 0)
			n_gen = atoi(v);
		else if (strcmp(a, "-r") == 0)
			reps = atoi(v);
		else if (strcmp(a, "-b") == 0)
			n_seq = atoi(v);
		else if (strcmp(a, "-T") == 0 || strcmp(a, "--trace-routing") == 0)
			trace_path = v;
		else if (strcmp(a, "-c") == 0)
			cache_mb = atof(v);
		else if (strcmp(a, "-i") == 0)
			n_iso = atoi(v);
		else if (strcmp(a, "-D") == 0)
			dev_name = v;
		else if (strcmp(a, "-X") == 0)
			tier_mb = atof(v);
		else if (strcmp(a, "-O") == 0)
			on_demand = atoi(v);
		else if (strcmp(a, "-P") == 0) {
			if (md_epol_parse(v, &policy)) {
				usage();
				return 2;
			}
		}
		else if (strcmp(a, "-v") == 0) {
			for (char *p = (char *)v; *p && nvk < 64;) {
				vks[nvk++] = (int)strtol(p, &p, 10);
				if (vks[nvk - 1] < 1 || vks[nvk - 1] > 1024) {
					usage();
					return 2;
				}
				if (*p == ',')
					p++;
				else if (*p) {
					usage();
					return 2;
				}
			}
		} else {
			usage();
			return 2;
		}
	}
	if (!path || n_threads < 1 || n_prompt < 0 || n_gen < 0 || reps < 1 || n_seq < 1 ||
	    n_seq > 256) {
		usage();
		return 2;
	}

	char err[512];
	struct md_model model;
	if (md_model_load(&model, path, err, sizeof(err))) {
		fprintf(stderr, "moed-bench: %s: %s\n", path, err);
		return 1;
	}
	struct bench b = { .m = &model, .rng = 42 };
	int max_tok = n_prompt > n_seq ? n_prompt : n_seq;
	int max_len = n_prompt > n_gen ? n_prompt : n_gen;
	for (int i = 0; i < nvk; i++) {
		max_tok = vks[i] > max_tok ? vks[i] : max_tok;
		max_len = n_prompt + vks[i] > max_len ? n_prompt + vks[i] : max_len;
	}
	uint32_t per_seq = (uint32_t)(max_len + MD_KV_BLOCK_TOKENS) / MD_KV_BLOCK_TOKENS;
	if (md_kv_init_rows(&b.kv, model.hp.n_layer, md_model_kv_rows(&model),
			    per_seq * (uint32_t)n_seq, (uint32_t)n_seq)) {
		fprintf(stderr, "moed-bench: cannot allocate the KV cache\n");
		return 1;
	}
	b.fw = md_forward_new(&model, n_threads, max_tok);
	b.logits = malloc((size_t)(max_tok > n_seq ? max_tok : n_seq) * model.hp.n_vocab * sizeof(float));
	b.tok = malloc((size_t)max_tok * sizeof(int32_t));
	b.seq = malloc((size_t)max_tok * sizeof(int32_t));
	b.pos = malloc((size_t)max_tok * sizeof(int32_t));
	if (!b.fw || !b.logits || !b.tok || !b.seq || !b.pos) {
		fprintf(stderr, "moed-bench: out of memory\n");
		return 1;
	}
	if (trace_path) {
		b.trace = md_route_trace_open(trace_path, model.hp.n_layer, model.hp.n_expert,
					      model.hp.n_expert_used, err, sizeof(err));
		b.trace_seq = malloc((size_t)max_tok * sizeof(uint64_t));
		if (!b.trace || !b.trace_seq) {
			fprintf(stderr, "moed-bench: %s\n", b.trace ? "out of memory" : err);
			return 1;
		}
		md_forward_set_route_cb(b.fw, on_route, &b);
		md_forward_set_pregate_cb(b.fw, on_pregate, &b);
	}

	struct md_expert_store *store = NULL;
	if (cache_mb > 0) {
		struct md_expert_store_config sc = { .host_bytes = (size_t)(cache_mb * 1048576.0),
						     .max_tokens = max_tok, .prefetch = true };
		if (md_expert_store_new(&store, &model, &sc, err, sizeof(err))) {
			fprintf(stderr, "moed-bench: %s\n", err);
			return 1;
		}
		md_forward_set_expert_src(b.fw, md_expert_store_src(store));
	}

	struct dev_run dr = { 0 };
	if (dev_name && dev_setup(&dr, &b, &model, dev_name, tier_mb, on_demand, policy, max_tok))
		return 1;

	struct stat st;
	double gib = stat(path, &st) == 0 ? (double)st.st_size / (1024.0 * 1024 * 1024) : 0;
	const char *name = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
	const struct md_kern *k = md_kern_active();
	/* The weight type named: the first MoE layer's experts (leading dense layers have none),
	 * else the attention output's (every architecture has one; latent attention no wq). */
	const struct md_tensor *wt_of = model.layers[0].wo;
	for (uint32_t l = 0; l < model.hp.n_layer; l++)
		if (model.layers[l].gate_exps) {
			wt_of = model.layers[l].gate_exps;
			break;
		}
	const char *wt = md_dtype_info(wt_of->type)->name;
	if (nvk) {
		struct md_tokenizer *tk = NULL;
		char terr[256];
		if (md_tokenizer_load(&tk, &model.gguf, terr, sizeof(terr)) == 0) {
			int n = md_tokenizer_encode(tk, TEXT, sizeof(TEXT) - 1, false, false, &b.text);
			b.n_text = n > 0 ? n : 0;
			md_tokenizer_free(tk);
		}
		printf("%s: %s experts, %.2f GiB, %d threads, %s kernels; verification steps, context %d, "
		       "%d steps per size and round, %d rounds, %d one-token steps before each; "
		       "tokens: %s\n\n", name, wt, gib, n_threads, k ? k->name : "ref", n_prompt, n_gen,
		       reps, n_iso, b.n_text ? "Genesis 1 (KJV), consecutive" : "pseudo-random ids");
		if (run_verify(&b, vks, nvk, n_prompt, n_gen > 0 ? n_gen : 1, reps, n_iso < 0 ? 0 : n_iso)) {
			fprintf(stderr, "moed-bench: verification steps failed\n");
			return 1;
		}
	} else {
		printf("| model | experts | size | threads | kernels | test | t/s (median) | spread (min..max) |\n");
		printf("| --- | --- | ---: | ---: | --- | --- | ---: | ---: |\n");
	}

	double *rate = malloc(sizeof(double) * (size_t)reps);
	for (int test = 0; test < 2 && !nvk; test++) {
		int n = test == 0 ? n_prompt : n_gen;
		if (n == 0 || (test == 0 && n_prompt == 0))
			continue;
		for (int r = -1; r < reps; r++) {
			double t = test == 0 ? run_pp(&b, n) : run_tg(&b, n, n_seq);
			if (t < 0) {
				fprintf(stderr, "moed-bench: forward failed\n");
				return 1;
			}
			if (r >= 0)
				rate[r] = (double)n * (test == 0 ? 1 : n_seq) / t;
		}
		qsort(rate, (size_t)reps, sizeof(double), cmp_d);
		double med = reps % 2 ? rate[reps / 2] : 0.5 * (rate[reps / 2 - 1] + rate[reps / 2]);
		char tname[32];
		if (test == 0)
			snprintf(tname, sizeof(tname), "pp%d", n);
		else if (n_seq > 1)
			snprintf(tname, sizeof(tname), "tg%d x%d", n, n_seq);
		else
			snprintf(tname, sizeof(tname), "tg%d", n);
		printf("| %s | %s | %.2f GiB | %d | %s | %s | %.2f | %.2f..%.2f |", name, wt, gib, n_threads,
		       dr.b ? dr.b->name : k ? k->name : "ref", tname, med, rate[0], rate[reps - 1]);
		if (dr.bound > 0 && test == 1 && n_seq == 1)
			printf(" %.0f%% of the bound", 100.0 * med / dr.bound);
		printf("\n");
		fflush(stdout);
	}
	free(rate);
	if (store) {
		struct md_expert_store_stats es;
		md_expert_store_get_stats(store, &es);
		printf("\nexpert store: %u of %u experts cached, %llu hits, %llu misses, %.1f MiB read, "
		       "stall %.2f s, prefetch accuracy %.2f\n", es.n_slots,
		       model.hp.n_layer * model.hp.n_expert, (unsigned long long)es.hits,
		       (unsigned long long)es.misses, es.bytes_read / 1048576.0, es.stall_ns / 1e9,
		       es.predicted_total ? (double)es.predicted_used / es.predicted_total : 0.0);
		md_forward_set_expert_src(b.fw, NULL);
		md_expert_store_free(store);
	}
	free(b.logits);
	free(b.tok);
	free(b.seq);
	free(b.pos);
	md_forward_free(b.fw);
	dev_release(&dr);
	if (md_route_trace_close(b.trace) < 0) {
		fprintf(stderr, "moed-bench: writing '%s' failed\n", trace_path);
		return 1;
	}
	free(b.trace_seq);
	md_kv_release(&b.kv);
	free(b.text);
	md_model_free(&model);
	return 0;
}
