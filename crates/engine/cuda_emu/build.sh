#!/usr/bin/env bash
# Builds the CUDA emulator into DIR (default target/cuda-emu): libcuda.so.1, libnvrtc.so.13,
# libcublasLt.so.13 and libnccl.so.2, host libraries with NVIDIA's C ABI for the calls the CUDA backend makes,
# and the device runtime the emulated NVRTC compiles kernels against. Needs only g++.
# Use: FERROTRON_LIBCUDA=DIR/libcuda.so.1 FERROTRON_NVRTC=DIR/libnvrtc.so.13
#      FERROTRON_CUBLASLT=DIR/libcublasLt.so.13 (scripts/cuda_emu.sh sets them and runs the tests).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here/../../../target/cuda-emu}"
mkdir -p "$out"
cxx="${CXX:-g++}"
if ! command -v "$cxx" >/dev/null; then
    echo "error: the CUDA emulator needs a C++17 compiler ($cxx not found): apt-get install g++, or set CXX" >&2
    exit 1
fi
flags=(-std=c++17 -O2 -fPIC -shared -Wall -Wextra -Werror -ffp-contract=off)
cp "$here/runtime.hpp" "$out/runtime.hpp"
"$cxx" "${flags[@]}" -Wl,-soname,libcuda.so.1 "$here/driver.cpp" -o "$out/libcuda.so.1" -ldl
"$cxx" "${flags[@]}" -Wl,-soname,libnvrtc.so.13 "$here/nvrtc.cpp" -o "$out/libnvrtc.so.13" -ldl
"$cxx" "${flags[@]}" -Wl,-soname,libcublasLt.so.13 "$here/cublaslt.cpp" -o "$out/libcublasLt.so.13" -ldl
# NCCL between ranks that are threads of one process; cudarc loads it as libnccl.so by name, so
# its directory goes on LD_LIBRARY_PATH.
"$cxx" "${flags[@]}" -Wl,-soname,libnccl.so.2 "$here/nccl.cpp" -o "$out/libnccl.so.2" -lpthread -ldl
ln -sf libnccl.so.2 "$out/libnccl.so"

# The runtime's own test: it runs what CUDA defines and refuses what CUDA leaves undefined.
"$cxx" -std=c++17 -O1 -Wall -Wextra -Werror -ffp-contract=off "$here/selftest.cpp" -o "$out/selftest"
"$out/selftest"
echo "cuda emulator built in $(cd "$out" && pwd)"
