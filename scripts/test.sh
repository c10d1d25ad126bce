#!/bin/sh
# Quick start, command 2: install what is missing, build, run every test that needs no GPU.
set -eu
cd "$(dirname "$0")/.."
sh scripts/deps.sh
sh scripts/build.sh
meson test -C build --print-errorlogs --num-processes 2 "$@"
