/* Unit tests for server/harmony.c: gpt-oss's channels come out as content and reasoning, the
 * same however the text is split (every split point, and byte by byte); tool-addressed bodies
 * are dropped; text that is not harmony is content. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/harmony.h"
#include "tests/check.h"

struct out {
	char content[4096], reasoning[4096];
	int n_content, n_reasoning; /* emissions */
};

static void on_emit(void *arg, enum md_harmony_ev ev, const char *s, size_t n)
{
	struct out *o = arg;
	CHECK(n > 0);
	if (ev == MD_HARMONY_CONTENT) {
		strncat(o->content, s, n);
		o->n_content++;
	} else {
		strncat(o->reasoning, s, n);
		o->n_reasoning++;
	}
}

/* Parse text split at every point into two pieces, and byte by byte: the same output each way. */
static void expect(const char *text, const char *content, const char *reasoning)
{
	size_t n = strlen(text);
	for (size_t cut = 0; cut <= n + 1; cut++) {
		struct out o;
		memset(&o, 0, sizeof(o));
		struct md_harmony h;
		md_harmony_init(&h, on_emit, &o);
		if (cut <= n) {
			md_harmony_push(&h, text, cut);
			md_harmony_push(&h, text + cut, n - cut);
		} else {
			for (size_t i = 0; i < n; i++)
				md_harmony_push(&h, text + i, 1);
		}
		md_harmony_finish(&h);
		if (strcmp(o.content, content) || strcmp(o.reasoning, reasoning)) {
			fprintf(stderr, "text %s (cut %zu):\n  content   '%s', want '%s'\n  reasoning '%s', want '%s'\n",
				text, cut, o.content, content, o.reasoning, reasoning);
			failures++;
			return;
		}
	}
}

int main(void)
{
	/* What gpt-oss writes after "<|start|>assistant": reasoning, then the answer. */
	expect("<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>"
	       "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.",
	       "2 + 2 = 4.", "User asks 2+2. Easy.");
	/* <|return|> rendered (a client that keeps EOG text) ends the final body. */
	expect("<|channel|>final<|message|>Hi!<|return|>", "Hi!", "");
	/* Markers' look-alikes inside a body are text: "<|" alone, "<|en", a "<" at the end. */
	expect("<|channel|>final<|message|>a <| b <|en c <", "a <| b <|en c <", "");
	/* A preamble in commentary is content; a body addressed to a tool is dropped. */
	expect("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_weather"
	       "<|channel|>commentary <|constrain|>json<|message|>{\"city\":\"Paris\"}<|call|>",
	       "Checking.", "");
	expect("<|channel|>analysis to=functions.f <|constrain|>json<|message|>{}<|call|>", "", "");
	/* Reasoning only (generation cut by max_tokens inside it). */
	expect("<|channel|>analysis<|message|>thinking about", "", "thinking about");
	/* A new header without <|end|><|start|>. */
	expect("<|channel|>analysis<|message|>r<|channel|>final<|message|>c", "c", "r");
	/* Several analysis messages and two finals: all of each, in order. */
	expect("<|channel|>analysis<|message|>one<|end|><|start|>assistant<|channel|>analysis<|message|>"
	       " two<|end|><|start|>assistant<|channel|>final<|message|>A<|end|>"
	       "<|start|>assistant<|channel|>final<|message|>B",
	       "AB", "one two");
	/* Not harmony: plain text is content (held while it could still be a header, released at
	 * the end or once longer than a header can be). */
	expect("Hello there, no channels here.", "Hello there, no channels here.", "");
	char longtext[600];
	memset(longtext, 'x', sizeof(longtext) - 1);
	longtext[sizeof(longtext) - 1] = 0;
	expect(longtext, longtext, "");
	/* A header cut off by the end of generation is no content. */
	expect("<|channel|>final", "", "");
	expect("<|start|>assistant", "", "");
	/* Other control-looking text is content (a vocabulary's own <|...|> tokens). */
	expect("<|tok_7|> and <|endoftext|>", "<|tok_7|> and <|endoftext|>", "");
	expect("", "", "");
	/* UTF-8 across pieces stays whole (bytes are passed through). */
	expect("<|channel|>analysis<|message|>héllo 世界<|end|><|start|>assistant<|channel|>final<|message|>🌍",
	       "🌍", "héllo 世界");
	/* A body streams: it is not held to the end (one push, most text emitted at once). */
	{
		struct out o;
		memset(&o, 0, sizeof(o));
		struct md_harmony h;
		md_harmony_init(&h, on_emit, &o);
		const char *t = "<|channel|>final<|message|>streaming text";
		md_harmony_push(&h, t, strlen(t));
		CHECK(strcmp(o.content, "streaming text") == 0);
	}
	if (failures)
		fprintf(stderr, "test_harmony: %d failure(s)\n", failures);
	else
		printf("test_harmony: ok\n");
	return failures ? 1 : 0;
}
