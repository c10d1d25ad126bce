/* Unit tests for server/tools.c: the tool-call parser gives the same content and calls however
 * the text is split into pieces (every split point, and byte by byte), streams arguments,
 * falls back to reading a call whole, and leaves malformed calls as content; tojson matches
 * the template engine's format; tools and tool_choice are checked. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "engine/grammar.h"
#include "server/tools.h"
#include "tests/check.h"

/* What the parser emitted, flattened: content, then per call "name(args)". */
struct out {
	char content[2048];
	char calls[8][512];
	char names[8][80];
	int n_calls;
	int n_args_events;
};

static void on_emit(void *arg, enum md_tool_ev ev, int index, const char *s, size_t n)
{
	struct out *o = arg;
	if (ev == MD_TOOL_EV_CONTENT) {
		strncat(o->content, s, n);
	} else if (ev == MD_TOOL_EV_BEGIN) {
		CHECK_EQ_I(index, o->n_calls);
		snprintf(o->names[o->n_calls++], 80, "%.*s", (int)n, s);
	} else {
		REQUIRE(CHECK(index >= 0 && index < o->n_calls));
		strncat(o->calls[index], s, n);
		o->n_args_events++;
	}
}

static enum md_tool_fmt fmt = MD_TOOL_FMT_HERMES;

/* Parse text cut at the given split points (sorted, within the text). */
static void parse_split(const char *text, const size_t *cuts, size_t n_cuts, struct out *o)
{
	struct md_tool_parser p;
	memset(o, 0, sizeof(*o));
	md_tool_parser_init(&p, fmt, on_emit, o);
	size_t at = 0, len = strlen(text);
	for (size_t i = 0; i <= n_cuts; i++) {
		size_t end = i < n_cuts ? cuts[i] : len;
		CHECK_EQ_I(md_tool_parser_push(&p, text + at, end - at), 0);
		at = end;
	}
	md_tool_parser_finish(&p);
	md_tool_parser_release(&p);
}

static void same(const struct out *a, const struct out *b, const char *what)
{
	CHECK_MSG(strcmp(a->content, b->content) == 0, "%s: content '%s' vs '%s'", what, a->content,
		  b->content);
	CHECK_MSG(a->n_calls == b->n_calls, "%s: %d vs %d calls", what, a->n_calls, b->n_calls);
	for (int i = 0; i < a->n_calls && i < b->n_calls; i++) {
		CHECK_STR_EQ(a->names[i], b->names[i]);
		CHECK_STR_EQ(a->calls[i], b->calls[i]);
	}
}

/* The whole text at once, then every single split point, then byte by byte. */
static void check_text(const char *text, const char *content, int n_calls, const char *const *names,
		       const char *const *args)
{
	struct out whole, part;
	parse_split(text, NULL, 0, &whole);
	CHECK_STR_EQ(whole.content, content);
	CHECK_EQ_I(whole.n_calls, n_calls);
	for (int i = 0; i < n_calls && i < whole.n_calls; i++) {
		CHECK_STR_EQ(whole.names[i], names[i]);
		CHECK_STR_EQ(whole.calls[i], args[i]);
	}
	size_t len = strlen(text);
	for (size_t c = 1; c < len; c++) {
		parse_split(text, &c, 1, &part);
		CHECK_CONTEXT("split at %zu of '%s'", c, text);
		same(&part, &whole, "one split");
		CHECK_CONTEXT_CLEAR();
	}
	size_t *cuts = malloc(sizeof(size_t) * len);
	for (size_t c = 1; c < len; c++)
		cuts[c - 1] = c;
	parse_split(text, cuts, len ? len - 1 : 0, &part);
	same(&part, &whole, "byte by byte");
	free(cuts);
}

static void test_parser(void)
{
	/* plain content, including things that look like the start of a tag */
	check_text("Hello <tool and <b> world", "Hello <tool and <b> world", 0, NULL, NULL);
	/* one call, Hermes spacing, nothing else */
	{
		const char *n[] = { "get_weather" };
		const char *a[] = { "{\"city\": \"Paris\", \"unit\": \"c\"}" };
		check_text("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
			   "\"unit\": \"c\"}}\n</tool_call>", "", 1, n, a);
	}
	/* content before, two parallel calls, nested braces in the arguments */
	{
		const char *n[] = { "a", "b-2" };
		const char *a[] = { "{\"x\": {\"y\": [1, {\"z\": \"}\"}]}}", "{}" };
		check_text("Let me look.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": {\"y\": [1, "
			   "{\"z\": \"}\"}]}}}\n</tool_call>\n<tool_call>\n{\"name\":\"b-2\",\"arguments\":{}}"
			   "\n</tool_call>", "Let me look.", 2, n, a);
	}
	/* another key order: read whole with cJSON; arguments given as a string pass as they are */
	{
		const char *n[] = { "f", "g" };
		const char *a[] = { "{\"k\":1}", "{\"s\": 2}" };
		check_text("<tool_call>{\"arguments\": {\"k\": 1}, \"name\": \"f\"}</tool_call>"
			   "<tool_call>{\"name\": \"g\", \"arguments\": \"{\\\"s\\\": 2}\"}</tool_call>",
			   "", 2, n, a);
	}
	/* malformed calls stay content */
	check_text("x <tool_call>not json</tool_call> y", "x <tool_call>not json</tool_call> y", 0,
		   NULL, NULL);
	/* an unfinished call at the end: what arrived of it */
	{
		struct out o;
		parse_split("ok <tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1", NULL, 0, &o);
		CHECK_STR_EQ(o.content, "ok");
		CHECK_EQ_I(o.n_calls, 1);
		CHECK_STR_EQ(o.calls[0], "{\"a\": 1");
		parse_split("ok <tool_call>\n{\"na", NULL, 0, &o);
		CHECK_STR_EQ(o.content, "ok <tool_call>\n{\"na");
		parse_split("ok\n<tool_call>", NULL, 0, &o);
		CHECK_STR_EQ(o.content, "ok\n<tool_call>");
		CHECK_EQ_I(o.n_calls, 0);
	}
	/* arguments stream: pushed in pieces, they come out before the call ends */
	{
		struct md_tool_parser p;
		struct out o = { 0 };
		md_tool_parser_init(&p, MD_TOOL_FMT_HERMES, on_emit, &o);
		const char *head = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"q\": \"abc";
		md_tool_parser_push(&p, head, strlen(head));
		CHECK_EQ_I(o.n_calls, 1);
		CHECK_STR_EQ(o.calls[0], "{\"q\": \"abc");
		md_tool_parser_push(&p, "def\"}", 5);
		CHECK_STR_EQ(o.calls[0], "{\"q\": \"abcdef\""); /* the '}' may be the call's */
		md_tool_parser_push(&p, "}\n</tool_call>", 14);
		CHECK_STR_EQ(o.calls[0], "{\"q\": \"abcdef\"}");
		md_tool_parser_finish(&p);
		md_tool_parser_release(&p);
	}
}

/* DeepSeek-V3's tool tokens: content, block markers dropped, calls, arguments with newlines. */
static void test_parser_deepseek(void)
{
	fmt = MD_TOOL_FMT_DEEPSEEK3;
	const char *n[] = { "get_weather", "add" };
	const char *a[] = { "{\"city\": \"Paris\"}", "{\n  \"a\": 1,\n  \"b\": 2\n}" };
	check_text("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
		   "get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n"
		   "<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{\n  \"a\": 1,\n  \"b\": 2\n}"
		   "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Checking.", 2, n, a);
	check_text("no calls here, just text", "no calls here, just text", 0, NULL, NULL);
	check_text("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>other<｜tool▁sep｜>x<｜tool▁call▁end｜>"
		   "\n```<｜tool▁call▁end｜>", "<｜tool▁call▁begin｜>other<｜tool▁sep｜>x<｜tool▁call▁end｜>"
		   "\n```<｜tool▁call▁end｜>", 0, NULL, NULL);
	fmt = MD_TOOL_FMT_HERMES;
}

/* Mistral's [TOOL_CALLS]: arguments end with their JSON value, the "id" is dropped, parallel
 * calls in one array, content before; a marker without a call stays content. */
static void test_parser_mistral(void)
{
	fmt = MD_TOOL_FMT_MISTRAL;
	{
		const char *n[] = { "get_weather", "add" };
		const char *a[] = { "{\"city\": \"Pa}ris\", \"n\": [1, {\"z\": \"]\"}]}", "{\"a\": 1}" };
		check_text("Sure. [TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": "
			   "\"Pa}ris\", \"n\": [1, {\"z\": \"]\"}]}, \"id\": \"abc123XYZ\"}, {\"name\":\"add\","
			   "\"arguments\":{\"a\": 1},\"id\":\"q\\\"}]\"}]", "Sure.", 2, n, a);
	}
	{
		/* no ids, no brackets after the marker (one bare object), then text after */
		const char *n[] = { "f" };
		const char *a[] = { "{}" };
		check_text("[TOOL_CALLS]{\"name\": \"f\", \"arguments\": {}} done", "done", 1, n, a);
	}
	{
		/* another key order and string arguments: read whole */
		const char *n[] = { "f", "g" };
		const char *a[] = { "{\"k\":1}", "{\"s\": 2}" };
		check_text("[TOOL_CALLS][{\"arguments\": {\"k\": 1}, \"name\": \"f\"}, {\"name\": \"g\", "
			   "\"arguments\": \"{\\\"s\\\": 2}\", \"id\": \"123456789\"}]", "", 2, n, a);
	}
	check_text("plain [TOOL and [INST] text", "plain [TOOL and [INST] text", 0, NULL, NULL);
	check_text("x [TOOL_CALLS] nope", "x [TOOL_CALLS] nope", 0, NULL, NULL);
	check_text("x [TOOL_CALLS][{\"q\": 1}] y", "x [TOOL_CALLS][{\"q\": 1}] y", 0, NULL, NULL);
	{
		/* unfinished at the end: the arguments so far */
		struct out o;
		parse_split("[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": [1", NULL, 0, &o);
		CHECK_EQ_I(o.n_calls, 1);
		CHECK_STR_EQ(o.calls[0], "{\"a\": [1");
		parse_split("ok [TOOL_CALLS][{\"na", NULL, 0, &o);
		CHECK_STR_EQ(o.content, "ok [TOOL_CALLS][{\"na");
	}
	fmt = MD_TOOL_FMT_HERMES;
}

/* Llama 3.1: a call is the reply itself (after whitespace or <|python_tag|>); "parameters" or
 * "arguments"; a reply that starts otherwise is content, braces and all. */
static void test_parser_llama(void)
{
	fmt = MD_TOOL_FMT_LLAMA3;
	{
		const char *n[] = { "get_weather" };
		const char *a[] = { "{\"city\": \"Paris\", \"d\": {\"x\": \"}{\"}}" };
		check_text("\n {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"d\": "
			   "{\"x\": \"}{\"}}}", "", 1, n, a);
	}
	{
		const char *n[] = { "a", "b" };
		const char *a[] = { "{\"x\":1}", "{}" };
		check_text("<|python_tag|>{\"name\":\"a\",\"arguments\":{\"x\":1}}; {\"name\": \"b\", "
			   "\"parameters\": {}}", "", 2, n, a);
	}
	{
		/* other key orders: read whole */
		const char *n[] = { "f" };
		const char *a[] = { "{\"k\":[1,2]}" };
		check_text("{\"type\": \"function\", \"name\": \"f\", \"parameters\": {\"k\": [1, 2]}}", "", 1,
			   n, a);
	}
	check_text("The answer is {\"name\": \"x\"}", "The answer is {\"name\": \"x\"}", 0, NULL, NULL);
	check_text("{\"answer\": 42} is JSON", "{\"answer\": 42} is JSON", 0, NULL, NULL);
	check_text("  plain text", "  plain text", 0, NULL, NULL);
	{
		struct out o;
		parse_split("{\"name\": \"f\", \"parameters\": {\"q\": \"ab", NULL, 0, &o);
		CHECK_EQ_I(o.n_calls, 1);
		CHECK_STR_EQ(o.calls[0], "{\"q\": \"ab");
		parse_split("{\"name\": \"f", NULL, 0, &o);
		CHECK_STR_EQ(o.content, "{\"name\": \"f");
		CHECK_EQ_I(o.n_calls, 0);
	}
	fmt = MD_TOOL_FMT_HERMES;
}

/* The grammar of forced calls in fmt accepts call and rejects bad. */
static void check_forced(enum md_tool_fmt f, bool parallel, const char *call, const char *bad)
{
	char err[300];
	struct md_tools t;
	cJSON *tools = cJSON_Parse("[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":"
				   "{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"integer\"}},"
				   "\"required\":[\"x\"],\"additionalProperties\":false}}}]");
	REQUIRE(CHECK_EQ_I(md_tools_parse(&t, tools, MD_TOOL_TEXT_TOJSON, err, sizeof(err)), 0));
	cJSON *req = cJSON_CreateString("required");
	CHECK_EQ_I(md_tools_set_choice(&t, req, err, sizeof(err)), 0);
	t.format = f;
	t.parallel = parallel;
	char *g = NULL;
	REQUIRE(CHECK_EQ_I(md_tools_grammar(&t, &g, err, sizeof(err)), 0));
	struct md_grammar *gg = NULL;
	REQUIRE(CHECK_EQ_I(md_grammar_parse(g, strlen(g), &gg, err, sizeof(err)), 0));
	static char one[256][1];
	const char *pc[257];
	size_t pl[257];
	bool eog[257] = { 0 };
	for (int i = 0; i < 256; i++) {
		one[i][0] = (char)i;
		pc[i] = one[i];
		pl[i] = 1;
	}
	pc[256] = "";
	pl[256] = 0;
	eog[256] = true;
	struct md_gvocab *v;
	REQUIRE(CHECK_EQ_I(md_gvocab_new_pieces(&v, pc, pl, eog, 257), 0));
	struct md_gmatch *m;
	REQUIRE(CHECK_EQ_I(md_gmatch_new(&m, gg, v), 0));
	CHECK_CONTEXT("grammar %s", g);
	CHECK_EQ_I(md_gmatch_accept_bytes(m, call, strlen(call)), 0);
	CHECK(md_gmatch_is_final(m));
	md_gmatch_free(m);
	REQUIRE(CHECK_EQ_I(md_gmatch_new(&m, gg, v), 0));
	CHECK(md_gmatch_accept_bytes(m, bad, strlen(bad)) != 0 || !md_gmatch_is_final(m));
	CHECK_CONTEXT_CLEAR();
	md_gmatch_free(m);
	md_gvocab_free(v);
	md_grammar_unref(gg);
	free(g);
	md_tools_release(&t);
	cJSON_Delete(tools);
	cJSON_Delete(req);
}

static void test_forced(void)
{
	check_forced(MD_TOOL_FMT_MISTRAL, true,
		     "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"x\": 3}, \"id\": \"a1B2c3D4e\"}, "
		     "{\"name\": \"f\", \"arguments\": {\"x\": -1}, \"id\": \"000000000\"}]",
		     "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"x\": 3}, \"id\": \"short\"}]");
	check_forced(MD_TOOL_FMT_MISTRAL, false,
		     "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"x\": 3}, \"id\": \"a1B2c3D4e\"}]",
		     "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"x\": 3}, \"id\": \"a1B2c3D4e\"}, "
		     "{\"name\": \"f\", \"arguments\": {\"x\": 3}, \"id\": \"a1B2c3D4e\"}]");
	/* Llama 3.1: one call even with parallel_tool_calls (the template takes one per turn) */
	check_forced(MD_TOOL_FMT_LLAMA3, true, "{\"name\": \"f\", \"parameters\": {\"x\": 7}}",
		     "{\"name\": \"f\", \"parameters\": {\"x\": 7}}{\"name\": \"f\", \"parameters\": "
		     "{\"x\": 7}}");
	char id[40];
	md_tools_call_id(MD_TOOL_FMT_MISTRAL, id, sizeof(id));
	CHECK_EQ_U(strlen(id), 9);
	for (int i = 0; i < 9; i++)
		CHECK((id[i] >= '0' && id[i] <= '9') || (id[i] >= 'a' && id[i] <= 'z') ||
		      (id[i] >= 'A' && id[i] <= 'Z'));
}

/* The tool texts of the other templates: `tojson(indent=4)` and Mistral's own (strings as
 * they are, "return" left out), as @huggingface/jinja renders the real templates' pieces. */
static void test_tool_text(void)
{
	char err[300];
	struct md_tools t;
	cJSON *tools = cJSON_Parse("[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"description\":"
				   "\"Does \\\"x\\\" \\u00e9\",\"parameters\":{\"type\":\"object\","
				   "\"properties\":{\"x\":{\"type\":\"integer\"},\"e\":{}},\"required\":"
				   "[\"x\"]},\"strict\":true,\"return\":{\"type\":\"string\"}}}]");
	REQUIRE(CHECK_EQ_I(md_tools_parse(&t, tools, MD_TOOL_TEXT_INDENT4, err, sizeof(err)), 0));
	CHECK_STR_EQ(t.json[0], "{\n    \"type\": \"function\",\n    \"function\": {\n        \"name\": "
		     "\"f\",\n        \"description\": \"Does \\\"x\\\" \xc3\xa9\",\n        \"parameters\": "
		     "{\n            \"type\": \"object\",\n            \"properties\": {\n                "
		     "\"x\": {\n                    \"type\": \"integer\"\n                },\n         "
		     "       \"e\": {}\n            },\n            \"required\": [\n                \"x\"\n"
		     "            ]\n        },\n        \"strict\": true,\n        \"return\": {\n     "
		     "       \"type\": \"string\"\n        }\n    }\n}");
	md_tools_release(&t);
	REQUIRE(CHECK_EQ_I(md_tools_parse(&t, tools, MD_TOOL_TEXT_MISTRAL, err, sizeof(err)), 0));
	CHECK_STR_EQ(t.json[0], "{\"type\": \"function\", \"function\": {\"name\": \"f\", \"description\": "
		     "\"Does \"x\" \xc3\xa9\", \"parameters\": {\"type\": \"object\", \"properties\": "
		     "{\"x\": {\"type\": \"integer\"}, \"e\": {}}, \"required\": [\"x\"]}, \"strict\": "
		     "true}}");
	md_tools_release(&t);
	cJSON_Delete(tools);
}

static void test_tojson(void)
{
	cJSON *v = cJSON_Parse("{\"a\":1,\"b\":[1,\"\\u00e9\\\"\\\\\\n<\"],\"c\":{\"d\":null,\"e\":true,"
			       "\"f\":1.5,\"h\":0.1},\"g\":[]}");
	char *s = md_tools_tojson(v);
	/* what @huggingface/jinja and transformers write for `x | tojson` */
	CHECK_STR_EQ(s, "{\"a\": 1, \"b\": [1, \"\xc3\xa9\\\"\\\\\\n<\"], \"c\": {\"d\": null, \"e\": true, "
		     "\"f\": 1.5, \"h\": 0.1}, \"g\": []}");
	free(s);
	cJSON_Delete(v);
}

static void test_request(void)
{
	char err[300];
	struct md_tools t;
	cJSON *tools = cJSON_Parse("[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":"
				   "{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"integer\"}},"
				   "\"required\":[\"x\"]}}},{\"type\":\"function\",\"function\":"
				   "{\"name\":\"g\"}}]");
	REQUIRE(CHECK_EQ_I(md_tools_parse(&t, tools, MD_TOOL_TEXT_TOJSON, err, sizeof(err)), 0));
	CHECK_EQ_U(t.n, 2);
	CHECK_STR_EQ(t.names[1], "g");
	CHECK_STR_EQ(t.json[1], "{\"type\": \"function\", \"function\": {\"name\": \"g\"}}");
	char *g = NULL;
	CHECK_EQ_I(md_tools_grammar(&t, &g, err, sizeof(err)), 0);
	CHECK(g == NULL); /* auto forces nothing */
	cJSON *req = cJSON_CreateString("required");
	CHECK_EQ_I(md_tools_set_choice(&t, req, err, sizeof(err)), 0);
	CHECK_EQ_I(md_tools_grammar(&t, &g, err, sizeof(err)), 0);
	CHECK(g && strstr(g, "<tool_call>") && strstr(g, "\"f\\\", \\\"arguments\\\": \""));
	free(g);
	t.format = MD_TOOL_FMT_DEEPSEEK3;
	CHECK_EQ_I(md_tools_grammar(&t, &g, err, sizeof(err)), 0);
	CHECK(g && strstr(g, "<｜tool▁calls▁begin｜>") && strstr(g, "<｜tool▁sep｜>"));
	/* the grammar compiles and accepts a DeepSeek-V3 call */
	struct md_grammar *gg = NULL;
	REQUIRE(CHECK_EQ_I(md_grammar_parse(g, strlen(g), &gg, err, sizeof(err)), 0));
	free(g);
	static char one[256][1];
	const char *pc[257];
	size_t pl[257];
	bool eog[257] = { 0 };
	for (int i = 0; i < 256; i++) {
		one[i][0] = (char)i;
		pc[i] = one[i];
		pl[i] = 1;
	}
	pc[256] = "";
	pl[256] = 0;
	eog[256] = true;
	struct md_gvocab *v;
	REQUIRE(CHECK_EQ_I(md_gvocab_new_pieces(&v, pc, pl, eog, 257), 0));
	struct md_gmatch *m;
	REQUIRE(CHECK_EQ_I(md_gmatch_new(&m, gg, v), 0));
	const char *call = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n"
			   "{\"x\": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
	CHECK_EQ_I(md_gmatch_accept_bytes(m, call, strlen(call)), 0);
	CHECK(md_gmatch_is_final(m));
	md_gmatch_free(m);
	md_gvocab_free(v);
	md_grammar_unref(gg);
	t.format = MD_TOOL_FMT_HERMES;
	cJSON *named = cJSON_Parse("{\"type\":\"function\",\"function\":{\"name\":\"zz\"}}");
	CHECK_EQ_I(md_tools_set_choice(&t, named, err, sizeof(err)), -EINVAL);
	CHECK(strstr(err, "'zz'") != NULL);
	cJSON *bad = cJSON_CreateString("sometimes");
	CHECK_EQ_I(md_tools_set_choice(&t, bad, err, sizeof(err)), -EINVAL);
	md_tools_release(&t);
	cJSON *dup = cJSON_Parse("[{\"type\":\"function\",\"function\":{\"name\":\"f\"}},"
				 "{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]");
	CHECK_EQ_I(md_tools_parse(&t, dup, MD_TOOL_TEXT_TOJSON, err, sizeof(err)), -EINVAL);
	CHECK(strstr(err, "twice") != NULL);
	md_tools_release(&t);
	cJSON_Delete(tools);
	cJSON_Delete(req);
	cJSON_Delete(named);
	cJSON_Delete(bad);
	cJSON_Delete(dup);

	char id1[40], id2[40];
	md_tools_call_id(MD_TOOL_FMT_HERMES, id1, sizeof(id1));
	md_tools_call_id(MD_TOOL_FMT_HERMES, id2, sizeof(id2));
	CHECK_EQ_U(strlen(id1), 29);
	CHECK(strncmp(id1, "call_", 5) == 0 && strcmp(id1, id2) != 0);
	CHECK(strcmp(id1 + 15, id2 + 15) != 0); /* the tail varies too */
}

int main(void)
{
	test_parser();
	test_parser_deepseek();
	test_parser_mistral();
	test_parser_llama();
	test_forced();
	test_tool_text();
	test_tojson();
	test_request();
	return failures ? 1 : 0;
}
