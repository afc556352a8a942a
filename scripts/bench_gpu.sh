#!/usr/bin/env bash
# ferrotron on the GPU against PyTorch on the same GPU, side by side (issue #14's acceptance):
# bf16, seq 2048, SmolLM-135M and Llama-3.2-1B shapes from random init; rounds interleaved
# (ferrotron, then PyTorch, per shape); per shape the median tokens/s of each side, their
# ratio, MFU (model FLOPs, causal-aware, against the GPU's dense bf16 peak) and peak memory.
#   bash bench_gpu.sh [rounds] [attention|train|all|trace|fp8|graph]   # in target/cuda-check on the GPU machine
# `fp8`: ferrotron's fp8 products against its bf16, per shape (speed-up, last loss, memory);
# `graph`: its bf16 with --cuda-graph against eager, the same way.
# `trace`: one traced run per shape (3 steps, --trace), each op's GPU time from the CUDA events
# around it summed by trace_ops.py (the traces stay in $OUT).
# First, attention alone (issue #32: forward + backward within 1.5x of PyTorch's SDPA, flash):
# the kit's cuda_attention_bench against bench_pytorch's peer bench_sdpa.py, same shapes.
# ferrotron is the bundle's binary (scripts/cuda_check.sh bundle); PyTorch is the machine's
# python3 with transformers (tests/reference/bench_pytorch.py --device cuda: SDPA, fused AdamW).
set -euo pipefail
cd "$(dirname "$0")"
rounds=${1:-3}
parts=${2:-all}
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
OUT=${OUT:-$(mktemp -d)}
RESULTS="$OUT/bench_gpu.jsonl"
: >"$RESULTS"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# ferrotron against itself, one change apart, per shape, rounds interleaved: the change's
# speed-up and both runs' last loss and memory.
#   fp8 (issue #32 item 4): the layer products through cuBLASLt's fp8 tensor cores, everything
#       else as bf16, against bf16;
#   graph (issue #32 item 5): bf16 with --cuda-graph (each micro-batch one launch of a graph
#       captured at step 3) against bf16 eager; the steps from 4 on are timed.
case "$parts" in
fp8) sides=("bf16:--precision bf16" "fp8:--precision fp8") ;;
graph) sides=("eager:--precision bf16" "graph:--precision bf16 --cuda-graph") ;;
*) sides=() ;;
esac
if [ ${#sides[@]} -gt 0 ]; then
    VS="$OUT/bench_$parts.jsonl"
    : >"$VS"
    for round in $(seq "$rounds"); do
        for shape in "smollm-135m 8" "llama-3.2-1b 4"; do
            read -r preset mbs <<<"$shape"
            for side in "${sides[@]}"; do
                name=${side%%:*}
                read -ra flags <<<"${side#*:}"
                dir="$OUT/$preset-$name-$round"
                ./ferrotron train --device cuda --model "$preset" --seq 2048 --mbs "$mbs" "${flags[@]}" \
                    --steps 8 --warmup 2 --eval-interval 0 --sample-tokens 0 --quiet --out-dir "$dir" \
                    2>"$dir.log" || { tail -5 "$dir.log"; exit 1; }
                python3 - "$preset" "$name" "$dir/metrics.jsonl" >>"$VS" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[3])]
print(json.dumps({"shape": sys.argv[1], "side": sys.argv[2],
    "tok_s": statistics.median(r["tokens_per_s"] for r in rows[3:]), "last_loss": rows[-1]["loss"],
    "mem_mib": rows[-1]["mem_peak_measured"] / 2**20, "planned_mib": rows[-1]["mem_peak_planned"] / 2**20}))
PY
                tail -1 "$VS"
            done
        done
    done
    python3 - "$VS" "${sides[0]%%:*}" "${sides[1]%%:*}" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
base, other = sys.argv[2], sys.argv[3]
for shape in dict.fromkeys(r["shape"] for r in rows):
    side = lambda s: [r for r in rows if r["shape"] == shape and r["side"] == s]
    b, o = side(base), side(other)
    med = lambda rs, k: statistics.median(r[k] for r in rs)
    print(f"{shape} seq 2048: {other} {med(o, 'tok_s'):.0f} tok/s vs {base} {med(b, 'tok_s'):.0f}: "
          f"{med(o, 'tok_s') / med(b, 'tok_s'):.2f}x; last loss {o[-1]['last_loss']:.4f} vs {b[-1]['last_loss']:.4f}; "
          f"memory {o[-1]['mem_mib']:.0f} MiB (planned {o[-1]['planned_mib']:.0f}) vs {b[-1]['mem_mib']:.0f}, over {len(o)} rounds")
PY
    exit 0
fi
if [ "$parts" = trace ]; then
    # The third: --offload params under 16 GiB (issue #33: 0.81 s a step against 0.55 planned),
    # whose phases' wall time beside the ops' GPU time shows what the streaming costs.
    for shape in "smollm-135m 8" "llama-3.2-1b 4" "llama-3.2-1b 1 offload-params"; do
        read -r preset mbs variant <<<"$shape"
        extra=()
        [ "${variant:-}" = offload-params ] && extra=(--offload params --device-memory 16)
        name="$preset${variant:+-$variant}"
        ./ferrotron train --device cuda --model "$preset" --seq 2048 --mbs "$mbs" --precision bf16 \
            --steps 3 --eval-interval 0 --sample-tokens 0 --quiet --trace "$OUT/trace-$name.json" \
            --trace-steps 3 "${extra[@]}" --out-dir "$OUT/traced-$name" 2>"$OUT/traced-$name.log" ||
            { tail -5 "$OUT/traced-$name.log"; exit 1; }
        echo "== $name, bf16 seq 2048 mbs $mbs: GPU time per op, steps 2-3"
        python3 trace_ops.py "$OUT/trace-$name.json" >"$OUT/ops-$name.txt"
        head -16 "$OUT/ops-$name.txt"
        tail -2 "$OUT/ops-$name.txt"
    done
    exit 0
fi
if [ "$parts" != train ]; then
    ATTENTION="$OUT/bench_attention.jsonl"
    : >"$ATTENTION"
    for round in $(seq "$rounds"); do
        ./cuda_attention_bench flash 10 >>"$ATTENTION"
        python3 bench_sdpa.py 10 >>"$ATTENTION"
    done
    python3 - "$ATTENTION" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for shape in dict.fromkeys(r["shape"] for r in rows):
    side = lambda p: [r for r in rows if r["shape"] == shape and r["impl"].startswith(p)]
    ours, theirs = side("ferrotron"), side("pytorch")
    med = lambda rs, k: statistics.median(r[k] for r in rs)
    total = lambda rs: med(rs, "fwd_ms") + med(rs, "bwd_ms")
    print(f"attention {shape} bf16 on {theirs[0]['device']}: ferrotron fwd {med(ours, 'fwd_ms'):.2f} + bwd "
          f"{med(ours, 'bwd_ms'):.2f} ms ({med(ours, 'fwd_bwd_tflops'):.0f} TFLOP/s) vs {theirs[0]['impl']} fwd "
          f"{med(theirs, 'fwd_ms'):.2f} + bwd {med(theirs, 'bwd_ms'):.2f} ms ({med(theirs, 'fwd_bwd_tflops'):.0f} "
          f"TFLOP/s): {total(ours) / total(theirs):.2f}x PyTorch's time over {len(ours)} rounds")
PY
fi
[ "$parts" = attention ] && exit 0
for round in $(seq "$rounds"); do
    for shape in "smollm-135m smollm135m 8" "llama-3.2-1b llama1b 4"; do
        read -r preset peer mbs <<<"$shape"
        dir="$OUT/$preset-$round"
        ./ferrotron train --device cuda --model "$preset" --seq 2048 --mbs "$mbs" --precision bf16 \
            --steps 8 --warmup 2 --eval-interval 0 --sample-tokens 0 --quiet --out-dir "$dir" 2>"$dir.log" ||
            { tail -5 "$dir.log"; exit 1; }
        theirs=$(python3 bench_pytorch.py --device cuda --config "$peer" --seq 2048 --mbs "$mbs" \
            --precision bf16 --steps 7 --warmup 2 2>/dev/null | tail -1)
        python3 - "$round" "$preset" "$dir/metrics.jsonl" "$theirs" >>"$RESULTS" <<'PY'
import json, statistics, sys
round_, preset, path, theirs = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
rows = [json.loads(l) for l in open(path)][1:]  # the first step warms up
print(json.dumps({"round": int(round_), "shape": preset,
    "ferrotron_tok_s": statistics.median(r["tokens_per_s"] for r in rows),
    "ferrotron_mfu": statistics.median(r["mfu"] for r in rows),
    "ferrotron_mem_mib": rows[-1]["mem_peak_measured"] / 2**20,
    "ferrotron_planned_mib": rows[-1]["mem_peak_planned"] / 2**20,
    "pytorch_tok_s": theirs["tokens_per_s"], "pytorch_mfu": theirs["mfu"],
    "pytorch_alloc_mib": theirs["gpu_peak_allocated_mib"], "pytorch_reserved_mib": theirs["gpu_peak_reserved_mib"],
    "device": theirs["device"], "torch": theirs["torch"]}))
PY
        tail -1 "$RESULTS"
    done
done
python3 - "$RESULTS" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for shape in dict.fromkeys(r["shape"] for r in rows):
    rs = [r for r in rows if r["shape"] == shape]
    med = lambda k: statistics.median(r[k] for r in rs)
    ratio = statistics.median(r["ferrotron_tok_s"] / r["pytorch_tok_s"] for r in rs)
    print(f"{shape} bf16 seq 2048 on {rs[0]['device']}: ferrotron {med('ferrotron_tok_s'):.0f} tok/s "
          f"(MFU {100*med('ferrotron_mfu'):.1f}%, {max(r['ferrotron_mem_mib'] for r in rs):.0f} MiB, planned "
          f"{rs[-1]['ferrotron_planned_mib']:.0f}) vs PyTorch {rs[0]['torch']} {med('pytorch_tok_s'):.0f} tok/s "
          f"(MFU {100*med('pytorch_mfu'):.1f}%, {max(r['pytorch_alloc_mib'] for r in rs):.0f} MiB allocated, "
          f"{max(r['pytorch_reserved_mib'] for r in rs):.0f} reserved): ratio {ratio:.2f}x over {len(rs)} rounds")
PY
