#!/bin/bash
# Expert parallelism on this machine (docs/BENCHMARKS.md, "expert parallelism"): the small
# Mixtral (ferrotron-moe-16m: 8 experts, top-2) on one rank, --ep 2, --ep 4 and --dp 2 --ep 2,
# fp32, the same 8 sequences of 256 tokens per step, 5 steps, two interleaved rounds. Prints per
# layout: median tok/s | rank 0's planned:measured peak MiB, worst rank | all-to-all MB sent per
# rank in the last step, measured:planned | the 5 losses. The mpirun row needs the mpi build.
set -u
cd "$(dirname "$0")/.."
B=./target/release/ferrotron
C="train --model ferrotron-moe-16m --steps 5 --seq 256 --mbs 2 --eval-interval 0 --sample-tokens 0 --peak-gflops 100"
run() { # name, prefix..., args
  local name="$1"; shift
  local out=/tmp/bench-ep/$name
  rm -rf $out
  "$@" --out-dir $out > $out.log 2>&1
  local done=$(grep "^done:" $out.log | sed -E 's/.*median ([0-9]+) tok\/s.*/\1/')
  local rest=$(python3 -c "
import json
rows=[json.loads(l) for l in open('$out/metrics.jsonl')]
last=rows[-1]
rm=last.get('rank_mem') or [{'rank':0,'mem_peak_planned':last['mem_peak_planned'],'mem_peak_measured':last['mem_peak_measured']}]
worst=max(abs(r['mem_peak_measured']/r['mem_peak_planned']-1) for r in rm)
r=rm[0]
a2a=last.get('ep_comm_bytes')
a2a='-' if a2a is None else f\"{a2a/1e6:.3f}:{last['ep_comm_bytes_planned']/1e6:.3f}\"
print(f\"{r['mem_peak_planned']/2**20:.2f}:{r['mem_peak_measured']/2**20:.2f}, worst {worst*100:.3f}%\", '|', a2a, '|', ' '.join(f\"{x['loss']:.6f}\" for x in rows))
" 2>/dev/null)
  echo "$name | $done | $rest"
}
mkdir -p /tmp/bench-ep
for round in 1 2; do
run one $B $C --grad-acc 4
run ep2 $B $C --grad-acc 2 --ep 2
run ep4 $B $C --grad-acc 1 --ep 4
run dp2-ep2 $B $C --grad-acc 1 --dp 2 --ep 2
run mpi-dp2-ep2 mpirun -np 4 --oversubscribe --allow-run-as-root $B $C --grad-acc 1 --dp 2 --ep 2
done
