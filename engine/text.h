/* A model's text side: tokenizer, chat template, incremental detokenizer, bound from GGUF. */
#ifndef MD_TEXT_H
#define MD_TEXT_H

/*
 * DESIGN
 * Everything the server needs to turn text into tokens and back, without touching the model's
 * weights: the tokenizer (tokenizer.c), the chat-template family chosen for the file (or named
 * by the operator), and the BOS/EOS texts templates write. Built once while loading, read-only
 * afterwards, so any thread may call the functions below once md_text_load has returned.
 */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/chat_template.h"
#include "engine/gguf.h"
#include "engine/tokenizer.h"

struct md_text {
	struct md_tokenizer *tok;  /* owned */
	enum md_chat_family chat;
	char bos_text[64], eos_text[64];
};

/* Bind the tokenizer and chat template of a GGUF file. chat_template: a built-in template name
 * that overrides the file's own, or NULL/"" to detect it from tokenizer.chat_template (absent:
 * chatml, with a warning). Returns 0 or a negative code with one line in err. */
int md_text_load(struct md_text *t, const struct md_gguf *g, const char *chat_template,
		 char *err, size_t errlen);
void md_text_release(struct md_text *t);

/* Render a chat (generation prompt appended) and tokenize it, adding BOS only where the model
 * wants one and the template did not write it. Returns the count with a malloc'd array in
 * *ids, -EINVAL when the template rejects the messages, or another negative code. */
int md_text_chat_tokenize(const struct md_text *t, const struct md_chat_msg *msgs, size_t n,
			  int32_t **ids);
/* The same with tools (chat_template.h md_chat_opts.tools; n_tools may be 0); -ENOTSUP when
 * the template has no tool format and the chat uses tools. */
int md_text_chat_tokenize_tools(const struct md_text *t, const struct md_chat_msg *msgs, size_t n,
				const char *const *tools, size_t n_tools, int32_t **ids);
/* The same with a reasoning effort (md_chat_opts.reasoning_effort; NULL: the default). */
int md_text_chat_tokenize_effort(const struct md_text *t, const struct md_chat_msg *msgs, size_t n,
				 const char *const *tools, size_t n_tools,
				 const char *reasoning_effort, int32_t **ids);

#endif
