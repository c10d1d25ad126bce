#!/bin/sh
# Configure (once) and build moed into ./build.
set -eu
cd "$(dirname "$0")/.."
if [ ! -f build/build.ninja ]; then
	meson setup build --buildtype=release -Dwerror=true >/dev/null
fi
ninja -C build
