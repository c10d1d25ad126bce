/* Tool calling: the request's tools and tool_choice, the grammar of forced calls, and the
 * parser that turns a model's tool-call text into OpenAI tool calls. */
#ifndef MD_TOOLS_H
#define MD_TOOLS_H

/*
 * DESIGN
 * Format: the one the model's chat template renders (engine/chat_template.h): Hermes/Qwen3
 *   <tool_call>\n{"name": "NAME", "arguments": ARGS}\n</tool_call>
 * with parallel calls separated by a newline, DeepSeek-V3's tool tokens, Mistral's
 *   [TOOL_CALLS][{"name": "NAME", "arguments": ARGS, "id": "ID"}, ...]
 * (ids of 9 letters and digits, which the template requires back), or Llama 3.1's reply that
 * is one JSON object {"name": "NAME", "parameters": ARGS} (enum md_tool_fmt).
 *
 * Request side (md_tools_*): tools are read into the text the template writes for each (the
 * form engine/chat_template.h md_chat_tool_text names), names and parameter schemas. tool_choice "auto" lets the model choose (nothing is
 * forced; the parser picks up calls it writes); "none" renders the tools but parses nothing;
 * "required" and a named function compile a grammar of one call (or, with parallel_tool_calls,
 * one or more) whose arguments follow the tool's parameter schema (server/json_schema.h), so
 * even a model that never saw the format produces valid calls.
 *
 * Output side (md_tool_parser): text arrives in pieces (after stop strings). Outside a call it
 * is content, except a tail that could begin "<tool_call>" (held) and whitespace right before
 * a call (dropped). Inside a call the head up to `"arguments": ` is matched (any spacing), and
 * then the arguments stream out as they come, holding back only the text from the last '}' on
 * (it may be the call's own closing brace); "</tool_call>" ends the call. A call whose head
 * does not have that shape is buffered whole and read with cJSON at its end; one that still
 * does not parse goes out as content. So streamed argument fragments concatenate to exactly
 * the arguments of the whole response. Mistral and Llama 3.1 calls are JSON objects whose
 * arguments end where their JSON value does (a small scanner follows strings and nesting);
 * the rest of the object (Mistral's "id") is read and dropped, the OpenAI id being moed's own.
 * A Llama 3.1 call is recognised only at the start of the reply (after whitespace and an
 * optional <|python_tag|>), where the template puts it: a reply that starts otherwise is
 * content throughout.
 *
 * Loop thread (cJSON).
 */

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stddef.h>

/* How the model writes calls: md_engine_tool_format()'s values. */
enum md_tool_fmt {
	MD_TOOL_FMT_NONE = 0,
	MD_TOOL_FMT_HERMES = 1,    /* <tool_call>\n{"name": N, "arguments": A}\n</tool_call> */
	MD_TOOL_FMT_DEEPSEEK3 = 2, /* <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N
				    * \n```json\nA\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜> */
	MD_TOOL_FMT_MISTRAL = 3,   /* [TOOL_CALLS][{"name": N, "arguments": A, "id": "..."}, ...] */
	MD_TOOL_FMT_LLAMA3 = 4,    /* {"name": N, "parameters": A} (the whole reply) */
};

/* The form of each tool's text: engine/chat_template.h md_chat_tool_text's values. */
enum md_tool_text {
	MD_TOOL_TEXT_TOJSON = 0,   /* tool | tojson */
	MD_TOOL_TEXT_INDENT4 = 1,  /* tool | tojson(indent=4) */
	MD_TOOL_TEXT_MISTRAL = 2,  /* {"type": "function", "function": {...}} as Mistral writes */
};

enum md_tool_choice {
	MD_TOOL_CHOICE_AUTO = 0,
	MD_TOOL_CHOICE_NONE,
	MD_TOOL_CHOICE_REQUIRED,
	MD_TOOL_CHOICE_NAMED,
};

struct md_tools {
	size_t n;
	char **json;          /* owned (n): each tool's text in the template's form */
	char **names;         /* owned (n) */
	cJSON *params;        /* owned: array of the tools' parameter schemas (null: none) */
	enum md_tool_choice choice;
	size_t named;         /* MD_TOOL_CHOICE_NAMED: the tool */
	bool parallel;        /* parallel_tool_calls (default true) */
	enum md_tool_fmt format; /* the model's call format (for the forced-call grammar) */
};

/* Read "tools" (an array of {"type":"function","function":{"name",...}}), each tool's text in
 * the form given. Returns 0, or -EINVAL with a message in err, or -ENOMEM. t must be released
 * either way. */
int md_tools_parse(struct md_tools *t, const cJSON *tools, enum md_tool_text form, char *err,
		   size_t errlen);
/* Read "tool_choice" (after md_tools_parse). Returns 0 or -EINVAL with a message. */
int md_tools_set_choice(struct md_tools *t, const cJSON *choice, char *err, size_t errlen);
/* Grammar text that forces the calls tool_choice asks for (required or named): *text is
 * malloc'd, or NULL when nothing is forced (auto, none, no tools). Returns 0, -EINVAL (a
 * parameter schema moed cannot enforce, named in err) or -ENOMEM. */
int md_tools_grammar(const struct md_tools *t, char **text, char *err, size_t errlen);
void md_tools_release(struct md_tools *t);

/* v as Jinja's tojson writes it (", " and ": " separators, key order kept, non-ASCII as is):
 * a malloc'd string or NULL when out of memory. */
char *md_tools_tojson(const cJSON *v);
/* v as `tojson(indent=4)` writes it (Python's json.dumps(indent=4): "," at line ends, ": "
 * between key and value, [] and {} when empty), or NULL when out of memory. */
char *md_tools_tojson_indent(const cJSON *v);

/* ---- the output parser ---- */

enum md_tool_ev {
	MD_TOOL_EV_CONTENT,   /* text (s, n) is content */
	MD_TOOL_EV_BEGIN,     /* call index begins: s is its name (NUL-terminated) */
	MD_TOOL_EV_ARGS,      /* more arguments text (s, n) of call index */
};

typedef void (*md_tool_emit_cb)(void *arg, enum md_tool_ev ev, int index, const char *s,
				size_t n);

struct md_tool_parser {
	enum md_tool_fmt fmt;
	md_tool_emit_cb emit;
	void *arg;            /* borrowed */
	int state;
	char *buf;            /* owned (cap): text not yet passed on */
	size_t n, cap;
	int n_calls;
	bool failed;          /* out of memory: text is passed through as content */
	char ws[64];          /* whitespace before a call, given back if the call is not one */
	size_t n_ws;
	/* the JSON scanner (Mistral, Llama 3.1): where a value or object ends */
	int _jdepth;
	bool _jstr, _jesc, _jstarted, _jscalar;
	bool _arr;            /* Mistral: the '[' after the marker was read */
};

void md_tool_parser_init(struct md_tool_parser *p, enum md_tool_fmt fmt, md_tool_emit_cb emit,
			 void *arg);
void md_tool_parser_release(struct md_tool_parser *p);
/* More output text. Returns 0 or -ENOMEM (the parser then passes text on as content). */
int md_tool_parser_push(struct md_tool_parser *p, const char *s, size_t n);
/* The end of the output: pass on what is held (an unfinished call keeps what it has). */
void md_tool_parser_finish(struct md_tool_parser *p);

/* A fresh tool call id into out (cap >= 32): "call_" and 24 letters and digits, or for
 * Mistral's format 9 letters and digits (what its template takes back). */
void md_tools_call_id(enum md_tool_fmt fmt, char *out, size_t cap);

#endif
