#!/bin/sh
# Quick start, command 1: install what is missing, build, and start the server on the default
# model (listening on 127.0.0.1:8080 unless flags say otherwise; extra arguments go to moed).
set -eu
cd "$(dirname "$0")/.."
sh scripts/deps.sh
sh scripts/build.sh
exec ./build/server/moed "$@"
