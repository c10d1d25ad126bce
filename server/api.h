/* OpenAI-compatible API: routing, auth and the small endpoints; generation is server/gen.h. */
#ifndef MD_API_H
#define MD_API_H

/*
 * DESIGN
 * The top of the server's request path: api.c (routes, auth, /health, /metrics, /v1/models,
 * /tokenize, /detokenize) -> gen.c (completions in flight) -> request.c (reading requests,
 * tokenizing long prompts off the loop) -> oai.c (wire format) -> engine/engine.h. Calls go
 * down only. The api owns the generation context and the HTTP
 * status counters, and drains engine events (state changes here, tokens to gen.c). Loop
 * thread only (asserted at the entry points).
 */

#include <stdbool.h>
#include <stddef.h>
#include <uv.h>

#include "engine/engine.h"
#include "server/config.h"
#include "server/http.h"

struct md_api; /* opaque; lives on the loop thread */

typedef void (*md_api_state_cb)(void *arg, enum md_engine_state st);

/* eng, cfg and loop (the one serving: long prompts are tokenized on its thread pool) are
 * borrowed for the api's lifetime. Returns 0 or -ENOMEM. */
int md_api_new(struct md_api **out, struct md_engine *eng, struct md_config *cfg,
	       uv_loop_t *loop);
void md_api_free(struct md_api *a);
void md_api_set_http(struct md_api *a, struct md_http_server *http);
void md_api_set_state_cb(struct md_api *a, md_api_state_cb cb, void *arg);

/* The md_http_request_cb to give the HTTP server (arg: the api). */
void md_api_on_request(void *arg, struct md_http_conn *c, struct md_http_req *r);
/* Drain engine events; call from the uv_async_t callback. */
void md_api_on_engine_events(struct md_api *a);

/* Draining: /health says 503, new generation requests get 503. */
void md_api_set_draining(struct md_api *a);
/* Generation requests still in flight. */
size_t md_api_n_active(const struct md_api *a);
/* Cancel every in-flight generation (end of the grace period). */
void md_api_cancel_all(struct md_api *a);

#endif
