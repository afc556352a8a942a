#!/usr/bin/env python3
"""Per-op totals of a `ferrotron train --trace FILE` Chrome trace, skipping the first step
(warm-up): calls, total ms and share of kernel time, largest first. On a GPU the ops' own
times from CUDA events (the trace's "gpu" events) are used; elsewhere the ops' host spans.
    python3 scripts/trace_ops.py runs/x/trace.json [runs/y/trace.json]
With two traces, a third column block gives the second's time over the first's per op. Last, the
first trace's phases (forward, backward, optimizer) by wall time over the same steps: where they
exceed the ops' time, the step waited on something else (copies, the host)."""
import json, sys
from collections import defaultdict


def totals(path, cat=None):
    ev = json.load(open(path))["traceEvents"]
    phases = [e for e in ev if e.get("cat") == "phase"]
    # Events before the end of step 1's last phase are warm-up.
    first = min((e["args"]["step"] for e in phases), default=0)
    cut = max((e["ts"] + e["dur"] for e in phases if e["args"]["step"] == first), default=0)
    t = defaultdict(lambda: [0, 0.0])
    cat = cat or ("gpu" if any(e.get("cat") == "gpu" for e in ev) else "kernel")
    for e in ev:
        if e.get("ph") == "X" and e.get("cat") == cat and e["ts"] >= cut:
            t[e["name"]][0] += 1
            t[e["name"]][1] += e["dur"] / 1e3
    return t


runs = [totals(p) for p in sys.argv[1:]]
base = runs[0]
total = sum(v[1] for v in base.values())
names = sorted(set().union(*runs), key=lambda n: -base.get(n, [0, 0.0])[1])
print(f"{'op':28} {'calls':>6} {'ms':>9} {'share':>6}" + "".join(f" {'ms':>9} {'ratio':>6}" for _ in runs[1:]))
for n in names:
    c, ms = base.get(n, [0, 0.0])
    row = f"{n:28} {c:6} {ms:9.1f} {100 * ms / total:5.1f}%"
    for r in runs[1:]:
        ms2 = r.get(n, [0, 0.0])[1]
        row += f" {ms2:9.1f} {ms2 / ms if ms else float('nan'):6.2f}"
    print(row)
print(f"{'total':28} {'':6} {total:9.1f}" + "".join(f" {sum(v[1] for v in r.values()):9.1f} {sum(v[1] for v in r.values()) / total:6.2f}" for r in runs[1:]))
phases = totals(sys.argv[1], "phase")
print("phases (wall ms, same steps): " + ", ".join(f"{n} {phases[n][1]:.1f}" for n in ("forward", "backward", "optimizer", "step") if n in phases))
