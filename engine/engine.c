/* The engine thread: model ownership, the request and event queues, loading, the step loop. */
#include "engine/engine.h"

/*
 * DESIGN
 * One thread owns the model, the KV cache, the forward context, the scheduler and every
 * sequence. The loop thread talks to it through two mutex-protected lists: submissions and
 * cancellations in (the engine sleeps on a condition variable when it has nothing to do) and
 * events out (the wake callback, uv_async_send, fires when that list goes from empty to
 * non-empty). Both sides detach a whole list under the lock and work on it unlocked; no lock
 * is held while taking another.
 *
 * A step: the scheduler plans a batch (sched.h: admission, preemption, fair service order,
 * chunked prefill), the forward pass computes it, the scheduler commits it, and every logits
 * row is sampled; tokens and finished requests become events, staged during the step and
 * handed over under one lock at its end. Cancellation is a message: the sequence leaves at
 * the next step and its blocks return to the pool.
 *
 * Every request carries its DONE event from submission (allocated on the caller's thread), so
 * running out of memory later can drop a token event but never leaves a request hanging.
 *
 * Every token of a sequence is a row in the batch and every row is computed the same way
 * whatever else shares the batch, so greedy output does not depend on batch composition.
 */

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/assert.h"
#include "common/log.h"
#include "engine/forward.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "engine/sched.h"
#include "engine/text.h"

struct cancel_msg {
	uint64_t id;
	struct cancel_msg *next;
};

struct md_engine {
	struct md_engine_config cfg;     /* strings owned (copied in md_engine_new) */
	md_engine_wake_cb wake;
	void *wake_arg;                  /* borrowed */
	pthread_t thread;
	bool started;
	_Atomic int state;
	char err[1024];

	/* submit side (sub_mu) */
	pthread_mutex_t sub_mu;
	pthread_cond_t sub_cv;
	struct md_engine_req *sub_head, *sub_tail; /* owned */
	struct cancel_msg *cancels;      /* owned */
	bool stop;
	_Atomic uint32_t n_submitted;    /* on the submit list, not yet taken by the engine */
	_Atomic uint32_t n_waiting;      /* in the scheduler's queue, as of the last step */
	_Atomic uint32_t n_running;      /* in the running batch, as of the last step */

	/* event side (ev_mu) */
	pthread_mutex_t ev_mu;
	struct md_engine_event *ev_head, *ev_tail; /* owned */

	/* stats (st_mu) */
	pthread_mutex_t st_mu;
	struct md_engine_stats stats;

	/* engine thread only */
	struct md_thread_owner owner;
	struct md_model model;
	bool model_loaded;
	struct md_text text;
	bool text_loaded;
	struct md_gvocab *gvocab;        /* owned: the vocabulary as grammars see it */
	struct md_forward_ctx *fw;       /* owned */
	struct md_kv_cache kv;
	bool kv_ready;
	struct md_sched sched;
	bool sched_ready;
	float *logits;                   /* owned: (max_seqs, n_vocab) */
	struct md_engine_event *out_head, *out_tail; /* events of the current step */

	/* published at READY, read-only afterwards */
	char name[256];
	uint32_t n_ctx, n_vocab;
};

/* ---- lifecycle ---- */

static char *dup_or_null(const char *s)
{
	return s ? strdup(s) : NULL;
}

int md_engine_new(struct md_engine **out, const struct md_engine_config *cfg,
		  md_engine_wake_cb wake, void *wake_arg)
{
	if (cfg->max_seqs == 0 || cfg->step_tokens == 0 || !cfg->model_path)
		return -EINVAL;
	struct md_engine *e = calloc(1, sizeof(*e));
	if (!e)
		return -ENOMEM;
	e->cfg = *cfg;
	e->cfg.model_path = dup_or_null(cfg->model_path);
	e->cfg.chat_template = dup_or_null(cfg->chat_template);
	e->wake = wake;
	e->wake_arg = wake_arg;
	e->owner._name = "engine";
	pthread_mutex_init(&e->sub_mu, NULL);
	pthread_cond_init(&e->sub_cv, NULL);
	pthread_mutex_init(&e->ev_mu, NULL);
	pthread_mutex_init(&e->st_mu, NULL);
	atomic_store(&e->state, MD_ENGINE_LOADING);
	*out = e;
	return 0;
}

enum md_engine_state md_engine_state(const struct md_engine *e)
{
	return (enum md_engine_state)atomic_load(&((struct md_engine *)e)->state);
}

const char *md_engine_error(const struct md_engine *e)
{
	return e->err;
}

/* ---- events ---- */

static struct md_engine_event *ev_new(enum md_event_kind kind, uint64_t id)
{
	struct md_engine_event *ev = calloc(1, sizeof(*ev));
	if (ev) {
		ev->kind = kind;
		ev->req_id = id;
	}
	return ev;
}

/* Queue an event for the end of the step (engine thread). */
static void ev_stage(struct md_engine *e, struct md_engine_event *ev)
{
	if (!ev)
		return; /* a token event out of memory: the client sees a gap, not a hang */
	ev->next = NULL;
	if (e->out_tail)
		e->out_tail->next = ev;
	else
		e->out_head = ev;
	e->out_tail = ev;
}

/* Hand the staged events to the loop thread; wake it if its list was empty. */
static void ev_flush(struct md_engine *e)
{
	if (!e->out_head)
		return;
	pthread_mutex_lock(&e->ev_mu);
	bool was_empty = e->ev_head == NULL;
	if (e->ev_tail)
		e->ev_tail->next = e->out_head;
	else
		e->ev_head = e->out_head;
	e->ev_tail = e->out_tail;
	pthread_mutex_unlock(&e->ev_mu);
	e->out_head = e->out_tail = NULL;
	if (was_empty && e->wake)
		e->wake(e->wake_arg);
}

struct md_engine_event *md_engine_poll(struct md_engine *e)
{
	pthread_mutex_lock(&e->ev_mu);
	struct md_engine_event *l = e->ev_head;
	e->ev_head = e->ev_tail = NULL;
	pthread_mutex_unlock(&e->ev_mu);
	return l;
}

void md_engine_events_free(struct md_engine_event *ev)
{
	while (ev) {
		struct md_engine_event *n = ev->next;
		free(ev);
		ev = n;
	}
}

static void set_state(struct md_engine *e, enum md_engine_state st)
{
	atomic_store(&e->state, st);
	ev_stage(e, ev_new(MD_EV_STATE, 0));
	ev_flush(e);
}

/* Post a request's DONE event (taken from it) and free the request. */
static void req_done(struct md_engine *e, struct md_engine_req *r, enum md_finish f, int err,
		     uint32_t n_prompt, uint32_t n_gen)
{
	struct md_engine_event *ev = r->_done;
	r->_done = NULL;
	ev->kind = MD_EV_DONE;
	ev->req_id = r->id;
	ev->finish = f;
	ev->err = err;
	ev->n_prompt = n_prompt;
	ev->n_gen = n_gen;
	ev_stage(e, ev);
	md_engine_req_free(r);
}

/* ---- submission ---- */

void md_engine_req_free(struct md_engine_req *r)
{
	if (!r)
		return;
	md_sampling_release(&r->sampling);
	md_gmatch_free(r->_gm);
	md_grammar_unref(r->grammar);
	free(r->_done);
	free(r->prompt);
	free(r);
}

int md_engine_submit(struct md_engine *e, struct md_engine_req *r)
{
	if (!r->prompt || r->n_prompt == 0 || r->max_tokens == 0)
		return -EINVAL;
	if (md_engine_state(e) != MD_ENGINE_READY)
		return -ESHUTDOWN;
	if (r->n_prompt >= e->n_ctx)
		return -EINVAL;
	struct md_engine_event *done = ev_new(MD_EV_DONE, r->id);
	if (!done)
		return -ENOMEM;
	pthread_mutex_lock(&e->sub_mu);
	int rc = 0;
	if (e->stop)
		rc = -ESHUTDOWN;
	else {
		/* A request not yet taken by the engine thread fills a free batch slot first,
		 * not the queue: with one slot and a one-deep queue, two requests that arrive
		 * together are both accepted however late the engine thread wakes. */
		uint32_t running = atomic_load(&e->n_running);
		uint32_t free_slots = running < e->cfg.max_seqs ? e->cfg.max_seqs - running : 0;
		if (atomic_load(&e->n_submitted) + atomic_load(&e->n_waiting) >=
		    e->cfg.max_queue + free_slots)
			rc = -EAGAIN;
	}
	if (rc) {
		pthread_mutex_unlock(&e->sub_mu);
		free(done);
		return rc;
	}
	if (r->max_tokens > e->n_ctx - r->n_prompt)
		r->max_tokens = e->n_ctx - r->n_prompt;
	r->_done = done;
	atomic_fetch_add(&e->n_submitted, 1);
	r->_next = NULL;
	if (e->sub_tail)
		e->sub_tail->_next = r;
	else
		e->sub_head = r;
	e->sub_tail = r;
	pthread_cond_signal(&e->sub_cv);
	pthread_mutex_unlock(&e->sub_mu);
	return 0;
}

int md_engine_cancel(struct md_engine *e, uint64_t id)
{
	struct cancel_msg *m = malloc(sizeof(*m));
	if (!m)
		return -ENOMEM;
	m->id = id;
	pthread_mutex_lock(&e->sub_mu);
	m->next = e->cancels;
	e->cancels = m;
	pthread_cond_signal(&e->sub_cv);
	pthread_mutex_unlock(&e->sub_mu);
	return 0;
}

void md_engine_get_stats(struct md_engine *e, struct md_engine_stats *s)
{
	pthread_mutex_lock(&e->st_mu);
	*s = e->stats;
	pthread_mutex_unlock(&e->st_mu);
	s->waiting = atomic_load(&e->n_submitted) + atomic_load(&e->n_waiting);
}

/* ---- the step ---- */

/* Post DONE for a sequence that is on no list, and free it. */
static void seq_finish(struct md_engine *e, struct md_seq *s, enum md_finish f, int err)
{
	struct md_engine_req *r = s->req;
	s->req = NULL;
	req_done(e, r, f, err, s->n_prompt, s->n_gen);
	md_seq_free(s);
}

/* Constrained decoding: sample under the grammar's mask (the matcher is made on the first
 * token; near max_tokens the mask keeps only tokens after which the grammar can still be
 * completed, so the output closes rather than being cut) and advance the matcher by the token. *complete: the grammar allows nothing after
 * it but the end, so the sequence can stop without another forward pass. */
static int sample_grammar(struct md_engine *e, struct md_seq *s, const float *row,
			  struct md_sample_out *so, bool *complete)
{
	struct md_engine_req *r = s->req;
	const uint32_t *allowed;
	int rc = r->_gm ? 0 : md_gmatch_new(&r->_gm, r->grammar, e->gvocab);
	if (!rc)
		rc = md_gmatch_mask_budget(r->_gm, r->max_tokens - s->n_gen, &allowed);
	if (rc)
		return rc;
	struct md_sampler_ctx ctx = {
		.prompt = s->toks, .n_prompt = s->n_prompt, .gen = s->toks + s->n_prompt,
		.n_gen = s->n_toks - s->n_prompt, .allowed = allowed,
	};
	rc = md_sampler_sample_ctx(&s->sm, &r->sampling, row, &ctx, so);
	if (!rc)
		rc = md_gmatch_accept(r->_gm, so->token);
	*complete = !rc && md_gmatch_is_final(r->_gm);
	return rc;
}

/* Sample the next token of s from its logits row; post events; finish when done.
 * Returns true when the sequence finished (it is then off the lists and freed). */
static bool sample_seq(struct md_engine *e, struct md_seq *s, float *row)
{
	struct md_sample_out so;
	const struct md_engine_req *r = s->req;
	bool complete = false;
	int rc = r->grammar ? sample_grammar(e, s, row, &so, &complete)
			    : md_sampler_sample(&s->sm, &r->sampling, row, s->toks, s->n_prompt,
						s->toks + s->n_prompt, s->n_toks - s->n_prompt, &so);
	if (rc) {
		md_sched_remove(&e->sched, s);
		seq_finish(e, s, MD_FINISH_ERROR, rc);
		return true;
	}
	s->n_gen++;
	/* Under a grammar the end token means the grammar is complete: it ends even with
	 * ignore_eos, since nothing may follow it. */
	if (md_tokenizer_is_eog(e->text.tok, so.token) && (!r->ignore_eos || r->grammar)) {
		md_sched_remove(&e->sched, s);
		seq_finish(e, s, MD_FINISH_STOP, 0);
		return true;
	}
	struct md_engine_event *ev = ev_new(MD_EV_TOKEN, r->id);
	if (ev) {
		ev->token = so.token;
		ev->logprob = so.logprob;
		uint32_t n_top = so.n_top < MD_ENGINE_MAX_TOP ? so.n_top : MD_ENGINE_MAX_TOP;
		ev->n_top = (uint8_t)n_top;
		for (uint32_t i = 0; i < n_top; i++) {
			ev->top[i].id = so.top_id[i];
			ev->top[i].logprob = so.top_logprob[i];
		}
	}
	ev_stage(e, ev);
	md_sched_append(&e->sched, s, so.token);
	if (complete) {
		md_sched_remove(&e->sched, s);
		seq_finish(e, s, MD_FINISH_STOP, 0);
		return true;
	}
	if (s->n_gen >= r->max_tokens || s->n_toks >= e->n_ctx || s->n_toks >= s->cap) {
		md_sched_remove(&e->sched, s);
		seq_finish(e, s, MD_FINISH_LENGTH, 0);
		return true;
	}
	return false;
}

static void publish_stats(struct md_engine *e)
{
	const struct md_sched_stats *ss = &e->sched.stats;
	pthread_mutex_lock(&e->st_mu);
	e->stats.running = md_sched_n_running(&e->sched);
	e->stats.kv_blocks_used = e->kv_ready ? md_kv_blocks_used(&e->kv) : 0;
	e->stats.steps = ss->steps;
	e->stats.preemptions = ss->preemptions;
	e->stats.prompt_tokens = ss->prompt_tokens;
	e->stats.gen_tokens = ss->gen_tokens;
	e->stats.recomputed_tokens = ss->recomputed_tokens;
	pthread_mutex_unlock(&e->st_mu);
	atomic_store(&e->n_waiting, md_sched_n_waiting(&e->sched));
	atomic_store(&e->n_running, md_sched_n_running(&e->sched));
}

/* Fail every sequence the scheduler holds (engine error, shutdown). */
static void finish_all(struct md_engine *e, enum md_finish f, int err)
{
	struct md_seq *s;
	while ((s = md_sched_pop_any(&e->sched)))
		seq_finish(e, s, f, err);
}

/* One scheduler step. Returns true when it did work. */
static bool step(struct md_engine *e)
{
	MD_ASSERT_OWNER(&e->owner);
	struct md_sched *sc = &e->sched;
	uint32_t n = md_sched_plan(sc);
	struct md_plan *p = &sc->plan;
	while (p->failed) {
		struct md_seq *s = p->failed;
		p->failed = s->next;
		s->next = NULL;
		seq_finish(e, s, MD_FINISH_ERROR, -ENOSPC);
	}
	if (n == 0)
		return false;

	struct md_batch b = {
		.n_tokens = (int32_t)n, .tokens = p->tokens, .seq = p->seq, .pos = p->pos,
		.want_logits = p->want_logits,
	};
	int rows = md_forward(e->fw, &e->kv, &b, e->logits);
	if (rows < 0 || (uint32_t)rows != p->n_logits) {
		md_log(MD_LOG_ERROR, "engine step failed (%d); failing %u sequences", rows,
		       md_sched_n_running(sc));
		finish_all(e, MD_FINISH_ERROR, rows < 0 ? rows : -EIO);
		return true;
	}
	md_sched_commit(sc, NULL);
	/* Logits rows come in item order; an item's rows are its last n_logits tokens. */
	uint32_t k = 0;
	for (uint32_t i = 0; i < p->n_items; i++) {
		struct md_plan_item *it = &p->items[i];
		if (it->n_logits == 0)
			continue;
		sample_seq(e, it->seq, e->logits + (size_t)k * e->n_vocab);
		k += it->n_logits;
	}
	return true;
}

/* ---- loading ---- */

/* Page the weights in now, with progress, rather than on the first requests: populate the
 * page tables a tenth at a time (MADV_POPULATE_READ, Linux 5.14+, no fault per page), or touch
 * every page where the kernel lacks it. */
static void populate_weights(const struct md_model *m, bool progress)
{
	volatile uint8_t sink = 0;
	const uint8_t *map = m->gguf.base;
	size_t size = m->gguf.size;
	size_t pg = 4096, step_len = ((size / 10 + 1) + pg - 1) / pg * pg;
	bool populate = true;
	for (size_t off = 0; off < size; off += step_len) {
		size_t len = off + step_len < size ? step_len : size - off;
#ifdef MADV_POPULATE_READ
		if (populate && madvise((void *)(map + off), len, MADV_POPULATE_READ) != 0)
			populate = false;
#else
		populate = false;
#endif
		if (!populate)
			for (size_t o = off; o < off + len; o += pg)
				sink ^= map[o];
		if (progress)
			md_log(MD_LOG_INFO, "loading weights %3zu%%", (off + len) * 100 / size);
	}
	(void)sink;
}

static void name_model(struct md_engine *e)
{
	struct md_gguf_str nm;
	if (md_gguf_get_str(&e->model.gguf, "general.name", &nm) && nm.len > 0) {
		size_t l = nm.len < sizeof(e->name) - 1 ? nm.len : sizeof(e->name) - 1;
		memcpy(e->name, nm.ptr, l);
		e->name[l] = 0;
		return;
	}
	const char *path = e->cfg.model_path;
	const char *base = strrchr(path, '/');
	snprintf(e->name, sizeof(e->name), "%s", base ? base + 1 : path);
	char *dot = strrchr(e->name, '.');
	if (dot && strcmp(dot, ".gguf") == 0)
		*dot = 0;
}

static uint32_t blocks_for(uint32_t n_pos)
{
	return (n_pos + MD_KV_BLOCK_TOKENS - 1) / MD_KV_BLOCK_TOKENS;
}

/* Size and allocate the KV pool. An explicit block count too small for one full context is
 * a configuration that cannot work: refuse it rather than silently growing it. */
static int setup_kv(struct md_engine *e)
{
	const struct md_engine_config *c = &e->cfg;
	const struct md_hparams *hp = &e->model.hp;
	uint32_t kv_dim = hp->n_head_kv * hp->head_dim;
	uint64_t block_bytes = (uint64_t)hp->n_layer * MD_KV_BLOCK_TOKENS * kv_dim * sizeof(float) * 2;
	uint64_t min_blocks = blocks_for(e->n_ctx) + 1;
	uint64_t n_blocks = c->kv_blocks;
	if (n_blocks && n_blocks < min_blocks) {
		snprintf(e->err, sizeof(e->err),
			 "kv-blocks %u cannot hold one full context of %u tokens (needs %llu blocks of "
			 "%d tokens): raise kv-blocks or lower ctx-size", c->kv_blocks, e->n_ctx,
			 (unsigned long long)min_blocks, MD_KV_BLOCK_TOKENS);
		return -EINVAL;
	}
	if (n_blocks == 0)
		n_blocks = ((uint64_t)c->kv_mem_mb << 20) / (block_bytes ? block_bytes : 1);
	uint64_t useful = (uint64_t)c->max_seqs * min_blocks;
	if (n_blocks > useful)
		n_blocks = useful;
	if (n_blocks < min_blocks)
		n_blocks = min_blocks;
	int rc = md_kv_init(&e->kv, hp->n_layer, kv_dim, (uint32_t)n_blocks, c->max_seqs);
	if (rc) {
		snprintf(e->err, sizeof(e->err), "cannot allocate the KV cache (%llu blocks)",
			 (unsigned long long)n_blocks);
		return rc;
	}
	e->kv_ready = true;
	if (c->progress)
		md_log(MD_LOG_INFO, "KV cache %llu blocks of %d tokens (%.1f MiB), context %u, "
		       "%u sequences, step budget %u tokens", (unsigned long long)n_blocks,
		       MD_KV_BLOCK_TOKENS, n_blocks * block_bytes / 1048576.0, e->n_ctx, c->max_seqs,
		       c->step_tokens);
	return 0;
}

/* Load the model and build everything a step needs. On failure e->err says why; what was
 * built is freed by md_engine_free. */
static int load(struct md_engine *e)
{
	char err[400] = "";
	const struct md_engine_config *c = &e->cfg;
	if (c->progress)
		md_log(MD_LOG_INFO, "loading model '%s'", c->model_path);
	int rc = md_model_load(&e->model, c->model_path, err, sizeof(err));
	if (rc) {
		snprintf(e->err, sizeof(e->err), "cannot load model '%s': %s", c->model_path, err);
		return rc;
	}
	e->model_loaded = true;
	const struct md_hparams *hp = &e->model.hp;
	if (c->progress)
		md_log(MD_LOG_INFO, "%s, %u layers, n_embd %u, %u experts (%u active), vocab %u, "
		       "%.1f MiB", hp->arch_name, hp->n_layer, hp->n_embd, hp->n_expert,
		       hp->n_expert_used, hp->n_vocab, e->model.gguf.size / 1048576.0);
	populate_weights(&e->model, c->progress);

	rc = md_text_load(&e->text, &e->model.gguf, c->chat_template, e->err, sizeof(e->err));
	if (rc)
		return rc;
	e->text_loaded = true;
	name_model(e);
	e->n_vocab = md_tokenizer_n_vocab(e->text.tok);
	if (e->n_vocab != hp->n_vocab) {
		snprintf(e->err, sizeof(e->err), "tokenizer has %u tokens but the model %u", e->n_vocab,
			 hp->n_vocab);
		return -EINVAL;
	}
	if (md_gvocab_new(&e->gvocab, e->text.tok)) {
		snprintf(e->err, sizeof(e->err), "out of memory indexing the vocabulary");
		return -ENOMEM;
	}
	/* Like llama.cpp, a context longer than the training context is allowed (RoPE works at any
	 * position) but warned about: quality past the training length is the model's business. */
	e->n_ctx = c->n_ctx ? c->n_ctx : hp->n_ctx_train;
	if (e->n_ctx == 0)
		e->n_ctx = 4096;
	if (hp->n_ctx_train && e->n_ctx > hp->n_ctx_train)
		md_log(MD_LOG_WARN, "context %u exceeds the model's training context %u; output "
		       "past %u tokens may degrade", e->n_ctx, hp->n_ctx_train, hp->n_ctx_train);

	rc = setup_kv(e);
	if (rc)
		return rc;
	struct md_sched_config sc = {
		.max_seqs = c->max_seqs, .step_tokens = c->step_tokens, .n_ctx = e->n_ctx,
	};
	rc = md_sched_init(&e->sched, &sc, &e->kv);
	if (rc) {
		snprintf(e->err, sizeof(e->err), "cannot set up the scheduler (%d)", rc);
		return rc;
	}
	e->sched_ready = true;
	md_owner_claim(&e->sched.owner, "engine");

	int threads = c->n_threads > 0 ? c->n_threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
	e->fw = md_forward_new(&e->model, threads, (int)c->step_tokens);
	/* One logits row per running sequence; the scheduler keeps a step within that. */
	e->logits = malloc(sizeof(float) * (size_t)c->max_seqs * e->n_vocab);
	if (!e->fw || !e->logits) {
		snprintf(e->err, sizeof(e->err), "out of memory setting up the engine");
		return -ENOMEM;
	}
	pthread_mutex_lock(&e->st_mu);
	e->stats.kv_blocks_total = md_kv_blocks_total(&e->kv);
	pthread_mutex_unlock(&e->st_mu);
	return 0;
}

/* ---- the thread ---- */

/* Take new requests into the scheduler (or fail them when the engine cannot serve). */
static void take_submissions(struct md_engine *e, struct md_engine_req *subs, bool failed)
{
	while (subs) {
		struct md_engine_req *r = subs;
		subs = r->_next;
		r->_next = NULL;
		atomic_fetch_sub(&e->n_submitted, 1);
		struct md_seq *s = NULL;
		if (!failed) {
			uint64_t seed = r->sampling.has_seed
				? r->sampling.seed
				: md_sampler_mix(r->id ^ (uint64_t)time(NULL) ^ (uint64_t)clock());
			s = md_seq_new(r, e->n_ctx, e->n_vocab, seed);
		}
		if (!s) {
			req_done(e, r, MD_FINISH_ERROR, failed ? -ESHUTDOWN : -ENOMEM, r->n_prompt, 0);
			continue;
		}
		md_sched_enqueue(&e->sched, s);
	}
}

static void *engine_main(void *arg)
{
	struct md_engine *e = arg;
	/* Signals belong to the loop thread; the compute pool inherits this mask. */
	sigset_t all;
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, NULL);
	md_owner_claim(&e->owner, "engine");

	int rc = load(e);
	if (rc) {
		set_state(e, MD_ENGINE_FAILED); /* the owner reports md_engine_error() */
	} else {
		set_state(e, MD_ENGINE_READY);
	}
	for (;;) {
		pthread_mutex_lock(&e->sub_mu);
		while (!e->stop && !e->sub_head && !e->cancels &&
		       (rc || (md_sched_n_waiting(&e->sched) == 0 &&
			       md_sched_n_running(&e->sched) == 0)))
			pthread_cond_wait(&e->sub_cv, &e->sub_mu);
		struct md_engine_req *subs = e->sub_head;
		struct cancel_msg *cancels = e->cancels;
		bool stop = e->stop;
		e->sub_head = e->sub_tail = NULL;
		e->cancels = NULL;
		pthread_mutex_unlock(&e->sub_mu);

		take_submissions(e, subs, rc != 0);
		while (cancels) {
			struct cancel_msg *m = cancels;
			cancels = m->next;
			struct md_seq *s = rc ? NULL : md_sched_cancel(&e->sched, m->id);
			if (s)
				seq_finish(e, s, MD_FINISH_CANCELLED, 0);
			free(m);
		}
		if (stop) {
			if (!rc)
				finish_all(e, MD_FINISH_CANCELLED, 0);
			if (e->sched_ready)
				publish_stats(e);
			ev_flush(e);
			break;
		}
		if (!rc) {
			step(e);
			publish_stats(e);
		}
		ev_flush(e);
	}
	atomic_store(&e->state, MD_ENGINE_STOPPED);
	md_owner_release(&e->owner);
	if (e->sched_ready)
		md_owner_release(&e->sched.owner);
	return NULL;
}

int md_engine_start(struct md_engine *e)
{
	int rc = pthread_create(&e->thread, NULL, engine_main, e);
	if (rc)
		return -rc;
	e->started = true;
	return 0;
}

void md_engine_stop(struct md_engine *e)
{
	if (!e->started)
		return;
	pthread_mutex_lock(&e->sub_mu);
	e->stop = true;
	pthread_cond_signal(&e->sub_cv);
	pthread_mutex_unlock(&e->sub_mu);
	pthread_join(e->thread, NULL);
	e->started = false;
}

void md_engine_free(struct md_engine *e)
{
	if (!e)
		return;
	md_engine_stop(e);
	while (e->sub_head) {
		struct md_engine_req *r = e->sub_head;
		e->sub_head = r->_next;
		md_engine_req_free(r);
	}
	while (e->cancels) {
		struct cancel_msg *m = e->cancels;
		e->cancels = m->next;
		free(m);
	}
	md_engine_events_free(e->ev_head);
	md_engine_events_free(e->out_head);
	if (e->sched_ready)
		md_sched_release(&e->sched);
	if (e->fw)
		md_forward_free(e->fw);
	if (e->kv_ready)
		md_kv_release(&e->kv);
	md_gvocab_free(e->gvocab);
	if (e->text_loaded)
		md_text_release(&e->text);
	if (e->model_loaded)
		md_model_free(&e->model);
	free(e->logits);
	free((char *)e->cfg.model_path);
	free((char *)e->cfg.chat_template);
	pthread_mutex_destroy(&e->sub_mu);
	pthread_cond_destroy(&e->sub_cv);
	pthread_mutex_destroy(&e->ev_mu);
	pthread_mutex_destroy(&e->st_mu);
	free(e);
}

/* ---- model facts and text helpers (read-only state published at READY) ---- */

const char *md_engine_model_name(const struct md_engine *e)
{
	return e->name;
}

const char *md_engine_model_path(const struct md_engine *e)
{
	return e->cfg.model_path;
}

uint32_t md_engine_n_ctx(const struct md_engine *e)
{
	return e->n_ctx;
}

uint32_t md_engine_n_vocab(const struct md_engine *e)
{
	return e->n_vocab;
}

const struct md_gvocab *md_engine_gvocab(const struct md_engine *e)
{
	return e->gvocab;
}

int md_engine_tool_format(const struct md_engine *e)
{
	return (int)md_chat_family_tool_format(e->text.chat);
}

int md_engine_tokenize(const struct md_engine *e, const char *text, size_t len, bool add_bos,
		       bool parse_special, int32_t **ids)
{
	return md_tokenizer_encode(e->text.tok, text, len, add_bos, parse_special, ids);
}

int md_engine_token_piece(const struct md_engine *e, int32_t id, char *buf, size_t cap)
{
	return md_tokenizer_piece(e->text.tok, id, buf, cap);
}

const char *md_engine_token_text(const struct md_engine *e, int32_t id, size_t *len)
{
	return md_tokenizer_token_text(e->text.tok, id, len);
}

bool md_engine_token_is_eog(const struct md_engine *e, int32_t id)
{
	return md_tokenizer_is_eog(e->text.tok, id);
}

int md_engine_chat_tokenize(const struct md_engine *e, const struct md_engine_msg *msgs,
			    size_t n, int32_t **ids)
{
	return md_engine_chat_tokenize_tools(e, msgs, n, NULL, 0, ids);
}

int md_engine_chat_tokenize_tools(const struct md_engine *e, const struct md_engine_msg *msgs,
				  size_t n, const char *const *tools, size_t n_tools, int32_t **ids)
{
	size_t n_calls = 0;
	for (size_t i = 0; i < n; i++)
		n_calls += msgs[i].n_tool_calls;
	struct md_chat_msg *cm = calloc(n ? n : 1, sizeof(*cm));
	struct md_chat_tool_call *calls = calloc(n_calls ? n_calls : 1, sizeof(*calls));
	int rc = -ENOMEM;
	if (!cm || !calls)
		goto out;
	for (size_t i = 0, k = 0; i < n; i++) {
		cm[i].role = msgs[i].role;
		cm[i].content = msgs[i].content;
		cm[i].tool_calls = calls + k;
		cm[i].n_tool_calls = msgs[i].n_tool_calls;
		cm[i].content_null = msgs[i].content_null;
		for (size_t j = 0; j < msgs[i].n_tool_calls; j++, k++) {
			calls[k].name = msgs[i].tool_calls[j].name;
			calls[k].arguments = msgs[i].tool_calls[j].arguments;
		}
	}
	rc = md_text_chat_tokenize_tools(&e->text, cm, n, tools, n_tools, ids);
out:
	free(calls);
	free(cm);
	return rc;
}

struct md_engine_detok {
	struct md_detok d;
};

struct md_engine_detok *md_engine_detok_new(const struct md_engine *e, bool continuation)
{
	struct md_engine_detok *d = malloc(sizeof(*d));
	if (!d)
		return NULL;
	md_detok_init(&d->d, e->text.tok);
	if (continuation)
		d->d.lstrip_first = false;
	return d;
}

void md_engine_detok_free(struct md_engine_detok *d)
{
	free(d);
}

int md_engine_detok_push(struct md_engine_detok *d, int32_t id, char *out, size_t cap)
{
	return md_detok_push(&d->d, id, out, cap);
}

int md_engine_detok_flush(struct md_engine_detok *d, char *out, size_t cap)
{
	return md_detok_flush(&d->d, out, cap);
}
