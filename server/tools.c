/* Tool calling: the request's tools and tool_choice, the grammar of forced calls, and the
 * parser that turns a model's tool-call text into OpenAI tool calls. */
#include "server/tools.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/sampler.h"
#include "server/json_schema.h"

#define MAX_TOOLS 128
#define MAX_NAME 64

/* ---- tojson ---- */

struct buf {
	char *s;
	size_t n, cap;
	bool oom;
};

static void put(struct buf *b, const char *s, size_t n)
{
	if (b->oom)
		return;
	if (b->n + n + 1 > b->cap) {
		size_t nc = b->cap ? b->cap * 2 : 128;
		while (nc < b->n + n + 1)
			nc *= 2;
		char *ns = realloc(b->s, nc);
		if (!ns) {
			b->oom = true;
			return;
		}
		b->s = ns;
		b->cap = nc;
	}
	memcpy(b->s + b->n, s, n);
	b->n += n;
	b->s[b->n] = 0;
}

static void puts_(struct buf *b, const char *s)
{
	put(b, s, strlen(s));
}

/* A leaf (number, string) as cJSON prints it: the same escapes as JSON.stringify and Python's
 * json.dumps(ensure_ascii=False) for valid UTF-8. */
static void leaf(struct buf *b, const cJSON *v)
{
	char *t = cJSON_PrintUnformatted(v);
	if (!t) {
		b->oom = true;
		return;
	}
	puts_(b, t);
	free(t);
}

static void tojson(struct buf *b, const cJSON *v, int depth)
{
	if (depth > 100) {
		b->oom = true;
		return;
	}
	if (cJSON_IsArray(v)) {
		puts_(b, "[");
		for (const cJSON *c = v->child; c; c = c->next) {
			tojson(b, c, depth + 1);
			if (c->next)
				puts_(b, ", ");
		}
		puts_(b, "]");
	} else if (cJSON_IsObject(v)) {
		puts_(b, "{");
		for (const cJSON *c = v->child; c; c = c->next) {
			cJSON *k = cJSON_CreateString(c->string ? c->string : "");
			if (!k) {
				b->oom = true;
				return;
			}
			leaf(b, k);
			cJSON_Delete(k);
			puts_(b, ": ");
			tojson(b, c, depth + 1);
			if (c->next)
				puts_(b, ", ");
		}
		puts_(b, "}");
	} else {
		leaf(b, v);
	}
}

static void pad(struct buf *b, int depth)
{
	puts_(b, "\n");
	for (int i = 0; i < depth; i++)
		puts_(b, "    ");
}

static void tojson_indent(struct buf *b, const cJSON *v, int depth)
{
	if (depth > 100) {
		b->oom = true;
		return;
	}
	bool arr = cJSON_IsArray(v);
	if ((!arr && !cJSON_IsObject(v)) || !v->child) {
		tojson(b, v, depth); /* leaves, [] and {} */
		return;
	}
	puts_(b, arr ? "[" : "{");
	for (const cJSON *c = v->child; c; c = c->next) {
		pad(b, depth + 1);
		if (!arr) {
			cJSON *k = cJSON_CreateString(c->string ? c->string : "");
			if (!k) {
				b->oom = true;
				return;
			}
			leaf(b, k);
			cJSON_Delete(k);
			puts_(b, ": ");
		}
		tojson_indent(b, c, depth + 1);
		if (c->next)
			puts_(b, ",");
	}
	pad(b, depth);
	puts_(b, arr ? "]" : "}");
}

char *md_tools_tojson_indent(const cJSON *v)
{
	struct buf b = { 0 };
	tojson_indent(&b, v, 0);
	if (b.oom) {
		free(b.s);
		return NULL;
	}
	return b.s;
}

/* Mistral's tool text: {"type": "function", "function": {ITEMS}}, each member of the function
 * object but "return" as `"key": "value"` (a string as is, unescaped, as the template writes
 * it) or `"key": ` + tojson(value). */
static char *mistral_tool(const cJSON *fn)
{
	struct buf b = { 0 };
	bool first = true;
	puts_(&b, "{\"type\": \"function\", \"function\": {");
	for (const cJSON *c = fn->child; c; c = c->next) {
		if (!c->string || strcmp(c->string, "return") == 0)
			continue;
		if (!first)
			puts_(&b, ", ");
		first = false;
		puts_(&b, "\"");
		puts_(&b, c->string);
		puts_(&b, "\": ");
		if (cJSON_IsString(c)) {
			puts_(&b, "\"");
			puts_(&b, c->valuestring);
			puts_(&b, "\"");
		} else {
			tojson(&b, c, 1);
		}
	}
	puts_(&b, "}}");
	if (b.oom) {
		free(b.s);
		return NULL;
	}
	return b.s;
}

char *md_tools_tojson(const cJSON *v)
{
	struct buf b = { 0 };
	tojson(&b, v, 0);
	if (b.oom) {
		free(b.s);
		return NULL;
	}
	return b.s;
}

/* ---- the request ---- */

void md_tools_release(struct md_tools *t)
{
	for (size_t i = 0; i < t->n; i++) {
		free(t->json[i]);
		free(t->names[i]);
	}
	free(t->json);
	free(t->names);
	cJSON_Delete(t->params);
	memset(t, 0, sizeof(*t));
}

static bool valid_name(const char *s)
{
	size_t n = strlen(s);
	if (n == 0 || n > MAX_NAME)
		return false;
	for (size_t i = 0; i < n; i++) {
		char c = s[i];
		if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
		      c == '_' || c == '-'))
			return false;
	}
	return true;
}

int md_tools_parse(struct md_tools *t, const cJSON *tools, enum md_tool_text form, char *err,
		   size_t errlen)
{
	memset(t, 0, sizeof(*t));
	t->parallel = true;
	if (!tools || cJSON_IsNull(tools))
		return 0;
	if (!cJSON_IsArray(tools)) {
		snprintf(err, errlen, "'tools' must be an array of function tools");
		return -EINVAL;
	}
	size_t n = (size_t)cJSON_GetArraySize(tools);
	if (n > MAX_TOOLS) {
		snprintf(err, errlen, "at most %d tools", MAX_TOOLS);
		return -EINVAL;
	}
	t->json = calloc(n ? n : 1, sizeof(char *));
	t->names = calloc(n ? n : 1, sizeof(char *));
	t->params = cJSON_CreateArray();
	if (!t->json || !t->names || !t->params)
		return -ENOMEM;
	size_t i = 0;
	const cJSON *tool;
	cJSON_ArrayForEach(tool, tools) {
		const cJSON *type = cJSON_GetObjectItemCaseSensitive(tool, "type");
		const cJSON *fn = cJSON_GetObjectItemCaseSensitive(tool, "function");
		const cJSON *name = cJSON_GetObjectItemCaseSensitive(fn, "name");
		const cJSON *params = cJSON_GetObjectItemCaseSensitive(fn, "parameters");
		if (!cJSON_IsObject(tool) || !cJSON_IsString(type) ||
		    strcmp(type->valuestring, "function") != 0 || !cJSON_IsObject(fn)) {
			snprintf(err, errlen, "tools[%zu] must be {\"type\": \"function\", \"function\": "
				 "{...}}", i);
			return -EINVAL;
		}
		if (!cJSON_IsString(name) || !valid_name(name->valuestring)) {
			snprintf(err, errlen, "tools[%zu].function.name must be 1 to %d letters, digits, "
				 "'_' or '-'", i, MAX_NAME);
			return -EINVAL;
		}
		for (size_t k = 0; k < i; k++)
			if (strcmp(t->names[k], name->valuestring) == 0) {
				snprintf(err, errlen, "tools[%zu]: the name '%s' is used twice", i,
					 name->valuestring);
				return -EINVAL;
			}
		if (params && !cJSON_IsNull(params) && !cJSON_IsObject(params)) {
			snprintf(err, errlen, "tools[%zu].function.parameters must be a JSON Schema "
				 "object", i);
			return -EINVAL;
		}
		cJSON *pc = params && !cJSON_IsNull(params) ? cJSON_Duplicate(params, true)
							    : cJSON_CreateNull();
		if (!pc)
			return -ENOMEM;
		cJSON_AddItemToArray(t->params, pc);
		t->json[i] = form == MD_TOOL_TEXT_INDENT4 ? md_tools_tojson_indent(tool)
			     : form == MD_TOOL_TEXT_MISTRAL ? mistral_tool(fn)
			     : md_tools_tojson(tool);
		t->names[i] = strdup(name->valuestring);
		t->n = i + 1;
		if (!t->json[i] || !t->names[i])
			return -ENOMEM;
		i++;
	}
	return 0;
}

int md_tools_set_choice(struct md_tools *t, const cJSON *choice, char *err, size_t errlen)
{
	t->choice = MD_TOOL_CHOICE_AUTO;
	if (!choice || cJSON_IsNull(choice))
		return 0;
	if (cJSON_IsString(choice)) {
		const char *s = choice->valuestring;
		if (strcmp(s, "auto") == 0)
			t->choice = MD_TOOL_CHOICE_AUTO;
		else if (strcmp(s, "none") == 0)
			t->choice = MD_TOOL_CHOICE_NONE;
		else if (strcmp(s, "required") == 0)
			t->choice = MD_TOOL_CHOICE_REQUIRED;
		else {
			snprintf(err, errlen, "'tool_choice' must be 'auto', 'none', 'required' or "
				 "{\"type\": \"function\", \"function\": {\"name\": ...}}");
			return -EINVAL;
		}
	} else {
		const cJSON *fn = cJSON_GetObjectItemCaseSensitive(choice, "function");
		const cJSON *name = cJSON_GetObjectItemCaseSensitive(fn, "name");
		if (!cJSON_IsObject(choice) || !cJSON_IsString(name)) {
			snprintf(err, errlen, "'tool_choice' must be 'auto', 'none', 'required' or "
				 "{\"type\": \"function\", \"function\": {\"name\": ...}}");
			return -EINVAL;
		}
		size_t k;
		for (k = 0; k < t->n; k++)
			if (strcmp(t->names[k], name->valuestring) == 0)
				break;
		if (k == t->n) {
			snprintf(err, errlen, "'tool_choice' names '%.64s', which is not in 'tools'",
				 name->valuestring);
			return -EINVAL;
		}
		t->choice = MD_TOOL_CHOICE_NAMED;
		t->named = k;
	}
	if (t->n == 0 && t->choice != MD_TOOL_CHOICE_AUTO && t->choice != MD_TOOL_CHOICE_NONE) {
		snprintf(err, errlen, "'tool_choice' requires 'tools'");
		return -EINVAL;
	}
	return 0;
}

/* Each format's forced calls as grammar text: a call is PRE NAME MID ARGS POST, several are
 * joined by SEP between OPEN and CLOSE. */
struct call_fmt {
	const char *pre, *mid, *post, *open, *sep, *close;
	bool one; /* one call per turn (the template takes no more) */
};

static const struct call_fmt call_fmts[] = {
	[MD_TOOL_FMT_HERMES] = { "\"<tool_call>\\n{\\\"name\\\": \\\"\"",
				 "\\\", \\\"arguments\\\": \"", "\"}\\n</tool_call>\"", "", "\"\\n\"",
				 "", false },
	[MD_TOOL_FMT_DEEPSEEK3] = { "\"<｜tool▁call▁begin｜>function<｜tool▁sep｜>\"", "\\n```json\\n\"",
				    "\"\\n```<｜tool▁call▁end｜>\"", "\"<｜tool▁calls▁begin｜>\" ", "\"\\n\"",
				    " \"<｜tool▁calls▁end｜>\"", false },
	[MD_TOOL_FMT_MISTRAL] = { "\"{\\\"name\\\": \\\"\"", "\\\", \\\"arguments\\\": \"",
				  "\", \\\"id\\\": \\\"\" [a-zA-Z0-9]{9} \"\\\"}\"", "\"[TOOL_CALLS][\" ",
				  "\", \"", " \"]\"", false },
	[MD_TOOL_FMT_LLAMA3] = { "\"{\\\"name\\\": \\\"\"", "\\\", \\\"parameters\\\": \"", "\"}\"",
				 "", "", "", true },
};

int md_tools_grammar(const struct md_tools *t, char **text, char *err, size_t errlen)
{
	*text = NULL;
	if (t->n == 0 || (t->choice != MD_TOOL_CHOICE_REQUIRED && t->choice != MD_TOOL_CHOICE_NAMED))
		return 0;
	const struct call_fmt *f = &call_fmts[MD_TOOL_FMT_HERMES];
	if (t->format == MD_TOOL_FMT_DEEPSEEK3 || t->format == MD_TOOL_FMT_MISTRAL ||
	    t->format == MD_TOOL_FMT_LLAMA3)
		f = &call_fmts[t->format];
	struct md_jgrammar *b = md_jgrammar_new();
	struct buf call = { 0 }, root = { 0 };
	int rc = -ENOMEM;
	if (!b)
		return -ENOMEM;
	puts_(&call, "( ");
	puts_(&call, f->pre);
	puts_(&call, " ( ");
	bool first = true;
	for (size_t i = 0; i < t->n; i++) {
		if (t->choice == MD_TOOL_CHOICE_NAMED && i != t->named)
			continue;
		const cJSON *params = cJSON_GetArrayItem(t->params, (int)i);
		char rule[32] = "j-object", e2[300];
		if (!cJSON_IsNull(params)) {
			rc = md_jgrammar_add(b, params, rule, sizeof(rule), e2, sizeof(e2));
			if (rc) {
				snprintf(err, errlen, "tools[%zu].function.parameters: %s", i, e2);
				goto out;
			}
		}
		if (!first)
			puts_(&call, " | ");
		puts_(&call, "\"");
		puts_(&call, t->names[i]); /* letters, digits, '_', '-': nothing to escape */
		puts_(&call, f->mid);
		puts_(&call, " ");
		puts_(&call, rule);
		first = false;
	}
	puts_(&call, " ) ");
	puts_(&call, f->post);
	puts_(&call, " )");
	puts_(&root, f->open);
	puts_(&root, call.s ? call.s : "");
	if (t->parallel && t->choice == MD_TOOL_CHOICE_REQUIRED && !f->one) {
		puts_(&root, " ( ");
		puts_(&root, f->sep);
		puts_(&root, " ");
		puts_(&root, call.s ? call.s : "");
		puts_(&root, " )*");
	}
	puts_(&root, f->close);
	rc = -ENOMEM;
	if (!call.oom && !root.oom)
		rc = md_jgrammar_finish(b, root.s, text);
	if (rc == -ENOMEM)
		snprintf(err, errlen, "out of memory");
out:
	free(call.s);
	free(root.s);
	md_jgrammar_free(b);
	return rc;
}

void md_tools_call_id(enum md_tool_fmt fmt, char *out, size_t cap)
{
	static const char al[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
	static uint64_t counter;
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	uint64_t seed = md_sampler_mix((uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^
				       (++counter << 52)), x = 0;
	size_t n = 0;
	int len = fmt == MD_TOOL_FMT_MISTRAL ? 9 : 24;
	if (cap < 6)
		return;
	if (fmt != MD_TOOL_FMT_MISTRAL) {
		memcpy(out, "call_", 5);
		n = 5;
	}
	/* 8 letters per 64-bit draw (62^8 < 2^48), each draw from its own mix of the seed */
	for (int i = 0; i < len && n + 1 < cap; i++) {
		if (i % 8 == 0)
			x = md_sampler_mix(seed + 0x9e3779b97f4a7c15ull * (uint64_t)(i / 8 + 1));
		out[n++] = al[x % 62];
		x /= 62;
	}
	out[n] = 0;
}

/* ---- the output parser ---- */

enum { ST_TEXT, ST_HEAD, ST_ARGS, ST_RAW, ST_OPEN, ST_TAIL, ST_NEXT, ST_START, ST_CONTENT };

static const char hermes_open[] = "<tool_call>";
static const char hermes_close[] = "</tool_call>";
static const char ds_open[] = "<｜tool▁call▁begin｜>";
static const char ds_close[] = "\n```<｜tool▁call▁end｜>";
static const char ds_calls_begin[] = "<｜tool▁calls▁begin｜>";
static const char ds_calls_end[] = "<｜tool▁calls▁end｜>";
static const char mistral_open[] = "[TOOL_CALLS]";
static const char python_tag[] = "<|python_tag|>";

void md_tool_parser_init(struct md_tool_parser *p, enum md_tool_fmt fmt, md_tool_emit_cb emit,
			 void *arg)
{
	memset(p, 0, sizeof(*p));
	p->fmt = fmt;
	p->emit = emit;
	p->arg = arg;
	if (fmt == MD_TOOL_FMT_LLAMA3)
		p->state = ST_START;
}

static const char *open_of(const struct md_tool_parser *p)
{
	return p->fmt == MD_TOOL_FMT_DEEPSEEK3 ? ds_open
	       : p->fmt == MD_TOOL_FMT_MISTRAL ? mistral_open
	       : p->fmt == MD_TOOL_FMT_LLAMA3 ? "" : hermes_open;
}

static const char *close_of(const struct md_tool_parser *p)
{
	return p->fmt == MD_TOOL_FMT_DEEPSEEK3 ? ds_close : hermes_close;
}

void md_tool_parser_release(struct md_tool_parser *p)
{
	free(p->buf);
	p->buf = NULL;
	p->n = p->cap = 0;
}

static void consume(struct md_tool_parser *p, size_t k)
{
	memmove(p->buf, p->buf + k, p->n - k);
	p->n -= k;
}

static bool is_ws(char c)
{
	return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}

/* The longest tail of s[0..n) that is a proper prefix of tag. */
static size_t partial_tail(const char *s, size_t n, const char *tag)
{
	size_t tl = strlen(tag);
	for (size_t k = tl - 1; k > 0; k--)
		if (k <= n && memcmp(s + n - k, tag, k) == 0)
			return k;
	return 0;
}

static const char *find(const char *s, size_t n, const char *tag)
{
	size_t tl = strlen(tag);
	for (size_t i = 0; i + tl <= n; i++)
		if (memcmp(s + i, tag, tl) == 0)
			return s + i;
	return NULL;
}

/* Match `{ "name" : "NAME" , "arguments" :` with any spacing at the start of s (with
 * also_params, "parameters" in place of "arguments" too). Returns 1 with the name and the bytes
 * used, 0 when s ends before a decision, -1 for another shape. */
static int match_head_json(const char *s, size_t n, char *name, size_t *used, bool also_params)
{
	const char *parts[] = { "{", "\"name\"", ":", "\"", NULL, "\"", ",", "\"arguments\"", ":" };
	size_t i = 0;
	for (size_t k = 0; k < sizeof(parts) / sizeof(parts[0]); k++) {
		if (k == 7 && also_params) {
			while (i < n && is_ws(s[i]))
				i++;
			if (i + 1 < n && s[i + 1] == 'p')
				parts[7] = "\"parameters\"";
		}
		if (k != 4 && k != 5) /* no spacing inside the name's quotes */
			while (i < n && is_ws(s[i]))
				i++;
		if (!parts[k]) {
			size_t l = 0;
			while (i < n && s[i] != '"') {
				if (s[i] == '\\' || l >= MAX_NAME)
					return -1;
				name[l++] = s[i++];
			}
			name[l] = 0;
			if (i >= n)
				return 0;
			if (l == 0)
				return -1;
			continue;
		}
		size_t pl = strlen(parts[k]);
		for (size_t j = 0; j < pl; j++, i++) {
			if (i >= n)
				return 0;
			if (s[i] != parts[k][j])
				return -1;
		}
	}
	while (i < n && is_ws(s[i]))
		i++;
	if (i >= n)
		return 0; /* the arguments' first byte decides nothing, but wait for it */
	*used = i;
	return 1;
}

/* Match `function<｜tool▁sep｜>NAME\n```json\n` (DeepSeek-V3). Same returns. */
static int match_head_ds(const char *s, size_t n, char *name, size_t *used)
{
	static const char pre[] = "function<｜tool▁sep｜>", post[] = "\n```json\n";
	size_t i = 0, l = 0;
	for (; i < sizeof(pre) - 1; i++) {
		if (i >= n)
			return 0;
		if (s[i] != pre[i])
			return -1;
	}
	while (i < n && s[i] != '\n') {
		if (l >= MAX_NAME)
			return -1;
		name[l++] = s[i++];
	}
	name[l] = 0;
	if (i >= n)
		return 0;
	if (l == 0)
		return -1;
	for (size_t k = 0; k < sizeof(post) - 1; k++, i++) {
		if (i >= n)
			return 0;
		if (s[i] != post[k])
			return -1;
	}
	*used = i;
	return 1;
}

/* The buffered text of a call that is not one, back out as content. */
static void call_as_content(struct md_tool_parser *p, size_t len)
{
	const char *open = open_of(p);
	if (p->n_ws)
		p->emit(p->arg, MD_TOOL_EV_CONTENT, -1, p->ws, p->n_ws);
	p->emit(p->arg, MD_TOOL_EV_CONTENT, -1, open, strlen(open));
	if (len)
		p->emit(p->arg, MD_TOOL_EV_CONTENT, -1, p->buf, len);
	p->n_ws = 0;
}

/* A whole call read with cJSON (the Hermes fallback; DeepSeek-V3 has no other shape). */
static void raw_call(struct md_tool_parser *p, size_t len)
{
	cJSON *o = p->fmt == MD_TOOL_FMT_HERMES ? cJSON_ParseWithLength(p->buf, len) : NULL;
	const cJSON *name = cJSON_GetObjectItemCaseSensitive(o, "name");
	const cJSON *args = cJSON_GetObjectItemCaseSensitive(o, "arguments");
	if (cJSON_IsObject(o) && cJSON_IsString(name) && valid_name(name->valuestring) &&
	    (!args || cJSON_IsObject(args) || cJSON_IsString(args))) {
		char *a = !args ? strdup("{}") : cJSON_IsString(args) ? strdup(args->valuestring)
								      : cJSON_PrintUnformatted(args);
		int idx = p->n_calls++;
		p->emit(p->arg, MD_TOOL_EV_BEGIN, idx, name->valuestring, strlen(name->valuestring));
		if (a)
			p->emit(p->arg, MD_TOOL_EV_ARGS, idx, a, strlen(a));
		free(a);
		p->n_ws = 0;
	} else {
		call_as_content(p, len + strlen(close_of(p)));
	}
	cJSON_Delete(o);
}

/* Outside calls: the first marker in buf (*which: 0 a call opens, 1 DeepSeek-V3's block
 * markers, dropped), or NULL; *hold gets how much of the tail may be a marker's start. */
static const char *find_marker(const struct md_tool_parser *p, int *which, size_t *hold)
{
	const char *open = open_of(p), *best = find(p->buf, p->n, open);
	*which = 0;
	*hold = partial_tail(p->buf, p->n, open);
	if (p->fmt != MD_TOOL_FMT_DEEPSEEK3)
		return best;
	const char *const extra[] = { ds_calls_begin, ds_calls_end };
	for (int k = 0; k < 2; k++) {
		const char *h = find(p->buf, p->n, extra[k]);
		if (h && (!best || h < best)) {
			best = h;
			*which = 1;
		}
		size_t t = partial_tail(p->buf, p->n, extra[k]);
		if (t > *hold)
			*hold = t;
	}
	return best;
}

static void process(struct md_tool_parser *p)
{
	bool ds = p->fmt == MD_TOOL_FMT_DEEPSEEK3;
	const char *close = close_of(p);
	size_t close_len = strlen(close);
	for (;;) {
		const char *hit;
		size_t e, hold;
		int which;
		switch (p->state) {
		case ST_TEXT:
			if ((hit = find_marker(p, &which, &hold))) {
				size_t i = (size_t)(hit - p->buf);
				size_t mlen = which ? strlen(strncmp(hit, ds_calls_begin,
								     strlen(ds_calls_begin)) == 0
								 ? ds_calls_begin : ds_calls_end)
						    : strlen(open_of(p));
				for (e = i; e > 0 && is_ws(p->buf[e - 1]) && i - e < sizeof(p->ws); e--)
					;
				if (e)
					p->emit(p->arg, MD_TOOL_EV_CONTENT, -1, p->buf, e);
				p->n_ws = i - e; /* held: dropped if a call follows */
				memcpy(p->ws, p->buf + e, p->n_ws);
				consume(p, i + mlen);
				if (!which)
					p->state = ST_HEAD;
				continue;
			}
			e = p->n - hold;
			while (e > 0 && is_ws(p->buf[e - 1]))
				e--;
			if (e) {
				if (p->n_ws) /* whitespace before a block marker: text after all */
					p->emit(p->arg, MD_TOOL_EV_CONTENT, -1, p->ws, p->n_ws);
				p->n_ws = 0;
				p->emit(p->arg, MD_TOOL_EV_CONTENT, -1, p->buf, e);
				consume(p, e);
			}
			return;
		case ST_HEAD: {
			char name[MAX_NAME + 1];
			size_t used = 0;
			int r = ds ? match_head_ds(p->buf, p->n, name, &used)
				   : match_head_json(p->buf, p->n, name, &used, false);
			if (r == 0 && p->n < 1024)
				return;
			/* arguments given as a JSON string need decoding: read the call whole */
			if (r <= 0 || (!ds && p->buf[used] == '"')) {
				p->state = ST_RAW;
				continue;
			}
			p->n_ws = 0;
			p->emit(p->arg, MD_TOOL_EV_BEGIN, p->n_calls++, name, strlen(name));
			consume(p, used);
			p->state = ST_ARGS;
			continue;
		}
		case ST_ARGS:
			if ((hit = find(p->buf, p->n, close))) {
				size_t j = (size_t)(hit - p->buf);
				e = j;
				if (!ds) {
					while (e > 0 && is_ws(p->buf[e - 1]))
						e--;
					if (e > 0 && p->buf[e - 1] == '}')
						e--; /* the call's own closing brace */
					while (e > 0 && is_ws(p->buf[e - 1]))
						e--;
				}
				if (e)
					p->emit(p->arg, MD_TOOL_EV_ARGS, p->n_calls - 1, p->buf, e);
				consume(p, j + close_len);
				p->state = ST_TEXT;
				continue;
			}
			/* everything before the last '}' (Hermes: it may be the call's brace) or the
			 * last newline (DeepSeek-V3: it may open the closing fence) is arguments */
			e = p->n;
			while (e > 0 && p->buf[e - 1] != (ds ? '\n' : '}'))
				e--;
			e = e > 0 ? e - 1 : p->n - partial_tail(p->buf, p->n, close);
			if (e) {
				p->emit(p->arg, MD_TOOL_EV_ARGS, p->n_calls - 1, p->buf, e);
				consume(p, e);
			}
			return;
		default: /* ST_RAW */
			if (!(hit = find(p->buf, p->n, close)))
				return;
			raw_call(p, (size_t)(hit - p->buf));
			consume(p, (size_t)(hit - p->buf) + close_len);
			p->state = ST_TEXT;
			continue;
		}
	}
}

/* ---- Mistral and Llama 3.1: calls as JSON objects ---- */

static void scan_reset(struct md_tool_parser *p)
{
	p->_jdepth = 0;
	p->_jstr = p->_jesc = p->_jstarted = p->_jscalar = false;
}

/* Feed s[0..n) to the scanner of one JSON value (leading whitespace skipped). Returns how many
 * bytes belong to the value, with *done set when it ends there (a scalar ends before the byte
 * that ends it); n when it goes on. */
static size_t scan_value(struct md_tool_parser *p, const char *s, size_t n, bool *done)
{
	*done = false;
	for (size_t i = 0; i < n; i++) {
		char c = s[i];
		if (!p->_jstarted) {
			if (is_ws(c))
				continue;
			p->_jstarted = true;
			p->_jscalar = c != '{' && c != '[' && c != '"';
		}
		if (p->_jstr) {
			if (p->_jesc) {
				p->_jesc = false;
			} else if (c == '\\') {
				p->_jesc = true;
			} else if (c == '"') {
				p->_jstr = false;
				if (p->_jdepth == 0) {
					*done = true;
					return i + 1;
				}
			}
			continue;
		}
		if (p->_jscalar) {
			if (is_ws(c) || c == ',' || c == '}' || c == ']') {
				*done = true;
				return i;
			}
			continue;
		}
		if (c == '"') {
			p->_jstr = true;
		} else if (c == '{' || c == '[') {
			p->_jdepth++;
		} else if ((c == '}' || c == ']') && --p->_jdepth <= 0) {
			*done = true;
			return i + 1;
		}
	}
	return n;
}

/* Skip to the end of the object whose members are being read (its closing brace at depth 0).
 * Returns the bytes up to and with it, or 0 when it is not in s yet (all of s scanned). */
static size_t scan_tail(struct md_tool_parser *p, const char *s, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		char c = s[i];
		if (p->_jstr) {
			if (p->_jesc)
				p->_jesc = false;
			else if (c == '\\')
				p->_jesc = true;
			else if (c == '"')
				p->_jstr = false;
		} else if (c == '"') {
			p->_jstr = true;
		} else if (c == '{' || c == '[') {
			p->_jdepth++;
		} else if ((c == '}' || c == ']') && p->_jdepth-- == 0) {
			return i + 1;
		}
	}
	return 0;
}

/* A call object read whole (its head had another shape): name and arguments (an object or a
 * JSON string; for Llama 3.1 "parameters" too). Returns true when it was a call. */
static bool raw_object(struct md_tool_parser *p, const char *s, size_t len)
{
	cJSON *o = cJSON_ParseWithLength(s, len);
	const cJSON *name = cJSON_GetObjectItemCaseSensitive(o, "name");
	const cJSON *args = cJSON_GetObjectItemCaseSensitive(o, "arguments");
	if (!args && p->fmt == MD_TOOL_FMT_LLAMA3)
		args = cJSON_GetObjectItemCaseSensitive(o, "parameters");
	bool ok = cJSON_IsObject(o) && cJSON_IsString(name) && valid_name(name->valuestring) &&
		  (!args || cJSON_IsObject(args) || cJSON_IsString(args));
	if (ok) {
		char *a = !args ? strdup("{}") : cJSON_IsString(args) ? strdup(args->valuestring)
								      : cJSON_PrintUnformatted(args);
		int idx = p->n_calls++;
		p->emit(p->arg, MD_TOOL_EV_BEGIN, idx, name->valuestring, strlen(name->valuestring));
		if (a)
			p->emit(p->arg, MD_TOOL_EV_ARGS, idx, a, strlen(a));
		free(a);
	}
	cJSON_Delete(o);
	return ok;
}

static size_t skip_ws(const struct md_tool_parser *p)
{
	size_t e = 0;
	while (e < p->n && is_ws(p->buf[e]))
		e++;
	return e;
}

/* What was taken for the start of a call is content after all (the held whitespace and, for
 * Mistral's first call, the marker and the bracket). */
static void give_back(struct md_tool_parser *p)
{
	if (p->n_ws)
		p->emit(p->arg, MD_TOOL_EV_CONTENT, -1, p->ws, p->n_ws);
	p->n_ws = 0;
	if (p->fmt == MD_TOOL_FMT_MISTRAL && p->n_calls == 0) {
		p->emit(p->arg, MD_TOOL_EV_CONTENT, -1, mistral_open, sizeof(mistral_open) - 1);
		if (p->_arr)
			p->emit(p->arg, MD_TOOL_EV_CONTENT, -1, "[", 1);
	}
	p->_arr = false;
}

static void process_json(struct md_tool_parser *p)
{
	bool llama = p->fmt == MD_TOOL_FMT_LLAMA3;
	for (;;) {
		const char *hit;
		size_t e, k;
		bool done;
		switch (p->state) {
		case ST_START: /* Llama 3.1: a call only at the very start */
			e = skip_ws(p);
			if (e == p->n)
				return;
			k = partial_tail(p->buf + e, p->n - e, python_tag);
			if (k && k == p->n - e)
				return;
			if (p->n - e >= sizeof(python_tag) - 1 &&
			    memcmp(p->buf + e, python_tag, sizeof(python_tag) - 1) == 0) {
				consume(p, e + sizeof(python_tag) - 1);
				continue;
			}
			if (p->buf[e] != '{') {
				p->state = ST_CONTENT;
				continue;
			}
			p->n_ws = e < sizeof(p->ws) ? e : sizeof(p->ws);
			memcpy(p->ws, p->buf, p->n_ws);
			consume(p, e);
			p->state = ST_HEAD;
			continue;
		case ST_CONTENT:
			if (p->n)
				p->emit(p->arg, MD_TOOL_EV_CONTENT, -1, p->buf, p->n);
			p->n = 0;
			return;
		case ST_TEXT: /* Mistral: content until [TOOL_CALLS] */
			if ((hit = find(p->buf, p->n, mistral_open))) {
				size_t i = (size_t)(hit - p->buf);
				for (e = i; e > 0 && is_ws(p->buf[e - 1]) && i - e < sizeof(p->ws); e--)
					;
				if (e)
					p->emit(p->arg, MD_TOOL_EV_CONTENT, -1, p->buf, e);
				p->n_ws = i - e;
				memcpy(p->ws, p->buf + e, p->n_ws);
				consume(p, i + sizeof(mistral_open) - 1);
				p->_arr = false;
				p->state = ST_OPEN;
				continue;
			}
			e = p->n - partial_tail(p->buf, p->n, mistral_open);
			while (e > 0 && is_ws(p->buf[e - 1]))
				e--;
			if (e) {
				p->emit(p->arg, MD_TOOL_EV_CONTENT, -1, p->buf, e);
				consume(p, e);
			}
			return;
		case ST_OPEN: /* after [TOOL_CALLS]: the array (or one bare object) */
			e = skip_ws(p);
			if (e == p->n)
				return;
			p->_arr = p->buf[e] == '[';
			if (p->_arr)
				consume(p, e + 1);
			p->state = ST_HEAD;
			continue;
		case ST_HEAD: {
			char name[MAX_NAME + 1];
			size_t used = 0;
			e = skip_ws(p);
			int r = match_head_json(p->buf + e, p->n - e, name, &used, llama);
			if (r == 0 && p->n < 1024)
				return;
			if (r <= 0 || p->buf[e + used] == '"') {
				p->state = ST_RAW;
				continue;
			}
			p->n_ws = 0;
			p->_arr = false;
			p->emit(p->arg, MD_TOOL_EV_BEGIN, p->n_calls++, name, strlen(name));
			consume(p, e + used);
			scan_reset(p);
			p->state = ST_ARGS;
			continue;
		}
		case ST_ARGS:
			k = scan_value(p, p->buf, p->n, &done);
			if (k)
				p->emit(p->arg, MD_TOOL_EV_ARGS, p->n_calls - 1, p->buf, k);
			consume(p, k);
			if (!done)
				return;
			scan_reset(p);
			p->state = ST_TAIL;
			continue;
		case ST_TAIL: /* the rest of the call object (Mistral's "id"), dropped */
			if (!(k = scan_tail(p, p->buf, p->n))) {
				consume(p, p->n);
				return;
			}
			consume(p, k);
			p->state = ST_NEXT;
			continue;
		case ST_NEXT:
			for (e = 0; e < p->n && (is_ws(p->buf[e]) || (llama && p->buf[e] == ';')); e++)
				;
			if (e == p->n) {
				consume(p, e);
				return;
			}
			if (!llama && (p->buf[e] == ',' || p->buf[e] == ']')) {
				p->state = p->buf[e] == ',' ? ST_HEAD : ST_TEXT;
				consume(p, e + 1);
				continue;
			}
			consume(p, e);
			p->state = !llama ? ST_TEXT : p->buf[0] == '{' ? ST_HEAD : ST_CONTENT;
			continue;
		default: /* ST_RAW: one call object read whole */
			e = skip_ws(p);
			if (e == p->n)
				return;
			if (p->buf[e] == '{') {
				scan_reset(p);
				k = scan_value(p, p->buf + e, p->n - e, &done);
				if (!done && p->n < (1u << 20))
					return; /* rescanned whole when more arrives */
				if (done && raw_object(p, p->buf + e, k)) {
					p->n_ws = 0;
					p->_arr = false;
					consume(p, e + k);
					p->state = ST_NEXT;
					continue;
				}
			}
			give_back(p);
			p->state = llama ? ST_CONTENT : ST_TEXT;
			if (!llama) { /* the rest is content; a later [TOOL_CALLS] may open calls */
				p->emit(p->arg, MD_TOOL_EV_CONTENT, -1, p->buf, p->n);
				p->n = 0;
				return;
			}
			continue;
		}
	}
}

int md_tool_parser_push(struct md_tool_parser *p, const char *s, size_t n)
{
	if (p->failed) {
		if (n)
			p->emit(p->arg, MD_TOOL_EV_CONTENT, -1, s, n);
		return 0;
	}
	if (p->n + n + 1 > p->cap) {
		size_t nc = p->cap ? p->cap * 2 : 256;
		while (nc < p->n + n + 1)
			nc *= 2;
		char *nb = realloc(p->buf, nc);
		if (!nb) {
			/* pass on what is held and everything after as content */
			p->failed = true;
			if (p->n)
				p->emit(p->arg, MD_TOOL_EV_CONTENT, -1, p->buf, p->n);
			p->n = 0;
			if (n)
				p->emit(p->arg, MD_TOOL_EV_CONTENT, -1, s, n);
			return -ENOMEM;
		}
		p->buf = nb;
		p->cap = nc;
	}
	memcpy(p->buf + p->n, s, n);
	p->n += n;
	if (p->fmt == MD_TOOL_FMT_MISTRAL || p->fmt == MD_TOOL_FMT_LLAMA3)
		process_json(p);
	else
		process(p);
	return 0;
}

void md_tool_parser_finish(struct md_tool_parser *p)
{
	if (p->fmt == MD_TOOL_FMT_MISTRAL || p->fmt == MD_TOOL_FMT_LLAMA3) {
		if (p->failed)
			return;
		switch (p->state) {
		case ST_ARGS: /* an unfinished call keeps what it has */
			if (p->n)
				p->emit(p->arg, MD_TOOL_EV_ARGS, p->n_calls - 1, p->buf, p->n);
			break;
		case ST_TAIL:
		case ST_NEXT:
			break;
		case ST_OPEN:
		case ST_HEAD:
		case ST_RAW: /* a call that never was: content, with its marker */
			give_back(p);
			/* fall through */
		default:
			if (p->n)
				p->emit(p->arg, MD_TOOL_EV_CONTENT, -1, p->buf, p->n);
			break;
		}
		p->n_ws = 0;
		p->n = 0;
		p->state = p->fmt == MD_TOOL_FMT_LLAMA3 ? ST_CONTENT : ST_TEXT;
		return;
	}
	if (p->failed || (p->n == 0 && (p->state == ST_TEXT || p->state == ST_ARGS)))
		return;
	switch (p->state) {
	case ST_TEXT:
		p->emit(p->arg, MD_TOOL_EV_CONTENT, -1, p->buf, p->n);
		break;
	case ST_ARGS:
		p->emit(p->arg, MD_TOOL_EV_ARGS, p->n_calls - 1, p->buf, p->n);
		break;
	default:
		call_as_content(p, p->n);
		break;
	}
	p->n_ws = 0;
	p->n = 0;
	p->state = ST_TEXT;
}
