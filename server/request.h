/* Reading requests: the parameter table, chat messages, completion prompts, and a request
 * object whose prompts are tokenized off the loop thread when they are long. */
#ifndef MD_REQUEST_H
#define MD_REQUEST_H

/*
 * DESIGN
 * The one module that reads a request, for every endpoint: api.c (routes) and gen.c
 * (generations) call it, it calls server/oai.h (error replies) and the engine's text helpers;
 * nothing here calls back up. Parameters go through one table (request.c `params[]`: one row
 * per parameter with its JSON name, type, range, target field and the endpoints that accept
 * it); chat messages and completion prompts have their readers.
 *
 * struct md_request is a chat or completions (or /tokenize) request read whole: it owns the
 * body, which its messages and prompt texts borrow, and ends with the prompts as token ids.
 * Rendering a chat template and tokenizing are the request's only heavy work before the
 * engine: a 100k-character prompt takes tens of milliseconds, during which a loop thread could
 * serve nothing. md_request_tokenize_then does it at once for short prompts (a thread hop
 * costs more than it saves) and otherwise on libuv's thread pool (uv_queue_work: the engine's
 * text helpers are immutable after load and callable from any thread), then hands the request
 * back on the loop thread. While it is away the connection's abort callback is the request's,
 * so a client that leaves is noticed and the result dropped. A worker was chosen over the
 * engine thread so that prefill of other requests never waits behind tokenization.
 *
 * Loop thread only, except md_request_tokenize (any thread, touching only the request).
 */

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "engine/engine.h"
#include "server/oai.h"
#include "server/tools.h"

/* ---- request parameters ---- */

enum md_req_endpoint {
	MD_REQ_CHAT = 1 << 0,        /* POST /v1/chat/completions */
	MD_REQ_COMPLETIONS = 1 << 1, /* POST /v1/completions */
	MD_REQ_TOKENIZE = 1 << 2,    /* POST /tokenize */
	MD_REQ_DETOKENIZE = 1 << 3,  /* POST /detokenize */
};

/* What parameter checks depend on besides the request. */
struct md_req_limits {
	const char *model_name;  /* borrowed: the served model id */
	int64_t max_tokens_cap;  /* largest max_tokens accepted */
	uint32_t n_vocab;        /* token ids are in [0, n_vocab) */
	bool has_draft;          /* a draft model is loaded ("speculative": {"drafter": "draft"}) */
	bool has_self;           /* self-speculation is available ({"drafter": "self"}) */
	int tool_format;         /* md_engine_tool_format(): how forced tool calls are written */
	int tool_text;           /* md_engine_tool_text(): the form of each tool's text */
};

#define MD_REQ_MAX_N 64          /* choices per prompt */
#define MD_REQ_MAX_CHOICES 256   /* choices per request (prompts times n) */
#define MD_REQ_MAX_STOPS 16
#define MD_REQ_MAX_STOP_LEN 512

/* Every request parameter moed reads, after parsing; defaults where absent. */
struct md_req_params {
	struct md_sampling s;        /* owns its logit_bias array */
	int64_t max_tokens;          /* valid when max_set */
	bool max_set;
	int64_t n;                   /* choices per prompt, 1..MD_REQ_MAX_N */
	bool stream, include_usage, ignore_eos;
	char **stops;                /* owned (n_stops): non-empty stop strings */
	size_t n_stops;
	bool want_lp;                /* logprobs asked */
	bool want_ids;               /* "return_token_ids" (vLLM's extension): the prompt's and
				      * each choice's token ids in the response (not streamed) */
	int lp_top;                  /* alternatives per token (0..MD_ENGINE_MAX_TOP) */
	bool add_special, with_pieces; /* /tokenize */
	struct md_grammar *grammar;  /* owned reference, or NULL: from response_format (json_object,
				      * json_schema), moed's raw "grammar" extension, or forced tool
				      * calls (tool_choice required or named) */
	struct md_tools tools;       /* tools, tool_choice, parallel_tool_calls (chat) */
	struct md_spec_opts spec;    /* moed extension "speculative" (zero: the server's) */
	const char *reasoning_effort; /* static: "low", "medium" or "high" (chat), NULL: absent */
	/* raw values, combined into the fields above once every row is read */
	int64_t _top_k, _seed, _lp_n, _top_lp;
	bool _lp_on, _lp_n_set, _top_lp_set;
};

/* Read the parameters endpoint accepts from body (a JSON object) into p, checking each
 * (type, range, cross-field rules). Unknown keys are ignored. Returns 0, or -1 after
 * answering 400/404 (naming the parameter) or 500; p must be released either way. */
int md_req_parse_params(const struct md_oai_reply *o, const struct md_req_limits *lim,
			cJSON *body, enum md_req_endpoint endpoint, struct md_req_params *p);
void md_req_params_release(struct md_req_params *p);

/* ---- chat messages ---- */

/* Chat "messages" parsed for md_engine_chat_tokenize: strings are borrowed from the request
 * body, except joined content parts and tool-call arguments given as objects, which are owned
 * here. Roles: system (and developer), user, assistant (with tool_calls), tool. */
struct md_req_msgs {
	struct md_engine_msg *msgs;  /* owned (n) */
	size_t n;
	char **owned;                /* owned (n_owned) */
	size_t n_owned;
	struct md_engine_tool_call *calls; /* owned: every assistant message's tool calls */
};

/* Returns 0, or -1 after answering 400 (naming the message) or 500; m is empty then. */
int md_req_parse_messages(const struct md_oai_reply *o, cJSON *body, struct md_req_msgs *m);
void md_req_msgs_release(struct md_req_msgs *m);

/* ---- completion prompts ---- */

/* The prompts of a request as token ids: a completions request's, or a chat's one. */
struct md_req_prompts {
	int32_t *ids[MD_REQ_MAX_CHOICES];  /* owned: (lens[i]) each; NULL while text[i] waits */
	uint32_t lens[MD_REQ_MAX_CHOICES];
	const char *text[MD_REQ_MAX_CHOICES]; /* borrowed from the body: prompt i as text, to be
					       * tokenized (md_request_tokenize), or NULL */
	size_t n;
};

/* Read "prompt" in its four forms ("text", ["text", ...], [id, ...], [[id, ...], ...]): ids
 * now, texts kept for md_request_tokenize. Returns 0, or -1 after answering 400 or 500; out
 * must be released either way. */
int md_req_parse_prompts(const struct md_oai_reply *o, const struct md_req_limits *lim,
			 cJSON *body, struct md_req_prompts *out);
void md_req_prompts_release(struct md_req_prompts *pr);

/* ---- a request read whole ---- */

/* Prompts shorter than this (bytes of text to render and tokenize) are tokenized at once on
 * the loop thread: ~0.2 ms of work. */
#define MD_REQ_INLINE_BYTES 16384

struct md_request {
	enum md_req_endpoint ep;
	cJSON *body;                 /* owned: messages and prompt texts borrow from it */
	struct md_req_params p;
	struct md_req_msgs m;        /* chat (and /tokenize with messages) */
	struct md_req_prompts pr;    /* the prompts as ids once tokenized (a chat's in pr.ids[0]) */
	bool add_special;            /* /tokenize: BOS where the model wants one */
	/* md_request_tokenize's outcome: 0, or the failure to answer (md_request_answer) */
	int tok_rc;
	/* the libuv hand-off (md_request_tokenize_then) */
	uv_work_t _work;
	const struct md_engine *_eng;
	struct md_oai_reply _o;
	void (*_done)(void *arg, struct md_request *r, const struct md_oai_reply *o);
	void *_arg;
	bool _gone;                  /* the client went away meanwhile */
};

/* Read body (consumed, whatever happens) as a request to ep: parameters, then messages (chat;
 * /tokenize with "messages") or prompts (completions; /tokenize's "content" or "prompt").
 * Returns the request, or NULL after answering (400, 404, 500). */
struct md_request *md_request_new(const struct md_oai_reply *o, const struct md_req_limits *lim,
				  cJSON *body, enum md_req_endpoint ep);
void md_request_free(struct md_request *r);
/* Bytes of text that tokenizing will go through. */
size_t md_request_text_bytes(const struct md_request *r);
/* Render (chat) and tokenize every prompt given as text. Any thread; touches r and eng's
 * immutable text side only. Returns r->tok_rc: 0, or -ENOTSUP / -EINVAL (the template refuses
 * tools or messages), -ENODATA (an empty prompt), -ENOMEM, another negative code. */
int md_request_tokenize(struct md_request *r, const struct md_engine *eng);
/* Answer the failure md_request_tokenize returned (400 or 500). */
void md_request_answer(const struct md_request *r, const struct md_oai_reply *o);

/* Tokenize r, at once or on loop's thread pool (see DESIGN), then call done(arg, r, o) on the
 * loop thread: o is the reply to answer through, or NULL when the client went away meanwhile
 * (nothing to answer; its connection is gone). done owns r from then on. While r is away the
 * connection's handler is r's; done must set its own (md_http_set_handler) if it keeps the
 * request open. */
void md_request_tokenize_then(struct md_request *r, uv_loop_t *loop, const struct md_engine *eng,
			      const struct md_oai_reply *o,
			      void (*done)(void *arg, struct md_request *r,
					   const struct md_oai_reply *o),
			      void *arg);

#endif
