#!/usr/bin/env python3
"""Golden FP8 casts from PyTorch for `crates/engine/tests/fp8.rs`.

Writes `crates/engine/tests/fixtures_fp8.json`:

  {
    "torch": "<torch.__version__>",
    "inputs":   [u32, ...],   # f32 inputs as their IEEE-754 bit patterns
    "e4m3fn":   [u8, ...],    # x.to(torch.float8_e4m3fn).view(torch.uint8), one per input
    "e5m2":     [u8, ...],    # x.to(torch.float8_e5m2).view(torch.uint8),   one per input
    "e4m3fn_decode": [u32; 256],  # code b -> f32 bits of torch's fp8 -> float32 cast
    "e5m2_decode":   [u32; 256]
  }

The inputs are: every finite value of both formats (so decode is checked too), the
midpoints between neighbouring values (ties: round-half-to-even) and the f32 values one ulp
either side of each midpoint, the subnormal ranges, random normals at several scales, and a
handful of values beyond each format's range plus ±inf and NaN.

Out-of-range behaviour of torch (CPU, checked with torch 2.15): the cast to
float8_e4m3fn SATURATES finite values beyond 448 to ±448 and also maps ±inf to ±448; the cast
to float8_e5m2 does NOT saturate: values that round past 57344 become ±inf.  ferrotron's
`encode` saturates finite values for both formats (Transformer Engine's behaviour for scaled
casts) and keeps infinities non-finite (E4M3: NaN, E5M2: inf), so the Rust test compares
bit-exactly only where both conventions agree and asserts the documented differences
elsewhere.

Regenerate:  .venv/bin/python tests/reference/fp8_reference.py
The output is deterministic (fixed seed, CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "crates" / "engine" / "tests" / "fixtures_fp8.json"

FORMATS = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def f32_bits(t: torch.Tensor) -> list[int]:
    return [b & 0xFFFFFFFF for b in t.to(torch.float32).contiguous().view(torch.int32).tolist()]


def finite_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of an fp8 dtype, as f32, sorted and without -0 duplicates."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(torch.float32)
    v = v[torch.isfinite(v)]
    return torch.unique(v)  # sorted; -0 and +0 collapse to one value


def main() -> None:
    g = torch.Generator().manual_seed(20220912)  # the FP8 paper's arXiv date
    parts: list[torch.Tensor] = []

    for dtype in FORMATS.values():
        vals = finite_values(dtype)
        parts.append(vals)
        mids = ((vals[1:].double() + vals[:-1].double()) / 2).to(torch.float32)  # exact
        parts += [
            mids,
            torch.nextafter(mids, torch.full_like(mids, float("inf"))),
            torch.nextafter(mids, torch.full_like(mids, float("-inf"))),
        ]

    # Subnormal ranges (E4M3: below 2^-6, quantum 2^-9; E5M2: below 2^-14, quantum 2^-16) and
    # values far below the smallest subnormal.
    parts.append(torch.rand(80, generator=g) * 2.0**-6 * 2 - 2.0**-6)
    parts.append(torch.rand(80, generator=g) * 2.0**-14 * 2 - 2.0**-14)
    parts.append(torch.tensor([2.0**-10, 2.0**-11, 3 * 2.0**-11, 2.0**-17, 2.0**-18, 1e-30, 1e-40]))
    # Random normals at several scales.
    for scale in [1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0, 1e3, 1e4]:
        parts.append(torch.randn(60, generator=g) * scale)
    # Beyond range, infinities, NaN, signed zeros.
    parts.append(
        torch.tensor(
            [449.0, 464.0, 465.0, 480.0, 1e3, 1e5, 57344.0, 60000.0, 61439.0, 61440.0, 65536.0,
             1e6, 3e38, float("inf"), 0.0, -0.0, float("nan")]
        )
    )
    parts[-1] = torch.cat([parts[-1], -parts[-1]])

    x = torch.cat([p.to(torch.float32).flatten() for p in parts])
    out = {
        "torch": torch.__version__,
        "inputs": f32_bits(x),
    }
    for name, dtype in FORMATS.items():
        out[name] = x.to(dtype).view(torch.uint8).tolist()
    for name, dtype in FORMATS.items():
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        out[name + "_decode"] = f32_bits(codes.view(dtype).to(torch.float32))
    OUT.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(json.dumps({"wrote": str(OUT.relative_to(REPO)), "inputs": len(out["inputs"])}))


if __name__ == "__main__":
    main()
