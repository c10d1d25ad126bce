// Structured outputs through the official OpenAI Node SDK, every output checked by a real JSON
// Schema validator (ajv + ajv-formats): json_object and json_schema over many schemas, with
// sampling, seeds, n > 1, streaming, stop strings and logprobs; the raw grammar extension; and
// the 400 for an unsupported keyword. Env: MOED_BASE, MOED_NPM (dir holding node_modules).
// Prints the coverage table (requests, outputs, valid per schema).
import { createRequire } from 'node:module';
import path from 'node:path';

const require = createRequire(path.join(process.env.MOED_NPM, 'package.json'));
const OpenAI = require('openai').default ?? require('openai');
const Ajv = require('ajv').default ?? require('ajv');
const addFormats = require('ajv-formats').default ?? require('ajv-formats');
const client = new OpenAI({ baseURL: process.env.MOED_BASE + '/v1', apiKey: 'test-key', maxRetries: 0 });
const ajv = new Ajv({ strict: false, allErrors: true });
addFormats(ajv);

let fails = 0;
function check(cond, what, ...detail) {
  if (!cond) {
    fails++;
    console.log('FAIL:', what, ...detail.map((d) => JSON.stringify(d)?.slice(0, 600)));
  }
  return cond;
}

const str = { type: 'string' };
const schemas = [
  ['person', 'Describe a person.', {
    type: 'object', additionalProperties: false, required: ['name', 'age'],
    properties: { name: str, age: { type: 'integer', minimum: 0, maximum: 120 } } }],
  ['color-enum', 'Pick a color.', {
    type: 'object', additionalProperties: false, required: ['color'],
    properties: { color: { type: 'string', enum: ['red', 'green', 'blue'] } } }],
  ['int-array', 'List some numbers.', { type: 'array', items: { type: 'integer' }, minItems: 1, maxItems: 5 }],
  ['address', 'Where does the king live?', {
    type: 'object', additionalProperties: false, required: ['city', 'address'],
    properties: {
      city: { type: 'string', maxLength: 30 },
      address: { type: 'object', additionalProperties: false, required: ['street', 'number'],
        properties: { street: { type: 'string', maxLength: 40 }, number: { type: 'integer', minimum: 1 } } } } }],
  ['any-of', 'Give a value.', {
    type: 'object', additionalProperties: false, required: ['v'],
    properties: { v: { anyOf: [{ type: 'string', maxLength: 10 }, { type: 'number' }, { type: 'null' }] } } }],
  ['flags', 'Set the flags.', {
    type: 'object', additionalProperties: false, required: ['a', 'b', 'c'],
    properties: { a: { type: 'boolean' }, b: { type: 'boolean' }, c: { type: 'boolean' } } }],
  ['date', 'When was it?', {
    type: 'object', additionalProperties: false, required: ['day'], properties: { day: { type: 'string', format: 'date' } } }],
  ['date-time', 'When exactly?', {
    type: 'object', additionalProperties: false, required: ['at'], properties: { at: { type: 'string', format: 'date-time' } } }],
  ['uuid', 'Make an id.', {
    type: 'object', additionalProperties: false, required: ['id'], properties: { id: { type: 'string', format: 'uuid' } } }],
  ['email', 'Contact?', {
    type: 'object', additionalProperties: false, required: ['email'], properties: { email: { type: 'string', format: 'email' } } }],
  ['ipv4', 'Which host?', {
    type: 'object', additionalProperties: false, required: ['ip'], properties: { ip: { type: 'string', format: 'ipv4' } } }],
  ['pattern', 'A product code.', {
    type: 'object', additionalProperties: false, required: ['code'],
    properties: { code: { type: 'string', pattern: '^[A-Z]{3}-[0-9]{4}$' } } }],
  ['const', 'Version?', {
    type: 'object', additionalProperties: false, required: ['version', 'ok'],
    properties: { version: { const: 2 }, ok: { type: 'boolean' } } }],
  ['nullable', 'Maybe a name.', {
    type: 'object', additionalProperties: false, required: ['name'], properties: { name: { type: ['string', 'null'], maxLength: 20 } } }],
  ['tree', 'A family tree.', {
    $defs: { node: { type: 'object', additionalProperties: false, required: ['name', 'children'],
      properties: { name: { type: 'string', maxLength: 12 },
        children: { type: 'array', maxItems: 2, items: { $ref: '#/$defs/node' } } } } },
    $ref: '#/$defs/node' }],
  ['map', 'Count the tribes.', { type: 'object', additionalProperties: { type: 'integer', minimum: 0 } }],
  ['unit-number', 'A probability.', {
    type: 'object', additionalProperties: false, required: ['p'], properties: { p: { type: 'number', minimum: 0, maximum: 1 } } }],
  ['optional', 'Some details.', {
    type: 'object', additionalProperties: false, required: ['title'],
    properties: { title: { type: 'string', maxLength: 20 }, year: { type: 'integer' }, done: { type: 'boolean' } } }],
  ['objects', 'List the kings.', {
    type: 'object', additionalProperties: false, required: ['kings'],
    properties: { kings: { type: 'array', minItems: 1, maxItems: 3, items: {
      type: 'object', additionalProperties: false, required: ['name', 'years'],
      properties: { name: { type: 'string', maxLength: 15 }, years: { type: 'integer', minimum: 1, maximum: 99 } } } } } }],
  ['negative', 'A temperature.', {
    type: 'object', additionalProperties: false, required: ['t'],
    properties: { t: { type: 'integer', exclusiveMinimum: -50, exclusiveMaximum: 0 } } }],
  ['lengths', 'A short word.', {
    type: 'object', additionalProperties: false, required: ['w'], properties: { w: { type: 'string', minLength: 3, maxLength: 6 } } }],
  ['enum-mixed', 'Choose.', { enum: ['yes', 'no', 1, null, true] }],
  ['openai-strict', 'Plan a trip.', {
    type: 'object', additionalProperties: false, required: ['destination', 'days', 'notes'],
    properties: {
      destination: { type: 'string', description: 'where' },
      days: { type: 'integer', description: 'how long' },
      notes: { anyOf: [{ type: 'string' }, { type: 'null' }] } } }],
  ['strings', 'Some words.', { type: 'array', items: str, maxItems: 4 }],
];

// Request variants: each schema runs every one. {stream, n, temperature, seed, stop, logprobs}
const variants = [
  { temperature: 0 },
  { temperature: 0, stream: true },
  { temperature: 0.8, seed: 1 },
  { temperature: 1.0, seed: 2, n: 2 },
  { temperature: 1.0, seed: 3, stream: true, n: 2 },
  { temperature: 0.7, seed: 4, stop: ['\n\n', '<|im_end|>'] },
  { temperature: 1.0, seed: 5, logprobs: true, top_logprobs: 2 },
  { temperature: 1.2, seed: 6, top_p: 0.9 },
  { temperature: 0.5, seed: 7, stream: true, logprobs: true },
];

async function one(name, prompt, schema, v) {
  const body = {
    model, messages: [{ role: 'user', content: prompt }], max_tokens: 90,
    response_format: schema ? { type: 'json_schema', json_schema: { name, strict: true, schema } }
      : { type: 'json_object' },
    ...v,
  };
  const outs = [];
  if (v.stream) {
    const st = await client.chat.completions.create(body);
    const acc = [];
    for await (const chunk of st) {
      for (const c of chunk.choices) {
        acc[c.index] ??= { text: '', finish: null, lp: 0 };
        acc[c.index].text += c.delta?.content ?? '';
        if (c.finish_reason) acc[c.index].finish = c.finish_reason;
        acc[c.index].lp += c.logprobs?.content?.length ?? 0;
      }
    }
    outs.push(...acc);
  } else {
    const r = await client.chat.completions.create(body);
    for (const c of r.choices)
      outs.push({ text: c.message.content, finish: c.finish_reason, lp: c.logprobs?.content?.length ?? 0 });
  }
  check(outs.length === (v.n ?? 1), `${name}: ${v.n ?? 1} choices`, outs.length);
  return outs;
}

const models = await client.models.list();
const model = models.data[0].id;
const table = [];
let nreq = 0, nout = 0, nvalid = 0;
const validators = schemas.map(([, , s]) => ajv.compile(s));
// json_object mode is checked as "any object"
const isObject = (x) => x !== null && typeof x === 'object' && !Array.isArray(x);

async function runSchema(idx) {
  const [name, prompt, schema] = idx < 0 ? ['json_object', 'Reply in JSON.', null] : schemas[idx];
  const row = { schema: name, requests: 0, outputs: 0, valid: 0 };
  for (const v of variants) {
    const outs = await one(name, prompt, schema, v);
    row.requests++;
    for (const o of outs) {
      row.outputs++;
      let parsed, ok = false;
      try {
        parsed = JSON.parse(o.text);
        ok = schema ? validators[idx](parsed) : isObject(parsed);
      } catch (e) {
        ok = false;
      }
      check(ok, `${name} ${JSON.stringify(v)}: output validates`, o.text, schema ? validators[idx].errors : null);
      check(o.finish === 'stop', `${name}: finish_reason stop (the JSON completed)`, o.finish, o.text);
      if (v.logprobs) check(o.lp > 0, `${name}: logprobs present`, o.lp);
      if (ok) row.valid++;
    }
  }
  return row;
}

// a few schemas at a time: the server batches them
const order = [-1, ...schemas.map((_, i) => i)];
for (let i = 0; i < order.length; i += 4) {
  const rows = await Promise.all(order.slice(i, i + 4).map(runSchema));
  table.push(...rows);
}
for (const r of table) {
  nreq += r.requests;
  nout += r.outputs;
  nvalid += r.valid;
}
console.log('schema coverage (each schema x', variants.length, 'request variants):');
console.log('schema'.padEnd(16), 'requests'.padStart(8), 'outputs'.padStart(8), 'valid'.padStart(6));
for (const r of table)
  console.log(r.schema.padEnd(16), String(r.requests).padStart(8), String(r.outputs).padStart(8), String(r.valid).padStart(6));
console.log('total'.padEnd(16), String(nreq).padStart(8), String(nout).padStart(8), String(nvalid).padStart(6),
  `(${(100 * nvalid / nout).toFixed(1)}% valid over ${table.length} schemas)`);
check(nreq >= 200 && table.length >= 20, 'at least 200 requests over 20 schemas', nreq, table.length);
check(nvalid === nout, 'every output valid', nvalid, nout);

// streamed and whole outputs agree (greedy)
{
  const [name, prompt, schema] = schemas[0];
  const body = { model, messages: [{ role: 'user', content: prompt }], max_tokens: 60, temperature: 0,
    response_format: { type: 'json_schema', json_schema: { name, schema } } };
  const whole = await client.chat.completions.create(body);
  let text = '';
  for await (const ch of await client.chat.completions.create({ ...body, stream: true }))
    text += ch.choices[0]?.delta?.content ?? '';
  check(text === whole.choices[0].message.content, 'stream equals whole', text, whole.choices[0].message.content);
}

// the raw grammar extension (a moed parameter the SDK passes through)
{
  const r = await client.chat.completions.create({
    model, messages: [{ role: 'user', content: 'Answer.' }], max_tokens: 20, temperature: 1, seed: 9,
    grammar: 'root ::= ("yes" | "no") ", " [0-9]{2} " " word\nword ::= [a-z]{1,8}',
  });
  const t = r.choices[0].message.content;
  check(/^(yes|no), [0-9]{2} [a-z]{1,8}$/.test(t), 'raw grammar output matches', t);
  check(r.choices[0].finish_reason === 'stop', 'raw grammar finish stop', r.choices[0].finish_reason);
}

// errors: an unsupported keyword names itself; a broken grammar gives its position
try {
  await client.chat.completions.create({ model, messages: [{ role: 'user', content: 'x' }],
    response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'array', uniqueItems: true } } } });
  check(false, 'uniqueItems should be refused');
} catch (e) {
  check(e instanceof OpenAI.BadRequestError && e.param === 'response_format' && /uniqueItems/.test(e.message),
    'unsupported keyword is a 400 naming it', e.status, e.message);
}
try {
  await client.chat.completions.create({ model, messages: [{ role: 'user', content: 'x' }], grammar: 'root ::= "a" | b' });
  check(false, 'undefined rule should be refused');
} catch (e) {
  check(e instanceof OpenAI.BadRequestError && e.param === 'grammar' && /undefined rule 'b'/.test(e.message),
    'bad grammar is a 400 naming the problem', e.status, e.message);
}
console.log(fails ? `${fails} check(s) failed` : 'all structured-output checks passed');
process.exit(fails ? 1 : 0);
