#!/bin/bash
# Pipeline parallelism on this machine (docs/BENCHMARKS.md, "pipeline parallelism"): one rank
# and each --pp layout on the default model, the same 8 sequences per step, two interleaved
# rounds. Prints per layout: median tok/s | first and last stage planned:measured MiB, worst
# rank | each stage's measured bubble | the planner's. The mpirun rows need the mpi build
# (cargo build --release -p ferrotron --features mpi) and Open MPI.
set -u
cd "$(dirname "$0")/.."
B=./target/release/ferrotron
C="train --steps 5 --eval-interval 0 --sample-tokens 0 --peak-gflops 100 --mbs 2"
run() { # name, prefix..., args
  local name="$1"; shift
  local out=/tmp/bench-pp/$name
  rm -rf $out
  "$@" --out-dir $out > $out.log 2>&1
  local done=$(grep "^done:" $out.log | sed -E 's/.*median ([0-9]+) tok\/s.*/\1/')
  local bub=$(grep "pipeline bubble" $out.log | sed -E 's/.*stages (.*) of their compute time blocked, planned .* = (.*)/\1 | \2/')
  local mem=$(python3 -c "
import json
rows=[json.loads(l) for l in open('$out/metrics.jsonl')]
last=[r for r in rows if 'mem_peak_planned' in r][-1]
rm=last.get('rank_mem') or [{'rank':0,'mem_peak_planned':last['mem_peak_planned'],'mem_peak_measured':last['mem_peak_measured']}]
worst=max(abs(r['mem_peak_measured']/r['mem_peak_planned']-1) for r in rm)
print(' / '.join(f\"{r['mem_peak_planned']/2**20:.2f}:{r['mem_peak_measured']/2**20:.2f}\" for r in rm[:: max(1,len(rm)//2) ] ), f'worst {worst*100:.2f}%')
" 2>/dev/null)
  echo "$name | $done | $mem | $bub"
}
mkdir -p /tmp/bench-pp
for round in 1 2; do
run one $B $C --grad-acc 4
run afab $B $C --grad-acc 4 --pp 2 --pp-schedule afab
run 1f1b $B $C --grad-acc 4 --pp 2 --pp-schedule 1f1b
run interleaved $B $C --grad-acc 4 --pp 2 --pp-schedule interleaved --pp-virtual 3
run 1f1b-42 $B $C --grad-acc 4 --pp 2 --pp-layers 4,2
run 3d $B $C --grad-acc 2 --dp 2 --tp 2 --sp --pp 2 --zero 1
run mpi-1f1b mpirun -np 2 --oversubscribe --allow-run-as-root $B $C --grad-acc 4 --pp 2
run mpi-3d mpirun -np 8 --oversubscribe --allow-run-as-root $B $C --grad-acc 2 --dp 2 --tp 2 --sp --pp 2 --zero 1
done
