/* The engine thread: model ownership, request queue, continuous-batching scheduler, events. */
#include "engine/engine.h"

/*
 * DESIGN
 * One thread owns the model, the KV cache, the forward context and every sequence. The loop
 * thread talks to it through two mutex-protected lists: submissions/cancellations in (the
 * engine sleeps on a condition variable when it has nothing to do) and events out (the wake
 * callback, uv_async_send, fires when that list goes from empty to non-empty). Both sides
 * detach a whole list under the lock and work on it unlocked; no lock is held while taking
 * another.
 *
 * Scheduling, once per step: admit waiting requests in FIFO order while a sequence slot and
 * KV blocks for the whole pending prompt are free (a head that does not fit blocks the ones
 * behind it, so nothing starves); give every decoding sequence its one token; fill the rest
 * of the step's token budget with prefill chunks in admission order. A decoding sequence that
 * cannot get a KV block preempts the youngest running sequence, which goes back to the front
 * of the queue and is recomputed later (its generated tokens become part of its prompt, its
 * sampler state is kept). Cancellation is a message: the sequence leaves at the next step and
 * its blocks return to the pool.
 *
 * Every token of a sequence is a row in the batch and every row is computed the same way
 * whatever else shares the batch, so greedy output does not depend on batch composition.
 */

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <unistd.h>

#include "engine/chat_template.h"
#include "engine/forward.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "engine/tokenizer.h"

struct seq {
	struct md_engine_req *req;  /* owned: prompt, sampling, limits */
	int32_t *toks;              /* owned: prompt then generated tokens, (cap) */
	uint32_t n_toks, cap;
	uint32_t n_prompt;
	uint32_t n_kv;              /* tokens whose K/V are in the cache */
	uint32_t n_gen;
	uint32_t n_sched;           /* tokens placed in the current step's batch */
	int kv_seq;                 /* KV sequence slot, -1 while waiting */
	uint64_t admit_no;          /* order of (re)admission */
	struct md_sampler sm;
	struct seq *next;           /* waiting list link */
};

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
	_Atomic uint32_t n_queued;       /* submitted, not yet admitted */

	/* event side (ev_mu) */
	pthread_mutex_t ev_mu;
	struct md_engine_event *ev_head, *ev_tail; /* owned */

	/* stats (st_mu) */
	pthread_mutex_t st_mu;
	struct md_engine_stats stats;

	/* engine thread only */
	struct md_model model;
	bool model_loaded;
	struct md_tokenizer *tok;        /* owned */
	enum md_chat_family chat;
	char bos_text[64], eos_text[64];
	struct md_forward_ctx *fw;       /* owned */
	struct md_kv_cache kv;
	bool kv_ready;
	struct seq *waiting;             /* owned: FIFO */
	struct seq **running;            /* owned (max_seqs), admission order */
	uint32_t n_running;
	uint64_t admit_counter;
	float *logits;                   /* owned: (max_seqs, n_vocab) */
	int32_t *b_tok, *b_seq, *b_pos;  /* owned: (step_tokens) */
	bool *b_want;                    /* owned: (step_tokens) */
	struct seq **b_owner;            /* owned: (max_seqs) sequences with a logits row */
	struct md_engine_event *out_head, *out_tail; /* events of the current step */

	/* published at READY, read-only afterwards */
	char name[256];
	uint32_t n_ctx, n_vocab;
};

static void md_log_engine(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* The engine prints load progress and warnings straight to stderr, one write per line. */
static void md_log_engine(const char *fmt, ...)
{
	char line[1024];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(line, sizeof(line) - 1, fmt, ap);
	va_end(ap);
	if (n < 0)
		return;
	if ((size_t)n > sizeof(line) - 2)
		n = (int)sizeof(line) - 2;
	line[n++] = '\n';
	ssize_t w = write(STDERR_FILENO, line, (size_t)n);
	(void)w;
}

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
		return; /* out of memory: the client sees a truncated stream, not a crash */
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

/* ---- submission ---- */

int md_engine_submit(struct md_engine *e, struct md_engine_req *r)
{
	if (!r->prompt || r->n_prompt == 0 || r->max_tokens == 0)
		return -EINVAL;
	if (md_engine_state(e) != MD_ENGINE_READY)
		return -ESHUTDOWN;
	if (r->n_prompt >= e->n_ctx)
		return -EINVAL;
	pthread_mutex_lock(&e->sub_mu);
	if (e->stop) {
		pthread_mutex_unlock(&e->sub_mu);
		return -ESHUTDOWN;
	}
	if (atomic_load(&e->n_queued) >= e->cfg.max_queue) {
		pthread_mutex_unlock(&e->sub_mu);
		return -EAGAIN;
	}
	atomic_fetch_add(&e->n_queued, 1);
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
	s->waiting = atomic_load(&e->n_queued);
}

/* ---- sequences ---- */

static void req_free(struct md_engine_req *r)
{
	if (!r)
		return;
	md_sampling_release(&r->sampling);
	free(r->prompt);
	free(r);
}

static void seq_free(struct md_engine *e, struct seq *s)
{
	if (s->kv_seq >= 0)
		md_kv_seq_free(&e->kv, s->kv_seq);
	md_sampler_release(&s->sm);
	req_free(s->req);
	free(s->toks);
	free(s);
}

/* Post DONE and free the sequence (it must be off every list). */
static void seq_finish(struct md_engine *e, struct seq *s, enum md_finish f, int err)
{
	struct md_engine_event *ev = ev_new(MD_EV_DONE, s->req->id);
	if (ev) {
		ev->finish = f;
		ev->err = err;
		ev->n_prompt = s->n_prompt;
		ev->n_gen = s->n_gen;
	}
	ev_stage(e, ev);
	seq_free(e, s);
}

static struct seq *seq_new(struct md_engine *e, struct md_engine_req *r)
{
	struct seq *s = calloc(1, sizeof(*s));
	if (!s)
		return NULL;
	s->req = r;
	s->kv_seq = -1;
	s->n_prompt = r->n_prompt;
	s->cap = r->n_prompt + r->max_tokens + 1;
	if (s->cap > e->n_ctx + 1)
		s->cap = e->n_ctx + 1;
	s->toks = malloc(sizeof(int32_t) * s->cap);
	uint64_t seed = r->sampling.has_seed ? r->sampling.seed
					     : md_sampler_mix(r->id ^ (uint64_t)time(NULL) ^
							      (uint64_t)clock());
	if (!s->toks || md_sampler_init(&s->sm, e->n_vocab, seed)) {
		free(s->toks);
		free(s);
		return NULL;
	}
	memcpy(s->toks, r->prompt, sizeof(int32_t) * r->n_prompt);
	s->n_toks = r->n_prompt;
	return s;
}

static void running_remove(struct md_engine *e, uint32_t i)
{
	memmove(&e->running[i], &e->running[i + 1], sizeof(struct seq *) * (e->n_running - i - 1));
	e->n_running--;
}

static void waiting_push_front(struct md_engine *e, struct seq *s)
{
	s->next = e->waiting;
	e->waiting = s;
	atomic_fetch_add(&e->n_queued, 1);
}

static void waiting_push_back(struct md_engine *e, struct seq *s)
{
	s->next = NULL;
	struct seq **pp = &e->waiting;
	while (*pp)
		pp = &(*pp)->next;
	*pp = s;
}

static void apply_cancel(struct md_engine *e, uint64_t id)
{
	for (struct seq **pp = &e->waiting; *pp; pp = &(*pp)->next)
		if ((*pp)->req->id == id) {
			struct seq *s = *pp;
			*pp = s->next;
			atomic_fetch_sub(&e->n_queued, 1);
			seq_finish(e, s, MD_FINISH_CANCELLED, 0);
			return;
		}
	for (uint32_t i = 0; i < e->n_running; i++)
		if (e->running[i]->req->id == id) {
			struct seq *s = e->running[i];
			running_remove(e, i);
			seq_finish(e, s, MD_FINISH_CANCELLED, 0);
			return;
		}
}

/* Preempt the youngest running sequence: free its KV, requeue it at the front. */
static struct seq *preempt_youngest(struct md_engine *e)
{
	if (e->n_running == 0)
		return NULL;
	uint32_t yi = 0;
	for (uint32_t i = 1; i < e->n_running; i++)
		if (e->running[i]->admit_no > e->running[yi]->admit_no)
			yi = i;
	struct seq *s = e->running[yi];
	running_remove(e, yi);
	md_kv_seq_free(&e->kv, s->kv_seq);
	s->kv_seq = -1;
	s->n_kv = 0;
	waiting_push_front(e, s);
	pthread_mutex_lock(&e->st_mu);
	e->stats.preemptions++;
	pthread_mutex_unlock(&e->st_mu);
	return s;
}

static uint32_t blocks_for(uint32_t n_pos)
{
	return (n_pos + MD_KV_BLOCK_TOKENS - 1) / MD_KV_BLOCK_TOKENS;
}

/* Admit from the queue head while a slot and KV blocks for its pending tokens are free.
 * One block per running sequence stays in reserve for their next decode steps. */
static void admit(struct md_engine *e)
{
	while (e->waiting && e->n_running < e->cfg.max_seqs) {
		struct seq *s = e->waiting;
		uint32_t need = blocks_for(s->n_toks + 1);
		if (need > e->kv.n_blocks) {
			e->waiting = s->next;
			atomic_fetch_sub(&e->n_queued, 1);
			seq_finish(e, s, MD_FINISH_ERROR, -ENOSPC);
			continue;
		}
		uint32_t reserve = e->n_running;
		if (e->kv.n_free < need + reserve && e->n_running > 0)
			break;
		int ks = md_kv_seq_new(&e->kv);
		if (ks < 0)
			break;
		if (md_kv_reserve(&e->kv, ks, s->n_toks)) {
			md_kv_seq_free(&e->kv, ks);
			break;
		}
		e->waiting = s->next;
		s->next = NULL;
		atomic_fetch_sub(&e->n_queued, 1);
		s->kv_seq = ks;
		s->n_kv = 0;
		s->admit_no = ++e->admit_counter;
		e->running[e->n_running++] = s;
	}
}

/* Sample the next token of s from its logits row; post events; finish when done.
 * Returns true when the sequence finished (and was freed). */
static bool sample_seq(struct md_engine *e, struct seq *s, float *row)
{
	struct md_sample_out so;
	const struct md_engine_req *r = s->req;
	int rc = md_sampler_sample(&s->sm, &r->sampling, row, s->toks, s->n_prompt,
				   s->toks + s->n_prompt, s->n_toks - s->n_prompt, &so);
	if (rc) {
		seq_finish(e, s, MD_FINISH_ERROR, rc);
		return true;
	}
	s->n_gen++;
	bool eog = md_tokenizer_is_eog(e->tok, so.token) && !r->ignore_eos;
	if (eog) {
		seq_finish(e, s, MD_FINISH_STOP, 0);
		return true;
	}
	struct md_engine_event *ev = ev_new(MD_EV_TOKEN, r->id);
	if (ev) {
		ev->token = so.token;
		ev->logprob = so.logprob;
		ev->n_top = (uint8_t)so.n_top;
		for (uint32_t i = 0; i < so.n_top && i < MD_ENGINE_MAX_TOP; i++) {
			ev->top[i].id = so.top_id[i];
			ev->top[i].logprob = so.top_logprob[i];
		}
	}
	ev_stage(e, ev);
	s->toks[s->n_toks++] = so.token;
	if (s->n_gen >= r->max_tokens || s->n_toks >= e->n_ctx || s->n_toks >= s->cap) {
		seq_finish(e, s, MD_FINISH_LENGTH, 0);
		return true;
	}
	return false;
}

/* One scheduler step. Returns true when it did work. */
static bool step(struct md_engine *e)
{
	admit(e);
	if (e->n_running == 0)
		return false;

	/* Every decoding sequence needs room for one more position; take it from the youngest
	 * sequences when the pool is dry (each preemption removes one, so this ends). */
	for (bool again = true; again;) {
		again = false;
		for (uint32_t i = 0; i < e->n_running; i++) {
			struct seq *s = e->running[i];
			if (s->n_toks - s->n_kv == 1 &&
			    md_kv_reserve(&e->kv, s->kv_seq, s->n_kv + 1)) {
				preempt_youngest(e);
				again = true;
				break;
			}
		}
	}
	if (e->n_running == 0)
		return false;

	uint32_t budget = e->cfg.step_tokens, n = 0, n_rows = 0, n_prefill = 0, n_decode = 0;
	/* decode rows first: one token per sequence whose prompt is done */
	for (uint32_t i = 0; i < e->n_running && budget > 0; i++) {
		struct seq *s = e->running[i];
		s->n_sched = 0;
		if (s->n_toks - s->n_kv != 1)
			continue;
		e->b_tok[n] = s->toks[s->n_kv];
		e->b_seq[n] = s->kv_seq;
		e->b_pos[n] = (int32_t)s->n_kv;
		e->b_want[n] = true;
		e->b_owner[n_rows++] = s;
		s->n_sched = 1;
		if (s->n_kv < s->n_prompt)
			n_prefill++;
		else
			n_decode++;
		n++;
		budget--;
	}
	/* then prefill chunks, oldest admission first (running[] is in admission order) */
	for (uint32_t i = 0; i < e->n_running && budget > 0; i++) {
		struct seq *s = e->running[i];
		uint32_t left = s->n_toks - s->n_kv;
		if (left <= 1)
			continue;
		uint32_t take = left < budget ? left : budget;
		for (uint32_t k = 0; k < take; k++) {
			e->b_tok[n] = s->toks[s->n_kv + k];
			e->b_seq[n] = s->kv_seq;
			e->b_pos[n] = (int32_t)(s->n_kv + k);
			e->b_want[n] = false;
			n++;
		}
		if (take == left) {
			e->b_want[n - 1] = true;
			e->b_owner[n_rows++] = s;
		}
		s->n_sched = take;
		n_prefill += take;
		budget -= take;
	}
	if (n == 0)
		return false;

	struct md_batch b = {
		.n_tokens = (int32_t)n, .tokens = e->b_tok, .seq = e->b_seq, .pos = e->b_pos,
		.want_logits = e->b_want,
	};
	int rows = md_forward(e->fw, &e->kv, &b, e->logits);
	if (rows < 0 || (uint32_t)rows != n_rows) {
		md_log_engine("moed: engine step failed (%d); failing %u sequences", rows,
			      e->n_running);
		while (e->n_running) {
			struct seq *s = e->running[--e->n_running];
			seq_finish(e, s, MD_FINISH_ERROR, rows < 0 ? rows : -EIO);
		}
		return true;
	}
	for (uint32_t i = 0; i < e->n_running; i++) {
		e->running[i]->n_kv += e->running[i]->n_sched;
		e->running[i]->n_sched = 0;
	}
	/* logits rows come in batch order, which is b_owner order */
	for (uint32_t k = 0; k < n_rows; k++) {
		struct seq *s = e->b_owner[k];
		if (sample_seq(e, s, e->logits + (size_t)k * e->n_vocab)) {
			for (uint32_t i = 0; i < e->n_running; i++)
				if (e->running[i] == s) {
					running_remove(e, i);
					break;
				}
		}
	}
	pthread_mutex_lock(&e->st_mu);
	e->stats.steps++;
	e->stats.prompt_tokens += n_prefill;
	e->stats.gen_tokens += n_decode;
	pthread_mutex_unlock(&e->st_mu);
	return true;
}

/* ---- loading ---- */

static int load(struct md_engine *e)
{
	char err[400] = "";
	const struct md_engine_config *c = &e->cfg;
	if (c->progress)
		md_log_engine("moed: loading model '%s'", c->model_path);
	int rc = md_model_load(&e->model, c->model_path, err, sizeof(err));
	if (rc) {
		snprintf(e->err, sizeof(e->err), "cannot load model '%s': %s", c->model_path, err);
		return rc;
	}
	e->model_loaded = true;
	const struct md_hparams *hp = &e->model.hp;
	if (c->progress) {
		md_log_engine("moed: %s, %u layers, n_embd %u, %u experts (%u active), vocab %u, "
			      "%.1f MiB", hp->arch_name, hp->n_layer, hp->n_embd, hp->n_expert,
			      hp->n_expert_used, hp->n_vocab, e->model.gguf.size / 1048576.0);
	}
	/* Page the weights in now, with progress, rather than on the first requests: populate
	 * the page tables a tenth at a time (MADV_POPULATE_READ, Linux 5.14+, no fault per page),
	 * or touch every page where the kernel lacks it. */
	volatile uint8_t sink = 0;
	const uint8_t *map = e->model.gguf.base;
	size_t size = e->model.gguf.size;
	size_t pg = 4096, step = ((size / 10 + 1) + pg - 1) / pg * pg;
	bool populate = true;
	for (size_t off = 0; off < size; off += step) {
		size_t len = off + step < size ? step : size - off;
#ifdef MADV_POPULATE_READ
		if (populate && madvise((void *)(map + off), len, MADV_POPULATE_READ) != 0)
			populate = false;
#else
		populate = false;
#endif
		if (!populate)
			for (size_t o = off; o < off + len; o += pg)
				sink ^= map[o];
		if (c->progress)
			md_log_engine("moed: loading weights %3zu%%", (off + len) * 100 / size);
	}
	(void)sink;

	rc = md_tokenizer_load(&e->tok, &e->model.gguf, err, sizeof(err));
	if (rc) {
		snprintf(e->err, sizeof(e->err), "cannot load tokenizer: %s", err);
		return rc;
	}
	int32_t bos = md_tokenizer_bos(e->tok), eos = md_tokenizer_eos(e->tok);
	size_t len;
	const char *t;
	if (bos >= 0 && (t = md_tokenizer_token_text(e->tok, bos, &len)) && len < sizeof(e->bos_text))
		memcpy(e->bos_text, t, len);
	if (eos >= 0 && (t = md_tokenizer_token_text(e->tok, eos, &len)) && len < sizeof(e->eos_text))
		memcpy(e->eos_text, t, len);

	if (c->chat_template && c->chat_template[0]) {
		if (md_chat_template_by_name(c->chat_template, &e->chat)) {
			snprintf(e->err, sizeof(e->err), "unknown chat template '%s' (known: %s)",
				 c->chat_template, md_chat_template_names());
			return -EINVAL;
		}
	} else {
		struct md_gguf_str js = { 0 };
		if (!md_gguf_get_str(&e->model.gguf, "tokenizer.chat_template", &js) || js.len == 0) {
			e->chat = MD_CHAT_CHATML;
			md_log_engine("moed: model has no chat template; using chatml");
		} else if (md_chat_template_detect_err(js.ptr, js.len, &e->chat, err, sizeof(err))) {
			snprintf(e->err, sizeof(e->err), "%s", err);
			return -EINVAL;
		}
	}

	struct md_gguf_str nm;
	if (md_gguf_get_str(&e->model.gguf, "general.name", &nm) && nm.len > 0) {
		size_t l = nm.len < sizeof(e->name) - 1 ? nm.len : sizeof(e->name) - 1;
		memcpy(e->name, nm.ptr, l);
		e->name[l] = 0;
	} else {
		const char *base = strrchr(c->model_path, '/');
		base = base ? base + 1 : c->model_path;
		snprintf(e->name, sizeof(e->name), "%s", base);
		char *dot = strrchr(e->name, '.');
		if (dot && strcmp(dot, ".gguf") == 0)
			*dot = 0;
	}
	e->n_vocab = md_tokenizer_n_vocab(e->tok);
	if (e->n_vocab != hp->n_vocab) {
		snprintf(e->err, sizeof(e->err), "tokenizer has %u tokens but the model %u", e->n_vocab,
			 hp->n_vocab);
		return -EINVAL;
	}
	/* Like llama.cpp, a context longer than the training context is allowed (RoPE works at any
	 * position) but warned about: quality past the training length is the model's business. */
	e->n_ctx = c->n_ctx ? c->n_ctx : hp->n_ctx_train;
	if (e->n_ctx == 0)
		e->n_ctx = 4096;
	if (hp->n_ctx_train && e->n_ctx > hp->n_ctx_train)
		md_log_engine("moed: warning: context %u exceeds the model's training context %u; "
			      "output past %u tokens may degrade", e->n_ctx, hp->n_ctx_train,
			      hp->n_ctx_train);

	uint32_t kv_dim = hp->n_head_kv * hp->head_dim;
	uint64_t block_bytes = (uint64_t)hp->n_layer * MD_KV_BLOCK_TOKENS * kv_dim * sizeof(float) * 2;
	uint64_t n_blocks = c->kv_blocks;
	if (n_blocks == 0)
		n_blocks = ((uint64_t)c->kv_mem_mb << 20) / (block_bytes ? block_bytes : 1);
	uint64_t useful = (uint64_t)c->max_seqs * (blocks_for(e->n_ctx) + 1);
	if (n_blocks > useful)
		n_blocks = useful;
	if (n_blocks < blocks_for(e->n_ctx) + 1)
		n_blocks = blocks_for(e->n_ctx) + 1;
	rc = md_kv_init(&e->kv, hp->n_layer, kv_dim, (uint32_t)n_blocks, c->max_seqs);
	if (rc) {
		snprintf(e->err, sizeof(e->err), "cannot allocate the KV cache (%llu blocks)",
			 (unsigned long long)n_blocks);
		return rc;
	}
	e->kv_ready = true;
	if (c->progress)
		md_log_engine("moed: KV cache %llu blocks of %d tokens (%.1f MiB), context %u, "
			      "%u sequences, step budget %u tokens", (unsigned long long)n_blocks,
			      MD_KV_BLOCK_TOKENS, n_blocks * block_bytes / 1048576.0, e->n_ctx,
			      c->max_seqs, c->step_tokens);

	int threads = c->n_threads > 0 ? c->n_threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
	e->fw = md_forward_new(&e->model, threads, (int)c->step_tokens);
	e->running = calloc(c->max_seqs, sizeof(*e->running));
	e->logits = malloc(sizeof(float) * (size_t)c->max_seqs * e->n_vocab);
	e->b_tok = malloc(sizeof(int32_t) * c->step_tokens);
	e->b_seq = malloc(sizeof(int32_t) * c->step_tokens);
	e->b_pos = malloc(sizeof(int32_t) * c->step_tokens);
	e->b_want = malloc(sizeof(bool) * c->step_tokens);
	e->b_owner = malloc(sizeof(struct seq *) * c->max_seqs);
	if (!e->fw || !e->running || !e->logits || !e->b_tok || !e->b_seq || !e->b_pos ||
	    !e->b_want || !e->b_owner) {
		snprintf(e->err, sizeof(e->err), "out of memory setting up the engine");
		return -ENOMEM;
	}
	pthread_mutex_lock(&e->st_mu);
	e->stats.kv_blocks_total = e->kv.n_blocks;
	pthread_mutex_unlock(&e->st_mu);
	return 0;
}

static void update_stats(struct md_engine *e)
{
	pthread_mutex_lock(&e->st_mu);
	e->stats.running = e->n_running;
	e->stats.kv_blocks_used = e->kv_ready ? md_kv_blocks_used(&e->kv) : 0;
	pthread_mutex_unlock(&e->st_mu);
}

static void *engine_main(void *arg)
{
	struct md_engine *e = arg;
	/* Signals belong to the loop thread; the compute pool inherits this mask. */
	sigset_t all;
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, NULL);

	int rc = load(e);
	if (rc) {
		md_log_engine("moed: %s", e->err);
		set_state(e, MD_ENGINE_FAILED);
	} else {
		set_state(e, MD_ENGINE_READY);
	}
	for (;;) {
		pthread_mutex_lock(&e->sub_mu);
		while (!e->stop && !e->sub_head && !e->cancels && (rc || (!e->waiting &&
								     e->n_running == 0)))
			pthread_cond_wait(&e->sub_cv, &e->sub_mu);
		struct md_engine_req *subs = e->sub_head;
		struct cancel_msg *cancels = e->cancels;
		bool stop = e->stop;
		e->sub_head = e->sub_tail = NULL;
		e->cancels = NULL;
		pthread_mutex_unlock(&e->sub_mu);

		while (subs) {
			struct md_engine_req *r = subs;
			subs = r->_next;
			struct seq *s = rc ? NULL : seq_new(e, r);
			if (!s) {
				atomic_fetch_sub(&e->n_queued, 1);
				struct md_engine_event *ev = ev_new(MD_EV_DONE, r->id);
				if (ev) {
					ev->finish = MD_FINISH_ERROR;
					ev->err = rc ? -ESHUTDOWN : -ENOMEM;
					ev->n_prompt = r->n_prompt;
				}
				ev_stage(e, ev);
				req_free(r);
				continue;
			}
			waiting_push_back(e, s);
		}
		while (cancels) {
			struct cancel_msg *m = cancels;
			cancels = m->next;
			apply_cancel(e, m->id);
			free(m);
		}
		if (stop) {
			while (e->waiting) {
				struct seq *s = e->waiting;
				e->waiting = s->next;
				atomic_fetch_sub(&e->n_queued, 1);
				seq_finish(e, s, MD_FINISH_CANCELLED, 0);
			}
			while (e->n_running) {
				struct seq *s = e->running[--e->n_running];
				seq_finish(e, s, MD_FINISH_CANCELLED, 0);
			}
			update_stats(e);
			ev_flush(e);
			break;
		}
		if (!rc)
			step(e);
		update_stats(e);
		ev_flush(e);
	}
	atomic_store(&e->state, MD_ENGINE_STOPPED);
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
		req_free(r);
	}
	while (e->cancels) {
		struct cancel_msg *m = e->cancels;
		e->cancels = m->next;
		free(m);
	}
	md_engine_events_free(e->ev_head);
	md_engine_events_free(e->out_head);
	while (e->waiting) {
		struct seq *s = e->waiting;
		e->waiting = s->next;
		seq_free(e, s);
	}
	for (uint32_t i = 0; i < e->n_running; i++)
		seq_free(e, e->running[i]);
	if (e->fw)
		md_forward_free(e->fw);
	if (e->kv_ready)
		md_kv_release(&e->kv);
	md_tokenizer_free(e->tok);
	if (e->model_loaded)
		md_model_free(&e->model);
	free(e->running);
	free(e->logits);
	free(e->b_tok);
	free(e->b_seq);
	free(e->b_pos);
	free(e->b_want);
	free(e->b_owner);
	free((char *)e->cfg.model_path);
	free((char *)e->cfg.chat_template);
	pthread_mutex_destroy(&e->sub_mu);
	pthread_cond_destroy(&e->sub_cv);
	pthread_mutex_destroy(&e->ev_mu);
	pthread_mutex_destroy(&e->st_mu);
	free(e);
}

/* ---- model facts and text helpers ---- */

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

int md_engine_tokenize(const struct md_engine *e, const char *text, size_t len, bool add_bos,
		       bool parse_special, int32_t **ids)
{
	return md_tokenizer_encode(e->tok, text, len, add_bos, parse_special, ids);
}

int md_engine_token_piece(const struct md_engine *e, int32_t id, char *buf, size_t cap)
{
	return md_tokenizer_piece(e->tok, id, buf, cap);
}

const char *md_engine_token_text(const struct md_engine *e, int32_t id, size_t *len)
{
	return md_tokenizer_token_text(e->tok, id, len);
}

bool md_engine_token_is_eog(const struct md_engine *e, int32_t id)
{
	return md_tokenizer_is_eog(e->tok, id);
}

int md_engine_chat_tokenize(const struct md_engine *e, const struct md_engine_msg *msgs,
			    size_t n, int32_t **ids)
{
	struct md_chat_msg *cm = malloc(sizeof(*cm) * (n ? n : 1));
	if (!cm)
		return -ENOMEM;
	for (size_t i = 0; i < n; i++) {
		cm[i].role = msgs[i].role;
		cm[i].content = msgs[i].content;
	}
	char *text = NULL;
	size_t len = 0;
	int rc = md_chat_render(e->chat, cm, n, true, e->bos_text, e->eos_text, &text, &len);
	free(cm);
	if (rc)
		return rc;
	bool has_bos = e->bos_text[0] && strncmp(text, e->bos_text, strlen(e->bos_text)) == 0;
	rc = md_tokenizer_encode(e->tok, text, len, !has_bos, true, ids);
	free(text);
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
	md_detok_init(&d->d, e->tok);
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
