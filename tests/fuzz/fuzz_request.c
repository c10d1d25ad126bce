/* libFuzzer target for the JSON request path: a request body through moed's parsing into a
 * validated generation request, as server/gen.c does it: the body as UTF-8 JSON, every
 * parameter through request.c's table (md_req_parse_params), chat messages through the model's
 * chat template into token ids, completion prompts in their four forms into token ids.
 * Every request must be answered exactly once (400/404 naming the problem, or 200 here where
 * gen.c would submit to the engine), and token ids must be in the vocabulary. The body rides
 * a real HTTP request on the real server; the engine holds the default model (tokenizer and
 * template), loaded once. The input's first byte picks the endpoint: odd chat, even
 * completions. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "engine/engine.h"
#include "server/oai.h"
#include "server/request.h"
#include "tests/fuzz/http_harness.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static struct md_engine *eng;
static struct md_req_limits lim;

static void no_wake(void *arg)
{
}

static void load_engine(void)
{
	md_log_setup(MD_LOG_ERROR, false);
	const char *model = getenv("MOED_FUZZ_MODEL");
#ifdef MOED_FUZZ_MODEL_PATH
	if (!model)
		model = MOED_FUZZ_MODEL_PATH;
#endif
	if (!model) {
		fprintf(stderr, "fuzz_request: set MOED_FUZZ_MODEL to a GGUF model\n");
		exit(1);
	}
	struct md_engine_config ec = {
		.model_path = model, .n_threads = 1, .n_ctx = 0, .kv_mem_mb = 8, .max_seqs = 1,
		.step_tokens = 64, .max_queue = 1,
	};
	if (md_engine_new(&eng, &ec, no_wake, NULL) || md_engine_start(eng))
		abort();
	while (md_engine_state(eng) == MD_ENGINE_LOADING)
		usleep(1000);
	if (md_engine_state(eng) != MD_ENGINE_READY) {
		fprintf(stderr, "fuzz_request: cannot load '%s': %s\n", model, md_engine_error(eng));
		exit(1);
	}
	lim = (struct md_req_limits){ .model_name = "fuzz", .max_tokens_cap = 4096,
				      .n_vocab = md_engine_n_vocab(eng) };
}

static void check_ids(const int32_t *ids, int n)
{
	for (int i = 0; i < n; i++)
		if (ids[i] < 0 || (uint32_t)ids[i] >= lim.n_vocab)
			abort();
}

/* As api.c's parse_body: valid UTF-8, one JSON value (trailing whitespace allowed), an object. */
static cJSON *parse_body(const struct md_oai_reply *o, const struct md_http_req *r)
{
	const char *end = NULL;
	cJSON *body = NULL;
	if (r->body_len && md_oai_utf8_valid(r->body, r->body_len))
		body = cJSON_ParseWithLengthOpts(r->body, r->body_len, &end, false);
	if (body && end) {
		while (end < r->body + r->body_len && strchr(" \n\r\t", *end) && *end)
			end++;
		if (end != r->body + r->body_len) {
			cJSON_Delete(body);
			body = NULL;
		}
	}
	if (body && !cJSON_IsObject(body)) {
		cJSON_Delete(body);
		body = NULL;
	}
	if (!body)
		md_oai_error(o, 400, "invalid_request_error", NULL, NULL, "bad body");
	return body;
}

static void handle(struct md_http_conn *c, struct md_http_req *r)
{
	struct md_oai_reply o = { .c = c, .r = r, .retry_after = 1 };
	bool chat = strcmp(r->path, "/c") == 0;
	cJSON *body = parse_body(&o, r);
	if (!body)
		goto answered;
	/* as gen.c: the request read whole (body consumed), then tokenized (here on this thread) */
	struct md_request *rq = md_request_new(&o, &lim, body, chat ? MD_REQ_CHAT : MD_REQ_COMPLETIONS);
	if (!rq)
		goto answered;
	if (rq->p.n < 1 || rq->p.n > MD_REQ_MAX_N || rq->p.n_stops > MD_REQ_MAX_STOPS)
		abort();
	if (md_request_tokenize(rq, eng) != 0) {
		md_request_answer(rq, &o);
	} else {
		if (rq->pr.n == 0 || rq->pr.n > MD_REQ_MAX_CHOICES)
			abort();
		for (size_t i = 0; i < rq->pr.n; i++) {
			if (!chat && rq->pr.lens[i] == 0)
				abort();
			check_ids(rq->pr.ids[i], (int)rq->pr.lens[i]);
		}
		md_http_respond(c, 200, "application/json", NULL, "{}", 2);
	}
	md_request_free(rq);
answered:
	if (md_http_status(c) == 0) {
		fprintf(stderr, "fuzz_request: a request left unanswered\n");
		abort();
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static int ready;
	if (!ready) {
		load_engine();
		md_fz_init(handle, 1 << 20, 4096);
		ready = 1;
	}
	if (size == 0)
		return 0;
	/* harness mode byte 0: one piece, no half-close */
	static char req[(1 << 20) + 256];
	size_t n = size - 1 < (1 << 20) ? size - 1 : (1 << 20);
	int h = snprintf(req, 256, "%cPOST /%c HTTP/1.1\r\nContent-Type: application/json\r\n"
			 "Content-Length: %zu\r\n\r\n", 0, (data[0] & 1) ? 'c' : 'p', n);
	memcpy(req + h, data + 1, n);
	md_fz_run((const uint8_t *)req, (size_t)h + n);
	return 0;
}
