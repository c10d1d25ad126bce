/* The draft-model drafter: a second model with the target's vocabulary, batched across
 * sequences (see the DESIGN in draft_model.h). */
#include "engine/draft_model.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/forward_dev.h"
#include "engine/spec.h"
#include "engine/spec_ctl.h"

/* The two files' vocabularies agree: same size, and the same token strings where both carry a
 * tokenizer. Returns 0 or -EINVAL with err set. */
static int same_vocab(const struct md_model *d, const struct md_model *t, char *err, size_t el)
{
	if (d->hp.n_vocab != t->hp.n_vocab) {
		snprintf(err, el, "its vocabulary has %u tokens, the model's %u", d->hp.n_vocab,
			 t->hp.n_vocab);
		return -EINVAL;
	}
	int64_t di = md_gguf_find_key(&d->gguf, "tokenizer.ggml.tokens");
	int64_t ti = md_gguf_find_key(&t->gguf, "tokenizer.ggml.tokens");
	if (di < 0 || ti < 0)
		return 0;
	const struct md_gguf_kv *dk = &d->gguf.kv[di], *tk = &t->gguf.kv[ti];
	if (dk->type != MD_GGUF_ARRAY || tk->type != MD_GGUF_ARRAY || dk->arr_n != tk->arr_n ||
	    !dk->str_offs || !tk->str_offs) {
		snprintf(err, el, "its token list does not match the model's");
		return -EINVAL;
	}
	for (uint64_t i = 0; i < dk->arr_n; i++) {
		struct md_gguf_str a, b;
		if (!md_gguf_arr_str(dk, i, &a) || !md_gguf_arr_str(tk, i, &b) || a.len != b.len ||
		    memcmp(a.ptr, b.ptr, a.len) != 0) {
			snprintf(err, el, "token %llu differs from the model's", (unsigned long long)i);
			return -EINVAL;
		}
	}
	return 0;
}

int md_draft_load(struct md_draft_model *dm, const char *path, const struct md_model *target,
		  struct md_forward_ctx *target_fw, int n_threads, uint32_t max_seqs,
		  uint32_t n_ctx, uint32_t budget, uint32_t kv_mb, char *err, size_t errlen)
{
	memset(dm, 0, sizeof(*dm));
	char why[400] = "";
	int rc = md_model_load(&dm->model, path, why, sizeof(why));
	if (rc) {
		snprintf(err, errlen, "cannot load draft model '%s': %s", path, why);
		return rc;
	}
	dm->loaded = true;
	if ((rc = same_vocab(&dm->model, target, why, sizeof(why)))) {
		snprintf(err, errlen, "draft model '%s' cannot draft for this model: %s", path, why);
		return rc;
	}
	const struct md_hparams *hp = &dm->model.hp;
	dm->n_vocab = hp->n_vocab;
	dm->budget = budget;
	dm->max_seqs = max_seqs;
	const struct md_kv_rows rows = md_model_kv_rows(&dm->model);
	uint64_t block_bytes = MD_KV_BLOCK_TOKENS * md_kv_token_bytes(hp->n_layer, rows);
	uint64_t per_seq = (n_ctx + MD_KV_BLOCK_TOKENS - 1) / MD_KV_BLOCK_TOKENS + 1;
	uint64_t blocks = ((uint64_t)kv_mb << 20) / (block_bytes ? block_bytes : 1);
	if (blocks > per_seq * max_seqs)
		blocks = per_seq * max_seqs;
	if (blocks < per_seq)
		blocks = per_seq;
	if ((rc = md_kv_init_rows(&dm->kv, hp->n_layer, rows, (uint32_t)blocks, max_seqs))) {
		snprintf(err, errlen, "cannot allocate the draft model's KV cache");
		return rc;
	}
	dm->kv_ready = true;
	dm->fw = md_forward_new(&dm->model, n_threads, (int)budget);
	dm->logits = malloc(sizeof(float) * (size_t)max_seqs * dm->n_vocab);
	dm->tok = malloc(sizeof(int32_t) * budget);
	dm->seq = malloc(sizeof(int32_t) * budget);
	dm->pos = malloc(sizeof(int32_t) * budget);
	dm->want = malloc(sizeof(bool) * budget);
	dm->row_seq = malloc(sizeof(*dm->row_seq) * max_seqs);
	if (!dm->fw || !dm->logits || !dm->tok || !dm->seq || !dm->pos || !dm->want ||
	    !dm->row_seq || md_sampler_init(&dm->sm, dm->n_vocab, 1)) {
		snprintf(err, errlen, "out of memory setting up the draft model");
		return -ENOMEM;
	}
	md_forward_share_pool(dm->fw, target_fw);
	return 0;
}

int md_draft_set_device(struct md_draft_model *dm, struct md_backend *b, char *err, size_t errlen)
{
	int rc = md_fwd_dev_new(&dm->model, b, &dm->kv, (int)dm->budget, true, &dm->fdev, err,
				errlen);
	if (!rc) {
		md_forward_set_device(dm->fw, dm->fdev);
		md_kv_drop_rows(&dm->kv); /* its rows live in the device's mirror */
	}
	return rc;
}

void md_draft_release(struct md_draft_model *dm)
{
	if (dm->fw)
		md_forward_free(dm->fw);
	md_fwd_dev_free(dm->fdev);
	if (dm->kv_ready)
		md_kv_release(&dm->kv);
	if (dm->loaded)
		md_model_free(&dm->model);
	free(dm->logits);
	free(dm->tok);
	free(dm->seq);
	free(dm->pos);
	free(dm->want);
	free(dm->row_seq);
	if (dm->sm.n_vocab)
		md_sampler_release(&dm->sm);
	memset(dm, 0, sizeof(*dm));
}

/* The prefix of s's tokens the draft KV keeps: what the draft saw that toks still has (the
 * drafts it was fed that the step accepted), all but the last token (whose logits round 0
 * wants); or, when more than MD_DRAFT_CATCHUP tokens would be missing, only the recent window
 * (DESIGN), *restart set. */
static uint32_t keep_of(const struct md_spec_seq *ss, const struct md_seq *s, bool *restart)
{
	uint32_t keep = ss->dkv_seq >= 0 ? ss->n_dkv : 0;
	uint32_t fed = ss->dkv_seq >= 0 ? ss->n_dfed : 0;
	for (uint32_t j = 0; j < fed && keep < s->n_toks && s->toks[keep] == ss->draft[j]; j++)
		keep++;
	if (keep > s->n_toks - 1)
		keep = s->n_toks - 1;
	*restart = s->n_toks - keep > MD_DRAFT_CATCHUP;
	if (*restart)
		keep = s->n_toks > MD_DRAFT_WINDOW ? s->n_toks - MD_DRAFT_WINDOW : 0;
	return keep;
}

uint32_t md_draft_catchup_rows(const struct md_seq *s)
{
	bool restart;
	return s->n_toks - keep_of(s->spec, s, &restart);
}

/* Bring the draft KV of s in line with its tokens (keep_of), claiming a slot the first time.
 * Returns false when s cannot draft now. */
static bool sync_seq(struct md_draft_model *dm, struct md_seq *s)
{
	struct md_spec_seq *ss = s->spec;
	if (ss->dkv_seq < 0) {
		int sl = md_kv_seq_new(&dm->kv);
		if (sl < 0)
			return false;
		ss->dkv_seq = sl;
		ss->dkv = &dm->kv;
		ss->dkv_base = ss->n_dkv = 0;
		ss->n_dfed = 0;
	}
	bool restart;
	uint32_t keep = keep_of(ss, s, &restart);
	if (restart)
		ss->dkv_base = keep;
	md_kv_truncate(&dm->kv, ss->dkv_seq, keep - ss->dkv_base);
	ss->n_dkv = keep;
	ss->n_dfed = 0;
	return true;
}

/* Draw from q with the sequence's draft RNG (inverse CDF in q's support order). */
static int32_t draw_q(const struct md_sampler_dist *q, uint64_t rng[2])
{
	double u = md_spec_uniform(rng) * q->sum, acc = 0;
	for (uint32_t i = 0; i < q->n; i++) {
		acc += q->w[q->id[i]];
		if (u < acc)
			return q->id[i];
	}
	return q->id[q->n - 1];
}

int md_draft_pick(struct md_sampler *sm, uint32_t n_vocab, struct md_seq *s, uint32_t r,
		  const float *row)
{
	struct md_spec_seq *ss = s->spec;
	const struct md_sampling *p = &s->req->sampling;
	struct md_sampler_ctx ctx = {
		.prompt = s->toks, .n_prompt = s->n_prompt,
		.gen = s->toks + s->n_prompt, .n_gen = s->n_toks - s->n_prompt + r,
	};
	bool greedy = p->temperature <= 1e-6f;
	struct md_sampler_dist *q = &sm->dist;
	int rc = 0;
	if (!greedy) {
		rc = md_spec_seq_alloc_q(ss, r, n_vocab);
		if (rc)
			return rc;
		q = &ss->q[r];
	}
	rc = md_sampler_transform(sm, p, &ctx, row, q->w);
	if (!rc)
		rc = md_sampler_dist_build(q, p, q->w);
	if (rc)
		return rc;
	int32_t d = q->greedy ? q->id[0] : draw_q(q, ss->rng);
	ss->draft[r] = d;
	s->toks[s->n_toks + r] = d;
	ss->draft_q = !q->greedy;
	return 0;
}

static int pick(struct md_draft_model *dm, struct md_seq *s, uint32_t r, const float *row)
{
	return md_draft_pick(&dm->sm, dm->n_vocab, s, r, row);
}

/* One batched forward of the planned rows (n tokens); the logits
 * row of each wanted token goes to dm->logits in batch order. Returns the rows or a negative
 * code.
 *
 * Every round is timed by its rows, the tokens it feeds (md_spec_rounds): a drafting round
 * has one per sequence, a round 0 that also catches sequences up on what the draft missed
 * (the window of the prompt at a request's first draft, the tokens of plain steps after a
 * pause) more, and is a small prefill. The controller charges a plan's rounds by their rows
 * and a sequence's catch-up as the rows it adds to round 0 (md_draft_catchup_rows). Catch-up
 * rounds were once timed apart as seconds per row, smoothed over rounds of every size; a
 * round's fixed cost (the weights read once) then made a 2-row catch-up's rate stand for a
 * prompt's, and at 16 streams of default-1g (Q4_K_M, AVX2) a 108-row catch-up that took
 * 24 ms was charged 94. */
static int run_round(struct md_draft_model *dm, uint32_t n)
{
	struct md_batch b = {
		.n_tokens = (int32_t)n, .tokens = dm->tok, .seq = dm->seq, .pos = dm->pos,
		.want_logits = dm->want,
	};
	struct md_spec_watch w;
	md_spec_watch_start(&w, md_forward_pool(dm->fw));
	int rows = md_forward(dm->fw, &dm->kv, &b, dm->logits);
	double dt = md_spec_watch_read(&w);
	if (rows >= 0)
		md_spec_rounds_observe(&dm->rounds, n, dt);
	return rows;
}

static void add_tok(struct md_draft_model *dm, uint32_t *n, int slot, int32_t tok, uint32_t pos,
		    bool want)
{
	dm->tok[*n] = tok;
	dm->seq[*n] = slot;
	dm->pos[*n] = (int32_t)pos;
	dm->want[*n] = want;
	(*n)++;
}

int md_draft_propose(struct md_draft_model *dm, struct md_seq **seqs, uint32_t *k, uint32_t n)
{
	uint32_t kmax = 0, nt = 0, nr = 0;
	for (uint32_t i = 0; i < n; i++) {
		struct md_seq *s = seqs[i];
		s->spec->n_draft = 0;
		s->spec->draft_q = false;
		if (k[i] == 0 || !sync_seq(dm, s) ||
		    md_kv_reserve(&dm->kv, s->spec->dkv_seq,
				  s->n_toks - s->spec->dkv_base + k[i] - 1)) {
			k[i] = 0;
			continue;
		}
		/* Round 0: catch up; a catch-up beyond the budget goes in pieces, drafts later. */
		struct md_spec_seq *ss = s->spec;
		uint32_t catch = s->n_toks - ss->n_dkv, room = dm->budget - nt;
		if (room == 0 || nr == dm->max_seqs) {
			k[i] = 0;
			continue;
		}
		bool whole = catch <= room;
		uint32_t take = whole ? catch : room;
		for (uint32_t j = 0; j < take; j++)
			add_tok(dm, &nt, ss->dkv_seq, s->toks[ss->n_dkv + j],
				ss->n_dkv + j - ss->dkv_base, whole && j == take - 1);
		if (whole)
			dm->row_seq[nr++] = s;
		else
			k[i] = 0;
		if (k[i] > kmax)
			kmax = k[i];
	}
	if (nt == 0)
		return 0;
	int rows = run_round(dm, nt);
	int rc = rows < 0 ? rows : (uint32_t)rows == nr ? 0 : -EIO;
	for (uint32_t i = 0; i < n && !rc; i++) /* md_forward committed the new lengths */
		if (seqs[i]->spec->dkv_seq >= 0)
			seqs[i]->spec->n_dkv = seqs[i]->spec->dkv_base +
					       md_kv_seq_len(&dm->kv, seqs[i]->spec->dkv_seq);
	for (uint32_t i = 0; i < nr && !rc; i++)
		rc = pick(dm, dm->row_seq[i], 0, dm->logits + (size_t)i * dm->n_vocab);
	/* Rounds 1..kmax-1: feed draft r-1, take draft r. */
	for (uint32_t r = 1; r < kmax && !rc; r++) {
		uint32_t m = 0;
		nt = 0;
		for (uint32_t i = 0; i < n; i++) {
			struct md_seq *s = seqs[i];
			if (k[i] <= r)
				continue;
			add_tok(dm, &nt, s->spec->dkv_seq, s->spec->draft[r - 1],
				s->n_toks + r - 1 - s->spec->dkv_base, true);
			dm->row_seq[m++] = s;
		}
		rows = run_round(dm, nt);
		rc = rows < 0 ? rows : (uint32_t)rows == m ? 0 : -EIO;
		for (uint32_t i = 0; i < m && !rc; i++)
			rc = pick(dm, dm->row_seq[i], r, dm->logits + (size_t)i * dm->n_vocab);
	}
	for (uint32_t i = 0; i < n; i++) {
		struct md_spec_seq *ss = seqs[i]->spec;
		if (rc || k[i] == 0) {
			ss->n_draft = 0;
			if (ss->dkv_seq >= 0)
				md_kv_truncate(&dm->kv, ss->dkv_seq, ss->n_dkv - ss->dkv_base);
			continue;
		}
		ss->n_draft = k[i];
		ss->n_dfed = k[i] - 1;
	}
	return rc;
}
