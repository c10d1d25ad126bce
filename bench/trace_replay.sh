#!/bin/sh
# Routing traces of real generations and their cache replay (bench/README.md, "Expert cache
# replay"): for each stream count, start moed on MODEL with --trace-routing, run
# bench_streams.py (STREAMS clients x REQS requests of TOKENS tokens, King James prompts,
# temperature 0.8, fixed seeds), stop it, and replay the trace with cache-replay (table on
# stdout, SVG beside the trace).
# usage: bench/trace_replay.sh BUILD_DIR MODEL OUT_DIR PORT "STREAMS:REQS:TOKENS ..."
set -eu
build=$1 model=$2 out=$3 port=$4 runs=$5
mkdir -p "$out"
for r in $runs; do
	streams=${r%%:*} rest=${r#*:}
	reqs=${rest%%:*} tokens=${rest#*:}
	trace="$out/moe64-s$streams.trace"
	"$build/server/moed" -m "$model" -p "$port" -t 2 --trace-routing "$trace" \
		>"$out/moed-s$streams.log" 2>&1 &
	pid=$!
	i=0
	until python3 -c "import http.client as h; c = h.HTTPConnection('127.0.0.1', $port, timeout=1); c.request('GET', '/health'); exit(c.getresponse().status != 200)" 2>/dev/null; do
		i=$((i + 1))
		[ $i -lt 300 ] || { echo "moed did not start" >&2; kill "$pid"; exit 1; }
		sleep 0.1
	done
	python3 "$(dirname "$0")/bench_streams.py" "$port" "$streams" "$reqs" "$tokens"
	kill "$pid"
	wait "$pid" || true
	"$build/bench/cache-replay" "$trace" --svg "$out/moe64-s$streams.svg" \
		--title "moe64, $streams stream(s): hit rate against cache budget"
done
