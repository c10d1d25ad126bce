/* API checks for engine/chat_template: names, error returns and messages, fixed renderings. */
#include "engine/chat_template.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures;

#define CHECK_INT(got, want)                                                              \
	do {                                                                              \
		long long g_ = (long long)(got), w_ = (long long)(want);                  \
		if (g_ != w_) {                                                           \
			fprintf(stderr, "%s:%d: %s = %lld, want %lld\n", __FILE__, __LINE__, \
				#got, g_, w_);                                            \
			failures++;                                                       \
		}                                                                         \
	} while (0)

#define CHECK_STR(got, want)                                                              \
	do {                                                                              \
		const char *g_ = (got), *w_ = (want);                                     \
		if (!g_ || strcmp(g_, w_) != 0) {                                         \
			fprintf(stderr, "%s:%d: %s = \"%s\", want \"%s\"\n", __FILE__,     \
				__LINE__, #got, g_ ? g_ : "(null)", w_);                  \
			failures++;                                                       \
		}                                                                         \
	} while (0)

static void test_names(void)
{
	static const char *const names[] = { "chatml", "chatml-bos", "qwen1.5", "qwen2", "qwen2.5",
					     "qwen3", "mistral", "mistral-v1", "tulu", "olmo2",
					     "llama3", "deepseek3" };
	enum md_chat_family f;

	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
		f = MD_CHAT_FAMILY_COUNT;
		CHECK_INT(md_chat_template_by_name(names[i], &f), 0);
		CHECK_STR(md_chat_family_name(f), names[i]);
		if (!strstr(md_chat_template_names(), names[i])) {
			fprintf(stderr, "'%s' missing from md_chat_template_names()\n", names[i]);
			failures++;
		}
	}
	CHECK_INT(md_chat_template_by_name("mixtral", &f), 0);
	CHECK_INT(f, MD_CHAT_MISTRAL);
	CHECK_INT(md_chat_template_by_name("vicuna", &f), -ENOENT);
	CHECK_INT(md_chat_template_by_name("", &f), -ENOENT);
	CHECK_INT(md_chat_template_by_name(NULL, &f), -ENOENT);
	CHECK_STR(md_chat_family_name(MD_CHAT_FAMILY_COUNT), "?");
}

static void test_detect_errors(void)
{
	enum md_chat_family f = MD_CHAT_QWEN3;
	char err[256] = "";
	const char *vicuna = "{% for m in messages %}USER: {{ m['content'] }}\n{% endfor %}";

	CHECK_INT(md_chat_template_detect(NULL, 0, &f), -ENOENT);
	CHECK_INT(md_chat_template_detect_err("", 0, &f, err, sizeof(err)), -ENOENT);
	if (!strstr(err, "no tokenizer.chat_template") || !strstr(err, "--chat-template")) {
		fprintf(stderr, "message for a missing template: '%s'\n", err);
		failures++;
	}
	CHECK_INT(md_chat_template_detect_err(vicuna, strlen(vicuna), &f, err, sizeof(err)),
		  -ENOENT);
	if (!strstr(err, "unrecognised") || !strstr(err, "{% for m in") ||
	    !strstr(err, "chatml")) {
		fprintf(stderr, "message for an unknown template: '%s'\n", err);
		failures++;
	}
	CHECK_INT(f, MD_CHAT_QWEN3); /* untouched on failure */
	/* A tiny buffer truncates but stays NUL-terminated. */
	CHECK_INT(md_chat_template_detect_err(vicuna, strlen(vicuna), &f, err, 8), -ENOENT);
	CHECK_INT(strlen(err), 7);
	/* Plain ChatML written with other quoting and trim markers is still ChatML. */
	{
		const char *t = "{%- for message in messages -%}\n  {{- \"<|im_start|>\" + message.role "
				"+ \"\\n\" + message.content + \"<|im_end|>\\n\" -}}\n{%- endfor -%}"
				"{%- if add_generation_prompt -%}{{- \"<|im_start|>assistant\\n\" -}}"
				"{%- endif -%}";

		CHECK_INT(md_chat_template_detect(t, strlen(t), &f), 0);
		CHECK_INT(f, MD_CHAT_CHATML);
	}
}

static void test_render_errors(void)
{
	struct md_chat_msg ok[] = { { "user", "hi" } };
	struct md_chat_msg bad_role[] = { { "tool", "x" } };
	struct md_chat_msg null_content[] = { { "user", NULL } };
	struct md_chat_msg sys_first[] = { { "system", "s" }, { "user", "u" } };
	struct md_chat_msg not_alternating[] = { { "user", "a" }, { "user", "b" } };
	char *out = (char *)1;
	size_t len = 99;

	CHECK_INT(md_chat_render(MD_CHAT_CHATML, ok, 0, true, NULL, NULL, &out, &len), -EINVAL);
	CHECK_INT(out == NULL, 1);
	CHECK_INT(md_chat_render(MD_CHAT_CHATML, bad_role, 1, true, NULL, NULL, &out, &len), -EINVAL);
	CHECK_INT(md_chat_render(MD_CHAT_LLAMA3, null_content, 1, true, NULL, NULL, &out, &len),
		  -EINVAL);
	CHECK_INT(md_chat_render(MD_CHAT_FAMILY_COUNT, ok, 1, true, NULL, NULL, &out, &len), -EINVAL);
	CHECK_INT(md_chat_render(MD_CHAT_MISTRAL_V1, sys_first, 2, true, "<s>", "</s>", &out, &len),
		  -EINVAL);
	CHECK_INT(md_chat_render(MD_CHAT_MISTRAL, not_alternating, 2, true, "<s>", "</s>", &out, &len),
		  -EINVAL);
	CHECK_INT(out == NULL, 1);
}

static void test_render_fixed(void)
{
	struct md_chat_msg conv[] = { { "system", "S" }, { "user", "U" }, { "assistant", "A" },
				      { "user", "V" } };
	struct md_chat_opts o = { .add_generation_prompt = true, .enable_thinking = 0 };
	char *out = NULL;
	size_t len = 0;

	CHECK_INT(md_chat_render(MD_CHAT_MISTRAL, conv, 4, true, "<s>", "</s>", &out, &len), 0);
	CHECK_STR(out, "<s> [INST] S\n\nU [/INST] A</s> [INST] V [/INST]");
	CHECK_INT(len, strlen("<s> [INST] S\n\nU [/INST] A</s> [INST] V [/INST]"));
	free(out);
	CHECK_INT(md_chat_render_opts(MD_CHAT_QWEN3, conv + 1, 1, &o, &out, &len), 0);
	CHECK_STR(out, "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
	free(out);
	/* Mixtral with only a system message renders just BOS; with no BOS text, "". */
	CHECK_INT(md_chat_render(MD_CHAT_MISTRAL, conv, 1, true, NULL, NULL, &out, &len), 0);
	CHECK_STR(out, "");
	CHECK_INT(len, 0);
	free(out);
	CHECK_INT(md_chat_render(MD_CHAT_LLAMA3, conv + 1, 1, false, "<|begin_of_text|>", NULL,
				 &out, NULL), 0);
	CHECK_STR(out, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>");
	free(out);
}

int main(void)
{
	test_names();
	test_detect_errors();
	test_render_errors();
	test_render_fixed();
	if (failures) {
		fprintf(stderr, "%d check(s) failed\n", failures);
		return 1;
	}
	printf("chat_template api: all checks passed\n");
	return 0;
}
