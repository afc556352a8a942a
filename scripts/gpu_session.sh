#!/usr/bin/env bash
# A lent GPU's session in one call (the kit's session.sh, built by scripts/cuda_check.sh bundle):
# a session has 15 minutes of device time, the machine's start included, and 10 a command, so
# the checks that matter most run first and each part gets what is left of one deadline.
#
#   cd target/cuda-check && OUT=$OUT bash session.sh [SECONDS]   # default 560
#
# In order: every op against the CPU (the kernels changed since the last GPU: a wrong kernel
# makes every number after it meaningless), then #32's acceptance figures side by side with
# PyTorch on the same GPU (bench_gpu.sh: training tokens/s, MFU and memory on SmolLM-135M and
# Llama-3.2-1B; attention alone against SDPA; fp8 against bf16), then --cuda-graph against
# eager, then the kit's run.sh (the trainer against the CPU, the layouts, offload) with the time
# left. $OUT/session.txt says what each part gave; each part's full output is in $OUT/<part>/.
# A part whose time is too short is skipped, said so. Exit 1 if any part failed.
set -uo pipefail
cd "$(dirname "$0")"
OUT=${OUT:-$(mktemp -d)}
deadline=$((SECONDS + ${1:-560}))
summary="$OUT/session.txt"
: >"$summary"
rc=0

# part NAME MIN_SECONDS COMMAND...: runs it in $OUT/NAME with what is left of the deadline (if
# at least MIN_SECONDS), its last lines to the summary.
part() {
    local name=$1 min=$2 left t0=$SECONDS r
    shift 2
    left=$((deadline - SECONDS))
    if [ "$left" -lt "$min" ]; then
        echo "$name: skipped, ${left} s left (needs $min)" | tee -a "$summary"
        return
    fi
    mkdir -p "$OUT/$name"
    if OUT="$OUT/$name" timeout "$left" "$@" >"$OUT/$name/log" 2>&1; then r=ok; else r="FAILED (exit $?)"; rc=1; fi
    echo "$name: $r in $((SECONDS - t0)) s" | tee -a "$summary"
    grep -v "^test \|^$\|^running " "$OUT/$name/log" | tail -n 6 | sed 's/^/  /' | cut -c1-400 | tee -a "$summary"
}

if ! gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1); then
    echo "error: no NVIDIA driver on this machine (nvidia-smi: ${gpu:-not found}): session.sh is for the GPU machine" | tee -a "$summary"
    exit 2
fi
echo "gpu: $gpu" | tee -a "$summary"
part ops 60 env FERROTRON_GPU_REQUIRED=1 ./cuda_backend --test-threads 1
part train 150 bash bench_gpu.sh 1 train
part attention 40 bash bench_gpu.sh 1 attention
part fp8 120 bash bench_gpu.sh 1 fp8
part graph 120 bash bench_gpu.sh 1 graph
part kit 60 bash run.sh
echo "result: $([ $rc = 0 ] && echo ok || echo FAILED)" | tee -a "$summary"
exit $rc
