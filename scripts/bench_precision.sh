#!/usr/bin/env bash
# Precision x recompute table and loss curves (docs/BENCHMARKS.md).
#   bash scripts/bench_precision.sh table [steps]   # 12 runs of the default model
#   bash scripts/bench_precision.sh curves [steps]  # fp32/bf16/fp16/fp8 loss curves + SVG plot
#   bash scripts/bench_precision.sh ratio [steps] [rounds]  # bf16/fp32 tokens/s per recompute,
#     fp32 and bf16 runs interleaved `rounds` times so a noisy neighbour hits both alike
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
elif [ "$mode" = ratio ]; then
  steps=${2:-6}
  rounds=${3:-3}
  echo "| recompute | fp32 median tok/s | bf16 median tok/s | bf16 / fp32 |"
  echo "|---|---|---|---|"
  for rc in none selective full; do
    for r in $(seq "$rounds"); do
      for p in fp32 bf16; do
        $bin train --precision "$p" --recompute "$rc" --steps "$steps" --eval-interval 0 \
          --out-dir "runs/bench-ratio/$rc-$p-$r" --quiet >/dev/null 2>&1
      done
    done
    python3 - runs/bench-ratio "$rc" "$rounds" <<'PY'
import json, sys, statistics
root, rc, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
def tps(p):
    # Every step but each run's first (warm-up), over all rounds.
    return statistics.median(json.loads(l)["tokens_per_s"]
                             for r in range(1, rounds + 1)
                             for l in list(open(f"{root}/{rc}-{p}-{r}/metrics.jsonl"))[1:])
a, b = tps("fp32"), tps("bf16")
print(f"| {rc} | {a:.0f} | {b:.0f} | {b / a:.2f} |")
PY
  done
else
  steps=${2:-200}
  # bf16-sr: bf16 with stochastic rounding of the weight update.
  for p in fp32 bf16 bf16-sr fp16 fp8; do
    $bin train --precision "${p%-sr}" --stochastic-rounding "$([ "$p" = bf16-sr ] && echo true || echo false)" \
      --steps "$steps" --mbs 4 --seq 128 --warmup 20 --lr 2e-3 \
      --eval-interval 0 --out-dir "runs/curves/$p" --quiet >/dev/null 2>&1
  done
  python3 scripts/plot_curves.py runs/curves docs/precision_loss_curves.svg
fi
