/* moed-run: greedy generation from token ids on any GGUF, for debugging the engine. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/forward.h"
#include "engine/kv_cache.h"
#include "engine/model.h"

#define MAX_SEQS 64

struct seq {
	int32_t *prompt;
	int n_prompt;
	int32_t *gen;
	int n_gen;
	int kv;
	int fed; /* prompt tokens already in the cache */
};

static double now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void usage(FILE *o)
{
	fprintf(o,
		"usage: moed-run -m MODEL.gguf -p IDS[;IDS...] [-n N] [--chunk C] [-t THREADS]\n"
		"                [--dump-logits PATH] [--kv-f32]\n"
		"  -p IDS          prompt(s): comma-separated token ids, ';' between sequences\n"
		"  -n N            greedy tokens to generate per sequence (default 16)\n"
		"  --chunk C       prefill micro-batches of at most C tokens, round-robin over sequences\n"
		"  -t THREADS      compute threads (default 1)\n"
		"  --dump-logits P write float32 logits of every prompt position and generation step\n"
		"  -v              print each decode step's tokens and time\n"
		"  --kv-f32        cache latent attention's rows in float, not half\n");
}

static int parse_prompts(const char *arg, struct seq *seqs, int *n_seqs)
{
	*n_seqs = 0;
	const char *p = arg;
	while (*p) {
		if (*n_seqs == MAX_SEQS)
			return -E2BIG;
		struct seq *s = &seqs[(*n_seqs)++];
		memset(s, 0, sizeof(*s));
		size_t cap = 16;
		s->prompt = malloc(cap * sizeof(int32_t));
		while (*p && *p != ';') {
			char *end;
			long v = strtol(p, &end, 10);
			if (end == p || v < 0 || v > 0x7fffffff)
				return -EINVAL;
			if ((size_t)s->n_prompt == cap) {
				cap *= 2;
				s->prompt = realloc(s->prompt, cap * sizeof(int32_t));
			}
			s->prompt[s->n_prompt++] = (int32_t)v;
			p = end;
			while (*p == ',' || *p == ' ')
				p++;
		}
		if (s->n_prompt == 0)
			return -EINVAL;
		if (*p == ';')
			p++;
	}
	return *n_seqs ? 0 : -EINVAL;
}

static int argmax(const float *v, uint32_t n)
{
	uint32_t best = 0;
	for (uint32_t i = 1; i < n; i++)
		if (v[i] > v[best])
			best = i;
	return (int)best;
}

int main(int argc, char **argv)
{
	const char *model_path = NULL, *prompts = NULL, *dump = NULL;
	int n_gen = 16, chunk = 0, n_threads = 1;
	bool verbose = false, kv_f32 = false;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		const char *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
			usage(stdout);
			return 0;
		} else if (!strcmp(a, "-m") && v) {
			model_path = v, i++;
		} else if (!strcmp(a, "-p") && v) {
			prompts = v, i++;
		} else if (!strcmp(a, "-n") && v) {
			n_gen = atoi(v), i++;
		} else if (!strcmp(a, "--chunk") && v) {
			chunk = atoi(v), i++;
		} else if (!strcmp(a, "-t") && v) {
			n_threads = atoi(v), i++;
		} else if (!strcmp(a, "-v")) {
			verbose = true;
		} else if (!strcmp(a, "--kv-f32")) {
			kv_f32 = true;
		} else if (!strcmp(a, "--dump-logits") && v) {
			dump = v, i++;
		} else {
			fprintf(stderr, "moed-run: unknown or incomplete option '%s'\n", a);
			usage(stderr);
			return 2;
		}
	}
	if (!model_path || !prompts || n_gen < 0 || chunk < 0 || n_threads < 1) {
		usage(stderr);
		return 2;
	}

	struct seq seqs[MAX_SEQS];
	int n_seqs;
	if (parse_prompts(prompts, seqs, &n_seqs)) {
		fprintf(stderr, "moed-run: bad -p '%s': expected ids like 1,2,3;4,5\n", prompts);
		return 2;
	}

	char err[512];
	struct md_model model;
	double t0 = now_ms();
	if (md_model_load(&model, model_path, err, sizeof(err))) {
		fprintf(stderr, "moed-run: %s: %s\n", model_path, err);
		return 1;
	}
	double t_load = now_ms() - t0;
	const uint32_t V = model.hp.n_vocab;
	for (int s = 0; s < n_seqs; s++)
		for (int i = 0; i < seqs[s].n_prompt; i++)
			if ((uint32_t)seqs[s].prompt[i] >= V) {
				fprintf(stderr, "moed-run: token id %d out of range (n_vocab %u)\n",
					seqs[s].prompt[i], V);
				return 1;
			}

	int total_prompt = 0, max_len = 0;
	for (int s = 0; s < n_seqs; s++) {
		total_prompt += seqs[s].n_prompt;
		if (seqs[s].n_prompt + n_gen > max_len)
			max_len = seqs[s].n_prompt + n_gen;
	}
	int max_batch = total_prompt > n_seqs ? total_prompt : n_seqs;
	if (chunk > 0 && chunk < max_batch)
		max_batch = chunk > n_seqs ? chunk : n_seqs;

	struct md_kv_cache kv;
	uint32_t blocks_per_seq = (uint32_t)(max_len + MD_KV_BLOCK_TOKENS - 1) / MD_KV_BLOCK_TOKENS;
	struct md_kv_rows kv_rows = md_model_kv_rows(&model);
	kv_rows.k_half = kv_rows.k_half && !kv_f32;
	if (md_kv_init_rows(&kv, model.hp.n_layer, kv_rows,
			    blocks_per_seq * (uint32_t)n_seqs, (uint32_t)n_seqs)) {
		fprintf(stderr, "moed-run: cannot allocate the KV cache\n");
		return 1;
	}
	struct md_forward_ctx *fw = md_forward_new(&model, n_threads, max_batch);
	if (!fw) {
		fprintf(stderr, "moed-run: cannot allocate forward buffers\n");
		return 1;
	}

	float *logits = malloc((size_t)max_batch * V * sizeof(float));
	int32_t *tok = malloc((size_t)max_batch * sizeof(int32_t));
	int32_t *sq = malloc((size_t)max_batch * sizeof(int32_t));
	int32_t *pos = malloc((size_t)max_batch * sizeof(int32_t));
	bool *want = malloc((size_t)max_batch * sizeof(bool));
	int *owner = malloc((size_t)max_batch * sizeof(int));
	/* Per-sequence dump rows: prompt positions then generation steps. */
	float **rows = calloc((size_t)n_seqs, sizeof(float *));
	FILE *df = NULL;
	if (dump) {
		df = fopen(dump, "wb");
		if (!df) {
			fprintf(stderr, "moed-run: cannot open '%s': %s\n", dump, strerror(errno));
			return 1;
		}
	}
	for (int s = 0; s < n_seqs; s++) {
		seqs[s].kv = md_kv_seq_new(&kv);
		md_kv_reserve(&kv, seqs[s].kv, (uint32_t)(seqs[s].n_prompt + n_gen));
		seqs[s].gen = malloc(((size_t)n_gen + 1) * sizeof(int32_t));
		if (dump)
			rows[s] = malloc((size_t)(seqs[s].n_prompt + n_gen) * V * sizeof(float));
	}

	/* Prefill: micro-batches of at most `chunk` tokens, round-robin across sequences. */
	double t1 = now_ms();
	int remaining = total_prompt;
	int n_batches = 0;
	while (remaining > 0) {
		int n = 0;
		int limit = chunk > 0 ? chunk : total_prompt;
		bool progress = true;
		while (n < limit && progress) {
			progress = false;
			for (int s = 0; s < n_seqs && n < limit; s++) {
				struct seq *q = &seqs[s];
				if (q->fed >= q->n_prompt)
					continue;
				/* keep one sequence's tokens in order within the batch */
				tok[n] = q->prompt[q->fed];
				sq[n] = q->kv;
				pos[n] = q->fed;
				want[n] = dump != NULL || q->fed == q->n_prompt - 1;
				owner[n] = s;
				q->fed++;
				n++;
				progress = true;
			}
		}
		struct md_batch b = { n, tok, sq, pos, want, NULL };
		int got = md_forward(fw, &kv, &b, logits);
		if (got < 0) {
			fprintf(stderr, "moed-run: forward failed: %d\n", got);
			return 1;
		}
		int r = 0;
		for (int i = 0; i < n; i++) {
			if (!want[i])
				continue;
			struct seq *q = &seqs[owner[i]];
			const float *lr = logits + (size_t)r * V;
			if (dump)
				memcpy(rows[owner[i]] + (size_t)pos[i] * V, lr, (size_t)V * sizeof(float));
			if (pos[i] == q->n_prompt - 1 && n_gen > 0)
				q->gen[q->n_gen++] = argmax(lr, V);
			r++;
		}
		remaining -= n;
		n_batches++;
	}
	double t_prefill = now_ms() - t1;

	/* Decode: every sequence steps together, each at its own position. */
	double t2 = now_ms();
	int steps = 0;
	for (int step = 1; step < n_gen; step++) {
		int n = 0;
		for (int s = 0; s < n_seqs; s++) {
			struct seq *q = &seqs[s];
			tok[n] = q->gen[q->n_gen - 1];
			sq[n] = q->kv;
			pos[n] = q->n_prompt + q->n_gen - 1;
			want[n] = true;
			owner[n] = s;
			n++;
		}
		struct md_batch b = { n, tok, sq, pos, want, NULL };
		double ts = now_ms();
		int got = md_forward(fw, &kv, &b, logits);
		if (verbose)
			fprintf(stderr, "# step %d: %.2f ms\n", step, now_ms() - ts);
		if (got != n) {
			fprintf(stderr, "moed-run: forward failed: %d\n", got);
			return 1;
		}
		for (int i = 0; i < n; i++) {
			struct seq *q = &seqs[owner[i]];
			const float *lr = logits + (size_t)i * V;
			if (dump)
				memcpy(rows[owner[i]] + (size_t)pos[i] * V, lr, (size_t)V * sizeof(float));
			q->gen[q->n_gen++] = argmax(lr, V);
			if (verbose)
				fprintf(stderr, "#   seq %d pos %d -> %d\n", owner[i], pos[i] + 1, q->gen[q->n_gen - 1]);
		}
		steps++;
	}
	double t_decode = now_ms() - t2;

	for (int s = 0; s < n_seqs; s++) {
		printf("seq %d:", s);
		for (int i = 0; i < seqs[s].n_gen; i++)
			printf(" %d", seqs[s].gen[i]);
		printf("\n");
		if (df) {
			size_t nrows = (size_t)seqs[s].n_prompt + (n_gen > 0 ? (size_t)n_gen - 1 : 0);
			if (fwrite(rows[s], sizeof(float) * V, nrows, df) != nrows) {
				fprintf(stderr, "moed-run: short write to '%s'\n", dump);
				return 1;
			}
		}
	}
	printf("# model %s: arch %s, %u layers, n_embd %u, %u experts (%u used), n_vocab %u\n",
	       model_path, model.hp.arch_name, model.hp.n_layer, model.hp.n_embd, model.hp.n_expert,
	       model.hp.n_expert_used, V);
	printf("# load %.1f ms; prefill %d tokens in %d batches, %.1f ms (%.1f tok/s)\n", t_load,
	       total_prompt, n_batches, t_prefill, t_prefill > 0 ? total_prompt * 1e3 / t_prefill : 0);
	if (steps)
		printf("# decode %d steps x %d seqs, %.1f ms (%.2f ms/step, %.1f tok/s)\n", steps, n_seqs,
		       t_decode, t_decode / steps, steps * n_seqs * 1e3 / t_decode);
	if (df && fclose(df)) {
		fprintf(stderr, "moed-run: cannot write '%s'\n", dump);
		return 1;
	}
	for (int s = 0; s < n_seqs; s++) {
		free(seqs[s].prompt);
		free(seqs[s].gen);
		free(rows[s]);
	}
	free(rows);
	free(logits);
	free(tok);
	free(sq);
	free(pos);
	free(want);
	free(owner);
	md_forward_free(fw);
	md_kv_release(&kv);
	md_model_free(&model);
	return 0;
}
