#!/bin/bash
# CI step for the CUDA backend: configures a build with CUDA required, builds everything (every
# executable then links the real backend through engine_dep) and runs the CUDA unit test. The
# test first checks that the engine-side md_backend_cuda() is the real one, which holds without
# a GPU too; its GPU cases then skip (exit 77) on machines without one.
#
# Usage: scripts/ci_cuda_build.sh [BUILD_DIR]   (default: build-cuda)
# Environment: CUDA_HOME (default /usr/local/cuda) is put in front of PATH, because meson finds
# nvcc only through PATH. Exits non-zero when nvcc is missing, configure/build fails or the test
# fails (passed and skipped both count as success).
# Measured on 2 shared cores: 26 s from scratch at load ~3, 99 s at load ~6, configure included;
# nvcc takes about 6 s of that (matmul.cu, sm_90 SASS + compute_80 PTX).
set -uo pipefail
cd "$(dirname "$0")/.."
bdir=${1:-build-cuda}
cuda_home=${CUDA_HOME:-/usr/local/cuda}
export PATH="$cuda_home/bin:$PATH"
start=$(date +%s)

if ! command -v nvcc >/dev/null 2>&1; then
	echo "ci-cuda: nvcc not found in $cuda_home/bin or on PATH: install the CUDA toolkit or set CUDA_HOME"
	exit 1
fi
if ! command -v g++ >/dev/null 2>&1; then
	echo "ci-cuda: g++ not found: nvcc needs a host C++ compiler (apt-get install g++)"
	exit 1
fi
echo "ci-cuda: using $(command -v nvcc) ($(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'))"

if [ ! -f "$bdir/build.ninja" ]; then
	meson setup "$bdir" -Dcuda=enabled || { echo "ci-cuda: meson setup failed"; exit 1; }
else
	meson configure "$bdir" -Dcuda=enabled >/dev/null || { echo "ci-cuda: meson configure failed"; exit 1; }
fi
if ! ninja -C "$bdir" -j2; then
	echo "ci-cuda: build failed"
	exit 1
fi
echo "ci-cuda: built in $(( $(date +%s) - start )) s"

# Exit status 77 is meson's SKIP: expected here, without a GPU; meson test returns 0 for it.
meson test -C "$bdir" --no-rebuild --print-errorlogs cuda gpu
rc=$?
echo "ci-cuda: cuda test exit status $rc (0: passed or skipped), $(( $(date +%s) - start )) s in all"
exit $rc
