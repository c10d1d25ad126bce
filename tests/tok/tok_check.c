/* Compares moed's tokenizer with reference ids (oracle.mjs output) for one model family. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/gguf.h"
#include "engine/tokenizer.h"

/* usage: tok_check MODEL.gguf ORACLE.tsv NAME
 * Per line of ORACLE.tsv (hex text, ids, hex expected decode, hf-decode-ok) it checks:
 *   ids      encode(parse_special) equals the reference ids exactly;
 *   decode   decoding those ids gives the expected text (the input, NFC'd where the family
 *            normalises);
 *   nospec   without parse_special: same ids when the reference has no control token, else
 *            no control token in the output and the text still decodes back;
 *   stream   pushing the ids one by one through md_detok gives the same text, every event
 *            being complete UTF-8;
 *   bos      encode(add_bos) is the same ids behind BOS when the model adds one. */

static unsigned char *unhex(const char *s, size_t n, size_t *out_n)
{
	unsigned char *o = malloc(n / 2 + 1);

	for (size_t i = 0; i + 1 < n; i += 2) {
		unsigned v;

		sscanf(s + i, "%2x", &v);
		o[i / 2] = (unsigned char)v;
	}
	*out_n = n / 2;
	return o;
}

static size_t parse_ids(const char *s, size_t n, int32_t **ids)
{
	size_t cnt = 0, cap = 16;
	char *end;

	*ids = malloc(cap * sizeof(**ids));
	for (size_t i = 0; i < n;) {
		long v = strtol(s + i, &end, 10);

		if (end == s + i)
			break;
		if (cnt == cap)
			*ids = realloc(*ids, (cap *= 2) * sizeof(**ids));
		(*ids)[cnt++] = (int32_t)v;
		i = (size_t)(end - s);
		if (i < n && s[i] == ',')
			i++;
	}
	return cnt;
}

static bool utf8_complete(const char *s, size_t n)
{
	const unsigned char *u = (const unsigned char *)s;

	for (size_t i = 0; i < n;) {
		size_t l = u[i] < 0x80 ? 1 : u[i] < 0xC2 ? 0 : u[i] < 0xE0 ? 2 : u[i] < 0xF0 ? 3 :
			   u[i] < 0xF5 ? 4 : 0;

		if (!l || i + l > n)
			return false;
		for (size_t k = 1; k < l; k++)
			if ((u[i + k] & 0xC0) != 0x80)
				return false;
		i += l;
	}
	return true;
}

static void print_ids(const char *what, const int32_t *ids, size_t n)
{
	fprintf(stderr, "    %s:", what);
	for (size_t i = 0; i < n && i < 40; i++)
		fprintf(stderr, " %d", ids[i]);
	fprintf(stderr, n > 40 ? " ... (%zu)\n" : "\n", n);
}

static void print_text(const char *what, const unsigned char *s, size_t n)
{
	fprintf(stderr, "    %s: \"", what);
	for (size_t i = 0; i < n && i < 160; i++)
		fprintf(stderr, s[i] >= 0x20 && s[i] != '"' && s[i] != '\\' ? "%c" : "\\x%02x", s[i]);
	fprintf(stderr, n > 160 ? "\"... (%zu bytes)\n" : "\"\n", n);
}

static bool has_control(const struct md_tokenizer *t, const int32_t *ids, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		enum md_token_type ty = md_tokenizer_type(t, ids[i]);

		if (ty == MD_TOKEN_CONTROL || ty == MD_TOKEN_UNKNOWN)
			return true;
	}
	return false;
}

int main(int argc, char **argv)
{
	struct md_gguf g;
	struct md_tokenizer *t;
	char err[256], *line = NULL;
	size_t lcap = 0;
	FILE *f;
	unsigned n = 0, ok_ids = 0, ok_dec = 0, ok_nospec = 0, ok_stream = 0, ok_bos = 0;
	unsigned hf_dec = 0, shown = 0;
	ssize_t ll;

	if (argc != 4 && argc != 5) {
		fprintf(stderr, "usage: tok_check MODEL.gguf ORACLE.tsv NAME [IDS.tsv]\n");
		return 2;
	}
	if (md_gguf_open(&g, argv[1], err, sizeof(err))) {
		fprintf(stderr, "cannot open '%s': %s\n", argv[1], err);
		return 1;
	}
	if (md_tokenizer_load(&t, &g, err, sizeof(err))) {
		fprintf(stderr, "cannot load tokenizer: %s\n", err);
		return 1;
	}
	md_gguf_close(&g);
	f = fopen(argv[2], "r");
	if (!f) {
		fprintf(stderr, "cannot open '%s': %s\n", argv[2], strerror(errno));
		return 1;
	}
	while ((ll = getline(&line, &lcap, f)) > 0) {
		char *c1, *c2, *c3, *c4;
		unsigned char *text, *want, *hfd;
		size_t tn, wn, rn, hn;
		int32_t *ref, *got = NULL, *ns = NULL, *wb = NULL;
		int gn, nn, bn;
		char *dec = NULL;
		size_t dn = 0;
		bool e_ids, e_dec, e_ns, e_st, e_bos;

		if (line[ll - 1] == '\n')
			line[--ll] = 0;
		c1 = strchr(line, '\t');
		c2 = c1 ? strchr(c1 + 1, '\t') : NULL;
		c3 = c2 ? strchr(c2 + 1, '\t') : NULL;
		c4 = c3 ? strchr(c3 + 1, '\t') : NULL;
		if (!c4)
			continue;
		n++;
		text = unhex(line, (size_t)(c1 - line), &tn);
		rn = parse_ids(c1 + 1, (size_t)(c2 - c1 - 1), &ref);
		want = unhex(c2 + 1, (size_t)(c3 - c2 - 1), &wn);
		hf_dec += c3[1] == '1';
		/* the decode is checked against Hugging Face's (which keeps, e.g., the space the
		 * encoder put after an added token), not against the text */
		hfd = unhex(c4 + 1, strlen(c4 + 1), &hn);

		gn = md_tokenizer_encode(t, (const char *)text, tn, false, true, &got);
		e_ids = gn >= 0 && (size_t)gn == rn && (rn == 0 || !memcmp(got, ref, rn * sizeof(*ref)));
		ok_ids += e_ids;

		e_dec = gn >= 0 && md_tokenizer_decode(t, got, (size_t)gn, false, &dec, &dn) == 0 &&
			dn == hn && !memcmp(dec, hfd, hn);
		ok_dec += e_dec;

		nn = md_tokenizer_encode(t, (const char *)text, tn, false, false, &ns);
		if (!has_control(t, ref, rn)) {
			e_ns = nn >= 0 && (size_t)nn == rn &&
			       (rn == 0 || !memcmp(ns, ref, rn * sizeof(*ref)));
		} else {
			char *d2 = NULL;
			size_t d2n = 0;

			/* no special tokens: no spaces after them either, the text comes back */
			e_ns = nn >= 0 && !has_control(t, ns, (size_t)nn) &&
			       md_tokenizer_decode(t, ns, (size_t)nn, false, &d2, &d2n) == 0 &&
			       d2n == wn && !memcmp(d2, want, wn);
			free(d2);
		}
		ok_nospec += e_ns;

		{
			struct md_detok d;
			char buf[MD_DETOK_MIN_CAP * 4];
			char *acc = malloc(dn * 2 + 64);
			size_t an = 0;
			int r = 0;

			md_detok_init(&d, t);
			e_st = gn >= 0;
			for (int i = 0; i < gn && e_st; i++) {
				r = md_detok_push(&d, got[i], buf, sizeof(buf));
				if (r < 0 || !utf8_complete(buf, (size_t)r) || an + (size_t)r > dn * 2 + 64) {
					e_st = false;
					break;
				}
				memcpy(acc + an, buf, (size_t)r);
				an += (size_t)r;
			}
			r = md_detok_flush(&d, buf, sizeof(buf));
			if (e_st && r >= 0 && an + (size_t)r <= dn * 2 + 64) {
				memcpy(acc + an, buf, (size_t)r);
				an += (size_t)r;
			}
			e_st = e_st && dec && an == dn && !memcmp(acc, dec, dn);
			free(acc);
		}
		ok_stream += e_st;

		bn = md_tokenizer_encode(t, (const char *)text, tn, true, true, &wb);
		{
			int off = md_tokenizer_add_bos(t) ? 1 : 0;

			e_bos = bn == gn + off && (!off || wb[0] == md_tokenizer_bos(t)) &&
				(gn <= 0 || !memcmp(wb + off, got, (size_t)gn * sizeof(*got)));
		}
		ok_bos += e_bos;

		if ((!e_ids || !e_dec || !e_ns || !e_st || !e_bos) && shown++ < 12) {
			fprintf(stderr, "%s: string %u:%s%s%s%s%s\n", argv[3], n - 1,
				e_ids ? "" : " ids", e_dec ? "" : " decode", e_ns ? "" : " nospecial",
				e_st ? "" : " stream", e_bos ? "" : " bos");
			print_text("text", text, tn);
			if (!e_ids) {
				print_ids("want", ref, rn);
				print_ids("got ", got, gn > 0 ? (size_t)gn : 0);
			}
			if (!e_dec && dec) {
				print_text("decoded", (unsigned char *)dec, dn);
				print_text("HF     ", hfd, hn);
			}
		}
		free(text);
		free(want);
		free(hfd);
		free(ref);
		free(got);
		free(ns);
		free(wb);
		free(dec);
	}
	fclose(f);
	/* id sequences made to decode badly, against Hugging Face's decode */
	unsigned n_seq = 0, ok_seq = 0;
	if (argc == 5 && (f = fopen(argv[4], "r"))) {
		while ((ll = getline(&line, &lcap, f)) > 0) {
			char *tab = strchr(line, '\t'), *dec = NULL;
			int32_t *ids = NULL;
			size_t wn, dn = 0, ni;
			unsigned char *want;

			if (line[ll - 1] == '\n')
				line[--ll] = 0;
			if (!tab)
				continue;
			n_seq++;
			ni = parse_ids(line, (size_t)(tab - line), &ids);
			want = unhex(tab + 1, strlen(tab + 1), &wn);
			bool ok = md_tokenizer_decode(t, ids, ni, false, &dec, &dn) == 0 && dn == wn &&
				  !memcmp(dec, want, wn);
			ok_seq += ok;
			if (!ok && shown++ < 12) {
				fprintf(stderr, "%s: id sequence %u decodes differently\n", argv[3],
					n_seq - 1);
				print_ids("ids", ids, ni);
				print_text("HF  ", want, wn);
				if (dec)
					print_text("moed", (unsigned char *)dec, dn);
			}
			free(ids);
			free(want);
			free(dec);
		}
		fclose(f);
	}
	free(line);
	md_tokenizer_free(t);
	printf("tok %s: ids %u/%u, decode %u/%u, no-special %u/%u, stream %u/%u, bos %u/%u "
	       "(reference's own decode round trip %u/%u), bad id sequences %u/%u\n", argv[3],
	       ok_ids, n, ok_dec, n, ok_nospec, n, ok_stream, n, ok_bos, n, hf_dec, n, ok_seq,
	       n_seq);
	if (n < 200) {
		printf("tok %s: only %u strings, want >= 200\n", argv[3], n);
		return 1;
	}
	if (argc == 5 && n_seq < 200) {
		printf("tok %s: only %u id sequences, want >= 200\n", argv[3], n_seq);
		return 1;
	}
	return ok_ids == n && ok_dec == n && ok_nospec == n && ok_stream == n && ok_bos == n &&
	       ok_seq == n_seq ? 0 : 1;
}
