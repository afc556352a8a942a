"""A run with --cuda-graph against the same run without (#32 item 5): a replayed micro-batch
runs the captured kernels on the new batch's ids, so every step's loss, gradient norm,
validation loss and measured peak must be the eager run's, bit for bit (the same kernels in
the same order), and from the graph run's third step on (a resumed run's too: its first steps
place its buffers) every micro-batch of a step must be a graph's launch (`device_ops.graphs`),
not the host's launches. A resumed graph run is compared on its steps.
Usage: python3 cuda_graph_compare.py LABEL EAGER_METRICS GRAPH_METRICS GRAD_ACC"""
import json
import sys

if len(sys.argv) != 5:
    print(__doc__.rsplit("Usage: ", 1)[1])
    sys.exit(2)
label, eager_path, graph_path, grad_acc = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
KEYS = ("loss", "grad_norm", "val_loss", "mem_peak_measured", "mem_peak_planned")


def steps(path):
    return [json.loads(l) for l in open(path) if l.strip()]


eager, graph = steps(eager_path), steps(graph_path)
eager = [e for e in eager if graph and e["step"] >= graph[0]["step"]]
if [s["step"] for s in eager] != [s["step"] for s in graph] or not eager:
    print(f"error: {label}: the runs have different steps ({len(eager)} and {len(graph)} lines)")
    sys.exit(1)
# The process's third step: the first captured (trainer/cuda_graph.rs, FIRST_CAPTURED_STEP).
FIRST_CAPTURED_STEP = graph[0]["step"] + 2
bad = []
for e, g in zip(eager, graph):
    for k in KEYS:
        if e.get(k) != g.get(k):
            bad.append(f"step {e['step']} {k}: eager {e.get(k)!r}, graph {g.get(k)!r}")
    graphs = (g.get("device_ops") or {}).get("graphs", 0)
    want = grad_acc if g["step"] >= FIRST_CAPTURED_STEP else 0
    if graphs != want:
        bad.append(f"step {g['step']}: {graphs} graphs launched, {want} expected")
if bad:
    print(f"error: {label}: --cuda-graph is not the eager run:\n  " + "\n  ".join(bad))
    sys.exit(1)
later = [s for s in graph if s["step"] >= FIRST_CAPTURED_STEP + 1]
launches = [(s["device_ops"]["launches"], e["device_ops"]["launches"]) for s, e in zip(graph, eager) if s in later]
ms = [(e["step_ms"], g["step_ms"]) for e, g in zip(eager, graph) if g in later]
print(
    f"{label}: --cuda-graph gives the eager run's bits over steps {graph[0]['step']}-{graph[-1]['step']} "
    f"(loss, norm, validation loss, peak); from step {FIRST_CAPTURED_STEP} each of the {grad_acc} micro-batches "
    f"is one graph launch"
    + (
        f": launches/step {launches[0][0]} vs {launches[0][1]} eager, "
        f"step {sorted(g for _, g in ms)[len(ms) // 2]:.1f} ms vs {sorted(e for e, _ in ms)[len(ms) // 2]:.1f} ms eager (medians)"
        if later
        else ""
    )
)
