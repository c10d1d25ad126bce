/* Built-in chat formatters that reproduce, byte for byte, the Jinja chat templates of known models. */
#include "engine/chat_template.h"

#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/*
 * DESIGN: moed does not interpret Jinja. Each formatter below is a transcription of one real
 * template (named in chat_template.h), checked by tests/tmpl against that template rendered by
 * @huggingface/jinja. Detection is deliberately strict: a template is recognised only when the
 * pieces that decide its output are all present, so a variant we do not reproduce (another
 * default system prompt, a date header, thinking tags) fails at load instead of silently
 * drifting from what the model was trained on. Tools, assistant tool calls and tool results
 * are rendered by the families with a tool format (chat_template.h, md_chat_family_has_tools)
 * from text the caller prepared (each tool as `tool | tojson`, each call's arguments as sent),
 * so this file needs no JSON library; multimodal content is outside the message model.
 */

static const char *const family_names[MD_CHAT_FAMILY_COUNT] = {
	[MD_CHAT_CHATML] = "chatml",
	[MD_CHAT_QWEN3] = "qwen3",
	[MD_CHAT_MISTRAL] = "mistral",
	[MD_CHAT_TULU] = "tulu",
	[MD_CHAT_LLAMA3] = "llama3",
	[MD_CHAT_DEEPSEEK3] = "deepseek3",
	[MD_CHAT_CHATML_BOS] = "chatml-bos",
	[MD_CHAT_QWEN15] = "qwen1.5",
	[MD_CHAT_QWEN2] = "qwen2",
	[MD_CHAT_QWEN25] = "qwen2.5",
	[MD_CHAT_MISTRAL_V1] = "mistral-v1",
	[MD_CHAT_OLMO2] = "olmo2",
	[MD_CHAT_GPT_OSS] = "gpt-oss",
	[MD_CHAT_MISTRAL_NEMO] = "mistral-nemo",
	[MD_CHAT_LLAMA31] = "llama3.1",
	[MD_CHAT_LLAMA32] = "llama3.2",
	[MD_CHAT_GLM45] = "glm4.5",
};

static const char all_names[] =
	"chatml, chatml-bos, qwen1.5, qwen2, qwen2.5, qwen3, mistral (mixtral), mistral-v1, "
	"tulu, olmo2, llama3, llama3.1, llama3.2, mistral-nemo, deepseek3, gpt-oss, glm4.5";

const char *md_chat_family_name(enum md_chat_family f)
{
	if ((unsigned)f >= MD_CHAT_FAMILY_COUNT)
		return "?";
	return family_names[f];
}

const char *md_chat_template_names(void)
{
	return all_names;
}

int md_chat_template_by_name(const char *name, enum md_chat_family *out)
{
	if (!name)
		return -ENOENT;
	if (strcmp(name, "mixtral") == 0) {
		*out = MD_CHAT_MISTRAL;
		return 0;
	}
	for (int i = 0; i < MD_CHAT_FAMILY_COUNT; i++) {
		if (strcmp(name, family_names[i]) == 0) {
			*out = (enum md_chat_family)i;
			return 0;
		}
	}
	return -ENOENT;
}

/* ---- detection ---- */

/*
 * Canonical form of a template for matching: outside string literals whitespace and the
 * Jinja trim markers ("{%-", "-}}") go, `.name` becomes `['name']` and `"` becomes `'`;
 * inside literals escapes are decoded (so '\n' and a real newline compare equal) and
 * adjacent literals joined by `+` are merged ('<|im_end|>' + '\n' == '<|im_end|>\n').
 * Returns a malloc'd string or NULL on allocation failure.
 */
static char *normalise(const char *s, size_t len)
{
	/* `.x` -> `['x']`: 5 output bytes for 2 input bytes at worst. */
	char *o = len < SIZE_MAX / 3 ? malloc(len * 3 + 1) : NULL;
	size_t n = 0;

	if (!o)
		return NULL;
	for (size_t i = 0; i < len;) {
		char c = s[i];

		if (c == '\'' || c == '"') {
			char q = c;

			o[n++] = '\'';
			i++;
			for (;;) {
				while (i < len && s[i] != q) {
					if (s[i] == '\\' && i + 1 < len) {
						char e = s[i + 1];

						o[n++] = e == 'n' ? '\n' : e == 't' ? '\t' : e;
						i += 2;
						continue;
					}
					o[n++] = s[i++];
				}
				if (i < len)
					i++; /* closing quote */
				/* Merge `'a' + 'b'`. */
				size_t j = i;

				while (j < len && strchr(" \t\r\n", s[j]))
					j++;
				if (j < len && s[j] == '+') {
					j++;
					while (j < len && strchr(" \t\r\n", s[j]))
						j++;
					if (j < len && (s[j] == '\'' || s[j] == '"')) {
						q = s[j];
						i = j + 1;
						continue;
					}
				}
				break;
			}
			o[n++] = '\'';
			continue;
		}
		if (c == ' ' || c == '\t' || c == '\r' || c == '\n') {
			i++;
			continue;
		}
		/* A comment renders nothing (and may hold an apostrophe: "we're"). */
		if (c == '{' && i + 1 < len && s[i + 1] == '#') {
			const char *end = strstr(s + i + 2, "#}");

			if (end && (size_t)(end - s) < len) {
				i = (size_t)(end - s) + 2;
				continue;
			}
		}
		if ((c == '{') && i + 2 < len && (s[i + 1] == '%' || s[i + 1] == '{') &&
		    s[i + 2] == '-') {
			o[n++] = '{';
			o[n++] = s[i + 1];
			i += 3;
			continue;
		}
		if (c == '-' && i + 2 < len && (s[i + 1] == '%' || s[i + 1] == '}') && s[i + 2] == '}') {
			i++;
			continue;
		}
		if (c == '.' && i + 1 < len &&
		    ((s[i + 1] >= 'a' && s[i + 1] <= 'z') || s[i + 1] == '_') && n > 0 &&
		    ((o[n - 1] >= 'a' && o[n - 1] <= 'z') || o[n - 1] == ']' || o[n - 1] == '_' ||
		     (o[n - 1] >= '0' && o[n - 1] <= '9'))) {
			size_t j = i + 1;

			while (j < len && ((s[j] >= 'a' && s[j] <= 'z') || s[j] == '_' ||
					   (s[j] >= '0' && s[j] <= '9')))
				j++;
			/* A method call (x.strip(...)) stays as written. */
			if (j < len && s[j] == '(') {
				o[n++] = c;
				i++;
				continue;
			}
			o[n++] = '[';
			o[n++] = '\'';
			memcpy(o + n, s + i + 1, j - i - 1);
			n += j - i - 1;
			o[n++] = '\'';
			o[n++] = ']';
			i = j;
			continue;
		}
		o[n++] = c;
		i++;
	}
	o[n] = '\0';
	return o;
}

static bool has(const char *norm, const char *marker)
{
	return strstr(norm, marker) != NULL;
}

static bool has_all(const char *norm, const char *const *markers)
{
	for (; *markers; markers++)
		if (!has(norm, *markers))
			return false;
	return true;
}

static const char *const sig_deepseek3[] = {
	"'<｜User｜>'+message['content']",
	"'<｜Assistant｜>'+message['content']+'<｜end▁of▁sentence｜>'",
	"{{bos_token}}{{ns['system_prompt']}}",
	"ns['system_prompt']+'\n\n'+message['content']",
	"{%ifadd_generation_promptandnotns['is_tool']%}{{'<｜Assistant｜>'}}{%endif%}",
	NULL,
};

/* GLM-4.5 / GLM-4.6 (the template llama.cpp keeps as models/templates/GLM-4.6.jinja). */
static const char *const sig_glm45[] = {
	"{%ifm['role']=='user'%}<|user|>{{visible_text(m['content'])}}",
	"{{'/nothink'if(enable_thinkingisdefinedandnotenable_thinkingandnot"
	"visible_text(m['content']).endswith('/nothink'))else''}}",
	"{%ifloop['index0']>ns['last_user_index']andreasoning_content%}"
	"{{'\n<think>'+reasoning_content.strip()+'</think>'}}{%else%}{{'\n<think></think>'}}",
	"{%ifcontent.strip()%}{{'\n'+content.strip()}}{%endif%}",
	"{%elifm['role']=='system'%}<|system|>{{visible_text(m['content'])}}{%endif%}",
	"{%ifadd_generation_prompt%}<|assistant|>{{'\n<think></think>'if(enable_thinking"
	"isdefinedandnotenable_thinking)else''}}{%endif%}",
	NULL,
};

static const char *const sig_llama3[] = {
	"{%setcontent='<|start_header_id|>'+message['role']+'<|end_header_id|>\n\n'+"
	"message['content']|trim+'<|eot_id|>'%}",
	"{%ifloop['index0']==0%}{%setcontent=bos_token+content%}{%endif%}{{content}}{%endfor%}",
	"{%ifadd_generation_prompt%}{{'<|start_header_id|>assistant<|end_header_id|>\n\n'}}"
	"{%endif%}",
	NULL,
};

/* Mistral-Nemo-Instruct-2407: every piece that writes text, and the tests that decide. */
static const char *const sig_mistral_nemo[] = {
	"{%ifmessages[0]['role']=='system'%}{%setsystem_message=messages[0]['content']%}"
	"{%setloop_messages=messages[1:]%}{%else%}{%setloop_messages=messages%}{%endif%}",
	"{%setuser_messages=loop_messages|selectattr('role','equalto','user')|list%}",
	"{%formessageinloop_messages|rejectattr('role','equalto','tool')|rejectattr('role',"
	"'equalto','tool_results')|selectattr('tool_calls','undefined')%}"
	"{%if(message['role']=='user')!=(loop['index0']%2==0)%}{{raise_exception(",
	"{{bos_token}}{%formessageinloop_messages%}{%ifmessage['role']=='user'%}"
	"{%iftoolsisnotnoneand(message==user_messages[-1])%}{{'[AVAILABLE_TOOLS]['}}"
	"{%fortoolintools%}{%settool=tool['function']%}{{'{\"type\": \"function\", "
	"\"function\": {'}}{%forkey,valintool.items()ifkey!='return'%}{%ifvalisstring%}"
	"{{'\"'+key+'\": \"'+val+'\"'}}{%else%}{{'\"'+key+'\": '+val|tojson}}{%endif%}"
	"{%ifnotloop['last']%}{{', '}}{%endif%}{%endfor%}{{'}}'}}{%ifnotloop['last']%}{{', '}}"
	"{%else%}{{']'}}{%endif%}{%endfor%}{{'[/AVAILABLE_TOOLS]'}}{%endif%}"
	"{%ifloop['last']andsystem_messageisdefined%}{{'[INST]'+system_message+'\n\n'+"
	"message['content']+'[/INST]'}}{%else%}{{'[INST]'+message['content']+'[/INST]'}}{%endif%}",
	"{%elifmessage['role']=='tool_calls'ormessage['tool_calls']isdefined%}",
	"{{'[TOOL_CALLS]['}}{%fortool_callintool_calls%}{%setout=tool_call['function']|tojson%}"
	"{{out[:-1]}}{%ifnottool_call['id']isdefinedortool_call['id']|length!=9%}"
	"{{raise_exception(",
	"{{', \"id\": \"'+tool_call['id']+'\"}'}}{%ifnotloop['last']%}{{', '}}{%else%}"
	"{{']'+eos_token}}{%endif%}{%endfor%}{%elifmessage['role']=='assistant'%}"
	"{{message['content']+eos_token}}{%elifmessage['role']=='tool_results'ormessage['role']"
	"=='tool'%}",
	"{{'[TOOL_RESULTS]{\"content\": '+content|string+', '}}"
	"{%ifnotmessage['tool_call_id']isdefinedormessage['tool_call_id']|length!=9%}"
	"{{raise_exception(",
	"{{'\"call_id\": \"'+message['tool_call_id']+'\"}[/TOOL_RESULTS]'}}{%else%}"
	"{{raise_exception(",
	NULL,
};

/* Llama 3.1 / 3.2 Instruct (tools in the first user message, JSON calls, ipython results);
 * the date and built-in tools lines are told apart in classify(). */
static const char *const sig_llama31[] = {
	"{{bos_token}}{%ifcustom_toolsisdefined%}{%settools=custom_tools%}{%endif%}"
	"{%ifnottools_in_user_messageisdefined%}{%settools_in_user_message=true%}{%endif%}",
	"{%ifnottoolsisdefined%}{%settools=none%}{%endif%}{%ifmessages[0]['role']=='system'%}"
	"{%setsystem_message=messages[0]['content']|trim%}{%setmessages=messages[1:]%}{%else%}"
	"{%setsystem_message=''%}{%endif%}{{'<|start_header_id|>system<|end_header_id|>\n\n'}}",
	"{{'Environment: ipython\n'}}{%endif%}",
	"{{'Cutting Knowledge Date: December 2023\n'}}{{'Today Date: '+date_string+'\n\n'}}"
	"{%iftoolsisnotnoneandnottools_in_user_message%}",
	"{%endfor%}{%endif%}{{system_message}}{{'<|eot_id|>'}}"
	"{%iftools_in_user_messageandnottoolsisnone%}{%ifmessages|length!=0%}"
	"{%setfirst_user_message=messages[0]['content']|trim%}{%setmessages=messages[1:]%}{%else%}"
	"{{raise_exception(",
	"{{'<|start_header_id|>user<|end_header_id|>\n\n'}}{{'Given the following functions, "
	"please respond with a JSON for a function call '}}{{'with its proper arguments that best "
	"answers the given prompt.\n\n'}}{{'Respond in the format {\"name\": function name, "
	"\"parameters\": dictionary of argument name and its value}.'}}{{'Do not use variables."
	"\n\n'}}{%fortintools%}{{t|tojson(indent=4)}}{{'\n\n'}}{%endfor%}"
	"{{first_user_message+'<|eot_id|>'}}{%endif%}{%formessageinmessages%}"
	"{%ifnot(message['role']=='ipython'ormessage['role']=='tool'or'tool_calls'inmessage)%}"
	"{{'<|start_header_id|>'+message['role']+'<|end_header_id|>\n\n'+message['content']|trim"
	"+'<|eot_id|>'}}{%elif'tool_calls'inmessage%}{%ifnotmessage['tool_calls']|length==1%}"
	"{{raise_exception(",
	"{%settool_call=message['tool_calls'][0]['function']%}",
	"{{'<|start_header_id|>assistant<|end_header_id|>\n\n'}}{{'{\"name\": \"'+"
	"tool_call['name']+'\", '}}{{'\"parameters\": '}}{{tool_call['arguments']|tojson}}"
	"{{'}'}}",
	"{%elifmessage['role']=='tool'ormessage['role']=='ipython'%}"
	"{{'<|start_header_id|>ipython<|end_header_id|>\n\n'}}{%ifmessage['content']ismapping"
	"ormessage['content']isiterable%}{{message['content']|tojson}}{%else%}"
	"{{message['content']}}{%endif%}{{'<|eot_id|>'}}{%endif%}{%endfor%}"
	"{%ifadd_generation_prompt%}{{'<|start_header_id|>assistant<|end_header_id|>\n\n'}}"
	"{%endif%}",
	NULL,
};

/* What only the 3.1 template has (builtin_tools) and only 3.2's (strftime_now): each needs all
 * of its own and none of the other's. */
static const char *const sig_llama31_only[] = {
	"{%ifnotdate_stringisdefined%}{%setdate_string='26 Jul 2024'%}{%endif%}",
	"{%ifbuiltin_toolsisdefinedortoolsisnotnone%}{{'Environment: ipython\n'}}{%endif%}"
	"{%ifbuiltin_toolsisdefined%}{{'Tools: '+",
	"{%ifbuiltin_toolsisdefined%}{{'<|eom_id|>'}}{%else%}{{'<|eot_id|>'}}{%endif%}",
	NULL,
};
static const char *const sig_llama32_only[] = {
	"{%ifnotdate_stringisdefined%}{%ifstrftime_nowisdefined%}"
	"{%setdate_string=strftime_now('%d %b %Y')%}{%else%}{%setdate_string='26 Jul 2024'%}"
	"{%endif%}{%endif%}",
	"{%iftoolsisnotnone%}{{'Environment: ipython\n'}}{%endif%}",
	"{{tool_call['arguments']|tojson}}{{'}'}}{{'<|eot_id|>'}}{%elifmessage['role']=='tool'",
	NULL,
};

static const char *const sig_mistral[] = {
	"{%ifmessages[0]['role']=='system'%}{%setsystem_message=messages[0]['content']%}"
	"{%setloop_messages=messages[1:]%}",
	"{{bos_token}}{%formessageinloop_messages%}",
	"{%if(message['role']=='user')!=(loop['index0']%2==0)%}",
	"{%ifloop['first']andsystem_messageisdefined%}"
	"{{' [INST] '+system_message+'\n\n'+message['content']+' [/INST]'}}"
	"{%else%}{{' [INST] '+message['content']+' [/INST]'}}{%endif%}",
	"{%elifmessage['role']=='assistant'%}{{' '+message['content']+eos_token}}{%else%}"
	"{{raise_exception(",
	NULL,
};

static const char *const sig_mistral_v1[] = {
	"{{bos_token}}{%formessageinmessages%}"
	"{%if(message['role']=='user')!=(loop['index0']%2==0)%}{{raise_exception(",
	"{%ifmessage['role']=='user'%}{{'[INST] '+message['content']+' [/INST]'}}"
	"{%elifmessage['role']=='assistant'%}{{message['content']+eos_token+' '}}{%else%}"
	"{{raise_exception(",
	NULL,
};

static const char *const sig_tulu[] = {
	"{%formessageinmessages%}{%ifmessage['role']=='system'%}"
	"{{'<|system|>\n'+message['content']+'\n'}}"
	"{%elifmessage['role']=='user'%}{{'<|user|>\n'+message['content']+'\n'}}"
	"{%elifmessage['role']=='assistant'%}{%ifnotloop['last']%}"
	"{{'<|assistant|>\n'+message['content']+eos_token+'\n'}}"
	"{%else%}{{'<|assistant|>\n'+message['content']+eos_token}}{%endif%}{%endif%}"
	"{%ifloop['last']andadd_generation_prompt%}{{'<|assistant|>\n'}}{%endif%}{%endfor%}",
	NULL,
};

static const char *const sig_qwen3[] = {
	"{%ifmessages[0]['role']=='system'%}"
	"{{'<|im_start|>system\n'+messages[0]['content']+'<|im_end|>\n'}}",
	"{%setns=namespace(multi_step_tool=true,last_query_index=messages|length-1)%}",
	"{%ifns['multi_step_tool']andmessage['role']=='user'andnot(message['content']"
	".startswith('<tool_response>')andmessage['content'].endswith('</tool_response>'))%}",
	"{%if(message['role']=='user')or(message['role']=='system'andnotloop['first'])%}"
	"{{'<|im_start|>'+message['role']+'\n'+message['content']+'<|im_end|>\n'}}",
	"{%setcontent=message['content'].split('</think>')[-1].lstrip('\n')%}",
	"{%setreasoning_content=message['content'].split('</think>')[0].rstrip('\n')"
	".split('<think>')[-1].lstrip('\n')%}",
	"{%ifloop['index0']>ns['last_query_index']%}{%ifloop['last']or(notloop['last']and"
	"reasoning_content)%}{{'<|im_start|>'+message['role']+'\n<think>\n'+"
	"reasoning_content.strip('\n')+'\n</think>\n\n'+content.lstrip('\n')}}",
	"{%else%}{{'<|im_start|>'+message['role']+'\n'+content}}{%endif%}",
	"{{'<|im_end|>\n'}}{%elifmessage['role']=='tool'%}",
	"{%ifadd_generation_prompt%}{{'<|im_start|>assistant\n'}}{%ifenable_thinkingisdefined"
	"andenable_thinkingisfalse%}{{'<think>\n\n</think>\n\n'}}{%endif%}{%endif%}",
	NULL,
};

static const char *const sig_qwen25[] = {
	"{%ifmessages[0]['role']=='system'%}"
	"{{'<|im_start|>system\n'+messages[0]['content']+'<|im_end|>\n'}}{%else%}"
	"{{'<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
	"assistant.<|im_end|>\n'}}{%endif%}{%endif%}{%formessageinmessages%}",
	"{%if(message['role']=='user')or(message['role']=='system'andnotloop['first'])or"
	"(message['role']=='assistant'andnotmessage['tool_calls'])%}"
	"{{'<|im_start|>'+message['role']+'\n'+message['content']+'<|im_end|>\n'}}",
	"{%ifadd_generation_prompt%}{{'<|im_start|>assistant\n'}}{%endif%}",
	NULL,
};

static const char *const sig_qwen2[] = {
	"{%formessageinmessages%}{%ifloop['first']andmessages[0]['role']!='system'%}"
	"{{'<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n'}}{%endif%}"
	"{{'<|im_start|>'+message['role']+'\n'+message['content']+'<|im_end|>\n'}}{%endfor%}"
	"{%ifadd_generation_prompt%}{{'<|im_start|>assistant\n'}}{%endif%}",
	NULL,
};

static const char *const sig_qwen15[] = {
	"{%formessageinmessages%}{%ifloop['first']andmessages[0]['role']!='system'%}"
	"{{'<|im_start|>system\nYou are a helpful assistant<|im_end|>\n'}}{%endif%}"
	"{{'<|im_start|>'+message['role']+'\n'+message['content']}}"
	"{%if(loop['last']andadd_generation_prompt)ornotloop['last']%}{{'<|im_end|>\n'}}"
	"{%endif%}{%endfor%}{%ifadd_generation_promptandmessages[-1]['role']!='assistant'%}"
	"{{'<|im_start|>assistant\n'}}{%endif%}",
	NULL,
};

static const char chatml_body[] =
	"{%formessageinmessages%}"
	"{{'<|im_start|>'+message['role']+'\n'+message['content']+'<|im_end|>\n'}}{%endfor%}"
	"{%ifadd_generation_prompt%}{{'<|im_start|>assistant\n'}}{%endif%}";

/* The optional prologue some ChatML templates carry: it changes nothing when the caller
 * passes add_generation_prompt explicitly. */
static const char chatml_prologue[] =
	"{%ifnotadd_generation_promptisdefined%}{%setadd_generation_prompt=false%}{%endif%}";

/* True when norm is exactly [prologue] [bos] chatml_body; *bos says whether bos is there. */
static bool is_chatml(const char *norm, bool *bos)
{
	size_t pl = strlen(chatml_prologue);

	if (strncmp(norm, chatml_prologue, pl) == 0)
		norm += pl;
	*bos = strncmp(norm, "{{bos_token}}", 13) == 0;
	if (*bos)
		norm += 13;
	return strcmp(norm, chatml_body) == 0;
}

/* gpt-oss-20b/120b's chat_template.jinja (harmony). */
static const char *const sig_gpt_oss[] = {
	"'<|start|>system<|message|>'",
	"Knowledge cutoff: 2024-06",
	"# Valid channels: analysis, commentary, final. Channel must be included for every message.",
	"'<|start|>developer<|message|>'",
	"'# Instructions\n\n'",
	"'<|start|>assistant<|channel|>final<|message|>'+message['content']+'<|end|>'",
	"'<|start|>assistant<|channel|>final<|message|>'+message['content']+'<|return|>'",
	"'<|start|>user<|message|>'+message['content']+'<|end|>'",
	NULL,
};

static enum md_chat_family classify(const char *norm, bool *found)
{
	bool bos;

	*found = true;
	if (has(norm, "<|channel|>")) {
		if (has_all(norm, sig_gpt_oss))
			return MD_CHAT_GPT_OSS;
	} else if (strncmp(norm, "[gMASK]<sop>", 12) == 0) {
		if (has_all(norm, sig_glm45))
			return MD_CHAT_GLM45;
	} else if (has(norm, "<｜Assistant｜>")) {
		if (!has(norm, "think") && has_all(norm, sig_deepseek3))
			return MD_CHAT_DEEPSEEK3;
	} else if (has(norm, "<|start_header_id|>")) {
		/* Llama 3.1/3.2: refused with anything they do not render (images, thinking) */
		if (has_all(norm, sig_llama31) && !has(norm, "image") && !has(norm, "thinking")) {
			if (has_all(norm, sig_llama31_only) && !has(norm, "strftime_now"))
				return MD_CHAT_LLAMA31;
			if (has_all(norm, sig_llama32_only) && !has(norm, "builtin_tools"))
				return MD_CHAT_LLAMA32;
		}
		if (!has(norm, "CuttingKnowledge") && !has(norm, "Cutting Knowledge") &&
		    !has(norm, "tool") && has_all(norm, sig_llama3))
			return MD_CHAT_LLAMA3;
	} else if (has(norm, "[INST]")) {
		if (has_all(norm, sig_mistral_nemo))
			return MD_CHAT_MISTRAL_NEMO;
		if (has_all(norm, sig_mistral))
			return MD_CHAT_MISTRAL;
		if (!has(norm, "system") && has_all(norm, sig_mistral_v1))
			return MD_CHAT_MISTRAL_V1;
	} else if (has(norm, "<|assistant|>")) {
		if (has_all(norm, sig_tulu)) {
			if (!has(norm, "bos_token"))
				return MD_CHAT_TULU;
			if (strncmp(norm, "{{bos_token}}{%formessage", 25) == 0 &&
			    !strstr(norm + 13, "bos_token"))
				return MD_CHAT_OLMO2;
		}
	} else if (has(norm, "<|im_start|>")) {
		if (has_all(norm, sig_qwen3))
			return MD_CHAT_QWEN3;
		if (!has(norm, "think")) {
			if (has_all(norm, sig_qwen25))
				return MD_CHAT_QWEN25;
			if (!has(norm, "tool")) {
				if (has_all(norm, sig_qwen2))
					return MD_CHAT_QWEN2;
				if (has_all(norm, sig_qwen15))
					return MD_CHAT_QWEN15;
				if (is_chatml(norm, &bos))
					return bos ? MD_CHAT_CHATML_BOS : MD_CHAT_CHATML;
			}
		}
	}
	*found = false;
	return MD_CHAT_CHATML;
}

__attribute__((format(printf, 3, 4)))
static void set_err(char *err, size_t errlen, const char *fmt, ...)
{
	va_list ap;

	if (!err || errlen == 0)
		return;
	va_start(ap, fmt);
	vsnprintf(err, errlen, fmt, ap);
	va_end(ap);
}

int md_chat_template_detect_err(const char *jinja, size_t len, enum md_chat_family *out,
                                char *err, size_t errlen)
{
	char *norm;
	bool found;
	enum md_chat_family f;

	if (!jinja || len == 0) {
		set_err(err, errlen,
			"model has no tokenizer.chat_template; pass --chat-template NAME (one of: %s)",
			all_names);
		return -ENOENT;
	}
	norm = normalise(jinja, len);
	if (!norm) {
		set_err(err, errlen, "cannot examine chat template: out of memory");
		return -ENOMEM;
	}
	f = classify(norm, &found);
	free(norm);
	if (!found) {
		/* Show where the template starts so the user can tell which one it is. */
		char head[61];
		size_t k = 0;

		for (size_t i = 0; i < len && k < sizeof(head) - 1; i++)
			head[k++] = (jinja[i] == '\n' || jinja[i] == '\r' || jinja[i] == '\t') ?
					    ' ' : jinja[i];
		/* Do not cut a UTF-8 sequence in half. */
		while (k > 0 && ((unsigned char)head[k - 1] & 0xC0) == 0x80)
			k--;
		if (k > 0 && ((unsigned char)head[k - 1] & 0x80))
			k--;
		head[k] = '\0';
		set_err(err, errlen,
			"unrecognised tokenizer.chat_template (%zu bytes, starting '%s'); pass "
			"--chat-template NAME (one of: %s)",
			len, head, all_names);
		return -ENOENT;
	}
	*out = f;
	return 0;
}

int md_chat_template_detect(const char *jinja, size_t len, enum md_chat_family *out)
{
	return md_chat_template_detect_err(jinja, len, out, NULL, 0);
}

/* ---- rendering ---- */

struct sbuf {
	char *p; /* owned */
	size_t n, cap;
	bool oom;
};

static void sb_put(struct sbuf *b, const char *s, size_t len)
{
	if (b->oom || len == 0)
		return;
	if (b->n + len + 1 > b->cap) {
		size_t cap = b->cap ? b->cap : 256;
		char *p;

		while (cap < b->n + len + 1) {
			if (cap > SIZE_MAX / 2) {
				b->oom = true;
				return;
			}
			cap *= 2;
		}
		p = realloc(b->p, cap);
		if (!p) {
			b->oom = true;
			return;
		}
		b->p = p;
		b->cap = cap;
	}
	memcpy(b->p + b->n, s, len);
	b->n += len;
	b->p[b->n] = '\0';
}

static void sb_puts(struct sbuf *b, const char *s)
{
	sb_put(b, s, strlen(s));
}

enum role { R_SYSTEM, R_USER, R_ASSISTANT, R_TOOL };

/* A borrowed slice of a message string. */
struct span {
	const char *p;
	size_t n;
};

static struct span span_of(const char *s)
{
	return (struct span){ s, strlen(s) };
}

static void sb_span(struct sbuf *b, struct span s)
{
	sb_put(b, s.p, s.n);
}

static bool starts_with(struct span s, const char *pre)
{
	size_t k = strlen(pre);

	return s.n >= k && memcmp(s.p, pre, k) == 0;
}

static bool ends_with(struct span s, const char *suf)
{
	size_t k = strlen(suf);

	return s.n >= k && memcmp(s.p + s.n - k, suf, k) == 0;
}

/* First (last = false) or last occurrence of needle in s, or NULL. */
static const char *find(struct span s, const char *needle, bool last)
{
	size_t k = strlen(needle);
	const char *hit = NULL;

	if (k > s.n)
		return NULL;
	for (size_t i = 0; i + k <= s.n; i++) {
		if (memcmp(s.p + i, needle, k) == 0) {
			hit = s.p + i;
			if (!last)
				break;
		}
	}
	return hit;
}

static struct span lstrip_nl(struct span s)
{
	while (s.n > 0 && s.p[0] == '\n') {
		s.p++;
		s.n--;
	}
	return s;
}

static struct span rstrip_nl(struct span s)
{
	while (s.n > 0 && s.p[s.n - 1] == '\n')
		s.n--;
	return s;
}

/* An assistant message's reasoning, as the Qwen3 and GLM-4.5 templates split it: the text
 * between the last "<think>" before the first "</think>" and that "</think>" (newlines
 * stripped around it); *content becomes what follows the last "</think>", leading newlines
 * stripped. Without "</think>" the reasoning is empty and *content is kept. */
static struct span split_think(struct span *content)
{
	struct span c = *content, reasoning = { "", 0 };
	const char *end = find(c, "</think>", false);
	if (!end)
		return reasoning;
	const char *last_end = find(c, "</think>", true);
	struct span before = rstrip_nl((struct span){ c.p, (size_t)(end - c.p) });
	const char *open = find(before, "<think>", true);
	if (open) {
		before.n -= (size_t)(open + 7 - before.p);
		before.p = open + 7;
	}
	reasoning = lstrip_nl(before);
	c.n -= (size_t)(last_end + 8 - c.p);
	c.p = last_end + 8;
	*content = lstrip_nl(c);
	return reasoning;
}

/* Length of the UTF-8 code point of Python's str.isspace() set at s, or 0. */
static size_t py_space_at(const unsigned char *s, size_t n)
{
	uint32_t cp;
	size_t k;

	if (n == 0)
		return 0;
	if (s[0] < 0x80) /* \t \n \v \f \r, \x1c-\x1f, space */
		return (s[0] >= 0x09 && s[0] <= 0x0d) || (s[0] >= 0x1c && s[0] <= 0x20) ? 1 : 0;
	if ((s[0] & 0xE0) == 0xC0 && n >= 2) {
		cp = ((uint32_t)(s[0] & 0x1F) << 6) | (s[1] & 0x3F);
		k = 2;
	} else if ((s[0] & 0xF0) == 0xE0 && n >= 3) {
		cp = ((uint32_t)(s[0] & 0x0F) << 12) | ((uint32_t)(s[1] & 0x3F) << 6) | (s[2] & 0x3F);
		k = 3;
	} else {
		return 0;
	}
	if (cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
	    cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000)
		return k;
	return 0;
}

/* Python's str.strip() (Jinja's trim filter) on UTF-8 text. */
static struct span py_strip(struct span s)
{
	size_t k;

	while ((k = py_space_at((const unsigned char *)s.p, s.n)) > 0) {
		s.p += k;
		s.n -= k;
	}
	/* From the right: step back over one code point at a time. */
	while (s.n > 0) {
		size_t start = s.n - 1;

		while (start > 0 && ((unsigned char)s.p[start] & 0xC0) == 0x80 && s.n - start < 4)
			start--;
		k = py_space_at((const unsigned char *)s.p + start, s.n - start);
		if (k == 0 || start + k != s.n)
			break;
		s.n = start;
	}
	return s;
}

/* The Hermes/Qwen3 tool block that opens the system turn. */
static void tools_prologue(struct sbuf *b, const struct md_chat_msg *m, const enum role *r,
			   const struct md_chat_opts *o)
{
	sb_puts(b, "<|im_start|>system\n");
	if (r[0] == R_SYSTEM) {
		sb_puts(b, m[0].content);
		sb_puts(b, "\n\n");
	}
	sb_puts(b, "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
		   "You are provided with function signatures within <tools></tools> XML tags:\n"
		   "<tools>");
	for (size_t i = 0; i < o->n_tools; i++) {
		sb_puts(b, "\n");
		sb_puts(b, o->tools[i]);
	}
	sb_puts(b, "\n</tools>\n\nFor each function call, return a json object with function name "
		   "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
		   "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
		   "<|im_end|>\n");
}

/* An assistant turn's tool calls, after its content (content_set: the content is not empty). */
static void tool_calls_hermes(struct sbuf *b, const struct md_chat_msg *m, bool content_set)
{
	for (size_t k = 0; k < m->n_tool_calls; k++) {
		if (k > 0 || content_set)
			sb_puts(b, "\n");
		sb_puts(b, "<tool_call>\n{\"name\": \"");
		sb_puts(b, m->tool_calls[k].name);
		sb_puts(b, "\", \"arguments\": ");
		sb_puts(b, m->tool_calls[k].arguments);
		sb_puts(b, "}\n</tool_call>");
	}
}

/* A tool result: consecutive tool messages share one user turn. */
static void tool_response_hermes(struct sbuf *b, const struct md_chat_msg *m, const enum role *r,
				 size_t n, size_t i)
{
	if (i == 0 || r[i - 1] != R_TOOL)
		sb_puts(b, "<|im_start|>user");
	sb_puts(b, "\n<tool_response>\n");
	sb_puts(b, m[i].content);
	sb_puts(b, "\n</tool_response>");
	if (i + 1 == n || r[i + 1] != R_TOOL)
		sb_puts(b, "<|im_end|>\n");
}

static void render_qwen3(struct sbuf *b, const struct md_chat_msg *m, const enum role *r,
                         size_t n, const struct md_chat_opts *o, bool reasoning_blocks);

static void render_chatml(struct sbuf *b, const struct md_chat_msg *m, const enum role *r,
                          size_t n, const struct md_chat_opts *o, bool bos,
                          const char *default_system)
{
	if (bos)
		sb_puts(b, o->bos_text);
	if (!default_system) {
		bool tools = o->n_tools > 0;
		for (size_t i = 0; i < n && !tools; i++)
			tools = r[i] == R_TOOL || m[i].n_tool_calls > 0;
		if (tools) {
			render_qwen3(b, m, r, n, o, false);
			return;
		}
	}
	for (size_t i = 0; i < n; i++) {
		if (i == 0 && default_system && r[0] != R_SYSTEM) {
			sb_puts(b, "<|im_start|>system\n");
			sb_puts(b, default_system);
			sb_puts(b, "<|im_end|>\n");
		}
		sb_puts(b, "<|im_start|>");
		sb_puts(b, m[i].role);
		sb_puts(b, "\n");
		sb_puts(b, m[i].content);
		sb_puts(b, "<|im_end|>\n");
	}
	if (o->add_generation_prompt)
		sb_puts(b, "<|im_start|>assistant\n");
}

static void render_qwen15(struct sbuf *b, const struct md_chat_msg *m, const enum role *r,
                          size_t n, const struct md_chat_opts *o)
{
	for (size_t i = 0; i < n; i++) {
		if (i == 0 && r[0] != R_SYSTEM)
			sb_puts(b, "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n");
		sb_puts(b, "<|im_start|>");
		sb_puts(b, m[i].role);
		sb_puts(b, "\n");
		sb_puts(b, m[i].content);
		if (i + 1 < n || o->add_generation_prompt)
			sb_puts(b, "<|im_end|>\n");
	}
	if (o->add_generation_prompt && r[n - 1] != R_ASSISTANT)
		sb_puts(b, "<|im_start|>assistant\n");
}

static void render_qwen25(struct sbuf *b, const struct md_chat_msg *m, const enum role *r,
                          size_t n, const struct md_chat_opts *o)
{
	if (r[0] == R_SYSTEM) {
		sb_puts(b, "<|im_start|>system\n");
		sb_puts(b, m[0].content);
		sb_puts(b, "<|im_end|>\n");
	} else {
		sb_puts(b, "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
			   "helpful assistant.<|im_end|>\n");
	}
	for (size_t i = r[0] == R_SYSTEM ? 1 : 0; i < n; i++) {
		sb_puts(b, "<|im_start|>");
		sb_puts(b, m[i].role);
		sb_puts(b, "\n");
		sb_puts(b, m[i].content);
		sb_puts(b, "<|im_end|>\n");
	}
	if (o->add_generation_prompt)
		sb_puts(b, "<|im_start|>assistant\n");
}

/*
 * Qwen3: assistant turns after the last real user query keep their reasoning as a
 * <think> block (the final turn always gets one, possibly empty); earlier turns lose it.
 * A "user" message wrapped in <tool_response>...</tool_response> does not count as a query.
 * Tools, tool calls and tool results in the Hermes format. Without reasoning_blocks (chatml
 * with tools) assistant turns are written as they are.
 */
static void render_qwen3(struct sbuf *b, const struct md_chat_msg *m, const enum role *r,
                         size_t n, const struct md_chat_opts *o, bool reasoning_blocks)
{
	size_t last_query = n - 1;

	if (o->n_tools > 0) {
		tools_prologue(b, m, r, o);
	} else if (r[0] == R_SYSTEM) {
		sb_puts(b, "<|im_start|>system\n");
		sb_puts(b, m[0].content);
		sb_puts(b, "<|im_end|>\n");
	}
	for (size_t k = n; k-- > 0;) {
		struct span c = span_of(m[k].content);

		if (r[k] == R_USER &&
		    !(starts_with(c, "<tool_response>") && ends_with(c, "</tool_response>"))) {
			last_query = k;
			break;
		}
	}
	for (size_t i = 0; i < n; i++) {
		if (r[i] == R_USER || (r[i] == R_SYSTEM && i > 0)) {
			sb_puts(b, "<|im_start|>");
			sb_puts(b, m[i].role);
			sb_puts(b, "\n");
			sb_puts(b, m[i].content);
			sb_puts(b, "<|im_end|>\n");
		} else if (r[i] == R_TOOL) {
			tool_response_hermes(b, m, r, n, i);
		} else if (r[i] == R_ASSISTANT) {
			struct span content = span_of(m[i].content);
			struct span reasoning = { "", 0 };
			if (reasoning_blocks)
				reasoning = split_think(&content);
			sb_puts(b, "<|im_start|>assistant\n");
			bool content_set = content.n > 0; /* the template tests its variable */
			if (reasoning_blocks && i > last_query && (i + 1 == n || reasoning.n > 0)) {
				sb_puts(b, "<think>\n");
				sb_span(b, lstrip_nl(rstrip_nl(reasoning)));
				sb_puts(b, "\n</think>\n\n");
				content = lstrip_nl(content);
			}
			sb_span(b, content);
			tool_calls_hermes(b, &m[i], content_set);
			sb_puts(b, "<|im_end|>\n");
		}
	}
	if (o->add_generation_prompt) {
		sb_puts(b, "<|im_start|>assistant\n");
		if (reasoning_blocks && o->enable_thinking == 0)
			sb_puts(b, "<think>\n\n</think>\n\n");
	}
}

/* Mixtral-8x7B-Instruct: an initial system message is prepended to the first user turn. */
static int render_mistral(struct sbuf *b, const struct md_chat_msg *m, const enum role *r,
                          size_t n, const struct md_chat_opts *o)
{
	const char *sys = NULL;
	size_t first = 0;

	if (r[0] == R_SYSTEM) {
		sys = m[0].content;
		first = 1;
	}
	sb_puts(b, o->bos_text);
	for (size_t i = first; i < n; i++) {
		bool even = (i - first) % 2 == 0;

		if ((r[i] == R_USER) != even || r[i] == R_SYSTEM)
			return -EINVAL;
		if (r[i] == R_USER) {
			sb_puts(b, " [INST] ");
			if (i == first && sys) {
				sb_puts(b, sys);
				sb_puts(b, "\n\n");
			}
			sb_puts(b, m[i].content);
			sb_puts(b, " [/INST]");
		} else {
			sb_puts(b, " ");
			sb_puts(b, m[i].content);
			sb_puts(b, o->eos_text);
		}
	}
	return 0;
}

/* Mistral-7B-Instruct v0.1/v0.2: strictly user/assistant alternation, no system role. */
static int render_mistral_v1(struct sbuf *b, const struct md_chat_msg *m, const enum role *r,
                             size_t n, const struct md_chat_opts *o)
{
	sb_puts(b, o->bos_text);
	for (size_t i = 0; i < n; i++) {
		if ((r[i] == R_USER) != (i % 2 == 0) || r[i] == R_SYSTEM)
			return -EINVAL;
		if (r[i] == R_USER) {
			sb_puts(b, "[INST] ");
			sb_puts(b, m[i].content);
			sb_puts(b, " [/INST]");
		} else {
			sb_puts(b, m[i].content);
			sb_puts(b, o->eos_text);
			sb_puts(b, " ");
		}
	}
	return 0;
}

static void render_tulu(struct sbuf *b, const struct md_chat_msg *m, const enum role *r,
                        size_t n, const struct md_chat_opts *o, bool bos)
{
	static const char *const tag[] = {
		[R_SYSTEM] = "<|system|>\n", [R_USER] = "<|user|>\n", [R_ASSISTANT] = "<|assistant|>\n"
	};

	if (bos)
		sb_puts(b, o->bos_text);
	for (size_t i = 0; i < n; i++) {
		bool last = i + 1 == n;

		sb_puts(b, tag[r[i]]);
		sb_puts(b, m[i].content);
		if (r[i] == R_ASSISTANT) {
			sb_puts(b, o->eos_text);
			if (!last)
				sb_puts(b, "\n");
		} else {
			sb_puts(b, "\n");
		}
		if (last && o->add_generation_prompt)
			sb_puts(b, "<|assistant|>\n");
	}
}

static void render_llama3(struct sbuf *b, const struct md_chat_msg *m, size_t n,
                          const struct md_chat_opts *o)
{
	for (size_t i = 0; i < n; i++) {
		if (i == 0)
			sb_puts(b, o->bos_text);
		sb_puts(b, "<|start_header_id|>");
		sb_puts(b, m[i].role);
		sb_puts(b, "<|end_header_id|>\n\n");
		sb_span(b, py_strip(span_of(m[i].content)));
		sb_puts(b, "<|eot_id|>");
	}
	if (o->add_generation_prompt)
		sb_puts(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

/* s as a JSON string, as Jinja's tojson writes it (Python's json.dumps with
 * ensure_ascii=False, JavaScript's JSON.stringify): quote, backslash and control characters
 * escaped, everything else as is. */
static void sb_json_string(struct sbuf *b, const char *s)
{
	static const char hex[] = "0123456789abcdef";

	sb_puts(b, "\"");
	for (const char *p = s; *p; p++) {
		unsigned char c = (unsigned char)*p;
		char esc[7] = { '\\', 0 };

		switch (c) {
		case '"': esc[1] = '"'; break;
		case '\\': esc[1] = '\\'; break;
		case '\n': esc[1] = 'n'; break;
		case '\r': esc[1] = 'r'; break;
		case '\t': esc[1] = 't'; break;
		case '\b': esc[1] = 'b'; break;
		case '\f': esc[1] = 'f'; break;
		default:
			if (c >= 0x20) {
				sb_put(b, p, 1);
				continue;
			}
			memcpy(esc + 1, "u00", 3);
			esc[4] = hex[c >> 4];
			esc[5] = hex[c & 15];
		}
		sb_puts(b, esc);
	}
	sb_puts(b, "\"");
}

/*
 * Mistral-Nemo-Instruct-2407. After an optional first system message, user and assistant turns
 * alternate (tool messages and tool-call turns aside). The tools go right before the last user
 * turn, and the system message into that turn only when it is the conversation's last message
 * (the template's quirk, kept). Python compares the user message dicts by value, so a user turn
 * equal to the last one gets the tools too (@huggingface/jinja compares them by identity; no
 * conversation of the tests tells the two apart). No generation prompt: the template has none.
 */
static int render_mistral_nemo(struct sbuf *b, const struct md_chat_msg *m, const enum role *r,
			       size_t n, const struct md_chat_opts *o)
{
	size_t first = r[0] == R_SYSTEM ? 1 : 0, k = 0, last_user = n;

	for (size_t i = first; i < n; i++) {
		if (r[i] == R_USER)
			last_user = i;
		if (r[i] == R_TOOL || m[i].n_tool_calls > 0)
			continue;
		if ((r[i] == R_USER) != (k % 2 == 0))
			return -EINVAL;
		k++;
	}
	sb_puts(b, o->bos_text);
	for (size_t i = first; i < n; i++) {
		if (r[i] == R_USER) {
			if (o->n_tools > 0 && strcmp(m[i].content, m[last_user].content) == 0) {
				sb_puts(b, "[AVAILABLE_TOOLS][");
				for (size_t t = 0; t < o->n_tools; t++) {
					if (t > 0)
						sb_puts(b, ", ");
					sb_puts(b, o->tools[t]);
				}
				sb_puts(b, "][/AVAILABLE_TOOLS]");
			}
			sb_puts(b, "[INST]");
			if (i + 1 == n && first) {
				sb_puts(b, m[0].content);
				sb_puts(b, "\n\n");
			}
			sb_puts(b, m[i].content);
			sb_puts(b, "[/INST]");
		} else if (m[i].n_tool_calls > 0) {
			sb_puts(b, "[TOOL_CALLS][");
			for (size_t c = 0; c < m[i].n_tool_calls; c++) {
				const struct md_chat_tool_call *tc = &m[i].tool_calls[c];

				if (!tc->arguments_obj || !tc->id || strlen(tc->id) != 9)
					return -EINVAL;
				sb_puts(b, "{\"name\": ");
				sb_json_string(b, tc->name);
				sb_puts(b, ", \"arguments\": ");
				sb_puts(b, tc->arguments_obj);
				sb_puts(b, ", \"id\": \"");
				sb_puts(b, tc->id);
				sb_puts(b, c + 1 < m[i].n_tool_calls ? "\"}, " : "\"}]");
			}
			sb_puts(b, o->eos_text);
		} else if (r[i] == R_ASSISTANT) {
			sb_puts(b, m[i].content);
			sb_puts(b, o->eos_text);
		} else if (r[i] == R_TOOL) {
			if (!m[i].tool_call_id || strlen(m[i].tool_call_id) != 9)
				return -EINVAL;
			sb_puts(b, "[TOOL_RESULTS]{\"content\": ");
			sb_puts(b, m[i].content);
			sb_puts(b, ", \"call_id\": \"");
			sb_puts(b, m[i].tool_call_id);
			sb_puts(b, "\"}[/TOOL_RESULTS]");
		} else {
			return -EINVAL; /* a system message after the first */
		}
	}
	return 0;
}

/*
 * Llama 3.1 / 3.2 Instruct: the system turn always carries the knowledge and today's dates
 * (and "Environment: ipython" with tools); the tools go into the first turn after the system
 * message, whatever its role, with the template's instructions. A tool-call turn holds one
 * call as {"name": ..., "parameters": ...}; a tool result is an ipython turn whose content the
 * template writes as a JSON string (a string "is iterable" to Jinja).
 */
static int render_llama31(struct sbuf *b, const struct md_chat_msg *m, const enum role *r,
			  size_t n, const struct md_chat_opts *o, const char *date)
{
	size_t i = 0;

	sb_puts(b, o->bos_text);
	sb_puts(b, "<|start_header_id|>system<|end_header_id|>\n\n");
	if (o->n_tools > 0)
		sb_puts(b, "Environment: ipython\n");
	sb_puts(b, "Cutting Knowledge Date: December 2023\nToday Date: ");
	sb_puts(b, date);
	sb_puts(b, "\n\n");
	if (r[0] == R_SYSTEM) {
		sb_span(b, py_strip(span_of(m[0].content)));
		i = 1;
	}
	sb_puts(b, "<|eot_id|>");
	if (o->n_tools > 0) {
		if (i == n)
			return -EINVAL; /* "Cannot put tools in the first user message ..." */
		sb_puts(b, "<|start_header_id|>user<|end_header_id|>\n\n"
			   "Given the following functions, please respond with a JSON for a function "
			   "call with its proper arguments that best answers the given prompt.\n\n"
			   "Respond in the format {\"name\": function name, \"parameters\": dictionary "
			   "of argument name and its value}.Do not use variables.\n\n");
		for (size_t t = 0; t < o->n_tools; t++) {
			sb_puts(b, o->tools[t]);
			sb_puts(b, "\n\n");
		}
		sb_span(b, py_strip(span_of(m[i].content)));
		sb_puts(b, "<|eot_id|>");
		i++;
	}
	for (; i < n; i++) {
		if (m[i].n_tool_calls > 0) {
			const struct md_chat_tool_call *tc = &m[i].tool_calls[0];

			if (m[i].n_tool_calls != 1 || !tc->arguments_obj)
				return -EINVAL;
			sb_puts(b, "<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"");
			sb_puts(b, tc->name);
			sb_puts(b, "\", \"parameters\": ");
			sb_puts(b, tc->arguments_obj);
			sb_puts(b, "}<|eot_id|>");
		} else if (r[i] == R_TOOL) {
			sb_puts(b, "<|start_header_id|>ipython<|end_header_id|>\n\n");
			sb_json_string(b, m[i].content);
			sb_puts(b, "<|eot_id|>");
		} else {
			sb_puts(b, "<|start_header_id|>");
			sb_puts(b, m[i].role);
			sb_puts(b, "<|end_header_id|>\n\n");
			sb_span(b, py_strip(span_of(m[i].content)));
			sb_puts(b, "<|eot_id|>");
		}
	}
	if (o->add_generation_prompt)
		sb_puts(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
	return 0;
}

/* DeepSeek-V3: every system message, joined by a blank line, goes first after BOS. */
/*
 * DeepSeek-V3 with tool calls and results, as its template writes them: an assistant message
 * whose content is null writes its calls (the first call of the whole conversation opens
 * <｜tool▁calls▁begin｜>; only later ones close it, a quirk of the template kept as is); one with
 * content after tool results closes the outputs first; tool results share one outputs block.
 * The tools themselves are not rendered: the template has no place for them.
 */
static void render_deepseek3_tools(struct sbuf *b, const struct md_chat_msg *m,
				   const enum role *r, size_t n, const struct md_chat_opts *o)
{
	bool is_first = false, is_tool = false, output_first = true;

	for (size_t i = 0; i < n; i++) {
		if (r[i] == R_USER) {
			is_tool = false;
			sb_puts(b, "<｜User｜>");
			sb_puts(b, m[i].content);
		}
		if (r[i] == R_ASSISTANT && m[i].content_null) {
			is_tool = false;
			for (size_t k = 0; k < m[i].n_tool_calls; k++) {
				sb_puts(b, is_first ? "\n<｜tool▁call▁begin｜>"
						    : "<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>");
				sb_puts(b, "function<｜tool▁sep｜>");
				sb_puts(b, m[i].tool_calls[k].name);
				sb_puts(b, "\n```json\n");
				sb_puts(b, m[i].tool_calls[k].arguments);
				sb_puts(b, "\n```<｜tool▁call▁end｜>");
				if (is_first)
					sb_puts(b, "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>");
				is_first = true;
			}
		}
		if (r[i] == R_ASSISTANT && !m[i].content_null) {
			sb_puts(b, is_tool ? "<｜tool▁outputs▁end｜>" : "<｜Assistant｜>");
			sb_puts(b, m[i].content);
			sb_puts(b, "<｜end▁of▁sentence｜>");
			is_tool = false;
		}
		if (r[i] == R_TOOL) {
			is_tool = true;
			sb_puts(b, output_first ? "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>"
						: "\n<｜tool▁output▁begin｜>");
			sb_puts(b, m[i].content);
			sb_puts(b, "<｜tool▁output▁end｜>");
			output_first = false;
		}
	}
	if (is_tool)
		sb_puts(b, "<｜tool▁outputs▁end｜>");
	if (o->add_generation_prompt && !is_tool)
		sb_puts(b, "<｜Assistant｜>");
}

static void render_deepseek3(struct sbuf *b, const struct md_chat_msg *m, const enum role *r,
                             size_t n, const struct md_chat_opts *o)
{
	bool first_sys = true, tools = false;

	for (size_t i = 0; i < n && !tools; i++)
		tools = r[i] == R_TOOL || m[i].n_tool_calls > 0 || m[i].content_null;
	sb_puts(b, o->bos_text);
	for (size_t i = 0; i < n; i++) {
		if (r[i] != R_SYSTEM)
			continue;
		if (!first_sys)
			sb_puts(b, "\n\n");
		sb_puts(b, m[i].content);
		first_sys = false;
	}
	if (tools) {
		render_deepseek3_tools(b, m, r, n, o);
		return;
	}
	for (size_t i = 0; i < n; i++) {
		if (r[i] == R_USER) {
			sb_puts(b, "<｜User｜>");
			sb_puts(b, m[i].content);
		} else if (r[i] == R_ASSISTANT) {
			sb_puts(b, "<｜Assistant｜>");
			sb_puts(b, m[i].content);
			sb_puts(b, "<｜end▁of▁sentence｜>");
		}
	}
	if (o->add_generation_prompt)
		sb_puts(b, "<｜Assistant｜>");
}

/*
 * gpt-oss-20b/120b's harmony template (see the header for what it renders). The template's
 * kwargs model_identity and builtin_tools are not taken (their defaults: the ChatGPT identity,
 * none); reasoning_effort and the date are md_chat_opts fields.
 */
static bool has_channel_tags(const char *s)
{
	return s && (strstr(s, "<|channel|>analysis<|message|>") || strstr(s, "<|channel|>final<|message|>"));
}

static int render_gpt_oss(struct sbuf *b, const struct md_chat_msg *m, const enum role *r,
			  size_t n, const struct md_chat_opts *o)
{
	char today[16];
	const char *date = o->date_text;

	if (!date) {
		time_t now = time(NULL);
		struct tm tm;

		if (!localtime_r(&now, &tm) || !strftime(today, sizeof(today), "%Y-%m-%d", &tm))
			snprintf(today, sizeof(today), "1970-01-01");
		date = today;
	}
	for (size_t i = 0; i < n; i++)
		if (r[i] == R_ASSISTANT && (has_channel_tags(m[i].content) || has_channel_tags(m[i].reasoning)))
			return -EINVAL; /* the template's raise_exception */
	sb_puts(b, "<|start|>system<|message|>You are ChatGPT, a large language model trained by "
		   "OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: ");
	sb_puts(b, date);
	sb_puts(b, "\n\nReasoning: ");
	sb_puts(b, o->reasoning_effort ? o->reasoning_effort : "medium");
	sb_puts(b, "\n\n# Valid channels: analysis, commentary, final. Channel must be included for "
		   "every message.<|end|>");
	size_t i0 = 0;
	if (r[0] == R_SYSTEM) {
		i0 = 1;
		if (m[0].content[0]) {
			sb_puts(b, "<|start|>developer<|message|># Instructions\n\n");
			sb_puts(b, m[0].content);
			sb_puts(b, "\n\n<|end|>");
		}
	}
	for (size_t i = i0; i < n; i++) {
		if (r[i] == R_USER) {
			sb_puts(b, "<|start|>user<|message|>");
			sb_puts(b, m[i].content);
			sb_puts(b, "<|end|>");
		} else if (r[i] == R_ASSISTANT && i + 1 == n && !o->add_generation_prompt) {
			if (m[i].reasoning) {
				sb_puts(b, "<|start|>assistant<|channel|>analysis<|message|>");
				sb_puts(b, m[i].reasoning);
				sb_puts(b, "<|end|>");
			}
			sb_puts(b, "<|start|>assistant<|channel|>final<|message|>");
			sb_puts(b, m[i].content);
			sb_puts(b, "<|return|>");
		} else if (r[i] == R_ASSISTANT) {
			sb_puts(b, "<|start|>assistant<|channel|>final<|message|>");
			sb_puts(b, m[i].content);
			sb_puts(b, "<|end|>");
		}
	}
	if (o->add_generation_prompt)
		sb_puts(b, "<|start|>assistant");
	return 0;
}

/*
 * GLM-4.5/4.6: "[gMASK]<sop>", then <|system|>\n / <|user|>\n turns (a user turn gets
 * "/nothink" when enable_thinking is false and it does not end so already), assistant turns
 * as <|assistant|> + "\n<think>R</think>" (R the reasoning part of a turn after the last user
 * turn: its content up to the first </think>, after the last <think> before that, newlines
 * trimmed, then strip()ped) or "\n<think></think>", then "\n" + the part after the last
 * </think>, strip()ped, when not empty. The generation prompt is <|assistant|>, with
 * "\n<think></think>" when enable_thinking is false. Rendered with the trim_blocks and
 * lstrip_blocks Hugging Face applies, which leave no other whitespace.
 */
static void render_glm45(struct sbuf *b, const struct md_chat_msg *m, const enum role *r,
			 size_t n, const struct md_chat_opts *o)
{
	size_t last_user = SIZE_MAX;

	for (size_t i = 0; i < n; i++)
		if (r[i] == R_USER)
			last_user = i;
	sb_puts(b, "[gMASK]<sop>");
	for (size_t i = 0; i < n; i++) {
		struct span c = span_of(m[i].content);

		if (r[i] == R_USER) {
			sb_puts(b, "<|user|>\n");
			sb_span(b, c);
			if (o->enable_thinking == 0 && !ends_with(c, "/nothink"))
				sb_puts(b, "/nothink");
		} else if (r[i] == R_SYSTEM) {
			sb_puts(b, "<|system|>\n");
			sb_span(b, c);
		} else if (r[i] == R_ASSISTANT) {
			struct span reasoning = split_think(&c);
			sb_puts(b, "<|assistant|>");
			if ((last_user == SIZE_MAX || i > last_user) && reasoning.n > 0) {
				sb_puts(b, "\n<think>");
				sb_span(b, py_strip(reasoning));
				sb_puts(b, "</think>");
			} else {
				sb_puts(b, "\n<think></think>");
			}
			c = py_strip(c);
			if (c.n > 0) {
				sb_puts(b, "\n");
				sb_span(b, c);
			}
		}
	}
	if (o->add_generation_prompt) {
		sb_puts(b, "<|assistant|>");
		if (o->enable_thinking == 0)
			sb_puts(b, "\n<think></think>");
	}
}

int md_chat_render_opts(enum md_chat_family f, const struct md_chat_msg *msgs, size_t n,
                        const struct md_chat_opts *opts, char **out, size_t *out_len)
{
	struct md_chat_opts o = *opts;
	struct sbuf b = { 0 };
	enum role *r;
	int rc = 0;

	*out = NULL;
	if (out_len)
		*out_len = 0;
	if ((unsigned)f >= MD_CHAT_FAMILY_COUNT || n == 0 || !msgs)
		return -EINVAL;
	if (!o.bos_text)
		o.bos_text = "";
	if (!o.eos_text)
		o.eos_text = "";
	r = calloc(n, sizeof(*r));
	if (!r)
		return -ENOMEM;
	for (size_t i = 0; i < n; i++) {
		if (!msgs[i].role || !msgs[i].content) {
			rc = -EINVAL;
			goto out_free_roles;
		}
		if (strcmp(msgs[i].role, "system") == 0 || strcmp(msgs[i].role, "developer") == 0) {
			r[i] = R_SYSTEM; /* OpenAI's developer role is the system role of older models */
		} else if (strcmp(msgs[i].role, "user") == 0) {
			r[i] = R_USER;
		} else if (strcmp(msgs[i].role, "assistant") == 0) {
			r[i] = R_ASSISTANT;
		} else if (strcmp(msgs[i].role, "tool") == 0) {
			r[i] = R_TOOL;
		} else {
			rc = -EINVAL;
			goto out_free_roles;
		}
		if ((r[i] == R_TOOL || msgs[i].n_tool_calls > 0) && !md_chat_family_has_tools(f)) {
			rc = -ENOTSUP;
			goto out_free_roles;
		}
		for (size_t k = 0; k < msgs[i].n_tool_calls; k++)
			if (r[i] != R_ASSISTANT || !msgs[i].tool_calls[k].name ||
			    !msgs[i].tool_calls[k].arguments) {
				rc = -EINVAL;
				goto out_free_roles;
			}
	}
	if (o.n_tools > 0 && !md_chat_family_has_tools(f)) {
		rc = -ENOTSUP;
		goto out_free_roles;
	}
	switch (f) {
	case MD_CHAT_CHATML:
		render_chatml(&b, msgs, r, n, &o, false, NULL);
		break;
	case MD_CHAT_CHATML_BOS:
		render_chatml(&b, msgs, r, n, &o, true, NULL);
		break;
	case MD_CHAT_QWEN15:
		render_qwen15(&b, msgs, r, n, &o);
		break;
	case MD_CHAT_QWEN2:
		render_chatml(&b, msgs, r, n, &o, false, "You are a helpful assistant.");
		break;
	case MD_CHAT_QWEN25:
		render_qwen25(&b, msgs, r, n, &o);
		break;
	case MD_CHAT_QWEN3:
		render_qwen3(&b, msgs, r, n, &o, true);
		break;
	case MD_CHAT_MISTRAL:
		rc = render_mistral(&b, msgs, r, n, &o);
		break;
	case MD_CHAT_MISTRAL_V1:
		rc = render_mistral_v1(&b, msgs, r, n, &o);
		break;
	case MD_CHAT_TULU:
		render_tulu(&b, msgs, r, n, &o, false);
		break;
	case MD_CHAT_OLMO2:
		render_tulu(&b, msgs, r, n, &o, true);
		break;
	case MD_CHAT_LLAMA3:
		render_llama3(&b, msgs, n, &o);
		break;
	case MD_CHAT_DEEPSEEK3:
		render_deepseek3(&b, msgs, r, n, &o);
		break;
	case MD_CHAT_GPT_OSS:
		rc = render_gpt_oss(&b, msgs, r, n, &o);
		break;
	case MD_CHAT_MISTRAL_NEMO:
		rc = render_mistral_nemo(&b, msgs, r, n, &o);
		break;
	case MD_CHAT_LLAMA31:
		rc = render_llama31(&b, msgs, r, n, &o, "26 Jul 2024");
		break;
	case MD_CHAT_LLAMA32: {
		char today[32];
		const char *date = o.date_string;

		if (!date) {
			time_t now = time(NULL);
			struct tm tm;

			/* strftime's %b follows the locale; the template's is Python's "C" one */
			static const char *const mon[] = { "Jan", "Feb", "Mar", "Apr", "May", "Jun",
							   "Jul", "Aug", "Sep", "Oct", "Nov", "Dec" };
			localtime_r(&now, &tm);
			snprintf(today, sizeof(today), "%02d %s %04d", tm.tm_mday, mon[tm.tm_mon],
				 tm.tm_year + 1900);
			date = today;
		}
		rc = render_llama31(&b, msgs, r, n, &o, date);
		break;
	}
	case MD_CHAT_GLM45:
		render_glm45(&b, msgs, r, n, &o);
		break;
	default:
		rc = -EINVAL;
		break;
	}
	if (rc == 0 && b.oom)
		rc = -ENOMEM;
	if (rc == 0 && !b.p) {
		/* Empty rendering (e.g. Mixtral with only a system message and no BOS text). */
		b.p = malloc(1);
		if (!b.p)
			rc = -ENOMEM;
		else
			b.p[0] = '\0';
	}
	if (rc != 0) {
		free(b.p);
		goto out_free_roles;
	}
	*out = b.p;
	if (out_len)
		*out_len = b.n;
out_free_roles:
	free(r);
	return rc;
}

bool md_chat_family_has_tools(enum md_chat_family f)
{
	return md_chat_family_tool_format(f) != MD_TOOL_FORMAT_NONE;
}

enum md_tool_format md_chat_family_tool_format(enum md_chat_family f)
{
	if (f == MD_CHAT_QWEN3 || f == MD_CHAT_CHATML)
		return MD_TOOL_FORMAT_HERMES;
	if (f == MD_CHAT_DEEPSEEK3)
		return MD_TOOL_FORMAT_DEEPSEEK3;
	if (f == MD_CHAT_MISTRAL_NEMO)
		return MD_TOOL_FORMAT_MISTRAL;
	if (f == MD_CHAT_LLAMA31 || f == MD_CHAT_LLAMA32)
		return MD_TOOL_FORMAT_LLAMA3;
	return MD_TOOL_FORMAT_NONE;
}

enum md_chat_tool_text md_chat_family_tool_text(enum md_chat_family f)
{
	if (f == MD_CHAT_MISTRAL_NEMO)
		return MD_CHAT_TOOL_MISTRAL;
	if (f == MD_CHAT_LLAMA31 || f == MD_CHAT_LLAMA32)
		return MD_CHAT_TOOL_TOJSON_INDENT4;
	return MD_CHAT_TOOL_TOJSON;
}

int md_chat_render(enum md_chat_family f, const struct md_chat_msg *msgs, size_t n,
                   bool add_generation_prompt, const char *bos_text, const char *eos_text,
                   char **out, size_t *out_len)
{
	struct md_chat_opts o = {
		.add_generation_prompt = add_generation_prompt,
		.enable_thinking = -1,
		.bos_text = bos_text,
		.eos_text = eos_text,
	};

	return md_chat_render_opts(f, msgs, n, &o, out, out_len);
}
