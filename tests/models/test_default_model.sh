#!/bin/sh
# The shipped default model (models/moed-default-moe.gguf) continues a held-in prompt exactly as
# the PyTorch model it was exported from did (and as llama.cpp does on the same file).
# usage: test_default_model.sh MOED_TOKENIZE MOED_RUN MODEL
set -eu
tok=$1 run=$2 model=$3
ids=$("$tok" -m "$model" "And the LORD said unto Moses," | tr -s ' \n' ',' | sed 's/^,//; s/,$//')
[ "$ids" = "1483,258,344,393,323,721,44" ] || { echo "FAIL: prompt ids $ids"; exit 1; }
gen=$("$run" -m "$model" -p "$ids" -n 34 | sed -n 's/^seq 0: //p' | tr ' ' ',')
text=$("$tok" -m "$model" --decode "$gen")
want=" Go, I will give thee to the LORD, and I will bring thee to the LORD, and will bring them out of the land of Israel."
case "$text" in
"$want"*) echo "ok: '$text'" ;;
*) echo "FAIL: got '$text', want it to start with '$want'"; exit 1 ;;
esac
