/* Chat and text completions: the generations in flight, from engine submit to the last byte. */
#include "server/gen.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/assert.h"
#include "common/log.h"
#include "server/harmony.h"
#include "server/request.h"
#include "server/stop.h"

#define SSE_HEADERS "Cache-Control: no-cache\r\nX-Accel-Buffering: no\r\n"

/* A token's logprob data waiting with its text. */
struct lp_ent {
	size_t off;                     /* where its text starts in the pending text */
	struct md_oai_lp lp;
};

struct md_gen;

/* A tool call of a choice (its id for the stream, all of it for the whole response). */
struct tcall {
	char id[40];
	char name[72];
	char *args;                     /* owned (args_cap): whole response only */
	size_t args_len, args_cap;
};

struct choice {
	struct md_gen *g;               /* borrowed: the owner */
	uint64_t eng_id;
	uint32_t index;
	bool active;                    /* still mapped: tokens expected */
	struct md_engine_detok *detok;  /* owned: stage 1 */
	struct md_stop stop;            /* stage 2: holds the pending text */
	struct lp_ent *ents;            /* owned (ents_cap): logprobs of pending tokens */
	size_t n_ents, ents_cap;
	char *text;                     /* owned (text_cap): released text (whole response) */
	size_t text_len, text_cap;
	cJSON *lp;                      /* owned: whole response's logprobs, NULL if not asked */
	size_t text_offset;             /* bytes released so far (legacy text_offset) */
	uint32_t n_tokens;              /* token events received */
	uint32_t usage_tokens;          /* completion tokens to report */
	uint32_t cached_tokens;         /* prompt tokens the engine took from its prefix cache */
	uint32_t n_drafted, n_accepted, n_verify; /* speculative decoding so far (events) */
	const char *finish;             /* static string once finished */
	double t_last;
	struct md_tool_parser tp;       /* stage 3 when the generation has tools */
	const struct lp_ent *tp_ents;   /* logprobs the parser's next emission carries */
	size_t tp_k;
	struct tcall *calls;            /* owned (n_calls) */
	size_t n_calls;
	struct md_harmony hm;           /* stage 2b when the model writes harmony channels */
	const struct lp_ent *hm_ents;   /* logprobs the channel parser's next emission carries */
	size_t hm_k;
	char *rtext;                    /* owned (rtext_cap): reasoning (whole response) */
	size_t rtext_len, rtext_cap;
	int32_t *ids;                   /* owned (ids_cap): every token generated (want_ids) */
	size_t n_ids, ids_cap;
	size_t ids_sent;                /* stream: ids already on a chunk */
	bool head_sent;                 /* stream: the choice's first chunk went out */
};

struct md_gen {
	struct md_gen_ctx *x;           /* borrowed */
	struct md_oai_reply o;          /* o.c: NULL once the client is gone or answered */
	struct md_gen *prev, *next;     /* the context's list, once linked */
	bool linked;
	bool stream, include_usage, want_lp;
	bool want_ids;                  /* return_token_ids: prompt and output ids in the reply */
	int32_t **prompt_ids;           /* owned (n_prompts, prompt_lens each) when want_ids */
	bool tools_on;                  /* parse tool calls out of the output (server/tools.h) */
	bool harmony_on;                /* split harmony channels (server/harmony.h): chat only */
	struct md_oai_ident ident;      /* strings point into id and the context's model */
	char id[64];
	char **stops;                   /* owned (n_stops) */
	size_t n_stops;
	struct choice *ch;              /* owned (n_ch) */
	size_t n_ch, n_open;
	uint32_t prompt_tokens;
	uint32_t *prompt_lens;          /* owned (n_prompts) */
	size_t n_prompts;
	bool got_first;
	bool head_sent;                 /* stream: the first chunk went out */
	unsigned long long req_id;      /* the HTTP request's id, as in the access log */
	double t_first, last_write;
	bool error, dead;
	int refs;                       /* functions of this module working on it */
	char errmsg[256];
};

/* engine request id -> choice, open addressing with linear probing */
struct slot {
	uint64_t id;
	struct choice *ch;              /* borrowed; NULL: free slot */
};

struct md_gen_ctx {
	struct md_engine *eng;          /* borrowed */
	const struct md_config *cfg;    /* borrowed */
	char model[256];
	uint32_t n_ctx, n_vocab;
	uint64_t next_eng_id;
	struct slot *map;               /* owned (map_cap, a power of two) */
	size_t map_cap, map_n;
	struct md_gen *gens;            /* list of generations in flight */
	size_t n_gens;
	uv_loop_t *loop;                /* borrowed: where long prompts are tokenized */
	size_t n_tokenizing;            /* requests away being tokenized (md_request.h) */
	bool cancelling;                /* md_gen_cancel_all was called */
	struct md_metrics_gen m;
};

/* ---- context ---- */

int md_gen_ctx_new(struct md_gen_ctx **out, struct md_engine *eng, const struct md_config *cfg,
		   uv_loop_t *loop)
{
	struct md_gen_ctx *x = calloc(1, sizeof(*x));
	if (!x)
		return -ENOMEM;
	x->map_cap = 1024;
	x->map = calloc(x->map_cap, sizeof(*x->map));
	if (!x->map) {
		free(x);
		return -ENOMEM;
	}
	x->eng = eng;
	x->cfg = cfg;
	x->loop = loop;
	md_metrics_gen_init(&x->m);
	*out = x;
	return 0;
}

void md_gen_ctx_free(struct md_gen_ctx *x)
{
	if (!x)
		return;
	free(x->map);
	free(x);
}

void md_gen_set_model(struct md_gen_ctx *x, const char *name, uint32_t n_ctx, uint32_t n_vocab)
{
	snprintf(x->model, sizeof(x->model), "%s", name);
	x->n_ctx = n_ctx;
	x->n_vocab = n_vocab;
}

size_t md_gen_n_active(const struct md_gen_ctx *x)
{
	return x->n_gens + x->n_tokenizing;
}

const struct md_metrics_gen *md_gen_metrics(const struct md_gen_ctx *x)
{
	return &x->m;
}

/* ---- id map ---- */

static size_t slot_of(uint64_t id, size_t cap)
{
	return (size_t)(md_sampler_mix(id) & (cap - 1));
}

static int map_grow(struct md_gen_ctx *x)
{
	size_t nc = x->map_cap * 2;
	struct slot *nm = calloc(nc, sizeof(*nm));
	if (!nm)
		return -ENOMEM;
	for (size_t i = 0; i < x->map_cap; i++)
		if (x->map[i].ch) {
			size_t j = slot_of(x->map[i].id, nc);
			while (nm[j].ch)
				j = (j + 1) & (nc - 1);
			nm[j] = x->map[i];
		}
	free(x->map);
	x->map = nm;
	x->map_cap = nc;
	return 0;
}

static struct choice *map_get(struct md_gen_ctx *x, uint64_t id)
{
	size_t j = slot_of(id, x->map_cap);
	while (x->map[j].ch) {
		if (x->map[j].id == id)
			return x->map[j].ch;
		j = (j + 1) & (x->map_cap - 1);
	}
	return NULL;
}

/* id must not be mapped yet. Returns 0 or -ENOMEM. */
static int map_put(struct md_gen_ctx *x, uint64_t id, struct choice *ch)
{
	MD_ASSERT(!map_get(x, id));
	if ((x->map_n + 1) * 2 > x->map_cap && map_grow(x))
		return -ENOMEM;
	size_t j = slot_of(id, x->map_cap);
	while (x->map[j].ch)
		j = (j + 1) & (x->map_cap - 1);
	x->map[j].id = id;
	x->map[j].ch = ch;
	x->map_n++;
	return 0;
}

static void map_del(struct md_gen_ctx *x, uint64_t id)
{
	size_t cap = x->map_cap, j = slot_of(id, cap);
	while (x->map[j].ch && x->map[j].id != id)
		j = (j + 1) & (cap - 1);
	if (!x->map[j].ch)
		return;
	x->map[j].ch = NULL;
	x->map_n--;
	/* backward-shift the cluster so lookups never stop at the hole */
	size_t k = (j + 1) & (cap - 1);
	while (x->map[k].ch) {
		struct slot s = x->map[k];
		x->map[k].ch = NULL;
		size_t h = slot_of(s.id, cap);
		while (x->map[h].ch)
			h = (h + 1) & (cap - 1);
		x->map[h] = s;
		k = (k + 1) & (cap - 1);
	}
}

/* ---- generation lifetime ---- */

/* Stop the choice's engine request: unmap it (its later events are dropped) and cancel. */
static void choice_detach(struct choice *ch)
{
	struct md_gen_ctx *x = ch->g->x;
	map_del(x, ch->eng_id);
	md_engine_cancel(x->eng, ch->eng_id);
	ch->active = false;
}

/* Free g and whatever it owns; detaches active choices and unlinks it. */
static void gen_free(struct md_gen *g)
{
	struct md_gen_ctx *x = g->x;
	MD_ASSERT(g->refs == 0);
	for (size_t i = 0; g->ch && i < g->n_ch; i++) {
		struct choice *ch = &g->ch[i];
		if (ch->active)
			choice_detach(ch);
		md_engine_detok_free(ch->detok);
		md_stop_release(&ch->stop);
		md_tool_parser_release(&ch->tp);
		for (size_t k = 0; k < ch->n_calls; k++)
			free(ch->calls[k].args);
		free(ch->calls);
		free(ch->ents);
		free(ch->text);
		free(ch->rtext);
		free(ch->ids);
		cJSON_Delete(ch->lp);
	}
	for (size_t i = 0; g->prompt_ids && i < g->n_prompts; i++)
		free(g->prompt_ids[i]);
	free(g->prompt_ids);
	free(g->ch);
	for (size_t i = 0; i < g->n_stops; i++)
		free(g->stops[i]);
	free(g->stops);
	free(g->prompt_lens);
	if (g->linked) {
		if (g->prev)
			g->prev->next = g->next;
		else
			x->gens = g->next;
		if (g->next)
			g->next->prev = g->prev;
		x->n_gens--;
	}
	free(g);
}

static void gen_unref(struct md_gen *g)
{
	MD_ASSERT(g->refs > 0);
	if (--g->refs == 0 && g->dead)
		gen_free(g);
}

/* The connection went away (md_http_abort_cb): cancel every open choice, drop the
 * connection, free g unless a function of this module holds it. */
static void on_abort(void *data)
{
	struct md_gen *g = data;
	struct md_gen_ctx *x = g->x;
	MD_ASSERT_LOOP_THREAD();
	md_log(MD_LOG_INFO, "req=%llu client gone, cancelling %zu sequence(s)",
	       (unsigned long long)g->o.r->id, g->n_open);
	md_log_access(g->o.r->method, g->o.r->path, 499, (unsigned long)g->o.r->id,
		      g->prompt_tokens, 0, g->got_first ? g->t_first - g->o.r->t_start : 0,
		      md_http_now() - g->o.r->t_start);
	for (size_t i = 0; i < g->n_ch; i++) {
		struct choice *ch = &g->ch[i];
		if (ch->active) {
			choice_detach(ch);
			x->m.finished[MD_METRICS_FIN_ABORT]++;
		}
	}
	g->o.c = NULL;
	g->dead = true;
	g->refs++;
	gen_unref(g);
}

/* ---- writing to the client ---- */

/* Write one SSE event. False when the client is gone (the write may have closed the
 * connection: the caller holds a reference). */
static bool sse_send(struct md_gen *g, const char *data, size_t len)
{
	MD_ASSERT_LOOP_THREAD();
	MD_ASSERT(g->refs > 0);
	if (!g->o.c || g->dead)
		return false;
	g->last_write = md_http_now();
	return md_http_stream_write(g->o.c, data, len) == 0;
}

/* Send doc (consumed) as one SSE event. */
static bool sse_json(struct md_gen *g, cJSON *doc)
{
	char *ev;
	long n = md_oai_sse_event(doc, &ev);
	if (n < 0)
		return false;
	bool ok = sse_send(g, ev, (size_t)n);
	free(ev);
	return ok;
}

/* return_token_ids on a stream (vLLM's places): each chunk of a choice carries the ids
 * generated since its last chunk, so that they add up to the whole response's token_ids
 * (ids whose text a stop string or a partial character holds back go out before their
 * text); the prompt's ids ride on the first chunk: on the choice for completions, on the
 * chunk itself for chat. */
static void chunk_ids(struct md_gen *g, struct choice *ch, cJSON *doc, cJSON *c0)
{
	if (!g->want_ids || !ch)
		return;
	if (!g->head_sent && g->ident.chat)
		cJSON_AddItemToObject(doc, "prompt_token_ids",
				      cJSON_CreateIntArray(g->prompt_ids[0], (int)g->prompt_lens[0]));
	if (!ch->head_sent && !g->ident.chat) {
		size_t pi = (size_t)(ch - g->ch) / (g->n_ch / g->n_prompts);
		cJSON_AddItemToObject(c0, "prompt_token_ids",
				      cJSON_CreateIntArray(g->prompt_ids[pi], (int)g->prompt_lens[pi]));
	}
	cJSON_AddItemToObject(c0, "token_ids", cJSON_CreateIntArray(ch->ids + ch->ids_sent,
								    (int)(ch->n_ids - ch->ids_sent)));
	ch->ids_sent = ch->n_ids;
	ch->head_sent = g->head_sent = true;
}

/* A chunk holding one choice (consumed), of choice ch. */
static bool sse_choice(struct md_gen *g, struct choice *ch, cJSON *c0)
{
	cJSON *choices, *doc = md_oai_doc_new(&g->ident, false, &choices);
	if (!doc) {
		cJSON_Delete(c0);
		return false;
	}
	chunk_ids(g, ch, doc, c0);
	cJSON_AddItemToArray(choices, c0);
	if (g->include_usage) /* as OpenAI: null on every chunk before the usage chunk */
		cJSON_AddNullToObject(doc, "usage");
	return sse_json(g, doc);
}

/* Heartbeat (md_http_tick_cb): an SSE comment after a silence. */
static void on_tick(void *data)
{
	struct md_gen *g = data;
	double iv = g->x->cfg->heartbeat_interval;
	if (g->stream && md_http_now() - g->last_write >= iv * 0.9) {
		static const char hb[] = ": keep-alive\n\n";
		g->refs++;
		sse_send(g, hb, sizeof(hb) - 1);
		gen_unref(g);
	}
}

/* ---- the output chain of a choice ---- */

static void choice_finish(struct choice *ch, const char *reason, bool cancel_engine);

/* Stage 4, emit: n bytes of text and the logprobs of k tokens go to the client (a chunk) or
 * into the whole response. */
static void stage_emit(struct choice *ch, const char *text, size_t n, const struct lp_ent *ents,
		       size_t k)
{
	struct md_gen *g = ch->g;
	struct md_engine *eng = g->x->eng;
	bool chat = g->ident.chat;
	if (g->stream) {
		cJSON *lp = NULL;
		if (g->want_lp) {
			lp = md_oai_logprobs_new(chat);
			for (size_t i = 0; i < k; i++)
				md_oai_logprobs_add(lp, chat, eng, &ents[i].lp,
						    ch->text_offset + ents[i].off);
		}
		sse_choice(g, ch, md_oai_choice_delta(&g->ident, ch->index, text, n, lp));
	} else {
		if (ch->text_len + n + 1 > ch->text_cap) {
			size_t nc = ch->text_cap ? ch->text_cap : 256;
			while (nc < ch->text_len + n + 1)
				nc *= 2;
			char *nt = realloc(ch->text, nc);
			if (nt) {
				ch->text = nt;
				ch->text_cap = nc;
			}
		}
		if (ch->text_len + n + 1 <= ch->text_cap) {
			memcpy(ch->text + ch->text_len, text, n);
			ch->text_len += n;
			ch->text[ch->text_len] = 0;
		}
		for (size_t i = 0; i < k; i++)
			md_oai_logprobs_add(ch->lp, chat, eng, &ents[i].lp,
					    ch->text_offset + ents[i].off);
	}
	ch->text_offset += n;
}

/* The logprobs object of the entries a tool-call chunk carries (NULL: none or not asked). */
static cJSON *tool_lp(struct choice *ch)
{
	struct md_gen *g = ch->g;
	if (!g->want_lp || !ch->tp_k)
		return NULL;
	cJSON *lp = md_oai_logprobs_new(true);
	for (size_t i = 0; i < ch->tp_k; i++)
		md_oai_logprobs_add(lp, true, g->x->eng, &ch->tp_ents[i].lp,
				    ch->text_offset + ch->tp_ents[i].off);
	return lp;
}

/* The tool-call parser's output (md_tool_emit_cb): content goes on to stage 4; a call's start
 * and its argument pieces become tool_calls deltas, or parts of the whole response. */
static void tool_emit(void *arg, enum md_tool_ev ev, int index, const char *s, size_t n)
{
	struct choice *ch = arg;
	struct md_gen *g = ch->g;
	const struct lp_ent *ents = ch->tp_ents;
	size_t k = ch->tp_k;
	if (ev == MD_TOOL_EV_CONTENT) {
		ch->tp_ents = NULL;
		ch->tp_k = 0;
		stage_emit(ch, s, n, ents, k);
		return;
	}
	if (ev == MD_TOOL_EV_BEGIN) {
		struct tcall *nc = realloc(ch->calls, (ch->n_calls + 1) * sizeof(*nc));
		if (!nc)
			return; /* the call is lost; its arguments are dropped below */
		ch->calls = nc;
		struct tcall *c = &ch->calls[ch->n_calls++];
		memset(c, 0, sizeof(*c));
		md_tools_call_id(ch->tp.fmt, c->id, sizeof(c->id));
		snprintf(c->name, sizeof(c->name), "%.*s", (int)n, s);
		if (g->stream)
			sse_choice(g, ch, md_oai_choice_tool_delta(ch->index, index, c->id, c->name, "", 0,
							       tool_lp(ch)));
	} else {
		if (index < 0 || (size_t)index >= ch->n_calls)
			return;
		struct tcall *c = &ch->calls[index];
		if (g->stream) {
			sse_choice(g, ch, md_oai_choice_tool_delta(ch->index, index, NULL, NULL, s, n,
							       tool_lp(ch)));
		} else if (n > 0) {
			if (c->args_len + n + 1 > c->args_cap) {
				size_t cap = c->args_cap ? c->args_cap * 2 : 64;
				while (cap < c->args_len + n + 1)
					cap *= 2;
				char *na = realloc(c->args, cap);
				if (!na)
					return; /* the piece is lost */
				c->args = na;
				c->args_cap = cap;
			}
			memcpy(c->args + c->args_len, s, n);
			c->args_len += n;
		}
	}
	if (!g->stream && g->want_lp)
		for (size_t i = 0; i < k; i++)
			md_oai_logprobs_add(ch->lp, true, g->x->eng, &ents[i].lp,
					    ch->text_offset + ents[i].off);
	ch->tp_ents = NULL;
	ch->tp_k = 0;
}

/* Stage 3, tool calls: with tools, the parser (server/tools.h) takes the model's tool calls
 * out of the content, holding text while it may still be the start of one; logprob entries
 * travel with the parser's next emission. Without tools, text passes through. */
static void stage_tools(struct choice *ch, const char *text, size_t n, const struct lp_ent *ents,
			size_t k)
{
	if (!ch->g->tools_on) {
		stage_emit(ch, text, n, ents, k);
		return;
	}
	ch->tp_ents = ents;
	ch->tp_k = k;
	md_tool_parser_push(&ch->tp, text, n);
	if (ch->tp_k && ch->g->want_lp) /* all text held: the entries go out now, without text */
		stage_emit(ch, "", 0, ch->tp_ents, ch->tp_k);
	ch->tp_ents = NULL;
	ch->tp_k = 0;
}

/* Reasoning text (the analysis channel): a delta.reasoning_content chunk, or kept for the
 * whole response's message.reasoning_content. */
static void stage_reasoning(struct choice *ch, const char *s, size_t n)
{
	struct md_gen *g = ch->g;
	if (g->stream) {
		sse_choice(g, ch, md_oai_choice_reasoning_delta(ch->index, s, n));
		return;
	}
	if (ch->rtext_len + n + 1 > ch->rtext_cap) {
		size_t nc = ch->rtext_cap ? ch->rtext_cap : 256;
		while (nc < ch->rtext_len + n + 1)
			nc *= 2;
		char *nt = realloc(ch->rtext, nc);
		if (!nt)
			return; /* the piece is lost; the content still flows */
		ch->rtext = nt;
		ch->rtext_cap = nc;
	}
	memcpy(ch->rtext + ch->rtext_len, s, n);
	ch->rtext_len += n;
	ch->rtext[ch->rtext_len] = 0;
}

/* The channel parser's output (md_harmony_emit_cb): content goes on to stage 3 with the
 * logprob entries that were waiting; reasoning out as reasoning, its entries (when asked
 * for) with an empty content piece. */
static void harmony_emit(void *arg, enum md_harmony_ev ev, const char *s, size_t n)
{
	struct choice *ch = arg;
	const struct lp_ent *ents = ch->hm_ents;
	size_t k = ch->hm_k;
	ch->hm_ents = NULL;
	ch->hm_k = 0;
	if (ev == MD_HARMONY_CONTENT) {
		stage_tools(ch, s, n, ents, k);
		return;
	}
	stage_reasoning(ch, s, n);
	if (k && ch->g->want_lp)
		stage_tools(ch, "", 0, ents, k);
}

/* Stage 2b, channels: for a model that writes harmony (gpt-oss), the parser splits the
 * output into reasoning and content and drops the markers; otherwise text passes through. */
static void stage_channels(struct choice *ch, const char *text, size_t n,
			   const struct lp_ent *ents, size_t k)
{
	if (!ch->g->harmony_on) {
		stage_tools(ch, text, n, ents, k);
		return;
	}
	ch->hm_ents = ents;
	ch->hm_k = k;
	md_harmony_push(&ch->hm, text, n);
	if (ch->hm_k && ch->g->want_lp) /* all text held: the entries go on now, without text */
		stage_tools(ch, "", 0, ch->hm_ents, ch->hm_k);
	ch->hm_ents = NULL;
	ch->hm_k = 0;
}

/* Move the first n pending bytes down the chain with the logprob entries of the tokens whose
 * text starts there (all waiting entries when final, even with no text). */
static void pass_on(struct choice *ch, size_t n, bool final)
{
	size_t k = 0;
	while (k < ch->n_ents && (ch->ents[k].off < n || final))
		k++;
	if (n == 0 && (k == 0 || !final))
		return;
	stage_channels(ch, md_stop_text(&ch->stop), n, ch->ents, k);
	md_stop_consume(&ch->stop, n);
	if (k)
		memmove(ch->ents, ch->ents + k, (ch->n_ents - k) * sizeof(*ch->ents));
	ch->n_ents -= k;
	for (size_t i = 0; i < ch->n_ents; i++)
		ch->ents[i].off = ch->ents[i].off >= n ? ch->ents[i].off - n : 0;
}

/* Stage 2, stop strings: release what can no longer be part of one; on a stop string release
 * the text before it and finish the choice. final: the engine is done, release everything. */
static void stage_stop(struct choice *ch, bool final)
{
	bool hit;
	size_t n = md_stop_ready(&ch->stop, final, &hit);
	if (!hit) {
		pass_on(ch, n, final);
		return;
	}
	pass_on(ch, n, false);
	md_stop_clear(&ch->stop);
	ch->n_ents = 0;
	ch->usage_tokens = ch->n_tokens;
	choice_finish(ch, "stop", true);
}

/* Stage 1 feeds stage 2: n bytes from the detokenizer. A NUL byte (a model may emit the byte
 * token 0x00) would cut the C strings that cJSON serialises, so streamed and whole responses
 * would disagree: it becomes U+FFFD. Returns 0 or -ENOMEM. */
static int stage_text(struct choice *ch, const char *buf, size_t n)
{
	char out[3 * 1024];
	size_t o = 0;
	MD_ASSERT(n <= 1024);
	for (size_t i = 0; i < n; i++) {
		if (buf[i] == 0) {
			memcpy(out + o, "\xEF\xBF\xBD", 3);
			o += 3;
		} else {
			out[o++] = buf[i];
		}
	}
	return md_stop_push(&ch->stop, out, o);
}

/* Remember the token's logprobs with the offset its text will start at. */
static void keep_logprobs(struct choice *ch, const struct md_engine_event *ev)
{
	if (ch->n_ents == ch->ents_cap) {
		size_t nc = ch->ents_cap ? ch->ents_cap * 2 : 8;
		struct lp_ent *ne = realloc(ch->ents, nc * sizeof(*ne));
		if (!ne)
			return; /* the entry is lost; the text still flows */
		ch->ents = ne;
		ch->ents_cap = nc;
	}
	struct lp_ent *e = &ch->ents[ch->n_ents++];
	e->off = md_stop_pending(&ch->stop);
	e->lp.token = ev->token;
	e->lp.logprob = ev->logprob;
	e->lp.n_top = ev->n_top;
	for (int i = 0; i < ev->n_top; i++) {
		e->lp.top_id[i] = ev->top[i].id;
		e->lp.top_lp[i] = ev->top[i].logprob;
	}
}

/* Token ids go out through cJSON_CreateIntArray, whose int is our int32_t. */
_Static_assert(sizeof(int) == sizeof(int32_t), "token ids as int");

/* The token ids of return_token_ids: every token the engine generated for the choice, as
 * usage counts them (a stop string's tokens too). Returns 0 or -ENOMEM. */
static int keep_id(struct choice *ch, int32_t token)
{
	if (ch->n_ids == ch->ids_cap) {
		size_t nc = ch->ids_cap ? ch->ids_cap * 2 : 64;
		int32_t *ni = realloc(ch->ids, nc * sizeof(*ni));
		if (!ni)
			return -ENOMEM;
		ch->ids = ni;
		ch->ids_cap = nc;
	}
	ch->ids[ch->n_ids++] = token;
	return 0;
}

static void fail_choice(struct choice *ch, const char *why)
{
	struct md_gen *g = ch->g;
	g->error = true;
	snprintf(g->errmsg, sizeof(g->errmsg), "%s", why);
	ch->usage_tokens = ch->n_tokens;
	choice_finish(ch, "error", true);
}

static void on_token(struct choice *ch, const struct md_engine_event *ev)
{
	struct md_gen *g = ch->g;
	struct md_gen_ctx *x = g->x;
	double now = md_http_now();
	ch->n_tokens++;
	x->m.generation_tokens++;
	if (!g->got_first) {
		g->got_first = true;
		g->t_first = now;
		md_hist_observe(&x->m.ttft, now - g->o.r->t_start);
	} else if (ch->t_last > 0) {
		md_hist_observe(&x->m.itl, now - ch->t_last);
	}
	ch->t_last = now;
	ch->n_drafted = ev->n_drafted;
	ch->n_accepted = ev->n_accepted;
	ch->n_verify = ev->n_verify;
	char buf[1024];
	int n = md_engine_detok_push(ch->detok, ev->token, buf, sizeof(buf));
	if (n < 0)
		n = 0;
	if (n > (int)sizeof(buf))
		n = (int)sizeof(buf);
	if (g->want_lp)
		keep_logprobs(ch, ev);
	if (g->want_ids && keep_id(ch, ev->token)) {
		fail_choice(ch, "out of memory");
		return;
	}
	if (stage_text(ch, buf, (size_t)n)) {
		fail_choice(ch, "out of memory");
		return;
	}
	stage_stop(ch, false);
}

static void on_done(struct choice *ch, const struct md_engine_event *ev)
{
	struct md_gen *g = ch->g;
	char buf[1024];
	int n = md_engine_detok_flush(ch->detok, buf, sizeof(buf));
	if (n > (int)sizeof(buf))
		n = (int)sizeof(buf);
	if (n > 0 && md_stop_push(&ch->stop, buf, (size_t)n)) {
		fail_choice(ch, "out of memory");
		return;
	}
	ch->usage_tokens = ev->n_gen > ch->n_tokens ? ev->n_gen : ch->n_tokens;
	ch->cached_tokens = ev->n_cached;
	ch->n_drafted = ev->n_drafted;
	ch->n_accepted = ev->n_accepted;
	ch->n_verify = ev->n_verify;
	stage_stop(ch, true);
	if (!ch->active || g->dead)
		return;
	const char *reason = "stop";
	switch (ev->finish) {
	case MD_FINISH_STOP: reason = "stop"; break;
	case MD_FINISH_LENGTH: reason = "length"; break;
	case MD_FINISH_CANCELLED: reason = "abort"; break;
	default:
		reason = "error";
		g->error = true;
		snprintf(g->errmsg, sizeof(g->errmsg), "generation failed in the engine (%d)", ev->err);
		break;
	}
	choice_finish(ch, reason, false);
}

void md_gen_on_event(struct md_gen_ctx *x, const struct md_engine_event *ev)
{
	MD_ASSERT_LOOP_THREAD();
	struct choice *ch = map_get(x, ev->req_id);
	if (!ch)
		return; /* stale: the request ended or its client went away */
	struct md_gen *g = ch->g;
	g->refs++;
	if (ev->kind == MD_EV_TOKEN)
		on_token(ch, ev);
	else if (ev->kind == MD_EV_DONE)
		on_done(ch, ev);
	gen_unref(g);
}

/* ---- the end of a generation ---- */

static uint32_t completion_tokens(const struct md_gen *g)
{
	uint32_t comp = 0;
	for (size_t i = 0; i < g->n_ch; i++)
		comp += g->ch[i].usage_tokens;
	return comp;
}

/* Prompt tokens served from the prefix cache: per prompt, the most any of its choices got
 * (choices are prompt-major, n per prompt; each prompt is counted once in prompt_tokens). */
static uint32_t cached_tokens(const struct md_gen *g)
{
	size_t per = g->n_prompts ? g->n_ch / g->n_prompts : 0;
	uint32_t sum = 0;
	for (size_t p = 0; per && p < g->n_prompts; p++) {
		uint32_t best = 0;
		for (size_t j = 0; j < per; j++)
			if (g->ch[p * per + j].cached_tokens > best)
				best = g->ch[p * per + j].cached_tokens;
		sum += best;
	}
	return sum;
}

/* The whole (non-streamed) response. */
static void respond_whole(struct md_gen *g, uint32_t comp, double ttft)
{
	cJSON *choices, *doc = md_oai_doc_new(&g->ident, true, &choices);
	for (size_t i = 0; doc && i < g->n_ch; i++) {
		struct choice *ch = &g->ch[i];
		cJSON *c0 = md_oai_choice_whole(&g->ident, ch->index, ch->text ? ch->text : "", ch->lp,
						ch->finish ? ch->finish : "stop");
		ch->lp = NULL;
		if (g->harmony_on)
			md_oai_choice_set_reasoning(c0, ch->rtext ? ch->rtext : "");
		if (ch->n_calls) {
			cJSON *calls = cJSON_CreateArray();
			for (size_t k = 0; k < ch->n_calls; k++) {
				struct tcall *c = &ch->calls[k];
				char *a = strndup(c->args ? c->args : "", c->args_len);
				cJSON_AddItemToArray(calls, md_oai_tool_call(c->id, c->name, a ? a : ""));
				free(a);
			}
			md_oai_choice_set_tool_calls(c0, calls);
		}
		if (g->want_ids) { /* vLLM's places: the prompt's on the choice, for completions */
			size_t pi = i / (g->n_ch / g->n_prompts);
			if (!g->ident.chat)
				cJSON_AddItemToObject(c0, "prompt_token_ids",
						      cJSON_CreateIntArray(g->prompt_ids[pi], (int)g->prompt_lens[pi]));
			cJSON_AddItemToObject(c0, "token_ids", cJSON_CreateIntArray(ch->ids, (int)ch->n_ids));
		}
		cJSON_AddItemToArray(choices, c0);
	}
	if (doc && g->want_ids && g->ident.chat) /* and on the response, for chat */
		cJSON_AddItemToObject(doc, "prompt_token_ids",
				      cJSON_CreateIntArray(g->prompt_ids[0], (int)g->prompt_lens[0]));
	if (doc)
		cJSON_AddItemToObject(doc, "usage", md_oai_usage(g->prompt_tokens, comp, cached_tokens(g)));
	char *txt = doc ? cJSON_PrintUnformatted(doc) : NULL;
	cJSON_Delete(doc);
	md_oai_account(&g->o, txt ? 200 : 500, g->prompt_tokens, comp, ttft);
	if (txt)
		md_http_respond(g->o.c, 200, "application/json", NULL, txt, strlen(txt));
	else
		md_http_respond(g->o.c, 500, "application/json", NULL, "{}", 2);
	free(txt);
}

/* The request log's speculation line, over all choices: drafted and accepted tokens, and
 * the mean accepted length (tokens per verifying step: 1 + accepted drafts). Counts arrive
 * with every token event, so a choice cut by a stop string reports what it had verified. */
static void log_spec(const struct md_gen *g)
{
	uint32_t dr = 0, ac = 0, vs = 0;
	for (size_t i = 0; i < g->n_ch; i++) {
		dr += g->ch[i].n_drafted;
		ac += g->ch[i].n_accepted;
		vs += g->ch[i].n_verify;
	}
	if (dr)
		md_log(MD_LOG_INFO, "req=%llu speculative drafted=%u accepted=%u rate=%.2f "
		       "mean_accepted_len=%.2f", g->req_id, dr, ac, (double)ac / dr,
		       vs ? 1.0 + (double)ac / vs : 0.0);
}

/* Every choice finished: write the tail of the stream or the whole response. The caller holds
 * a reference; g is dead afterwards. */
static void gen_complete(struct md_gen *g)
{
	MD_ASSERT_LOOP_THREAD();
	MD_ASSERT(g->refs > 0);
	struct md_gen_ctx *x = g->x;
	double now = md_http_now();
	uint32_t comp = completion_tokens(g);
	log_spec(g);
	x->m.prompt_tokens += g->prompt_tokens;
	md_hist_observe(&x->m.e2e, now - g->o.r->t_start);
	for (size_t i = 0; i < g->n_prompts; i++)
		md_hist_observe(&x->m.prompt_len, g->prompt_lens[i]);
	if (g->dead || !g->o.c) {
		g->dead = true;
		return;
	}
	double ttft = g->got_first ? g->t_first - g->o.r->t_start : 0;
	if (g->stream) {
		if (g->error)
			sse_json(g, md_oai_error_doc(g->errmsg, "server_error"));
		if (g->include_usage) {
			cJSON *choices, *doc = md_oai_doc_new(&g->ident, false, &choices);
			if (doc)
				cJSON_AddItemToObject(doc, "usage", md_oai_usage(g->prompt_tokens, comp, cached_tokens(g)));
			sse_json(g, doc);
		}
		static const char done[] = "data: [DONE]\n\n";
		sse_send(g, done, sizeof(done) - 1);
		if (g->o.c) {
			md_oai_account(&g->o, 200, g->prompt_tokens, comp, ttft);
			md_http_stream_end(g->o.c);
		}
	} else if (g->error) {
		md_oai_error(&g->o, 500, "server_error", NULL, NULL, "%s", g->errmsg);
	} else {
		respond_whole(g, comp, ttft);
	}
	g->o.c = NULL;
	g->dead = true;
}

/* The choice is over: send its finish chunk, stop the engine if needed, count it; the last
 * choice completes the generation. */
static void choice_finish(struct choice *ch, const char *reason, bool cancel_engine)
{
	struct md_gen *g = ch->g;
	struct md_gen_ctx *x = g->x;
	if (!ch->active)
		return;
	MD_ASSERT(g->n_open > 0);
	if (g->harmony_on)
		md_harmony_finish(&ch->hm);
	if (g->tools_on) {
		md_tool_parser_finish(&ch->tp);
		if (ch->n_calls > 0 && strcmp(reason, "stop") == 0)
			reason = "tool_calls";
	}
	ch->active = false;
	map_del(x, ch->eng_id);
	if (cancel_engine)
		md_engine_cancel(x->eng, ch->eng_id);
	ch->finish = reason;
	enum md_metrics_finish f = MD_METRICS_FIN_ERROR;
	if (strcmp(reason, "stop") == 0)
		f = MD_METRICS_FIN_STOP;
	else if (strcmp(reason, "length") == 0)
		f = MD_METRICS_FIN_LENGTH;
	else if (strcmp(reason, "tool_calls") == 0)
		f = MD_METRICS_FIN_STOP;
	else if (strcmp(reason, "abort") == 0)
		f = MD_METRICS_FIN_ABORT;
	x->m.finished[f]++;
	md_hist_observe(&x->m.gen_len, ch->usage_tokens);
	if (g->stream)
		sse_choice(g, ch, md_oai_choice_finish(&g->ident, ch->index, reason));
	if (--g->n_open == 0)
		gen_complete(g);
}

/* ---- starting a generation: validate, allocate, submit, begin ---- */

/* Check the request against the context and choose each prompt's max_tokens. Returns 0, or
 * -1 after answering 400. */
static int gen_validate(struct md_gen_ctx *x, const struct md_oai_reply *o, bool chat,
			const struct md_req_params *p, const uint32_t *lens, size_t n_prompts,
			int64_t *max_tokens)
{
	uint32_t n_ctx = x->n_ctx;
	for (size_t i = 0; i < n_prompts; i++) {
		if (lens[i] >= n_ctx) {
			md_oai_error(o, 400, "invalid_request_error", chat ? "messages" : "prompt",
				     "context_length_exceeded",
				     "This model's maximum context length is %u tokens; the prompt "
				     "has %u tokens", n_ctx, lens[i]);
			return -1;
		}
		int64_t room = (int64_t)n_ctx - lens[i];
		if (p->max_set) {
			if (p->max_tokens > room) {
				md_oai_error(o, 400, "invalid_request_error", "max_tokens",
					     "context_length_exceeded",
					     "This model's maximum context length is %u tokens; you "
					     "requested %u prompt tokens plus %lld output tokens",
					     n_ctx, lens[i], (long long)p->max_tokens);
				return -1;
			}
			max_tokens[i] = p->max_tokens;
		} else {
			int64_t def = chat ? x->cfg->max_tokens_cap : 16;
			max_tokens[i] = def < room ? def : room;
		}
	}
	if (n_prompts * (size_t)p->n > MD_REQ_MAX_CHOICES) {
		md_oai_error(o, 400, "invalid_request_error", "n", "invalid_value",
			     "at most %d choices per request (prompts times n)", MD_REQ_MAX_CHOICES);
		return -1;
	}
	return 0;
}

/* Allocate a generation of n_prompts x p->n choices (detokenizers, stop matchers, logprob
 * documents) and take p's stop strings. Touches nothing outside itself: not linked, nothing
 * mapped or submitted. Returns NULL when out of memory (p unchanged). */
static struct md_gen *gen_new(struct md_gen_ctx *x, const struct md_oai_reply *o, bool chat,
			      struct md_req_params *p, const uint32_t *lens, size_t n_prompts)
{
	size_t n_ch = n_prompts * (size_t)p->n;
	struct md_gen *g = calloc(1, sizeof(*g));
	if (!g)
		return NULL;
	g->x = x;
	g->o = *o;
	g->req_id = (unsigned long long)o->r->id;
	g->n_ch = n_ch;
	g->n_prompts = n_prompts;
	if (!(g->ch = calloc(n_ch, sizeof(*g->ch))))
		goto free_gen;
	if (!(g->prompt_lens = calloc(n_prompts, sizeof(uint32_t))))
		goto free_gen;
	for (size_t i = 0; i < n_ch; i++) {
		struct choice *ch = &g->ch[i];
		ch->g = g;
		ch->index = (uint32_t)i;
		if (!(ch->detok = md_engine_detok_new(x->eng, !chat)))
			goto free_gen;
		if (p->want_lp && !(ch->lp = md_oai_logprobs_new(chat)))
			goto free_gen;
	}
	/* nothing can fail from here on */
	g->tools_on = p->tools.n > 0 && p->tools.choice != MD_TOOL_CHOICE_NONE;
	for (size_t i = 0; i < n_ch; i++)
		md_tool_parser_init(&g->ch[i].tp, (enum md_tool_fmt)md_engine_tool_format(x->eng),
				    tool_emit, &g->ch[i]);
	g->harmony_on = chat && md_engine_chat_harmony(x->eng);
	for (size_t i = 0; i < n_ch; i++)
		md_harmony_init(&g->ch[i].hm, harmony_emit, &g->ch[i]);
	g->stream = p->stream;
	g->include_usage = p->include_usage;
	g->want_lp = p->want_lp;
	g->want_ids = p->want_ids;
	md_oai_make_id(g->id, sizeof(g->id), chat ? "chatcmpl-" : "cmpl-");
	g->ident = (struct md_oai_ident){ .id = g->id, .model = x->model,
					  .created = (long)time(NULL), .chat = chat };
	g->stops = p->stops;
	g->n_stops = p->n_stops;
	p->stops = NULL;
	p->n_stops = 0;
	for (size_t i = 0; i < n_ch; i++)
		md_stop_init(&g->ch[i].stop, g->stops, g->n_stops);
	for (size_t i = 0; i < n_prompts; i++) {
		g->prompt_lens[i] = lens[i];
		g->prompt_tokens += lens[i];
	}
	return g;
free_gen:
	gen_free(g); /* frees the detokenizers and documents made so far */
	return NULL;
}

/* The engine request of choice i (a copy of its prompt and sampling), or NULL when out of
 * memory. */
static struct md_engine_req *req_new(const struct md_req_params *p, size_t i,
				     const int32_t *prompt, uint32_t len, int64_t max_tokens)
{
	struct md_engine_req *er = calloc(1, sizeof(*er));
	if (!er)
		return NULL;
	er->n_prompt = len;
	er->max_tokens = (uint32_t)max_tokens;
	er->ignore_eos = p->ignore_eos;
	er->spec = p->spec;
	er->sampling = p->s;
	er->sampling.logit_bias = NULL;
	er->sampling.n_logit_bias = 0;
	er->grammar = p->grammar ? md_grammar_ref(p->grammar) : NULL;
	if (p->s.has_seed)
		er->sampling.seed = p->s.seed + i;
	if (!(er->prompt = malloc(sizeof(int32_t) * len)))
		goto free_req;
	memcpy(er->prompt, prompt, sizeof(int32_t) * len);
	if (p->s.n_logit_bias) {
		size_t sz = sizeof(*p->s.logit_bias) * p->s.n_logit_bias;
		if (!(er->sampling.logit_bias = malloc(sz)))
			goto free_prompt;
		memcpy(er->sampling.logit_bias, p->s.logit_bias, sz);
		er->sampling.n_logit_bias = p->s.n_logit_bias;
	}
	return er;
free_prompt:
	free(er->prompt);
free_req:
	md_grammar_unref(er->grammar);
	free(er);
	return NULL;
}

/* Map and submit every choice's engine request. Returns 0, or a negative code (-ENOMEM, or
 * md_engine_submit's -EAGAIN, -ESHUTDOWN, -EINVAL) with every choice detached again. */
static int gen_submit(struct md_gen *g, const struct md_req_params *p, int32_t *const *prompts,
		      const uint32_t *lens, const int64_t *max_tokens)
{
	struct md_gen_ctx *x = g->x;
	int rc = 0;
	size_t i;
	if (g->want_ids) {
		if (!(g->prompt_ids = calloc(g->n_prompts, sizeof(*g->prompt_ids))))
			return -ENOMEM;
		for (size_t pi = 0; pi < g->n_prompts; pi++) {
			size_t sz = sizeof(int32_t) * (lens[pi] ? lens[pi] : 1);
			if (!(g->prompt_ids[pi] = malloc(sz)))
				return -ENOMEM; /* gen_free releases the copies made */
			memcpy(g->prompt_ids[pi], prompts[pi], sizeof(int32_t) * lens[pi]);
		}
	}
	for (i = 0; i < g->n_ch; i++) {
		struct choice *ch = &g->ch[i];
		size_t pi = i / (size_t)p->n;
		ch->eng_id = ++x->next_eng_id;
		struct md_engine_req *er = req_new(p, i, prompts[pi], lens[pi], max_tokens[pi]);
		if (!er) {
			rc = -ENOMEM;
			goto detach;
		}
		er->id = ch->eng_id;
		if ((rc = map_put(x, ch->eng_id, ch))) {
			md_engine_req_free(er);
			goto detach;
		}
		if ((rc = md_engine_submit(x->eng, er))) {
			map_del(x, ch->eng_id);
			md_engine_req_free(er);
			goto detach;
		}
		ch->active = true;
		g->n_open++;
	}
	return 0;
detach:
	/* cancel what went in */
	while (i-- > 0) {
		choice_detach(&g->ch[i]);
		g->n_open--;
	}
	return rc;
}

/* Link g into the context, give the connection its callbacks and, for a stream, write the
 * head and the chat role chunks. */
static void gen_begin(struct md_gen *g)
{
	struct md_gen_ctx *x = g->x;
	g->next = x->gens;
	if (x->gens)
		x->gens->prev = g;
	x->gens = g;
	g->linked = true;
	x->n_gens++;
	md_http_set_handler(g->o.c, g, on_abort, g->stream ? on_tick : NULL,
			    x->cfg->heartbeat_interval);
	if (!g->stream)
		return;
	/* Any write below may fail and close the connection, whose abort callback frees g
	 * unless it is referenced: hold a reference across all of them. */
	g->refs++;
	md_http_stream_begin(g->o.c, 200, "text/event-stream", SSE_HEADERS);
	g->last_write = md_http_now();
	if (g->ident.chat)
		for (size_t i = 0; i < g->n_ch && !g->dead; i++)
			sse_choice(g, &g->ch[i], md_oai_choice_role((uint32_t)i));
	gen_unref(g);
}

static void answer_submit_error(const struct md_oai_reply *o, int rc)
{
	if (rc == -EAGAIN)
		md_oai_error(o, 429, "rate_limit_error", NULL, "queue_full",
			     "the server is at capacity; retry later");
	else if (rc == -ESHUTDOWN)
		md_oai_error(o, 503, "server_error", NULL, "unavailable",
			     "the engine is not serving");
	else
		md_oai_error(o, rc == -EINVAL ? 400 : 500,
			     rc == -EINVAL ? "invalid_request_error" : "server_error", NULL, NULL,
			     "cannot start generation (%s)", strerror(-rc));
}

/* Start a generation for the prompts (copied; each gets p->n choices), taking p's stop
 * strings. The request is answered with an error now, or by the generation later. */
static void start_gen(struct md_gen_ctx *x, const struct md_oai_reply *o, bool chat,
		      struct md_req_params *p, int32_t *const *prompts, const uint32_t *lens,
		      size_t n_prompts)
{
	MD_ASSERT_LOOP_THREAD();
	int64_t max_tokens[MD_REQ_MAX_CHOICES];
	if (gen_validate(x, o, chat, p, lens, n_prompts, max_tokens) < 0)
		return;
	struct md_gen *g = gen_new(x, o, chat, p, lens, n_prompts);
	if (!g) {
		md_oai_error(o, 500, "server_error", NULL, NULL, "out of memory");
		return;
	}
	int rc = gen_submit(g, p, prompts, lens, max_tokens);
	if (rc) {
		gen_free(g);
		answer_submit_error(o, rc);
		return;
	}
	gen_begin(g);
}

/* ---- endpoints ---- */

static struct md_req_limits limits_of(const struct md_gen_ctx *x)
{
	return (struct md_req_limits){ .model_name = x->model,
				       .max_tokens_cap = x->cfg->max_tokens_cap,
				       .n_vocab = x->n_vocab,
				       .has_draft = md_engine_has_draft(x->eng),
				       .has_self = md_engine_has_self(x->eng),
				       .tool_format = md_engine_tool_format(x->eng),
				       .tool_text = md_engine_tool_text(x->eng) };
}

/* The request's prompts are token ids now (md_request_tokenize_then): start its generation, or
 * answer why not. o is NULL when the client left meanwhile. Frees r. */
static void on_tokenized(void *arg, struct md_request *r, const struct md_oai_reply *o)
{
	struct md_gen_ctx *x = arg;
	MD_ASSERT_LOOP_THREAD();
	x->n_tokenizing--;
	if (!o)
		; /* nobody to answer */
	else if (r->tok_rc)
		md_request_answer(r, o);
	else if (x->cancelling)
		md_oai_error(o, 503, "server_error", NULL, "unavailable", "the server is shutting down");
	else
		start_gen(x, o, r->ep == MD_REQ_CHAT, &r->p, r->pr.ids, r->pr.lens, r->pr.n);
	md_request_free(r);
}

static void serve(struct md_gen_ctx *x, const struct md_oai_reply *o, cJSON *body,
		  enum md_req_endpoint ep)
{
	struct md_req_limits lim = limits_of(x);
	struct md_request *r = md_request_new(o, &lim, body, ep);
	if (!r)
		return;
	x->n_tokenizing++;
	md_request_tokenize_then(r, x->loop, x->eng, o, on_tokenized, x);
}

void md_gen_chat(struct md_gen_ctx *x, const struct md_oai_reply *o, cJSON *body)
{
	serve(x, o, body, MD_REQ_CHAT);
}

void md_gen_completion(struct md_gen_ctx *x, const struct md_oai_reply *o, cJSON *body)
{
	serve(x, o, body, MD_REQ_COMPLETIONS);
}

void md_gen_cancel_all(struct md_gen_ctx *x)
{
	x->cancelling = true; /* requests still being tokenized end with 503 */
	for (struct md_gen *g = x->gens; g; g = g->next)
		for (size_t i = 0; i < g->n_ch; i++)
			if (g->ch[i].active)
				md_engine_cancel(x->eng, g->ch[i].eng_id);
}
