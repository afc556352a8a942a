"""What a GPU training run asked of the driver per step (issue #32's before and after, from
the trainer's `device_ops` metrics: crates/engine/src/kernels/device_ops.rs): blocking host
synchronisations by site and launches (kernels, cuBLASLt calls, device copies, captured
graphs: `--cuda-graph` replays a micro-batch as one). The first
step is left out of the figure (it allocates the gradients and grows scratch); the later
steps' median is printed, with their range when they differ. With --max-syncs N it fails
when that median is above N: the CUDA emulator's CI stage holds the counts it measured, so a
change that adds a round trip fails CI, and issue #32 lowers the bound as it removes them.
Also printed: the host->device writes and memsets, and the synchronous copies and memsets
(either way), which CUDA runs on the legacy default stream and a captured step (CUDA graphs)
cannot hold; --max-legacy N fails when their median is above N.
Usage: python3 cuda_ops.py LABEL METRICS_JSONL [--max-syncs N] [--max-legacy N]"""
import json
import statistics
import sys

label, path = sys.argv[1:3]
flags = dict(zip(sys.argv[3::2], sys.argv[4::2]))
unknown = set(flags) - {"--max-syncs", "--max-legacy"}
if unknown or len(sys.argv[3:]) % 2:
    print(f"error: {label}: usage: cuda_ops.py LABEL METRICS_JSONL [--max-syncs N] [--max-legacy N]")
    sys.exit(2)
max_syncs = int(flags["--max-syncs"]) if "--max-syncs" in flags else None
max_legacy = int(flags["--max-legacy"]) if "--max-legacy" in flags else None
steps = [json.loads(l) for l in open(path)]
ops = [s.get("device_ops") for s in steps]
if not steps or any(o is None for o in ops):
    print(f"error: {label}: no device_ops in {path} (not a GPU run, or the counts are gone)")
    sys.exit(1)
later = ops[1:] or ops


def per_step(get):
    xs = [get(o) for o in later]
    m = statistics.median(xs)
    m = int(m) if m == int(m) else m
    return f"{m}" if min(xs) == max(xs) else f"{m} [{min(xs)}..{max(xs)}]"


sites = sorted({k for o in later for k in o["sync_sites"]})
by_site = ", ".join(f"{k} {per_step(lambda o: o['sync_sites'].get(k, 0))}" for k in sites)
print(
    f"{label}: host syncs/step {per_step(lambda o: o['host_syncs'])} ({by_site}); "
    f"launches/step {per_step(lambda o: o['launches'])} (kernels {per_step(lambda o: o['kernels'])}, "
    f"cuBLASLt {per_step(lambda o: o['blas'])}, device copies {per_step(lambda o: o['copies'])}, "
    f"captured graphs {per_step(lambda o: o.get('graphs', 0))}); "
    f"host->device writes/step {per_step(lambda o: o['writes'])}; "
    f"on the legacy stream (synchronous copies and memsets) {per_step(lambda o: o.get('legacy', 0))}; "
    f"over steps {steps[1]['step'] if len(steps) > 1 else steps[0]['step']}-{steps[-1]['step']}, "
    f"first step {ops[0]['host_syncs']} syncs, {ops[0]['launches']} launches"
)
syncs = statistics.median(o["host_syncs"] for o in later)
if max_syncs is not None and syncs > max_syncs:
    print(f"error: {label}: {syncs:g} host synchronisations per step, more than the {max_syncs} held")
    sys.exit(1)
legacy = statistics.median(o.get("legacy", 0) for o in later)
if max_legacy is not None and legacy > max_legacy:
    print(f"error: {label}: {legacy:g} copies or memsets per step on the legacy stream, more than the {max_legacy} held")
    sys.exit(1)
