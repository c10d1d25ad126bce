#!/bin/sh
# The shipped many-expert model (models/moed-moe64.gguf, see models/README.md) is what the
# trainer says it is (6 layers of 64 experts, 4 used per token), shares its draft's
# (models/moed-moe64-draft.gguf) vocabulary, and both continue a held-in prompt exactly as the
# PyTorch models they were exported from did (tools/train/verify_engine.py --check
# moe64,moe64-draft compares six prompts; this is one of them).
# usage: test_moe64_model.sh MOED_GGUF MOED_TOKENIZE MOED_RUN MODEL DRAFT
set -eu
gguf=$1 tok=$2 run=$3 model=$4 draft=$5
info=$("$gguf" info "$model" | tr -s ' ')
for kv in "qwen3moe.block_count u32 6" "qwen3moe.expert_count u32 64" \
	"qwen3moe.expert_used_count u32 4" "qwen3moe.expert_feed_forward_length u32 64"; do
	case "$info" in
	*"$kv"*) ;;
	*) echo "FAIL: metadata has no '$kv'"; exit 1 ;;
	esac
done
prompt="And the LORD said unto Moses,"
ids=$("$tok" -m "$model" "$prompt" | tr -s ' \n' ',' | sed 's/^,//; s/,$//')
[ "$ids" = "1483,258,344,393,323,721,44" ] || { echo "FAIL: prompt ids $ids"; exit 1; }
# The draft must read the same ids (same vocabulary and merges) to draft for this model.
dids=$("$tok" -m "$draft" "$prompt" | tr -s ' \n' ',' | sed 's/^,//; s/,$//')
[ "$dids" = "$ids" ] || { echo "FAIL: draft tokenizes '$prompt' as $dids, model as $ids"; exit 1; }
gen=$("$run" -m "$model" -p "$ids" -n 24 | sed -n 's/^seq 0: //p' | tr ' ' ',')
want="937,585,258,344,44,937,585,258,344,44,937,585,258,344,44,937,585,258,344,44,267,258,344,398"
[ "$gen" = "$want" ] || { echo "FAIL: greedy ids $gen, torch gave $want"; exit 1; }
# The draft (distilled from this model) continues it as its torch checkpoint did.
dgen=$("$run" -m "$draft" -p "$ids" -n 24 | sed -n 's/^seq 0: //p' | tr ' ' ',')
dwant="267,258,344,44,267,258,344,44,267,258,344,44,267,258,344,44,267,258,344,44,267,258,344,44"
[ "$dgen" = "$dwant" ] || { echo "FAIL: draft greedy ids $dgen, torch gave $dwant"; exit 1; }
echo "ok: '$("$tok" -m "$model" --decode "$gen")'; draft: '$("$tok" -m "$draft" --decode "$dgen")'"
