#!/bin/bash
# Context parallelism on this machine (docs/BENCHMARKS.md, "context parallelism"): one rank and
# --cp 2 / --cp 4 on the default model at seq 512, fp32, the same 4 sequences per step (mbs 2 ×
# grad-acc 2), 5 steps, two interleaved rounds. Columns: scripts/lib/bench_layout.sh. The
# mpirun row needs the mpi build (cargo build --release -p ferrotron --features mpi) and Open MPI.
set -u
cd "$(dirname "$0")/.."
. scripts/lib/bench_layout.sh
B=./target/release/ferrotron
C="train --steps 5 --seq 512 --mbs 2 --grad-acc 2 --eval-interval 0 --sample-tokens 0 --peak-gflops 100"
BENCH_OUT=/tmp/bench-cp
mkdir -p $BENCH_OUT
for round in 1 2; do
layout one $B $C
layout cp2 $B $C --cp 2
layout cp4 $B $C --cp 4
layout tp2-sp-cp2 $B $C --cp 2 --tp 2 --sp
layout mpi-cp2 mpirun -np 2 --oversubscribe --allow-run-as-root $B $C --cp 2
done
