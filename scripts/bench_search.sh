#!/usr/bin/env bash
# Times `ferrotron plan search` on 1,024 GPUs (the planner's benchmark; docs/BENCHMARKS.md).
# Usage: bash scripts/bench_search.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p ferrotron
bin=target/release/ferrotron
run() {
    local start end
    start=$(date +%s.%N)
    "$bin" plan search "$@" --json > /dev/null
    end=$(date +%s.%N)
    printf '%-60s %6.3f s\n' "$*" "$(echo "$end - $start" | bc)"
}
for i in 1 2 3; do
    run --model llama-3-70b --gpus 1024 --gpus-per-node 8 --gpu h100 --seq 4096 --gbs-tokens 4194304
    run --model llama-3.1-405b --gpus 1024 --gpus-per-node 8 --gpu h100 --seq 8192 --gbs-tokens 16777216
    run --model mixtral-8x7b --gpus 1024 --gpus-per-node 8 --gpu h100 --seq 4096 --gbs-tokens 4194304
done
cargo run --release -q -p ferrotron-plan --example search_bench
