/* A model's text side: tokenizer, chat template, incremental detokenizer, bound from GGUF. */
#include "engine/text.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

static void copy_token_text(const struct md_tokenizer *tok, int32_t id, char *out, size_t cap)
{
	size_t len;
	const char *s;
	if (id >= 0 && (s = md_tokenizer_token_text(tok, id, &len)) && len < cap) {
		memcpy(out, s, len);
		out[len] = 0;
	}
}

int md_text_load(struct md_text *t, const struct md_gguf *g, const char *chat_template,
		 char *err, size_t errlen)
{
	memset(t, 0, sizeof(*t));
	char why[400] = "";
	int rc = md_tokenizer_load(&t->tok, g, why, sizeof(why));
	if (rc) {
		snprintf(err, errlen, "cannot load tokenizer: %s", why);
		return rc;
	}
	copy_token_text(t->tok, md_tokenizer_bos(t->tok), t->bos_text, sizeof(t->bos_text));
	copy_token_text(t->tok, md_tokenizer_eos(t->tok), t->eos_text, sizeof(t->eos_text));

	if (chat_template && chat_template[0]) {
		if (md_chat_template_by_name(chat_template, &t->chat)) {
			snprintf(err, errlen, "unknown chat template '%s' (known: %s)", chat_template,
				 md_chat_template_names());
			rc = -EINVAL;
			goto fail_tok;
		}
		return 0;
	}
	struct md_gguf_str js = { 0 };
	if (!md_gguf_get_str(g, "tokenizer.chat_template", &js) || js.len == 0) {
		t->chat = MD_CHAT_CHATML;
		md_log(MD_LOG_WARN, "model has no chat template; using chatml");
		return 0;
	}
	if (md_chat_template_detect_err(js.ptr, js.len, &t->chat, err, errlen)) {
		rc = -EINVAL;
		goto fail_tok;
	}
	return 0;

fail_tok:
	md_tokenizer_free(t->tok);
	t->tok = NULL;
	return rc;
}

void md_text_release(struct md_text *t)
{
	md_tokenizer_free(t->tok);
	t->tok = NULL;
}

int md_text_chat_tokenize(const struct md_text *t, const struct md_chat_msg *msgs, size_t n,
			  int32_t **ids)
{
	return md_text_chat_tokenize_tools(t, msgs, n, NULL, 0, ids);
}

int md_text_chat_tokenize_tools(const struct md_text *t, const struct md_chat_msg *msgs, size_t n,
				const char *const *tools, size_t n_tools, int32_t **ids)
{
	return md_text_chat_tokenize_effort(t, msgs, n, tools, n_tools, NULL, ids);
}

int md_text_chat_tokenize_effort(const struct md_text *t, const struct md_chat_msg *msgs, size_t n,
				 const char *const *tools, size_t n_tools,
				 const char *reasoning_effort, int32_t **ids)
{
	char *text = NULL;
	size_t len = 0;
	struct md_chat_opts o = {
		.add_generation_prompt = true, .enable_thinking = -1, .bos_text = t->bos_text,
		.eos_text = t->eos_text, .tools = tools, .n_tools = n_tools,
		.reasoning_effort = reasoning_effort,
	};
	int rc = md_chat_render_opts(t->chat, msgs, n, &o, &text, &len);
	if (rc)
		return rc;
	bool has_bos = t->bos_text[0] && strncmp(text, t->bos_text, strlen(t->bos_text)) == 0;
	rc = md_tokenizer_encode(t->tok, text, len, !has_bos, true, ids);
	free(text);
	return rc;
}
