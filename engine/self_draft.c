/* The self-speculation drafter (see the DESIGN in self_draft.h). */
#include "engine/self_draft.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/draft_model.h"
#include "engine/spec.h"
#include "engine/spec_ctl.h"

/* Parse "1,3" into skip (n_layer). Returns 0 or -EINVAL with err set. */
static int parse_skip(const char *list, uint8_t *skip, uint32_t n_layer, char *err, size_t el)
{
	if (!list)
		return 0;
	const char *p = list;
	while (*p) {
		char *end;
		long l = strtol(p, &end, 10);
		if (end == p || l < 0 || (unsigned long)l >= n_layer) {
			snprintf(err, el, "spec-self-skip: '%s' is not a list of layers 0..%u", list,
				 n_layer - 1);
			return -EINVAL;
		}
		skip[l] = 1;
		p = end;
		if (*p == ',')
			p++;
		else if (*p) {
			snprintf(err, el, "spec-self-skip: '%s' is not a list of layers 0..%u", list,
				 n_layer - 1);
			return -EINVAL;
		}
	}
	return 0;
}

int md_self_draft_init(struct md_self_draft *sd, const struct md_model *m,
		       struct md_forward_ctx *fw, struct md_kv_cache *kv, uint32_t n_used,
		       const char *skip, uint32_t max_seqs, char *err, size_t errlen)
{
	memset(sd, 0, sizeof(*sd));
	const struct md_hparams *hp = &m->hp;
	sd->fw = fw;
	sd->kv = kv;
	sd->n_layer = hp->n_layer;
	sd->n_expert = hp->n_expert;
	sd->n_vocab = hp->n_vocab;
	sd->max_seqs = max_seqs;
	sd->skip = calloc(hp->n_layer, 1);
	sd->predict = calloc((size_t)hp->n_layer * (hp->n_expert ? hp->n_expert : 1), 1);
	sd->plist = malloc(sizeof(int32_t) * (hp->n_expert ? hp->n_expert : 1));
	sd->logits = malloc(sizeof(float) * (size_t)max_seqs * hp->n_vocab);
	sd->tok = malloc(sizeof(int32_t) * max_seqs);
	sd->seq = malloc(sizeof(int32_t) * max_seqs);
	sd->pos = malloc(sizeof(int32_t) * max_seqs);
	sd->want = malloc(sizeof(bool) * max_seqs);
	sd->row_seq = malloc(sizeof(*sd->row_seq) * max_seqs);
	if (!sd->skip || !sd->predict || !sd->plist || !sd->logits || !sd->tok || !sd->seq ||
	    !sd->pos || !sd->want || !sd->row_seq || md_sampler_init(&sd->sm, hp->n_vocab, 1)) {
		snprintf(err, errlen, "out of memory setting up self-speculation");
		return -ENOMEM;
	}
	int rc = parse_skip(skip, sd->skip, hp->n_layer, err, errlen);
	if (rc)
		return rc;
	uint32_t skipped = 0;
	for (uint32_t l = 0; l < hp->n_layer; l++)
		skipped += sd->skip[l];
	if (skipped == hp->n_layer) {
		snprintf(err, errlen, "spec-self-skip: every layer skipped");
		return -EINVAL;
	}
	if (!hp->n_expert && !skipped) {
		snprintf(err, errlen, "self-speculation needs experts to drop or layers to skip "
			 "(a dense model drafting as itself)");
		return -EINVAL;
	}
	uint32_t used = n_used ? n_used : 1;
	if (hp->n_expert && used > hp->n_expert_used)
		used = hp->n_expert_used;
	sd->mode.n_used = used;
	sd->mode.skip = skipped ? sd->skip : NULL;
	sd->ready = true;
	return 0;
}

void md_self_draft_release(struct md_self_draft *sd)
{
	free(sd->skip);
	free(sd->predict);
	free(sd->plist);
	free(sd->logits);
	free(sd->tok);
	free(sd->seq);
	free(sd->pos);
	free(sd->want);
	free(sd->row_seq);
	if (sd->sm.n_vocab)
		md_sampler_release(&sd->sm);
	memset(sd, 0, sizeof(*sd));
}

void md_self_draft_set_src(struct md_self_draft *sd, struct md_expert_src *src)
{
	sd->src = src;
	sd->mode.resident_only = src != NULL;
}

/* One batched draft pass over the round's rows; logits in row order. */
static int run_round(struct md_self_draft *sd, uint32_t n)
{
	struct md_batch b = {
		.n_tokens = (int32_t)n, .tokens = sd->tok, .seq = sd->seq, .pos = sd->pos,
		.want_logits = sd->want,
	};
	struct md_spec_watch w;
	md_spec_watch_start(&w, md_forward_pool(sd->fw));
	md_forward_set_draft(sd->fw, &sd->mode);
	int rows = md_forward(sd->fw, sd->kv, &b, sd->logits);
	md_forward_set_draft(sd->fw, NULL);
	double dt = md_spec_watch_read(&w);
	md_spec_rounds_observe(&sd->rounds, n, dt);
	return rows < 0 ? rows : (uint32_t)rows == n ? 0 : -EIO;
}

/* The exact pass's likely experts, layer by layer, to the source's prefetch. */
static void prefetch_predicted(struct md_self_draft *sd)
{
	for (uint32_t l = 0; l < sd->n_layer; l++) {
		uint8_t *p = sd->predict + (size_t)l * sd->n_expert;
		int n = 0;
		for (uint32_t e = 0; e < sd->n_expert; e++)
			if (p[e])
				sd->plist[n++] = (int32_t)e;
		if (n) {
			md_expert_src_prefetch(sd->src, l, sd->plist, n);
			sd->prefetched += (uint64_t)n;
		}
	}
}

int md_self_draft_propose(struct md_self_draft *sd, struct md_seq **seqs, uint32_t *k, uint32_t n)
{
	uint32_t kmax = 0;
	for (uint32_t i = 0; i < n; i++) {
		struct md_seq *s = seqs[i];
		s->spec->n_draft = 0;
		s->spec->draft_q = false;
		if (k[i] == 0 || s->n_toks != s->n_kv + 1 ||
		    md_kv_reserve(sd->kv, s->kv_seq, s->n_kv + k[i])) {
			k[i] = 0;
			continue;
		}
		kmax = k[i] > kmax ? k[i] : kmax;
	}
	if (kmax == 0)
		return 0;
	bool predict = sd->src && sd->src->ops->prefetch && sd->n_expert;
	if (predict)
		memset(sd->predict, 0, (size_t)sd->n_layer * sd->n_expert);
	sd->mode.predict = predict ? sd->predict : NULL;
	int rc = 0;
	for (uint32_t r = 0; r < kmax && !rc; r++) {
		uint32_t m = 0;
		for (uint32_t i = 0; i < n && m < sd->max_seqs; i++) {
			struct md_seq *s = seqs[i];
			if (k[i] <= r)
				continue;
			sd->tok[m] = r == 0 ? s->toks[s->n_kv] : s->spec->draft[r - 1];
			sd->seq[m] = s->kv_seq;
			sd->pos[m] = (int32_t)(s->n_kv + r);
			sd->want[m] = true;
			sd->row_seq[m++] = s;
		}
		rc = run_round(sd, m);
		for (uint32_t i = 0; i < m && !rc; i++)
			rc = md_draft_pick(&sd->sm, sd->n_vocab, sd->row_seq[i], r,
					   sd->logits + (size_t)i * sd->n_vocab);
	}
	sd->mode.predict = NULL;
	for (uint32_t i = 0; i < n; i++) {
		struct md_seq *s = seqs[i];
		if (k[i] == 0)
			continue;
		md_kv_truncate(sd->kv, s->kv_seq, s->n_kv); /* the draft's rows go (DESIGN) */
		s->spec->n_draft = rc ? 0 : k[i];
		if (rc)
			s->spec->draft_q = false;
	}
	sd->predicted = false;
	if (!rc && predict) {
		prefetch_predicted(sd);
		sd->predicted = true;
	}
	return rc;
}

bool md_self_draft_take_prediction(struct md_self_draft *sd)
{
	bool p = sd->predicted;
	sd->predicted = false;
	return p;
}

const uint8_t *md_self_draft_predicted(const struct md_self_draft *sd, uint32_t l)
{
	return sd->predict + (size_t)l * sd->n_expert;
}
