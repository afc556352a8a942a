#!/usr/bin/env python3
"""Loss curves of runs/curves/<precision>/metrics.jsonl as one SVG (top: 10-step mean training
loss; bottom: its gap to fp32 with the stated bands), and the band statistics (largest and mean
|loss - fp32 loss| of the 10-step means, after the first 10 steps) as a Markdown table.
    python3 scripts/plot_curves.py runs/curves docs/precision_loss_curves.svg"""
import json, sys
from pathlib import Path

root, out = Path(sys.argv[1]), Path(sys.argv[2])
BANDS = {"bf16": 0.1, "bf16-sr": 0.1, "fp16": 0.1, "fp8": 0.15}  # stated in docs/BENCHMARKS.md, tested short
COLORS = {"fp32": "#222", "bf16": "#1f77b4", "bf16-sr": "#9467bd", "fp16": "#2ca02c", "fp8": "#d62728"}
runs = {}
for p in COLORS:
    f = root / p / "metrics.jsonl"
    if f.exists():
        runs[p] = [json.loads(l)["loss"] for l in f.open()]


def smooth(xs, w=10):
    return [sum(xs[max(0, i - w + 1):i + 1]) / len(xs[max(0, i - w + 1):i + 1]) for i in range(len(xs))]


means = {p: smooth(v) for p, v in runs.items()}
gaps = {p: [a - b for a, b in zip(s, means["fp32"])] for p, s in means.items() if p != "fp32"}
n = max(len(v) for v in runs.values())
W, L, R = 760, 70, 110
panels = [  # (top, height, lo, hi, y label)
    (20, 300, min(min(v) for v in means.values()), max(max(v) for v in means.values()),
     "training loss (10-step mean)"),
    (370, 170, -0.16, 0.16, "gap to fp32 (nats)"),
]
H = 590
x = lambda i: L + (W - L - R) * i / max(1, n - 1)
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
       f'<rect width="{W}" height="{H}" fill="white"/>']
for k, (top, h, lo, hi, label) in enumerate(panels):
    y = lambda v, top=top, h=h, lo=lo, hi=hi: top + h * (hi - v) / (hi - lo)
    svg += [f'<rect x="{L}" y="{top}" width="{W - L - R}" height="{h}" fill="none" stroke="#888"/>',
            f'<text x="16" y="{top + h / 2}" transform="rotate(-90 16 {top + h / 2})" text-anchor="middle">{label}</text>']
    for t in range(5):
        v = lo + (hi - lo) * t / 4
        svg.append(f'<text x="{L - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    if k == 0:
        series = means.items()
    else:
        series = gaps.items()
        svg.append(f'<line x1="{L}" y1="{y(0):.1f}" x2="{W - R}" y2="{y(0):.1f}" stroke="#222"/>')
        for b, dash in [(0.1, "4 3"), (0.15, "1 3")]:
            for v in (b, -b):
                svg.append(f'<line x1="{L}" y1="{y(v):.1f}" x2="{W - R}" y2="{y(v):.1f}" stroke="#999" stroke-dasharray="{dash}"/>')
            svg.append(f'<text x="{W - R + 6}" y="{y(b) + 4:.1f}" fill="#666">±{b} band</text>')
    for p, s in series:
        pts = " ".join(f"{x(i):.1f},{y(u):.1f}" for i, u in enumerate(s))
        svg.append(f'<polyline fill="none" stroke="{COLORS[p]}" stroke-width="1.4" points="{pts}"/>')
for t in range(5):
    i = (n - 1) * t // 4
    svg.append(f'<text x="{x(i):.1f}" y="{H - 32}" text-anchor="middle">{i + 1}</text>')
svg.append(f'<text x="{L + (W - L - R) / 2}" y="{H - 12}" text-anchor="middle">step</text>')
for k, p in enumerate(runs):
    svg.append(f'<text x="{W - R + 6}" y="{40 + 16 * k}" fill="{COLORS[p]}">{p}</text>')
svg.append("</svg>")
out.write_text("\n".join(svg) + "\n")
print("| precision | final loss (10-step mean) | largest gap to fp32 | mean gap | band |")
print("|---|---|---|---|---|")
for p, s in means.items():
    g = [abs(v) for v in gaps.get(p, [0.0] * len(s))][10:]
    band = f"±{BANDS[p]}" if p in BANDS else "reference"
    print(f"| {p} | {s[-1]:.4f} | {max(g):.4f} | {sum(g) / len(g):.4f} | {band} |")
