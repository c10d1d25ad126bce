#!/bin/sh
# meson install step: put the sample configuration at DIR/moed.conf (under $DESTDIR) unless a
# configuration is already there; an existing one is left as it is and the new sample goes
# beside it as moed.conf.sample.
# usage: install_conf.sh SOURCE_CONF DIR
set -eu
src=$1
dir=${DESTDIR:-}$2
mkdir -p "$dir"
if [ -e "$dir/moed.conf" ]; then
	install -m 0644 "$src" "$dir/moed.conf.sample"
	echo "Keeping $dir/moed.conf (the shipped sample is $dir/moed.conf.sample)"
else
	install -m 0644 "$src" "$dir/moed.conf"
	echo "Installing $src to $dir/moed.conf"
fi
