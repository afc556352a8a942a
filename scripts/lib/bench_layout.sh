# Sourced by the layout benchmarks (scripts/bench_cp.sh, scripts/bench_ep.sh): `layout NAME
# COMMAND...` runs one training command with --out-dir $BENCH_OUT/NAME and prints
#   NAME | median tok/s | plan's activations | rank 0 planned:measured MiB, worst rank | A2A | losses
# where A2A is the last step's all-to-all MB sent, measured:planned (expert parallelism; "-"
# without it).
layout() {
  local name="$1"; shift
  local out="$BENCH_OUT/$name"
  rm -rf "$out"
  "$@" --out-dir "$out" > "$out.log" 2>&1
  local done acts rest
  done=$(grep "^done:" "$out.log" | sed -E 's/.*median ([0-9]+) tok\/s.*/\1/')
  acts=$(grep -o "activations [0-9.]*" "$out.log" | head -1)
  rest=$(python3 - "$out/metrics.jsonl" <<'PY' 2>/dev/null
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
last = rows[-1]
rm = last.get("rank_mem") or [{"rank": 0, "mem_peak_planned": last["mem_peak_planned"],
                               "mem_peak_measured": last["mem_peak_measured"]}]
worst = max(abs(r["mem_peak_measured"] / r["mem_peak_planned"] - 1) for r in rm)
r = rm[0]
a2a = last.get("ep_comm_bytes")
a2a = "-" if a2a is None else f"{a2a / 1e6:.3f}:{last['ep_comm_bytes_planned'] / 1e6:.3f}"
mem = f"{r['mem_peak_planned'] / 2**20:.2f}:{r['mem_peak_measured'] / 2**20:.2f}, worst {worst * 100:.3f}%"
print(mem, "|", a2a, "|", " ".join(f"{x['loss']:.7f}" for x in rows))
PY
)
  echo "$name | $done | $acts | $rest"
}
