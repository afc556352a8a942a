#!/usr/bin/env bash
# The CUDA backend (issue #14), in three places:
#
#   bash scripts/cuda_check.sh            # any machine (CI): builds with --features cuda (no
#                                         # toolkit, no GPU needed), lints it, compiles every
#                                         # kernel with NVRTC for sm_90 and sm_80, and checks
#                                         # that `train --device cuda` refuses in one line
#   bash scripts/cuda_check.sh bundle     # here, before a GPU session: the test binaries and
#                                         # ferrotron built with CUDA, stripped, in target/cuda-check
#   bash target/cuda-check/run.sh         # on the GPU machine (no Rust there): every op and
#                                         # training step against the CPU backend, then the
#                                         # trainer on GPU vs CPU, then NCCL at world size 1
#   bash target/cuda-check/bench_gpu.sh   # there too: ferrotron vs PyTorch on the same GPU
#
# NVRTC comes from the CUDA toolkit when there is one, else from the `nvidia-cuda-nvrtc` wheel,
# installed here into target/nvrtc (about 60 MB, once).
set -euo pipefail
cd "$(dirname "$0")/.."

nvrtc() {
    if [ -n "${FERROTRON_NVRTC:-}" ] || [ -e /usr/local/cuda/lib64/libnvrtc.so ]; then return; fi
    local lib
    lib=$(find target/nvrtc .venv/lib/python3.11/site-packages/nvidia -name 'libnvrtc.so.1[0-9]' 2>/dev/null | head -1 || true)
    if [ -z "$lib" ]; then
        echo "== installing NVRTC (pip: nvidia-cuda-nvrtc) into target/nvrtc"
        python3 -m pip install -q --disable-pip-version-check --target target/nvrtc 'nvidia-cuda-nvrtc==13.*'
        lib=$(find target/nvrtc -name 'libnvrtc.so.1[0-9]' | head -1)
    fi
    export FERROTRON_NVRTC="$PWD/$lib"
}

case "${1:-check}" in
check)
    nvrtc
    echo "== CUDA backend: clippy --features cuda"
    cargo clippy --release -p ferrotron-engine -p ferrotron-train -p ferrotron --features cuda --all-targets -- -D warnings
    echo "== CUDA backend: NVRTC compiles every kernel; the GPU tests skip without a GPU"
    cargo test --release -p ferrotron-engine --features cuda --lib -- cuda
    cargo test --release -p ferrotron-engine --features cuda --test cuda_source --test cuda_backend -- --nocapture
    cargo test --release -p ferrotron-train --features cuda --lib device
    echo "== NCCL communicator: builds; its world-size-1 tests skip without a GPU"
    cargo test --release -p ferrotron-train --features cuda --test nccl -- --nocapture
    echo "== CUDA backend: ferrotron built with CUDA refuses --device cuda here in one line"
    cargo build --release -p ferrotron --features cuda
    if out=$(target/release/ferrotron train --device cuda --steps 1 2>&1); then
        echo "error: train --device cuda succeeded on a machine without the trainer's GPU path: $out"
        exit 1
    fi
    echo "$out"
    case "$out" in
    "error: device = cuda: "*) ;;
    *) echo "error: unexpected message"; exit 1 ;;
    esac
    ;;
bundle)
    out=target/cuda-check
    rm -rf "$out" && mkdir -p "$out"
    cargo build --release -p ferrotron --features cuda
    cp target/release/ferrotron "$out/"
    for t in cuda_backend cuda_source; do
        bin=$(cargo test --release -p ferrotron-engine --features cuda --test "$t" --no-run --message-format=json 2>/dev/null |
            python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable"): print(m["executable"])' | tail -1)
        cp "$bin" "$out/$t"
    done
    # The NCCL communicator's world-size-1 tests (issue #33), a train test binary.
    bin=$(cargo test --release -p ferrotron-train --features cuda --test nccl --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable"): print(m["executable"])' | tail -1)
    cp "$bin" "$out/nccl"
    strip "$out"/*
    cp scripts/cuda_compare.py scripts/bench_gpu.sh tests/reference/bench_pytorch.py "$out/"
    cat >"$out/run.sh" <<'RUN'
#!/usr/bin/env bash
# On the GPU machine: the CUDA backend against the CPU backend (built by
# scripts/cuda_check.sh bundle), then the trainer on the GPU against the CPU: the default
# model for 20 steps in fp32 and bf16, losses and planned vs measured memory compared
# (cuda_compare.py). cuBLASLt and NVRTC come from the CUDA install or PyTorch's wheels.
set -uo pipefail
cd "$(dirname "$0")"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
rc=0
./cuda_source --nocapture || rc=1
./cuda_backend --nocapture --test-threads 1 || rc=1
out=${OUT:-/tmp}/cuda-train
for p in fp32 bf16; do
    for d in cpu cuda; do
        # The CPU's MFU is not the point here: a fixed peak skips measuring it. The GPU's
        # comes from the planner's table.
        peak=(); [ "$d" = cpu ] && peak=(--peak-gflops 100)
        ./ferrotron train --device "$d" --precision "$p" --steps 20 --eval-interval 10 \
            --sample-tokens 0 --quiet "${peak[@]}" --out-dir "$out/$p-$d" 2>"$out-$p-$d.log" ||
            { rc=1; tail -5 "$out-$p-$d.log"; }
    done
    python3 cuda_compare.py "$p" "$out/$p-cpu/metrics.jsonl" "$out/$p-cuda/metrics.jsonl" || rc=1
done
# NCCL at world size 1 (issue #33), after the stages above so they run first. cudarc loads
# libnccl.so by name and PyTorch's wheel holds libnccl.so.2: a link to it goes on
# LD_LIBRARY_PATH. A missing NCCL fails this stage (FERROTRON_REQUIRE_NCCL), never skips it.
echo "== NCCL communicator, world size 1"
nccl_lib=$(ls /opt/torch/.venv/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2 \
    /usr/lib/x86_64-linux-gnu/libnccl.so.2 2>/dev/null | head -1)
if [ -z "$nccl_lib" ]; then
    echo "error: NCCL (libnccl.so.2) not found on this GPU machine"
    rc=1
else
    link=/tmp/ferrotron-nccl-link
    mkdir -p "$link" && ln -sf "$nccl_lib" "$link/libnccl.so"
    LD_LIBRARY_PATH="$link:$LD_LIBRARY_PATH" FERROTRON_REQUIRE_NCCL=1 \
        timeout 180 ./nccl --nocapture --test-threads 1 || rc=1
fi
exit $rc
RUN
    chmod +x "$out/run.sh"
    du -sh "$out"
    echo "carry: target/cuda-check; run: bash target/cuda-check/run.sh"
    ;;
*)
    echo "usage: bash scripts/cuda_check.sh [check|bundle]" >&2
    exit 2
    ;;
esac
