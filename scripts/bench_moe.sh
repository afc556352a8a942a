#!/bin/bash
# Mixture of experts and expert parallelism on this machine (docs/BENCHMARKS.md, "mixture of
# experts"): ferrotron-moe-16m (a small Mixtral: 8 experts, top-2) on one rank and on each
# --dp/--ep layout, the same 16 sequences of 256 tokens per step (one rank runs the replicas'
# micro-batches in turn), two interleaved rounds. Prints per layout: median tok/s | rank 0's
# planned:measured peak MiB, worst rank's deviation | rank 0's planned layer activations MiB at its peak |
# all-to-all MB sent by rank 0 in the last step, planned | last loss. The mpirun row needs the
# mpi build (cargo build --release -p ferrotron --features mpi) and Open MPI.
set -u
cd "$(dirname "$0")/.."
B=./target/release/ferrotron
C="train --model ferrotron-moe-16m --steps 5 --eval-interval 0 --sample-tokens 0 --peak-gflops 100 --mbs 4 --seq 256"
run() { # name, prefix..., args
  local name="$1"; shift
  local out=/tmp/bench-moe/$name
  rm -rf $out
  "$@" --out-dir $out > $out.log 2>&1
  local done=$(grep "^done:" $out.log | sed -E 's/.*median ([0-9]+) tok\/s.*/\1/')
  local a2a=$(grep "expert parallel:" $out.log | sed -E 's/.*: ([0-9.]+) MB sent.*planned ([0-9.]+) MB.*/\1 (planned \2)/')
  local mem=$(python3 -c "
import json
rows=[json.loads(l) for l in open('$out/metrics.jsonl')]
last=rows[-1]
rm=last.get('rank_mem') or [{'rank':0,'mem_peak_planned':last['mem_peak_planned'],'mem_peak_measured':last['mem_peak_measured']}]
worst=max(abs(r['mem_peak_measured']/r['mem_peak_planned']-1) for r in rm)
plan=json.load(open('$out/plan.json'))
acts=plan['rank']['at_peak'].get('layer_activations')
print(f\"{rm[0]['mem_peak_planned']/2**20:.2f}:{rm[0]['mem_peak_measured']/2**20:.2f} worst {worst*100:.2f}% | {acts/2**20 if acts else float('nan'):.1f} | loss {last['loss']:.4f}\")
" 2>/dev/null)
  echo "$name | $done | $mem | ${a2a:--}"
}
mkdir -p /tmp/bench-moe
for round in 1 2; do
run one $B $C --grad-acc 4
run dp2 $B $C --grad-acc 2 --dp 2
run ep2 $B $C --grad-acc 2 --ep 2
run ep4 $B $C --ep 4
run dp2-ep2 $B $C --dp 2 --ep 2
run mpi-dp2-ep2 mpirun -np 4 --oversubscribe --allow-run-as-root $B $C --dp 2 --ep 2
done
