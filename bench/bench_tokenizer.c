/* bench_tokenizer: encode/decode throughput per tokenizer GGUF on a few MB of mixed text. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/gguf.h"
#include "engine/tokenizer.h"

/* usage: bench_tokenizer [--mb N] [--chunk BYTES] MODEL.gguf...
 * The text is deterministic: English prose, code, digits, whitespace runs, CJK, Arabic,
 * Devanagari, accents and emoji in fixed proportions, cut into prompts of --chunk bytes (at
 * character boundaries) that are encoded one by one, as a server sees them. */

static const char *const parts[] = {
	"The quick brown fox jumps over the lazy dog. ",
	"Mixture-of-experts models route every token to a few experts; ",
	"I'm sure they'll say it's fine, but we've seen what can't work. ",
	"int main(void) {\n\tfor (int i = 0; i < 1024; i++)\n\t\tsum += a[i] * b[i];\n}\n",
	"def f(x):\n    return {\"k\": [1, 2, 3], \"v\": x ** 2}\n\n",
	"https://example.com/v1/chat/completions?stream=true&n=1 ",
	"3141592653589793238462643383279502884197 ",
	"    \n\n\t\t  \r\n",
	("\xe6\xa8\xa1\xe5\x9e\x8b\xe7\x9a\x84\xe4\xb8\x93\xe5\xae\xb6\xe6\xb7\xb7\xe5\x90\x88"
	 "\xe3\x80\x82\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e\xe3\x81\xae\xe3\x83\x86\xe3\x82\xad"
	 "\xe3\x82\xb9\xe3\x83\x88\xe3\x80\x82"),
	("\xd9\x85\xd8\xb1\xd8\xad\xd8\xa8\xd8\xa7 \xd8\xa8\xd8\xa7\xd9\x84\xd8\xb9\xd8\xa7\xd9\x84"
	 "\xd9\x85 "),
	"\xe0\xa4\xa8\xe0\xa4\xae\xe0\xa4\xb8\xe0\xa5\x8d\xe0\xa4\xa4\xe0\xa5\x87 ",
	"caf\xc3\xa9 na\xc3\xafve cafe\xcc\x81 ",
	"\xf0\x9f\x98\x80 \xf0\x9f\x91\xa8\xe2\x80\x8d\xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x91\xa7 ",
};
static const int weights[] = { 20, 15, 10, 8, 8, 4, 3, 4, 6, 3, 3, 3, 2 };

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static char *make_text(size_t size)
{
	char *t = malloc(size + 256);
	size_t o = 0;
	unsigned seed = 12345, total = 0;

	for (size_t i = 0; i < sizeof(weights) / sizeof(weights[0]); i++)
		total += (unsigned)weights[i];
	while (o < size) {
		unsigned r, k = 0;

		seed = seed * 1103515245u + 12345u;
		r = (seed >> 8) % total;
		while (r >= (unsigned)weights[k])
			r -= (unsigned)weights[k++];
		size_t l = strlen(parts[k]);

		memcpy(t + o, parts[k], l);
		o += l;
	}
	t[o] = 0;
	return t;
}

int main(int argc, char **argv)
{
	double mb = 4;
	size_t chunk = 4096;
	int first = 1;

	while (first < argc && argv[first][0] == '-') {
		if (!strcmp(argv[first], "--mb") && first + 1 < argc)
			mb = atof(argv[++first]);
		else if (!strcmp(argv[first], "--chunk") && first + 1 < argc)
			chunk = (size_t)atol(argv[++first]);
		else
			break;
		first++;
	}
	if (first >= argc || mb <= 0 || chunk < 16) {
		fprintf(stderr, "usage: bench_tokenizer [--mb N] [--chunk BYTES] MODEL.gguf...\n");
		return 2;
	}
	size_t size = (size_t)(mb * 1024 * 1024);
	char *text = make_text(size);

	size = strlen(text);
	printf("%-28s %10s %12s %12s %12s\n", "tokenizer", "MB", "encode MB/s", "tokens/s",
	       "decode MB/s");
	for (int a = first; a < argc; a++) {
		struct md_gguf g;
		struct md_tokenizer *t;
		char err[256];
		size_t ntok = 0, nout = 0;
		double t0, t1, t2;
		int32_t *all = NULL;
		size_t all_n = 0, all_cap = 0;

		if (md_gguf_open(&g, argv[a], err, sizeof(err)) ||
		    md_tokenizer_load(&t, &g, err, sizeof(err))) {
			fprintf(stderr, "%s: %s\n", argv[a], err);
			return 1;
		}
		md_gguf_close(&g);
		t0 = now();
		for (size_t off = 0; off < size;) {
			size_t l = chunk < size - off ? chunk : size - off;
			int32_t *ids;
			int n;

			while (off + l < size && ((unsigned char)text[off + l] & 0xC0) == 0x80)
				l++; /* whole characters per prompt */
			n = md_tokenizer_encode(t, text + off, l, false, false, &ids);
			if (n < 0) {
				fprintf(stderr, "encode failed\n");
				return 1;
			}
			if (all_n + (size_t)n > all_cap) {
				all_cap = (all_n + (size_t)n) * 2;
				all = realloc(all, all_cap * sizeof(*all));
			}
			memcpy(all + all_n, ids, (size_t)n * sizeof(*ids));
			all_n += (size_t)n;
			ntok += (size_t)n;
			free(ids);
			off += l;
		}
		t1 = now();
		{
			struct md_detok d;
			char buf[1024];

			md_detok_init(&d, t);
			for (size_t i = 0; i < all_n; i++) {
				int r = md_detok_push(&d, all[i], buf, sizeof(buf));

				nout += r > 0 ? (size_t)r : 0;
			}
		}
		t2 = now();
		printf("%-28s %10.2f %12.2f %12.0f %12.2f\n", argv[a], size / 1048576.0,
		       size / 1048576.0 / (t1 - t0), ntok / (t1 - t0), nout / 1048576.0 / (t2 - t1));
		free(all);
		md_tokenizer_free(t);
	}
	free(text);
	return 0;
}
