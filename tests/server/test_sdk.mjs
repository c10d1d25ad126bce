// The official OpenAI Node SDK against a running moed: chat and completions, streaming and
// not, include_usage and logprobs. Env: MOED_BASE, MOED_NPM (dir holding node_modules/openai).
import { createRequire } from 'node:module';
import path from 'node:path';

const require = createRequire(path.join(process.env.MOED_NPM, 'package.json'));
const OpenAI = require('openai').default ?? require('openai');
const client = new OpenAI({ baseURL: process.env.MOED_BASE + '/v1', apiKey: 'test-key', maxRetries: 0 });

let fails = 0;
function check(cond, what, ...detail) {
  if (!cond) {
    fails++;
    console.log('FAIL:', what, ...detail.map((d) => JSON.stringify(d)?.slice(0, 400)));
  }
}

const models = await client.models.list();
const model = models.data[0].id;
check(models.data.length === 1, 'one model', models.data);

const msgs = [{ role: 'user', content: 'Tell me a story' }];
const chat = await client.chat.completions.create({ model, messages: msgs, max_tokens: 12, temperature: 0 });
check(chat.object === 'chat.completion' && chat.choices[0].message.role === 'assistant', 'chat object', chat);
check(chat.usage.total_tokens === chat.usage.prompt_tokens + chat.usage.completion_tokens, 'chat usage', chat.usage);

const stream = await client.chat.completions.create({
  model, messages: msgs, max_tokens: 12, temperature: 0, stream: true,
  stream_options: { include_usage: true }, logprobs: true, top_logprobs: 2,
});
let text = '', usage = null, finish = null, nlp = 0, first = true;
for await (const chunk of stream) {
  if (first) check(chunk.choices[0]?.delta?.role === 'assistant', 'role first', chunk);
  first = false;
  if (chunk.usage) usage = chunk.usage;
  for (const c of chunk.choices) {
    text += c.delta.content ?? '';
    if (c.finish_reason) finish = c.finish_reason;
    nlp += c.logprobs?.content?.length ?? 0;
  }
}
check(text === chat.choices[0].message.content, 'stream text equals', text, chat.choices[0].message.content);
check(usage && usage.completion_tokens === chat.usage.completion_tokens, 'stream usage', usage, chat.usage);
check(finish === chat.choices[0].finish_reason, 'finish reason', finish);
check(nlp > 0, 'stream logprobs', nlp);

const cmpl = await client.completions.create({ model, prompt: 'Once upon a time', max_tokens: 10, temperature: 0, logprobs: 3 });
check(cmpl.object === 'text_completion' && cmpl.choices[0].logprobs.tokens.length > 0, 'completion logprobs', cmpl);
const cs = await client.completions.create({ model, prompt: 'Once upon a time', max_tokens: 10, temperature: 0, stream: true, stream_options: { include_usage: true } });
let ctext = '', cusage = null;
for await (const chunk of cs) {
  if (chunk.usage) cusage = chunk.usage;
  for (const c of chunk.choices) ctext += c.text;
}
check(ctext === cmpl.choices[0].text, 'completion stream equals', ctext, cmpl.choices[0].text);
check(cusage && cusage.completion_tokens === cmpl.usage.completion_tokens, 'completion stream usage', cusage);

// errors map to the SDK's exception classes
try {
  await client.chat.completions.create({ model: 'no-such-model', messages: msgs });
  check(false, 'unknown model should throw');
} catch (e) {
  check(e instanceof OpenAI.NotFoundError && e.status === 404, 'NotFoundError', e.status, e.error);
}
try {
  await client.chat.completions.create({ model, messages: msgs, temperature: 9 });
  check(false, 'bad temperature should throw');
} catch (e) {
  check(e instanceof OpenAI.BadRequestError && e.param === 'temperature', 'BadRequestError', e.status, e.error);
}
console.log(fails ? `${fails} check(s) failed` : 'all SDK checks passed');
process.exit(fails ? 1 : 0);
