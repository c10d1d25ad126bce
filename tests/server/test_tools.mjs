// Tool calling through the official OpenAI Node SDK: forced calls (tool_choice required and
// named, parallel or not) whose arguments validate against the tools' parameter schemas (ajv),
// a two-turn conversation that sends the call and its result back, streamed delta.tool_calls
// that reassemble to the whole response, tool_choice none, the parser under auto, and errors.
// Env: MOED_BASE, MOED_NPM, MOED_TOOL_FAMILY (the server's --chat-template, whose tool format
// the calls take: default Hermes; mistral-nemo [TOOL_CALLS] with 9-character ids; llama3.1 one
// JSON call per turn). Prints one streamed call as the SDK saw it.
import { createRequire } from 'node:module';
import path from 'node:path';

const require = createRequire(path.join(process.env.MOED_NPM, 'package.json'));
const OpenAI = require('openai').default ?? require('openai');
const Ajv = require('ajv').default ?? require('ajv');
const client = new OpenAI({ baseURL: process.env.MOED_BASE + '/v1', apiKey: 'test-key', maxRetries: 0 });
const ajv = new Ajv({ strict: false });
const family = process.env.MOED_TOOL_FAMILY || 'default';
const mistral = family === 'mistral-nemo', llama = family.startsWith('llama3');
const idRe = mistral ? /^[A-Za-z0-9]{9}$/ : /^call_[A-Za-z0-9]{24}$/;
console.log(`tool format of the '${family}' chat template`);

let fails = 0;
function check(cond, what, ...detail) {
  if (!cond) {
    fails++;
    console.log('FAIL:', what, ...detail.map((d) => JSON.stringify(d)?.slice(0, 800)));
  }
  return cond;
}

const tools = [
  { type: 'function', function: { name: 'get_weather', description: 'Current weather in a city',
    parameters: { type: 'object', additionalProperties: false, required: ['city', 'unit'],
      properties: { city: { type: 'string', maxLength: 24 }, unit: { type: 'string', enum: ['celsius', 'fahrenheit'] } } } } },
  { type: 'function', function: { name: 'add', description: 'Add two integers',
    parameters: { type: 'object', additionalProperties: false, required: ['a', 'b'],
      properties: { a: { type: 'integer', minimum: -1000, maximum: 1000 }, b: { type: 'integer', minimum: -1000, maximum: 1000 } } } } },
  { type: 'function', function: { name: 'no_args', description: 'Takes nothing' } },
];
const validate = Object.fromEntries(tools.map((t) => [t.function.name,
  ajv.compile(t.function.parameters ?? { type: 'object' })]));

const models = await client.models.list();
const model = models.data[0].id;
const user = { role: 'user', content: 'What is the weather in Paris, and what is 2 plus 3?' };

function checkCalls(calls, what, onlyName) {
  check(Array.isArray(calls) && calls.length > 0, `${what}: tool_calls present`, calls);
  for (const c of calls ?? []) {
    check(typeof c.id === 'string' && idRe.test(c.id), `${what}: call id`, c.id);
    check(c.type === 'function', `${what}: type function`, c);
    check(c.function.name in validate, `${what}: a declared tool`, c.function.name);
    if (onlyName) check(c.function.name === onlyName, `${what}: the named tool`, c.function.name);
    let args;
    try {
      args = JSON.parse(c.function.arguments);
    } catch (e) {
      check(false, `${what}: arguments parse`, c.function.arguments);
      continue;
    }
    check(validate[c.function.name]?.(args), `${what}: arguments validate`, c.function.name, args);
  }
}

// 1. required, whole and streamed, several seeds: valid calls; the stream reassembles to the
//    whole response (same seed and settings)
let shown = false;
for (const [seed, parallel] of [[1, true], [2, false], [3, true], [4, false], [5, true]]) {
  const body = { model, messages: [user], tools, tool_choice: 'required', parallel_tool_calls: parallel,
    temperature: 1, seed, max_tokens: 120 };
  const whole = await client.chat.completions.create(body);
  const m = whole.choices[0].message;
  check(whole.choices[0].finish_reason === 'tool_calls', `required seed ${seed}: finish tool_calls`,
    whole.choices[0].finish_reason, m);
  checkCalls(m.tool_calls, `required seed ${seed}`);
  if (!parallel || llama) check(m.tool_calls?.length === 1, `seed ${seed}: one call (parallel_tool_calls ${parallel})`, m.tool_calls);
  const stream = await client.chat.completions.create({ ...body, stream: true });
  const acc = [];
  let finish = null, content = '';
  const seen = [];
  for await (const chunk of stream) {
    const c = chunk.choices[0];
    if (!c) continue;
    if (c.finish_reason) finish = c.finish_reason;
    content += c.delta?.content ?? '';
    for (const d of c.delta?.tool_calls ?? []) {
      if (!shown) seen.push(d);
      acc[d.index] ??= { id: '', name: '', arguments: '' };
      if (d.id) acc[d.index].id = d.id;
      if (d.function?.name) acc[d.index].name += d.function.name;
      acc[d.index].arguments += d.function?.arguments ?? '';
    }
  }
  if (!shown) {
    console.log('a streamed tool call as the SDK saw it (delta.tool_calls of each chunk):');
    for (const d of seen) console.log('  ' + JSON.stringify(d));
    shown = true;
  }
  check(finish === 'tool_calls', `stream seed ${seed}: finish tool_calls`, finish);
  check(content === '', `stream seed ${seed}: no content`, content);
  check(acc.length === (m.tool_calls?.length ?? -1), `stream seed ${seed}: same number of calls`, acc, m.tool_calls);
  for (let i = 0; i < acc.length; i++) {
    check(acc[i].name === m.tool_calls?.[i]?.function.name && acc[i].arguments === m.tool_calls?.[i]?.function.arguments,
      `stream seed ${seed}: call ${i} reassembles to the whole response`, acc[i], m.tool_calls?.[i]);
    check(idRe.test(acc[i].id), `stream seed ${seed}: call ${i} has an id`, acc[i].id);
  }
}

// 2. a named function
{
  const r = await client.chat.completions.create({ model, messages: [user], tools, temperature: 0.7, seed: 11,
    tool_choice: { type: 'function', function: { name: 'add' } }, max_tokens: 120 });
  checkCalls(r.choices[0].message.tool_calls, 'named add', 'add');
  check(r.choices[0].message.tool_calls?.length === 1, 'named: exactly one call', r.choices[0].message.tool_calls);
  const n = await client.chat.completions.create({ model, messages: [user], tools, temperature: 0,
    tool_choice: { type: 'function', function: { name: 'no_args' } }, max_tokens: 120 });
  checkCalls(n.choices[0].message.tool_calls, 'named no_args', 'no_args');
}

// 3. two turns: the call and its result go back; the model answers in text
{
  const first = await client.chat.completions.create({ model, messages: [user], tools, temperature: 0,
    tool_choice: { type: 'function', function: { name: 'get_weather' } }, max_tokens: 120 });
  const am = first.choices[0].message;
  checkCalls(am.tool_calls, 'turn 1', 'get_weather');
  const messages = [user, am, ...am.tool_calls.map((c) => ({ role: 'tool', tool_call_id: c.id,
    content: JSON.stringify({ city: JSON.parse(c.function.arguments).city, temperature: 21 }) }))];
  const second = await client.chat.completions.create({ model, messages, tools, temperature: 0, max_tokens: 16 });
  const c2 = second.choices[0];
  check(['stop', 'length', 'tool_calls'].includes(c2.finish_reason), 'turn 2 finishes', c2.finish_reason);
  check(second.usage.prompt_tokens > first.usage.prompt_tokens, 'turn 2 prompt holds turn 1, the call and its result',
    second.usage.prompt_tokens, first.usage.prompt_tokens);
  // the same conversation with tool_choice none: text only
  const none = await client.chat.completions.create({ model, messages, tools, tool_choice: 'none', temperature: 0, max_tokens: 16 });
  check(!none.choices[0].message.tool_calls && typeof none.choices[0].message.content === 'string',
    'tool_choice none: text, no calls', none.choices[0].message);
  check(none.choices[0].finish_reason !== 'tool_calls', 'tool_choice none: finish not tool_calls', none.choices[0].finish_reason);
  // and a third turn after a text answer
  const third = await client.chat.completions.create({ model, temperature: 0, max_tokens: 8, tools,
    messages: [...messages, { role: 'assistant', content: none.choices[0].message.content }, { role: 'user', content: 'Thanks' }] });
  check(third.choices.length === 1, 'turn 3 answered', third);
}

// 4. auto: the parser takes a call the model writes out of the content (the raw grammar makes
//    the model write one after some text), streamed and whole alike
{
  const argsG = '{\\"city\\": \\"" [A-Z] [a-z]{2,6} "\\", \\"unit\\": \\"celsius\\"}';
  const grammar = mistral ? `root ::= "Let me check. [TOOL_CALLS][{\\"name\\": \\"get_weather\\", \\"arguments\\": ${argsG}, \\"id\\": \\"abcdefghi\\"}]"`
    : llama ? `root ::= " {\\"name\\": \\"get_weather\\", \\"parameters\\": ${argsG}}"` // a call is the whole reply
    : `root ::= "Let me check.\\n<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": ${argsG}}\\n</tool_call>"`;
  const body = { model, messages: [user], tools, tool_choice: 'auto', grammar, temperature: 1, seed: 21, max_tokens: 120 };
  const r = await client.chat.completions.create(body);
  const m = r.choices[0].message;
  check(m.content === (llama ? null : 'Let me check.'), 'auto: the text before the call is content', m.content);
  checkCalls(m.tool_calls, 'auto', 'get_weather');
  check(r.choices[0].finish_reason === 'tool_calls', 'auto: finish tool_calls', r.choices[0].finish_reason);
  let content = '', args = '', name = '';
  for await (const ch of await client.chat.completions.create({ ...body, stream: true })) {
    const c = ch.choices[0];
    content += c?.delta?.content ?? '';
    for (const d of c?.delta?.tool_calls ?? []) {
      name += d.function?.name ?? '';
      args += d.function?.arguments ?? '';
    }
  }
  check(content === (m.content ?? '') && name === 'get_weather' && args === m.tool_calls?.[0]?.function.arguments,
    'auto: stream equals whole', { content, name, args }, m);
}

// 5. tool calls with n = 2 and logprobs: each choice has its calls, logprobs come along
{
  const r = await client.chat.completions.create({ model, messages: [user], tools, tool_choice: 'required',
    parallel_tool_calls: false, temperature: 1, seed: 31, n: 2, max_tokens: 120, logprobs: true, top_logprobs: 1 });
  check(r.choices.length === 2, 'n=2: two choices', r.choices.length);
  for (const c of r.choices) {
    checkCalls(c.message.tool_calls, `n=2 choice ${c.index}`);
    check(c.finish_reason === 'tool_calls', `n=2 choice ${c.index}: finish tool_calls`, c.finish_reason);
    check(c.logprobs?.content?.length > 10 && c.logprobs.content.every((e) => e.top_logprobs.length === 1),
      `n=2 choice ${c.index}: logprobs for the call's tokens`, c.logprobs?.content?.length);
  }
}

// 6. errors
try {
  await client.chat.completions.create({ model, messages: [user], tools, tool_choice: { type: 'function', function: { name: 'nope' } } });
  check(false, 'unknown named tool should be refused');
} catch (e) {
  check(e instanceof OpenAI.BadRequestError && e.param === 'tool_choice', 'unknown tool is a 400 on tool_choice', e.status, e.message);
}
try {
  await client.chat.completions.create({ model, messages: [user], tools: [{ type: 'function', function: { name: 'bad name!' } }] });
  check(false, 'bad tool name should be refused');
} catch (e) {
  check(e instanceof OpenAI.BadRequestError && e.param === 'tools', 'bad tool name is a 400 on tools', e.status, e.message);
}
try {
  await client.chat.completions.create({ model, messages: [user], tool_choice: 'required',
    tools: [{ type: 'function', function: { name: 'f', parameters: { type: 'object', properties: { x: { type: 'array', uniqueItems: true } } } } }] });
  check(false, 'an unenforceable parameter schema should be refused');
} catch (e) {
  check(e instanceof OpenAI.BadRequestError && /uniqueItems/.test(e.message), 'unsupported keyword in parameters is a 400', e.status, e.message);
}
console.log(fails ? `${fails} check(s) failed` : 'all tool-calling checks passed');
process.exit(fails ? 1 : 0);
