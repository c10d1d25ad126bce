#!/usr/bin/env node
// Bounded load generator: streaming chat requests at rising concurrency, to and past
// saturation. At each level, CONC clients send requests back to back for SECONDS (closed
// loop); every request is counted with its status (or "net" for a connection error, "cut"
// for a stream that ended without [DONE]). Prints one table row per level: completed
// requests/s, tokens/s, TTFT p50/p99 and inter-token latency p50/p99 (per stream: its mean
// gap between tokens, first to last), the p50/p99 time to a 429/503 answer, and answers by
// status (with a count of refusals that came without Retry-After, which should be none). A
// refused client waits Retry-After (within the level) before its next request. Exit status 1
// when a request went unanswered (a connection error or a cut stream) or a refusal had no
// Retry-After.
//
// usage: node bench/loadgen.mjs URL [--levels 1,2,4,8,16,32] [--seconds 10]
//        [--max-tokens 64] [--timeout 60] [--json FILE]
// URL: the base, e.g. http://127.0.0.1:8000 (nginx) or a replica directly.
// Node's own http module only (Node 18+); keep-alive agent, one socket per client.
import http from "node:http";
import fs from "node:fs";

const args = process.argv.slice(2);
if (!args.length || args[0].startsWith("--")) {
	console.error("usage: node bench/loadgen.mjs URL [--levels 1,2,4] [--seconds 10] " +
		"[--max-tokens 64] [--timeout 60] [--json FILE]");
	process.exit(2);
}
const base = new URL(args[0]);
const opt = (name, def) => {
	const i = args.indexOf("--" + name);
	return i >= 0 ? args[i + 1] : def;
};
const levels = opt("levels", "1,2,4,8,16,32").split(",").map(Number);
const seconds = Number(opt("seconds", "10"));
const maxTokens = Number(opt("max-tokens", "64"));
const timeoutS = Number(opt("timeout", "60"));
const jsonOut = opt("json", null);

const prompts = ["Tell me a story about a lighthouse keeper.", "What is a mixture of experts?",
	"List five rivers and one fact about each.", "Write a short poem about autumn.",
	"Explain TCP slow start to a child.", "Summarise the plot of a heist film."];

function pct(v, p) {
	if (!v.length) return NaN;
	const s = [...v].sort((a, b) => a - b);
	return s[Math.min(s.length - 1, Math.floor(p * (s.length - 1) + 0.5))];
}

// One streaming chat request. Resolves {status, ttft, gaps[], tokens, ok, retryAfter, ms}.
function one(agent, i) {
	const body = JSON.stringify({
		messages: [{ role: "user", content: prompts[i % prompts.length] }],
		max_tokens: maxTokens, temperature: 0.8, seed: i, ignore_eos: true, stream: true,
	});
	return new Promise((resolve) => {
		const t0 = performance.now();
		let done = false;
		const finish = (r) => {
			if (!done) {
				done = true;
				resolve({ ms: performance.now() - t0, ...r });
			}
		};
		const req = http.request({
			host: base.hostname, port: base.port, path: "/v1/chat/completions", method: "POST",
			agent, headers: { "Content-Type": "application/json",
				"Content-Length": Buffer.byteLength(body) },
		}, (res) => {
			let ttft = null, last = null, tokens = 0, buf = "", sawDone = false;
			const gaps = [];
			res.setEncoding("utf8");
			res.on("data", (d) => {
				buf += d;
				let k;
				while ((k = buf.indexOf("\n\n")) >= 0) {
					const ev = buf.slice(0, k);
					buf = buf.slice(k + 2);
					if (!ev.startsWith("data: ")) continue;
					if (ev === "data: [DONE]") { sawDone = true; continue; }
					if (!ev.includes('"content"') || ev.includes('"role"')) continue; // role, usage
					const now = performance.now();
					if (ttft === null) ttft = now - t0;
					else gaps.push(now - last);
					last = now;
					tokens++;
				}
			});
			res.on("end", () => finish({
				status: res.statusCode, ttft, gaps, tokens,
				ok: res.statusCode === 200 && sawDone,
				cut: res.statusCode === 200 && !sawDone,
				retryAfter: res.headers["retry-after"] ?? null,
			}));
			res.on("error", () => finish({ status: res.statusCode, ttft, gaps, tokens,
				ok: false, cut: true }));
		});
		req.setTimeout(timeoutS * 1000, () => req.destroy(new Error("timeout")));
		req.on("error", (e) => finish({ status: "net", error: e.code || e.message, gaps: [],
			tokens: 0, ok: false }));
		req.end(body);
	});
}

async function level(conc) {
	const results = [];
	const t0 = performance.now();
	const end = t0 + seconds * 1000;
	let n = 0;
	const client = async () => {
		const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });
		while (performance.now() < end) {
			const r = await one(agent, n++);
			results.push(r);
			// a refused request: honour Retry-After up to the level's end (a polite client)
			if (!r.ok && r.status !== 200) {
				const wait = Math.min(Number(r.retryAfter ?? 1) * 1000 || 1000,
					end - performance.now());
				if (wait > 0) await new Promise((ok) => setTimeout(ok, wait));
			}
		}
		agent.destroy();
	};
	await Promise.all(Array.from({ length: conc }, client));
	const wall = (performance.now() - t0) / 1000;
	const ok = results.filter((r) => r.ok);
	const by = {};
	for (const r of results) {
		const k = r.cut ? "cut" : String(r.status);
		by[k] = (by[k] || 0) + 1;
	}
	// per stream: mean gap between its tokens (several events often share one read, so
	// single gaps are mostly 0)
	const tpot = ok.filter((r) => r.gaps.length).map((r) =>
		r.gaps.reduce((x, y) => x + y, 0) / r.gaps.length);
	const refused = results.filter((r) => r.status === 429 || r.status === 503);
	const refusedMs = refused.map((r) => r.ms);
	return {
		conc, wall, requests: results.length, ok: ok.length,
		rps: ok.length / wall,
		tps: ok.reduce((a, r) => a + r.tokens, 0) / wall,
		ttft50: pct(ok.map((r) => r.ttft), 0.5), ttft99: pct(ok.map((r) => r.ttft), 0.99),
		itl50: pct(tpot, 0.5), itl99: pct(tpot, 0.99),
		refused50: pct(refusedMs, 0.5), refused99: pct(refusedMs, 0.99),
		// a refusal must tell the client when to come back
		noRetryAfter: refused.filter((r) => r.retryAfter === null).length,
		by,
	};
}

const f = (x, d = 1) => (Number.isFinite(x) ? x.toFixed(d) : "-");
console.log(`loadgen: ${base.origin} chat stream max_tokens=${maxTokens}, ${seconds}s per level`);
console.log("| clients | done/s | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms " +
	"| refusal p50 / p99 ms | answers by status |");
console.log("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |");
const rows = [];
for (const c of levels) {
	const r = await level(c);
	rows.push(r);
	const by = Object.entries(r.by).sort().map(([k, v]) => `${k}:${v}`).join(" ") +
		(r.noRetryAfter ? ` (${r.noRetryAfter} refusals without Retry-After)` : "");
	const refusal = Number.isFinite(r.refused50) ? `${f(r.refused50)} / ${f(r.refused99)}` : "-";
	console.log(`| ${c} | ${f(r.rps, 2)} | ${f(r.tps, 0)} | ${f(r.ttft50)} | ${f(r.ttft99)} | ` +
		`${f(r.itl50, 2)} | ${f(r.itl99, 2)} | ${refusal} | ${by} |`);
}
if (jsonOut) fs.writeFileSync(jsonOut, JSON.stringify(rows, null, 1));
const unanswered = rows.reduce((n, r) => n + (r.by.net || 0) + (r.by.cut || 0), 0);
const bare = rows.reduce((n, r) => n + r.noRetryAfter, 0);
console.log(`loadgen: ${rows.reduce((n, r) => n + r.requests, 0)} requests, ${unanswered} ` +
	`unanswered (connection error or cut stream), ${bare} refusals without Retry-After`);
if (unanswered || bare) process.exitCode = 1;
