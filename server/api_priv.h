/* Internals shared by the API modules (api.c: routing and small endpoints; gen.c: generation). */
#ifndef MD_API_PRIV_H
#define MD_API_PRIV_H

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>

#include "server/api.h"
#include "server/metrics.h"

struct md_gen_choice;

struct md_api {
	struct md_engine *eng;        /* borrowed */
	struct md_config *cfg;        /* borrowed */
	struct md_http_server *http;  /* borrowed, may be NULL */
	md_api_state_cb state_cb;
	void *state_arg;              /* borrowed */
	enum md_engine_state state;   /* as last seen on the loop thread */
	bool draining;
	char allow[16];               /* Allow header of the 405 being answered */
	struct md_metrics metrics;
	char model_name[256];
	uint32_t n_ctx, n_vocab;
	time_t started;
	uint64_t next_eng_id;
	/* engine request id -> choice, open addressing with linear probing */
	struct md_api_slot { uint64_t id; struct md_gen_choice *ch; } *map; /* owned (map_cap) */
	size_t map_cap, map_n;
	struct md_gen *gens;          /* borrowed list heads: in-flight generations */
	size_t n_gens;
};

/* Send an OpenAI error object and end the request. param may be NULL. */
void md__api_error(struct md_api *a, struct md_http_conn *c, struct md_http_req *r, int status,
		   const char *type, const char *param, const char *code, const char *fmt, ...)
	__attribute__((format(printf, 8, 9)));
/* Send a JSON document (consumed) and end the request. */
void md__api_json(struct md_api *a, struct md_http_conn *c, struct md_http_req *r, int status,
		  cJSON *doc, const char *extra_headers);
/* Access log line + status metric for a request about to end. */
void md__api_account(struct md_api *a, struct md_http_req *r, int status, unsigned in,
		     unsigned out, double ttft);

bool md__utf8_valid(const char *s, size_t n);
/* Copy n bytes as valid UTF-8 (ill-formed bytes become U+FFFD) into a malloc'd string. */
char *md__utf8_sanitize(const char *s, size_t n);

/* id map */
int md__map_put(struct md_api *a, uint64_t id, struct md_gen_choice *ch);
struct md_gen_choice *md__map_get(struct md_api *a, uint64_t id);
void md__map_del(struct md_api *a, uint64_t id);

/* gen.c */
void md__gen_chat(struct md_api *a, struct md_http_conn *c, struct md_http_req *r, cJSON *body);
void md__gen_completion(struct md_api *a, struct md_http_conn *c, struct md_http_req *r,
			cJSON *body);
void md__gen_on_event(struct md_api *a, struct md_engine_event *ev);
void md__gen_cancel_all(struct md_api *a);

/* Parameter helpers: return 0 (absent or null: *present false), 1 (set), or -1 after
 * answering 400 naming param. */
int md__param_number(struct md_api *a, struct md_http_conn *c, struct md_http_req *r,
		     cJSON *obj, const char *name, double lo, double hi, bool lo_open, double *out);
int md__param_int(struct md_api *a, struct md_http_conn *c, struct md_http_req *r, cJSON *obj,
		  const char *name, int64_t lo, int64_t hi, int64_t *out);
int md__param_bool(struct md_api *a, struct md_http_conn *c, struct md_http_req *r, cJSON *obj,
		   const char *name, bool *out);
/* Check the "model" field: absent or the served name. Returns 0 or -1 after answering 404. */
int md__check_model(struct md_api *a, struct md_http_conn *c, struct md_http_req *r, cJSON *obj);
/* Parse the chat "messages" array into msgs (borrowing strings from body; joined text parts
 * are malloc'd into *owned). Returns the count or -1 after answering 400. */
int md__parse_messages(struct md_api *a, struct md_http_conn *c, struct md_http_req *r,
		       cJSON *body, struct md_engine_msg **msgs, char ***owned, size_t *n_owned);
void md__free_messages(struct md_engine_msg *msgs, char **owned, size_t n_owned);

#endif
