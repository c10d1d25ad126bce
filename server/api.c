/* OpenAI-compatible API: routing, auth, errors, /health, /metrics, /v1/models, (de)tokenize. */
#include "server/api.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "server/api_priv.h"
#include "common/log.h"

int md_api_new(struct md_api **out, struct md_engine *eng, struct md_config *cfg)
{
	struct md_api *a = calloc(1, sizeof(*a));
	if (!a)
		return -ENOMEM;
	a->eng = eng;
	a->cfg = cfg;
	a->state = MD_ENGINE_LOADING;
	a->started = time(NULL);
	md_metrics_init(&a->metrics);
	a->map_cap = 1024;
	a->map = calloc(a->map_cap, sizeof(*a->map));
	if (!a->map) {
		free(a);
		return -ENOMEM;
	}
	snprintf(a->model_name, sizeof(a->model_name), "%s", cfg->served_model_name);
	*out = a;
	return 0;
}

void md_api_free(struct md_api *a)
{
	if (!a)
		return;
	free(a->map);
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
	return a->n_gens;
}

void md_api_cancel_all(struct md_api *a)
{
	md__gen_cancel_all(a);
}

/* ---- id map ---- */

static size_t slot_of(uint64_t id, size_t cap)
{
	return (size_t)(md_sampler_mix(id) & (cap - 1));
}

static int map_grow(struct md_api *a)
{
	size_t nc = a->map_cap * 2;
	struct md_api_slot *nm = calloc(nc, sizeof(*nm));
	if (!nm)
		return -ENOMEM;
	for (size_t i = 0; i < a->map_cap; i++)
		if (a->map[i].ch) {
			size_t j = slot_of(a->map[i].id, nc);
			while (nm[j].ch)
				j = (j + 1) & (nc - 1);
			nm[j] = a->map[i];
		}
	free(a->map);
	a->map = nm;
	a->map_cap = nc;
	return 0;
}

int md__map_put(struct md_api *a, uint64_t id, struct md_gen_choice *ch)
{
	if ((a->map_n + 1) * 2 > a->map_cap && map_grow(a))
		return -ENOMEM;
	size_t j = slot_of(id, a->map_cap);
	while (a->map[j].ch)
		j = (j + 1) & (a->map_cap - 1);
	a->map[j].id = id;
	a->map[j].ch = ch;
	a->map_n++;
	return 0;
}

struct md_gen_choice *md__map_get(struct md_api *a, uint64_t id)
{
	size_t j = slot_of(id, a->map_cap);
	while (a->map[j].ch) {
		if (a->map[j].id == id)
			return a->map[j].ch;
		j = (j + 1) & (a->map_cap - 1);
	}
	return NULL;
}

void md__map_del(struct md_api *a, uint64_t id)
{
	size_t cap = a->map_cap, j = slot_of(id, cap);
	while (a->map[j].ch && a->map[j].id != id)
		j = (j + 1) & (cap - 1);
	if (!a->map[j].ch)
		return;
	a->map[j].ch = NULL;
	a->map_n--;
	/* backward-shift the cluster so lookups never stop at the hole */
	size_t k = (j + 1) & (cap - 1);
	while (a->map[k].ch) {
		struct md_api_slot s = a->map[k];
		a->map[k].ch = NULL;
		size_t h = slot_of(s.id, cap);
		while (a->map[h].ch)
			h = (h + 1) & (cap - 1);
		a->map[h] = s;
		k = (k + 1) & (cap - 1);
	}
}

/* ---- UTF-8 ---- */

/* Length of the well-formed sequence at s (1..4), or 0 when ill-formed. */
static size_t utf8_seq(const unsigned char *s, size_t n)
{
	unsigned char c = s[0];
	if (c < 0x80)
		return 1;
	size_t len;
	unsigned char lo = 0x80, hi = 0xBF;
	if (c >= 0xC2 && c <= 0xDF)
		len = 2;
	else if (c >= 0xE0 && c <= 0xEF) {
		len = 3;
		if (c == 0xE0)
			lo = 0xA0;
		else if (c == 0xED)
			hi = 0x9F;
	} else if (c >= 0xF0 && c <= 0xF4) {
		len = 4;
		if (c == 0xF0)
			lo = 0x90;
		else if (c == 0xF4)
			hi = 0x8F;
	} else
		return 0;
	if (n < len || s[1] < lo || s[1] > hi)
		return 0;
	for (size_t i = 2; i < len; i++)
		if (s[i] < 0x80 || s[i] > 0xBF)
			return 0;
	return len;
}

bool md__utf8_valid(const char *s, size_t n)
{
	const unsigned char *p = (const unsigned char *)s;
	for (size_t i = 0; i < n;) {
		size_t l = utf8_seq(p + i, n - i);
		if (!l)
			return false;
		i += l;
	}
	return true;
}

char *md__utf8_sanitize(const char *s, size_t n)
{
	char *out = malloc(n * 3 + 1);
	if (!out)
		return NULL;
	const unsigned char *p = (const unsigned char *)s;
	size_t o = 0;
	for (size_t i = 0; i < n;) {
		size_t l = utf8_seq(p + i, n - i);
		if (l) {
			memcpy(out + o, p + i, l);
			o += l;
			i += l;
		} else {
			memcpy(out + o, "\xEF\xBF\xBD", 3);
			o += 3;
			i++;
		}
	}
	out[o] = 0;
	return out;
}

/* ---- responses ---- */

void md__api_account(struct md_api *a, struct md_http_req *r, int status, unsigned in,
		     unsigned out, double ttft)
{
	md_metrics_http(&a->metrics, status);
	md_log_access(r->method, r->path, status, (unsigned long)r->id, in, out, ttft,
		      md_http_now() - r->t_start);
}

void md__api_json(struct md_api *a, struct md_http_conn *c, struct md_http_req *r, int status,
		  cJSON *doc, const char *extra_headers)
{
	char *txt = doc ? cJSON_PrintUnformatted(doc) : NULL;
	cJSON_Delete(doc);
	if (!txt) {
		static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":"
					  "\"server_error\",\"param\":null,\"code\":null}}";
		md__api_account(a, r, 500, 0, 0, 0);
		md_http_respond(c, 500, "application/json", NULL, oom, sizeof(oom) - 1);
		return;
	}
	md__api_account(a, r, status, 0, 0, 0);
	md_http_respond(c, status, "application/json", extra_headers, txt, strlen(txt));
	free(txt);
}

void md__api_error(struct md_api *a, struct md_http_conn *c, struct md_http_req *r, int status,
		   const char *type, const char *param, const char *code, const char *fmt, ...)
{
	char msg[1024];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	cJSON *doc = cJSON_CreateObject();
	cJSON *err = cJSON_AddObjectToObject(doc, "error");
	char *safe = md__utf8_sanitize(msg, strlen(msg));
	cJSON_AddStringToObject(err, "message", safe ? safe : "error");
	free(safe);
	cJSON_AddStringToObject(err, "type", type);
	if (param)
		cJSON_AddStringToObject(err, "param", param);
	else
		cJSON_AddNullToObject(err, "param");
	if (code)
		cJSON_AddStringToObject(err, "code", code);
	else
		cJSON_AddNullToObject(err, "code");
	char extra[128] = "";
	if (status == 429 || status == 503)
		snprintf(extra, sizeof(extra), "Retry-After: %lld\r\n",
			 (long long)a->cfg->retry_after);
	else if (status == 401)
		snprintf(extra, sizeof(extra), "WWW-Authenticate: Bearer\r\n");
	else if (status == 405 && a->allow[0])
		snprintf(extra, sizeof(extra), "Allow: %s\r\n", a->allow);
	md__api_json(a, c, r, status, doc, extra[0] ? extra : NULL);
}

static void bad_request(struct md_api *a, struct md_http_conn *c, struct md_http_req *r,
			const char *param, const char *msg)
{
	md__api_error(a, c, r, 400, "invalid_request_error", param, NULL, "%s", msg);
}

/* ---- parameters ---- */

int md__param_number(struct md_api *a, struct md_http_conn *c, struct md_http_req *r,
		     cJSON *obj, const char *name, double lo, double hi, bool lo_open, double *out)
{
	cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, name);
	if (!it || cJSON_IsNull(it))
		return 0;
	if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble)) {
		md__api_error(a, c, r, 400, "invalid_request_error", name, "invalid_type",
			      "'%s' must be a number", name);
		return -1;
	}
	double v = it->valuedouble;
	if (v < lo || v > hi || (lo_open && v == lo)) {
		md__api_error(a, c, r, 400, "invalid_request_error", name, "invalid_value",
			      "'%s' must be in %s%g, %g], got %g", name, lo_open ? "(" : "[", lo, hi,
			      v);
		return -1;
	}
	*out = v;
	return 1;
}

int md__param_int(struct md_api *a, struct md_http_conn *c, struct md_http_req *r, cJSON *obj,
		  const char *name, int64_t lo, int64_t hi, int64_t *out)
{
	cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, name);
	if (!it || cJSON_IsNull(it))
		return 0;
	if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble) ||
	    it->valuedouble != floor(it->valuedouble)) {
		md__api_error(a, c, r, 400, "invalid_request_error", name, "invalid_type",
			      "'%s' must be an integer", name);
		return -1;
	}
	double v = it->valuedouble;
	if (v < (double)lo || v > (double)hi) {
		md__api_error(a, c, r, 400, "invalid_request_error", name, "invalid_value",
			      "'%s' must be in [%lld, %lld], got %.15g", name, (long long)lo,
			      (long long)hi, v);
		return -1;
	}
	*out = (int64_t)v;
	return 1;
}

int md__param_bool(struct md_api *a, struct md_http_conn *c, struct md_http_req *r, cJSON *obj,
		   const char *name, bool *out)
{
	cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, name);
	if (!it || cJSON_IsNull(it))
		return 0;
	if (!cJSON_IsBool(it)) {
		md__api_error(a, c, r, 400, "invalid_request_error", name, "invalid_type",
			      "'%s' must be a boolean", name);
		return -1;
	}
	*out = cJSON_IsTrue(it);
	return 1;
}

int md__check_model(struct md_api *a, struct md_http_conn *c, struct md_http_req *r, cJSON *obj)
{
	cJSON *m = cJSON_GetObjectItemCaseSensitive(obj, "model");
	if (!m || cJSON_IsNull(m))
		return 0;
	if (!cJSON_IsString(m)) {
		md__api_error(a, c, r, 400, "invalid_request_error", "model", "invalid_type",
			      "'model' must be a string");
		return -1;
	}
	if (strcmp(m->valuestring, a->model_name) != 0) {
		md__api_error(a, c, r, 404, "invalid_request_error", "model", "model_not_found",
			      "The model '%.200s' does not exist; this server serves '%s'",
			      m->valuestring, a->model_name);
		return -1;
	}
	return 0;
}

void md__free_messages(struct md_engine_msg *msgs, char **owned, size_t n_owned)
{
	for (size_t i = 0; i < n_owned; i++)
		free(owned[i]);
	free(owned);
	free(msgs);
}

int md__parse_messages(struct md_api *a, struct md_http_conn *c, struct md_http_req *r,
		       cJSON *body, struct md_engine_msg **msgs_out, char ***owned_out,
		       size_t *n_owned_out)
{
	cJSON *arr = cJSON_GetObjectItemCaseSensitive(body, "messages");
	if (!arr) {
		bad_request(a, c, r, "messages", "'messages' is required");
		return -1;
	}
	if (!cJSON_IsArray(arr) || cJSON_GetArraySize(arr) == 0) {
		bad_request(a, c, r, "messages", "'messages' must be a non-empty array");
		return -1;
	}
	size_t n = (size_t)cJSON_GetArraySize(arr);
	struct md_engine_msg *msgs = calloc(n, sizeof(*msgs));
	char **owned = calloc(n, sizeof(char *));
	size_t n_owned = 0, i = 0;
	char param[64];
	if (!msgs || !owned) {
		free(msgs);
		free(owned);
		md__api_error(a, c, r, 500, "server_error", NULL, NULL, "out of memory");
		return -1;
	}
	cJSON *m;
	cJSON_ArrayForEach(m, arr) {
		if (!cJSON_IsObject(m)) {
			snprintf(param, sizeof(param), "messages[%zu]", i);
			bad_request(a, c, r, param, "each message must be an object");
			goto fail;
		}
		cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
		if (!cJSON_IsString(role)) {
			snprintf(param, sizeof(param), "messages[%zu].role", i);
			bad_request(a, c, r, param, "'role' must be a string");
			goto fail;
		}
		const char *rs = role->valuestring;
		if (strcmp(rs, "developer") == 0)
			rs = "system";
		if (strcmp(rs, "system") && strcmp(rs, "user") && strcmp(rs, "assistant")) {
			snprintf(param, sizeof(param), "messages[%zu].role", i);
			md__api_error(a, c, r, 400, "invalid_request_error", param, "invalid_value",
				      "unsupported role '%.64s' (system, developer, user, assistant)",
				      role->valuestring);
			goto fail;
		}
		msgs[i].role = rs;
		cJSON *content = cJSON_GetObjectItemCaseSensitive(m, "content");
		if (!content || cJSON_IsNull(content)) {
			if (strcmp(rs, "assistant") != 0) {
				snprintf(param, sizeof(param), "messages[%zu].content", i);
				bad_request(a, c, r, param, "'content' is required");
				goto fail;
			}
			msgs[i].content = "";
		} else if (cJSON_IsString(content)) {
			msgs[i].content = content->valuestring;
		} else if (cJSON_IsArray(content)) {
			/* content parts: only text parts, joined */
			size_t len = 0;
			cJSON *part;
			cJSON_ArrayForEach(part, content) {
				cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
				cJSON *text = cJSON_GetObjectItemCaseSensitive(part, "text");
				if (!cJSON_IsString(type) || strcmp(type->valuestring, "text") ||
				    !cJSON_IsString(text)) {
					snprintf(param, sizeof(param), "messages[%zu].content", i);
					bad_request(a, c, r, param,
						    "only content parts of type 'text' are supported");
					goto fail;
				}
				len += strlen(text->valuestring);
			}
			char *joined = malloc(len + 1);
			if (!joined) {
				md__api_error(a, c, r, 500, "server_error", NULL, NULL, "out of memory");
				goto fail;
			}
			size_t o = 0;
			cJSON_ArrayForEach(part, content) {
				const char *t = cJSON_GetObjectItemCaseSensitive(part, "text")->valuestring;
				size_t l = strlen(t);
				memcpy(joined + o, t, l);
				o += l;
			}
			joined[o] = 0;
			owned[n_owned++] = joined;
			msgs[i].content = joined;
		} else {
			snprintf(param, sizeof(param), "messages[%zu].content", i);
			bad_request(a, c, r, param, "'content' must be a string or an array of parts");
			goto fail;
		}
		i++;
	}
	*msgs_out = msgs;
	*owned_out = owned;
	*n_owned_out = n_owned;
	return (int)n;
fail:
	md__free_messages(msgs, owned, n_owned);
	return -1;
}

/* ---- small endpoints ---- */

static void h_health(struct md_api *a, struct md_http_conn *c, struct md_http_req *r)
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
	md__api_json(a, c, r, code, doc, extra[0] ? extra : NULL);
}

static void h_metrics(struct md_api *a, struct md_http_conn *c, struct md_http_req *r)
{
	struct md_engine_stats st;
	md_engine_get_stats(a->eng, &st);
	struct md_metrics_gauges g = {
		.waiting = st.waiting, .running = st.running,
		.kv_blocks_used = st.kv_blocks_used, .kv_blocks_total = st.kv_blocks_total,
		.engine_steps = st.steps, .preemptions = st.preemptions,
		.connections = a->http ? md_http_n_connections(a->http) : 0,
		.busy = a->http ? md_http_n_busy(a->http) : 0,
		.ready = a->state == MD_ENGINE_READY && !a->draining,
	};
	/* count this response before rendering so the scrape sees itself */
	md__api_account(a, r, 200, 0, 0, 0);
	char *txt;
	long n = md_metrics_render(&a->metrics, &g, a->model_name, &txt);
	if (n < 0) {
		md_http_respond(c, 500, "text/plain", NULL, "out of memory\n", 14);
		return;
	}
	md_http_respond(c, 200, "text/plain; version=0.0.4; charset=utf-8", NULL, txt, (size_t)n);
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

static void h_models(struct md_api *a, struct md_http_conn *c, struct md_http_req *r)
{
	cJSON *doc = cJSON_CreateObject();
	cJSON_AddStringToObject(doc, "object", "list");
	cJSON *data = cJSON_AddArrayToObject(doc, "data");
	if (a->state == MD_ENGINE_READY)
		cJSON_AddItemToArray(data, model_object(a));
	md__api_json(a, c, r, 200, doc, NULL);
}

static void h_model_one(struct md_api *a, struct md_http_conn *c, struct md_http_req *r,
			const char *id)
{
	if (a->state != MD_ENGINE_READY || strcmp(id, a->model_name) != 0) {
		md__api_error(a, c, r, 404, "invalid_request_error", "model", "model_not_found",
			      "The model '%.200s' does not exist", id);
		return;
	}
	md__api_json(a, c, r, 200, model_object(a), NULL);
}

static void h_tokenize(struct md_api *a, struct md_http_conn *c, struct md_http_req *r,
		       cJSON *body)
{
	bool add_special = true, with_pieces = false;
	if (md__param_bool(a, c, r, body, "add_special", &add_special) < 0 ||
	    md__param_bool(a, c, r, body, "with_pieces", &with_pieces) < 0 ||
	    md__check_model(a, c, r, body) < 0)
		return;
	int32_t *ids = NULL;
	int n;
	cJSON *text = cJSON_GetObjectItemCaseSensitive(body, "content");
	if (!text)
		text = cJSON_GetObjectItemCaseSensitive(body, "prompt");
	if (text) {
		if (!cJSON_IsString(text)) {
			bad_request(a, c, r, "content", "'content' must be a string");
			return;
		}
		n = md_engine_tokenize(a->eng, text->valuestring, strlen(text->valuestring),
				       add_special, true, &ids);
	} else if (cJSON_GetObjectItemCaseSensitive(body, "messages")) {
		struct md_engine_msg *msgs;
		char **owned;
		size_t n_owned;
		int nm = md__parse_messages(a, c, r, body, &msgs, &owned, &n_owned);
		if (nm < 0)
			return;
		n = md_engine_chat_tokenize(a->eng, msgs, (size_t)nm, &ids);
		md__free_messages(msgs, owned, n_owned);
		if (n == -EINVAL) {
			bad_request(a, c, r, "messages", "the chat template rejects these messages");
			return;
		}
	} else {
		bad_request(a, c, r, "content", "'content' (or 'prompt' or 'messages') is required");
		return;
	}
	if (n < 0) {
		md__api_error(a, c, r, 500, "server_error", NULL, NULL, "tokenization failed (%d)", n);
		return;
	}
	cJSON *doc = cJSON_CreateObject();
	cJSON *toks = cJSON_AddArrayToObject(doc, "tokens");
	for (int i = 0; i < n; i++)
		cJSON_AddItemToArray(toks, cJSON_CreateNumber(ids[i]));
	cJSON_AddNumberToObject(doc, "count", n);
	cJSON_AddNumberToObject(doc, "max_model_len", a->n_ctx);
	if (with_pieces) {
		cJSON *pieces = cJSON_AddArrayToObject(doc, "pieces");
		for (int i = 0; i < n; i++) {
			char buf[512];
			int pl = md_engine_token_piece(a->eng, ids[i], buf, sizeof(buf));
			if (pl < 0)
				pl = 0;
			if (pl > (int)sizeof(buf))
				pl = (int)sizeof(buf);
			char *s = md__utf8_sanitize(buf, (size_t)pl);
			cJSON_AddItemToArray(pieces, cJSON_CreateString(s ? s : ""));
			free(s);
		}
	}
	free(ids);
	md__api_json(a, c, r, 200, doc, NULL);
}

static void h_detokenize(struct md_api *a, struct md_http_conn *c, struct md_http_req *r,
			 cJSON *body)
{
	if (md__check_model(a, c, r, body) < 0)
		return;
	cJSON *toks = cJSON_GetObjectItemCaseSensitive(body, "tokens");
	if (!cJSON_IsArray(toks)) {
		bad_request(a, c, r, "tokens", "'tokens' must be an array of token ids");
		return;
	}
	cJSON *t;
	cJSON_ArrayForEach(t, toks) {
		if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble) ||
		    t->valuedouble < 0 || t->valuedouble >= a->n_vocab) {
			md__api_error(a, c, r, 400, "invalid_request_error", "tokens", "invalid_value",
				      "token ids must be integers in [0, %u)", a->n_vocab);
			return;
		}
	}
	struct md_engine_detok *d = md_engine_detok_new(a->eng, false);
	size_t cap = 1024, len = 0;
	char *out = malloc(cap);
	if (!d || !out) {
		md_engine_detok_free(d);
		free(out);
		md__api_error(a, c, r, 500, "server_error", NULL, NULL, "out of memory");
		return;
	}
	char buf[1024];
	int k;
	bool last = false;
	t = toks->child;
	for (;;) {
		if (t) {
			k = md_engine_detok_push(d, (int32_t)t->valuedouble, buf, sizeof(buf));
			t = t->next;
		} else {
			k = md_engine_detok_flush(d, buf, sizeof(buf));
			last = true;
		}
		if (k > 0) {
			if (len + (size_t)k + 1 > cap) {
				while (len + (size_t)k + 1 > cap)
					cap *= 2;
				char *no = realloc(out, cap);
				if (!no)
					break;
				out = no;
			}
			memcpy(out + len, buf, (size_t)k);
			len += (size_t)k;
		}
		if (last)
			break;
	}
	md_engine_detok_free(d);
	out[len] = 0;
	cJSON *doc = cJSON_CreateObject();
	cJSON_AddStringToObject(doc, "content", out);
	cJSON_AddStringToObject(doc, "prompt", out);
	free(out);
	md__api_json(a, c, r, 200, doc, NULL);
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

void md_api_on_request(void *arg, struct md_http_conn *c, struct md_http_req *r)
{
	struct md_api *a = arg;
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
			md__api_error(a, c, r, 401, "authentication_error", NULL, "invalid_api_key",
				      "missing or invalid API key");
			return;
		}
		md__api_error(a, c, r, 404, "invalid_request_error", NULL, "not_found",
			      "no route for %.200s %.200s", r->method, r->path);
		return;
	}
	if (!(rt && rt->id == R_HEALTH) && !authorized(a, r)) {
		md__api_error(a, c, r, 401, "authentication_error", NULL, "invalid_api_key",
			      "missing or invalid API key");
		return;
	}
	if (model_one) {
		if (strcmp(r->method, "GET") != 0) {
			snprintf(a->allow, sizeof(a->allow), "GET");
			md__api_error(a, c, r, 405, "invalid_request_error", NULL, "method_not_allowed",
				      "method %s not allowed here", r->method);
			return;
		}
		h_model_one(a, c, r, path + 11);
		return;
	}
	if (!rt) {
		for (size_t i = 0; i < sizeof(routes) / sizeof(routes[0]); i++)
			if (strcmp(routes[i].path, path) == 0)
				snprintf(a->allow, sizeof(a->allow), "%s", routes[i].method);
		md__api_error(a, c, r, 405, "invalid_request_error", NULL, "method_not_allowed",
			      "method %.32s not allowed on %.200s", r->method, path);
		return;
	}
	if (rt->needs_model && (a->state != MD_ENGINE_READY || a->draining)) {
		md__api_error(a, c, r, 503, "server_error", NULL, "unavailable",
			      a->draining ? "the server is shutting down"
					  : a->state == MD_ENGINE_LOADING ? "the model is still loading"
					  : "the model failed to load");
		return;
	}
	cJSON *body = NULL;
	if (rt->json_body) {
		if (r->body_len == 0) {
			bad_request(a, c, r, NULL, "the request body is empty (JSON expected)");
			return;
		}
		if (!md__utf8_valid(r->body, r->body_len)) {
			bad_request(a, c, r, NULL, "the request body is not valid UTF-8");
			return;
		}
		const char *end = NULL;
		body = cJSON_ParseWithLengthOpts(r->body, r->body_len, &end, false);
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
			bad_request(a, c, r, NULL, "the request body is not valid JSON");
			return;
		}
		if (!cJSON_IsObject(body)) {
			cJSON_Delete(body);
			bad_request(a, c, r, NULL, "the request body must be a JSON object");
			return;
		}
	}
	switch (rt->id) {
	case R_HEALTH: h_health(a, c, r); break;
	case R_METRICS: h_metrics(a, c, r); break;
	case R_MODELS: h_models(a, c, r); break;
	case R_CHAT: md__gen_chat(a, c, r, body); break;
	case R_COMPLETIONS: md__gen_completion(a, c, r, body); break;
	case R_TOKENIZE: h_tokenize(a, c, r, body); break;
	case R_DETOKENIZE: h_detokenize(a, c, r, body); break;
	}
	cJSON_Delete(body);
}

void md_api_on_engine_events(struct md_api *a)
{
	struct md_engine_event *list = md_engine_poll(a->eng), *ev;
	for (ev = list; ev; ev = ev->next) {
		if (ev->kind == MD_EV_STATE) {
			enum md_engine_state st = md_engine_state(a->eng);
			if (st == a->state)
				continue;
			a->state = st;
			if (st == MD_ENGINE_READY) {
				if (!a->model_name[0])
					snprintf(a->model_name, sizeof(a->model_name), "%s",
						 md_engine_model_name(a->eng));
				a->n_ctx = md_engine_n_ctx(a->eng);
				a->n_vocab = md_engine_n_vocab(a->eng);
			}
			if (a->state_cb)
				a->state_cb(a->state_arg, st);
			continue;
		}
		md__gen_on_event(a, ev);
	}
	md_engine_events_free(list);
}
