#!/bin/sh
# Packs a CUDA build for a GPU machine that has the NVIDIA driver but not moed's build
# dependencies (no meson, no libuv or cJSON headers, no network to install them): builds
# build-gpu/ here (nvcc is enough, no GPU), then writes build-gpu/moed-gpu.tar.xz with the
# stripped binaries tests/gpu/run.sh runs and the shared libraries they load other than the C
# and C++ runtimes. On the GPU machine, in a checkout of the same commit:
#
#   tar xJf moed-gpu.tar.xz && MOED_GPU_PREBUILT=1 tests/gpu/run.sh
#
# run.sh then puts on the library path only those packed libraries the machine lacks. The CUDA
# runtime is linked statically (cuda/meson.build), so the driver is all the binaries need of
# CUDA. About 3 MB.
#
# usage: tests/gpu/pack.sh
set -eu
cd "$(dirname "$0")/../.."
export PATH="${CUDA_HOME:-/usr/local/cuda}/bin:$PATH"
[ -f build-gpu/build.ninja ] || meson setup build-gpu -Dcuda=enabled --buildtype=release
ninja -C build-gpu
st=$(mktemp -d)
trap 'rm -rf "$st"' EXIT
bins="server/moed tests/gpu/test_gpu bench/moed-bench bench/moed-bandwidth bench/bench_dev_ops tools/moed-gguf"
for b in $bins; do
	mkdir -p "$st/build-gpu/$(dirname "$b")"
	cp "build-gpu/$b" "$st/build-gpu/$b"
	strip "$st/build-gpu/$b"
done
mkdir -p "$st/build-gpu/lib"
for b in $bins; do
	ldd "build-gpu/$b" | awk '$3 ~ /^\// { print $3 }'
done | sort -u | while read -r lib; do
	case $(basename "$lib") in
	libc.so.*|libm.so.*|libstdc++.so.*|libgcc_s.so.*|ld-linux*|libpthread.so.*|libdl.so.*|librt.so.*) ;;
	*) cp -L "$lib" "$st/build-gpu/lib/" ;;
	esac
done
tar cJf build-gpu/moed-gpu.tar.xz -C "$st" build-gpu
echo "build-gpu/moed-gpu.tar.xz: $(stat -c %s build-gpu/moed-gpu.tar.xz) bytes," \
	"$(ls "$st/build-gpu/lib" | wc -l) libraries: $(ls "$st/build-gpu/lib" | tr '\n' ' ')"
