#!/usr/bin/env python3
"""Loss curves of runs/curves/<precision>/metrics.jsonl as one SVG, and the band statistics
(largest |loss - fp32 loss| over a 10-step running mean) printed as a Markdown table."""
import json, sys
from pathlib import Path

root, out = Path(sys.argv[1]), Path(sys.argv[2])
runs = {}
for p in ["fp32", "bf16", "fp16", "fp8"]:
    f = root / p / "metrics.jsonl"
    if f.exists():
        runs[p] = [json.loads(l)["loss"] for l in f.open()]

def smooth(xs, w=10):
    return [sum(xs[max(0, i - w + 1):i + 1]) / len(xs[max(0, i - w + 1):i + 1]) for i in range(len(xs))]

W, H, L, B = 720, 400, 60, 40
n = max(len(v) for v in runs.values())
lo = min(min(v) for v in runs.values()); hi = max(max(v) for v in runs.values())
x = lambda i: L + (W - L - 20) * i / max(1, n - 1)
y = lambda v: 20 + (H - B - 20) * (hi - v) / (hi - lo)
colors = {"fp32": "#222", "bf16": "#1f77b4", "fp16": "#2ca02c", "fp8": "#d62728"}
parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
         f'<rect width="{W}" height="{H}" fill="white"/>',
         f'<line x1="{L}" y1="{H-B}" x2="{W-20}" y2="{H-B}" stroke="#888"/>',
         f'<line x1="{L}" y1="20" x2="{L}" y2="{H-B}" stroke="#888"/>',
         f'<text x="{W/2}" y="{H-8}" text-anchor="middle">step</text>',
         f'<text x="14" y="{H/2}" transform="rotate(-90 14 {H/2})" text-anchor="middle">training loss (10-step mean)</text>']
for t in range(5):
    v = lo + (hi - lo) * t / 4
    parts.append(f'<text x="{L-6}" y="{y(v)+4:.1f}" text-anchor="end">{v:.2f}</text>')
for t in range(5):
    i = (n - 1) * t // 4
    parts.append(f'<text x="{x(i):.1f}" y="{H-B+16}" text-anchor="middle">{i+1}</text>')
for k, (p, v) in enumerate(runs.items()):
    s = smooth(v)
    pts = " ".join(f"{x(i):.1f},{y(u):.1f}" for i, u in enumerate(s))
    parts.append(f'<polyline fill="none" stroke="{colors[p]}" stroke-width="1.5" points="{pts}"/>')
    parts.append(f'<text x="{W-120}" y="{40+16*k}" fill="{colors[p]}">{p}</text>')
parts.append("</svg>")
out.write_text("\n".join(parts) + "\n")
ref = smooth(runs["fp32"])
print("| precision | final loss (10-step mean) | max abs gap to fp32 (10-step means) | mean gap |")
print("|---|---|---|---|")
for p, v in runs.items():
    s = smooth(v)
    gaps = [abs(a - b) for a, b in zip(s, ref)][10:]
    print(f"| {p} | {s[-1]:.4f} | {max(gaps):.4f} | {sum(gaps)/len(gaps):.4f} |")
