"""PyTorch's causal attention alone on the GPU, the peer of ferrotron's
`crates/engine/examples/cuda_attention_bench.rs` (same shapes, same FLOP count): SDPA with the
flash backend, bf16, q/k/v laid out [B, T, H, D] and viewed [B, H, T, D] as transformers'
Llama does, the kv heads repeated for the query heads (transformers' `repeat_kv`) outside the
timed region. One JSON line per shape, median milliseconds of `reps` after a warm-up.
    python3 bench_sdpa.py [reps]      (on the GPU machine: scripts/bench_gpu.sh)"""
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [("smollm-135m", 8, 2048, 9, 3, 64), ("llama-3.2-1b", 4, 2048, 32, 8, 64),
          ("head-dim-128", 4, 2048, 16, 8, 128)]
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 10


def timed(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


for name, b, t, h, kv, d in SHAPES:
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(b, t, h, d, device=dev, dtype=dt).transpose(1, 2).requires_grad_()
    k = torch.randn(b, t, kv, d, device=dev, dtype=dt).transpose(1, 2)
    v = torch.randn(b, t, kv, d, device=dev, dtype=dt).transpose(1, 2)
    k = k.repeat_interleave(h // kv, dim=1).requires_grad_()
    v = v.repeat_interleave(h // kv, dim=1).requires_grad_()
    d_o = torch.randn(b, h, t, d, device=dev, dtype=dt)
    fwd, bwd = [], []
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for rep in range(reps + 1):
            out = {}
            f = timed(lambda: out.setdefault("o", F.scaled_dot_product_attention(q, k, v, is_causal=True)))
            g = timed(lambda: out["o"].backward(d_o))
            q.grad = k.grad = v.grad = None
            if rep:
                fwd.append(f)
                bwd.append(g)
    fm, bm = statistics.median(fwd), statistics.median(bwd)
    flops = 4.0 * d * b * h * t * (t + 1) / 2
    print(json.dumps({"impl": f"pytorch-{torch.__version__}-sdpa-flash", "shape": name, "b": b, "t": t,
                      "heads": h, "kv_heads": kv, "head_dim": d, "fwd_ms": round(fm, 3), "bwd_ms": round(bm, 3),
                      "fwd_tflops": round(flops / fm / 1e9, 1),
                      "fwd_bwd_tflops": round(3.5 * flops / (fm + bm) / 1e9, 1),
                      "device": torch.cuda.get_device_name()}))
