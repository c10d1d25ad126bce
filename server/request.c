/* Reading requests: the parameter table, chat messages, completion prompts, and a request
 * object whose prompts are tokenized off the loop thread when they are long. */
#include "server/request.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/assert.h"
#include "common/log.h"
#include "server/json_schema.h"

static void bad_request(const struct md_oai_reply *o, const char *param, const char *msg)
{
	md_oai_error(o, 400, "invalid_request_error", param, NULL, "%s", msg);
}

static void out_of_memory(const struct md_oai_reply *o)
{
	md_oai_error(o, 500, "server_error", NULL, NULL, "out of memory");
}

/* ---- parameter readers: 0 absent or null, 1 read, -1 after answering 400 ---- */

static int read_number(const struct md_oai_reply *o, cJSON *it, const char *name, double lo,
		       double hi, bool lo_open, double *out)
{
	if (!it || cJSON_IsNull(it))
		return 0;
	if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble)) {
		md_oai_error(o, 400, "invalid_request_error", name, "invalid_type",
			     "'%s' must be a number", name);
		return -1;
	}
	double v = it->valuedouble;
	if (v < lo || v > hi || (lo_open && v == lo)) {
		md_oai_error(o, 400, "invalid_request_error", name, "invalid_value",
			     "'%s' must be in %s%g, %g], got %g", name, lo_open ? "(" : "[", lo, hi, v);
		return -1;
	}
	*out = v;
	return 1;
}

static int read_int(const struct md_oai_reply *o, cJSON *it, const char *name, int64_t lo,
		    int64_t hi, int64_t *out)
{
	if (!it || cJSON_IsNull(it))
		return 0;
	if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble) ||
	    it->valuedouble != floor(it->valuedouble)) {
		md_oai_error(o, 400, "invalid_request_error", name, "invalid_type",
			     "'%s' must be an integer", name);
		return -1;
	}
	double v = it->valuedouble;
	if (v < (double)lo || v > (double)hi) {
		md_oai_error(o, 400, "invalid_request_error", name, "invalid_value",
			     "'%s' must be in [%lld, %lld], got %.15g", name, (long long)lo,
			     (long long)hi, v);
		return -1;
	}
	*out = (int64_t)v;
	return 1;
}

static int read_bool(const struct md_oai_reply *o, cJSON *it, const char *name, bool *out)
{
	if (!it || cJSON_IsNull(it))
		return 0;
	if (!cJSON_IsBool(it)) {
		md_oai_error(o, 400, "invalid_request_error", name, "invalid_type",
			     "'%s' must be a boolean", name);
		return -1;
	}
	*out = cJSON_IsTrue(it);
	return 1;
}

/* ---- the parameter table ---- */

struct param;

/* What a custom parser sees. */
struct pctx {
	const struct md_oai_reply *o;
	const struct md_req_limits *lim;
	struct md_req_params *p;
};

/* Parses one parameter's value (it: never NULL, maybe JSON null). Returns 0, or -1 after
 * answering. */
typedef int (*param_fn)(const struct param *row, struct pctx *x, cJSON *it);

enum ptype {
	P_NUMBER, /* finite number in [lo, hi] (or (lo, hi]), stored as float */
	P_INT,    /* integral number in [ilo, ihi], stored as int64_t */
	P_BOOL,   /* true or false, stored as bool */
	P_CUSTOM, /* its own parser */
};

#define NO_FLAG ((size_t)-1)

/* One request parameter. */
struct param {
	const char *name;     /* JSON key */
	unsigned endpoints;   /* enum md_req_endpoint bits that accept it */
	enum ptype type;
	double lo, hi;        /* P_NUMBER range */
	bool lo_open;         /* P_NUMBER: lo itself excluded */
	int64_t ilo, ihi;     /* P_INT range */
	bool hi_is_cap;       /* P_INT: the upper bound is the server's max_tokens_cap */
	size_t off;           /* target field in struct md_req_params */
	size_t flag_off;      /* bool field set when present, or NO_FLAG */
	param_fn parse;       /* P_CUSTOM */
};

#define GEN_EPS (MD_REQ_CHAT | MD_REQ_COMPLETIONS)
#define ALL_EPS (MD_REQ_CHAT | MD_REQ_COMPLETIONS | MD_REQ_TOKENIZE | MD_REQ_DETOKENIZE)
#define F(field) offsetof(struct md_req_params, field)
#define NUMBER(n, eps, l, h, open, field) \
	{ .name = n, .endpoints = eps, .type = P_NUMBER, .lo = l, .hi = h, .lo_open = open, \
	  .off = F(field), .flag_off = NO_FLAG }
#define INT(n, eps, l, h, field, flag) \
	{ .name = n, .endpoints = eps, .type = P_INT, .ilo = l, .ihi = h, .off = F(field), \
	  .flag_off = flag }
#define INT_CAPPED(n, eps, l, field, flag) \
	{ .name = n, .endpoints = eps, .type = P_INT, .ilo = l, .hi_is_cap = true, \
	  .off = F(field), .flag_off = flag }
#define BOOL(n, eps, field) \
	{ .name = n, .endpoints = eps, .type = P_BOOL, .off = F(field), .flag_off = NO_FLAG }
#define CUSTOM(n, eps, fn) { .name = n, .endpoints = eps, .type = P_CUSTOM, .parse = fn }

static int p_model(const struct param *row, struct pctx *x, cJSON *m)
{
	if (cJSON_IsNull(m))
		return 0;
	if (!cJSON_IsString(m)) {
		md_oai_error(x->o, 400, "invalid_request_error", "model", "invalid_type",
			     "'model' must be a string");
		return -1;
	}
	if (strcmp(m->valuestring, x->lim->model_name) != 0) {
		md_oai_error(x->o, 404, "invalid_request_error", "model", "model_not_found",
			     "The model '%.200s' does not exist; this server serves '%s'",
			     m->valuestring, x->lim->model_name);
		return -1;
	}
	return 0;
}

static int p_stream_options(const struct param *row, struct pctx *x, cJSON *so)
{
	if (cJSON_IsNull(so))
		return 0;
	if (!cJSON_IsObject(so)) {
		bad_request(x->o, "stream_options", "'stream_options' must be an object");
		return -1;
	}
	if (!x->p->stream) {
		bad_request(x->o, "stream_options",
			    "'stream_options' is only allowed when 'stream' is true");
		return -1;
	}
	cJSON *iu = cJSON_GetObjectItemCaseSensitive(so, "include_usage");
	return read_bool(x->o, iu, "include_usage", &x->p->include_usage) < 0 ? -1 : 0;
}

static int p_user(const struct param *row, struct pctx *x, cJSON *user)
{
	if (!cJSON_IsNull(user) && !cJSON_IsString(user)) {
		bad_request(x->o, "user", "'user' must be a string");
		return -1;
	}
	return 0;
}

/* Chat top_logprobs: needs logprobs true (its row comes after logprobs). */
static int p_top_logprobs(const struct param *row, struct pctx *x, cJSON *it)
{
	int rc = read_int(x->o, it, row->name, 0, MD_ENGINE_MAX_TOP, &x->p->_top_lp);
	if (rc < 0)
		return -1;
	if (rc && !x->p->_lp_on) {
		bad_request(x->o, "top_logprobs", "'top_logprobs' requires 'logprobs' to be true");
		return -1;
	}
	x->p->_top_lp_set = rc > 0;
	return 0;
}

static int p_echo(const struct param *row, struct pctx *x, cJSON *it)
{
	bool echo = false;
	if (read_bool(x->o, it, "echo", &echo) < 0)
		return -1;
	if (echo) {
		bad_request(x->o, "echo", "'echo' is not supported");
		return -1;
	}
	return 0;
}

static int p_stop(const struct param *row, struct pctx *x, cJSON *st)
{
	const struct md_oai_reply *o = x->o;
	struct md_req_params *p = x->p;
	if (cJSON_IsNull(st))
		return 0;
	cJSON *one = NULL;
	size_t n;
	if (cJSON_IsString(st)) {
		one = st;
		n = 1;
	} else if (cJSON_IsArray(st)) {
		n = (size_t)cJSON_GetArraySize(st);
		if (n > MD_REQ_MAX_STOPS) {
			md_oai_error(o, 400, "invalid_request_error", "stop", "invalid_value",
				     "at most %d stop sequences", MD_REQ_MAX_STOPS);
			return -1;
		}
	} else {
		bad_request(o, "stop", "'stop' must be a string or an array of strings");
		return -1;
	}
	p->stops = calloc(n ? n : 1, sizeof(char *));
	if (!p->stops) {
		out_of_memory(o);
		return -1;
	}
	cJSON *it = one ? one : st->child;
	for (size_t i = 0; i < n; i++, it = it->next) {
		if (!cJSON_IsString(it)) {
			bad_request(o, "stop", "'stop' must be a string or an array of strings");
			return -1;
		}
		size_t l = strlen(it->valuestring);
		if (l == 0)
			continue; /* an empty stop string can never be matched usefully */
		if (l > MD_REQ_MAX_STOP_LEN) {
			md_oai_error(o, 400, "invalid_request_error", "stop", "invalid_value",
				     "stop sequences are limited to %d bytes", MD_REQ_MAX_STOP_LEN);
			return -1;
		}
		p->stops[p->n_stops] = strdup(it->valuestring);
		if (!p->stops[p->n_stops]) {
			out_of_memory(o);
			return -1;
		}
		p->n_stops++;
	}
	return 0;
}

static int p_logit_bias(const struct param *row, struct pctx *x, cJSON *lb)
{
	const struct md_oai_reply *o = x->o;
	struct md_sampling *s = &x->p->s;
	if (cJSON_IsNull(lb))
		return 0;
	if (!cJSON_IsObject(lb)) {
		bad_request(o, "logit_bias", "'logit_bias' must be an object of token id -> bias");
		return -1;
	}
	size_t n = (size_t)cJSON_GetArraySize(lb);
	if (n > 1024) {
		bad_request(o, "logit_bias", "'logit_bias' holds at most 1024 entries");
		return -1;
	}
	s->logit_bias = calloc(n ? n : 1, sizeof(*s->logit_bias));
	if (!s->logit_bias) {
		out_of_memory(o);
		return -1;
	}
	cJSON *it;
	cJSON_ArrayForEach(it, lb) {
		char *end;
		errno = 0;
		long id = strtol(it->string, &end, 10);
		if (errno || end == it->string || *end || id < 0 || (uint64_t)id >= x->lim->n_vocab) {
			md_oai_error(o, 400, "invalid_request_error", "logit_bias", "invalid_value",
				     "logit_bias key '%.40s' is not a token id in [0, %u)", it->string,
				     x->lim->n_vocab);
			return -1;
		}
		if (!cJSON_IsNumber(it) || it->valuedouble < -100 || it->valuedouble > 100) {
			bad_request(o, "logit_bias", "logit_bias values must be numbers in [-100, 100]");
			return -1;
		}
		s->logit_bias[s->n_logit_bias].id = (int32_t)id;
		s->logit_bias[s->n_logit_bias].bias = (float)it->valuedouble;
		s->n_logit_bias++;
	}
	return 0;
}

/* ---- constrained decoding: response_format and the raw grammar extension ---- */

/* Compile grammar text into p->grammar; a failure is answered as a 400 on param. */
static int set_grammar(struct pctx *x, const char *param, const char *text, size_t len)
{
	char err[300];
	struct md_grammar *g;
	if (x->p->grammar) {
		bad_request(x->o, param, "only one of 'grammar', a JSON 'response_format' and a forced "
			    "tool call ('tool_choice' required or a function) may be given");
		return -1;
	}
	int rc = md_grammar_parse(text, len, &g, err, sizeof(err));
	if (rc == -ENOMEM) {
		out_of_memory(x->o);
		return -1;
	}
	if (rc) {
		md_oai_error(x->o, 400, "invalid_request_error", param, "invalid_value",
			     "invalid grammar: %s", err);
		return -1;
	}
	x->p->grammar = g;
	return 0;
}

static int p_response_format(const struct param *row, struct pctx *x, cJSON *rf)
{
	const struct md_oai_reply *o = x->o;
	if (cJSON_IsNull(rf))
		return 0;
	cJSON *type = cJSON_IsObject(rf) ? cJSON_GetObjectItemCaseSensitive(rf, "type") : NULL;
	if (!cJSON_IsString(type)) {
		bad_request(o, "response_format", "'response_format' must be an object with a 'type' "
			    "of 'text', 'json_object' or 'json_schema'");
		return -1;
	}
	const char *t = type->valuestring;
	if (strcmp(t, "text") == 0)
		return 0;
	if (strcmp(t, "json_object") == 0) {
		const char *g = md_json_object_grammar();
		return set_grammar(x, "response_format", g, strlen(g));
	}
	if (strcmp(t, "json_schema") != 0) {
		md_oai_error(o, 400, "invalid_request_error", "response_format", "invalid_value",
			     "unsupported response_format type '%.40s' (text, json_object, "
			     "json_schema)", t);
		return -1;
	}
	cJSON *js = cJSON_GetObjectItemCaseSensitive(rf, "json_schema");
	if (!cJSON_IsObject(js)) {
		bad_request(o, "response_format", "'response_format.json_schema' must be an object "
			    "with 'name' and 'schema'");
		return -1;
	}
	cJSON *name = cJSON_GetObjectItemCaseSensitive(js, "name");
	cJSON *strict = cJSON_GetObjectItemCaseSensitive(js, "strict");
	cJSON *schema = cJSON_GetObjectItemCaseSensitive(js, "schema");
	if (name && !cJSON_IsString(name)) {
		bad_request(o, "response_format", "'response_format.json_schema.name' must be a "
			    "string");
		return -1;
	}
	if (strict && !cJSON_IsNull(strict) && !cJSON_IsBool(strict)) {
		bad_request(o, "response_format", "'response_format.json_schema.strict' must be a "
			    "boolean");
		return -1;
	}
	if (!schema || cJSON_IsNull(schema)) {
		const char *g = md_json_object_grammar();
		return set_grammar(x, "response_format", g, strlen(g));
	}
	/* strict or not, the output follows the schema: the grammar enforces it either way */
	char err[300], *text;
	int rc = md_json_schema_grammar(schema, &text, err, sizeof(err));
	if (rc == -ENOMEM) {
		out_of_memory(o);
		return -1;
	}
	if (rc) {
		md_oai_error(o, 400, "invalid_request_error", "response_format", "invalid_value",
			     "response_format.json_schema.schema: %s", err);
		return -1;
	}
	rc = set_grammar(x, "response_format", text, strlen(text));
	free(text);
	return rc;
}

static int p_tools(const struct param *row, struct pctx *x, cJSON *t)
{
	char err[300];
	md_tools_release(&x->p->tools);
	int rc = md_tools_parse(&x->p->tools, t, (enum md_tool_text)x->lim->tool_text, err,
				sizeof(err));
	x->p->tools.format = (enum md_tool_fmt)x->lim->tool_format;
	if (rc == -ENOMEM) {
		out_of_memory(x->o);
		return -1;
	}
	if (rc) {
		md_oai_error(x->o, 400, "invalid_request_error", "tools", "invalid_value", "%s", err);
		return -1;
	}
	return 0;
}

/* moed extension: "speculative": {"drafter": "ngram"|"draft"|"off", "max_k": 0..16}, each
 * key optional (absent: the server's default); max_k 0 turns speculation off. */
static int p_speculative(const struct param *row, struct pctx *x, cJSON *sp)
{
	struct md_spec_opts *so = &x->p->spec;
	if (cJSON_IsNull(sp))
		return 0;
	if (!cJSON_IsObject(sp)) {
		bad_request(x->o, "speculative", "'speculative' must be an object");
		return -1;
	}
	cJSON *it;
	cJSON_ArrayForEach(it, sp) {
		if (strcmp(it->string, "drafter") && strcmp(it->string, "max_k")) {
			md_oai_error(x->o, 400, "invalid_request_error", "speculative", "invalid_value",
				     "unknown key 'speculative.%.40s' (drafter, max_k)", it->string);
			return -1;
		}
	}
	cJSON *d = cJSON_GetObjectItemCaseSensitive(sp, "drafter");
	if (d && !cJSON_IsNull(d)) {
		int v = cJSON_IsString(d) ? md_spec_drafter_parse(d->valuestring) : -EINVAL;
		if (v < 0 || v == MD_SPEC_DEFAULT) {
			bad_request(x->o, "speculative.drafter",
				    "'speculative.drafter' must be \"ngram\", \"draft\", \"self\" or \"off\"");
			return -1;
		}
		if (v == MD_SPEC_DRAFT && !x->lim->has_draft) {
			bad_request(x->o, "speculative.drafter",
				    "no draft model is loaded (start moed with --draft-model)");
			return -1;
		}
		if (v == MD_SPEC_SELF && !x->lim->has_self) {
			bad_request(x->o, "speculative.drafter",
				    "self-speculation needs a model with experts (or --spec-self-skip)");
			return -1;
		}
		so->drafter = (enum md_spec_drafter)v;
	}
	int64_t k;
	int rc = read_int(x->o, cJSON_GetObjectItemCaseSensitive(sp, "max_k"), "speculative.max_k",
			  0, MD_SPEC_MAX_K, &k);
	if (rc < 0)
		return -1;
	if (rc > 0) {
		if (k == 0)
			so->drafter = MD_SPEC_OFF;
		so->max_k = (uint32_t)k;
	}
	return 0;
}

/* After tools and parallel_tool_calls: a forced call (required, named) becomes a grammar. */
static int p_tool_choice(const struct param *row, struct pctx *x, cJSON *c)
{
	char err[400], *text;
	struct md_tools *t = &x->p->tools;
	if (cJSON_IsNull(c))
		return 0;
	if (md_tools_set_choice(t, c, err, sizeof(err))) {
		md_oai_error(x->o, 400, "invalid_request_error", "tool_choice", "invalid_value", "%s",
			     err);
		return -1;
	}
	int rc = md_tools_grammar(t, &text, err, sizeof(err));
	if (rc == -ENOMEM) {
		out_of_memory(x->o);
		return -1;
	}
	if (rc) {
		md_oai_error(x->o, 400, "invalid_request_error", "tools", "invalid_value", "%s", err);
		return -1;
	}
	if (!text)
		return 0;
	rc = set_grammar(x, "tool_choice", text, strlen(text));
	free(text);
	return rc;
}

/* moed's extension: "grammar" holds grammar text (engine/grammar.h, documented in
 * proto/openapi.yaml). */
static int p_grammar(const struct param *row, struct pctx *x, cJSON *g)
{
	if (cJSON_IsNull(g))
		return 0;
	if (!cJSON_IsString(g)) {
		bad_request(x->o, "grammar", "'grammar' must be a string of grammar rules");
		return -1;
	}
	return set_grammar(x, "grammar", g->valuestring, strlen(g->valuestring));
}

/* OpenAI's reasoning_effort: where the chat template has a place for it (gpt-oss's system
 * header "Reasoning: ..."), it goes there; other templates ignore it, as OpenAI's non-reasoning
 * models do. gpt-oss knows low, medium and high. */
static int p_reasoning_effort(const struct param *row, struct pctx *x, cJSON *v)
{
	static const char *const efforts[] = { "low", "medium", "high" };
	if (cJSON_IsNull(v))
		return 0;
	for (size_t i = 0; cJSON_IsString(v) && i < 3; i++)
		if (strcmp(v->valuestring, efforts[i]) == 0) {
			x->p->reasoning_effort = efforts[i];
			return 0;
		}
	md_oai_error(x->o, 400, "invalid_request_error", "reasoning_effort", "invalid_value",
		     "'reasoning_effort' must be one of 'low', 'medium', 'high'");
	return -1;
}

/*
 * Every parameter moed reads, in the order they are checked (the first bad one is the one
 * answered). A new parameter is one row: a plain number, integer or boolean needs no code;
 * anything else (tools, tool_choice, response_format, ...) adds its parser above. Rows read
 * by later rows (stream before stream_options, logprobs before top_logprobs) come first.
 */
static const struct param params[] = {
	CUSTOM("model", ALL_EPS, p_model),
	INT_CAPPED("max_tokens", GEN_EPS, 1, max_tokens, F(max_set)),
	INT_CAPPED("max_completion_tokens", MD_REQ_CHAT, 1, max_tokens, F(max_set)),
	NUMBER("temperature", GEN_EPS, 0, 2, false, s.temperature),
	NUMBER("top_p", GEN_EPS, 0, 1, true, s.top_p),
	INT("top_k", GEN_EPS, -1, 1 << 30, _top_k, NO_FLAG),
	NUMBER("min_p", GEN_EPS, 0, 1, false, s.min_p),
	NUMBER("presence_penalty", GEN_EPS, -2, 2, false, s.presence_penalty),
	NUMBER("frequency_penalty", GEN_EPS, -2, 2, false, s.frequency_penalty),
	NUMBER("repetition_penalty", GEN_EPS, 0, 10, true, s.repetition_penalty),
	INT("seed", GEN_EPS, INT64_MIN / 2, INT64_MAX / 2, _seed, F(s.has_seed)),
	INT("n", GEN_EPS, 1, MD_REQ_MAX_N, n, NO_FLAG),
	BOOL("stream", GEN_EPS, stream),
	BOOL("ignore_eos", GEN_EPS, ignore_eos),
	CUSTOM("stream_options", GEN_EPS, p_stream_options),
	CUSTOM("user", GEN_EPS, p_user),
	BOOL("logprobs", MD_REQ_CHAT, _lp_on),
	INT("logprobs", MD_REQ_COMPLETIONS, 0, MD_ENGINE_MAX_TOP, _lp_n, F(_lp_n_set)),
	CUSTOM("top_logprobs", MD_REQ_CHAT, p_top_logprobs),
	CUSTOM("echo", MD_REQ_COMPLETIONS, p_echo),
	CUSTOM("stop", GEN_EPS, p_stop),
	CUSTOM("logit_bias", GEN_EPS, p_logit_bias),
	CUSTOM("response_format", GEN_EPS, p_response_format),
	CUSTOM("grammar", GEN_EPS, p_grammar),
	CUSTOM("tools", MD_REQ_CHAT, p_tools),
	BOOL("parallel_tool_calls", MD_REQ_CHAT, tools.parallel),
	CUSTOM("tool_choice", MD_REQ_CHAT, p_tool_choice),
	CUSTOM("speculative", GEN_EPS, p_speculative),
	CUSTOM("reasoning_effort", MD_REQ_CHAT, p_reasoning_effort),
	BOOL("return_token_ids", GEN_EPS, want_ids),
	BOOL("add_special", MD_REQ_TOKENIZE, add_special),
	BOOL("with_pieces", MD_REQ_TOKENIZE, with_pieces),
};

#define N_PARAMS (sizeof(params) / sizeof(params[0]))

static int parse_row(const struct param *row, struct pctx *x, cJSON *it)
{
	char *field = (char *)x->p + row->off;
	int rc = 0;
	switch (row->type) {
	case P_NUMBER: {
		double d;
		rc = read_number(x->o, it, row->name, row->lo, row->hi, row->lo_open, &d);
		if (rc > 0)
			*(float *)field = (float)d;
		break;
	}
	case P_INT: {
		int64_t v;
		int64_t hi = row->hi_is_cap ? x->lim->max_tokens_cap : row->ihi;
		rc = read_int(x->o, it, row->name, row->ilo, hi, &v);
		if (rc > 0)
			*(int64_t *)field = v;
		break;
	}
	case P_BOOL:
		rc = read_bool(x->o, it, row->name, (bool *)field);
		break;
	case P_CUSTOM:
		return row->parse(row, x, it);
	}
	if (rc < 0)
		return -1;
	if (rc > 0 && row->flag_off != NO_FLAG)
		*(bool *)((char *)x->p + row->flag_off) = true;
	return 0;
}

int md_req_parse_params(const struct md_oai_reply *o, const struct md_req_limits *lim,
			cJSON *body, enum md_req_endpoint endpoint, struct md_req_params *p)
{
	memset(p, 0, sizeof(*p));
	md_sampling_default(&p->s);
	p->n = 1;
	p->add_special = true;
	p->_top_k = p->s.top_k;
	p->tools.parallel = true;
	struct pctx x = { .o = o, .lim = lim, .p = p };
	for (size_t i = 0; i < N_PARAMS; i++) {
		const struct param *row = &params[i];
		if (!(row->endpoints & endpoint))
			continue;
		cJSON *it = cJSON_GetObjectItemCaseSensitive(body, row->name);
		if (it && parse_row(row, &x, it) < 0)
			return -1;
	}
	/* combine the raw values */
	p->s.top_k = p->_top_k < 0 ? 0 : (int32_t)p->_top_k;
	if (p->s.has_seed)
		p->s.seed = (uint64_t)p->_seed;
	if (endpoint == MD_REQ_CHAT) {
		p->want_lp = p->_lp_on;
		p->lp_top = p->_top_lp_set ? (int)p->_top_lp : 0;
	} else if (endpoint == MD_REQ_COMPLETIONS) {
		p->want_lp = p->_lp_n_set;
		p->lp_top = p->_lp_n_set ? (int)p->_lp_n : 0;
	}
	p->s.top_logprobs = p->want_lp ? p->lp_top : -1;
	return 0;
}

void md_req_params_release(struct md_req_params *p)
{
	md_sampling_release(&p->s);
	md_grammar_unref(p->grammar);
	p->grammar = NULL;
	md_tools_release(&p->tools);
	for (size_t i = 0; i < p->n_stops; i++)
		free(p->stops[i]);
	free(p->stops);
	p->stops = NULL;
	p->n_stops = 0;
}

/* ---- chat messages ---- */

void md_req_msgs_release(struct md_req_msgs *m)
{
	for (size_t i = 0; i < m->n_owned; i++)
		free(m->owned[i]);
	free(m->owned);
	free(m->msgs);
	free(m->calls);
	memset(m, 0, sizeof(*m));
}

/* Join the text parts of an array content into a malloc'd string in *out. Returns 0, or -1
 * after answering. */
static int join_parts(const struct md_oai_reply *o, cJSON *content, size_t i, char **out)
{
	char param[64];
	size_t len = 0;
	cJSON *part;
	cJSON_ArrayForEach(part, content) {
		cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
		cJSON *text = cJSON_GetObjectItemCaseSensitive(part, "text");
		if (!cJSON_IsString(type) || strcmp(type->valuestring, "text") ||
		    !cJSON_IsString(text)) {
			snprintf(param, sizeof(param), "messages[%zu].content", i);
			bad_request(o, param, "only content parts of type 'text' are supported");
			return -1;
		}
		len += strlen(text->valuestring);
	}
	char *joined = malloc(len + 1);
	if (!joined) {
		out_of_memory(o);
		return -1;
	}
	size_t at = 0;
	cJSON_ArrayForEach(part, content) {
		const char *t = cJSON_GetObjectItemCaseSensitive(part, "text")->valuestring;
		size_t l = strlen(t);
		memcpy(joined + at, t, l);
		at += l;
	}
	joined[at] = 0;
	*out = joined;
	return 0;
}

int md_req_parse_messages(const struct md_oai_reply *o, cJSON *body, struct md_req_msgs *out)
{
	memset(out, 0, sizeof(*out));
	cJSON *arr = cJSON_GetObjectItemCaseSensitive(body, "messages");
	if (!arr) {
		bad_request(o, "messages", "'messages' is required");
		return -1;
	}
	if (!cJSON_IsArray(arr) || cJSON_GetArraySize(arr) == 0) {
		bad_request(o, "messages", "'messages' must be a non-empty array");
		return -1;
	}
	size_t n = (size_t)cJSON_GetArraySize(arr), i = 0, n_calls = 0, at_call = 0;
	cJSON *msg;
	cJSON_ArrayForEach(msg, arr) {
		cJSON *tc = cJSON_GetObjectItemCaseSensitive(msg, "tool_calls");
		if (cJSON_IsArray(tc))
			n_calls += (size_t)cJSON_GetArraySize(tc);
	}
	struct md_req_msgs m = { .msgs = calloc(n, sizeof(*m.msgs)),
				 .owned = calloc(n + 2 * n_calls, sizeof(char *)),
				 .calls = calloc(n_calls ? n_calls : 1, sizeof(*m.calls)) };
	char param[64];
	if (!m.msgs || !m.owned || !m.calls) {
		md_req_msgs_release(&m);
		out_of_memory(o);
		return -1;
	}
	cJSON_ArrayForEach(msg, arr) {
		if (!cJSON_IsObject(msg)) {
			snprintf(param, sizeof(param), "messages[%zu]", i);
			bad_request(o, param, "each message must be an object");
			goto fail;
		}
		cJSON *role = cJSON_GetObjectItemCaseSensitive(msg, "role");
		if (!cJSON_IsString(role)) {
			snprintf(param, sizeof(param), "messages[%zu].role", i);
			bad_request(o, param, "'role' must be a string");
			goto fail;
		}
		const char *rs = role->valuestring;
		if (strcmp(rs, "developer") == 0)
			rs = "system";
		if (strcmp(rs, "system") && strcmp(rs, "user") && strcmp(rs, "assistant") &&
		    strcmp(rs, "tool")) {
			snprintf(param, sizeof(param), "messages[%zu].role", i);
			md_oai_error(o, 400, "invalid_request_error", param, "invalid_value",
				     "unsupported role '%.64s' (system, developer, user, assistant, "
				     "tool)", role->valuestring);
			goto fail;
		}
		cJSON *tc = cJSON_GetObjectItemCaseSensitive(msg, "tool_calls");
		if (tc && !cJSON_IsNull(tc)) {
			snprintf(param, sizeof(param), "messages[%zu].tool_calls", i);
			if (strcmp(rs, "assistant") != 0 || !cJSON_IsArray(tc)) {
				bad_request(o, param, "'tool_calls' must be an array, on assistant "
					    "messages only");
				goto fail;
			}
			m.msgs[i].tool_calls = m.calls + at_call;
			cJSON *call;
			cJSON_ArrayForEach(call, tc) {
				cJSON *fn = cJSON_GetObjectItemCaseSensitive(call, "function");
				cJSON *name = cJSON_GetObjectItemCaseSensitive(fn, "name");
				cJSON *args = cJSON_GetObjectItemCaseSensitive(fn, "arguments");
				if (!cJSON_IsString(name) || !(cJSON_IsString(args) || cJSON_IsObject(args))) {
					bad_request(o, param, "each tool call needs 'function' with a 'name' "
						    "and 'arguments' (a JSON string)");
					goto fail;
				}
				struct md_engine_tool_call *c = &m.calls[at_call++];
				c->name = name->valuestring;
				cJSON *id = cJSON_GetObjectItemCaseSensitive(call, "id");
				c->id = cJSON_IsString(id) ? id->valuestring : NULL;
				/* the arguments as sent, and as `tojson` of their value for the
				 * templates that take them as an object (NULL: not JSON) */
				cJSON *parsed = cJSON_IsString(args) ? cJSON_Parse(args->valuestring)
								      : NULL;
				char *a = cJSON_IsString(args) ? NULL : md_tools_tojson(args);
				char *obj = parsed ? md_tools_tojson(parsed) : NULL;
				cJSON_Delete(parsed);
				if (!cJSON_IsString(args) && !a) {
					free(obj);
					out_of_memory(o);
					goto fail;
				}
				if (a)
					m.owned[m.n_owned++] = a;
				if (obj)
					m.owned[m.n_owned++] = obj;
				c->arguments = a ? a : args->valuestring;
				c->arguments_obj = a ? a : obj;
				m.msgs[i].n_tool_calls++;
			}
		}
		m.msgs[i].role = rs;
		cJSON *tcid = cJSON_GetObjectItemCaseSensitive(msg, "tool_call_id");
		m.msgs[i].tool_call_id = cJSON_IsString(tcid) ? tcid->valuestring : NULL;
		cJSON *content = cJSON_GetObjectItemCaseSensitive(msg, "content");
		if (!content || cJSON_IsNull(content)) {
			if (strcmp(rs, "assistant") != 0) {
				snprintf(param, sizeof(param), "messages[%zu].content", i);
				bad_request(o, param, "'content' is required");
				goto fail;
			}
			m.msgs[i].content = "";
			m.msgs[i].content_null = true;
		} else if (cJSON_IsString(content)) {
			m.msgs[i].content = content->valuestring;
		} else if (cJSON_IsArray(content)) {
			char *joined;
			if (join_parts(o, content, i, &joined) < 0)
				goto fail;
			m.owned[m.n_owned++] = joined;
			m.msgs[i].content = joined;
		} else {
			snprintf(param, sizeof(param), "messages[%zu].content", i);
			bad_request(o, param, "'content' must be a string or an array of parts");
			goto fail;
		}
		i++;
	}
	m.n = n;
	*out = m;
	return 0;
fail:
	md_req_msgs_release(&m);
	return -1;
}

/* ---- completion prompts ---- */

void md_req_prompts_release(struct md_req_prompts *pr)
{
	for (size_t i = 0; i < pr->n; i++) {
		free(pr->ids[i]);
		pr->ids[i] = NULL;
		pr->text[i] = NULL;
	}
	pr->n = 0;
}

static const char bad_prompt[] = "'prompt' must be a string, an array of strings, an array of "
				 "token ids or an array of such arrays";

int md_req_parse_prompts(const struct md_oai_reply *o, const struct md_req_limits *lim,
			 cJSON *body, struct md_req_prompts *out)
{
	out->n = 0;
	cJSON *pr = cJSON_GetObjectItemCaseSensitive(body, "prompt");
	if (!pr || cJSON_IsNull(pr)) {
		bad_request(o, "prompt", "'prompt' is required");
		return -1;
	}
	cJSON *items[MD_REQ_MAX_CHOICES];
	size_t ni = 0;
	bool ids_form = false;
	if (cJSON_IsString(pr)) {
		items[ni++] = pr;
	} else if (cJSON_IsArray(pr) && cJSON_GetArraySize(pr) > 0) {
		if (cJSON_IsNumber(pr->child)) {
			items[ni++] = pr;
			ids_form = true;
		} else {
			if (cJSON_GetArraySize(pr) > MD_REQ_MAX_CHOICES) {
				bad_request(o, "prompt", "too many prompts");
				return -1;
			}
			cJSON *it;
			cJSON_ArrayForEach(it, pr) items[ni++] = it;
		}
	} else {
		bad_request(o, "prompt", bad_prompt);
		return -1;
	}
	for (size_t i = 0; i < ni; i++) {
		cJSON *it = items[i];
		if (cJSON_IsString(it) && !ids_form) {
			out->ids[out->n] = NULL;
			out->lens[out->n] = 0;
			out->text[out->n++] = it->valuestring; /* emptiness: md_request_tokenize */
			continue;
		} else if (cJSON_IsArray(it) && (ids_form || (it->child && cJSON_IsNumber(it->child)))) {
			size_t n = (size_t)cJSON_GetArraySize(it);
			int32_t *ids = malloc(sizeof(int32_t) * (n ? n : 1));
			if (!ids) {
				out_of_memory(o);
				return -1;
			}
			out->text[out->n] = NULL;
			out->ids[out->n] = ids;
			out->lens[out->n++] = (uint32_t)n;
			size_t k = 0;
			cJSON *t;
			cJSON_ArrayForEach(t, it) {
				if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble) ||
				    t->valuedouble < 0 || t->valuedouble >= lim->n_vocab) {
					md_oai_error(o, 400, "invalid_request_error", "prompt",
						     "invalid_value",
						     "prompt token ids must be integers in [0, %u)",
						     lim->n_vocab);
					return -1;
				}
				ids[k++] = (int32_t)t->valuedouble;
			}
		} else {
			bad_request(o, "prompt", bad_prompt);
			return -1;
		}
		if (out->lens[out->n - 1] == 0) {
			bad_request(o, "prompt", "the prompt is empty");
			return -1;
		}
	}
	return 0;
}

/* ---- a request read whole ---- */

void md_request_free(struct md_request *r)
{
	if (!r)
		return;
	md_req_params_release(&r->p);
	md_req_msgs_release(&r->m);
	md_req_prompts_release(&r->pr);
	cJSON_Delete(r->body);
	free(r);
}

/* /tokenize: "content" (or "prompt"), a string, or "messages". Returns 0 or -1 after
 * answering. */
static int tokenize_input(const struct md_oai_reply *o, struct md_request *r)
{
	cJSON *text = cJSON_GetObjectItemCaseSensitive(r->body, "content");
	if (!text)
		text = cJSON_GetObjectItemCaseSensitive(r->body, "prompt");
	if (text) {
		if (!cJSON_IsString(text)) {
			bad_request(o, "content", "'content' must be a string");
			return -1;
		}
		r->pr.text[0] = text->valuestring;
		r->pr.n = 1;
		return 0;
	}
	if (cJSON_GetObjectItemCaseSensitive(r->body, "messages"))
		return md_req_parse_messages(o, r->body, &r->m);
	bad_request(o, "content", "'content' (or 'prompt' or 'messages') is required");
	return -1;
}

struct md_request *md_request_new(const struct md_oai_reply *o, const struct md_req_limits *lim,
				  cJSON *body, enum md_req_endpoint ep)
{
	struct md_request *r = calloc(1, sizeof(*r));
	if (!r) {
		cJSON_Delete(body);
		out_of_memory(o);
		return NULL;
	}
	r->ep = ep;
	r->body = body;
	if (md_req_parse_params(o, lim, body, ep, &r->p) < 0)
		goto fail;
	r->add_special = r->p.add_special;
	if (ep == MD_REQ_CHAT && md_req_parse_messages(o, body, &r->m) < 0)
		goto fail;
	if (ep == MD_REQ_COMPLETIONS && md_req_parse_prompts(o, lim, body, &r->pr) < 0)
		goto fail;
	if (ep == MD_REQ_TOKENIZE && tokenize_input(o, r) < 0)
		goto fail;
	return r;
fail:
	md_request_free(r);
	return NULL;
}

size_t md_request_text_bytes(const struct md_request *r)
{
	size_t n = 0;
	for (size_t i = 0; i < r->m.n; i++)
		n += strlen(r->m.msgs[i].content);
	for (size_t i = 0; i < r->p.tools.n; i++)
		n += strlen(r->p.tools.json[i]);
	for (size_t i = 0; i < r->pr.n; i++)
		if (r->pr.text[i])
			n += strlen(r->pr.text[i]);
	return n;
}

int md_request_tokenize(struct md_request *r, const struct md_engine *eng)
{
	int n;
	r->tok_rc = 0;
	if (r->m.n) { /* a chat, or /tokenize of messages: the one prompt */
		int32_t *ids = NULL;
		n = md_engine_chat_tokenize_effort(eng, r->m.msgs, r->m.n,
						   (const char *const *)r->p.tools.json, r->p.tools.n,
						   r->p.reasoning_effort, &ids);
		if (n < 0 || (n == 0 && r->ep == MD_REQ_CHAT)) {
			free(ids);
			return r->tok_rc = n < 0 ? n : -ENODATA;
		}
		r->pr.ids[0] = ids;
		r->pr.lens[0] = (uint32_t)n;
		r->pr.n = 1;
		return 0;
	}
	bool bos = r->ep == MD_REQ_TOKENIZE ? r->add_special : true;
	for (size_t i = 0; i < r->pr.n; i++) {
		if (!r->pr.text[i])
			continue;
		n = md_engine_tokenize(eng, r->pr.text[i], strlen(r->pr.text[i]), bos, true,
				       &r->pr.ids[i]);
		if (n < 0)
			return r->tok_rc = n;
		r->pr.lens[i] = (uint32_t)n;
		if (n == 0 && r->ep == MD_REQ_COMPLETIONS)
			return r->tok_rc = -ENODATA;
	}
	return 0;
}

void md_request_answer(const struct md_request *r, const struct md_oai_reply *o)
{
	int rc = r->tok_rc;
	if (r->ep == MD_REQ_CHAT) {
		if (rc == -ENOTSUP)
			md_oai_error(o, 400, "invalid_request_error", "tools", "unsupported",
				     "this model's chat template has no tool format: tools, tool calls "
				     "and tool messages are not supported with it");
		else if (rc == -EINVAL)
			md_oai_error(o, 400, "invalid_request_error", "messages", "invalid_value",
				     "the model's chat template rejects these messages (roles must "
				     "alternate user/assistant where the template requires it)");
		else
			md_oai_error(o, 500, "server_error", NULL, NULL,
				     "cannot render the chat prompt (%d)", rc == -ENODATA ? 0 : rc);
	} else if (rc == -ENODATA) {
		bad_request(o, "prompt", "the prompt is empty");
	} else if (r->ep == MD_REQ_TOKENIZE && r->m.n && rc == -EINVAL) {
		bad_request(o, "messages", "the chat template rejects these messages");
	} else if (rc == -ECANCELED) {
		md_oai_error(o, 503, "server_error", NULL, "unavailable", "the server is shutting down");
	} else {
		md_oai_error(o, 500, "server_error", NULL, NULL, "tokenization failed (%d)", rc);
	}
}

static void deliver(struct md_request *r)
{
	struct md_oai_reply o = r->_o; /* r may be freed by done */
	if (r->_gone) {
		r->_done(r->_arg, r, NULL);
		return;
	}
	md_http_set_handler(o.c, NULL, NULL, NULL, 0);
	r->_done(r->_arg, r, &o);
}

static void on_gone(void *data)
{
	struct md_request *r = data;
	r->_gone = true;
}

static void work_cb(uv_work_t *w)
{
	struct md_request *r = w->data;
	md_request_tokenize(r, r->_eng);
}

static void after_work_cb(uv_work_t *w, int status)
{
	struct md_request *r = w->data;
	MD_ASSERT_LOOP_THREAD();
	if (status == UV_ECANCELED)
		r->tok_rc = -ECANCELED;
	deliver(r);
}

void md_request_tokenize_then(struct md_request *r, uv_loop_t *loop, const struct md_engine *eng,
			      const struct md_oai_reply *o,
			      void (*done)(void *arg, struct md_request *r,
					   const struct md_oai_reply *o),
			      void *arg)
{
	MD_ASSERT_LOOP_THREAD();
	r->_eng = eng;
	r->_o = *o;
	r->_done = done;
	r->_arg = arg;
	if (md_request_text_bytes(r) < MD_REQ_INLINE_BYTES ||
	    (r->_work.data = r, uv_queue_work(loop, &r->_work, work_cb, after_work_cb) != 0)) {
		md_request_tokenize(r, eng);
		deliver(r);
		return;
	}
	md_http_set_handler(o->c, r, on_gone, NULL, 0);
}
