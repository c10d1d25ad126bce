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
 * the next step and its blocks return to the pool. The forward pass reports every MoE
 * layer's routing to on_route, which feeds the routing trace (--trace-routing), the
 * scheduler's expert predictions (expert-aware batching) and the distinct-experts counters.
 *
 * Speculative decoding (engine/spec.h) lives in the same step: before the plan every decoding
 * sequence with a drafter gets up to k drafts (n-gram lookup, or the draft model's batched
 * rounds, engine/draft_model.h), k chosen per sequence by the controller (engine/spec_ctl.h);
 * after the forward pass every item's tokens are decided first (drafts accepted while they
 * hold), then the scheduler commits, rolling back the rejected drafts' KV rows, and only then
 * are tokens emitted, one event each with the same end-of-generation and length checks as
 * a plain step, so a step may emit several tokens of one sequence.
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
#include "engine/experts.h"
#include "engine/draft_model.h"
#include "engine/self_draft.h"
#include "engine/forward.h"
#include "engine/dev_place.h"
#include "engine/expert_tiers.h"
#include "engine/forward_dev.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "engine/route_trace.h"
#include "engine/sched.h"
#include "engine/spec_ctl.h"
#include "engine/text.h"

struct cancel_msg {
	uint64_t id;
	struct cancel_msg *next;
};

/* What the verification of one step decided, per plan item, before any of it is applied. */
struct spec_step {
	struct md_sample_out *out;       /* owned (max_logits): decided tokens, by logits row */
	uint32_t *n_out;                 /* owned (max_seqs): tokens decided per item */
	uint32_t *n_acc;                 /* owned (max_seqs): drafts accepted per item */
	uint32_t *keep;                  /* owned (max_seqs): drafts whose KV rows stay */
	int *err;                        /* owned (max_seqs): sampling error per item, 0 */
	struct md_sampler_dist resid;    /* owned: the rejection step's residual */
	bool ready;
	uint32_t k;                      /* the largest k (cfg.spec_k resolved) */
	enum md_spec_drafter drafter;    /* requests' default */
	uint64_t drafted, accepted, verify_steps, emitted; /* totals for the stats */
	uint64_t seq_steps, proposal_steps; /* decode sequence-steps of sequences with a drafter,
					      and those where it had a proposal (for the stats) */
	uint64_t proposed;               /* tokens those proposals offered (up to the room) */
	uint64_t verify_layers, verify_distinct, self_hit, self_used; /* on_route, for the stats */
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
	struct md_dev_place place;       /* owned: where the forward pass runs */
	struct md_fwd_dev *fdev;         /* owned: the forward pass on the device, NULL: CPU */
	struct md_expert_tiers tiers;    /* owned: the store and its device, or the mapping */
	struct md_expert_store *store;   /* borrowed from tiers: NULL on the mmap path */
	uint64_t kv_mem_bytes;           /* KV budget after the memory plan */
	struct md_kv_cache kv;
	bool kv_ready;
	struct md_sched sched;
	bool sched_ready;
	float *logits;                   /* owned: (max_logits, n_vocab) */
	int32_t *tok_err;                /* owned: (step_tokens) per batch row, an expert read
					  * error of that token in the last step (md_batch) */
	int *item_err;                   /* owned: (max_seqs) per plan item, the first of its
					  * tokens' errors */
	uint32_t max_logits;             /* rows: max_seqs, plus spec_k for up to 16 of them */
	struct md_engine_event *out_head, *out_tail; /* events of the current step */
	struct md_route_trace *trace;    /* owned, NULL: no --trace-routing */
	uint64_t *trace_seq;             /* owned (step_tokens): request id of each batch row */
	uint64_t moe_layer_steps, moe_distinct; /* routing statistics, engine thread */
	bool step_verifies;              /* the running step has drafts (on_route counts it) */
	bool step_predicted;             /* ... and self-speculation predicted its experts */
	struct spec_step sp;             /* speculation's per-step scratch and counters */
	struct md_draft_model draft;     /* the draft model, when draft_ready */
	bool draft_ready;
	struct md_seq **dseq;            /* owned (max_seqs): sequences the draft model drafts for */
	uint32_t *dk;                    /* owned (max_seqs): their k */
	struct md_self_draft self;       /* self-speculation, when self.ready */
	struct md_seq **sseq;            /* owned (max_seqs): sequences self-speculation drafts for */
	uint32_t *sk;                    /* owned (max_seqs): their k */
	struct md_spec_ctl ctl;          /* chooses k per sequence and step */
	struct md_seq **cseq;            /* owned (max_seqs): this step's candidates */
	struct md_spec_seq **css;        /* owned (max_seqs): their states */
	uint32_t *ck;                    /* owned (max_seqs): room in, chosen k out */

	/* published at READY, read-only afterwards */
	char name[256];
	uint32_t n_ctx, n_vocab;
};

/* ---- lifecycle ---- */

static char *dup_or_null(const char *s)
{
	return s ? strdup(s) : NULL;
}

int md_engine_check_device(const char *spec, char *err, size_t errlen)
{
	return md_dev_place_check(spec, err, errlen);
}

int md_engine_check_expert_device(const char *spec, char *err, size_t errlen)
{
	struct md_expert_device d;
	return md_expert_device_parse(spec, &d, err, errlen);
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
	e->cfg.trace_routing = cfg->trace_routing && cfg->trace_routing[0]
		? strdup(cfg->trace_routing) : NULL;
	e->cfg.expert_policy = dup_or_null(cfg->expert_policy);
	e->cfg.expert_device = dup_or_null(cfg->expert_device);
	e->cfg.device = dup_or_null(cfg->device);
	e->cfg.state_dir = dup_or_null(cfg->state_dir);
	e->cfg.spec_self_skip = dup_or_null(cfg->spec_self_skip);
	e->kv_mem_bytes = (uint64_t)cfg->kv_mem_mb << 20;
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
	r->_done->n_cached = s->n_cached;
	if (s->spec) {
		r->_done->n_drafted = s->spec->drafted;
		r->_done->n_accepted = s->spec->accepted;
		r->_done->n_verify = s->spec->verify_steps;
	}
	req_done(e, r, f, err, s->n_prompt, s->n_gen);
	md_seq_free(s);
}

/* Constrained decoding: the grammar's mask for the token s decides at row j of this step
 * (the matcher is made on the first token; near max_tokens the mask keeps only tokens after
 * which the grammar can still be completed, so the output closes rather than being cut).
 * Row j's mask is the one at the state after the j tokens decided before it in the step: a
 * verifying step decides row by row, the matcher advancing by each decided token (decide_item),
 * so every row's target distribution is masked as plain decoding would mask it, and a drafted
 * token the grammar does not allow is rejected like any other mismatch (it has probability 0;
 * md_spec_decide draws the correction from the masked residual). Nothing to roll back: the
 * matcher only ever takes decided tokens. */
static int grammar_mask(struct md_engine *e, struct md_seq *s, uint32_t j,
			const uint32_t **allowed)
{
	struct md_engine_req *r = s->req;
	int rc = r->_gm ? 0 : md_gmatch_new(&r->_gm, r->grammar, e->gvocab);
	if (!rc)
		rc = md_gmatch_mask_budget(r->_gm, r->max_tokens - s->n_gen - j, allowed);
	return rc;
}

/* Post DONE for a sequence that is still running: off the lists, finished, freed. */
static void seq_end(struct md_engine *e, struct md_seq *s, enum md_finish f, int err)
{
	md_sched_remove(&e->sched, s);
	seq_finish(e, s, f, err);
}

/* Whether s stops after one more token (so: tokens it may still take). */
static bool at_limit(const struct md_engine *e, const struct md_seq *s, uint32_t extra)
{
	return s->n_gen + extra >= s->req->max_tokens || s->n_toks + extra >= e->n_ctx ||
	       s->n_toks + extra >= s->cap;
}

/* Emit one decided token of s: post its event and append it, or finish s (end-of-generation,
 * max_tokens, context, a completed grammar). Returns true when the sequence finished (it is
 * then freed). */
static bool emit_token(struct md_engine *e, struct md_seq *s, const struct md_sample_out *so,
		       bool last)
{
	const struct md_engine_req *r = s->req;
	s->n_gen++;
	/* Under a grammar the end token means the grammar is complete: it ends even with
	 * ignore_eos, since nothing may follow it. */
	if (md_tokenizer_is_eog(e->text.tok, so->token) && (!r->ignore_eos || r->grammar)) {
		seq_end(e, s, MD_FINISH_STOP, 0);
		return true;
	}
	struct md_engine_event *ev = ev_new(MD_EV_TOKEN, r->id);
	if (ev) {
		ev->token = so->token;
		ev->logprob = so->logprob;
		uint32_t n_top = so->n_top < MD_ENGINE_MAX_TOP ? so->n_top : MD_ENGINE_MAX_TOP;
		ev->n_top = (uint8_t)n_top;
		for (uint32_t i = 0; i < n_top; i++) {
			ev->top[i].id = so->top_id[i];
			ev->top[i].logprob = so->top_logprob[i];
		}
		if (s->spec) {
			ev->n_drafted = s->spec->drafted;
			ev->n_accepted = s->spec->accepted;
			ev->n_verify = s->spec->verify_steps;
		}
	}
	ev_stage(e, ev);
	md_sched_append(&e->sched, s, so->token);
	/* the matcher is at the state after the step's last decided token */
	if (last && r->grammar && r->_gm && md_gmatch_is_final(r->_gm)) {
		seq_end(e, s, MD_FINISH_STOP, 0);
		return true;
	}
	if (at_limit(e, s, 0)) {
		seq_end(e, s, MD_FINISH_LENGTH, 0);
		return true;
	}
	return false;
}

/* ---- the expert store ---- */

static uint32_t blocks_for(uint32_t n_pos)
{
	return (n_pos + MD_KV_BLOCK_TOKENS - 1) / MD_KV_BLOCK_TOKENS;
}

/* The rows the KV cache holds: the model's (latent attention caches one half row of its own
 * width and no V: md_model_kv_rows), in float with kv_f32. */
static struct md_kv_rows kv_rows(const struct md_engine *e)
{
	struct md_kv_rows r = md_model_kv_rows(&e->model);
	r.k_half = r.k_half && !e->cfg.kv_f32;
	return r;
}

/* Bytes of one KV block. */
static uint64_t kv_block_bytes(const struct md_engine *e)
{
	return MD_KV_BLOCK_TOKENS * md_kv_token_bytes(e->model.hp.n_layer, kv_rows(e));
}

/* Where the forward pass runs (engine/dev_place.h): decided before the expert tiers, which
 * give a device that cannot hold every expert its tier. */
static int setup_place(struct md_engine *e)
{
	const struct md_engine_config *c = &e->cfg;
	uint64_t bb = kv_block_bytes(e);
	uint64_t kv_min = (blocks_for(e->n_ctx) + 1) * bb;
	uint64_t kv = c->kv_blocks ? c->kv_blocks * bb : e->kv_mem_bytes;
	uint64_t useful = (uint64_t)c->max_seqs * kv_min; /* setup_kv's cap */
	struct md_dev_place_config pc = {
		.device = c->device,
		.kv_bytes = kv < kv_min ? kv_min : kv > useful ? useful : kv,
		.step_tokens = (int)c->step_tokens,
		.tier_mb = c->device_expert_mb,
	};
	char why[sizeof(e->err) - 64];
	int rc = md_dev_place_plan(&e->place, &e->model, &pc, why, sizeof(why));
	if (rc) {
		snprintf(e->err, sizeof(e->err), "--device %s: %s", c->device ? c->device : "auto",
			 why);
		return rc;
	}
	return 0; /* the line is logged once the memory plan accepted the model (load) */
}

/* The forward pass on the device: weights uploaded, the KV pool mirrored (after setup_kv).
 * A failure here (device memory, say) is fatal only when the device was asked for by name. */
static int setup_fwd_dev(struct md_engine *e)
{
	if (!e->place.b)
		return 0;
	char why[600];
	bool resident = e->place.experts_resident;
	int rc = md_fwd_dev_new(&e->model, e->place.b, &e->kv, (int)e->cfg.step_tokens, resident,
				&e->fdev, why, sizeof(why));
	if (rc && e->place.required) {
		snprintf(e->err, sizeof(e->err), "cannot start the forward pass on %.200s: %s",
			 e->place.info.name, why);
		return rc;
	}
	if (rc) {
		md_log(MD_LOG_WARN, "device: cpu after all: the forward pass could not start on %s: "
		       "%s", e->place.info.name, why);
		return 0;
	}
	md_forward_set_device(e->fw, e->fdev);
	md_kv_drop_rows(&e->kv); /* every pass runs on the device, on its mirror */
	md_spec_ctl_use_wall_clock(true);
	struct md_fwd_dev_mem mem;
	md_fwd_dev_mem(e->fdev, &mem);
	md_log(MD_LOG_INFO, "device: %s, %.1f MiB of weights, %.1f MiB KV mirror, %.1f MiB of "
	       "activations; routed experts %s", e->place.info.name, mem.weights / 1048576.0,
	       mem.kv / 1048576.0, mem.activations / 1048576.0,
	       resident ? "resident on the device"
	       : e->store && md_expert_store_src(e->store) ? "through the expert store (device "
		 "tier, the others computed on the CPU or copied up by cost)"
	       : "from the mapping, computed on the CPU");
	pthread_mutex_lock(&e->st_mu);
	e->stats.dev_forward = true;
	snprintf(e->stats.dev_name, sizeof(e->stats.dev_name), "%.120s", e->place.info.name);
	e->stats.dev_mem_total = e->place.info.mem_total;
	e->stats.dev_mem_weights = mem.weights;
	e->stats.dev_mem_kv = mem.kv;
	e->stats.dev_mem_act = mem.activations;
	pthread_mutex_unlock(&e->st_mu);
	return 0;
}

/* Choose the experts' mode and make their tiers (engine/expert_tiers.h); the plan may lower
 * the KV budget. */
static int setup_experts(struct md_engine *e)
{
	const struct md_engine_config *c = &e->cfg;
	/* setup_kv's pool: kv-blocks when set, else the budget, never less than one context */
	uint64_t bb = kv_block_bytes(e);
	uint64_t kv_min = (blocks_for(e->n_ctx) + 1) * bb;
	uint64_t kv = c->kv_blocks ? c->kv_blocks * bb : e->kv_mem_bytes;
	const bool dev_tier = e->place.b && !e->place.experts_resident && e->place.tier_mb > 0;
	struct md_expert_tiers_config tc = {
		.cache_mb = c->expert_cache_mb,
		.device_mb = dev_tier ? e->place.tier_mb : c->device_expert_mb,
		.device = c->expert_device,
		.dev = dev_tier ? e->place.b : NULL,
		.policy = c->expert_policy,
		.prefetch = !c->no_expert_prefetch,
		.fill = !c->no_expert_fill,
		.step_tokens = c->step_tokens,
		.state_dir = c->state_dir,
		.kv_bytes = kv,
		.kv_min = c->kv_blocks ? kv : kv_min,
	};
	char why[sizeof(e->err) - 400];
	int rc = md_expert_tiers_init(&e->tiers, &e->model, &tc, why, sizeof(why));
	if (rc && e->tiers.refused)
		snprintf(e->err, sizeof(e->err), "'%s' cannot be served %s; raise the limit, lower "
			 "ctx-size (KV for one context of %u tokens is %.0f MiB) or serve a smaller "
			 "model", c->model_path, why, e->n_ctx, kv_min / 1048576.0);
	else if (rc)
		snprintf(e->err, sizeof(e->err), "%s", why);
	if (rc)
		return rc;
	e->store = e->tiers.store;
	e->kv_mem_bytes = e->tiers.kv_bytes;
	return 0;
}

/* Expert-aware batching's residency predicate (md_sched_resident_fn): host RAM or device. */
static bool store_resident(void *arg, uint32_t layer, uint32_t expert)
{
	return md_expert_store_resident(arg, layer, expert);
}

/* The store's counters into e->stats (engine thread, st_mu held). */
static void experts_stats(struct md_engine *e)
{
	struct md_expert_store_stats st;
	md_expert_store_get_stats(e->store, &st);
	struct md_engine_stats *o = &e->stats;
	o->experts_store = true;
	o->experts_hits = st.hits;
	o->experts_misses = st.misses;
	o->experts_bytes_read = st.bytes_read;
	o->experts_read_errors = st.read_errors;
	o->experts_evictions = st.evictions;
	o->experts_stall_s = st.stall_ns / 1e9;
	o->experts_prefetch_issued = st.prefetch_issued;
	o->experts_prefetch_used = st.prefetch_used;
	o->experts_prefetch_wasted_bytes = st.prefetch_wasted_bytes;
	o->experts_prefetch_cancelled = st.prefetch_cancelled;
	o->experts_predicted_used = st.predicted_used;
	o->experts_predicted_total = st.predicted_total;
	o->experts_steps = st.steps;
	o->experts_step_distinct = st.step_experts;
	o->experts_slots = st.n_slots;
	o->experts_resident = st.n_resident;
	o->experts_cache_bytes = (uint64_t)st.n_slots * st.slot_bytes;
	o->experts_device = st.dev_slots > 0;
	o->dev_hits = st.dev_hits;
	o->dev_misses = st.dev_misses;
	o->dev_compute_dev = st.dev_compute_dev;
	o->dev_compute_host = st.dev_compute_host;
	o->dev_uploads = st.dev_uploads;
	o->dev_bytes_uploaded = st.dev_bytes_uploaded;
	o->dev_evictions = st.dev_evictions;
	o->dev_stall_s = st.dev_stall_ns / 1e9;
	o->dev_prefetch_issued = st.dev_prefetch_issued;
	o->dev_prefetch_used = st.dev_prefetch_used;
	o->dev_prefetch_wasted_bytes = st.dev_prefetch_wasted_bytes;
	o->dev_resident = st.dev_resident;
	o->dev_mem_bytes = st.dev_mem_bytes;
}

/*
 * Decide the tokens of plan item i from its logits rows (engine/spec.h, DESIGN): row j is
 * sampled with the history extended by the drafts accepted before it, and the walk stops at
 * the first rejected draft, an end-of-generation token or a length limit, exactly where
 * emitting would stop. Decided tokens are written after toks[n_toks) as scratch (within cap)
 * so the penalties of the next row see them. Nothing is emitted or appended here.
 */
static void decide_item(struct md_engine *e, uint32_t i, const float *rows,
			struct md_sample_out *out)
{
	struct spec_step *sp = &e->sp;
	struct md_plan_item *it = &e->sched.plan.items[i];
	struct md_seq *s = it->seq;
	const struct md_engine_req *r = s->req;
	struct md_spec_seq *ss = s->spec;
	uint32_t n = 0, acc = 0;
	sp->err[i] = 0;
	for (uint32_t j = 0; j < it->n_logits; j++) {
		int32_t d = j < it->n_draft ? ss->draft[j] : -1;
		const struct md_sampler_dist *q = d >= 0 && ss->draft_q ? &ss->q[j] : NULL;
		struct md_sampler_ctx ctx = {
			.prompt = s->toks, .n_prompt = s->n_prompt,
			.gen = s->toks + s->n_prompt, .n_gen = s->n_toks - s->n_prompt + j,
		};
		if (r->grammar) {
			int grc = grammar_mask(e, s, j, &ctx.allowed);
			if (grc) {
				sp->err[i] = grc;
				break;
			}
		}
		bool ok;
		int rc = md_spec_decide(&s->sm, &r->sampling, &ctx, rows + (size_t)j * e->n_vocab,
					d, q, &sp->resid, &out[n], &ok);
		if (rc) {
			sp->err[i] = rc;
			break;
		}
		if (r->grammar && (rc = md_gmatch_accept(r->_gm, out[n].token))) {
			sp->err[i] = rc;
			break;
		}
		s->toks[s->n_toks + n] = out[n].token;
		n++;
		if (!ok)
			break;
		acc++;
		if ((md_tokenizer_is_eog(e->text.tok, out[n - 1].token) &&
		     (!r->ignore_eos || r->grammar)) ||
		    at_limit(e, s, n) || (r->grammar && md_gmatch_is_final(r->_gm)))
			break; /* nothing may follow: the sequence ends with this token */
	}
	sp->n_out[i] = n;
	sp->n_acc[i] = acc;
	/* Every decided token but the last is an accepted draft whose K/V row stays. */
	sp->keep[i] = n ? n - 1 : 0;
	if (ss && it->n_draft) {
		ss->drafted += it->n_draft;
		ss->accepted += acc;
		ss->verify_steps++;
	}
	if (ss)
		md_spec_ctl_feedback(&e->ctl, ss, it->n_draft, acc, n ? out[0].token : -1);
}

/* Emit what decide_item decided for item i (after the commit). */
static void emit_item(struct md_engine *e, uint32_t i, const struct md_sample_out *out)
{
	struct spec_step *sp = &e->sp;
	struct md_seq *s = e->sched.plan.items[i].seq;
	if (sp->n_out[i] == 0) {
		seq_end(e, s, MD_FINISH_ERROR, sp->err[i] ? sp->err[i] : -EIO);
		return;
	}
	for (uint32_t j = 0; j < sp->n_out[i]; j++)
		if (emit_token(e, s, &out[j], j + 1 == sp->n_out[i]))
			return;
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
	e->stats.prefix_queries = ss->prefix_queries;
	e->stats.prefix_hits = ss->prefix_hits;
	e->stats.prefix_hit_tokens = ss->prefix_hit_tokens;
	e->stats.prefix_blocks = e->kv_ready ? md_kv_prefix_blocks(&e->kv) : 0;
	e->stats.prefix_evictions = e->kv_ready ? md_kv_prefix_evictions(&e->kv) : 0;
	e->stats.moe_layer_steps = e->moe_layer_steps;
	e->stats.moe_distinct_experts = e->moe_distinct;
	e->stats.expert_selections = ss->expert_selections;
	e->stats.prefill_selections = ss->prefill_selections;
	if (e->store)
		experts_stats(e);
	if (e->fdev) {
		md_fwd_dev_counts(e->fdev, &e->stats.dev_layers_routed_dev,
				  &e->stats.dev_layers_routed_host);
		md_fwd_dev_graphs(e->fdev, &e->stats.dev_graph_captures, &e->stats.dev_graph_launches);
	}
	e->stats.spec_drafted = e->sp.drafted;
	e->stats.spec_accepted = e->sp.accepted;
	e->stats.spec_verify_steps = e->sp.verify_steps;
	e->stats.spec_emitted = e->sp.emitted;
	e->stats.spec_seq_steps = e->sp.seq_steps;
	e->stats.spec_proposal_steps = e->sp.proposal_steps;
	e->stats.spec_proposed = e->sp.proposed;
	e->stats.spec_verify_layers = e->sp.verify_layers;
	e->stats.spec_verify_distinct = e->sp.verify_distinct;
	e->stats.spec_self_predicted = e->self.prefetched;
	e->stats.spec_self_predicted_used = e->sp.self_hit;
	e->stats.spec_self_used = e->sp.self_used;
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

/* ---- routing observers ---- */

/* Every MoE layer's routing, on the engine thread during md_forward: the routing trace, the
 * scheduler's expert predictions, the distinct-experts statistics. */
static void on_route(void *ud, uint32_t layer, const struct md_routing *r)
{
	struct md_engine *e = ud;
	if (e->trace)
		md_route_trace_layer(e->trace, layer, r);
	md_sched_note_routing(&e->sched, layer, r);
	e->moe_layer_steps++;
	e->moe_distinct += (uint64_t)r->n_active;
	if (e->step_verifies) {
		e->sp.verify_layers++;
		e->sp.verify_distinct += (uint64_t)r->n_active;
	}
	if (e->step_predicted) {
		const uint8_t *p = md_self_draft_predicted(&e->self, layer);
		for (int i = 0; i < r->n_active; i++)
			e->sp.self_hit += p[r->active[i]] != 0;
		e->sp.self_used += (uint64_t)r->n_active;
	}
}

/* Pre-gating's prediction of a layer's routing, into the trace (set only when tracing). */
static void on_pregate(void *ud, uint32_t layer, const struct md_routing *r)
{
	struct md_engine *e = ud;
	md_route_trace_pregate(e->trace, layer, r);
}

/* Name each row of the planned batch for the trace: its request id and position. */
static void trace_step_begin(struct md_engine *e, const struct md_plan *p)
{
	if (!e->trace)
		return;
	for (uint32_t i = 0; i < p->n_items; i++)
		for (uint32_t k = 0; k < p->items[i].n_tok; k++)
			e->trace_seq[p->items[i].row + k] = p->items[i].seq->req->id;
	md_route_trace_step(e->trace, e->sched.step_no, p->n_tokens, e->trace_seq, p->pos);
}

static int setup_trace(struct md_engine *e)
{
	const struct md_hparams *hp = &e->model.hp;
	if (!e->cfg.trace_routing)
		return 0;
	if (hp->n_expert == 0) {
		snprintf(e->err, sizeof(e->err), "trace-routing: the model has no experts");
		return -EINVAL;
	}
	e->trace_seq = malloc(sizeof(*e->trace_seq) * e->cfg.step_tokens);
	if (!e->trace_seq)
		return -ENOMEM;
	e->trace = md_route_trace_open(e->cfg.trace_routing, hp->n_layer, hp->n_expert,
				       hp->n_expert_used, e->err, sizeof(e->err));
	if (!e->trace)
		return -EINVAL;
	if (e->cfg.progress)
		md_log(MD_LOG_INFO, "tracing routing to '%s'", e->cfg.trace_routing);
	return 0;
}

/* ---- speculation in the step ---- */

/* Count the step's verifications (after decide_item). */
static void spec_account(struct md_engine *e)
{
	struct spec_step *sp = &e->sp;
	const struct md_plan *p = &e->sched.plan;
	for (uint32_t i = 0; i < p->n_items; i++) {
		if (p->items[i].n_draft == 0)
			continue;
		sp->drafted += p->items[i].n_draft;
		sp->accepted += sp->n_acc[i];
		sp->verify_steps++;
		sp->emitted += sp->n_out[i];
	}
}

/* Drafts a decoding sequence may carry: its k, and no more than the tokens it may still emit
 * after the one it is sure to get. */
static uint32_t spec_room(const struct md_engine *e, const struct md_seq *s)
{
	uint32_t k = s->spec->max_k;
	uint32_t left_gen = s->req->max_tokens > s->n_gen ? s->req->max_tokens - s->n_gen : 0;
	uint32_t left_cap = s->cap - s->n_toks, left_ctx = e->n_ctx > s->n_toks ? e->n_ctx - s->n_toks : 0;
	uint32_t left = left_gen < left_cap ? left_gen : left_cap;
	left = left < left_ctx ? left : left_ctx;
	left = left > 0 ? left - 1 : 0;
	return k < left ? k : left;
}

/* The wall clock in seconds (the step trace's). */
static double wall_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Before the plan: the n-gram proposals, the controller's k for every decoding sequence with
 * a drafter (engine/spec_ctl.h), then the draft model's rounds. */
static void spec_propose(struct md_engine *e)
{
	struct md_sched *sc = &e->sched;
	uint32_t nd = 0, ns = 0, nc = 0, B = 0;
	for (uint32_t i = 0; i < sc->n_running; i++) {
		struct md_seq *s = sc->running[i];
		struct md_spec_seq *ss = s->spec;
		if (s->n_toks - s->n_kv != 1)
			continue;
		B++;
		if (!ss)
			continue;
		e->sp.seq_steps++;
		ss->n_draft = 0;
		ss->draft_q = false;
		ss->n_prop = 0;
		ss->cls = 0;
		s->draft = ss->draft;
		s->n_draft = 0;
		uint32_t k = spec_room(e, s);
		if (k == 0)
			continue;
		if (ss->drafter == MD_SPEC_NGRAM) {
			k = md_spec_ngram(s->toks, s->n_toks, 2, 4, k, ss->draft,
					  e->ctl.one_class ? NULL : &ss->cls);
			if (k == 0)
				continue;
		}
		e->sp.proposal_steps++;
		e->sp.proposed += k;
		ss->n_prop = k;
		ss->catchup = 0;
		if (ss->drafter == MD_SPEC_DRAFT && e->draft_ready) {
			/* what the rows the draft model has not seen add to its round 0 */
			ss->catchup = md_spec_ctl_catchup_cost(&e->ctl, &e->draft.rounds,
							       md_draft_catchup_rows(s));
		}
		ss->horizon = s->req->max_tokens > s->n_gen ? s->req->max_tokens - s->n_gen : 1;
		e->cseq[nc] = s;
		e->css[nc] = ss;
		e->ck[nc++] = k;
	}
	if (nc == 0)
		return;
	const struct md_spec_rounds *rounds[MD_SPEC_CTL_DRAFTERS] = { NULL };
	rounds[MD_SPEC_DRAFT] = e->draft_ready ? &e->draft.rounds : NULL;
	rounds[MD_SPEC_SELF] = e->self.ready ? &e->self.rounds : NULL;
	md_spec_ctl_choose(&e->ctl, e->css, e->ck, rounds, nc, B);
	/* Drafts beyond the spare logits rows would crowd other sequences out of the step. */
	uint32_t spare = e->max_logits - e->cfg.max_seqs;
	for (uint32_t i = 0; i < nc; i++) {
		if (e->ck[i] > spare)
			e->ck[i] = spare;
		spare -= e->ck[i];
	}
	for (uint32_t i = 0; i < nc; i++) {
		struct md_seq *s = e->cseq[i];
		struct md_spec_seq *ss = s->spec;
		ss->k_used = e->ck[i];
		if (ss->drafter == MD_SPEC_NGRAM) {
			if (e->ck[i] == 0 && ss->n_shadow == 0) {
				/* judged against the tokens the next steps emit */
				memcpy(ss->shadow, ss->draft, ss->n_prop * sizeof(int32_t));
				ss->n_shadow = ss->n_prop;
				ss->shadow_at = 0;
				ss->shadow_cls = ss->cls;
			}
			ss->n_draft = s->n_draft = e->ck[i];
		} else if (e->ck[i] > 0 && ss->drafter == MD_SPEC_SELF) {
			e->sseq[ns] = s;
			e->sk[ns++] = e->ck[i];
		} else if (e->ck[i] > 0) {
			e->dseq[nd] = s;
			e->dk[nd++] = e->ck[i];
		}
	}
	if (nd > 0) {
		/* traced: the draft model's rounds and the catch-up rows of the first sequence */
		double tw0 = e->ctl.trace ? wall_s() : 0;
		uint32_t seen0 = e->dseq[0]->spec->n_dkv;
		int rc = md_draft_propose(&e->draft, e->dseq, e->dk, nd);
		if (e->ctl.trace)
			fprintf(stderr, "spec-draft seqs=%u k0=%u caught_up=%d wall=%.2fms "
				"charged_catchup=%.2fms t_round=%.2fms charged=%.2fms\n", nd, e->dk[0],
				(int)e->dseq[0]->spec->n_dkv - (int)seen0, (wall_s() - tw0) * 1e3,
				e->dseq[0]->spec->catchup * 1e3,
				md_spec_rounds_one(&e->draft.rounds) * 1e3,
				md_spec_ctl_pass_cost(&e->ctl, &e->draft.rounds, e->dk, nd) * 1e3);
		if (rc)
			md_log(MD_LOG_WARN, "draft model step failed (%d): no drafts this step", rc);
		for (uint32_t i = 0; i < nd; i++)
			e->dseq[i]->n_draft = e->dseq[i]->spec->n_draft;
	}
	if (ns > 0) {
		/* traced: the self-draft passes, as the draft model's rounds above */
		double tw0 = e->ctl.trace ? wall_s() : 0;
		int rc = md_self_draft_propose(&e->self, e->sseq, e->sk, ns);
		if (e->ctl.trace)
			fprintf(stderr, "spec-self seqs=%u k0=%u wall=%.2fms t_round=%.2fms "
				"charged=%.2fms\n", ns, e->sk[0], (wall_s() - tw0) * 1e3,
				md_spec_rounds_one(&e->self.rounds) * 1e3,
				md_spec_ctl_pass_cost(&e->ctl, &e->self.rounds, e->sk, ns) * 1e3);
		if (rc)
			md_log(MD_LOG_WARN, "self-speculation draft failed (%d): no drafts this step", rc);
		for (uint32_t i = 0; i < ns; i++)
			e->sseq[i]->n_draft = e->sseq[i]->spec->n_draft;
	}
}

/* The speculation state of a new sequence from its request and the engine's defaults; NULL
 * (no speculation) when off. Returns 0 or -ENOMEM. */
static int spec_attach(struct md_engine *e, struct md_seq *s, uint64_t seed)
{
	const struct md_spec_opts *o = &s->req->spec;
	enum md_spec_drafter d = o->drafter == MD_SPEC_DEFAULT ? e->sp.drafter : o->drafter;
	if ((d == MD_SPEC_DRAFT && !e->draft_ready) || (d == MD_SPEC_SELF && !e->self.ready))
		d = MD_SPEC_OFF; /* not available: the server refuses such requests before */
	if (d != MD_SPEC_NGRAM && d != MD_SPEC_DRAFT && d != MD_SPEC_SELF)
		return 0;
	uint32_t k = o->max_k ? o->max_k : e->sp.k;
	s->spec = md_spec_seq_new(d, k < e->sp.k ? k : e->sp.k, seed);
	if (!s->spec)
		return -ENOMEM;
	md_spec_ctl_prior(&e->ctl, s->spec);
	return 0;
}

static int spec_setup(struct md_engine *e)
{
	struct spec_step *sp = &e->sp;
	const struct md_engine_config *c = &e->cfg;
	sp->k = c->spec_k ? c->spec_k : 16;
	if (sp->k > MD_SPEC_MAX_K)
		sp->k = MD_SPEC_MAX_K;
	sp->drafter = c->spec == MD_SPEC_DEFAULT ? MD_SPEC_OFF : c->spec;
	uint32_t S = c->max_seqs;
	/* Logits rows for every sequence, and drafts for up to 16 of them at once (under heavier
	 * load the scheduler trims drafts to the rows; the controller rarely wants more then). */
	e->max_logits = S + (S < 16 ? S : 16) * sp->k;
	md_spec_ctl_init(&e->ctl, &e->model, c->spec_fixed);
	e->dseq = calloc(S, sizeof(*e->dseq));
	e->dk = calloc(S, sizeof(*e->dk));
	e->cseq = calloc(S, sizeof(*e->cseq));
	e->css = calloc(S, sizeof(*e->css));
	e->ck = calloc(S, sizeof(*e->ck));
	e->sseq = calloc(S, sizeof(*e->sseq));
	e->sk = calloc(S, sizeof(*e->sk));
	if (!e->dseq || !e->dk || !e->cseq || !e->css || !e->ck || !e->sseq || !e->sk)
		return -ENOMEM;
	sp->out = calloc(e->max_logits, sizeof(*sp->out));
	sp->n_out = calloc(S, sizeof(uint32_t));
	sp->n_acc = calloc(S, sizeof(uint32_t));
	sp->keep = calloc(S, sizeof(uint32_t));
	sp->err = calloc(S, sizeof(int));
	if (!sp->out || !sp->n_out || !sp->n_acc || !sp->keep || !sp->err ||
	    md_sampler_dist_init(&sp->resid, e->n_vocab))
		return -ENOMEM;
	sp->ready = true;
	return 0;
}

static void spec_release(struct md_engine *e)
{
	struct spec_step *sp = &e->sp;
	free(sp->out);
	free(sp->n_out);
	free(sp->n_acc);
	free(sp->keep);
	free(sp->err);
	if (sp->ready)
		md_sampler_dist_release(&sp->resid);
	memset(sp, 0, sizeof(*sp));
	if (e->draft_ready)
		md_draft_release(&e->draft);
	e->draft_ready = false;
	free(e->dseq);
	free(e->dk);
	free(e->cseq);
	free(e->css);
	free(e->ck);
	free(e->sseq);
	free(e->sk);
	md_self_draft_release(&e->self);
}

/* The controller's step costs for one sequence verifying up to k drafts, measured before
 * serving (md_spec_ctl_calibrate): a request's first drafts are then weighed against times
 * already known instead of probes that cost it the steps it would gain (requests are short:
 * a probe's cold first step of a size cost 2x its later ones). A warm-up step first, then
 * every size 1..k+1 up to CAL_PASSES times (each size's median), on a scratch sequence of a
 * text's tokens (the forward's routing observer is detached: the scheduler and metrics
 * never see these steps). Not with an expert store (the steps would fetch experts no request
 * asked for) nor while tracing routes.
 *
 * The steps verify what a served one does: tokens of running text after CAL_CTX tokens of
 * context, each pass at another place in the text. The first version timed the text's first
 * tokens at positions 0..n-1, the same ones every pass: on default-1g those routed to fewer
 * distinct experts than verified text does, and 2 tokens cost 1.30-1.35x one token in it,
 * where served steps (and moed-bench -v, context 32) cost 1.7-1.8x. Wherever a size had not
 * been measured lately the controller fell back on that shape and drafted at an acceptance
 * of 0.5-0.67, which loses (traced with the draft model, which runs at 0.92-0.98x plain
 * decode where it cannot pay; bench/README.md). */
#define CAL_PASSES 5     /* timed passes over the sizes, after a warm-up step */
#define CAL_BUDGET_S 2.0 /* CPU seconds: fewer passes where steps are slow */
#define CAL_CTX 16       /* context before the timed steps */
#define CAL_SHIFT 5      /* tokens the text moves on between passes */

static int cmp_double(const void *a, const void *b)
{
	const double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

/* One forward pass of tokens ids[0..n) at positions p0.. of seq; its critical path in *dt
 * when dt is not NULL. Returns whether it ran. */
static bool cal_pass(struct md_engine *e, int seq, const int32_t *ids, uint32_t n, uint32_t p0,
		     double *dt)
{
	int32_t sq[MD_SPEC_MAX_K + CAL_CTX + 1], pos[MD_SPEC_MAX_K + CAL_CTX + 1];
	bool want[MD_SPEC_MAX_K + CAL_CTX + 1];
	for (uint32_t i = 0; i < n; i++) {
		sq[i] = seq;
		pos[i] = (int32_t)(p0 + i);
		want[i] = dt != NULL || i + 1 == n; /* a verification wants every row's logits */
	}
	struct md_batch b = { .n_tokens = (int32_t)n, .tokens = (int32_t *)ids, .seq = sq,
			      .pos = pos, .want_logits = want };
	if (md_kv_reserve(&e->kv, seq, p0 + n) != 0)
		return false;
	struct md_spec_watch w;
	md_spec_watch_start(&w, md_forward_pool(e->fw));
	if (md_forward(e->fw, &e->kv, &b, e->logits) != (dt ? (int)n : 1))
		return false;
	if (dt)
		*dt = md_spec_watch_read(&w);
	return true;
}

static void spec_calibrate(struct md_engine *e)
{
	const uint32_t n_max = e->sp.k + 1;
	if (e->cfg.spec_fixed || e->store || e->trace || n_max > e->cfg.step_tokens ||
	    n_max > e->max_logits || CAL_CTX > e->cfg.step_tokens)
		return;
	int seq = md_kv_seq_new(&e->kv);
	if (seq < 0)
		return;
	/* Text, not ids spread over the vocabulary: on default-1g such ids made a 2-token step
	 * cost 1.84x a 1-token one (they route to more distinct experts than text does). */
	static const char text[] =
		"The river ran past the old mill, and the children of the village went down to "
		"the water every morning of the summer. Their mothers called them home at noon, "
		"but the boys stayed by the stones until the sun was low and the fish came up to "
		"feed in the shallows under the bridge.";
	const uint32_t need = CAL_CTX + n_max + CAL_PASSES * CAL_SHIFT;
	int32_t tok[MD_SPEC_MAX_K + CAL_CTX + 1 + CAL_PASSES * CAL_SHIFT];
	int32_t *ids = NULL;
	int n_ids = md_engine_tokenize(e, text, sizeof(text) - 1, false, false, &ids);
	for (uint32_t i = 0; i < need; i++)
		tok[i] = n_ids > 0 ? ids[i % (uint32_t)n_ids] : (int32_t)((i * 7919u + 101u) % e->n_vocab);
	md_forward_set_route_cb(e->fw, NULL, NULL);
	md_forward_set_pregate_cb(e->fw, NULL, NULL);
	double t_all = md_spec_ctl_clock();
	double dt[CAL_PASSES][MD_SPEC_MAX_K + 2];
	uint32_t passes = 0;
	bool ok = true;
	for (uint32_t pass = 0; pass <= CAL_PASSES && ok; pass++) {
		/* pass 0 warms up (the largest size once); pass p times every size at the
		 * text's place (p - 1) * CAL_SHIFT */
		const int32_t *at = tok + (pass ? (pass - 1) * CAL_SHIFT : 0);
		md_kv_truncate(&e->kv, seq, 0);
		ok = cal_pass(e, seq, at, CAL_CTX - 1, 0, NULL);
		for (uint32_t n = pass ? 1 : n_max; n <= n_max && ok; n++) {
			/* after a plain step, as in serving: a step after a large one finds less of
			 * the dense weights in the cache (one token: 4.2-4.5 ms against 3.5 served) */
			ok = cal_pass(e, seq, at + CAL_CTX - 1, 1, CAL_CTX - 1, NULL) &&
			     cal_pass(e, seq, at + CAL_CTX, n, CAL_CTX, pass ? &dt[pass - 1][n] : NULL);
			md_kv_truncate(&e->kv, seq, CAL_CTX - 1);
		}
		if (ok && pass)
			passes = pass;
		/* A big model's steps take long: stop at the time budget once one pass is in. */
		if (passes && md_spec_ctl_clock() - t_all > CAL_BUDGET_S)
			break;
	}
	/* Each size's median over the passes: its times are bimodal on a shared machine
	 * (default-1g, 2 tokens: 9.8-9.9 or 13.7-13.9 ms over six passes). */
	for (uint32_t n = 1; n <= n_max && passes; n++) {
		double v[CAL_PASSES];
		for (uint32_t p = 0; p < passes; p++)
			v[p] = dt[p][n];
		qsort(v, passes, sizeof(v[0]), cmp_double);
		md_spec_ctl_calibrate(&e->ctl, n, passes % 2 ? v[passes / 2]
						 : 0.5 * (v[passes / 2 - 1] + v[passes / 2]));
	}
	free(ids);
	md_kv_seq_free(&e->kv, seq);
	md_forward_set_route_cb(e->fw, on_route, e);
	if (e->trace)
		md_forward_set_pregate_cb(e->fw, on_pregate, e);
	if (e->cfg.progress && ok)
		md_log(MD_LOG_INFO, "speculation: step costs of 1..%u tokens measured in %.0f ms "
		       "(1: %.2f ms, 2: %.2f ms, %u: %.2f ms)", n_max,
		       (md_spec_ctl_clock() - t_all) * 1e3, md_spec_ctl_cost(&e->ctl, 1) * 1e3,
		       md_spec_ctl_cost(&e->ctl, 2) * 1e3, n_max, md_spec_ctl_cost(&e->ctl, n_max) * 1e3);
}

/* The draft model, when configured (after the forward context exists: it shares its pool). */
static int spec_load_draft(struct md_engine *e, int threads)
{
	const struct md_engine_config *c = &e->cfg;
	if (!c->draft_model_path) {
		if (c->spec == MD_SPEC_DRAFT) {
			snprintf(e->err, sizeof(e->err), "spec = draft needs a draft model "
				 "(--draft-model FILE)");
			return -EINVAL;
		}
		return 0;
	}
	uint32_t kv_mb = c->kv_mem_mb / 4 ? c->kv_mem_mb / 4 : 16;
	int rc = md_draft_load(&e->draft, c->draft_model_path, &e->model, e->fw, threads,
			       c->max_seqs, e->n_ctx, c->step_tokens, kv_mb, e->err, sizeof(e->err));
	if (rc) {
		md_draft_release(&e->draft);
		return rc;
	}
	e->draft_ready = true;
	char why[300] = "";
	bool on_dev = e->fdev && !md_draft_set_device(&e->draft, e->place.b, why, sizeof(why));
	if (e->fdev && !on_dev)
		md_log(MD_LOG_WARN, "draft model '%s' stays on the CPU: %s", c->draft_model_path, why);
	if (c->progress) {
		const struct md_hparams *hp = &e->draft.model.hp;
		md_log(MD_LOG_INFO, "draft model '%s': %s, %u layers, n_embd %u, %.1f MiB, on the %s",
		       c->draft_model_path, hp->arch_name, hp->n_layer, hp->n_embd,
		       e->draft.model.gguf.size / 1048576.0, on_dev ? "device" : "CPU");
	}
	return 0;
}

/* After the forward pass: each plan item's first token error (md_batch.tok_err: an expert its
 * tokens needed could not be read) into e->item_err. Those sequences fail with it; the rest of
 * the step is exact and goes on. Returns how many items failed. */
static uint32_t items_failed(struct md_engine *e, const struct md_plan *p)
{
	uint32_t n_bad = 0;
	for (uint32_t i = 0; i < p->n_items; i++) {
		const struct md_plan_item *it = &p->items[i];
		e->item_err[i] = 0;
		for (uint32_t t = it->row; t < it->row + it->n_tok && !e->item_err[i]; t++)
			e->item_err[i] = e->tok_err[t];
		if (e->item_err[i]) {
			n_bad++;
			md_log(MD_LOG_WARN, "request %llu failed: an expert it needs cannot be read "
			       "(%s); the other requests go on", (unsigned long long)it->seq->req->id,
			       strerror(-e->item_err[i]));
		}
	}
	return n_bad;
}

/* Self-speculation, where the model can draft as itself (MoE, or layers to skip): a missing
 * ability is no error unless the server's default drafter is self or layers were asked. */
static int spec_setup_self(struct md_engine *e)
{
	const struct md_engine_config *c = &e->cfg;
	char why[256];
	int rc = md_self_draft_init(&e->self, &e->model, e->fw, &e->kv, c->spec_self_experts,
				    c->spec_self_skip, c->max_seqs, why, sizeof(why));
	if (rc == -ENOMEM) {
		snprintf(e->err, sizeof(e->err), "%s", why);
		return rc;
	}
	if (rc) {
		bool asked = c->spec == MD_SPEC_SELF || (c->spec_self_skip && c->spec_self_skip[0]);
		md_self_draft_release(&e->self);
		if (asked) {
			snprintf(e->err, sizeof(e->err), "%s", why);
			return rc;
		}
		return 0;
	}
	if (e->store)
		md_self_draft_set_src(&e->self, md_expert_store_src(e->store));
	return 0;
}

/* $MOED_SPEC_TRACE's line per decode step (bench/spec_trace.py reads it): its tokens and
 * outputs, its cost as the controller counts it, its wall and process CPU time, and the
 * distinct experts it computed. Read only while tracing. */
struct step_trace {
	double cpu0, wall0;
	uint64_t distinct0;
};

static void step_trace_start(const struct md_engine *e, struct step_trace *t)
{
	t->cpu0 = md_spec_ctl_clock();
	t->wall0 = wall_s();
	t->distinct0 = e->moe_distinct;
}

static void step_trace_print(const struct md_engine *e, const struct step_trace *t, uint32_t n,
			     double dt)
{
	const struct md_plan *p = &e->sched.plan;
	uint32_t out = 0;
	for (uint32_t i = 0; i < p->n_items; i++)
		out += e->sp.n_out[i];
	fprintf(stderr, "spec-step n=%u items=%u out=%u dt=%.2fms wall=%.2fms experts=%llu "
		"cpu=%.2fms\n", n, p->n_items, out, dt * 1e3, (wall_s() - t->wall0) * 1e3,
		(unsigned long long)(e->moe_distinct - t->distinct0),
		(md_spec_ctl_clock() - t->cpu0) * 1e3);
}

/* One scheduler step. Returns true when it did work. */
static bool step(struct md_engine *e)
{
	MD_ASSERT_OWNER(&e->owner);
	struct md_sched *sc = &e->sched;
	spec_propose(e);
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
		.want_logits = p->want_logits, .tok_err = e->tok_err,
	};
	trace_step_begin(e, p);
	e->step_verifies = false;
	for (uint32_t i = 0; i < p->n_items && !e->step_verifies; i++)
		e->step_verifies = p->items[i].n_draft > 0;
	e->step_predicted = e->step_verifies && md_self_draft_take_prediction(&e->self);
	struct md_spec_watch watch;
	md_spec_watch_start(&watch, md_forward_pool(e->fw));
	struct step_trace st = { 0 };
	if (e->ctl.trace)
		step_trace_start(e, &st);
	int rows = md_forward(e->fw, &e->kv, &b, e->logits);
	e->step_verifies = e->step_predicted = false;
	if (e->trace)
		md_route_trace_flush(e->trace);
	if (rows < 0 || (uint32_t)rows != p->n_logits) {
		md_log(MD_LOG_ERROR, "engine step failed (%d); failing %u sequences", rows,
		       md_sched_n_running(sc));
		finish_all(e, MD_FINISH_ERROR, rows < 0 ? rows : -EIO);
		return true;
	}
	/* Decide every item's tokens, roll back the rejected drafts, then emit: emitting may
	 * remove a sequence, which the commit still reads. Logits rows come in item order; an
	 * item's rows are its last n_logits tokens. */
	struct spec_step *sp = &e->sp;
	uint32_t n_bad = items_failed(e, p);
	uint32_t k = 0;
	for (uint32_t i = 0; i < p->n_items; i++) {
		sp->n_out[i] = sp->n_acc[i] = sp->keep[i] = 0;
		if (p->items[i].n_logits == 0 || e->item_err[i])
			goto next;
		decide_item(e, i, e->logits + (size_t)k * e->n_vocab, sp->out + k);
	next:
		k += p->items[i].n_logits;
	}
	/* The controller's cost table: forward plus decisions of decode-only steps. */
	if (p->n_prompt == 0 && p->n_recompute == 0 && n_bad == 0) {
		double dt = md_spec_watch_read(&watch);
		md_spec_ctl_observe(&e->ctl, n, dt);
		if (e->ctl.trace)
			step_trace_print(e, &st, n, dt);
	}
	md_sched_commit(sc, sp->keep);
	spec_account(e);
	k = 0;
	for (uint32_t i = 0; i < p->n_items; i++) {
		uint32_t rows0 = k;
		k += p->items[i].n_logits;
		if (e->item_err[i])
			seq_end(e, p->items[i].seq, MD_FINISH_ERROR, e->item_err[i]);
		else if (p->items[i].n_logits)
			emit_item(e, i, sp->out + rows0);
	}
	return true;
}

/* ---- loading ---- */

/* Page the weights in now, with progress, rather than on the first requests: populate the
 * page tables a tenth at a time (MADV_POPULATE_READ, Linux 5.14+, no fault per page), or touch
 * every page where the kernel lacks it. */
static void load_status(const struct md_engine_config *c, const char *status)
{
	if (c->progress)
		md_log(MD_LOG_INFO, "%s", status);
	if (c->status_cb)
		c->status_cb(c->status_arg, status);
}

static void populate_weights(const struct md_model *m, const struct md_engine_config *c)
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
		char st[64];
		snprintf(st, sizeof(st), "loading weights %3zu%%", (off + len) * 100 / size);
		load_status(c, st);
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

/* Size and allocate the KV pool. An explicit block count too small for one full context is
 * a configuration that cannot work: refuse it rather than silently growing it. */
static int setup_kv(struct md_engine *e)
{
	const struct md_engine_config *c = &e->cfg;
	const struct md_hparams *hp = &e->model.hp;
	uint64_t block_bytes = kv_block_bytes(e);
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
		n_blocks = e->kv_mem_bytes / (block_bytes ? block_bytes : 1);
	uint64_t useful = (uint64_t)c->max_seqs * min_blocks;
	if (n_blocks > useful)
		n_blocks = useful;
	if (n_blocks < min_blocks)
		n_blocks = min_blocks;
	int rc = md_kv_init_rows(&e->kv, hp->n_layer, kv_rows(e), (uint32_t)n_blocks, c->max_seqs);
	if (rc) {
		snprintf(e->err, sizeof(e->err), "cannot allocate the KV cache (%llu blocks)",
			 (unsigned long long)n_blocks);
		return rc;
	}
	if (!c->no_prefix_cache && (rc = md_kv_prefix_enable(&e->kv))) {
		snprintf(e->err, sizeof(e->err), "cannot allocate the prefix cache index");
		return rc;
	}
	e->kv_ready = true;
	if (c->progress)
		md_log(MD_LOG_INFO, "KV cache %llu blocks of %d tokens (%.1f MiB, %llu bytes per "
		       "token), context %u, %u sequences, step budget %u tokens",
		       (unsigned long long)n_blocks, MD_KV_BLOCK_TOKENS,
		       n_blocks * block_bytes / 1048576.0,
		       (unsigned long long)(block_bytes / MD_KV_BLOCK_TOKENS), e->n_ctx, c->max_seqs,
		       c->step_tokens);
	if (c->progress && hp->kv_lora_rank) {
		/* What the decompressed heads would take: K (nope + rope) and V per head. */
		uint64_t full = (uint64_t)hp->n_layer * hp->n_head *
				(hp->head_dim_nope + hp->n_rot + hp->head_dim_v);
		md_log(MD_LOG_INFO, "latent attention caches %u %s per token and layer; "
		       "decompressed K and V would take %llu bytes per token in float, %llu in half",
		       hp->kv_lora_rank + hp->n_rot, c->kv_f32 ? "floats" : "halves",
		       (unsigned long long)(full * 4), (unsigned long long)(full * 2));
	}
	return 0;
}

/* Load the model and build everything a step needs. On failure e->err says why; what was
 * built is freed by md_engine_free. */
static int load(struct md_engine *e)
{
	char err[400] = "";
	const struct md_engine_config *c = &e->cfg;
	char st[4200];
	snprintf(st, sizeof(st), "loading model '%s'", c->model_path);
	load_status(c, st);
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
	/* Like llama.cpp, a context longer than the training context is allowed (RoPE works at any
	 * position) but warned about: quality past the training length is the model's business. */
	e->n_ctx = c->n_ctx ? c->n_ctx : hp->n_ctx_train;
	if (e->n_ctx == 0)
		e->n_ctx = 4096;
	if (hp->n_ctx_train && e->n_ctx > hp->n_ctx_train)
		md_log(MD_LOG_WARN, "context %u exceeds the model's training context %u; output "
		       "past %u tokens may degrade", e->n_ctx, hp->n_ctx_train, hp->n_ctx_train);

	rc = setup_place(e);
	if (rc)
		return rc;
	rc = setup_experts(e);
	if (rc)
		return rc;
	md_log(MD_LOG_INFO, "%s", e->place.line);
	if (!e->store)
		populate_weights(&e->model, c);

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
	rc = setup_kv(e);
	if (rc)
		return rc;
	if (spec_setup(e)) {
		snprintf(e->err, sizeof(e->err), "out of memory setting up speculative decoding");
		return -ENOMEM;
	}
	struct md_sched_config sc = {
		.max_seqs = c->max_seqs, .step_tokens = c->step_tokens, .n_ctx = e->n_ctx,
		.n_layer = hp->n_expert ? hp->n_layer : 0, .n_expert = hp->n_expert,
		.expert_aware = c->expert_batching > 0 || (c->expert_batching < 0 && e->store),
		.max_logits = e->max_logits,
	};
	rc = md_sched_init(&e->sched, &sc, &e->kv);
	if (rc) {
		snprintf(e->err, sizeof(e->err), "cannot set up the scheduler (%d)", rc);
		return rc;
	}
	e->sched_ready = true;
	md_owner_claim(&e->sched.owner, "engine");
	if (e->store)
		md_sched_set_resident(&e->sched, store_resident, e->store);

	int threads = c->n_threads > 0 ? c->n_threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
	e->fw = md_forward_new(&e->model, threads, (int)c->step_tokens);
	/* One logits row per running sequence and its drafts; the scheduler keeps a step
	 * within that. */
	e->logits = malloc(sizeof(float) * (size_t)e->max_logits * e->n_vocab);
	e->tok_err = malloc(sizeof(*e->tok_err) * c->step_tokens);
	e->item_err = malloc(sizeof(*e->item_err) * c->max_seqs);
	if (!e->fw || !e->logits || !e->tok_err || !e->item_err) {
		snprintf(e->err, sizeof(e->err), "out of memory setting up the engine");
		return -ENOMEM;
	}
	md_forward_set_route_cb(e->fw, on_route, e);
	rc = setup_fwd_dev(e);
	if (rc)
		return rc;
	rc = setup_trace(e);
	if (rc)
		return rc;
	if (e->trace)
		md_forward_set_pregate_cb(e->fw, on_pregate, e);
	if (e->store)
		md_forward_set_expert_src(e->fw, md_expert_store_src(e->store));
	rc = spec_load_draft(e, threads);
	if (rc)
		return rc;
	rc = spec_setup_self(e);
	if (rc)
		return rc;
	spec_calibrate(e);
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
			if (s && spec_attach(e, s, seed)) {
				s->req = NULL; /* r is still the caller's: failed below */
				md_seq_free(s);
				s = NULL;
			}
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
	if (!rc)
		md_expert_tiers_save(&e->tiers);
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
	md_fwd_dev_free(e->fdev);
	e->fdev = NULL;
	if (md_route_trace_close(e->trace) < 0)
		md_log(MD_LOG_WARN, "routing trace '%s' is incomplete: a write failed",
		       e->cfg.trace_routing);
	free(e->trace_seq);
	md_expert_tiers_release(&e->tiers);
	e->store = NULL;
	if (e->kv_ready)
		md_kv_release(&e->kv);
	md_gvocab_free(e->gvocab);
	if (e->text_loaded)
		md_text_release(&e->text);
	if (e->model_loaded)
		md_model_free(&e->model);
	free(e->logits);
	free(e->tok_err);
	free(e->item_err);
	spec_release(e); /* the draft's device memory first */
	md_dev_place_release(&e->place);
	free((char *)e->cfg.model_path);
	free((char *)e->cfg.chat_template);
	free((char *)e->cfg.trace_routing);
	free((char *)e->cfg.expert_policy);
	free((char *)e->cfg.expert_device);
	free((char *)e->cfg.device);
	free((char *)e->cfg.state_dir);
	free((char *)e->cfg.spec_self_skip);
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

bool md_engine_has_draft(const struct md_engine *e)
{
	return e->draft_ready;
}

bool md_engine_has_self(const struct md_engine *e)
{
	return e->self.ready;
}

int md_engine_tool_format(const struct md_engine *e)
{
	return (int)md_chat_family_tool_format(e->text.chat);
}

bool md_engine_chat_harmony(const struct md_engine *e)
{
	return e->text.chat == MD_CHAT_GPT_OSS;
}

int md_engine_tool_text(const struct md_engine *e)
{
	return (int)md_chat_family_tool_text(e->text.chat);
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
	return md_engine_chat_tokenize_effort(e, msgs, n, tools, n_tools, NULL, ids);
}

int md_engine_chat_tokenize_effort(const struct md_engine *e, const struct md_engine_msg *msgs,
				   size_t n, const char *const *tools, size_t n_tools,
				   const char *reasoning_effort, int32_t **ids)
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
		cm[i].tool_call_id = msgs[i].tool_call_id;
		for (size_t j = 0; j < msgs[i].n_tool_calls; j++, k++) {
			calls[k].name = msgs[i].tool_calls[j].name;
			calls[k].arguments = msgs[i].tool_calls[j].arguments;
			calls[k].arguments_obj = msgs[i].tool_calls[j].arguments_obj;
			calls[k].id = msgs[i].tool_calls[j].id;
		}
	}
	rc = md_text_chat_tokenize_effort(&e->text, cm, n, tools, n_tools, reasoning_effort, ids);
out:
	free(calls);
	free(cm);
	return rc;
}

int md_engine_detokenize(const struct md_engine *e, const int32_t *ids, size_t n, char **out,
			 size_t *len)
{
	return md_tokenizer_decode(e->text.tok, ids, n, false, out, len);
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
