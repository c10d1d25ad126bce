/* Chat and text completions: the generations in flight, from engine submit to the last byte. */
#ifndef MD_GEN_H
#define MD_GEN_H

/*
 * DESIGN
 * A generation is one completions request: n choices per prompt, each one engine request
 * (by id, never by pointer). Requests reach it read and tokenized by server/request.h. This module owns what lives as long as generations do: the map
 * from engine request id to choice, the list of generations in flight and the generation
 * counters of /metrics. api.c hands it parsed JSON bodies and engine events; it answers
 * through server/oai.h and never calls back into api.c.
 *
 * Each choice's output runs down a chain of stages, one function each in gen.c:
 *   detokenize (md_engine_detok: complete UTF-8 only; NUL bytes become U+FFFD)
 *   -> stop strings (server/stop.h: text that could still begin a stop string is held)
 *   -> tool calls (a slot: passes text through today; a parser that turns the model's tool
 *      calls into OpenAI tool_calls takes its text here)
 *   -> emit (an SSE chunk when streaming, else appended to the whole response).
 * Logprob entries travel with the text of their token.
 *
 * Lifetime: a generation is referenced by its connection (the abort callback) and, while a
 * function of this module works on it, by a count (refs). The client going away (abort)
 * marks it dead and cancels its engine requests; it is freed when dead and unreferenced.
 * Any write to the client may close the connection and run the abort callback at once, so
 * every path that writes holds a reference across the write.
 *
 * Everything here runs on the loop thread (asserted).
 */

#include <cjson/cJSON.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "engine/engine.h"
#include "server/config.h"
#include "server/metrics.h"
#include "server/oai.h"

struct md_gen_ctx; /* opaque */

/* eng, cfg and loop are borrowed for the context's lifetime (loop: where long prompts are
 * tokenized, server/request.h). Returns 0 or -ENOMEM. */
int md_gen_ctx_new(struct md_gen_ctx **out, struct md_engine *eng, const struct md_config *cfg,
		   uv_loop_t *loop);
/* Frees the context; generations still in flight must have ended (md_gen_n_active() == 0)
 * or their connections be closed already. */
void md_gen_ctx_free(struct md_gen_ctx *x);

/* The served model, once loaded: its id in the API, context length and vocabulary size. */
void md_gen_set_model(struct md_gen_ctx *x, const char *name, uint32_t n_ctx, uint32_t n_vocab);

/* Serve POST /v1/chat/completions or /v1/completions: body (a JSON object) is consumed; *o is
 * copied. The request is read (server/request.h), its prompts tokenized (off the loop thread
 * when long), then answered with an error or by the generation, always through o. */
void md_gen_chat(struct md_gen_ctx *x, const struct md_oai_reply *o, cJSON *body);
void md_gen_completion(struct md_gen_ctx *x, const struct md_oai_reply *o, cJSON *body);

/* One engine event (MD_EV_TOKEN or MD_EV_DONE); events of unknown ids are dropped. */
void md_gen_on_event(struct md_gen_ctx *x, const struct md_engine_event *ev);

/* Generations in flight, and requests on their way to one (being tokenized). */
size_t md_gen_n_active(const struct md_gen_ctx *x);
/* Cancel every in-flight engine request (end of the drain grace period); each generation then
 * ends with finish_reason "abort". */
void md_gen_cancel_all(struct md_gen_ctx *x);
/* The generation counters, for /metrics. */
const struct md_metrics_gen *md_gen_metrics(const struct md_gen_ctx *x);

#endif
