#!/bin/bash
# Context parallelism on this machine (docs/BENCHMARKS.md, "context parallelism"): one rank and
# --cp 2 / --cp 4 on the default model at seq 512, fp32, the same 4 sequences per step (mbs 2 ×
# grad-acc 2), 5 steps, two interleaved rounds. Prints per layout: median tok/s | each rank's
# planned:measured peak MiB (first rank), worst rank | planned activations per rank (MiB) | the
# 5 losses. The mpirun row needs the mpi build (cargo build --release -p ferrotron --features
# mpi) and Open MPI.
set -u
cd "$(dirname "$0")/.."
B=./target/release/ferrotron
C="train --steps 5 --seq 512 --mbs 2 --grad-acc 2 --eval-interval 0 --sample-tokens 0 --peak-gflops 100"
run() { # name, prefix..., args
  local name="$1"; shift
  local out=/tmp/bench-cp/$name
  rm -rf $out
  "$@" --out-dir $out > $out.log 2>&1
  local done=$(grep "^done:" $out.log | sed -E 's/.*median ([0-9]+) tok\/s.*/\1/')
  local acts=$(grep -o "activations [0-9.]*" $out.log | head -1)
  local rest=$(python3 -c "
import json
rows=[json.loads(l) for l in open('$out/metrics.jsonl')]
last=rows[-1]
rm=last.get('rank_mem') or [{'rank':0,'mem_peak_planned':last['mem_peak_planned'],'mem_peak_measured':last['mem_peak_measured']}]
worst=max(abs(r['mem_peak_measured']/r['mem_peak_planned']-1) for r in rm)
r=rm[0]
print(f\"{r['mem_peak_planned']/2**20:.2f}:{r['mem_peak_measured']/2**20:.2f}, worst {worst*100:.3f}%\", '|', ' '.join(f\"{x['loss']:.7f}\" for x in rows))
" 2>/dev/null)
  echo "$name | $done | ${acts} | $rest"
}
mkdir -p /tmp/bench-cp
for round in 1 2; do
run one $B $C
run cp2 $B $C --cp 2
run cp4 $B $C --cp 4
run tp2-sp-cp2 $B $C --cp 2 --tp 2 --sp
run mpi-cp2 mpirun -np 2 --oversubscribe --allow-run-as-root $B $C --cp 2
done
