/* Test driver: renders JSON-described conversations with md_chat_render_opts and prints JSON. */
#include "engine/chat_template.h"

#include <cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/*
 * stdin:  {"cases": [{"family": "qwen3", "template": "...", "messages": [{"role","content"}],
 *          "add_generation_prompt": true, "enable_thinking": false, "bos": "<s>",
 *          "eos": "</s>"}, ...]}
 *         "family" picks the formatter; without it the formatter is the one detected from
 *         "template". Either may be absent; "enable_thinking" absent means undefined.
 *         Tools: "tools": ["<tool text>", ...] (in the family's md_chat_tool_text form); a
 *         message may have "tool_calls": [{"id": "...", "function": {"name": "...",
 *         "arguments": "<JSON text>"}, "arguments_obj": "<tojson of the parsed arguments>"}]
 *         and "tool_call_id"; "thinking": an assistant turn's reasoning (gpt-oss's name for
 *         it); "date_string" sets llama3.2's date; gpt-oss: "date", "reasoning_effort".
 * stdout: [{"detect_rc": 0, "detected": "qwen3", "detect_err": "", "rc": 0, "text": "..."}]
 *         detect_* only when "template" was given; text is null when rc != 0.
 */

static char *read_all(FILE *f)
{
	size_t cap = 1 << 16, n = 0;
	char *buf = malloc(cap);

	if (!buf)
		return NULL;
	for (;;) {
		size_t got;

		if (n + 1 >= cap) {
			char *p = realloc(buf, cap * 2);

			if (!p) {
				free(buf);
				return NULL;
			}
			buf = p;
			cap *= 2;
		}
		got = fread(buf + n, 1, cap - n - 1, f);
		if (got == 0)
			break;
		n += got;
	}
	buf[n] = '\0';
	return buf;
}

static const char *str_or(const cJSON *obj, const char *key, const char *dflt)
{
	const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, key);

	return cJSON_IsString(it) ? it->valuestring : dflt;
}

static cJSON *run_case(const cJSON *c)
{
	cJSON *res = cJSON_CreateObject();
	const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(c, "messages");
	const cJSON *tmpl = cJSON_GetObjectItemCaseSensitive(c, "template");
	const cJSON *agp = cJSON_GetObjectItemCaseSensitive(c, "add_generation_prompt");
	const cJSON *think = cJSON_GetObjectItemCaseSensitive(c, "enable_thinking");
	const char *fam_name = str_or(c, "family", NULL);
	enum md_chat_family fam = MD_CHAT_CHATML;
	bool have_fam = false;
	struct md_chat_msg *m = NULL;
	size_t n = 0;
	struct md_chat_opts o = {
		.add_generation_prompt = cJSON_IsTrue(agp),
		.enable_thinking = cJSON_IsBool(think) ? cJSON_IsTrue(think) : -1,
		.bos_text = str_or(c, "bos", NULL),
		.eos_text = str_or(c, "eos", NULL),
		.date_text = str_or(c, "date", NULL),
		.reasoning_effort = str_or(c, "reasoning_effort", NULL),
		.date_string = str_or(c, "date_string", NULL),
	};
	char *text = NULL;
	size_t len = 0;
	int rc;

	if (cJSON_IsString(tmpl)) {
		char err[512] = "";
		enum md_chat_family d;
		int drc = md_chat_template_detect_err(tmpl->valuestring, strlen(tmpl->valuestring),
						      &d, err, sizeof(err));

		cJSON_AddNumberToObject(res, "detect_rc", drc);
		if (drc == 0) {
			cJSON_AddStringToObject(res, "detected", md_chat_family_name(d));
			fam = d;
			have_fam = true;
		} else {
			cJSON_AddNullToObject(res, "detected");
		}
		cJSON_AddStringToObject(res, "detect_err", err);
	}
	if (fam_name) {
		rc = md_chat_template_by_name(fam_name, &fam);
		if (rc != 0) {
			cJSON_AddNumberToObject(res, "rc", rc);
			cJSON_AddNullToObject(res, "text");
			return res;
		}
		have_fam = true;
	}
	if (!have_fam || !cJSON_IsArray(msgs)) {
		cJSON_AddNumberToObject(res, "rc", -ENOENT);
		cJSON_AddNullToObject(res, "text");
		return res;
	}
	n = (size_t)cJSON_GetArraySize(msgs);
	m = calloc(n ? n : 1, sizeof(*m));
	if (!m) {
		fprintf(stderr, "out of memory\n");
		exit(2);
	}
	const cJSON *tools = cJSON_GetObjectItemCaseSensitive(c, "tools");
	size_t n_tools = cJSON_IsArray(tools) ? (size_t)cJSON_GetArraySize(tools) : 0;
	const char **tool_text = calloc(n_tools ? n_tools : 1, sizeof(char *));
	struct md_chat_tool_call *calls = calloc(64 * (n ? n : 1), sizeof(*calls));

	if (!tool_text || !calls) {
		fprintf(stderr, "out of memory\n");
		exit(2);
	}
	for (size_t i = 0; i < n_tools; i++) {
		const cJSON *t = cJSON_GetArrayItem(tools, (int)i);

		tool_text[i] = cJSON_IsString(t) ? t->valuestring : "";
	}
	o.tools = tool_text;
	o.n_tools = n_tools;
	for (size_t i = 0; i < n; i++) {
		const cJSON *it = cJSON_GetArrayItem(msgs, (int)i);
		const cJSON *tc = cJSON_GetObjectItemCaseSensitive(it, "tool_calls"), *call;

		m[i].role = str_or(it, "role", NULL);
		m[i].content = str_or(it, "content", NULL);
		m[i].reasoning = str_or(it, "thinking", NULL);
		if (cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(it, "content"))) {
			m[i].content = "";
			m[i].content_null = true;
		}
		m[i].tool_call_id = str_or(it, "tool_call_id", NULL);
		m[i].tool_calls = calls + 64 * i;
		cJSON_ArrayForEach(call, tc) {
			const cJSON *fn = cJSON_GetObjectItemCaseSensitive(call, "function");

			if (m[i].n_tool_calls == 64)
				break;
			calls[64 * i + m[i].n_tool_calls].name = str_or(fn, "name", NULL);
			calls[64 * i + m[i].n_tool_calls].arguments = str_or(fn, "arguments", NULL);
			calls[64 * i + m[i].n_tool_calls].arguments_obj =
				str_or(call, "arguments_obj", NULL);
			calls[64 * i + m[i].n_tool_calls].id = str_or(call, "id", NULL);
			m[i].n_tool_calls++;
		}
	}
	rc = md_chat_render_opts(fam, m, n, &o, &text, &len);
	free(tool_text);
	free(calls);
	cJSON_AddNumberToObject(res, "rc", rc);
	if (rc == 0) {
		if (strlen(text) != len)
			fprintf(stderr, "length mismatch: strlen %zu, out_len %zu\n", strlen(text), len);
		cJSON_AddStringToObject(res, "text", text);
	} else {
		cJSON_AddNullToObject(res, "text");
	}
	free(text);
	free(m);
	return res;
}

int main(void)
{
	char *in = read_all(stdin);
	cJSON *root, *cases, *out;
	const cJSON *c;
	char *s;

	if (!in) {
		fprintf(stderr, "render_chat: cannot read stdin\n");
		return 2;
	}
	root = cJSON_Parse(in);
	free(in);
	cases = cJSON_GetObjectItemCaseSensitive(root, "cases");
	if (!cJSON_IsArray(cases)) {
		fprintf(stderr, "render_chat: expected {\"cases\": [...]} on stdin\n");
		cJSON_Delete(root);
		return 2;
	}
	out = cJSON_CreateArray();
	cJSON_ArrayForEach(c, cases)
		cJSON_AddItemToArray(out, run_case(c));
	s = cJSON_PrintUnformatted(out);
	if (!s) {
		fprintf(stderr, "render_chat: out of memory\n");
		return 2;
	}
	fputs(s, stdout);
	fputc('\n', stdout);
	free(s);
	cJSON_Delete(out);
	cJSON_Delete(root);
	return 0;
}
