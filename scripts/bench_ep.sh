#!/bin/bash
# Expert parallelism on this machine (docs/BENCHMARKS.md, "expert parallelism"): the small
# Mixtral (ferrotron-moe-16m: 8 experts, top-2) on one rank, --ep 2, --ep 4 and --dp 2 --ep 2,
# fp32, the same 8 sequences of 256 tokens per step, 5 steps, two interleaved rounds. Columns:
# scripts/lib/bench_layout.sh. The mpirun row needs the mpi build.
set -u
cd "$(dirname "$0")/.."
. scripts/lib/bench_layout.sh
B=./target/release/ferrotron
C="train --model ferrotron-moe-16m --steps 5 --seq 256 --mbs 2 --eval-interval 0 --sample-tokens 0 --peak-gflops 100"
BENCH_OUT=/tmp/bench-ep
mkdir -p $BENCH_OUT
for round in 1 2; do
layout one $B $C --grad-acc 4
layout ep2 $B $C --grad-acc 2 --ep 2
layout ep4 $B $C --grad-acc 1 --ep 4
layout dp2-ep2 $B $C --grad-acc 1 --dp 2 --ep 2
layout mpi-dp2-ep2 mpirun -np 4 --oversubscribe --allow-run-as-root $B $C --grad-acc 1 --dp 2 --ep 2
done
