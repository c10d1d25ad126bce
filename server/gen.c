/* Chat and text completions: parameters, engine submission, stop strings, SSE and JSON output. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/api_priv.h"
#include "common/log.h"

#define MAX_N 64          /* choices per prompt */
#define MAX_CHOICES 256   /* choices per request (prompts x n) */
#define MAX_STOPS 16
#define MAX_STOP_LEN 512
#define SSE_HEADERS "Cache-Control: no-cache\r\nX-Accel-Buffering: no\r\n"

/* A token's logprob data waiting with its text. */
struct lp_ent {
	size_t off;        /* where its text starts in the pending buffer */
	int32_t token;
	float logprob;
	uint8_t n_top;
	int32_t top_id[MD_ENGINE_MAX_TOP];
	float top_lp[MD_ENGINE_MAX_TOP];
};

struct md_gen_choice {
	struct md_gen *g;               /* borrowed: the owner */
	uint64_t eng_id;
	uint32_t index;
	uint32_t prompt_idx;
	bool active;                    /* still mapped: tokens expected */
	struct md_engine_detok *detok;  /* owned */
	char *pend;                     /* owned: decoded text not yet released (held back) */
	size_t pend_len, pend_cap;
	struct lp_ent *ents;            /* owned: logprob entries of pending tokens */
	size_t n_ents, ents_cap;
	char *text;                     /* owned: released text (non-streaming) */
	size_t text_len, text_cap;
	cJSON *lp;                      /* owned: non-streaming logprobs being built */
	size_t text_offset;             /* legacy completions text_offset */
	uint32_t n_tokens;              /* token events received */
	uint32_t usage_tokens;          /* completion tokens to report */
	const char *finish;             /* static string once finished */
	double t_last;
};

struct md_gen {
	struct md_api *a;               /* borrowed */
	struct md_http_conn *c;         /* borrowed: NULL once the client is gone */
	struct md_http_req *r;          /* borrowed: valid while c is */
	struct md_gen *prev, *next;     /* the api's list */
	bool chat, stream, include_usage, want_lp;
	int lp_top;
	char id[64];
	long created;
	char **stops;                   /* owned (n_stops) */
	size_t n_stops;
	struct md_gen_choice *ch;       /* owned (n_ch) */
	size_t n_ch, n_open;
	uint32_t prompt_tokens;
	uint32_t *prompt_lens;          /* owned (n_prompts) */
	size_t n_prompts;
	bool got_first;
	double t_first, last_write;
	bool error, dead;
	int refs;
	char errmsg[256];
};

struct gen_params {
	struct md_sampling s;
	int64_t max_tokens;
	bool max_set;
	int64_t n;
	bool stream, include_usage, ignore_eos;
	char **stops;
	size_t n_stops;
	bool want_lp;
	int lp_top;
};

static void params_release(struct gen_params *p)
{
	md_sampling_release(&p->s);
	for (size_t i = 0; i < p->n_stops; i++)
		free(p->stops[i]);
	free(p->stops);
	p->stops = NULL;
	p->n_stops = 0;
}

static void err400(struct md_api *a, struct md_http_conn *c, struct md_http_req *r,
		   const char *param, const char *msg)
{
	md__api_error(a, c, r, 400, "invalid_request_error", param, NULL, "%s", msg);
}

static int parse_stop(struct md_api *a, struct md_http_conn *c, struct md_http_req *r,
		      cJSON *body, struct gen_params *p)
{
	cJSON *st = cJSON_GetObjectItemCaseSensitive(body, "stop");
	if (!st || cJSON_IsNull(st))
		return 0;
	cJSON *one = NULL;
	size_t n;
	if (cJSON_IsString(st)) {
		one = st;
		n = 1;
	} else if (cJSON_IsArray(st)) {
		n = (size_t)cJSON_GetArraySize(st);
		if (n > MAX_STOPS) {
			md__api_error(a, c, r, 400, "invalid_request_error", "stop", "invalid_value",
				      "at most %d stop sequences", MAX_STOPS);
			return -1;
		}
	} else {
		err400(a, c, r, "stop", "'stop' must be a string or an array of strings");
		return -1;
	}
	p->stops = calloc(n ? n : 1, sizeof(char *));
	if (!p->stops) {
		md__api_error(a, c, r, 500, "server_error", NULL, NULL, "out of memory");
		return -1;
	}
	cJSON *it = one ? one : st->child;
	for (size_t i = 0; i < n; i++, it = it->next) {
		if (!cJSON_IsString(it)) {
			err400(a, c, r, "stop", "'stop' must be a string or an array of strings");
			return -1;
		}
		size_t l = strlen(it->valuestring);
		if (l == 0)
			continue; /* an empty stop string can never be matched usefully */
		if (l > MAX_STOP_LEN) {
			md__api_error(a, c, r, 400, "invalid_request_error", "stop", "invalid_value",
				      "stop sequences are limited to %d bytes", MAX_STOP_LEN);
			return -1;
		}
		p->stops[p->n_stops] = strdup(it->valuestring);
		if (!p->stops[p->n_stops]) {
			md__api_error(a, c, r, 500, "server_error", NULL, NULL, "out of memory");
			return -1;
		}
		p->n_stops++;
	}
	return 0;
}

static int parse_logit_bias(struct md_api *a, struct md_http_conn *c, struct md_http_req *r,
			    cJSON *body, struct gen_params *p)
{
	cJSON *lb = cJSON_GetObjectItemCaseSensitive(body, "logit_bias");
	if (!lb || cJSON_IsNull(lb))
		return 0;
	if (!cJSON_IsObject(lb)) {
		err400(a, c, r, "logit_bias", "'logit_bias' must be an object of token id -> bias");
		return -1;
	}
	size_t n = (size_t)cJSON_GetArraySize(lb);
	if (n > 1024) {
		err400(a, c, r, "logit_bias", "'logit_bias' holds at most 1024 entries");
		return -1;
	}
	p->s.logit_bias = calloc(n ? n : 1, sizeof(*p->s.logit_bias));
	if (!p->s.logit_bias) {
		md__api_error(a, c, r, 500, "server_error", NULL, NULL, "out of memory");
		return -1;
	}
	cJSON *it;
	cJSON_ArrayForEach(it, lb) {
		char *end;
		errno = 0;
		long id = strtol(it->string, &end, 10);
		if (errno || end == it->string || *end || id < 0 || (uint64_t)id >= a->n_vocab) {
			md__api_error(a, c, r, 400, "invalid_request_error", "logit_bias",
				      "invalid_value", "logit_bias key '%.40s' is not a token id in "
				      "[0, %u)", it->string, a->n_vocab);
			return -1;
		}
		if (!cJSON_IsNumber(it) || it->valuedouble < -100 || it->valuedouble > 100) {
			err400(a, c, r, "logit_bias", "logit_bias values must be numbers in [-100, 100]");
			return -1;
		}
		p->s.logit_bias[p->s.n_logit_bias].id = (int32_t)id;
		p->s.logit_bias[p->s.n_logit_bias].bias = (float)it->valuedouble;
		p->s.n_logit_bias++;
	}
	return 0;
}

/* Parameters shared by both endpoints. Returns 0 or -1 after answering. */
static int parse_params(struct md_api *a, struct md_http_conn *c, struct md_http_req *r,
			cJSON *body, bool chat, struct gen_params *p)
{
	memset(p, 0, sizeof(*p));
	md_sampling_default(&p->s);
	p->n = 1;
	double d;
	int64_t v;
	int rc;
	int64_t cap = a->cfg->max_tokens_cap;

	if (md__check_model(a, c, r, body) < 0)
		return -1;
	if ((rc = md__param_int(a, c, r, body, "max_tokens", 1, cap, &v)) < 0)
		return -1;
	if (rc) {
		p->max_tokens = v;
		p->max_set = true;
	}
	if (chat) {
		if ((rc = md__param_int(a, c, r, body, "max_completion_tokens", 1, cap, &v)) < 0)
			return -1;
		if (rc) {
			p->max_tokens = v;
			p->max_set = true;
		}
	}
	if ((rc = md__param_number(a, c, r, body, "temperature", 0, 2, false, &d)) < 0)
		return -1;
	if (rc)
		p->s.temperature = (float)d;
	if ((rc = md__param_number(a, c, r, body, "top_p", 0, 1, true, &d)) < 0)
		return -1;
	if (rc)
		p->s.top_p = (float)d;
	if ((rc = md__param_int(a, c, r, body, "top_k", -1, 1 << 30, &v)) < 0)
		return -1;
	if (rc)
		p->s.top_k = v < 0 ? 0 : (int32_t)v;
	if ((rc = md__param_number(a, c, r, body, "min_p", 0, 1, false, &d)) < 0)
		return -1;
	if (rc)
		p->s.min_p = (float)d;
	if ((rc = md__param_number(a, c, r, body, "presence_penalty", -2, 2, false, &d)) < 0)
		return -1;
	if (rc)
		p->s.presence_penalty = (float)d;
	if ((rc = md__param_number(a, c, r, body, "frequency_penalty", -2, 2, false, &d)) < 0)
		return -1;
	if (rc)
		p->s.frequency_penalty = (float)d;
	if ((rc = md__param_number(a, c, r, body, "repetition_penalty", 0, 10, true, &d)) < 0)
		return -1;
	if (rc)
		p->s.repetition_penalty = (float)d;
	if ((rc = md__param_int(a, c, r, body, "seed", INT64_MIN / 2, INT64_MAX / 2, &v)) < 0)
		return -1;
	if (rc) {
		p->s.seed = (uint64_t)v;
		p->s.has_seed = true;
	}
	if (md__param_int(a, c, r, body, "n", 1, MAX_N, &p->n) < 0)
		return -1;
	if (md__param_bool(a, c, r, body, "stream", &p->stream) < 0)
		return -1;
	if (md__param_bool(a, c, r, body, "ignore_eos", &p->ignore_eos) < 0)
		return -1;
	cJSON *so = cJSON_GetObjectItemCaseSensitive(body, "stream_options");
	if (so && !cJSON_IsNull(so)) {
		if (!cJSON_IsObject(so)) {
			err400(a, c, r, "stream_options", "'stream_options' must be an object");
			return -1;
		}
		if (!p->stream) {
			err400(a, c, r, "stream_options",
			       "'stream_options' is only allowed when 'stream' is true");
			return -1;
		}
		if (md__param_bool(a, c, r, so, "include_usage", &p->include_usage) < 0)
			return -1;
	}
	cJSON *user = cJSON_GetObjectItemCaseSensitive(body, "user");
	if (user && !cJSON_IsNull(user) && !cJSON_IsString(user)) {
		err400(a, c, r, "user", "'user' must be a string");
		return -1;
	}
	if (chat) {
		bool lp = false;
		if (md__param_bool(a, c, r, body, "logprobs", &lp) < 0)
			return -1;
		if ((rc = md__param_int(a, c, r, body, "top_logprobs", 0, MD_ENGINE_MAX_TOP, &v)) < 0)
			return -1;
		if (rc && !lp) {
			err400(a, c, r, "top_logprobs", "'top_logprobs' requires 'logprobs' to be true");
			return -1;
		}
		p->want_lp = lp;
		p->lp_top = rc ? (int)v : 0;
	} else {
		if ((rc = md__param_int(a, c, r, body, "logprobs", 0, MD_ENGINE_MAX_TOP, &v)) < 0)
			return -1;
		p->want_lp = rc > 0;
		p->lp_top = rc ? (int)v : 0;
		bool echo = false;
		if (md__param_bool(a, c, r, body, "echo", &echo) < 0)
			return -1;
		if (echo) {
			err400(a, c, r, "echo", "'echo' is not supported");
			return -1;
		}
	}
	p->s.top_logprobs = p->want_lp ? p->lp_top : -1;
	if (parse_stop(a, c, r, body, p) < 0 || parse_logit_bias(a, c, r, body, p) < 0)
		return -1;
	return 0;
}

/* ---- generation lifetime ---- */

static void gen_free(struct md_gen *g)
{
	struct md_api *a = g->a;
	for (size_t i = 0; i < g->n_ch; i++) {
		struct md_gen_choice *ch = &g->ch[i];
		if (ch->active) {
			md__map_del(a, ch->eng_id);
			md_engine_cancel(a->eng, ch->eng_id);
		}
		md_engine_detok_free(ch->detok);
		free(ch->pend);
		free(ch->ents);
		free(ch->text);
		cJSON_Delete(ch->lp);
	}
	free(g->ch);
	for (size_t i = 0; i < g->n_stops; i++)
		free(g->stops[i]);
	free(g->stops);
	free(g->prompt_lens);
	if (g->prev)
		g->prev->next = g->next;
	else
		a->gens = g->next;
	if (g->next)
		g->next->prev = g->prev;
	a->n_gens--;
	free(g);
}

static void gen_unref(struct md_gen *g)
{
	if (--g->refs == 0 && g->dead)
		gen_free(g);
}

static void on_abort(void *data)
{
	struct md_gen *g = data;
	struct md_api *a = g->a;
	md_log(MD_LOG_INFO, "req=%llu client gone, cancelling %zu sequence(s)",
	       (unsigned long long)g->r->id, g->n_open);
	md_log_access(g->r->method, g->r->path, 499, (unsigned long)g->r->id, g->prompt_tokens, 0,
		      g->got_first ? g->t_first - g->r->t_start : 0, md_http_now() - g->r->t_start);
	for (size_t i = 0; i < g->n_ch; i++) {
		struct md_gen_choice *ch = &g->ch[i];
		if (ch->active) {
			md__map_del(a, ch->eng_id);
			md_engine_cancel(a->eng, ch->eng_id);
			ch->active = false;
			a->metrics.finished_abort++;
		}
	}
	g->c = NULL;
	g->dead = true;
	g->refs++;
	gen_unref(g);
}

/* Write one SSE event (data: json). False when the client is gone. */
static bool sse_send(struct md_gen *g, const char *data, size_t len)
{
	if (!g->c || g->dead)
		return false;
	g->last_write = md_http_now();
	return md_http_stream_write(g->c, data, len) == 0;
}

static bool sse_json(struct md_gen *g, cJSON *doc)
{
	char *txt = cJSON_PrintUnformatted(doc);
	cJSON_Delete(doc);
	if (!txt)
		return false;
	size_t l = strlen(txt);
	char *ev = malloc(l + 9);
	if (!ev) {
		free(txt);
		return false;
	}
	memcpy(ev, "data: ", 6);
	memcpy(ev + 6, txt, l);
	memcpy(ev + 6 + l, "\n\n", 2);
	free(txt);
	bool ok = sse_send(g, ev, l + 8);
	free(ev);
	return ok;
}

static void on_tick(void *data)
{
	struct md_gen *g = data;
	double iv = g->a->cfg->heartbeat_interval;
	if (g->stream && md_http_now() - g->last_write >= iv * 0.9) {
		static const char hb[] = ": keep-alive\n\n";
		g->refs++;
		sse_send(g, hb, sizeof(hb) - 1);
		gen_unref(g);
	}
}

static cJSON *chunk_base(struct md_gen *g, cJSON **choices)
{
	cJSON *doc = cJSON_CreateObject();
	cJSON_AddStringToObject(doc, "id", g->id);
	cJSON_AddStringToObject(doc, "object", g->chat ? "chat.completion.chunk" : "text_completion");
	cJSON_AddNumberToObject(doc, "created", (double)g->created);
	cJSON_AddStringToObject(doc, "model", g->a->model_name);
	if (g->chat)
		cJSON_AddNullToObject(doc, "system_fingerprint");
	*choices = cJSON_AddArrayToObject(doc, "choices");
	return doc;
}

/* Token text (sanitised) and its raw bytes. */
static void token_strings(struct md_api *a, int32_t id, cJSON *obj, const char *key, bool bytes)
{
	char buf[512];
	int n = md_engine_token_piece(a->eng, id, buf, sizeof(buf));
	if (n < 0)
		n = 0;
	if (n > (int)sizeof(buf))
		n = (int)sizeof(buf);
	char *s = md__utf8_sanitize(buf, (size_t)n);
	cJSON_AddStringToObject(obj, key, s ? s : "");
	free(s);
	if (bytes) {
		cJSON *b = cJSON_AddArrayToObject(obj, "bytes");
		for (int i = 0; i < n; i++)
			cJSON_AddItemToArray(b, cJSON_CreateNumber((unsigned char)buf[i]));
	}
}

static cJSON *chat_lp_entry(struct md_api *a, const struct lp_ent *e)
{
	cJSON *o = cJSON_CreateObject();
	token_strings(a, e->token, o, "token", true);
	cJSON_AddNumberToObject(o, "logprob", e->logprob);
	cJSON *tops = cJSON_AddArrayToObject(o, "top_logprobs");
	for (int i = 0; i < e->n_top; i++) {
		cJSON *t = cJSON_CreateObject();
		token_strings(a, e->top_id[i], t, "token", true);
		cJSON_AddNumberToObject(t, "logprob", e->top_lp[i]);
		cJSON_AddItemToArray(tops, t);
	}
	return o;
}

/* Legacy completions logprobs: append one token to the four parallel arrays. */
static void legacy_lp_append(struct md_api *a, cJSON *lp, const struct lp_ent *e, size_t offset)
{
	cJSON *tok = cJSON_CreateObject();
	token_strings(a, e->token, tok, "t", false);
	cJSON_AddItemToArray(cJSON_GetObjectItem(lp, "tokens"),
			     cJSON_CreateString(cJSON_GetObjectItem(tok, "t")->valuestring));
	cJSON_Delete(tok);
	cJSON_AddItemToArray(cJSON_GetObjectItem(lp, "token_logprobs"),
			     cJSON_CreateNumber(e->logprob));
	cJSON *tops = cJSON_CreateObject();
	for (int i = 0; i < e->n_top; i++) {
		cJSON *t = cJSON_CreateObject();
		token_strings(a, e->top_id[i], t, "t", false);
		const char *k = cJSON_GetObjectItem(t, "t")->valuestring;
		if (!cJSON_GetObjectItemCaseSensitive(tops, k))
			cJSON_AddNumberToObject(tops, k, e->top_lp[i]);
		cJSON_Delete(t);
	}
	cJSON_AddItemToArray(cJSON_GetObjectItem(lp, "top_logprobs"), tops);
	cJSON_AddItemToArray(cJSON_GetObjectItem(lp, "text_offset"),
			     cJSON_CreateNumber((double)offset));
}

static cJSON *legacy_lp_new(void)
{
	cJSON *lp = cJSON_CreateObject();
	cJSON_AddArrayToObject(lp, "tokens");
	cJSON_AddArrayToObject(lp, "token_logprobs");
	cJSON_AddArrayToObject(lp, "top_logprobs");
	cJSON_AddArrayToObject(lp, "text_offset");
	return lp;
}

static int buf_append(char **buf, size_t *len, size_t *cap, const char *s, size_t n)
{
	if (*len + n + 1 > *cap) {
		size_t nc = *cap ? *cap : 256;
		while (nc < *len + n + 1)
			nc *= 2;
		char *nb = realloc(*buf, nc);
		if (!nb)
			return -ENOMEM;
		*buf = nb;
		*cap = nc;
	}
	memcpy(*buf + *len, s, n);
	*len += n;
	(*buf)[*len] = 0;
	return 0;
}

/* Release the first n pending bytes (and the entries starting before n) to the client.
 * force: emit even with no text when entries are waiting (end of stream). */
static void release(struct md_gen_choice *ch, size_t n, bool force)
{
	struct md_gen *g = ch->g;
	struct md_api *a = g->a;
	size_t k = 0;
	while (k < ch->n_ents && (ch->ents[k].off < n || force))
		k++;
	if (n == 0 && (k == 0 || !force))
		return;
	if (g->stream) {
		cJSON *choices, *doc = chunk_base(g, &choices);
		cJSON *c0 = cJSON_CreateObject();
		cJSON_AddNumberToObject(c0, "index", ch->index);
		char *txt = strndup(ch->pend, n);
		if (g->chat) {
			cJSON *delta = cJSON_AddObjectToObject(c0, "delta");
			cJSON_AddStringToObject(delta, "content", txt ? txt : "");
		} else {
			cJSON_AddStringToObject(c0, "text", txt ? txt : "");
		}
		free(txt);
		if (g->want_lp) {
			cJSON *lp;
			if (g->chat) {
				lp = cJSON_CreateObject();
				cJSON *content = cJSON_AddArrayToObject(lp, "content");
				for (size_t i = 0; i < k; i++)
					cJSON_AddItemToArray(content, chat_lp_entry(a, &ch->ents[i]));
			} else {
				lp = legacy_lp_new();
				for (size_t i = 0; i < k; i++)
					legacy_lp_append(a, lp, &ch->ents[i],
							 ch->text_offset + ch->ents[i].off);
			}
			cJSON_AddItemToObject(c0, "logprobs", lp);
		} else {
			cJSON_AddNullToObject(c0, "logprobs");
		}
		cJSON_AddNullToObject(c0, "finish_reason");
		cJSON_AddItemToArray(choices, c0);
		sse_json(g, doc);
	} else {
		buf_append(&ch->text, &ch->text_len, &ch->text_cap, ch->pend, n);
		if (g->want_lp) {
			for (size_t i = 0; i < k; i++) {
				if (g->chat)
					cJSON_AddItemToArray(cJSON_GetObjectItem(ch->lp, "content"),
							     chat_lp_entry(a, &ch->ents[i]));
				else
					legacy_lp_append(a, ch->lp, &ch->ents[i],
							 ch->text_offset + ch->ents[i].off);
			}
		}
	}
	ch->text_offset += n;
	/* pend and ents stay NULL until the first text or logprob entry arrives */
	if (n)
		memmove(ch->pend, ch->pend + n, ch->pend_len - n);
	ch->pend_len -= n;
	if (k)
		memmove(ch->ents, ch->ents + k, (ch->n_ents - k) * sizeof(*ch->ents));
	ch->n_ents -= k;
	for (size_t i = 0; i < ch->n_ents; i++)
		ch->ents[i].off = ch->ents[i].off >= n ? ch->ents[i].off - n : 0;
}

static void gen_complete(struct md_gen *g);

/* The choice is over: send its finish chunk, stop the engine if needed, count it. */
static void choice_finish(struct md_gen_choice *ch, const char *reason, bool cancel_engine)
{
	struct md_gen *g = ch->g;
	struct md_api *a = g->a;
	if (!ch->active)
		return;
	ch->active = false;
	md__map_del(a, ch->eng_id);
	if (cancel_engine)
		md_engine_cancel(a->eng, ch->eng_id);
	ch->finish = reason;
	if (strcmp(reason, "stop") == 0)
		a->metrics.finished_stop++;
	else if (strcmp(reason, "length") == 0)
		a->metrics.finished_length++;
	else if (strcmp(reason, "abort") == 0)
		a->metrics.finished_abort++;
	else
		a->metrics.finished_error++;
	md_hist_observe(&a->metrics.gen_len, ch->usage_tokens);
	if (g->stream) {
		cJSON *choices, *doc = chunk_base(g, &choices);
		cJSON *c0 = cJSON_CreateObject();
		cJSON_AddNumberToObject(c0, "index", ch->index);
		if (g->chat)
			cJSON_AddObjectToObject(c0, "delta");
		else
			cJSON_AddStringToObject(c0, "text", "");
		cJSON_AddNullToObject(c0, "logprobs");
		cJSON_AddStringToObject(c0, "finish_reason", reason);
		cJSON_AddItemToArray(choices, c0);
		sse_json(g, doc);
	}
	if (--g->n_open == 0)
		gen_complete(g);
}

/* Find the first stop string in the pending text; release text before it and finish.
 * Otherwise release all but the longest tail that could still begin a stop string. */
static void check_stops(struct md_gen_choice *ch, bool final)
{
	struct md_gen *g = ch->g;
	size_t best = (size_t)-1;
	for (size_t i = 0; i < g->n_stops && ch->pend_len; i++) {
		const char *p = memmem(ch->pend, ch->pend_len, g->stops[i], strlen(g->stops[i]));
		if (p && (size_t)(p - ch->pend) < best)
			best = (size_t)(p - ch->pend);
	}
	if (best != (size_t)-1) {
		release(ch, best, false);
		ch->pend_len = 0;
		ch->n_ents = 0;
		ch->usage_tokens = ch->n_tokens;
		choice_finish(ch, "stop", true);
		return;
	}
	if (final) {
		release(ch, ch->pend_len, true);
		return;
	}
	size_t hold = 0;
	for (size_t i = 0; i < g->n_stops; i++) {
		size_t sl = strlen(g->stops[i]);
		size_t maxh = sl - 1 < ch->pend_len ? sl - 1 : ch->pend_len;
		for (size_t h = maxh; h > hold; h--)
			if (memcmp(ch->pend + ch->pend_len - h, g->stops[i], h) == 0) {
				hold = h;
				break;
			}
	}
	release(ch, ch->pend_len - hold, false);
}

static void on_token(struct md_gen_choice *ch, const struct md_engine_event *ev)
{
	struct md_gen *g = ch->g;
	struct md_api *a = g->a;
	double now = md_http_now();
	ch->n_tokens++;
	a->metrics.generation_tokens++;
	if (!g->got_first) {
		g->got_first = true;
		g->t_first = now;
		md_hist_observe(&a->metrics.ttft, now - g->r->t_start);
	} else if (ch->t_last > 0) {
		md_hist_observe(&a->metrics.itl, now - ch->t_last);
	}
	ch->t_last = now;
	char buf[1024];
	int n = md_engine_detok_push(ch->detok, ev->token, buf, sizeof(buf));
	if (n < 0)
		n = 0;
	if (g->want_lp) {
		if (ch->n_ents == ch->ents_cap) {
			size_t nc = ch->ents_cap ? ch->ents_cap * 2 : 8;
			struct lp_ent *ne = realloc(ch->ents, nc * sizeof(*ne));
			if (ne) {
				ch->ents = ne;
				ch->ents_cap = nc;
			}
		}
		if (ch->n_ents < ch->ents_cap) {
			struct lp_ent *e = &ch->ents[ch->n_ents++];
			e->off = ch->pend_len;
			e->token = ev->token;
			e->logprob = ev->logprob;
			e->n_top = ev->n_top;
			for (int i = 0; i < ev->n_top; i++) {
				e->top_id[i] = ev->top[i].id;
				e->top_lp[i] = ev->top[i].logprob;
			}
		}
	}
	/* A NUL byte (a model may emit the byte token 0x00) would cut the C strings that cJSON
	 * serialises, so streamed and whole responses would disagree: it becomes U+FFFD. */
	for (int i = 0; i < n; i++) {
		if (buf[i] == 0)
			buf_append(&ch->pend, &ch->pend_len, &ch->pend_cap, "\xEF\xBF\xBD", 3);
		else
			buf_append(&ch->pend, &ch->pend_len, &ch->pend_cap, buf + i, 1);
	}
	check_stops(ch, false);
}

static void on_done(struct md_gen_choice *ch, const struct md_engine_event *ev)
{
	struct md_gen *g = ch->g;
	char buf[64];
	int n = md_engine_detok_flush(ch->detok, buf, sizeof(buf));
	if (n > 0)
		buf_append(&ch->pend, &ch->pend_len, &ch->pend_cap, buf, (size_t)n);
	ch->usage_tokens = ev->n_gen > ch->n_tokens ? ev->n_gen : ch->n_tokens;
	check_stops(ch, true);
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

void md__gen_on_event(struct md_api *a, struct md_engine_event *ev)
{
	struct md_gen_choice *ch = md__map_get(a, ev->req_id);
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

static cJSON *usage_json(struct md_gen *g)
{
	uint32_t comp = 0;
	for (size_t i = 0; i < g->n_ch; i++)
		comp += g->ch[i].usage_tokens;
	cJSON *u = cJSON_CreateObject();
	cJSON_AddNumberToObject(u, "prompt_tokens", g->prompt_tokens);
	cJSON_AddNumberToObject(u, "completion_tokens", comp);
	cJSON_AddNumberToObject(u, "total_tokens", g->prompt_tokens + comp);
	return u;
}

/* Every choice finished: write the tail of the stream or the whole response. */
static void gen_complete(struct md_gen *g)
{
	struct md_api *a = g->a;
	double now = md_http_now();
	uint32_t comp = 0;
	for (size_t i = 0; i < g->n_ch; i++)
		comp += g->ch[i].usage_tokens;
	a->metrics.prompt_tokens += g->prompt_tokens;
	md_hist_observe(&a->metrics.e2e, now - g->r->t_start);
	for (size_t i = 0; i < g->n_prompts; i++)
		md_hist_observe(&a->metrics.prompt_len, g->prompt_lens[i]);
	if (g->dead || !g->c) {
		g->dead = true;
		return;
	}
	double ttft = g->got_first ? g->t_first - g->r->t_start : 0;
	if (g->stream) {
		if (g->error) {
			cJSON *doc = cJSON_CreateObject();
			cJSON *e = cJSON_AddObjectToObject(doc, "error");
			cJSON_AddStringToObject(e, "message", g->errmsg);
			cJSON_AddStringToObject(e, "type", "server_error");
			cJSON_AddNullToObject(e, "param");
			cJSON_AddNullToObject(e, "code");
			sse_json(g, doc);
		}
		if (g->include_usage) {
			cJSON *choices, *doc = chunk_base(g, &choices);
			cJSON_AddItemToObject(doc, "usage", usage_json(g));
			sse_json(g, doc);
		}
		static const char done[] = "data: [DONE]\n\n";
		sse_send(g, done, sizeof(done) - 1);
		if (g->c) {
			md__api_account(a, g->r, 200, g->prompt_tokens, comp, ttft);
			md_http_stream_end(g->c);
		}
	} else if (g->error) {
		md__api_error(a, g->c, g->r, 500, "server_error", NULL, NULL, "%s", g->errmsg);
	} else {
		cJSON *doc = cJSON_CreateObject();
		cJSON_AddStringToObject(doc, "id", g->id);
		cJSON_AddStringToObject(doc, "object", g->chat ? "chat.completion" : "text_completion");
		cJSON_AddNumberToObject(doc, "created", (double)g->created);
		cJSON_AddStringToObject(doc, "model", a->model_name);
		if (g->chat)
			cJSON_AddNullToObject(doc, "system_fingerprint");
		cJSON *choices = cJSON_AddArrayToObject(doc, "choices");
		for (size_t i = 0; i < g->n_ch; i++) {
			struct md_gen_choice *ch = &g->ch[i];
			cJSON *c0 = cJSON_CreateObject();
			cJSON_AddNumberToObject(c0, "index", ch->index);
			if (g->chat) {
				cJSON *msg = cJSON_AddObjectToObject(c0, "message");
				cJSON_AddStringToObject(msg, "role", "assistant");
				cJSON_AddStringToObject(msg, "content", ch->text ? ch->text : "");
			} else {
				cJSON_AddStringToObject(c0, "text", ch->text ? ch->text : "");
			}
			if (ch->lp) {
				cJSON_AddItemToObject(c0, "logprobs", ch->lp);
				ch->lp = NULL;
			} else {
				cJSON_AddNullToObject(c0, "logprobs");
			}
			cJSON_AddStringToObject(c0, "finish_reason", ch->finish ? ch->finish : "stop");
			cJSON_AddItemToArray(choices, c0);
		}
		cJSON_AddItemToObject(doc, "usage", usage_json(g));
		char *txt = cJSON_PrintUnformatted(doc);
		cJSON_Delete(doc);
		md__api_account(a, g->r, txt ? 200 : 500, g->prompt_tokens, comp, ttft);
		if (txt)
			md_http_respond(g->c, 200, "application/json", NULL, txt, strlen(txt));
		else
			md_http_respond(g->c, 500, "application/json", NULL, "{}", 2);
		free(txt);
	}
	g->c = NULL;
	g->dead = true;
}

static void make_id(char *out, size_t cap, const char *prefix)
{
	static uint64_t counter;
	uint64_t x = md_sampler_mix((uint64_t)time(NULL) ^ (++counter << 20) ^
				    (uint64_t)(md_http_now() * 1e9));
	snprintf(out, cap, "%s%016llx%08llx", prefix, (unsigned long long)x,
		 (unsigned long long)(counter & 0xffffffff));
}

/* Create the generation for n_prompts prompts (each gets p->n choices) and submit it. Takes
 * ownership of nothing: prompts are copied. */
static void start_gen(struct md_api *a, struct md_http_conn *c, struct md_http_req *r,
		      bool chat, struct gen_params *p, int32_t **prompts, const uint32_t *lens,
		      size_t n_prompts)
{
	uint32_t n_ctx = a->n_ctx;
	int64_t max_tokens[MAX_CHOICES];
	for (size_t i = 0; i < n_prompts; i++) {
		if (lens[i] >= n_ctx) {
			md__api_error(a, c, r, 400, "invalid_request_error", chat ? "messages" : "prompt",
				      "context_length_exceeded",
				      "This model's maximum context length is %u tokens; the prompt "
				      "has %u tokens", n_ctx, lens[i]);
			return;
		}
		int64_t room = (int64_t)n_ctx - lens[i];
		if (p->max_set) {
			if (p->max_tokens > room) {
				md__api_error(a, c, r, 400, "invalid_request_error",
					      chat ? "max_tokens" : "max_tokens",
					      "context_length_exceeded",
					      "This model's maximum context length is %u tokens; you "
					      "requested %u prompt tokens plus %lld output tokens",
					      n_ctx, lens[i], (long long)p->max_tokens);
				return;
			}
			max_tokens[i] = p->max_tokens;
		} else {
			int64_t def = chat ? a->cfg->max_tokens_cap : 16;
			max_tokens[i] = def < room ? def : room;
		}
	}
	size_t n_ch = n_prompts * (size_t)p->n;
	if (n_ch > MAX_CHOICES) {
		md__api_error(a, c, r, 400, "invalid_request_error", "n", "invalid_value",
			      "at most %d choices per request (prompts times n)", MAX_CHOICES);
		return;
	}
	struct md_gen *g = calloc(1, sizeof(*g));
	if (!g || !(g->ch = calloc(n_ch, sizeof(*g->ch))) ||
	    !(g->prompt_lens = calloc(n_prompts, sizeof(uint32_t)))) {
		if (g)
			free(g->ch);
		free(g);
		md__api_error(a, c, r, 500, "server_error", NULL, NULL, "out of memory");
		return;
	}
	g->a = a;
	g->c = c;
	g->r = r;
	g->chat = chat;
	g->stream = p->stream;
	g->include_usage = p->include_usage;
	g->want_lp = p->want_lp;
	g->lp_top = p->lp_top;
	g->created = (long)time(NULL);
	make_id(g->id, sizeof(g->id), chat ? "chatcmpl-" : "cmpl-");
	g->stops = p->stops;
	g->n_stops = p->n_stops;
	p->stops = NULL;
	p->n_stops = 0;
	g->n_ch = n_ch;
	g->n_prompts = n_prompts;
	g->next = a->gens;
	if (a->gens)
		a->gens->prev = g;
	a->gens = g;
	a->n_gens++;
	for (size_t i = 0; i < n_prompts; i++) {
		g->prompt_lens[i] = lens[i];
		g->prompt_tokens += lens[i];
	}
	uint64_t base_seed = p->s.has_seed ? p->s.seed : 0;

	int rc = 0;
	for (size_t i = 0; i < n_ch; i++) {
		struct md_gen_choice *ch = &g->ch[i];
		size_t pi = i / (size_t)p->n;
		ch->g = g;
		ch->index = (uint32_t)i;
		ch->prompt_idx = (uint32_t)pi;
		ch->eng_id = ++a->next_eng_id;
		ch->detok = md_engine_detok_new(a->eng, !chat);
		if (g->want_lp)
			ch->lp = chat ? cJSON_CreateObject() : legacy_lp_new();
		if (chat && ch->lp)
			cJSON_AddArrayToObject(ch->lp, "content");
		struct md_engine_req *er = calloc(1, sizeof(*er));
		if (!ch->detok || !er) {
			free(er);
			rc = -ENOMEM;
			break;
		}
		er->id = ch->eng_id;
		er->n_prompt = lens[pi];
		er->prompt = malloc(sizeof(int32_t) * lens[pi]);
		er->max_tokens = (uint32_t)max_tokens[pi];
		er->ignore_eos = p->ignore_eos;
		er->sampling = p->s;
		er->sampling.logit_bias = NULL;
		er->sampling.n_logit_bias = 0;
		if (p->s.has_seed)
			er->sampling.seed = base_seed + i;
		if (p->s.n_logit_bias) {
			er->sampling.logit_bias = malloc(sizeof(*p->s.logit_bias) * p->s.n_logit_bias);
			if (er->sampling.logit_bias) {
				memcpy(er->sampling.logit_bias, p->s.logit_bias,
				       sizeof(*p->s.logit_bias) * p->s.n_logit_bias);
				er->sampling.n_logit_bias = p->s.n_logit_bias;
			}
		}
		if (!er->prompt || (p->s.n_logit_bias && !er->sampling.logit_bias)) {
			md_sampling_release(&er->sampling);
			free(er->prompt);
			free(er);
			rc = -ENOMEM;
			break;
		}
		memcpy(er->prompt, prompts[pi], sizeof(int32_t) * lens[pi]);
		if (md__map_put(a, ch->eng_id, ch)) {
			md_sampling_release(&er->sampling);
			free(er->prompt);
			free(er);
			rc = -ENOMEM;
			break;
		}
		ch->active = true;
		g->n_open++;
		rc = md_engine_submit(a->eng, er);
		if (rc) {
			md__map_del(a, ch->eng_id);
			ch->active = false;
			g->n_open--;
			md_sampling_release(&er->sampling);
			free(er->prompt);
			free(er);
			break;
		}
	}
	if (rc) {
		/* undo: cancel what went in, answer the error */
		for (size_t i = 0; i < n_ch; i++)
			if (g->ch[i].active) {
				md__map_del(a, g->ch[i].eng_id);
				md_engine_cancel(a->eng, g->ch[i].eng_id);
				g->ch[i].active = false;
			}
		g->c = NULL;
		g->dead = true;
		gen_free(g);
		if (rc == -EAGAIN)
			md__api_error(a, c, r, 429, "rate_limit_error", NULL, "queue_full",
				      "the server is at capacity; retry later");
		else if (rc == -ESHUTDOWN)
			md__api_error(a, c, r, 503, "server_error", NULL, "unavailable",
				      "the engine is not serving");
		else
			md__api_error(a, c, r, rc == -EINVAL ? 400 : 500,
				      rc == -EINVAL ? "invalid_request_error" : "server_error", NULL,
				      NULL, "cannot start generation (%s)", strerror(-rc));
		return;
	}
	md_http_set_handler(c, g, on_abort, g->stream ? on_tick : NULL,
			    a->cfg->heartbeat_interval);
	if (g->stream) {
		md_http_stream_begin(c, 200, "text/event-stream", SSE_HEADERS);
		g->last_write = md_http_now();
		if (chat) {
			g->refs++;
			for (size_t i = 0; i < n_ch && !g->dead; i++) {
				cJSON *choices, *doc = chunk_base(g, &choices);
				cJSON *c0 = cJSON_CreateObject();
				cJSON_AddNumberToObject(c0, "index", (double)i);
				cJSON *delta = cJSON_AddObjectToObject(c0, "delta");
				cJSON_AddStringToObject(delta, "role", "assistant");
				cJSON_AddStringToObject(delta, "content", "");
				cJSON_AddNullToObject(c0, "logprobs");
				cJSON_AddNullToObject(c0, "finish_reason");
				cJSON_AddItemToArray(choices, c0);
				sse_json(g, doc);
			}
			gen_unref(g);
		}
	}
}

void md__gen_chat(struct md_api *a, struct md_http_conn *c, struct md_http_req *r, cJSON *body)
{
	struct gen_params p;
	if (parse_params(a, c, r, body, true, &p) < 0) {
		params_release(&p);
		return;
	}
	struct md_engine_msg *msgs;
	char **owned;
	size_t n_owned;
	int nm = md__parse_messages(a, c, r, body, &msgs, &owned, &n_owned);
	if (nm < 0) {
		params_release(&p);
		return;
	}
	int32_t *ids = NULL;
	int n = md_engine_chat_tokenize(a->eng, msgs, (size_t)nm, &ids);
	md__free_messages(msgs, owned, n_owned);
	if (n == -EINVAL) {
		md__api_error(a, c, r, 400, "invalid_request_error", "messages", "invalid_value",
			      "the model's chat template rejects these messages (roles must "
			      "alternate user/assistant where the template requires it)");
	} else if (n <= 0) {
		md__api_error(a, c, r, 500, "server_error", NULL, NULL,
			      "cannot render the chat prompt (%d)", n);
	} else {
		uint32_t len = (uint32_t)n;
		start_gen(a, c, r, true, &p, &ids, &len, 1);
	}
	free(ids);
	params_release(&p);
}

void md__gen_completion(struct md_api *a, struct md_http_conn *c, struct md_http_req *r,
			cJSON *body)
{
	struct gen_params p;
	int32_t *prompts[MAX_CHOICES];
	uint32_t lens[MAX_CHOICES];
	size_t np = 0;
	if (parse_params(a, c, r, body, false, &p) < 0)
		goto out;
	cJSON *pr = cJSON_GetObjectItemCaseSensitive(body, "prompt");
	if (!pr || cJSON_IsNull(pr)) {
		err400(a, c, r, "prompt", "'prompt' is required");
		goto out;
	}
	/* forms: "text", ["text", ...], [id, ...], [[id, ...], ...] */
	cJSON *items[MAX_CHOICES];
	size_t ni = 0;
	bool ids_form = false;
	if (cJSON_IsString(pr)) {
		items[ni++] = pr;
	} else if (cJSON_IsArray(pr) && cJSON_GetArraySize(pr) > 0) {
		if (cJSON_IsNumber(pr->child)) {
			items[ni++] = pr;
			ids_form = true;
		} else {
			if (cJSON_GetArraySize(pr) > MAX_CHOICES) {
				err400(a, c, r, "prompt", "too many prompts");
				goto out;
			}
			cJSON *it;
			cJSON_ArrayForEach(it, pr) items[ni++] = it;
		}
	} else {
		err400(a, c, r, "prompt", "'prompt' must be a string, an array of strings, an array "
					  "of token ids or an array of such arrays");
		goto out;
	}
	for (size_t i = 0; i < ni; i++) {
		cJSON *it = items[i];
		if (cJSON_IsString(it) && !ids_form) {
			int n = md_engine_tokenize(a->eng, it->valuestring, strlen(it->valuestring), true,
						   true, &prompts[np]);
			if (n < 0) {
				md__api_error(a, c, r, 500, "server_error", NULL, NULL,
					      "tokenization failed (%d)", n);
				goto out;
			}
			lens[np++] = (uint32_t)n;
		} else if (cJSON_IsArray(it) && (ids_form || (it->child && cJSON_IsNumber(it->child)))) {
			size_t n = (size_t)cJSON_GetArraySize(it);
			int32_t *ids = malloc(sizeof(int32_t) * (n ? n : 1));
			if (!ids) {
				md__api_error(a, c, r, 500, "server_error", NULL, NULL, "out of memory");
				goto out;
			}
			prompts[np] = ids;
			lens[np++] = (uint32_t)n;
			size_t k = 0;
			cJSON *t;
			cJSON_ArrayForEach(t, it) {
				if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble) ||
				    t->valuedouble < 0 || t->valuedouble >= a->n_vocab) {
					md__api_error(a, c, r, 400, "invalid_request_error", "prompt",
						      "invalid_value",
						      "prompt token ids must be integers in [0, %u)",
						      a->n_vocab);
					goto out;
				}
				ids[k++] = (int32_t)t->valuedouble;
			}
		} else {
			err400(a, c, r, "prompt", "'prompt' must be a string, an array of strings, an "
						  "array of token ids or an array of such arrays");
			goto out;
		}
		if (lens[np - 1] == 0) {
			err400(a, c, r, "prompt", "the prompt is empty");
			goto out;
		}
	}
	start_gen(a, c, r, false, &p, prompts, lens, np);
out:
	for (size_t i = 0; i < np; i++)
		free(prompts[i]);
	params_release(&p);
}

void md__gen_cancel_all(struct md_api *a)
{
	for (struct md_gen *g = a->gens; g; g = g->next)
		for (size_t i = 0; i < g->n_ch; i++)
			if (g->ch[i].active)
				md_engine_cancel(a->eng, g->ch[i].eng_id);
}
