"""TensorBoard's own reader against `ferrotron train --tensorboard`: every scalar of the event
files, read by tensorboard's EventAccumulator, equals the value of `metrics.jsonl` it came from
(as a float32, TensorBoard's simple_value), and every number of metrics.jsonl is there.

    python3 -m venv /tmp/tb && /tmp/tb/bin/pip install tensorboard
    ./target/release/ferrotron train --steps 3 --dp 2 --mbs 2 --eval-interval 2 \
        --out-dir runs/tb3 --tensorboard runs/tb3/tb
    /tmp/tb/bin/python tests/reference/tensorboard_check.py runs/tb3/metrics.jsonl runs/tb3/tb

The tag of a number is its key in the JSON line: `rank_mem/1/mem_peak_measured` inside a list
of objects, `pp_bubble/0` inside a list of numbers; booleans are 0/1, text is left out; `step`
is the event's step. `skipped` is on every step (a JSON line carries it only when true) and
`skipped_steps` counts them so far (crates/train/src/tensorboard.rs). Prints one line per tag
and exits 1 on any difference. Not run by CI (no tensorboard there); the Rust reader of
crates/train/tests/tensorboard.rs is.
"""

import json
import struct
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def flatten(prefix, v, out):
    if isinstance(v, bool):
        out[prefix] = float(v)
    elif isinstance(v, (int, float)):
        out[prefix] = float(v)
    elif isinstance(v, list):
        for i, x in enumerate(v):
            flatten(f"{prefix}/{i}", x, out)
    elif isinstance(v, dict):
        for k, x in v.items():
            flatten(f"{prefix}/{k}" if prefix else k, x, out)


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def main(metrics_path, logdir):
    expected = {}  # tag -> [(step, value)]
    skipped = 0
    with open(metrics_path) as f:
        for line in f:
            m = json.loads(line)
            step = m.pop("step")
            was_skipped = bool(m.pop("skipped", False))
            skipped += was_skipped
            flat = {}
            flatten("", m, flat)
            flat["skipped"] = float(was_skipped)
            flat["skipped_steps"] = float(skipped)
            for tag, x in flat.items():
                expected.setdefault(tag, []).append((step, f32(x)))

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    tags = sorted(acc.Tags()["scalars"])
    bad = 0
    for tag in sorted(set(tags) | set(expected)):
        got = [(e.step, e.value) for e in acc.Scalars(tag)] if tag in tags else []
        want = expected.get(tag, [])
        ok = got == want
        bad += not ok
        print(f"{'ok  ' if ok else 'DIFF'} {tag}: {len(got)} steps" + ("" if ok else f" tensorboard {got} metrics.jsonl {want}"))
    steps = len({s for v in expected.values() for s, _ in v})
    print(f"{len(tags)} scalar tags over {steps} steps read by TensorBoard's EventAccumulator; {bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: tensorboard_check.py METRICS_JSONL TENSORBOARD_DIR")
    sys.exit(main(sys.argv[1], sys.argv[2]))
