#!/bin/sh
# Builds moed's benchmark models (bench/README.md) from the shipped models into bench/models/,
# and measures decode speed against the machine's memory bandwidth.
#
# usage: bench/make_models.sh [-B BUILD] [-o DIR] list
#        bench/make_models.sh [-B BUILD] [-o DIR] build NAME... | all
#        bench/make_models.sh [-B BUILD] bytes MODEL.gguf    bytes one decoded token reads
#        bench/make_models.sh [-B BUILD] [-n N] bandwidth     read GB/s: sizes, threads, pages
#        bench/make_models.sh [-B BUILD] [-o DIR] [-t T] [-r R] [-n N] [-L DIR] measure NAME... | all
#        bench/make_models.sh [-B BUILD] [-o DIR] exact NAME... | all
#
# bandwidth: bench/moed-bandwidth (median of N samples, default 21) for 1 and 2 threads, 256 MiB
# and 1 GiB, 4 KiB and huge pages: a table of medians, min-max, and the median of the clean
# samples (no thread preempted).
# measure: per model, the read bandwidth of that model's file mapped as the engine maps it with T
# threads (median of N samples, taken right before), decode tok/s (moed-bench tg64, median of R
# runs) and, with -L DIR (llama.cpp's binaries; or MOED_LLAMA_CPP), llama-bench tg64 with T
# threads (median of R runs) on the same file; each decode as a share of the bound bandwidth /
# bytes per token, median against median.
# exact: greedy tokens and top-5 log-probabilities of an inflated model against its source
# (the q8_0 file it was inflated from), 24 tokens after a KJV prompt, with the reference
# kernels (judged) and the default ones (reported).
#
# BUILD (default build/) must hold tools/moed-gguf, bench/moed-bench and bench/moed-bandwidth.
# Each model is written to DIR/NAME.gguf (default bench/models/, git-ignored) through a
# temporary file, so an interrupted build leaves nothing that looks finished; an existing file
# is kept unless the shipped model it comes from is newer.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build
out=$root/bench/models
threads=2
reps=5
samples=21
llama=${MOED_LLAMA_CPP:-}

while [ $# -gt 0 ]; do
	case $1 in
	-B) build=$2; shift 2 ;;
	-o) out=$2; shift 2 ;;
	-t) threads=$2; shift 2 ;;
	-r) reps=$2; shift 2 ;;
	-n) samples=$2; shift 2 ;;
	-L) llama=$2; shift 2 ;;
	*) break ;;
	esac
done
[ $# -ge 1 ] || { sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
cmd=$1
shift
gguf=$build/tools/moed-gguf
models=$root/models

NAMES="default-1g default-1g-draft default-4g default-4g-draft moe64-2g moe64-2g-draft random-2g"

# name -> one line: what it is (for `list`)
describe() {
	case $1 in
	default-1g) echo "default MoE (qwen3moe, 16 experts top-2) in Q8_0, n_embd x8, heads x4, expert FFN x24: ~1.0 GB" ;;
	default-4g) echo "default MoE in Q8_0, n_embd x16, heads x8, expert FFN x48: ~3.9 GB" ;;
	default-1g-draft) echo "default draft (dense qwen3) in Q8_0, n_embd x8, heads x4, FFN x8: ~32 MB" ;;
	default-4g-draft) echo "default draft in Q8_0, n_embd x16, heads x8, FFN x16: ~112 MB" ;;
	moe64-2g) echo "many-expert MoE (qwen3moe, 64 experts top-4) in Q8_0, n_embd x8, heads x4, expert FFN x16: ~2.0 GB" ;;
	moe64-2g-draft) echo "moe64's own draft (dense qwen3, distilled from moe64) in Q8_0, inflated like default-1g-draft: ~32 MB" ;;
	random-2g) echo "random weights (moed-gguf gen), qwen3moe 16 layers, n_embd 1024, 128 experts x 256 top-8, Q8_0: ~1.8 GB" ;;
	*) return 1 ;;
	esac
}

# run a command quietly; on failure show what it printed and stop
quiet() {
	log=$(mktemp)
	if ! "$@" >"$log" 2>&1; then
		cat "$log" >&2
		rm -f "$log"
		echo "make_models: failed: $*" >&2
		exit 1
	fi
	rm -f "$log"
}

need() {
	[ -x "$1" ] || { echo "make_models: '$1' not found: build moed first (sh scripts/build.sh)" >&2; exit 1; }
}

# quantize models/SRC.gguf to q8_0 once, into DIR/SRC-q8_0.gguf (kept for reuse)
q8() {
	q_dst=$out/$1-q8_0.gguf
	if [ ! -f "$q_dst" ] || [ "$models/$1.gguf" -nt "$q_dst" ]; then
		quiet "$gguf" quantize "$models/$1.gguf" "$q_dst.tmp" q8_0
		mv "$q_dst.tmp" "$q_dst"
	fi
}

# inflate NAME SRC EMBD HEADS FF: SRC in q8_0, inflated in its own type (blocks copied exactly)
inflate() {
	q8 "$2"
	quiet "$gguf" inflate --embd "$3" --heads "$4" --ff "$5" "$out/$2-q8_0.gguf" \
		"$out/$1.gguf.tmp"
}

# the q8_0 file NAME was inflated from (nothing for random-2g)
source_of() {
	case $1 in
	default-1g | default-4g) echo "$out/moed-default-moe-q8_0.gguf" ;;
	moe64-2g-draft) echo "$out/moed-moe64-draft-q8_0.gguf" ;;
	*-draft) echo "$out/moed-default-draft-q8_0.gguf" ;;
	moe64-2g) echo "$out/moed-moe64-q8_0.gguf" ;;
	esac
}

# exact NAME: same greedy tokens and top-5 log-probabilities as its source. The criterion
# (tolerance 1e-4) uses the dequantize-and-dot kernels (MOED_KERNELS=ref), which compute the
# file's function as written; the default integer kernels round activations to 8 bits per
# block, and a last-bit change of an RMS over a longer row can move one value across a rounding
# step, so their difference is reported beside it, not judged.
exact_one() {
	src=$(source_of "$1")
	[ -n "$src" ] || { echo "$1: not inflated, nothing to compare"; return 0; }
	tmp=$(mktemp -d)
	prompt=1483,258,344,393,323,721,44 # "And the LORD said unto Moses,"
	for k in ref default; do
		for m in a b; do
			f=$src
			[ $m = b ] && f=$out/$1.gguf
			if [ $k = ref ]; then
				MOED_KERNELS=ref "$build/tools/moed-run" -m "$f" -p "$prompt" -n 24 \
					-t "$threads" --dump-logits "$tmp/$k-$m.logits" >"$tmp/$k-$m.out"
			else
				"$build/tools/moed-run" -m "$f" -p "$prompt" -n 24 -t "$threads" \
					--dump-logits "$tmp/$k-$m.logits" >"$tmp/$k-$m.out"
			fi
		done
	done
	rc=0
	/usr/bin/python3 - "$1" "$tmp" <<'EOF' || rc=1
import sys
import numpy as np
name, tmp = sys.argv[1:3]
res = {}
for k in ("ref", "default"):
    ids = [open(f"{tmp}/{k}-{m}.out").read().split("seq 0:")[1].splitlines()[0].split()
           for m in "ab"]
    lp = []
    for m in "ab":
        a = np.fromfile(f"{tmp}/{k}-{m}.logits", dtype=np.float32).reshape(-1, 4096)
        a = a.astype(np.float64) - a.max(1, keepdims=True)
        lp.append(a - np.log(np.exp(a).sum(1, keepdims=True)))
    d = [float(np.abs(lp[0][i][t] - lp[1][i][t]).max())
         for i in range(len(lp[0])) for t in [np.argsort(-lp[0][i])[:5]]]
    res[k] = (ids[0] == ids[1], max(d), sum(x > 1e-4 for x in d), len(d))
ok = res["ref"][0] and res["ref"][1] <= 1e-4
g = lambda e: "equal" if e else "DIFFERENT"  # noqa: E731
print(f"{name}: ref kernels: greedy {g(res['ref'][0])}, top-5 log-prob max diff "
      f"{res['ref'][1]:.2g} over {res['ref'][3]} positions: {'OK' if ok else 'FAIL'}; "
      f"integer kernels: greedy {g(res['default'][0])}, max diff {res['default'][1]:.2g} "
      f"({res['default'][2]} positions over 1e-4)")
sys.exit(0 if ok else 1)
EOF
	rm -rf "$tmp"
	return $rc
}

build_one() {
	name=$1
	dst=$out/$name.gguf
	src=$(source_of "$name")
	if [ -f "$dst" ] && { [ -z "$src" ] || [ "$dst" -nt "$models/$(basename "$src" -q8_0.gguf).gguf" ]; }; then
		echo "$name: $dst exists"
		return 0
	fi
	describe "$name" >/dev/null || { echo "make_models: unknown model '$name' (try: list)" >&2; exit 2; }
	t0=$(date +%s)
	case $name in
	default-1g) inflate "$name" moed-default-moe 8 4 24 ;;
	default-4g) inflate "$name" moed-default-moe 16 8 48 ;;
	default-1g-draft) inflate "$name" moed-default-draft 8 4 8 ;;
	moe64-2g-draft) inflate "$name" moed-moe64-draft 8 4 8 ;;
	default-4g-draft) inflate "$name" moed-default-draft 16 8 16 ;;
	moe64-2g) inflate "$name" moed-moe64 8 4 16 ;;
	random-2g)
		quiet "$gguf" gen --arch qwen3moe --type q8_0 --seed 1 --n-layer 16 --n-embd 1024 \
			--n-head 16 --n-head-kv 4 --head-dim 64 --n-expert 128 --n-expert-used 8 \
			--n-ff-exp 256 --n-ctx 4096 --tokenizer-gguf "$models/moed-default-moe.gguf" \
			"$dst.tmp" ;;
	esac
	mv "$dst.tmp" "$dst"
	echo "$name: $dst $(wc -c <"$dst") bytes in $(($(date +%s) - t0)) s"
}

# Bytes one decoded token reads: every weight except the embedding table (one row; all of it
# when it is also the output projection, i.e. there is no output.weight) and the routed
# experts (expert_used_count of expert_count of each *_exps tensor).
bytes_per_token() {
	"$gguf" info "$1" | awk '
		$1 ~ /\.expert_count$/ { E = $3 }
		$1 ~ /\.expert_used_count$/ { K = $3 }
		$1 ~ /^[0-9]+$/ && NF >= 5 {
			name = $2; b = $(NF - 1)
			if (name == "token_embd.weight") { emb = b; next }
			if (name ~ /_exps\.weight$/) { exps += b; next }
			if (name == "output.weight") untied = 1
			other += b
		}
		END {
			if (!E) { E = 1; K = 1 }
			printf "%.0f\n", other + exps * K / E + (untied ? 0 : emb)
		}'
}

# Streaming-read bandwidth (bench/moed-bandwidth): the median and spread of N samples over
# thread counts, buffer sizes and page sizes, one table row each.
bandwidth_table() {
	printf '%-8s %9s %6s %6s %11s %17s %6s %13s\n' threads size pages huge% median_GB/s \
		min-max clean clean_median
	for t in 1 2; do
		for mib in 256 1024; do
			for pages in small huge; do
				"$bw" -t "$t" -s "$mib" -p "$pages" -n "$samples" | awk -v mib="$mib" '{
					for (i = 1; i < NF; i += 2) v[$i] = $(i + 1)
					printf "%-8s %6s MiB %6s %5s%% %11s %8s-%-8s %6s %13s\n", v["threads"],
						mib, v["pages"], v["huge_pct"], v["median_gbs"], v["min_gbs"],
						v["max_gbs"], v["clean"] "/" v["samples"], v["clean_median_gbs"] }'
			done
		done
	done
}

# field KEY of a moed-bandwidth line
bw_field() {
	awk -v k="$1" '{ for (i = 1; i < NF; i += 2) if ($i == k) print $(i + 1) }'
}

# llama-bench tg64 tok/s on FILE with $threads threads: the median of $reps runs
llama_tg() {
	"$llama_bench" -m "$1" -t "$threads" -p 0 -n 64 -r "$reps" -o json 2>/dev/null |
		/usr/bin/python3 -c '
import json, statistics, sys
r = [x for x in json.load(sys.stdin) if x.get("n_gen") == 64]
print("%.2f" % statistics.median(r[0]["samples_ts"]) if r else "-")'
}

case $cmd in
list)
	for n in $NAMES; do
		printf '%-17s %s\n' "$n" "$(describe "$n")"
	done ;;
build)
	need "$gguf"
	[ $# -ge 1 ] || { echo "make_models: build NAME... | all" >&2; exit 2; }
	[ "$1" = all ] && set -- $NAMES
	mkdir -p "$out"
	for n in "$@"; do
		build_one "$n"
	done ;;
bytes)
	need "$gguf"
	bytes_per_token "$1" ;;
bandwidth)
	bw=$build/bench/moed-bandwidth
	need "$bw"
	bandwidth_table ;;
measure)
	need "$gguf"
	need "$build/bench/moed-bench"
	bw=$build/bench/moed-bandwidth
	need "$bw"
	[ $# -ge 1 ] || { echo "make_models: measure NAME... | all" >&2; exit 2; }
	[ "$1" = all ] && set -- $NAMES
	llama_bench=
	if [ -n "$llama" ]; then
		for c in "$llama/llama-bench" "$llama/build/bin/llama-bench"; do
			[ -x "$c" ] && llama_bench=$c && break
		done
		[ -n "$llama_bench" ] || { echo "make_models: no llama-bench in '$llama'" >&2; exit 1; }
	fi
	echo "threads $threads; bandwidth: median of $samples reads of the mapped file;" \
		"decode: tg64, median of $reps runs"
	printf '%-17s %12s %8s %8s %10s %10s %8s %10s %8s\n' model bytes/token GB/s clean \
		bound moed_tg of_bound llama_tg of_bound
	for n in "$@"; do
		f=$out/$n.gguf
		[ -f "$f" ] || { echo "make_models: $f missing (build $n first)" >&2; exit 1; }
		bpt=$(bytes_per_token "$f")
		line=$("$bw" -t "$threads" -n "$samples" -f "$f") # right before, under the same load
		tg=$("$build/bench/moed-bench" -m "$f" -t "$threads" -p 0 -n 64 -r "$reps" |
			awk -F'|' '$7 ~ /tg/ { gsub(/ /, "", $8); print $8 }')
		ltg=-
		[ -n "$llama_bench" ] && ltg=$(llama_tg "$f")
		awk -v n="$n" -v b="$bpt" -v bw="$(echo "$line" | bw_field median_gbs)" \
			-v cl="$(echo "$line" | bw_field clean_median_gbs)" -v tg="$tg" -v ltg="$ltg" 'BEGIN {
			bound = bw * 1e9 / b
			printf "%-17s %12.0f %8.2f %8.2f %10.1f %10.2f %7.0f%% %10s %8s\n", n, b, bw, cl,
				bound, tg, 100 * tg / bound, ltg,
				ltg == "-" ? "-" : sprintf("%.0f%%", 100 * ltg / bound) }'
	done ;;
exact)
	need "$build/tools/moed-run"
	[ $# -ge 1 ] || { echo "make_models: exact NAME... | all" >&2; exit 2; }
	[ "$1" = all ] && set -- $NAMES
	fail=0
	for n in "$@"; do
		exact_one "$n" || fail=1
	done
	exit $fail ;;
*)
	echo "make_models: unknown command '$cmd'" >&2
	exit 2 ;;
esac
