#!/bin/sh
# Install the Debian 12 packages moed needs to build and test (only the missing ones).
#
# Never fatal by itself: when apt cannot install something (no sudo, a held lock, a mirror
# that is down, a package that conflicts with one from elsewhere) it says which packages and
# why, and the build that follows fails with the compiler's or meson's own message if one
# of them was really needed.
set -u
PKGS="build-essential pkgconf meson ninja-build git
libuv1-dev node-llhttp libcjson-dev libjemalloc-dev libinih-dev libsystemd-dev
libpcre2-dev libutf8proc-dev
clang libclang-rt-14-dev valgrind curl jq python3-numpy python3-yaml nginx wrk nodejs npm"
missing=""
for p in $PKGS; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
# Node.js may come from elsewhere (NodeSource's Node 20 on the CI machines, which bundles npm
# and conflicts with Debian's npm package): any working node keeps both out of the list.
if command -v node >/dev/null 2>&1; then
	missing=$(echo "$missing" | tr ' ' '\n' | grep -v -x -e nodejs -e npm | tr '\n' ' ')
	command -v npm >/dev/null 2>&1 ||
		echo "deps: node without npm: the tokenizer and template suites will skip" >&2
fi
missing=$(echo "$missing" | xargs)
[ -z "$missing" ] && exit 0
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
	if ! command -v sudo >/dev/null 2>&1; then
		echo "deps: not root and no sudo: cannot install: $missing" >&2
		exit 0
	fi
	SUDO=sudo
fi
apt_get() {
	DEBIAN_FRONTEND=noninteractive $SUDO apt-get -o DPkg::Lock::Timeout=600 "$@"
}
echo "deps: installing $missing" >&2
apt_get update -qq || echo "deps: apt-get update failed; using the package lists already here" >&2
# shellcheck disable=SC2086
if ! apt_get install -y -qq --no-install-recommends $missing; then
	echo "deps: installing them together failed; one at a time:" >&2
	failed=""
	for p in $missing; do
		apt_get install -y -qq --no-install-recommends "$p" || failed="$failed $p"
	done
	[ -n "$failed" ] && echo "deps: could not install:$failed" >&2
fi
exit 0
