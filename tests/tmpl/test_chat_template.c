/* API checks for engine/chat_template: names, error returns and messages, fixed renderings. */
#include "engine/chat_template.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/check.h"

static void test_names(void)
{
	static const char *const names[] = { "chatml", "chatml-bos", "qwen1.5", "qwen2", "qwen2.5",
					     "qwen3", "mistral", "mistral-v1", "tulu", "olmo2",
					     "llama3", "deepseek3" };
	enum md_chat_family f;

	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
		f = MD_CHAT_FAMILY_COUNT;
		CHECK_EQ_I(md_chat_template_by_name(names[i], &f), 0);
		CHECK_STR_EQ(md_chat_family_name(f), names[i]);
		CHECK_MSG(strstr(md_chat_template_names(), names[i]) != NULL,
			  "'%s' missing from md_chat_template_names()", names[i]);
	}
	CHECK_EQ_I(md_chat_template_by_name("mixtral", &f), 0);
	CHECK_EQ_I(f, MD_CHAT_MISTRAL);
	CHECK_EQ_I(md_chat_template_by_name("vicuna", &f), -ENOENT);
	CHECK_EQ_I(md_chat_template_by_name("", &f), -ENOENT);
	CHECK_EQ_I(md_chat_template_by_name(NULL, &f), -ENOENT);
	CHECK_STR_EQ(md_chat_family_name(MD_CHAT_FAMILY_COUNT), "?");
}

static void test_detect_errors(void)
{
	enum md_chat_family f = MD_CHAT_QWEN3;
	char err[256] = "";
	const char *vicuna = "{% for m in messages %}USER: {{ m['content'] }}\n{% endfor %}";

	CHECK_EQ_I(md_chat_template_detect(NULL, 0, &f), -ENOENT);
	CHECK_EQ_I(md_chat_template_detect_err("", 0, &f, err, sizeof(err)), -ENOENT);
	CHECK_MSG(strstr(err, "no tokenizer.chat_template") && strstr(err, "--chat-template"),
		  "message for a missing template: '%s'", err);
	CHECK_EQ_I(md_chat_template_detect_err(vicuna, strlen(vicuna), &f, err, sizeof(err)),
		  -ENOENT);
	CHECK_MSG(strstr(err, "unrecognised") && strstr(err, "{% for m in") && strstr(err, "chatml"),
		  "message for an unknown template: '%s'", err);
	CHECK_EQ_I(f, MD_CHAT_QWEN3); /* untouched on failure */
	/* A tiny buffer truncates but stays NUL-terminated. */
	CHECK_EQ_I(md_chat_template_detect_err(vicuna, strlen(vicuna), &f, err, 8), -ENOENT);
	CHECK_EQ_I(strlen(err), 7);
	/* Plain ChatML written with other quoting and trim markers is still ChatML. */
	{
		const char *t = "{%- for message in messages -%}\n  {{- \"<|im_start|>\" + message.role "
				"+ \"\\n\" + message.content + \"<|im_end|>\\n\" -}}\n{%- endfor -%}"
				"{%- if add_generation_prompt -%}{{- \"<|im_start|>assistant\\n\" -}}"
				"{%- endif -%}";

		CHECK_EQ_I(md_chat_template_detect(t, strlen(t), &f), 0);
		CHECK_EQ_I(f, MD_CHAT_CHATML);
	}
}

static void test_render_errors(void)
{
	struct md_chat_msg ok[] = { { .role = "user", .content = "hi" } };
	struct md_chat_msg bad_role[] = { { .role = "function", .content = "x" } };
	struct md_chat_msg tool_msg[] = { { .role = "tool", .content = "x" } };
	struct md_chat_msg null_content[] = { { .role = "user", .content = NULL } };
	struct md_chat_msg sys_first[] = { { .role = "system", .content = "s" }, { .role = "user", .content = "u" } };
	struct md_chat_msg not_alternating[] = { { .role = "user", .content = "a" }, { .role = "user", .content = "b" } };
	char *out = (char *)1;
	size_t len = 99;

	CHECK_EQ_I(md_chat_render(MD_CHAT_CHATML, ok, 0, true, NULL, NULL, &out, &len), -EINVAL);
	CHECK(out == NULL);
	CHECK_EQ_I(md_chat_render(MD_CHAT_CHATML, bad_role, 1, true, NULL, NULL, &out, &len), -EINVAL);
	/* a tool result in a family without a tool format */
	CHECK_EQ_I(md_chat_render(MD_CHAT_LLAMA3, tool_msg, 1, true, NULL, NULL, &out, &len),
		   -ENOTSUP);
	CHECK_EQ_I(md_chat_render(MD_CHAT_LLAMA3, null_content, 1, true, NULL, NULL, &out, &len),
		  -EINVAL);
	CHECK_EQ_I(md_chat_render(MD_CHAT_FAMILY_COUNT, ok, 1, true, NULL, NULL, &out, &len), -EINVAL);
	CHECK_EQ_I(md_chat_render(MD_CHAT_MISTRAL_V1, sys_first, 2, true, "<s>", "</s>", &out, &len),
		  -EINVAL);
	CHECK_EQ_I(md_chat_render(MD_CHAT_MISTRAL, not_alternating, 2, true, "<s>", "</s>", &out, &len),
		  -EINVAL);
	CHECK(out == NULL);
}

static void test_render_fixed(void)
{
	struct md_chat_msg conv[] = { { .role = "system", .content = "S" }, { .role = "user", .content = "U" }, { .role = "assistant", .content = "A" },
				      { .role = "user", .content = "V" } };
	struct md_chat_opts o = { .add_generation_prompt = true, .enable_thinking = 0 };
	char *out = NULL;
	size_t len = 0;

	CHECK_EQ_I(md_chat_render(MD_CHAT_MISTRAL, conv, 4, true, "<s>", "</s>", &out, &len), 0);
	CHECK_STR_EQ(out, "<s> [INST] S\n\nU [/INST] A</s> [INST] V [/INST]");
	CHECK_EQ_I(len, strlen("<s> [INST] S\n\nU [/INST] A</s> [INST] V [/INST]"));
	free(out);
	CHECK_EQ_I(md_chat_render_opts(MD_CHAT_QWEN3, conv + 1, 1, &o, &out, &len), 0);
	CHECK_STR_EQ(out, "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
	free(out);
	/* Mixtral with only a system message renders just BOS; with no BOS text, "". */
	CHECK_EQ_I(md_chat_render(MD_CHAT_MISTRAL, conv, 1, true, NULL, NULL, &out, &len), 0);
	CHECK_STR_EQ(out, "");
	CHECK_EQ_I(len, 0);
	free(out);
	CHECK_EQ_I(md_chat_render(MD_CHAT_LLAMA3, conv + 1, 1, false, "<|begin_of_text|>", NULL,
				 &out, NULL), 0);
	CHECK_STR_EQ(out, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>");
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
