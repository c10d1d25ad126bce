/* OpenAI wire format: replies and error objects, request parameters, messages, chunks. */
#ifndef MD_OAI_H
#define MD_OAI_H

/*
 * DESIGN
 * The bottom of the server's request path: api.c (routes) -> gen.c (generations) -> this
 * module -> engine/engine.h. It knows the OpenAI formats and nothing of routes or in-flight
 * generations: it sends replies (JSON documents and error objects, each counted and logged
 * once), reads request parameters through one table (oai.c `params[]`: one row per
 * parameter with its JSON name, type, range, target field and the endpoints that accept it),
 * parses chat messages and builds the chunks and documents of streamed and whole responses.
 * Nothing here calls back up. Loop thread only (cJSON, connections).
 */

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"
#include "server/http.h"
#include "server/metrics.h"
#include "server/tools.h"

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

/* ---- request parameters ---- */

enum md_oai_endpoint {
	MD_OAI_CHAT = 1 << 0,        /* POST /v1/chat/completions */
	MD_OAI_COMPLETIONS = 1 << 1, /* POST /v1/completions */
	MD_OAI_TOKENIZE = 1 << 2,    /* POST /tokenize */
	MD_OAI_DETOKENIZE = 1 << 3,  /* POST /detokenize */
};

/* What parameter checks depend on besides the request. */
struct md_oai_limits {
	const char *model_name;  /* borrowed: the served model id */
	int64_t max_tokens_cap;  /* largest max_tokens accepted */
	uint32_t n_vocab;        /* token ids are in [0, n_vocab) */
	bool has_draft;          /* a draft model is loaded ("speculative": {"drafter": "draft"}) */
	bool has_self;           /* self-speculation is available ({"drafter": "self"}) */
	int tool_format;         /* md_engine_tool_format(): how forced tool calls are written */
};

#define MD_OAI_MAX_N 64          /* choices per prompt */
#define MD_OAI_MAX_CHOICES 256   /* choices per request (prompts times n) */
#define MD_OAI_MAX_STOPS 16
#define MD_OAI_MAX_STOP_LEN 512

/* Every request parameter moed reads, after parsing; defaults where absent. */
struct md_oai_params {
	struct md_sampling s;        /* owns its logit_bias array */
	int64_t max_tokens;          /* valid when max_set */
	bool max_set;
	int64_t n;                   /* choices per prompt, 1..MD_OAI_MAX_N */
	bool stream, include_usage, ignore_eos;
	char **stops;                /* owned (n_stops): non-empty stop strings */
	size_t n_stops;
	bool want_lp;                /* logprobs asked */
	int lp_top;                  /* alternatives per token (0..MD_ENGINE_MAX_TOP) */
	bool add_special, with_pieces; /* /tokenize */
	struct md_grammar *grammar;  /* owned reference, or NULL: from response_format (json_object,
				      * json_schema), moed's raw "grammar" extension, or forced tool
				      * calls (tool_choice required or named) */
	struct md_tools tools;       /* tools, tool_choice, parallel_tool_calls (chat) */
	struct md_spec_opts spec;    /* moed extension "speculative" (zero: the server's) */
	/* raw values, combined into the fields above once every row is read */
	int64_t _top_k, _seed, _lp_n, _top_lp;
	bool _lp_on, _lp_n_set, _top_lp_set;
};

/* Read the parameters endpoint accepts from body (a JSON object) into p, checking each
 * (type, range, cross-field rules). Unknown keys are ignored. Returns 0, or -1 after
 * answering 400/404 (naming the parameter) or 500; p must be released either way. */
int md_oai_parse_params(const struct md_oai_reply *o, const struct md_oai_limits *lim,
			cJSON *body, enum md_oai_endpoint endpoint, struct md_oai_params *p);
void md_oai_params_release(struct md_oai_params *p);

/* ---- chat messages ---- */

/* Chat "messages" parsed for md_engine_chat_tokenize: strings are borrowed from the request
 * body, except joined content parts and tool-call arguments given as objects, which are owned
 * here. Roles: system (and developer), user, assistant (with tool_calls), tool. */
struct md_oai_msgs {
	struct md_engine_msg *msgs;  /* owned (n) */
	size_t n;
	char **owned;                /* owned (n_owned) */
	size_t n_owned;
	struct md_engine_tool_call *calls; /* owned: every assistant message's tool calls */
};

/* Returns 0, or -1 after answering 400 (naming the message) or 500; m is empty then. */
int md_oai_parse_messages(const struct md_oai_reply *o, cJSON *body, struct md_oai_msgs *m);
void md_oai_msgs_release(struct md_oai_msgs *m);

/* ---- completion prompts ---- */

/* The prompts of a completions request as token ids. */
struct md_oai_prompts {
	int32_t *ids[MD_OAI_MAX_CHOICES];  /* owned: (lens[i]) each */
	uint32_t lens[MD_OAI_MAX_CHOICES];
	size_t n;
};

/* Read "prompt" in its four forms ("text", ["text", ...], [id, ...], [[id, ...], ...]),
 * tokenizing text with eng. Returns 0 (every prompt non-empty), or -1 after answering 400 or
 * 500; out must be released either way. */
int md_oai_parse_prompts(const struct md_oai_reply *o, const struct md_engine *eng,
			 const struct md_oai_limits *lim, cJSON *body, struct md_oai_prompts *out);
void md_oai_prompts_release(struct md_oai_prompts *pr);

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
