#!/bin/sh
# Builds the libFuzzer targets with clang and runs each for N seconds: the GGUF reader
# (fuzz_gguf), the HTTP request path (fuzz_http) and the JSON request path (fuzz_request).
#
# usage: tests/fuzz/run_fuzz.sh [seconds per target (default 60)] [build dir (default
#        build-fuzz)] [target ...]
# Extra libFuzzer flags may come in FUZZ_FLAGS (e.g. -runs=10000000 -jobs=1).
# Exit status: 0 when every run ends without findings; otherwise the first failing run's
# libFuzzer status (crash inputs are left as crash-* files in the work directory it prints).
set -eu

secs=${1:-60}
src=$(cd "$(dirname "$0")/../.." && pwd)
build=${2:-"$src/build-fuzz"}
[ $# -ge 2 ] && shift 2 || shift $#
targets=${*:-"fuzz_gguf fuzz_http fuzz_request"}
jobs=${FUZZ_BUILD_JOBS:-2}

if [ ! -f "$build/build.ninja" ]; then
	CC=clang meson setup "$build" "$src" -Dfuzz=true -Db_lundef=false \
		-Djemalloc=disabled -Dcuda=disabled
fi
# fuzz_request tokenizes with the default model the build makes
ninja -C "$build" -j "$jobs" models/default.gguf $(for t in $targets; do echo "tests/fuzz/$t"; done)

rc=0
for t in $targets; do
	case $t in
	fuzz_gguf) seeds=gguf; max_len=4096 ;;
	fuzz_http) seeds=http; max_len=16384 ;;
	fuzz_request) seeds=request; max_len=8192 ;;
	*) echo "run_fuzz: unknown target '$t'" >&2; exit 2 ;;
	esac
	# New inputs go to a scratch corpus; the committed seeds are only read.
	work=$(mktemp -d "${TMPDIR:-/tmp}/$t.XXXXXX")
	mkdir "$work/corpus"
	echo "$t: ${secs}s, work dir $work"
	status=0
	(cd "$work" && MOED_FUZZ_MODEL="$build/models/default.gguf" "$build/tests/fuzz/$t" \
		-max_total_time="$secs" -max_len="$max_len" -timeout=10 -rss_limit_mb=2048 \
		-print_final_stats=1 -artifact_prefix="$work/" ${FUZZ_FLAGS:-} \
		"$work/corpus" "$src/tests/fuzz/corpus/$seeds" 2>"$work/fuzz.log") || status=$?
	# libFuzzer's progress lines stay in fuzz.log; its final stats are shown.
	grep -E '^(Done|stat::(number_of_executed_units|average_exec_per_sec|new_units_added|peak_rss_mb))' \
		"$work/fuzz.log" | sed "s/^/$t: /" || true
	if [ "$status" -eq 0 ]; then
		rm -rf "$work"
		echo "$t: no findings in ${secs}s"
	else
		tail -n 60 "$work/fuzz.log" >&2
		echo "$t: FAILED (status $status), inputs and fuzz.log in $work" >&2
		[ "$rc" -eq 0 ] && rc=$status
	fi
done
exit "$rc"
