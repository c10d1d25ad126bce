/* Routing traces: writer and reader (format in route_trace.h). */
#include "engine/route_trace.h"

#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct md_route_trace {
	FILE *f;                /* owned */
	int err;                /* first write error, negative errno */
	uint32_t n_layer, n_expert, n_used;
	uint64_t step;
	uint32_t n_rows;
	const uint64_t *seq;    /* borrowed until flush */
	const int32_t *pos;     /* borrowed until flush */
};

struct md_route_trace *md_route_trace_open(const char *path, uint32_t n_layer, uint32_t n_expert,
					   uint32_t n_used, char *err, size_t errlen)
{
	if (n_used == 0 || n_used > MD_ROUTE_TRACE_MAX_USED || n_used > n_expert) {
		snprintf(err, errlen, "cannot trace routing with %u of %u experts", n_used,
			 n_expert);
		return NULL;
	}
	struct md_route_trace *t = calloc(1, sizeof(*t));
	if (!t) {
		snprintf(err, errlen, "out of memory");
		return NULL;
	}
	t->f = fopen(path, "w");
	if (!t->f) {
		snprintf(err, errlen, "cannot open routing trace '%s': %s", path, strerror(errno));
		free(t);
		return NULL;
	}
	t->n_layer = n_layer;
	t->n_expert = n_expert;
	t->n_used = n_used;
	if (fprintf(t->f, "# moed routing trace 2\n# n_layer %u n_expert %u n_used %u\n", n_layer,
		    n_expert, n_used) < 0 || fflush(t->f) != 0) {
		snprintf(err, errlen, "cannot write routing trace '%s': %s", path, strerror(errno));
		fclose(t->f);
		free(t);
		return NULL;
	}
	return t;
}

int md_route_trace_close(struct md_route_trace *t)
{
	if (!t)
		return 0;
	int rc = t->err;
	if (fclose(t->f) != 0 && rc == 0)
		rc = -errno;
	free(t);
	return rc;
}

void md_route_trace_step(struct md_route_trace *t, uint64_t step, uint32_t n_rows,
			 const uint64_t *seq, const int32_t *pos)
{
	t->step = step;
	t->n_rows = n_rows;
	t->seq = seq;
	t->pos = pos;
}

/* The records of one layer's rows: "[p ]step layer seq pos e_1..e_k[ w_1..w_k]". */
static void write_rows(struct md_route_trace *t, const char *prefix, uint32_t layer,
		       const struct md_routing *r, bool weights)
{
	if (t->err)
		return;
	int k = r->n_used;
	for (int i = 0; i < r->n_tokens && (uint32_t)i < t->n_rows; i++) {
		/* One record in a local buffer, then one fwrite: ~40 bytes at k = 4. */
		char line[64 + MD_ROUTE_TRACE_MAX_USED * 24];
		int n = snprintf(line, sizeof(line), "%s%" PRIu64 " %u %" PRIu64 " %d", prefix,
				 t->step, layer, t->seq[i], t->pos[i]);
		for (int j = 0; j < k && j < MD_ROUTE_TRACE_MAX_USED; j++)
			n += snprintf(line + n, sizeof(line) - (size_t)n, " %d", r->ids[i * k + j]);
		for (int j = 0; weights && j < k && j < MD_ROUTE_TRACE_MAX_USED; j++)
			n += snprintf(line + n, sizeof(line) - (size_t)n, " %.4f",
				      (double)r->w[i * k + j]);
		line[n++] = '\n';
		if (fwrite(line, 1, (size_t)n, t->f) != (size_t)n) {
			t->err = -(errno ? errno : EIO);
			return;
		}
	}
}

void md_route_trace_layer(struct md_route_trace *t, uint32_t layer, const struct md_routing *r)
{
	write_rows(t, "", layer, r, true);
}

void md_route_trace_pregate(struct md_route_trace *t, uint32_t layer, const struct md_routing *r)
{
	write_rows(t, "p ", layer, r, false);
}

void md_route_trace_flush(struct md_route_trace *t)
{
	if (!t->err && fflush(t->f) != 0)
		t->err = -(errno ? errno : EIO);
	t->seq = NULL;
	t->pos = NULL;
	t->n_rows = 0;
}

/* ---- reading ---- */

static int fail(struct md_route_log *log, int rc, char *err, size_t errlen, const char *path,
		uint64_t line, const char *why)
{
	snprintf(err, errlen, "%s:%" PRIu64 ": %s", path, line, why);
	md_route_log_release(log);
	return rc;
}

/* Parse an unsigned decimal field; advances *p past it and the blanks after. */
static bool field_u64(char **p, uint64_t *out)
{
	char *end;
	while (**p == ' ' || **p == '\t')
		(*p)++;
	if (**p < '0' || **p > '9')
		return false;
	errno = 0;
	*out = strtoull(*p, &end, 10);
	if (errno || end == *p)
		return false;
	*p = end;
	return true;
}

static bool field_f(char **p, float *out)
{
	char *end;
	while (**p == ' ' || **p == '\t')
		(*p)++;
	*out = strtof(*p, &end);
	if (end == *p)
		return false;
	*p = end;
	return true;
}

static bool rest_blank(const char *p)
{
	while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
		p++;
	return *p == 0;
}

static int grow(struct md_route_log *log, uint64_t *cap)
{
	uint64_t nc = *cap ? *cap * 2 : 4096;
	struct md_route_rec *r = realloc(log->rec, sizeof(*r) * nc);
	if (!r)
		return -ENOMEM;
	log->rec = r;
	int32_t *e = realloc(log->experts, sizeof(*e) * nc * log->n_used);
	if (!e)
		return -ENOMEM;
	log->experts = e;
	float *w = realloc(log->weights, sizeof(*w) * nc * log->n_used);
	if (!w)
		return -ENOMEM;
	log->weights = w;
	int32_t *pg = realloc(log->pregate, sizeof(*pg) * nc * log->n_used);
	if (!pg)
		return -ENOMEM;
	log->pregate = pg;
	*cap = nc;
	return 0;
}

/* "p" lines of the current step waiting for their records, in file order. */
struct pending {
	struct pend {
		uint64_t seq;
		uint32_t layer, pos;
		bool taken;
		int32_t e[MD_ROUTE_TRACE_MAX_USED];
	} *a;
	size_t n, cap, cursor;
	uint64_t step;
};

static int pending_add(struct pending *pd, const struct pend *x)
{
	if (pd->n == pd->cap) {
		size_t nc = pd->cap ? pd->cap * 2 : 256;
		struct pend *a = realloc(pd->a, sizeof(*a) * nc);
		if (!a)
			return -ENOMEM;
		pd->a = a;
		pd->cap = nc;
	}
	pd->a[pd->n++] = *x;
	return 0;
}

/* The prediction for (layer, seq, pos) of the current step, or NULL. Records come in the
 * order their predictions did, so the search starts where the last one matched. */
static const struct pend *pending_take(struct pending *pd, uint32_t layer, uint64_t seq,
				       uint32_t pos)
{
	for (size_t k = 0; k < pd->n; k++) {
		size_t i = (pd->cursor + k) % pd->n;
		struct pend *x = &pd->a[i];
		if (!x->taken && x->layer == layer && x->seq == seq && x->pos == pos) {
			x->taken = true;
			pd->cursor = i + 1;
			return x;
		}
	}
	return NULL;
}

/* A "p" line (after its "p"): into pd, which is emptied when the step changes. */
static bool parse_pregate(struct md_route_log *log, char *p, struct pending *pd, int *rc)
{
	uint64_t step, layer, seq, pos;
	struct pend x = { 0 };
	*rc = 0;
	if (!field_u64(&p, &step) || !field_u64(&p, &layer) || !field_u64(&p, &seq) ||
	    !field_u64(&p, &pos) || pos > UINT32_MAX || layer >= log->n_layer)
		return false;
	for (uint32_t j = 0; j < log->n_used; j++) {
		uint64_t e = 0;
		if (!field_u64(&p, &e) || e >= log->n_expert)
			return false;
		x.e[j] = (int32_t)e;
	}
	if (!rest_blank(p))
		return false;
	if (pd->n == 0 || step != pd->step) {
		pd->n = 0;
		pd->cursor = 0;
		pd->step = step;
	}
	x.seq = seq;
	x.layer = (uint32_t)layer;
	x.pos = (uint32_t)pos;
	*rc = pending_add(pd, &x);
	return true;
}

int md_route_log_read(struct md_route_log *log, const char *path, char *err, size_t errlen)
{
	memset(log, 0, sizeof(*log));
	FILE *f = fopen(path, "r");
	if (!f) {
		int rc = -errno;
		snprintf(err, errlen, "cannot open '%s': %s", path, strerror(errno));
		return rc;
	}
	char *buf = NULL;
	size_t bufcap = 0;
	uint64_t lineno = 0, cap = 0;
	int rc = 0;
	bool have_magic = false, have_shape = false;
	struct pending pd = { 0 };
	while (getline(&buf, &bufcap, f) >= 0) {
		lineno++;
		if (buf[0] == '#') {
			unsigned a, b, c;
			int v;
			if (!have_magic) {
				if (sscanf(buf, "# moed routing trace %d", &v) != 1 || v < 1 ||
				    v > 2) {
					rc = fail(log, -EINVAL, err, errlen, path, lineno,
						  "not a moed routing trace (version 1 or 2)");
					break;
				}
				have_magic = true;
			} else if (!have_shape) {
				int nf = sscanf(buf, "# n_layer %u n_expert %u n_used %u", &a, &b,
						&c);
				if (nf != 3 || a == 0 || b == 0 || c == 0 || c > b ||
				    c > MD_ROUTE_TRACE_MAX_USED) {
					rc = fail(log, -EINVAL, err, errlen, path, lineno,
						  "bad shape line (n_layer, n_expert, n_used)");
					break;
				}
				log->n_layer = a;
				log->n_expert = b;
				log->n_used = c;
				have_shape = true;
			}
			continue;
		}
		if (rest_blank(buf))
			continue;
		if (!have_shape) {
			rc = fail(log, -EINVAL, err, errlen, path, lineno,
				  "record before the header");
			break;
		}
		if (buf[0] == 'p' && have_shape) {
			if (!parse_pregate(log, buf + 1, &pd, &rc)) {
				rc = fail(log, -EINVAL, err, errlen, path, lineno,
					  "malformed pre-gating line");
				break;
			}
			if (rc) {
				rc = fail(log, rc, err, errlen, path, lineno, "out of memory");
				break;
			}
			continue;
		}
		if (log->n_rec == cap && (rc = grow(log, &cap)) != 0) {
			rc = fail(log, rc, err, errlen, path, lineno, "out of memory");
			break;
		}
		struct md_route_rec *r = &log->rec[log->n_rec];
		uint64_t layer, pos;
		char *p = buf;
		if (!field_u64(&p, &r->step) || !field_u64(&p, &layer) || !field_u64(&p, &r->seq) ||
		    !field_u64(&p, &pos) || pos > UINT32_MAX) {
			rc = fail(log, -EINVAL, err, errlen, path, lineno, "malformed record");
			break;
		}
		if (layer >= log->n_layer) {
			rc = fail(log, -EINVAL, err, errlen, path, lineno, "layer out of range");
			break;
		}
		if (log->n_rec && r->step < log->rec[log->n_rec - 1].step) {
			rc = fail(log, -EINVAL, err, errlen, path, lineno, "step goes backwards");
			break;
		}
		r->layer = (uint32_t)layer;
		r->pos = (uint32_t)pos;
		r->first = log->n_rec * log->n_used;
		bool ok = true;
		for (uint32_t j = 0; j < log->n_used && ok; j++) {
			uint64_t e = 0;
			ok = field_u64(&p, &e) && e < log->n_expert;
			log->experts[r->first + j] = (int32_t)e;
		}
		for (uint32_t j = 0; j < log->n_used && ok; j++)
			ok = field_f(&p, &log->weights[r->first + j]);
		if (!ok || !rest_blank(p)) {
			rc = fail(log, -EINVAL, err, errlen, path, lineno,
				  "bad experts or weights (n_used of each, experts < n_expert)");
			break;
		}
		const struct pend *x = pd.n && pd.step == r->step ?
			pending_take(&pd, r->layer, r->seq, r->pos) : NULL;
		r->has_pregate = x != NULL;
		for (uint32_t j = 0; j < log->n_used; j++)
			log->pregate[r->first + j] = x ? x->e[j] : -1;
		log->n_pregate += x != NULL;
		log->n_rec++;
	}
	if (rc == 0 && !have_shape)
		rc = fail(log, -EINVAL, err, errlen, path, lineno ? lineno : 1,
			  "no header (empty file?)");
	free(buf);
	free(pd.a);
	fclose(f);
	return rc;
}

void md_route_log_release(struct md_route_log *log)
{
	free(log->rec);
	free(log->experts);
	free(log->weights);
	free(log->pregate);
	memset(log, 0, sizeof(*log));
}
