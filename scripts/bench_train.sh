#!/usr/bin/env bash
# Training benchmark: tokens/s, MFU and peak RSS of `ferrotron train` on fixed configs
# (fp32, AdamW, random order over the bundled corpus), medians over the timed steps.
#   bash scripts/bench_train.sh [small|smollm|all] [steps] [precision: fp32|bf16|...]
#   bash scripts/bench_train.sh pytorch [rounds] [small|smollm|all] ["fp32 bf16"]
#     the same configs side by side with the PyTorch peer, interleaved (scripts/bench_vs_pytorch.sh)
# The GEMM kernel is the process's choice (FERROTRON_GEMM=portable|onednn|auto); the binary is
# this tree's release build, or FERROTRON_BIN.
# Record results in docs/BENCHMARKS.md with the machine and the PyTorch peer
# (tests/reference/bench_pytorch.py), measured in the same sitting.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = pytorch ]; then
  shift
  exec bash scripts/bench_vs_pytorch.sh "$@"
fi
which=${1:-all}
steps=${2:-8}
precision=${3:-fp32}
# FERROTRON_BIN: a binary built elsewhere (before/after comparisons of two builds).
if [ -z "${FERROTRON_BIN:-}" ]; then
  cargo build --release -p ferrotron >/dev/null
fi
BIN=${FERROTRON_BIN:-${CARGO_TARGET_DIR:-target}/release/ferrotron}
OUT=$(mktemp -d)
bench() {
  local name=$1; shift
  $BIN train --out-dir "$OUT/$name" --data "$OUT/data" --steps "$steps" --warmup 2 \
    --eval-interval 0 --quiet --precision "$precision" "$@" 2>"$OUT/$name.log" || { cat "$OUT/$name.log"; exit 1; }
  python3 - "$name" "$OUT/$name/metrics.jsonl" "$OUT/$name.log" "$precision" <<'PY'
import json, re, statistics, sys
name, path, log, precision = sys.argv[1:]
rows = [json.loads(l) for l in open(path)][1:]  # the first step warms up
tps = statistics.median(r["tokens_per_s"] for r in rows)
mfu = statistics.median(r["mfu"] for r in rows)
ms = statistics.median(r["step_ms"] for r in rows)
rss = re.search(r"peak RSS ([0-9.]+) MiB", open(log).read()).group(1)
peak = re.search(r"matmul peak ([0-9.]+) GFLOP/s", open(log).read()).group(1)
gemm = re.search(r"gemm: (.*)", open(log).read()).group(1)
mem = rows[-1]
print(json.dumps({"config": name, "precision": precision, "gemm": gemm, "steps_timed": len(rows), "median_step_ms": round(ms, 1),
                  "tokens_per_s": round(tps, 1), "mfu": round(mfu, 4), "matmul_peak_gflops": float(peak),
                  "peak_rss_mib": float(rss), "mem_planned": mem["mem_peak_planned"],
                  "mem_measured": mem["mem_peak_measured"]}))
PY
}
$BIN data --input data/corpus/shakespeare.txt --out "$OUT/data" >/dev/null
case $which in
  small|all) bench small --model ferrotron-12m --seq 256 --mbs 8 ;;
esac
case $which in
  smollm|all) bench smollm --model smollm-135m --seq 256 --mbs 4 ;;
esac
rm -rf "$OUT"
