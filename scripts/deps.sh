#!/bin/sh
# Install the Debian 12 packages moed needs to build and test (only the missing ones).
set -eu
PKGS="build-essential pkgconf meson ninja-build git
libuv1-dev node-llhttp libcjson-dev libjemalloc-dev libinih-dev libsystemd-dev
libpcre2-dev libutf8proc-dev
clang libclang-rt-14-dev valgrind curl jq python3-numpy nginx wrk nodejs npm"
missing=""
for p in $PKGS; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
# nodejs/npm may come from elsewhere (Node 20 on the CI machines): keep what works.
if command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then
	missing=$(echo "$missing" | tr ' ' '\n' | grep -v -x -e nodejs -e npm | tr '\n' ' ')
fi
missing=$(echo "$missing" | xargs)
[ -z "$missing" ] && exit 0
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO=sudo
echo "deps: installing $missing" >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
