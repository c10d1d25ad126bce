/* OpenAI wire format: replies and error objects, request parameters, messages, chunks. */
#include "server/oai.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/assert.h"
#include "common/log.h"

/* ---- replies ---- */

void md_oai_account(const struct md_oai_reply *o, int status, unsigned tokens_in,
		    unsigned tokens_out, double ttft)
{
	if (o->http)
		md_metrics_http_count(o->http, status);
	md_log_access(o->r->method, o->r->path, status, (unsigned long)o->r->id, tokens_in,
		      tokens_out, ttft, md_http_now() - o->r->t_start);
}

void md_oai_json(const struct md_oai_reply *o, int status, cJSON *doc, const char *extra_headers)
{
	char *txt = doc ? cJSON_PrintUnformatted(doc) : NULL;
	cJSON_Delete(doc);
	if (!txt) {
		static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":"
					  "\"server_error\",\"param\":null,\"code\":null}}";
		md_oai_account(o, 500, 0, 0, 0);
		md_http_respond(o->c, 500, "application/json", NULL, oom, sizeof(oom) - 1);
		return;
	}
	md_oai_account(o, status, 0, 0, 0);
	md_http_respond(o->c, status, "application/json", extra_headers, txt, strlen(txt));
	free(txt);
}

cJSON *md_oai_error_doc(const char *message, const char *type)
{
	cJSON *doc = cJSON_CreateObject();
	cJSON *e = cJSON_AddObjectToObject(doc, "error");
	cJSON_AddStringToObject(e, "message", message);
	cJSON_AddStringToObject(e, "type", type);
	cJSON_AddNullToObject(e, "param");
	cJSON_AddNullToObject(e, "code");
	return doc;
}

void md_oai_error(const struct md_oai_reply *o, int status, const char *type, const char *param,
		  const char *code, const char *fmt, ...)
{
	char msg[1024];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	cJSON *doc = cJSON_CreateObject();
	cJSON *err = cJSON_AddObjectToObject(doc, "error");
	char *safe = md_oai_utf8_sanitize(msg, strlen(msg));
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
		snprintf(extra, sizeof(extra), "Retry-After: %lld\r\n", (long long)o->retry_after);
	else if (status == 401)
		snprintf(extra, sizeof(extra), "WWW-Authenticate: Bearer\r\n");
	else if (status == 405 && o->allow && o->allow[0])
		snprintf(extra, sizeof(extra), "Allow: %s\r\n", o->allow);
	md_oai_json(o, status, doc, extra[0] ? extra : NULL);
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

bool md_oai_utf8_valid(const char *s, size_t n)
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

char *md_oai_utf8_sanitize(const char *s, size_t n)
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

/* ---- response documents and chunks ---- */

void md_oai_make_id(char *out, size_t cap, const char *prefix)
{
	static uint64_t counter;
	uint64_t x = md_sampler_mix((uint64_t)time(NULL) ^ (++counter << 20) ^
				    (uint64_t)(md_http_now() * 1e9));
	snprintf(out, cap, "%s%016llx%08llx", prefix, (unsigned long long)x,
		 (unsigned long long)(counter & 0xffffffff));
}

cJSON *md_oai_doc_new(const struct md_oai_ident *id, bool whole, cJSON **choices)
{
	cJSON *doc = cJSON_CreateObject();
	if (!doc)
		return NULL;
	cJSON_AddStringToObject(doc, "id", id->id);
	const char *object = id->chat ? (whole ? "chat.completion" : "chat.completion.chunk")
				      : "text_completion";
	cJSON_AddStringToObject(doc, "object", object);
	cJSON_AddNumberToObject(doc, "created", (double)id->created);
	cJSON_AddStringToObject(doc, "model", id->model);
	if (id->chat)
		cJSON_AddNullToObject(doc, "system_fingerprint");
	*choices = cJSON_AddArrayToObject(doc, "choices");
	return doc;
}

cJSON *md_oai_choice_role(uint32_t index)
{
	cJSON *c0 = cJSON_CreateObject();
	cJSON_AddNumberToObject(c0, "index", index);
	cJSON *delta = cJSON_AddObjectToObject(c0, "delta");
	cJSON_AddStringToObject(delta, "role", "assistant");
	cJSON_AddStringToObject(delta, "content", "");
	cJSON_AddNullToObject(c0, "logprobs");
	cJSON_AddNullToObject(c0, "finish_reason");
	return c0;
}

cJSON *md_oai_choice_delta(const struct md_oai_ident *id, uint32_t index, const char *text,
			   size_t len, cJSON *logprobs)
{
	cJSON *c0 = cJSON_CreateObject();
	cJSON_AddNumberToObject(c0, "index", index);
	char *txt = strndup(text, len);
	if (id->chat) {
		cJSON *delta = cJSON_AddObjectToObject(c0, "delta");
		cJSON_AddStringToObject(delta, "content", txt ? txt : "");
	} else {
		cJSON_AddStringToObject(c0, "text", txt ? txt : "");
	}
	free(txt);
	if (logprobs)
		cJSON_AddItemToObject(c0, "logprobs", logprobs);
	else
		cJSON_AddNullToObject(c0, "logprobs");
	cJSON_AddNullToObject(c0, "finish_reason");
	return c0;
}

cJSON *md_oai_choice_reasoning_delta(uint32_t index, const char *text, size_t len)
{
	cJSON *c0 = cJSON_CreateObject();
	cJSON_AddNumberToObject(c0, "index", index);
	cJSON *delta = cJSON_AddObjectToObject(c0, "delta");
	char *txt = strndup(text, len);
	cJSON_AddStringToObject(delta, "reasoning_content", txt ? txt : "");
	free(txt);
	cJSON_AddNullToObject(c0, "logprobs");
	cJSON_AddNullToObject(c0, "finish_reason");
	return c0;
}

void md_oai_choice_set_reasoning(cJSON *choice, const char *text)
{
	cJSON *msg = cJSON_GetObjectItemCaseSensitive(choice, "message");
	if (!msg)
		return;
	if (text && *text)
		cJSON_AddStringToObject(msg, "reasoning_content", text);
	else
		cJSON_AddNullToObject(msg, "reasoning_content");
}

cJSON *md_oai_choice_finish(const struct md_oai_ident *id, uint32_t index, const char *reason)
{
	cJSON *c0 = cJSON_CreateObject();
	cJSON_AddNumberToObject(c0, "index", index);
	if (id->chat)
		cJSON_AddObjectToObject(c0, "delta");
	else
		cJSON_AddStringToObject(c0, "text", "");
	cJSON_AddNullToObject(c0, "logprobs");
	cJSON_AddStringToObject(c0, "finish_reason", reason);
	return c0;
}

cJSON *md_oai_choice_whole(const struct md_oai_ident *id, uint32_t index, const char *text,
			   cJSON *logprobs, const char *reason)
{
	cJSON *c0 = cJSON_CreateObject();
	cJSON_AddNumberToObject(c0, "index", index);
	if (id->chat) {
		cJSON *msg = cJSON_AddObjectToObject(c0, "message");
		cJSON_AddStringToObject(msg, "role", "assistant");
		cJSON_AddStringToObject(msg, "content", text);
	} else {
		cJSON_AddStringToObject(c0, "text", text);
	}
	if (logprobs)
		cJSON_AddItemToObject(c0, "logprobs", logprobs);
	else
		cJSON_AddNullToObject(c0, "logprobs");
	cJSON_AddStringToObject(c0, "finish_reason", reason);
	return c0;
}

cJSON *md_oai_usage(uint32_t prompt_tokens, uint32_t completion_tokens, uint32_t cached_tokens)
{
	cJSON *u = cJSON_CreateObject();
	cJSON_AddNumberToObject(u, "prompt_tokens", prompt_tokens);
	cJSON_AddNumberToObject(u, "completion_tokens", completion_tokens);
	cJSON_AddNumberToObject(u, "total_tokens", prompt_tokens + completion_tokens);
	cJSON *d = cJSON_AddObjectToObject(u, "prompt_tokens_details");
	if (d)
		cJSON_AddNumberToObject(d, "cached_tokens", cached_tokens);
	return u;
}

cJSON *md_oai_tool_call(const char *id, const char *name, const char *arguments)
{
	cJSON *c = cJSON_CreateObject();
	cJSON_AddStringToObject(c, "id", id);
	cJSON_AddStringToObject(c, "type", "function");
	cJSON *fn = cJSON_AddObjectToObject(c, "function");
	cJSON_AddStringToObject(fn, "name", name);
	cJSON_AddStringToObject(fn, "arguments", arguments);
	return c;
}

cJSON *md_oai_choice_tool_delta(uint32_t index, int call_index, const char *id, const char *name,
				const char *args, size_t args_len, cJSON *logprobs)
{
	cJSON *c0 = cJSON_CreateObject();
	cJSON_AddNumberToObject(c0, "index", index);
	cJSON *delta = cJSON_AddObjectToObject(c0, "delta");
	cJSON *calls = cJSON_AddArrayToObject(delta, "tool_calls");
	cJSON *tc = cJSON_CreateObject();
	cJSON_AddItemToArray(calls, tc);
	cJSON_AddNumberToObject(tc, "index", call_index);
	if (id) {
		cJSON_AddStringToObject(tc, "id", id);
		cJSON_AddStringToObject(tc, "type", "function");
	}
	cJSON *fn = cJSON_AddObjectToObject(tc, "function");
	if (name)
		cJSON_AddStringToObject(fn, "name", name);
	char *a = strndup(args ? args : "", args ? args_len : 0);
	cJSON_AddStringToObject(fn, "arguments", a ? a : "");
	free(a);
	if (logprobs)
		cJSON_AddItemToObject(c0, "logprobs", logprobs);
	else
		cJSON_AddNullToObject(c0, "logprobs");
	cJSON_AddNullToObject(c0, "finish_reason");
	return c0;
}

void md_oai_choice_set_tool_calls(cJSON *choice, cJSON *calls)
{
	cJSON *msg = cJSON_GetObjectItemCaseSensitive(choice, "message");
	if (!msg) {
		cJSON_Delete(calls);
		return;
	}
	cJSON *content = cJSON_GetObjectItemCaseSensitive(msg, "content");
	if (cJSON_IsString(content) && content->valuestring[0] == 0)
		cJSON_ReplaceItemInObjectCaseSensitive(msg, "content", cJSON_CreateNull());
	cJSON_AddItemToObject(msg, "tool_calls", calls);
}

long md_oai_sse_event(cJSON *doc, char **out)
{
	char *txt = doc ? cJSON_PrintUnformatted(doc) : NULL;
	cJSON_Delete(doc);
	if (!txt)
		return -ENOMEM;
	size_t l = strlen(txt);
	char *ev = malloc(l + 9);
	if (!ev) {
		free(txt);
		return -ENOMEM;
	}
	memcpy(ev, "data: ", 6);
	memcpy(ev + 6, txt, l);
	memcpy(ev + 6 + l, "\n\n", 3);
	free(txt);
	*out = ev;
	return (long)(l + 8);
}

/* Token text (sanitised) under key, and with bytes its raw bytes. */
static void token_strings(const struct md_engine *eng, int32_t id, cJSON *obj, const char *key,
			  bool bytes)
{
	char buf[512];
	int n = md_engine_token_piece(eng, id, buf, sizeof(buf));
	if (n < 0)
		n = 0;
	if (n > (int)sizeof(buf))
		n = (int)sizeof(buf);
	char *s = md_oai_utf8_sanitize(buf, (size_t)n);
	cJSON_AddStringToObject(obj, key, s ? s : "");
	free(s);
	if (bytes) {
		cJSON *b = cJSON_AddArrayToObject(obj, "bytes");
		for (int i = 0; i < n; i++)
			cJSON_AddItemToArray(b, cJSON_CreateNumber((unsigned char)buf[i]));
	}
}

cJSON *md_oai_logprobs_new(bool chat)
{
	cJSON *lp = cJSON_CreateObject();
	if (chat) {
		cJSON_AddArrayToObject(lp, "content");
	} else {
		cJSON_AddArrayToObject(lp, "tokens");
		cJSON_AddArrayToObject(lp, "token_logprobs");
		cJSON_AddArrayToObject(lp, "top_logprobs");
		cJSON_AddArrayToObject(lp, "text_offset");
	}
	return lp;
}

static cJSON *chat_lp_entry(const struct md_engine *eng, const struct md_oai_lp *e)
{
	cJSON *o = cJSON_CreateObject();
	token_strings(eng, e->token, o, "token", true);
	cJSON_AddNumberToObject(o, "logprob", e->logprob);
	cJSON *tops = cJSON_AddArrayToObject(o, "top_logprobs");
	for (int i = 0; i < e->n_top; i++) {
		cJSON *t = cJSON_CreateObject();
		token_strings(eng, e->top_id[i], t, "token", true);
		cJSON_AddNumberToObject(t, "logprob", e->top_lp[i]);
		cJSON_AddItemToArray(tops, t);
	}
	return o;
}

/* Legacy completions logprobs: one token into the four parallel arrays. */
static void legacy_lp_append(const struct md_engine *eng, cJSON *lp, const struct md_oai_lp *e,
			     size_t offset)
{
	cJSON *tok = cJSON_CreateObject();
	token_strings(eng, e->token, tok, "t", false);
	cJSON_AddItemToArray(cJSON_GetObjectItem(lp, "tokens"),
			     cJSON_CreateString(cJSON_GetObjectItem(tok, "t")->valuestring));
	cJSON_Delete(tok);
	cJSON_AddItemToArray(cJSON_GetObjectItem(lp, "token_logprobs"),
			     cJSON_CreateNumber(e->logprob));
	cJSON *tops = cJSON_CreateObject();
	for (int i = 0; i < e->n_top; i++) {
		cJSON *t = cJSON_CreateObject();
		token_strings(eng, e->top_id[i], t, "t", false);
		const char *k = cJSON_GetObjectItem(t, "t")->valuestring;
		if (!cJSON_GetObjectItemCaseSensitive(tops, k))
			cJSON_AddNumberToObject(tops, k, e->top_lp[i]);
		cJSON_Delete(t);
	}
	cJSON_AddItemToArray(cJSON_GetObjectItem(lp, "top_logprobs"), tops);
	cJSON_AddItemToArray(cJSON_GetObjectItem(lp, "text_offset"),
			     cJSON_CreateNumber((double)offset));
}

void md_oai_logprobs_add(cJSON *lp, bool chat, const struct md_engine *eng,
			 const struct md_oai_lp *e, size_t text_offset)
{
	if (!lp)
		return;
	if (chat)
		cJSON_AddItemToArray(cJSON_GetObjectItem(lp, "content"), chat_lp_entry(eng, e));
	else
		legacy_lp_append(eng, lp, e, text_offset);
}
