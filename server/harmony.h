/* The output side of gpt-oss's harmony format: the model's channels as content and reasoning. */
#ifndef MD_HARMONY_H
#define MD_HARMONY_H

/*
 * After the generation prompt "<|start|>assistant" a gpt-oss model writes messages, each a
 * header and a body:
 *     <|channel|>analysis<|message|>...reasoning...<|end|>
 *     <|start|>assistant<|channel|>final<|message|>...answer...   (<|return|> ends generation)
 * The header names the channel (and, for tool calls, a recipient " to=functions.NAME" and a
 * "<|constrain|>json" content type). The control tokens reach this parser as their text (the
 * detokenizer renders them), in pieces of any size.
 *
 * The analysis channel becomes reasoning (OpenAI's message.reasoning_content, streamed as
 * delta.reasoning_content, as llama.cpp's server and vLLM send it); the final channel, and
 * commentary addressed to no tool (a preamble), become content. Tool calls (a header with
 * "to=") are not parsed yet: their bodies are dropped, so no JSON meant for a tool reaches the
 * user as text. The markers themselves never reach the client.
 *
 * A model that does not write harmony: a header that grows past MD_HARMONY_MAX_HEADER bytes
 * without <|message|>, or text left in a header at the end that holds no <|channel|> or
 * <|start|> (a header cut off by the end of generation), is content, so nothing the model
 * wrote is lost.
 *
 * One parser per choice, on the loop thread; no allocation beyond the header buffer.
 */

#include <stdbool.h>
#include <stddef.h>

#define MD_HARMONY_MAX_HEADER 256

enum md_harmony_ev {
	MD_HARMONY_CONTENT,   /* final channel (or a preamble): message content */
	MD_HARMONY_REASONING, /* analysis channel: reasoning_content */
};

/* Receives the parser's output in order; s is valid only during the call (n > 0). */
typedef void (*md_harmony_emit_cb)(void *arg, enum md_harmony_ev ev, const char *s, size_t n);

struct md_harmony {
	md_harmony_emit_cb emit;
	void *arg;                  /* borrowed: passed to emit */
	enum { HM_HEADER, HM_BODY } _state;
	int _dest;                  /* in a body: enum md_harmony_ev, or -1 (dropped) */
	char _buf[MD_HARMONY_MAX_HEADER + 16]; /* the header so far, or a body's held tail */
	size_t _n;
};

void md_harmony_init(struct md_harmony *h, md_harmony_emit_cb emit, void *arg);
/* Feed n bytes of output text. */
void md_harmony_push(struct md_harmony *h, const char *s, size_t n);
/* The output ended: what is held goes out (a body's held tail to its channel, an unfinished
 * header as content). The parser may be pushed to again afterwards, from a fresh header. */
void md_harmony_finish(struct md_harmony *h);

#endif
