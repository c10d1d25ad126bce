#!/bin/sh
# Quick start, command 1: install what is missing, build, and run moed on the default model.
set -eu
cd "$(dirname "$0")/.."
sh scripts/deps.sh
sh scripts/build.sh
mkdir -p build/models
MODEL=build/models/demo-qwen3moe.gguf
[ -f "$MODEL" ] || ./build/tools/moed-gguf gen --arch qwen3moe --type q8_0 --seed 1 "$MODEL"
exec ./build/tools/moed-run -m "$MODEL" -p "1,2,3,4,5,6,7,8" -n 32 "$@"
