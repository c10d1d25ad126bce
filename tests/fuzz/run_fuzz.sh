#!/bin/sh
# Builds the GGUF libFuzzer target with clang and runs it for N seconds.
#
# usage: tests/fuzz/run_fuzz.sh [seconds (default 60)] [build dir (default build-fuzz)]
# Exit status: 0 when the run ends without findings; libFuzzer's status otherwise (crash
# inputs are left as crash-* files in the work directory it prints).
set -eu

secs=${1:-60}
src=$(cd "$(dirname "$0")/../.." && pwd)
build=${2:-"$src/build-fuzz"}
jobs=${FUZZ_BUILD_JOBS:-2}

if [ ! -f "$build/build.ninja" ]; then
	CC=clang meson setup "$build" "$src" -Dfuzz=true -Db_lundef=false \
		-Djemalloc=disabled -Dcuda=disabled
fi
ninja -C "$build" -j "$jobs" tests/fuzz/fuzz_gguf

# New inputs go to a scratch corpus; the committed seeds are only read.
work=$(mktemp -d "${TMPDIR:-/tmp}/fuzz_gguf.XXXXXX")
mkdir "$work/corpus"
echo "fuzz_gguf: ${secs}s, work dir $work"
cd "$work"
status=0
"$build/tests/fuzz/fuzz_gguf" -max_total_time="$secs" -max_len=4096 -timeout=10 \
	-rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$work/" \
	"$work/corpus" "$src/tests/fuzz/corpus/gguf" 2>"$work/fuzz.log" || status=$?
# libFuzzer's progress lines and dictionary stay in fuzz.log; its final stats are shown.
grep -E '^(Done|stat::)' "$work/fuzz.log" || true
if [ "$status" -eq 0 ]; then
	rm -rf "$work"
	echo "fuzz_gguf: no findings in ${secs}s"
else
	tail -n 60 "$work/fuzz.log" >&2
	echo "fuzz_gguf: FAILED (status $status), inputs and fuzz.log in $work" >&2
fi
exit "$status"
