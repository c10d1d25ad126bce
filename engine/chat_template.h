/* Built-in chat formatters that reproduce, byte for byte, the Jinja chat templates of known models. */
#ifndef MD_CHAT_TEMPLATE_H
#define MD_CHAT_TEMPLATE_H

#include <stdbool.h>
#include <stddef.h>

/*
 * One value per exact template, not per loose family: two templates that differ in a single
 * space or default system prompt get two values, because the model was trained on one of them.
 * The comment names the template each formatter reproduces and its --chat-template name.
 */
enum md_chat_family {
	MD_CHAT_CHATML,     /* "chatml": plain ChatML, no default system (Dolphin-Mixtral) */
	MD_CHAT_QWEN3,      /* "qwen3": Qwen3 hybrid thinking (Qwen3-0.6B ... Qwen3-235B-A22B) */
	MD_CHAT_MISTRAL,    /* "mistral": Mixtral-8x7B-Instruct-v0.1 (system folded into turn 1) */
	MD_CHAT_TULU,       /* "tulu": Tulu 3 (<|user|>\n ... <|assistant|>\n), no BOS */
	MD_CHAT_LLAMA3,     /* "llama3": Meta-Llama-3-8B/70B-Instruct (not 3.1+) */
	MD_CHAT_DEEPSEEK3,  /* "deepseek3": DeepSeek-V3 (not R1 / V3.1 with <think>) */
	MD_CHAT_CHATML_BOS, /* "chatml-bos": bos_token + ChatML (Nous-Hermes-2-Mixtral) */
	MD_CHAT_QWEN15,     /* "qwen1.5": Qwen1.5 chat (Qwen1.5-MoE-A2.7B-Chat) */
	MD_CHAT_QWEN2,      /* "qwen2": Qwen2-Instruct (Qwen2-57B-A14B-Instruct) */
	MD_CHAT_QWEN25,     /* "qwen2.5": Qwen2.5-Instruct, default "You are Qwen..." system */
	MD_CHAT_MISTRAL_V1, /* "mistral-v1": Mistral-7B-Instruct v0.1/v0.2, no system role */
	MD_CHAT_OLMO2,      /* "olmo2": bos_token + Tulu 3 (OLMo-2-1124-Instruct) */
	MD_CHAT_GPT_OSS,    /* "gpt-oss": OpenAI's harmony format (gpt-oss-20b/120b) */
	MD_CHAT_MISTRAL_NEMO, /* "mistral-nemo": Mistral-Nemo-Instruct-2407, with tools
			       * ([AVAILABLE_TOOLS], [TOOL_CALLS], [TOOL_RESULTS]) */
	MD_CHAT_LLAMA31,    /* "llama3.1": Meta-Llama-3.1-Instruct, JSON tool calls, the
			     * template's fixed "26 Jul 2024" date */
	MD_CHAT_LLAMA32,    /* "llama3.2": Llama-3.2-Instruct: llama3.1 with today's date
			     * (strftime_now) and no built-in tools */
	MD_CHAT_GLM45,      /* "glm4.5": GLM-4.5/4.6 ([gMASK]<sop>, <think></think> turns; no tools) */
	MD_CHAT_FAMILY_COUNT
};

/* A tool call of an earlier assistant turn (OpenAI's tool_calls[i].function). */
struct md_chat_tool_call {
	const char *name;      /* borrowed */
	const char *arguments; /* borrowed: the arguments' JSON text as the client sent it */
	/* borrowed, may be NULL: the arguments as `tojson` writes the parsed value (what the
	 * templates that take arguments as an object render: mistral-nemo, llama3.1/3.2, as
	 * llama.cpp's and vLLM's servers hand them over); NULL when they do not parse, which
	 * those families refuse (-EINVAL) */
	const char *arguments_obj;
	const char *id;        /* borrowed, may be NULL: the call's id (mistral-nemo writes it) */
};

/* One message. role and content are borrowed for the duration of the call and must be
 * non-NULL; role is "system" (or its alias "developer"), "user", "assistant" or "tool"
 * (anything else is -EINVAL).
 * An assistant message may carry tool calls; a tool message is a tool's result. */
struct md_chat_msg {
	const char *role;
	const char *content;
	const struct md_chat_tool_call *tool_calls; /* borrowed (n_tool_calls), assistant only */
	size_t n_tool_calls;
	bool content_null;     /* the client sent null content (content is then ""): templates
				* that tell null from "" (deepseek3) see it */
	const char *reasoning; /* borrowed, NULL: none. An assistant turn's reasoning (OpenAI's
				* reasoning_content; gpt-oss's template calls it `thinking` and
				* renders it only in a conversation's closing assistant turn) */
	const char *tool_call_id; /* borrowed, may be NULL: a tool message's call id */
};

/* Knobs a template reads beyond the messages (the Jinja context variables). */
struct md_chat_opts {
	bool add_generation_prompt;
	/* Qwen3's enable_thinking: -1 leaves it undefined (the template's default: thinking on),
	 * 0 renders it false (an empty <think></think> block after the generation prompt),
	 * 1 renders it true (same as undefined). Ignored by other families. */
	int enable_thinking;
	const char *bos_text; /* borrowed: bos_token as text, NULL = "" (only where used) */
	const char *eos_text; /* borrowed: eos_token as text, NULL = "" (only where used) */
	/* The request's tools, each as the template's `tool | tojson` writes it (JSON with ", "
	 * and ": " separators, keys in the client's order, non-ASCII unescaped). Borrowed
	 * (n_tools). */
	const char *const *tools;
	size_t n_tools;
	/* gpt-oss: the system header's "Current date" (YYYY-MM-DD; NULL: today, local time, as
	 * the template's strftime_now does) and "Reasoning" effort (NULL: "medium"). */
	const char *date_text;
	const char *reasoning_effort;
	/* llama3.2's date_string ("26 Jul 2024" style); NULL: today's (local time), as the
	 * template's strftime_now("%d %b %Y") gives it. llama3.1's template fixes its own. */
	const char *date_string;
};

/*
 * gpt-oss (harmony): a system header (identity, knowledge cutoff, date, reasoning effort,
 * valid channels), a leading system or developer message as the developer's "# Instructions",
 * user turns, assistant turns in the final channel (<|end|> after history, <|return|> closing
 * a conversation that ends with the assistant, its reasoning in the analysis channel before
 * it), the generation prompt "<|start|>assistant". Later system messages are dropped, as the
 * template drops them. Text holding channel tags raises, as the template does (-EINVAL).
 * Tools (the TypeScript-like namespace, calls in the commentary channel) are not rendered
 * yet: -ENOTSUP.
 *
 * Tools: the families whose templates render tools do so in their own format (qwen3: the
 * Hermes format, a "# Tools" system block with <tools></tools>, calls as
 * <tool_call>{"name": ..., "arguments": ...}</tool_call>, results as <tool_response> in a user
 * turn). chatml's own template has no tool format; with tools, tool calls or tool messages it
 * renders them as Qwen3 does (without Qwen3's reasoning blocks), the format the default model's
 * family uses. deepseek3 writes calls and results with DeepSeek-V3's tool tokens, exactly as its
 * template does (which has no place for the tool list itself, and writes a call only for an
 * assistant turn whose content is null: md_chat_msg.content_null). mistral-nemo lists the tools
 * in [AVAILABLE_TOOLS] before the last user turn, writes calls as [TOOL_CALLS][...] with their
 * 9-character ids and results as [TOOL_RESULTS]{"content": ..., "call_id": ...}; its template
 * raises (-EINVAL here) for an id of another length. llama3.1/3.2 put the tools, indented JSON,
 * in the first user turn, write a call as {"name": ..., "parameters": ...} (one per assistant
 * turn: more is -EINVAL, as the template raises) and a result as an ipython turn holding the
 * content as a JSON string. Every other family refuses tools and tool messages with -ENOTSUP.
 */
bool md_chat_family_has_tools(enum md_chat_family f);

/* The form each of md_chat_opts.tools must have for a family: `tool | tojson` (qwen3, chatml,
 * deepseek3), `tool | tojson(indent=4)` (llama3.1/3.2: Python's json.dumps indent, item
 * separator "," at line ends), or mistral-nemo's own rendering of one tool:
 * {"type": "function", "function": {ITEMS}} where ITEMS are the function object's members in
 * order (except "return") joined by ", ", each `"key": "value"` with the string value as is
 * (not escaped) or `"key": ` + tojson(value) for any other value. */
enum md_chat_tool_text {
	MD_CHAT_TOOL_TOJSON = 0,
	MD_CHAT_TOOL_TOJSON_INDENT4,
	MD_CHAT_TOOL_MISTRAL,
};
enum md_chat_tool_text md_chat_family_tool_text(enum md_chat_family f);

/* The format a family's model writes tool calls in (what the output parser reads). */
enum md_tool_format {
	MD_TOOL_FORMAT_NONE = 0,
	MD_TOOL_FORMAT_HERMES,    /* <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call> */
	MD_TOOL_FORMAT_DEEPSEEK3, /* <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
				   * \n```json\nARGS\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜> */
	MD_TOOL_FORMAT_MISTRAL,   /* [TOOL_CALLS][{"name": N, "arguments": A, "id": "9 chars"}, ...] */
	MD_TOOL_FORMAT_LLAMA3,    /* {"name": N, "parameters": A} as the whole reply (one call) */
};
enum md_tool_format md_chat_family_tool_format(enum md_chat_family f);

/*
 * Recognise the GGUF's tokenizer.chat_template. Matching is by distinctive pieces of the
 * template after whitespace, quote style and `x.y` / `x['y']` spelling are normalised, and a
 * template that carries features a formatter does not reproduce (Llama-3.1 date header,
 * <think> in DeepSeek-R1, ...) is refused rather than approximated.
 * Returns 0 and sets *out, or -ENOENT when no built-in formatter renders this template
 * exactly (also for jinja == NULL or len == 0). When err is non-NULL, a one-line message
 * fit for the load-time log is written there on failure (truncated to errlen).
 */
int md_chat_template_detect_err(const char *jinja, size_t len, enum md_chat_family *out,
                                char *err, size_t errlen);
int md_chat_template_detect(const char *jinja, size_t len, enum md_chat_family *out);

/* --chat-template NAME: the names in the enum comments ("mixtral" is an alias of
 * "mistral"). Returns 0, or -ENOENT for an unknown name. */
int md_chat_template_by_name(const char *name, enum md_chat_family *out);

/* The --chat-template name of a family (static string), "?" when out of range. */
const char *md_chat_family_name(enum md_chat_family f);

/* All accepted names, comma-separated (static string), for help and error messages. */
const char *md_chat_template_names(void);

/*
 * Render messages as the model's template does. *out receives a malloc'd NUL-terminated
 * string owned by the caller, *out_len (out_len may be NULL) its length. Pure function of its
 * arguments; safe from any thread. bos/eos appear in the output only where the template writes
 * bos_token / eos_token: when the text starts with bos_text the caller must not add BOS again.
 * Returns 0, -EINVAL where the model's template raises an error (roles that do not alternate
 * in the Mistral templates, a system message for mistral-v1) or for n == 0, a NULL string or
 * an unknown role, -ENOTSUP for tools in a family without a tool format, -ENOMEM. On failure
 * *out is NULL.
 */
int md_chat_render_opts(enum md_chat_family f, const struct md_chat_msg *msgs, size_t n,
                        const struct md_chat_opts *opts, char **out, size_t *out_len);

/* md_chat_render_opts with enable_thinking left undefined. */
int md_chat_render(enum md_chat_family f, const struct md_chat_msg *msgs, size_t n,
                   bool add_generation_prompt, const char *bos_text, const char *eos_text,
                   char **out, size_t *out_len);

#endif
