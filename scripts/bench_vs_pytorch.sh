#!/usr/bin/env bash
# ferrotron against its PyTorch peer, side by side: rounds of interleaved runs (ferrotron, then
# PyTorch, for every config × precision), then per config × precision the median tokens/s of
# each side over the rounds, the median of the rounds' ratios, and the largest peak RSS.
#   bash scripts/bench_vs_pytorch.sh [rounds] [small|smollm|all] [precisions, e.g. "fp32 bf16"]
#   (also: bash scripts/bench_train.sh pytorch [rounds] [config] [precisions])
# Each side times its own steps and drops its warm-up (ferrotron: bench_train.sh; PyTorch:
# tests/reference/bench_pytorch.py, fp32 or bf16 autocast, its venv made by
# tests/reference/setup_venv.sh when missing). Ratios are taken within a round: on a shared
# machine the load moves absolute numbers between rounds far more than between two neighbouring
# runs. Raw JSON lines are kept in $RESULTS (default: a temporary file, path printed).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
which=${2:-all}
precisions=${3:-fp32 bf16}
VENV=${VENV:-$PWD/.venv}
[ -x "$VENV/bin/python" ] || VENV=$VENV bash tests/reference/setup_venv.sh
RESULTS=${RESULTS:-$(mktemp --suffix=.jsonl)}
: >"$RESULTS"

# The machine, as the table needs it: model name and the flags that pick the kernels.
lscpu | sed -n 's/^Model name: *//p' | head -1 | sed 's/^/cpu: /'
echo "cpu flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' |
  grep -E '^(avx2|fma|avx512f|avx512bw|avx512vl|avx512_bf16|avx512_fp16|amx_bf16|amx_tile|amx_int8)$' | tr '\n' ' ')"
echo "cores: $(nproc), threads per side: 2, FERROTRON_GEMM=${FERROTRON_GEMM:-auto}," \
  "FERROTRON_SIMD=${FERROTRON_SIMD:-auto}, ferrotron: ${FERROTRON_BIN:-this tree ($(git rev-parse --short HEAD))}"

configs=()
case $which in small | all) configs+=(small) ;; esac
case $which in smollm | all) configs+=(smollm) ;; esac
for round in $(seq "$rounds"); do
  for config in "${configs[@]}"; do
    # ferrotron: bench_train.sh's step counts (first step dropped); PyTorch: the same number of
    # timed steps after its two untimed warm-up steps.
    case $config in
      small) steps=10 peer=small ;;
      smollm) steps=5 peer=smollm135m ;;
    esac
    for precision in $precisions; do
      load=$(cut -d' ' -f1 /proc/loadavg)
      ours=$(bash scripts/bench_train.sh "$config" "$steps" "$precision" | tail -1)
      theirs=$("$VENV/bin/python" tests/reference/bench_pytorch.py --config "$peer" \
        --steps $((steps - 1)) --warmup 2 --precision "$precision" --no-peak 2>/dev/null | tail -1)
      python3 - "$round" "$load" "$ours" "$theirs" >>"$RESULTS" <<'PY'
import json, sys
round_, load, ours, theirs = sys.argv[1], float(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
print(json.dumps({"round": int(round_), "load_1m": load, "config": ours["config"], "precision": ours["precision"],
                  "gemm": ours["gemm"], "ferrotron_tok_s": ours["tokens_per_s"], "pytorch_tok_s": theirs["tokens_per_s"],
                  "ferrotron_rss_mib": ours["peak_rss_mib"], "pytorch_rss_mib": theirs["peak_rss_mib"],
                  "torch": theirs["torch"]}))
PY
      tail -1 "$RESULTS"
    done
  done
done

python3 - "$RESULTS" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"results: {sys.argv[1]}")
print("| config | precision | rounds | ferrotron tok/s | PyTorch tok/s | ratio | ferrotron peak RSS | PyTorch peak RSS | RSS ratio |")
print("|---|---|---|---|---|---|---|---|---|")
# Peak RSS: the median over the rounds, the largest in brackets (a run's own peak can jump).
for key in dict.fromkeys((r["config"], r["precision"]) for r in rows):
    rs = [r for r in rows if (r["config"], r["precision"]) == key]
    ours = statistics.median(r["ferrotron_tok_s"] for r in rs)
    theirs = statistics.median(r["pytorch_tok_s"] for r in rs)
    ratio = statistics.median(r["ferrotron_tok_s"] / r["pytorch_tok_s"] for r in rs)
    rss = {side: [r[f"{side}_rss_mib"] for r in rs] for side in ("ferrotron", "pytorch")}
    med = {side: statistics.median(v) for side, v in rss.items()}
    cell = {side: f"{med[side]:,.0f} ({max(v):,.0f}) MiB" for side, v in rss.items()}
    print(f"| {key[0]} | {key[1]} | {len(rs)} | {ours:,.0f} | {theirs:,.0f} | {ratio:.2f}× | {cell['ferrotron']} | {cell['pytorch']} | {med['ferrotron'] / med['pytorch']:.2f}× |")
# bf16 over fp32 on our side, within each round (the issue's "bf16 ≥ 1.5× our fp32").
for config in dict.fromkeys(r["config"] for r in rows):
    pairs = []
    for rnd in sorted({r["round"] for r in rows}):
        by = {r["precision"]: r["ferrotron_tok_s"] for r in rows if r["config"] == config and r["round"] == rnd}
        if "fp32" in by and "bf16" in by:
            pairs.append(by["bf16"] / by["fp32"])
    if pairs:
        print(f"{config}: ferrotron bf16 / fp32 per round {', '.join(f'{p:.2f}' for p in pairs)} (median {statistics.median(pairs):.2f}×)")
PY
