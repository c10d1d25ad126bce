/* OpenAI wire format: replies and error objects, request parameters, messages, chunks. */
#ifndef MD_OAI_H
#define MD_OAI_H

/*
 * DESIGN
 * The bottom of the server's request path: api.c (routes) -> gen.c (generations) ->
 * request.c (reading requests) -> this module -> engine/engine.h. It knows the OpenAI formats
 * and nothing of routes, requests or in-flight generations: it sends replies (JSON documents
 * and error objects, each counted and logged once) and builds the chunks and documents of
 * streamed and whole responses. Nothing here calls back up. Loop thread only (cJSON,
 * connections).
 */

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"
#include "server/http.h"
#include "server/metrics.h"

/* ---- replies ---- */

/* Where a reply goes and what it is counted against. */
struct md_oai_reply {
	struct md_http_conn *c;       /* borrowed: the connection answering r */
	struct md_http_req *r;        /* borrowed: valid while c is */
	struct md_metrics_http *http; /* borrowed: status counter, may be NULL */
	int64_t retry_after;          /* seconds, sent with 429 and 503 */
	const char *allow;            /* borrowed, may be NULL: the Allow header of a 405 */
};

/* Access log line and status counter for a request about to end. */
void md_oai_account(const struct md_oai_reply *o, int status, unsigned tokens_in,
		    unsigned tokens_out, double ttft);
/* Send doc (consumed; NULL or unprintable gives a 500 error object) and end the request.
 * extra_headers: "Name: value\r\n" lines or NULL. */
void md_oai_json(const struct md_oai_reply *o, int status, cJSON *doc, const char *extra_headers);
/* Send {"error":{message,type,param,code}} and end the request; param and code may be NULL.
 * 429 and 503 carry Retry-After, 401 WWW-Authenticate, 405 Allow (when o->allow is set). */
void md_oai_error(const struct md_oai_reply *o, int status, const char *type, const char *param,
		  const char *code, const char *fmt, ...) __attribute__((format(printf, 6, 7)));
/* The error object alone (for an error event inside a stream). */
cJSON *md_oai_error_doc(const char *message, const char *type);

/* ---- UTF-8 ---- */

bool md_oai_utf8_valid(const char *s, size_t n);
/* Copy n bytes as valid UTF-8 (ill-formed bytes become U+FFFD) into a malloc'd string, or
 * NULL when out of memory. */
char *md_oai_utf8_sanitize(const char *s, size_t n);

/* ---- response documents and chunks ---- */

/* What every chunk and response of one generation repeats. */
struct md_oai_ident {
	const char *id;     /* borrowed: "chatcmpl-..." or "cmpl-..." */
	const char *model;  /* borrowed */
	long created;
	bool chat;
};

/* Write a fresh response id with the prefix into out. */
void md_oai_make_id(char *out, size_t cap, const char *prefix);

/* A chunk (or, with whole true, a complete response) with an empty "choices" array, returned
 * in *choices. NULL when out of memory. */
cJSON *md_oai_doc_new(const struct md_oai_ident *id, bool whole, cJSON **choices);
/* Chunk choices: the chat role announcement, a piece of text (with its logprobs object,
 * consumed, or NULL for null) and the finish. */
cJSON *md_oai_choice_role(uint32_t index);
cJSON *md_oai_choice_delta(const struct md_oai_ident *id, uint32_t index, const char *text,
			   size_t len, cJSON *logprobs);
cJSON *md_oai_choice_finish(const struct md_oai_ident *id, uint32_t index, const char *reason);
/* A chunk choice carrying a piece of reasoning: {"delta":{"reasoning_content": ...}}, as
 * llama.cpp's server and vLLM stream a reasoning model's thinking. */
cJSON *md_oai_choice_reasoning_delta(uint32_t index, const char *text, size_t len);
/* Give a whole chat response's choice message.reasoning_content (null when empty). */
void md_oai_choice_set_reasoning(cJSON *choice, const char *text);
/* A whole response's choice: text, logprobs (consumed, NULL for null), finish reason. */
cJSON *md_oai_choice_whole(const struct md_oai_ident *id, uint32_t index, const char *text,
			   cJSON *logprobs, const char *reason);
cJSON *md_oai_usage(uint32_t prompt_tokens, uint32_t completion_tokens, uint32_t cached_tokens);
/* One tool call of a whole response: {"id","type":"function","function":{"name","arguments"}}. */
cJSON *md_oai_tool_call(const char *id, const char *name, const char *arguments);
/* A chunk choice carrying one tool-call delta: the call's start (id and name set, arguments
 * "") or a piece of its arguments (id and name NULL), as OpenAI streams them. logprobs is
 * consumed (NULL for null). */
cJSON *md_oai_choice_tool_delta(uint32_t index, int call_index, const char *id, const char *name,
				const char *args, size_t args_len, cJSON *logprobs);
/* Give a whole response's choice its tool calls (calls consumed): content becomes null when
 * it is empty, as OpenAI answers a call without text. */
void md_oai_choice_set_tool_calls(cJSON *choice, cJSON *calls);
/* Frame doc (consumed) as one SSE event "data: <json>\n\n" in a malloc'd *out. Returns the
 * length, or -ENOMEM (nothing allocated). */
long md_oai_sse_event(cJSON *doc, char **out);

/* One token's logprob data. */
struct md_oai_lp {
	int32_t token;
	float logprob;
	uint8_t n_top;
	int32_t top_id[MD_ENGINE_MAX_TOP];
	float top_lp[MD_ENGINE_MAX_TOP];
};

/* An empty logprobs object: {"content":[]} for chat, the four parallel arrays of legacy
 * completions otherwise. */
cJSON *md_oai_logprobs_new(bool chat);
/* Append one token (text_offset: where its text starts in the choice, legacy only). */
void md_oai_logprobs_add(cJSON *lp, bool chat, const struct md_engine *eng,
			 const struct md_oai_lp *e, size_t text_offset);

#endif
