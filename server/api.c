/* OpenAI-compatible API: routing, auth, /health, /metrics, /v1/models, (de)tokenize. */
#include "server/api.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "common/assert.h"
#include "common/log.h"
#include "server/gen.h"
#include "server/metrics.h"
#include "server/oai.h"
#include "server/request.h"

struct md_api {
	struct md_engine *eng;        /* borrowed */
	struct md_config *cfg;        /* borrowed */
	struct md_http_server *http;  /* borrowed, may be NULL */
	struct md_gen_ctx *gen;       /* owned: the generations in flight */
	uv_loop_t *loop;              /* borrowed: where /tokenize's long texts are tokenized */
	md_api_state_cb state_cb;
	void *state_arg;              /* borrowed */
	enum md_engine_state state;   /* as last seen on the loop thread */
	bool draining;
	struct md_metrics_http http_counts;
	char model_name[256];
	uint32_t n_ctx, n_vocab;
	time_t started;
};

int md_api_new(struct md_api **out, struct md_engine *eng, struct md_config *cfg,
	       uv_loop_t *loop)
{
	struct md_api *a = calloc(1, sizeof(*a));
	if (!a)
		return -ENOMEM;
	int rc = md_gen_ctx_new(&a->gen, eng, cfg, loop);
	if (rc) {
		free(a);
		return rc;
	}
	a->eng = eng;
	a->cfg = cfg;
	a->loop = loop;
	a->state = MD_ENGINE_LOADING;
	a->started = time(NULL);
	snprintf(a->model_name, sizeof(a->model_name), "%s", cfg->served_model_name);
	*out = a;
	return 0;
}

void md_api_free(struct md_api *a)
{
	if (!a)
		return;
	md_gen_ctx_free(a->gen);
	free(a);
}

void md_api_set_http(struct md_api *a, struct md_http_server *http)
{
	a->http = http;
}

void md_api_set_state_cb(struct md_api *a, md_api_state_cb cb, void *arg)
{
	a->state_cb = cb;
	a->state_arg = arg;
}

void md_api_set_draining(struct md_api *a)
{
	a->draining = true;
}

size_t md_api_n_active(const struct md_api *a)
{
	return md_gen_n_active(a->gen);
}

void md_api_cancel_all(struct md_api *a)
{
	md_gen_cancel_all(a->gen);
}

static void bad_request(const struct md_oai_reply *o, const char *param, const char *msg)
{
	md_oai_error(o, 400, "invalid_request_error", param, NULL, "%s", msg);
}

static struct md_req_limits limits_of(const struct md_api *a)
{
	return (struct md_req_limits){ .model_name = a->model_name,
				       .max_tokens_cap = a->cfg->max_tokens_cap,
				       .n_vocab = a->n_vocab };
}

/* ---- small endpoints ---- */

static void h_health(struct md_api *a, const struct md_oai_reply *o)
{
	const char *st = "ok";
	int code = 200;
	if (a->draining) {
		st = "draining";
		code = 503;
	} else if (a->state == MD_ENGINE_LOADING) {
		st = "loading";
		code = 503;
	} else if (a->state != MD_ENGINE_READY) {
		st = "error";
		code = 503;
	}
	cJSON *doc = cJSON_CreateObject();
	cJSON_AddStringToObject(doc, "status", st);
	char extra[64] = "";
	if (code == 503)
		snprintf(extra, sizeof(extra), "Retry-After: %lld\r\n", (long long)a->cfg->retry_after);
	md_oai_json(o, code, doc, extra[0] ? extra : NULL);
}

static void h_metrics(struct md_api *a, const struct md_oai_reply *o)
{
	struct md_engine_stats st;
	md_engine_get_stats(a->eng, &st);
	struct md_metrics_server srv = {
		.connections = a->http ? md_http_n_connections(a->http) : 0,
		.busy = a->http ? md_http_n_busy(a->http) : 0,
		.conns_evicted = a->http ? md_http_n_evicted(a->http) : 0,
		.conns_refused = a->http ? md_http_n_refused(a->http) : 0,
		.ready = a->state == MD_ENGINE_READY && !a->draining,
	};
	struct md_metrics_src src = { .http = &a->http_counts, .gen = md_gen_metrics(a->gen),
				      .engine = &st, .server = &srv };
	/* count this response before rendering so the scrape sees itself */
	md_oai_account(o, 200, 0, 0, 0);
	char *txt;
	long n = md_metrics_render(&src, a->model_name, &txt);
	if (n < 0) {
		md_http_respond(o->c, 500, "text/plain", NULL, "out of memory\n", 14);
		return;
	}
	md_http_respond(o->c, 200, "text/plain; version=0.0.4; charset=utf-8", NULL, txt, (size_t)n);
	free(txt);
}

static cJSON *model_object(struct md_api *a)
{
	cJSON *m = cJSON_CreateObject();
	cJSON_AddStringToObject(m, "id", a->model_name);
	cJSON_AddStringToObject(m, "object", "model");
	cJSON_AddNumberToObject(m, "created", (double)a->started);
	cJSON_AddStringToObject(m, "owned_by", "moed");
	cJSON_AddNumberToObject(m, "max_model_len", a->n_ctx);
	return m;
}

static void h_models(struct md_api *a, const struct md_oai_reply *o)
{
	cJSON *doc = cJSON_CreateObject();
	cJSON_AddStringToObject(doc, "object", "list");
	cJSON *data = cJSON_AddArrayToObject(doc, "data");
	if (a->state == MD_ENGINE_READY)
		cJSON_AddItemToArray(data, model_object(a));
	md_oai_json(o, 200, doc, NULL);
}

static void h_model_one(struct md_api *a, const struct md_oai_reply *o, const char *id)
{
	if (a->state != MD_ENGINE_READY || strcmp(id, a->model_name) != 0) {
		md_oai_error(o, 404, "invalid_request_error", "model", "model_not_found",
			     "The model '%.200s' does not exist", id);
		return;
	}
	md_oai_json(o, 200, model_object(a), NULL);
}

/* /tokenize, its text tokenized (server/request.h): the ids, with their pieces when asked. */
static void on_tokenized(void *arg, struct md_request *r, const struct md_oai_reply *o)
{
	struct md_api *a = arg;
	if (!o) {
		md_request_free(r);
		return;
	}
	if (r->tok_rc) {
		md_request_answer(r, o);
		md_request_free(r);
		return;
	}
	const int32_t *ids = r->pr.ids[0];
	int n = (int)r->pr.lens[0];
	cJSON *doc = cJSON_CreateObject();
	cJSON *toks = cJSON_AddArrayToObject(doc, "tokens");
	for (int i = 0; i < n; i++)
		cJSON_AddItemToArray(toks, cJSON_CreateNumber(ids[i]));
	cJSON_AddNumberToObject(doc, "count", n);
	cJSON_AddNumberToObject(doc, "max_model_len", a->n_ctx);
	if (r->p.with_pieces) {
		cJSON *pieces = cJSON_AddArrayToObject(doc, "pieces");
		for (int i = 0; i < n; i++) {
			char buf[512];
			int pl = md_engine_token_piece(a->eng, ids[i], buf, sizeof(buf));
			if (pl < 0)
				pl = 0;
			if (pl > (int)sizeof(buf))
				pl = (int)sizeof(buf);
			char *s = md_oai_utf8_sanitize(buf, (size_t)pl);
			cJSON_AddItemToArray(pieces, cJSON_CreateString(s ? s : ""));
			free(s);
		}
	}
	md_request_free(r);
	md_oai_json(o, 200, doc, NULL);
}

/* body is consumed. */
static void h_tokenize(struct md_api *a, const struct md_oai_reply *o, cJSON *body)
{
	struct md_req_limits lim = limits_of(a);
	struct md_request *r = md_request_new(o, &lim, body, MD_REQ_TOKENIZE);
	if (r)
		md_request_tokenize_then(r, a->loop, a->eng, o, on_tokenized, a);
}

static void h_detokenize(struct md_api *a, const struct md_oai_reply *o, cJSON *body)
{
	struct md_req_limits lim = limits_of(a);
	struct md_req_params p;
	int rc = md_req_parse_params(o, &lim, body, MD_REQ_DETOKENIZE, &p);
	md_req_params_release(&p);
	if (rc < 0)
		return;
	cJSON *toks = cJSON_GetObjectItemCaseSensitive(body, "tokens");
	if (!cJSON_IsArray(toks)) {
		bad_request(o, "tokens", "'tokens' must be an array of token ids");
		return;
	}
	cJSON *t;
	cJSON_ArrayForEach(t, toks) {
		if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble) ||
		    t->valuedouble < 0 || t->valuedouble >= a->n_vocab) {
			md_oai_error(o, 400, "invalid_request_error", "tokens", "invalid_value",
				      "token ids must be integers in [0, %u)", a->n_vocab);
			return;
		}
	}
	/* the whole sequence at once, as Hugging Face decodes it (a stream cannot know how a
	 * run of byte tokens ends: engine/tokenizer.h) */
	size_t n = (size_t)cJSON_GetArraySize(toks), len = 0, i = 0;
	int32_t *ids = malloc(sizeof(int32_t) * (n ? n : 1));
	char *out = NULL;
	if (ids) {
		cJSON_ArrayForEach(t, toks)
			ids[i++] = (int32_t)t->valuedouble;
	}
	int rc2 = ids ? md_engine_detokenize(a->eng, ids, n, &out, &len) : -ENOMEM;
	free(ids);
	if (rc2) {
		md_oai_error(o, rc2 == -EINVAL ? 400 : 500,
			     rc2 == -EINVAL ? "invalid_request_error" : "server_error",
			     rc2 == -EINVAL ? "tokens" : NULL, NULL, "cannot decode the tokens (%s)",
			     strerror(-rc2));
		return;
	}
	cJSON *doc = cJSON_CreateObject();
	cJSON_AddStringToObject(doc, "content", out);
	cJSON_AddStringToObject(doc, "prompt", out);
	free(out);
	md_oai_json(o, 200, doc, NULL);
}

/* ---- routing ---- */

/* Constant-time: the time depends on the lengths only, never on where bytes differ. */
static bool key_equal(const char *a, size_t al, const char *b, size_t bl)
{
	size_t n = al > bl ? al : bl;
	unsigned diff = (unsigned)(al ^ bl);
	for (size_t i = 0; i < n; i++) {
		unsigned char x = i < al ? (unsigned char)a[i] : 0;
		unsigned char y = i < bl ? (unsigned char)b[i] : 0;
		diff |= (unsigned)(x ^ y);
	}
	return diff == 0;
}

static bool authorized(struct md_api *a, struct md_http_req *r)
{
	if (a->cfg->n_api_keys == 0)
		return true;
	const char *h = r->authorization;
	if (!h || strncasecmp(h, "Bearer ", 7) != 0)
		return false;
	h += 7;
	while (*h == ' ')
		h++;
	size_t hl = strlen(h);
	while (hl && (h[hl - 1] == ' ' || h[hl - 1] == '\t'))
		hl--;
	bool ok = false;
	for (size_t i = 0; i < a->cfg->n_api_keys; i++)
		ok |= key_equal(h, hl, a->cfg->api_keys[i], strlen(a->cfg->api_keys[i]));
	return ok;
}

enum route_id { R_HEALTH, R_METRICS, R_MODELS, R_CHAT, R_COMPLETIONS, R_TOKENIZE, R_DETOKENIZE };

static const struct route {
	const char *path;
	const char *method;
	enum route_id id;
	bool needs_model; /* answers 503 until the model is loaded */
	bool json_body;
} routes[] = {
	{ "/health", "GET", R_HEALTH, false, false },
	{ "/metrics", "GET", R_METRICS, false, false },
	{ "/v1/models", "GET", R_MODELS, false, false },
	{ "/v1/chat/completions", "POST", R_CHAT, true, true },
	{ "/v1/completions", "POST", R_COMPLETIONS, true, true },
	{ "/tokenize", "POST", R_TOKENIZE, true, true },
	{ "/detokenize", "POST", R_DETOKENIZE, true, true },
};

/* Parse a JSON object body. Returns it, or NULL after answering 400. */
static cJSON *parse_body(const struct md_oai_reply *o, struct md_http_req *r)
{
	if (r->body_len == 0) {
		bad_request(o, NULL, "the request body is empty (JSON expected)");
		return NULL;
	}
	if (!md_oai_utf8_valid(r->body, r->body_len)) {
		bad_request(o, NULL, "the request body is not valid UTF-8");
		return NULL;
	}
	const char *end = NULL;
	cJSON *body = cJSON_ParseWithLengthOpts(r->body, r->body_len, &end, false);
	if (body && end) {
		while (end < r->body + r->body_len &&
		       (*end == ' ' || *end == '\n' || *end == '\r' || *end == '\t'))
			end++;
		if (end != r->body + r->body_len) {
			cJSON_Delete(body);
			body = NULL;
		}
	}
	if (!body) {
		bad_request(o, NULL, "the request body is not valid JSON");
		return NULL;
	}
	if (!cJSON_IsObject(body)) {
		cJSON_Delete(body);
		bad_request(o, NULL, "the request body must be a JSON object");
		return NULL;
	}
	return body;
}

void md_api_on_request(void *arg, struct md_http_conn *c, struct md_http_req *r)
{
	struct md_api *a = arg;
	MD_ASSERT_LOOP_THREAD();
	char allow[16] = "";
	struct md_oai_reply o = { .c = c, .r = r, .http = &a->http_counts,
				  .retry_after = a->cfg->retry_after, .allow = allow };
	const struct route *rt = NULL;
	bool path_known = false;
	const char *path = r->path;
	/* tolerate a trailing slash as proxies and SDKs sometimes add one */
	char pbuf[256];
	size_t pl = strlen(path);
	if (pl > 1 && pl < sizeof(pbuf) && path[pl - 1] == '/') {
		memcpy(pbuf, path, pl - 1);
		pbuf[pl - 1] = 0;
		path = pbuf;
	}
	bool model_one = strncmp(path, "/v1/models/", 11) == 0 && path[11];
	for (size_t i = 0; i < sizeof(routes) / sizeof(routes[0]); i++)
		if (strcmp(routes[i].path, path) == 0) {
			path_known = true;
			if (strcmp(routes[i].method, r->method) == 0)
				rt = &routes[i];
		}
	if (model_one)
		path_known = true;

	if (!path_known) {
		if (!authorized(a, r)) {
			md_oai_error(&o, 401, "authentication_error", NULL, "invalid_api_key",
				     "missing or invalid API key");
			return;
		}
		md_oai_error(&o, 404, "invalid_request_error", NULL, "not_found",
			     "no route for %.200s %.200s", r->method, r->path);
		return;
	}
	if (!(rt && rt->id == R_HEALTH) && !authorized(a, r)) {
		md_oai_error(&o, 401, "authentication_error", NULL, "invalid_api_key",
			     "missing or invalid API key");
		return;
	}
	if (model_one) {
		if (strcmp(r->method, "GET") != 0) {
			snprintf(allow, sizeof(allow), "GET");
			md_oai_error(&o, 405, "invalid_request_error", NULL, "method_not_allowed",
				     "method %s not allowed here", r->method);
			return;
		}
		h_model_one(a, &o, path + 11);
		return;
	}
	if (!rt) {
		for (size_t i = 0; i < sizeof(routes) / sizeof(routes[0]); i++)
			if (strcmp(routes[i].path, path) == 0)
				snprintf(allow, sizeof(allow), "%s", routes[i].method);
		md_oai_error(&o, 405, "invalid_request_error", NULL, "method_not_allowed",
			     "method %.32s not allowed on %.200s", r->method, path);
		return;
	}
	if (rt->needs_model && (a->state != MD_ENGINE_READY || a->draining)) {
		md_oai_error(&o, 503, "server_error", NULL, "unavailable",
			     a->draining ? "the server is shutting down"
					 : a->state == MD_ENGINE_LOADING ? "the model is still loading"
					 : "the model failed to load");
		return;
	}
	cJSON *body = NULL;
	if (rt->json_body && !(body = parse_body(&o, r)))
		return;
	switch (rt->id) {
	case R_HEALTH: h_health(a, &o); break;
	case R_METRICS: h_metrics(a, &o); break;
	case R_MODELS: h_models(a, &o); break;
	/* these take the body */
	case R_CHAT: md_gen_chat(a->gen, &o, body); body = NULL; break;
	case R_COMPLETIONS: md_gen_completion(a->gen, &o, body); body = NULL; break;
	case R_TOKENIZE: h_tokenize(a, &o, body); body = NULL; break;
	case R_DETOKENIZE: h_detokenize(a, &o, body); break;
	}
	cJSON_Delete(body);
}

/* The engine changed state: remember the model's facts once it is ready. */
static void on_state(struct md_api *a)
{
	enum md_engine_state st = md_engine_state(a->eng);
	if (st == a->state)
		return;
	a->state = st;
	if (st == MD_ENGINE_READY) {
		if (!a->model_name[0])
			snprintf(a->model_name, sizeof(a->model_name), "%s",
				 md_engine_model_name(a->eng));
		a->n_ctx = md_engine_n_ctx(a->eng);
		a->n_vocab = md_engine_n_vocab(a->eng);
		md_gen_set_model(a->gen, a->model_name, a->n_ctx, a->n_vocab);
	}
	if (a->state_cb)
		a->state_cb(a->state_arg, st);
}

void md_api_on_engine_events(struct md_api *a)
{
	MD_ASSERT_LOOP_THREAD();
	struct md_engine_event *list = md_engine_poll(a->eng), *ev;
	for (ev = list; ev; ev = ev->next) {
		if (ev->kind == MD_EV_STATE)
			on_state(a);
		else
			md_gen_on_event(a->gen, ev);
	}
	md_engine_events_free(list);
}
