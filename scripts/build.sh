#!/bin/sh
# Configure (once) and build moed into ./build.
set -eu
cd "$(dirname "$0")/.."
if [ ! -f build/build.ninja ]; then
	log=$(mktemp)
	if ! meson setup build --buildtype=release -Dwerror=true >"$log" 2>&1; then
		cat "$log"
		rm -f "$log"
		echo "build: meson setup failed (output above)" >&2
		exit 1
	fi
	rm -f "$log"
fi
ninja -C build
