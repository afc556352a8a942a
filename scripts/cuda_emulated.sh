#!/usr/bin/env bash
# The GPU kit's stages on the CUDA emulator (crates/engine/cuda_emu), in CI: the CUDA backend's
# own code (launches, cuBLASLt descriptors, device memory, the trainer's GPU path) runs here
# for real, on host libraries standing in for the driver, NVRTC and cuBLASLt, so that what a
# GPU session would find first is found without one. Called by scripts/cuda_check.sh after it
# built target/release/ferrotron with --features cuda; also by hand:
#   bash scripts/cuda_emulated.sh
# Stages, each as run.sh has it on the GPU (same scripts, smaller model: a 0.6M-parameter
# Llama, since the emulator runs each GPU thread as a fiber, ~100 tokens/s):
#   - every op test and training step of the backend against the CPU, nothing skipped;
#   - the trainer on the GPU against the CPU, fp32 and bf16, and a mixture of experts
#     (cuda_compare.py), with each step's host synchronisations and launches (cuda_ops.py);
#   - --cuda-graph (a micro-batch captured into a CUDA graph, replayed) against the eager run's
#     bits (cuda_graph_compare.py), and refused for a mixture of experts;
#   - device memory by the driver's count against the plan, fp32/bf16 x none/full (cuda_memory.py);
#   - a plan over --device-memory refused with its fixes, then trained with --offload
#     optimizer and --offload params under that budget, against the CPU and the driver;
#   - dp 2, tp 2, pp 2, ZeRO-3 and cp 2 on the one GPU against one rank (cuda_ranks.py), and
#     ep 2 of the mixture of experts; dp 2 (fp32, bf16; ZeRO-1, 2, 3), tp 2 (with sp), cp 2 (with
#     tp 2), pp 2 and ep 2 x dp 2 (ZeRO-1) through the emulator's libnccl;
#   - the NCCL communicator at 1 to 3 ranks on the emulator's libnccl, and the watchdog taking
#     down a job whose NCCL peer stopped.
# What it cannot show (PTX and the hardware's rounding of expf, speed, the GPU's memory model,
# real NCCL and its streams) stays the GPU kit's: bash scripts/cuda_check.sh bundle, then target/cuda-check/run.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$PWD/target/cuda-emu
bash crates/engine/cuda_emu/build.sh "$dir"
export FERROTRON_LIBCUDA=$dir/libcuda.so.1 FERROTRON_NVRTC=$dir/libnvrtc.so.13 \
    FERROTRON_CUBLASLT=$dir/libcublasLt.so.13 FERROTRON_CACHE=$dir/cache FERROTRON_GPU_REQUIRED=1
bin=target/release/ferrotron
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# A run's output to a log, shown only when it fails.
run() {
    "$@" >"$work/run.log" 2>&1 || {
        tail -40 "$work/run.log"
        echo "error: failed on the CUDA emulator: $*"
        exit 1
    }
}
# The last run's peak RSS within its plan: on the emulator the device plan, the initial
# weights' host buffers and any offload tier, with the emulator's constant.
rss_within() {
    grep -q "within the bound of plan" "$work/run.log" || {
        grep "^done" "$work/run.log"
        echo "error: peak RSS over the plan on the CUDA emulator ($1)"
        exit 1
    }
}

# The last run's log has a line matching $1, else it is shown and $2 is the error.
said() {
    grep -q "$1" "$work/run.log" || {
        cat "$work/run.log"
        echo "error: $2"
        exit 1
    }
}

echo "== emulated GPU: the backend's op tests and training steps against the CPU"
cargo test --release -p ferrotron-engine --features cuda --test cuda_backend -- --test-threads 1

echo "== emulated NCCL: the NCCL communicator at 1, 2 and 3 ranks (threads) against the threads backend (#33)"
# The emulator's libnccl (cuda_emu/nccl.cpp) joins ranks that are threads of one process;
# cudarc finds it by name on LD_LIBRARY_PATH. Same features as cuda_check.sh's build: no rebuild.
LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}" FERROTRON_REQUIRE_NCCL=1 \
    cargo test --release -p ferrotron-dist -p ferrotron --features cuda --test nccl

# A 2-layer GQA Llama with the bundled tokenizer's vocabulary; the corpus tokenized once.
cat >"$work/config.json" <<'JSON'
{"model_type":"llama","hidden_size":64,"intermediate_size":160,"num_attention_heads":4,
 "num_key_value_heads":2,"num_hidden_layers":2,"vocab_size":8192,
 "max_position_embeddings":128,"tie_word_embeddings":true}
JSON
run "$bin" train --device cpu --model "$work/config.json" --steps 1 --seq 64 --mbs 2 --eval-interval 0 \
    --sample-tokens 0 --quiet --out-dir "$work/data-run"
common=(--data "$work/data-run/data" --seq 64 --mbs 2 --sample-tokens 0 --quiet)
tiny=(--model "$work/config.json" "${common[@]}")

echo "== emulated GPU: the trainer against the CPU, fp32, bf16 and fp8 (cuBLASLt's fp8 products, #32)"
for p in fp32 bf16 fp8; do
    for d in cpu cuda; do
        run "$bin" train --device "$d" --peak-gflops 100 --precision "$p" "${tiny[@]}" --steps 4 \
            --eval-interval 2 --out-dir "$work/$p-$d"
    done
    rss_within "$p"
    python3 scripts/cuda_compare.py "$p" "$work/$p-cpu/metrics.jsonl" "$work/$p-cuda/metrics.jsonl"
done

echo "== emulated GPU: a micro-batch captured into a CUDA graph and replayed (--cuda-graph, #32 item 5)"
# Against the same run eager, bit for bit: fp32 over 5 steps (a graph captured at step 3, an
# evaluation after step 4 between two of its launches), bf16 over 4 (full recomputation), fp8
# over 4 (its scales computed on the device from each operand's amax) and fp16 over 5 with the
# loss scale doubling every step (a graph replays the scale it captured, so each step's first
# micro-batch is captured anew and its second replays it), two micro-batches a step; from step
# 3 each micro-batch is one graph launch, its embedding grouping uploaded before it from the
# new batch's ids. The emulator runs the graph's launches with the arguments captured, its
# kernels late on the compute stream. Sequences of 32 tokens: the stage is about bits and
# launches, the emulator's time is its kernels'.
short=(--model "$work/config.json" --data "$work/data-run/data" --seq 32 --mbs 2 --sample-tokens 0 --quiet)
for g in "fp32 none 5" "bf16 full 4" "fp8 none 4" "fp16 none 5 --loss-scale-growth-interval 1"; do
    read -r p rc steps more <<<"$g"
    read -ra more <<<"${more:-}"
    for m in eager graph; do
        flag=("${more[@]}")
        [ "$m" = graph ] && flag+=(--cuda-graph)
        run "$bin" train --device cuda --precision "$p" --grad-acc 2 --recompute "$rc" \
            "${short[@]}" --steps "$steps" --eval-interval 2 "${flag[@]}" --out-dir "$work/graph-$p-$m"
    done
    python3 scripts/cuda_graph_compare.py "$p" "$work/graph-$p-eager/metrics.jsonl" \
        "$work/graph-$p-graph/metrics.jsonl" 2
done
# Resumed at step 2 with --cuda-graph: captured at the process's third step (its first two place
# the arena and grow the backend's scratch anew), the uninterrupted eager run's bits.
run "$bin" train --device cuda --precision fp32 --grad-acc 2 "${short[@]}" --steps 2 --eval-interval 2 \
    --checkpoint-dir "$work/graph-ck" --out-dir "$work/graph-ck-run"
run "$bin" train --device cuda --grad-acc 2 "${short[@]}" --steps 5 --eval-interval 2 --cuda-graph \
    --resume "$work/graph-ck" --out-dir "$work/graph-resumed"
python3 scripts/cuda_graph_compare.py "fp32 resumed" "$work/graph-fp32-eager/metrics.jsonl" \
    "$work/graph-resumed/metrics.jsonl" 2
python3 scripts/cuda_ops.py "fp32 --cuda-graph" "$work/graph-fp32-graph/metrics.jsonl" --max-syncs 2 --max-legacy 0

echo "== emulated GPU: a trace's GPU track, each op timed by CUDA events around it (#32)"
run "$bin" train --device cuda --peak-gflops 100 --precision bf16 "${tiny[@]}" --steps 2 \
    --eval-interval 0 --trace "$work/trace.json" --trace-steps 2 --out-dir "$work/traced"
python3 - "$work/trace.json" <<'PY'
import json, sys
ev = [e for e in json.load(open(sys.argv[1]))["traceEvents"] if e.get("ph") == "X"]
ops = [e for e in ev if e.get("cat") == "kernel"]
gpu = [e for e in ev if e.get("cat") == "gpu"]
# Every op called has its span on the device, under its name, in order, none negative.
assert [e["name"] for e in gpu] == [e["name"] for e in ops], (len(gpu), len(ops))
assert all(e["dur"] >= 0 for e in gpu) and sum(e["dur"] for e in gpu) > 0
starts = [e["ts"] for e in gpu]
assert all(a <= b for a, b in zip(starts, starts[1:])), "the device's spans run in order"
print(f"trace: {len(gpu)} ops with their GPU time from CUDA events, {sum(e['dur'] for e in gpu) / 1e3:.1f} ms in all")
PY
python3 scripts/trace_ops.py "$work/trace.json" >"$work/ops.txt"
head -4 "$work/ops.txt"

echo "== emulated GPU: the tensor-core attention in training, bf16 at head dim 64, against the CPU"
# (The model above has head dim 16, which the plain kernels take.) Two heads of 64 sharing one
# kv head, two 64-row tiles per sequence; the emulator runs mma.sync as the PTX ISA defines it.
cat >"$work/d64.json" <<'JSON'
{"model_type":"llama","hidden_size":128,"intermediate_size":256,"num_attention_heads":2,
 "num_key_value_heads":1,"num_hidden_layers":2,"vocab_size":8192,
 "max_position_embeddings":256,"tie_word_embeddings":true}
JSON
for d in cpu cuda; do
    run "$bin" train --device "$d" --peak-gflops 100 --precision bf16 --model "$work/d64.json" \
        --data "$work/data-run/data" --seq 128 --mbs 2 --sample-tokens 0 --quiet --steps 4 \
        --eval-interval 2 --out-dir "$work/d64-$d"
done
python3 scripts/cuda_compare.py bf16 "$work/d64-cpu/metrics.jsonl" "$work/d64-cuda/metrics.jsonl"
# The kit's attention benchmark (bench_gpu.sh) runs, on one short shape.
cargo build --release -p ferrotron-engine --features cuda --example cuda_attention_bench
target/release/examples/cuda_attention_bench flash 1 small

echo "== emulated GPU: a mixture of experts (4 experts, top 2) against the CPU, fp32"
cat >"$work/moe.json" <<'JSON'
{"model_type":"mixtral","hidden_size":64,"intermediate_size":96,"num_attention_heads":4,
 "num_key_value_heads":2,"num_hidden_layers":2,"vocab_size":8192,"max_position_embeddings":128,
 "tie_word_embeddings":true,"num_local_experts":4,"num_experts_per_tok":2}
JSON
for d in cpu cuda; do
    run "$bin" train --device "$d" --peak-gflops 100 --model "$work/moe.json" "${common[@]}" \
        --steps 4 --eval-interval 2 --out-dir "$work/moe-$d"
done
python3 scripts/cuda_compare.py fp32 "$work/moe-cpu/metrics.jsonl" "$work/moe-cuda/metrics.jsonl"
# A graph cannot hold its routing (built on the host between kernels): refused in one line.
if "$bin" train --device cuda --model "$work/moe.json" "${common[@]}" --steps 1 --cuda-graph \
    --out-dir "$work/moe-graph" 2>"$work/moe-graph.err"; then
    echo "error: --cuda-graph did not refuse a mixture of experts"
    exit 1
fi
grep -q "^error: cuda_graph: a mixture of experts" "$work/moe-graph.err" || {
    cat "$work/moe-graph.err"
    echo "error: --cuda-graph's refusal of a mixture of experts changed"
    exit 1
}
# Issue #32's counts, as run.sh prints them on the GPU, held where they stand: dense 2 (the
# norm, which brings the step's loss kept on the device along, and the step's end: the
# tokens' grouping and the target count are taken from the trainer's host copy, and the
# arena's region is reused, not reallocated), MoE 8 (the model reads its router's choices
# back once per layer and pass, 6, and the backend's routing tables are built from that copy).
python3 scripts/cuda_ops.py "moe fp32" "$work/moe-cuda/metrics.jsonl" --max-syncs 8
# A dense step leaves nothing on the legacy stream, which CUDA graphs cannot capture (#32 item 5).
python3 scripts/cuda_ops.py fp32 "$work/fp32-cuda/metrics.jsonl" --max-syncs 2 --max-legacy 0

echo "== emulated GPU: device memory by the driver's count against the plan"
mem=()
for p in fp32 bf16; do
    for rc in none full; do
        run "$bin" train --device cuda --precision "$p" --recompute "$rc" "${tiny[@]}" --steps 2 \
            --eval-interval 0 --out-dir "$work/mem-$p-$rc"
        mem+=("$p/$rc=$work/mem-$p-$rc/metrics.jsonl")
    done
done
python3 scripts/cuda_memory.py "${mem[@]}"

echo "== emulated GPU: the offload story, as the kit tells it for Llama-3.2-1B in 16 GiB"
# bf16 needs 47.8 MiB here, 34 of them the GPU's own workspace: refused under a 43 MiB budget
# with the fixes, then trained under it with the optimizer states, then the weights too, on
# the host; each against the CPU and its device memory by the driver against its plan.
budget=(--precision bf16 --device-memory 0.042 --eval-interval 0 --steps 3)
if "$bin" train --device cuda "${tiny[@]}" "${budget[@]}" --out-dir "$work/refused" 2>"$work/refused.err"; then
    echo "error: --device-memory 0.042 did not refuse a 47.8 MiB plan"
    exit 1
fi
grep "same-GPU fixes" "$work/refused.err" | cut -c1-200
run "$bin" train --device cpu --peak-gflops 100 "${tiny[@]}" "${budget[@]}" --out-dir "$work/offload-cpu"
offload=()
for o in optimizer params; do
    run "$bin" train --device cuda --peak-gflops 100 "${tiny[@]}" "${budget[@]}" --offload "$o" \
        --out-dir "$work/offload-$o"
    rss_within "--offload $o"
    python3 scripts/cuda_compare.py bf16 "$work/offload-cpu/metrics.jsonl" "$work/offload-$o/metrics.jsonl"
    offload+=("offload-$o=$work/offload-$o/metrics.jsonl")
done
python3 scripts/cuda_memory.py "${offload[@]}"
# --offload params uploads each layer one ahead on a copy stream, which the emulator runs as
# late as CUDA allows: the compute stream must wait for it (DeviceAlloc::await_uploads) or it
# reads the layer before's weights. Against the plain GPU run, with gradient accumulation:
# within 1e-5 (the update is the host's AdamW); a missed wait is 1e-3 off.
ahead=(--precision bf16 --eval-interval 0 --steps 3 --grad-acc 2)
run "$bin" train --device cuda "${tiny[@]}" "${ahead[@]}" --out-dir "$work/ahead-plain"
run "$bin" train --device cuda "${tiny[@]}" "${ahead[@]}" --offload params --out-dir "$work/ahead-params"
python3 scripts/cuda_ranks.py "$work/ahead-plain/metrics.jsonl" "offload-params=$work/ahead-params/metrics.jsonl"
# A host that cannot hold the tier (with CUDA's libraries, 768 MiB): refused before anything
# is allocated, naming the disk tier.
if FERROTRON_HOST_MEMORY=$((512 << 20)) "$bin" train --device cuda "${tiny[@]}" "${budget[@]}" \
    --offload optimizer --out-dir "$work/host-refused" 2>"$work/host.err"; then
    echo "error: a host of 512 MiB did not refuse the offload tier with CUDA's 768 MiB"
    exit 1
fi
grep -q "^error: offload = optimizer: the host tier needs .* try --offload-dir PATH" "$work/host.err" || {
    cat "$work/host.err"
    echo "error: the host refusal's message"
    exit 1
}
cut -c1-200 "$work/host.err"
[ ! -e "$work/host-refused/metrics.jsonl" ] || { echo "error: the refused run wrote metrics"; exit 1; }

echo "== emulated GPU: several ranks on the one GPU against one rank (fp32, the same global batch)"
# At sequences of 32 (`short`, as the graphs above): the layouts' equivalence does not depend on
# the length, and these 20 multi-rank runs were the largest share of the emulated stage.
ranks=(--steps 3 --eval-interval 0)
run "$bin" train --device cuda "${short[@]}" "${ranks[@]}" --grad-acc 2 --out-dir "$work/ranks-one"
got=()
for l in "dp2:--dp 2 --grad-acc 1" "tp2:--tp 2 --grad-acc 2" "pp2:--pp 2 --grad-acc 2" \
    "zero3:--dp 2 --zero 3 --grad-acc 1" "cp2:--cp 2 --grad-acc 2"; do
    read -ra lf <<<"${l#*:}"
    run "$bin" train --device cuda "${short[@]}" "${ranks[@]}" "${lf[@]}" --out-dir "$work/ranks-${l%%:*}"
    got+=("${l%%:*}=$work/ranks-${l%%:*}/metrics.jsonl")
done
python3 scripts/cuda_ranks.py "$work/ranks-one/metrics.jsonl" "${got[@]}"
# Data parallelism's gradient sum through NCCL (FERROTRON_NCCL=1: the emulator's libnccl takes
# two ranks on its one GPU), in place on the device and overlapping the backward: the staged
# dp 2's bits, 5 host syncs a step where the host's buckets take 44.
LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}" FERROTRON_NCCL=1 run "$bin" train --device cuda "${short[@]}" \
    "${ranks[@]}" --dp 2 --grad-acc 1 --out-dir "$work/ranks-nccl"
said "^data parallel: gradients summed in place by NCCL" "dp 2 with FERROTRON_NCCL=1 did not sum through NCCL"
python3 scripts/cuda_ranks.py "$work/ranks-one/metrics.jsonl" "nccl-dp2=$work/ranks-nccl/metrics.jsonl"
python3 scripts/cuda_ops.py "nccl dp2" "$work/ranks-nccl/metrics.jsonl" --max-syncs 6
# ZeRO-1 and 2 through NCCL: each segment's gradients summed into its owner's copy (ZeRO-1, in
# place) or shard (ZeRO-2, from its window), the updated weights broadcast from the owners, on
# the device (4-5 host syncs a step where the host's buckets take 66 and 88): against one rank.
for z in 1 2; do
    LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}" FERROTRON_NCCL=1 run "$bin" train --device cuda "${short[@]}" \
        "${ranks[@]}" --dp 2 --zero $z --grad-acc 1 --out-dir "$work/ranks-nccl-zero$z"
    python3 scripts/cuda_ranks.py "$work/ranks-one/metrics.jsonl" "nccl-zero$z=$work/ranks-nccl-zero$z/metrics.jsonl"
    python3 scripts/cuda_ops.py "nccl zero$z" "$work/ranks-nccl-zero$z/metrics.jsonl" --max-syncs 7
done
# ZeRO-3 through NCCL: each unit's weights broadcast into its window from the owners' shards, a
# layer ahead; with gradient accumulation each segment's sum lands in place in the owner's
# window and the owner adds it into its shard by the backend's kernel (4 host syncs a step
# where the host's buckets take 92.5): 2 micro-batches a step against one rank of 4.
run "$bin" train --device cuda "${short[@]}" "${ranks[@]}" --grad-acc 4 --out-dir "$work/ranks-one4"
LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}" FERROTRON_NCCL=1 run "$bin" train --device cuda "${short[@]}" \
    "${ranks[@]}" --dp 2 --zero 3 --grad-acc 2 --out-dir "$work/nccl-zero3-acc"
python3 scripts/cuda_ranks.py "$work/ranks-one4/metrics.jsonl" "nccl-zero3-acc2=$work/nccl-zero3-acc/metrics.jsonl"
# (bf16 sums in bf16, each addition rounded once, at two ranks the host buckets' bits: the
# communicator's own test, tests/nccl.rs, which CI runs above; a trainer pair of runs here
# cost CI 20 s for the same check.)
# Asked for where it cannot serve (fp16 gradients, whose loss scale checks them on the host's
# buckets): refused in one line, nothing trained.
if LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}" FERROTRON_NCCL=1 "$bin" train --device cuda "${short[@]}" \
    "${ranks[@]}" --dp 2 --precision fp16 --out-dir "$work/nccl-refused" 2>"$work/nccl.err"; then
    echo "error: FERROTRON_NCCL=1 trained fp16 gradients"
    exit 1
fi
grep -q "^error: rank 0: FERROTRON_NCCL=1: data parallel: precision = fp16: fp16 gradients" "$work/nccl.err" || {
    cat "$work/nccl.err"
    echo "error: the NCCL refusal's message"
    exit 1
}
# dp 2 on NCCL with test switch $1 on rank 1 at step 3 (more flags after $3) must fail within
# 60 s with a line matching $2, else $3 is the error.
rank1_at_step3() {
    if LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}" FERROTRON_NCCL=1 env "$1=1:3" timeout 60 \
        "$bin" train --device cuda "${short[@]}" --steps 6 --eval-interval 0 --dp 2 --grad-acc 1 \
        "${@:4}" --out-dir "$work/nccl-$1" 2>"$work/nccl.err"; then
        echo "error: $3 (the run finished)"
        exit 1
    fi
    grep -q "$2" "$work/nccl.err" || {
        cat "$work/nccl.err"
        echo "error: $3"
        exit 1
    }
}
# A rank that stops alive (FERROTRON_TEST_STALL) holds its NCCL peer in the device's queue,
# where no host collective waits: the watchdog arms NCCL's calls and the GPU's host
# synchronisations, and takes the job down in one line after --comm-timeout.
rank1_at_step3 FERROTRON_TEST_STALL "^error: rank 0: comm timeout: .* on group dp at step 3 got no answer within 3 s" \
    "the NCCL peer of a stalled rank did not time out (--comm-timeout 3)" --comm-timeout 3
# A rank that fails (FERROTRON_TEST_FAIL) leaves its NCCL peer waiting where no host
# communicator wakes it: the watchdog ends the job a few seconds after the failure, with its
# error, not at the 600 s default deadline.
rank1_at_step3 FERROTRON_TEST_FAIL \
    "^error: rank 1 failed: rank 1: failed at step 3, as FERROTRON_TEST_FAIL asked; rank 0 still waits in .* on group dp" \
    "the NCCL peer of a failed rank was not ended with its error"
# Tensor parallelism's collectives through NCCL on the activations where they lie, in their own
# type (device_collective.rs; bf16 at 2 and 3 ranks in tests/nccl.rs): the staged tp 2's bits,
# sequence parallelism's gathers and scatters against one rank; with the vocabulary-parallel
# cross-entropy's kernels and the gradient norm read back once, 4 host synchronisations a step
# (the staged tp 2 takes 48.5: its collectives' downloads), held there.
nccl_run() {
    LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}" FERROTRON_NCCL=$1 run "$bin" train --device cuda "${short[@]}" \
        "${ranks[@]}" --grad-acc 2 "${@:3}" --out-dir "$work/$2"
}
nccl_run 1 nccl-tp2 --tp 2
said "^tensor parallel: the activations' collectives run on each rank's GPU by NCCL" \
    "tp 2 with FERROTRON_NCCL=1 did not run its collectives on NCCL"
nccl_run 1 nccl-sp2 --tp 2 --sp
python3 scripts/cuda_ranks.py "$work/ranks-tp2/metrics.jsonl" "nccl-tp2=$work/nccl-tp2/metrics.jsonl"
python3 scripts/cuda_ranks.py "$work/ranks-one/metrics.jsonl" "nccl-sp2=$work/nccl-sp2/metrics.jsonl"
python3 scripts/cuda_ops.py "nccl tp2" "$work/nccl-tp2/metrics.jsonl" --max-syncs 6
# The pipeline on NCCL: the tied embedding summed over its ends in place (the staged pp 2 moves
# it through the host's receive buffer, 128 of its 137.5 host syncs a step), the stages'
# messages GPU to GPU over a communicator per directed edge from device send buffers (8 more):
# the staged run's bits, 4.5-5.5 host syncs a step (an arena placement's allocation or two).
nccl_run 1 nccl-pp2 --pp 2
said "^pipeline parallel: the tied embedding's gradient summed over the first and last stages by NCCL" \
    "pp 2 with FERROTRON_NCCL=1 did not sum its tied embedding on NCCL"
said "^pipeline parallel: the stages' messages pass between their GPUs by NCCL" \
    "pp 2 with FERROTRON_NCCL=1 did not send its messages by NCCL"
python3 scripts/cuda_ranks.py "$work/ranks-pp2/metrics.jsonl" "nccl-pp2=$work/nccl-pp2/metrics.jsonl"
python3 scripts/cuda_ops.py "nccl pp2" "$work/nccl-pp2/metrics.jsonl" --max-syncs 7
# Context parallelism's ring through NCCL (each f32 block as it lies, one group of a send and a
# receive beside the attention of the block in hand; a compute stream that did not wait for it
# would read the last block, which the emulator's late streams show): the staged cp 2's bits,
# and with tensor parallelism too (both groups on NCCL). With the ring attention's kernels,
# 5 host synchronisations a step (628 when its blocks went through the host).
nccl_run 1 nccl-cp2 --cp 2
said "^context parallel: the ring's blocks pass between the ranks' GPUs by NCCL" "cp 2 with FERROTRON_NCCL=1 did not pass its ring through NCCL"
nccl_run 1 nccl-cp2-tp2 --cp 2 --tp 2
python3 scripts/cuda_ranks.py "$work/ranks-cp2/metrics.jsonl" "nccl-cp2=$work/nccl-cp2/metrics.jsonl"
python3 scripts/cuda_ranks.py "$work/ranks-one/metrics.jsonl" "nccl-cp2-tp2=$work/nccl-cp2-tp2/metrics.jsonl"
python3 scripts/cuda_ops.py "nccl cp2" "$work/nccl-cp2/metrics.jsonl" --max-syncs 7
# Expert parallelism of the mixture of experts: ep 2 against one rank, and the backward's rows
# moved in blocks and kernels (gather_copies, scale_each_row, dot_each_row, scatter_copies),
# the rows widened and rounded by kernels (widen, narrow), not row by row through the host:
# 9,389 host synchronisations a step at first, 98 now (the staged all-to-alls' pieces), held
# there. Through NCCL, ep 2 x dp 2 under ZeRO-1 (the all-to-alls between the blocks where they
# lie, each dense segment summed into its owner among the four ranks, each expert's among its
# two replicas, the updated weights broadcast back from the owners): against one rank of 4
# micro-batches (the staged run's bits, 37 host syncs a step of its four ranks where the
# staged take 245.5: the router's choices read back for the blocks).
moe_ranks=(--model "$work/moe.json" "${common[@]}" --steps 3 --eval-interval 0)
run "$bin" train --device cuda "${moe_ranks[@]}" --grad-acc 2 --out-dir "$work/ep-one"
run "$bin" train --device cuda "${moe_ranks[@]}" --ep 2 --grad-acc 1 --out-dir "$work/ep-two"
python3 scripts/cuda_ranks.py "$work/ep-one/metrics.jsonl" "ep2=$work/ep-two/metrics.jsonl"
python3 scripts/cuda_ops.py "moe ep2" "$work/ep-two/metrics.jsonl" --max-syncs 100
run "$bin" train --device cuda "${moe_ranks[@]}" --grad-acc 4 --out-dir "$work/ep-one4"
LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}" FERROTRON_NCCL=1 run "$bin" train --device cuda "${moe_ranks[@]}" \
    --ep 2 --dp 2 --zero 1 --grad-acc 1 --out-dir "$work/ep-nccl"
said "^expert parallel: the routed rows' all-to-alls run between the ranks' GPUs by NCCL" \
    "ep 2 with FERROTRON_NCCL=1 did not exchange through NCCL"
said "^data parallel: gradients summed in place by NCCL" "ep 2 x dp 2 with FERROTRON_NCCL=1 did not sum through NCCL"
python3 scripts/cuda_ranks.py "$work/ep-one4/metrics.jsonl" "nccl-ep2-dp2=$work/ep-nccl/metrics.jsonl"
python3 scripts/cuda_ops.py "nccl moe ep2 dp2" "$work/ep-nccl/metrics.jsonl" --max-syncs 45
echo "== emulated GPU: every stage passed"
