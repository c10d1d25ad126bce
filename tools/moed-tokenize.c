/* moed-tokenize: print the token ids of a text, or the text of token ids, for a GGUF model. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/gguf.h"
#include "engine/tokenizer.h"

static void usage(FILE *f)
{
	fputs("usage: moed-tokenize -m MODEL.gguf [--special] [--bos] [--pieces] TEXT\n"
	      "       moed-tokenize -m MODEL.gguf [--special] [--bos] -f FILE   (- for stdin)\n"
	      "       moed-tokenize -m MODEL.gguf [--skip-special] --decode ID,ID,...\n"
	      "  --special       match control tokens (<|im_start|>, <s> ...) written in the text\n"
	      "  --bos           add BOS/EOS as the model's metadata asks\n"
	      "  --pieces        print id<TAB>vocab text, one per line\n"
	      "  --skip-special  leave control tokens out of decoded text\n", f);
}

static char *read_all(const char *path, size_t *len)
{
	FILE *f = strcmp(path, "-") == 0 ? stdin : fopen(path, "rb");
	char *buf = NULL;
	size_t cap = 0, n = 0;

	if (!f)
		return NULL;
	for (;;) {
		if (n == cap) {
			char *nb = realloc(buf, cap ? cap * 2 : 65536);

			if (!nb) {
				free(buf);
				buf = NULL;
				break;
			}
			buf = nb;
			cap = cap ? cap * 2 : 65536;
		}
		size_t r = fread(buf + n, 1, cap - n, f);

		n += r;
		if (r == 0)
			break;
	}
	if (f != stdin)
		fclose(f);
	*len = n;
	return buf;
}

int main(int argc, char **argv)
{
	const char *model = NULL, *text = NULL, *file = NULL, *decode = NULL;
	bool special = false, bos = false, pieces = false, skip_special = false;
	struct md_gguf g;
	struct md_tokenizer *t;
	char err[256];
	int rc;

	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "-m") == 0 && i + 1 < argc)
			model = argv[++i];
		else if (strcmp(argv[i], "-f") == 0 && i + 1 < argc)
			file = argv[++i];
		else if (strcmp(argv[i], "--decode") == 0 && i + 1 < argc)
			decode = argv[++i];
		else if (strcmp(argv[i], "--special") == 0)
			special = true;
		else if (strcmp(argv[i], "--bos") == 0)
			bos = true;
		else if (strcmp(argv[i], "--pieces") == 0)
			pieces = true;
		else if (strcmp(argv[i], "--skip-special") == 0)
			skip_special = true;
		else if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
			usage(stdout);
			return 0;
		} else if (argv[i][0] == '-' && argv[i][1] && !text) {
			fprintf(stderr, "moed-tokenize: unknown option '%s'\n", argv[i]);
			usage(stderr);
			return 2;
		} else if (!text)
			text = argv[i];
		else {
			usage(stderr);
			return 2;
		}
	}
	if (!model || (!text && !file && !decode)) {
		usage(stderr);
		return 2;
	}
	if (md_gguf_open(&g, model, err, sizeof(err))) {
		fprintf(stderr, "moed-tokenize: %s\n", err);
		return 1;
	}
	rc = md_tokenizer_load(&t, &g, err, sizeof(err));
	md_gguf_close(&g);
	if (rc) {
		fprintf(stderr, "moed-tokenize: cannot load tokenizer of '%s': %s\n", model, err);
		return 1;
	}
	rc = 0;
	if (decode) {
		int32_t *ids = NULL;
		size_t n = 0, cap = 0, olen;
		char *out, *end;

		for (const char *p = decode; *p;) {
			long v = strtol(p, &end, 10);

			if (end == p || v < 0 || v > INT32_MAX) {
				fprintf(stderr, "moed-tokenize: bad id list at '%s'\n", p);
				rc = 2;
				goto done_dec;
			}
			if (n == cap) {
				int32_t *ni = realloc(ids, (cap = cap ? cap * 2 : 64) * sizeof(*ids));

				if (!ni) {
					rc = 1;
					goto done_dec;
				}
				ids = ni;
			}
			ids[n++] = (int32_t)v;
			p = end;
			while (*p == ',' || *p == ' ')
				p++;
		}
		if (md_tokenizer_decode(t, ids, n, skip_special, &out, &olen)) {
			fprintf(stderr, "moed-tokenize: cannot decode (id out of range?)\n");
			rc = 1;
			goto done_dec;
		}
		fwrite(out, 1, olen, stdout);
		putchar('\n');
		free(out);
done_dec:
		free(ids);
	} else {
		size_t len = 0;
		char *buf = NULL;
		int32_t *ids;
		int n;

		if (file) {
			buf = read_all(file, &len);
			if (!buf) {
				fprintf(stderr, "moed-tokenize: cannot read '%s': %s\n", file,
					strerror(errno));
				md_tokenizer_free(t);
				return 1;
			}
			text = buf;
		} else {
			len = strlen(text);
		}
		n = md_tokenizer_encode(t, text, len, bos, special, &ids);
		if (n < 0) {
			fprintf(stderr, "moed-tokenize: encode failed: %s\n", strerror(-n));
			rc = 1;
		}
		for (int i = 0; i < n; i++) {
			if (pieces) {
				size_t l;
				const char *s = md_tokenizer_token_text(t, ids[i], &l);

				printf("%d\t%.*s\n", ids[i], (int)l, s);
			} else {
				printf(i ? ",%d" : "%d", ids[i]);
			}
		}
		if (!pieces && n >= 0)
			putchar('\n');
		free(ids);
		free(buf);
	}
	md_tokenizer_free(t);
	return rc;
}
