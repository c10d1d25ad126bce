#!/bin/bash
# ASan+UBSan run for CI: builds build-asan and runs the unit tests, the GGUF corpus test, the
# tokenizer/template unit tests and the server suite under the sanitizers (leaks included).
# The server suite includes server-soak, which under ASan sends 200 mixed requests and then
# 1,500 mutated HTTP inputs (a bounded HTTP fuzz run on the real server, engine and sampler
# included) and fails on any sanitizer report in the server's log or exit status: about 2
# minutes at a load average of 20 on 2 cores. server-memlimit skips itself here (77).
#
# Usage: scripts/ci_sanitize.sh [BUILD_DIR]   (default: build-asan)
# Ends with "N passed, M failed" and exits non-zero when the build or any test fails.
# Measured on 2 shared cores: about 2 minutes to build, about 1.5 minutes of tests.
set -uo pipefail
cd "$(dirname "$0")/.."
bdir=${1:-build-asan}
start=$(date +%s)

# jemalloc off (it and ASan crash together on a bad free); CUDA off (nvcc objects carry no
# instrumentation and only slow the build); clang also needs b_lundef=false.
opts=(-Db_sanitize=address,undefined -Db_lundef=false -Djemalloc=disabled -Dcuda=disabled
      -Dc_args=-fno-sanitize-recover=all)
if [ ! -f "$bdir/build.ninja" ]; then
	meson setup "$bdir" "${opts[@]}" || { echo "ci-sanitize: meson setup failed"; echo "0 passed, 1 failed"; exit 1; }
else
	meson configure "$bdir" "${opts[@]}" >/dev/null || { echo "ci-sanitize: meson configure failed"; echo "0 passed, 1 failed"; exit 1; }
fi
if ! ninja -C "$bdir" -j2; then
	echo "ci-sanitize: build failed"
	echo "0 passed, 1 failed"
	exit 1
fi

# The set: every test in the project's default suite (the C unit tests, the GGUF corpus test,
# moed-gguf end to end), the tokenizer and template unit tests, and the whole server suite.
# Reference (numpy parity), tokenizer-vocabulary and template-vs-Jinja suites are left out:
# they exercise the same C paths as the unit tests at many times the cost.
mapfile -t names < <(meson test -C "$bdir" --list 2>/dev/null |
	sed -n -e 's|^moed / ||p' -e 's|^moed:server / ||p' -e 's|^moed:tok / \(tok-detok\)$|\1|p' \
		-e 's|^moed:tmpl / \(tmpl-api\)$|\1|p')
if [ ${#names[@]} -eq 0 ]; then
	echo "ci-sanitize: no tests found"
	echo "0 passed, 1 failed"
	exit 1
fi

# detect_leaks: the server tests stop moed with SIGTERM and check its exit status, so a leak
# at exit fails them. halt_on_error/abort: the first report ends the process.
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:halt_on_error=1:print_summary=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:print_summary=1
export LSAN_OPTIONS=print_suppressions=0
rm -f "$bdir/meson-logs/testlog.json"
meson test -C "$bdir" --no-rebuild --print-errorlogs --num-processes 2 "${names[@]}"

log=$bdir/meson-logs/testlog.json
if [ ! -f "$log" ]; then
	echo "ci-sanitize: no test log"
	echo "0 passed, 1 failed"
	exit 1
fi
/usr/bin/python3 - "$log" "$start" <<'PY'
import json, sys, time
counts, bad = {}, []
for line in open(sys.argv[1]):
    line = line.strip()
    if not line:
        continue
    r = json.loads(line)
    counts[r["result"]] = counts.get(r["result"], 0) + 1
    if r["result"] not in ("OK", "SKIP", "EXPECTEDFAIL"):
        bad.append(r["name"])
        print("ci-sanitize: FAILED:", r["name"], r["result"])
ok = counts.get("OK", 0) + counts.get("EXPECTEDFAIL", 0)
print("ci-sanitize: %d s in all" % (time.time() - int(sys.argv[2])))
print(f"{ok} passed, {len(bad)} failed, {counts.get('SKIP', 0)} skipped")
sys.exit(1 if bad else 0)
PY
