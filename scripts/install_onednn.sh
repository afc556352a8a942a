#!/usr/bin/env bash
# oneDNN (Debian's libdnnl2), which the CPU backend loads at run time for its GEMMs on CPUs
# with AVX-512 or AMX (crates/engine/src/kernels/cpu/onednn.rs); without it every product runs
# on the gemm crate, so it is optional. Installs it when missing and root or passwordless sudo
# is at hand; says so otherwise. Skipped with FERROTRON_GEMM=portable.
# Exit status 1 only when an install was attempted and failed (scripts/test.sh then fails, so
# CI does not silently lose the oneDNN tests); scripts/run.sh carries on without it.
set -euo pipefail
if [ "${FERROTRON_GEMM:-auto}" = portable ]; then
    exit 0
fi
if { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true; } | grep -q 'libdnnl\.so\.2 '; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1 || ! apt-cache show libdnnl2 >/dev/null 2>&1; then
    echo "== oneDNN (libdnnl.so.2) not installed and no libdnnl2 package: GEMMs on the gemm crate"
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "== oneDNN (libdnnl.so.2) not installed and no root or sudo: GEMMs on the gemm crate"
        exit 0
    fi
fi
echo "== installing oneDNN (libdnnl2: GEMMs on AVX-512 / AMX)"
if ! { $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends libdnnl2 >/dev/null; }; then
    echo "error: installing libdnnl2 failed (FERROTRON_GEMM=portable skips it)"
    exit 1
fi
