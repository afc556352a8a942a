#!/usr/bin/env bash
# Precision x recompute table and loss curves (docs/BENCHMARKS.md).
#   bash scripts/bench_precision.sh table [steps]   # 12 runs of the default model
#   bash scripts/bench_precision.sh curves [steps]  # fp32/bf16/fp16/fp8 loss curves + SVG plot
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q --bin ferrotron
bin=target/release/ferrotron
mode=${1:-table}
if [ "$mode" = table ]; then
  steps=${2:-8}
  echo "| precision | recompute | planned peak MiB | measured peak MiB | deviation | median tok/s | loss @ step $steps |"
  echo "|---|---|---|---|---|---|---|"
  for p in fp32 bf16 fp16 fp8; do
    for rc in none selective full; do
      out=runs/bench-precision/$p-$rc
      $bin train --precision "$p" --recompute "$rc" --steps "$steps" --eval-interval 0 \
        --out-dir "$out" --quiet >/dev/null 2>&1
      python3 - "$out/metrics.jsonl" "$p" "$rc" <<'PY'
import json, sys, statistics
rows = [json.loads(l) for l in open(sys.argv[1])]
later = rows[1:]
plan = max(r["mem_peak_planned"] for r in later) / 2**20
meas = max(r["mem_peak_measured"] for r in later) / 2**20
tps = statistics.median(r["tokens_per_s"] for r in later)
print(f"| {sys.argv[2]} | {sys.argv[3]} | {plan:.1f} | {meas:.1f} | {100*(meas/plan-1):+.2f}% | {tps:.0f} | {rows[-1]['loss']:.4f} |")
PY
    done
  done
else
  steps=${2:-200}
  for p in fp32 bf16 fp16 fp8; do
    $bin train --precision "$p" --steps "$steps" --mbs 4 --seq 128 --warmup 20 --lr 2e-3 \
      --eval-interval 0 --out-dir "runs/curves/$p" --quiet >/dev/null 2>&1
  done
  python3 scripts/plot_curves.py runs/curves docs/precision_loss_curves.svg
fi
