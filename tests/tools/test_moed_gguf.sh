#!/bin/sh
# moed-gguf end to end: gen every arch (f32, q8_0), info, quantize q4_k_m, truncated file.
# usage: test_moed_gguf.sh PATH/TO/moed-gguf
set -u
M=${1:?usage: $0 moed-gguf}
T=$(mktemp -d "${TMPDIR:-/tmp}/moed-gguf-test.XXXXXX") || exit 1
trap 'rm -rf "$T"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

# expect_names FILE INFO_OUT NAME... : every NAME appears as a tensor row of info's table.
expect_names() {
	out=$1; shift
	for n in "$@"; do
		grep -Eq "^ +[0-9]+  $n " "$out" || fail "$out: tensor $n missing"
	done
}
# expect_types INFO_OUT NAME TYPE [NAME TYPE]... : tensor NAME has TYPE in info's table.
expect_types() {
	out=$1; shift
	while [ $# -ge 2 ]; do
		grep -Eq "^ +[0-9]+  $1 +$2 " "$out" || fail "$out: $1 is not $2"
		shift 2
	done
}
reject_names() {
	out=$1; shift
	for n in "$@"; do
		! grep -Eq "^ +[0-9]+  $n " "$out" || fail "$out: unexpected tensor $n"
	done
}

common="token_embd.weight output_norm.weight blk.0.attn_norm.weight blk.1.attn_q.weight
 blk.1.attn_k.weight blk.1.attn_v.weight blk.1.attn_output.weight blk.1.ffn_norm.weight"
moe="blk.1.ffn_gate_inp.weight blk.1.ffn_gate_exps.weight blk.1.ffn_up_exps.weight
 blk.1.ffn_down_exps.weight"
moe_exps="blk.1.ffn_gate_exps.weight blk.1.ffn_up_exps.weight blk.1.ffn_down_exps.weight"
dense="blk.1.ffn_gate.weight blk.1.ffn_up.weight blk.1.ffn_down.weight"
bias="blk.1.attn_q.bias blk.1.attn_k.bias blk.1.attn_v.bias"
qkn="blk.1.attn_q_norm.weight blk.1.attn_k_norm.weight"
shexp="blk.1.ffn_gate_inp_shexp.weight blk.1.ffn_gate_shexp.weight blk.1.ffn_up_shexp.weight
 blk.1.ffn_down_shexp.weight"

for arch in qwen3moe qwen2moe llama mixtral olmoe qwen2 qwen3; do
	case $arch in
	qwen3moe) want="$moe $qkn output.weight"; not="$dense $bias $shexp"; key=qwen3moe ;;
	qwen2moe) want="$moe $bias $shexp output.weight"; not="$dense $qkn" ; key=qwen2moe ;;
	llama)    want="$dense output.weight"; not="$moe $bias $qkn"; key=llama ;;
	mixtral)  want="$moe output.weight"; not="$dense $bias $qkn $shexp"; key=llama ;;
	olmoe)    want="$moe $qkn output.weight"; not="$dense $bias $shexp"; key=olmoe ;;
	qwen2)    want="$dense $bias output.weight"; not="$moe $qkn"; key=qwen2 ;;
	qwen3)    want="$dense $qkn output.weight"; not="$moe $bias"; key=qwen3 ;;
	esac
	for type in f32 q8_0; do
		f="$T/$arch-$type.gguf"
		if ! "$M" gen --arch "$arch" --type "$type" --seed 7 "$f" 2>"$T/gen.err"; then
			fail "gen $arch $type: $(tail -1 "$T/gen.err")"
			continue
		fi
		if ! "$M" info "$f" >"$T/info.out" 2>&1; then
			fail "info $arch $type: $(tail -1 "$T/info.out")"
			continue
		fi
		cp "$T/info.out" "$T/info-$arch-$type.out"
		o="$T/info-$arch-$type.out"
		expect_names "$o" $common $want
		reject_names "$o" $not
		grep -q "general.architecture  *string \"$key\"" "$o" || fail "$o: architecture"
		grep -q "tokenizer.ggml.tokens  *\[string x 512\] \"!\", \"\\\\\"\"" "$o" ||
			fail "$o: token list"
		if [ "$type" = q8_0 ]; then
			grep -Eq "^ +[0-9]+  blk.1.attn_q.weight +q8_0 " "$o" || fail "$o: attn_q not q8_0"
			grep -q "general.file_type  *u32 7$" "$o" || fail "$o: file_type"
			grep -q "general.quantization_version  *u32 2$" "$o" || fail "$o: quant version"
			case " $want " in *ffn_gate_inp.weight*)
				grep -Eq "^ +[0-9]+  blk.1.ffn_gate_inp.weight +f32 " "$o" ||
					fail "$o: router not f32" ;;
			esac
		fi
	done
done

# Same seed, same bytes; another seed, other bytes.
"$M" gen --arch qwen3moe --seed 7 "$T/again.gguf" 2>/dev/null &&
	cmp -s "$T/again.gguf" "$T/qwen3moe-f32.gguf" || fail "gen is not deterministic"
"$M" gen --arch qwen3moe --seed 8 "$T/other.gguf" 2>/dev/null &&
	! cmp -s "$T/other.gguf" "$T/qwen3moe-f32.gguf" || fail "seed has no effect"

# --tied drops output.weight where the arch allows it.
"$M" gen --arch qwen3 --tied "$T/tied.gguf" 2>/dev/null && "$M" info "$T/tied.gguf" >"$T/tied.out" ||
	fail "gen --tied"
reject_names "$T/tied.out" output.weight

# Layouts of llama.cpp's writers. converter: Qwen2-MoE's shared-expert gate 2-D [n_embd, 1],
# routers f32 even in an f16 file.
if "$M" gen --arch qwen2moe --layout converter --type f16 "$T/conv.gguf" 2>/dev/null &&
	"$M" info "$T/conv.gguf" >"$T/conv.out" 2>&1; then
	grep -Eq "^ +[0-9]+  blk.1.ffn_gate_inp_shexp.weight +f32 +\[64, 1\] " "$T/conv.out" ||
		fail "converter: shared-expert gate not f32 [64, 1]"
	grep -Eq "^ +[0-9]+  blk.1.ffn_gate_inp.weight +f32 +\[64, 4\] " "$T/conv.out" ||
		fail "converter: router not f32"
	grep -Eq "^ +[0-9]+  blk.1.ffn_gate_shexp.weight +f16 " "$T/conv.out" ||
		fail "converter: shared expert not f16"
else
	fail "gen --layout converter"
fi
# split-experts: old convert.py Mixtral, per-expert 2-D tensors expert by expert; --vec-type.
if "$M" gen --arch mixtral --layout split-experts --type q8_0 --vec-type bf16 "$T/split.gguf" \
	2>/dev/null && "$M" info "$T/split.gguf" >"$T/split.out" 2>&1; then
	expect_names "$T/split.out" blk.1.ffn_gate.0.weight blk.1.ffn_down.3.weight blk.1.ffn_up.2.weight
	reject_names "$T/split.out" $moe_exps
	grep -Eq "^ +[0-9]+  blk.1.ffn_down.3.weight +q8_0 +\[64, 64\] " "$T/split.out" ||
		fail "split-experts: ffn_down.3 not q8_0 [64, 64]"
	grep -Eq "^ +[0-9]+  blk.0.attn_norm.weight +bf16 +\[64\] " "$T/split.out" ||
		fail "--vec-type bf16: attn_norm not bf16"
	order=$(grep -Eo "blk.0.ffn_(gate|down|up).[01].weight" "$T/split.out" | tr '\n' ' ')
	[ "$order" = "blk.0.ffn_gate.0.weight blk.0.ffn_down.0.weight blk.0.ffn_up.0.weight blk.0.ffn_gate.1.weight blk.0.ffn_down.1.weight blk.0.ffn_up.1.weight " ] ||
		fail "split-experts order: $order"
else
	fail "gen --layout split-experts"
fi
"$M" gen --arch qwen3 --layout split-experts "$T/bad.gguf" 2>"$T/split.err" &&
	fail "split-experts on a dense arch succeeded"
grep -q "needs an MoE arch" "$T/split.err" || fail "split-experts dense message: $(cat "$T/split.err")"
# --bias adds the optional q/k/v biases.
"$M" gen --arch qwen3moe --bias "$T/bias.gguf" 2>/dev/null && "$M" info "$T/bias.gguf" >"$T/bias.out" ||
	fail "gen --bias"
expect_names "$T/bias.out" $bias

# K types need 256-wide rows: rejected with a message naming the rule.
if "$M" gen --arch qwen3moe --type q4_k "$T/bad.gguf" 2>"$T/k.err"; then
	fail "gen q4_k on a 64-wide model succeeded"
fi
grep -q "multiple of 256" "$T/k.err" || fail "q4_k rejection message: $(cat "$T/k.err")"
[ ! -e "$T/bad.gguf" ] || fail "rejected gen left a file"

# quantize q4_k_m on a 256-wide model with 8 layers (more-bits layers 0, 3, 6, 7).
big="$T/w256.gguf"
"$M" gen --arch qwen3moe --n-layer 8 --n-embd 256 --n-head 4 --n-head-kv 2 --head-dim 64 \
	--n-ff-exp 256 --n-expert 4 "$big" 2>/dev/null || fail "gen 256-wide"
if "$M" quantize "$big" "$T/q4km.gguf" q4_k_m 2>"$T/q.err"; then
	"$M" info "$T/q4km.gguf" >"$T/q.out" 2>&1 || fail "info q4_k_m: $(tail -1 "$T/q.out")"
	o="$T/q.out"
	grep -q "general.file_type  *u32 15$" "$o" || fail "q4_k_m file_type"
	grep -Eq "^ +[0-9]+  output.weight +q6_K " "$o" || fail "output.weight not q6_K"
	grep -Eq "^ +[0-9]+  token_embd.weight +q4_K " "$o" || fail "token_embd not q4_K"
	for i in 0 3 6 7; do
		grep -Eq "^ +[0-9]+  blk.$i.attn_v.weight +q6_K " "$o" || fail "blk.$i.attn_v not q6_K"
		grep -Eq "^ +[0-9]+  blk.$i.ffn_down_exps.weight +q6_K " "$o" ||
			fail "blk.$i.ffn_down_exps not q6_K"
	done
	for i in 1 2 4 5; do
		grep -Eq "^ +[0-9]+  blk.$i.attn_v.weight +q4_K " "$o" || fail "blk.$i.attn_v not q4_K"
		grep -Eq "^ +[0-9]+  blk.$i.ffn_down_exps.weight +q4_K " "$o" ||
			fail "blk.$i.ffn_down_exps not q4_K"
	done
	grep -Eq "^ +[0-9]+  blk.0.ffn_gate_inp.weight +f32 " "$o" || fail "router requantized"
	grep -Eq "^ +[0-9]+  blk.0.attn_norm.weight +f32 " "$o" || fail "norm requantized"
	# head_dim 64 makes attn_k_norm 64 wide, but it is 1-D and stays f32; no fallbacks here.
	grep -q "K-quant fallback" "$o" && fail "unexpected fallback note"
	grep -q "tokenizer.ggml.tokens" "$o" || fail "metadata not copied"
	grep -q "ffn_down_exps.weight" "$T/q.err" || fail "no per-tensor progress on stderr"
else
	fail "quantize q4_k_m: $(tail -1 "$T/q.err")"
fi

# A K mix on a 64-wide model falls back as llama-quantize does (q4_K -> q5_0, q6_K -> q8_0)
# and info says so.
if "$M" quantize "$T/qwen3moe-f32.gguf" "$T/fb.gguf" q4_k_m 2>/dev/null; then
	"$M" info "$T/fb.gguf" >"$T/fb.out" 2>&1 || fail "info fallback file"
	grep -Eq "^ +[0-9]+  blk.0.attn_q.weight +q5_0 " "$T/fb.out" || fail "no q5_0 fallback"
	grep -Eq "^ +[0-9]+  output.weight +q8_0 " "$T/fb.out" || fail "no q8_0 fallback for q6_K"
	grep -q "K-quant fallback" "$T/fb.out" || fail "info does not mention the fallback"
else
	fail "quantize q4_k_m (fallback)"
fi

# The low-bit mixes as llama-quantize builds them on the same model (head_count 4 over
# head_count_kv 2: n_gqa 2; 4 experts; 8 layers).
if "$M" quantize "$big" "$T/q2k.gguf" q2_k 2>"$T/q.err"; then
	"$M" info "$T/q2k.gguf" >"$T/q2k.out" 2>&1 || fail "info q2_k"
	grep -q "general.file_type  *u32 10$" "$T/q2k.out" || fail "q2_k file_type"
	expect_types "$T/q2k.out" token_embd.weight q2_K output.weight q6_K \
		blk.0.attn_q.weight q2_K blk.0.attn_k.weight q2_K blk.5.attn_v.weight q3_K \
		blk.3.attn_output.weight q3_K blk.7.ffn_down_exps.weight q3_K \
		blk.7.ffn_gate_exps.weight q2_K blk.2.ffn_up_exps.weight q2_K \
		blk.0.ffn_gate_inp.weight f32
else
	fail "quantize q2_k: $(tail -1 "$T/q.err")"
fi

if "$M" quantize "$big" "$T/q3km.gguf" q3_k_m 2>"$T/q.err"; then
	"$M" info "$T/q3km.gguf" >"$T/q3km.out" 2>&1 || fail "info q3_k_m"
	grep -q "general.file_type  *u32 12$" "$T/q3km.out" || fail "q3_k_m file_type"
	expect_types "$T/q3km.out" token_embd.weight q3_K output.weight q6_K \
		blk.0.attn_q.weight q3_K blk.0.attn_v.weight q5_K blk.1.attn_v.weight q5_K \
		blk.2.attn_v.weight q4_K blk.3.attn_output.weight q4_K \
		blk.0.ffn_down_exps.weight q4_K blk.7.ffn_gate_exps.weight q3_K
else
	fail "quantize q3_k_m: $(tail -1 "$T/q.err")"
fi

if "$M" quantize "$big" "$T/iq4nl.gguf" iq4_nl 2>"$T/q.err"; then
	"$M" info "$T/iq4nl.gguf" >"$T/iq4nl.out" 2>&1 || fail "info iq4_nl"
	grep -q "general.file_type  *u32 25$" "$T/iq4nl.out" || fail "iq4_nl file_type"
	expect_types "$T/iq4nl.out" token_embd.weight iq4_nl output.weight q6_K \
		blk.0.attn_v.weight iq4_nl blk.0.ffn_down_exps.weight q5_K \
		blk.1.ffn_down_exps.weight iq4_nl blk.3.attn_output.weight iq4_nl
else
	fail "quantize iq4_nl: $(tail -1 "$T/q.err")"
fi
if "$M" quantize "$big" "$T/iq4xs.gguf" iq4_xs 2>"$T/q.err"; then
	"$M" info "$T/iq4xs.gguf" >"$T/iq4xs.out" 2>&1 || fail "info iq4_xs"
	grep -q "general.file_type  *u32 30$" "$T/iq4xs.out" || fail "iq4_xs file_type"
	expect_types "$T/iq4xs.out" token_embd.weight iq4_xs output.weight q6_K \
		blk.0.attn_v.weight iq4_xs blk.0.ffn_down_exps.weight q5_K \
		blk.1.ffn_down_exps.weight iq4_xs blk.3.attn_output.weight iq4_xs
else
	fail "quantize iq4_xs: $(tail -1 "$T/q.err")"
fi
if "$M" quantize "$big" "$T/mxfp4.gguf" mxfp4_moe 2>"$T/q.err"; then
	"$M" info "$T/mxfp4.gguf" >"$T/mxfp4.out" 2>&1 || fail "info mxfp4_moe"
	grep -q "general.file_type  *u32 38$" "$T/mxfp4.out" || fail "mxfp4_moe file_type"
	expect_types "$T/mxfp4.out" token_embd.weight q8_0 output.weight q8_0 \
		blk.0.attn_v.weight q8_0 blk.0.attn_q.weight q8_0 \
		blk.0.ffn_down_exps.weight mxfp4 blk.5.ffn_gate_exps.weight mxfp4 \
		blk.7.ffn_up_exps.weight mxfp4 blk.0.ffn_gate_inp.weight f32
else
	fail "quantize mxfp4_moe: $(tail -1 "$T/q.err")"
fi
# On the 64-wide model q2_K and q3_K rows fall back to q4_0 and iq4_xs rows to iq4_nl (as
# llama-quantize 34af94cd does).
if "$M" quantize "$T/qwen3moe-f32.gguf" "$T/fb2.gguf" q2_k 2>/dev/null; then
	"$M" info "$T/fb2.gguf" >"$T/fb2.out" 2>&1 || fail "info q2_k fallback file"
	expect_types "$T/fb2.out" blk.0.attn_q.weight q4_0 blk.1.ffn_down_exps.weight q4_0
	grep -q "K-quant fallback" "$T/fb2.out" || fail "info does not mention the q4_0 fallback"
else
	fail "quantize q2_k (fallback)"
fi
if "$M" quantize "$T/qwen3moe-f32.gguf" "$T/fb3.gguf" iq4_xs 2>/dev/null; then
	"$M" info "$T/fb3.gguf" >"$T/fb3.out" 2>&1 || fail "info iq4_xs fallback file"
	expect_types "$T/fb3.out" blk.0.attn_q.weight iq4_nl blk.1.ffn_down_exps.weight iq4_nl
else
	fail "quantize iq4_xs (fallback)"
fi

# Truncated file: info fails with exit 1 and one line.
f="$T/qwen3moe-q8_0.gguf"
head -c $(( $(wc -c <"$f") - 100 )) "$f" >"$T/trunc.gguf"
"$M" info "$T/trunc.gguf" >"$T/trunc.out" 2>&1
rc=$?
[ "$rc" -eq 1 ] || fail "truncated: exit $rc, want 1"
[ "$(wc -l <"$T/trunc.out")" -eq 1 ] || fail "truncated: $(wc -l <"$T/trunc.out") lines: $(cat "$T/trunc.out")"
head -c 20 "$f" >"$T/trunc2.gguf"
"$M" info "$T/trunc2.gguf" >"$T/trunc2.out" 2>&1
rc=$?
[ "$rc" -eq 1 ] && [ "$(wc -l <"$T/trunc2.out")" -eq 1 ] || fail "header-truncated: exit $rc"

if [ "$fails" -ne 0 ]; then
	echo "$fails failure(s)"
	exit 1
fi
echo "moed-gguf: all checks passed"
