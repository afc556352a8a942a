#!/usr/bin/env python3
"""PyTorch training-step baseline for ferrotron (LlamaForCausalLM, AdamW; fp32, or bf16
autocast as the peer of `ferrotron train --precision bf16`), on the CPU or (`--device cuda`)
the GPU: there with SDPA and `torch.optim.AdamW(fused=True)`, the peer issue #14 names.

  python3 tests/reference/bench_pytorch.py --device cuda --config smollm135m --seq 2048 --mbs 8 --precision bf16
  python3 tests/reference/bench_pytorch.py --device cuda --config llama1b --seq 2048 --mbs 4 --precision bf16

  .venv/bin/python tests/reference/bench_pytorch.py --config small --steps 5
  .venv/bin/python tests/reference/bench_pytorch.py --config small --steps 5 --precision bf16
  .venv/bin/python tests/reference/bench_pytorch.py --config smollm135m --steps 2

`--precision bf16` runs the forward and the loss under `torch.autocast("cpu", torch.bfloat16)`,
PyTorch's documented CPU mixed precision (https://pytorch.org/docs/stable/amp.html#cpu-ops-that-can-autocast-to-bfloat16):
linear layers and SDPA multiply bf16 copies of the fp32 weights (oneDNN: AMX or AVX512-BF16
where the CPU has them), the parameters, gradients and AdamW states stay fp32. That is the
same recipe as ferrotron's bf16 mixed precision (fp32 master weights, bf16 products).

One training step = zero_grad, forward, cross-entropy loss (mean over B*T tokens),
backward, clip_grad_norm_(1.0), AdamW step. Random tokens; warm-up steps are untimed.
Prints a human-readable summary and, as the last line, one JSON object.

FLOP accounting (the "PaLM / nanoGPT" convention, stated so that the Rust side can
use the very same numbers):
  N_matmul  = parameters that take part in a matmul: for every layer
              q,k,v,o projections (+ biases ignored) and gate/up/down, plus lm_head
              (V*h, counted even when tied to the embedding). The embedding lookup and
              the RMSNorm weights are not matmuls and are excluded.
  dense     = 6 * N_matmul * tokens            (2 fwd + 4 bwd FLOPs per weight per token)
  attention = 12 * L * h_attn * T^2 * B        (QK^T and AV: 2*2*T^2*h_attn fwd per layer
              per sequence, x3 for fwd+bwd; h_attn = n_heads*head_dim). This counts the full
              T x T score matrix, like PaLM's 6N + 12*L*h*T per token. A causal kernel only
              needs half of it; `flops_per_step_causal` reports dense + attention/2.
  model FLOPs per step = dense + attention     (no recompute, no softmax/norm/elementwise)
MFU = (model FLOPs per step / median step time) / measured fp32 matmul peak, where the
peak is the best of several torch.mm(2048x2048, 2048x2048) runs with the same thread
count (2 * 2048^3 FLOPs each), measured before and after the timed steps (max taken).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

CONFIGS = {
    # (a) ~12M Llama (12.6M params, tied embeddings: the ferrotron-12m preset)
    "small": dict(
        vocab_size=8192,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        seq=256,
        mbs=8,
    ),
    # (b) SmolLM-135M shape
    "smollm135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
        seq=256,
        mbs=4,
    ),
}
# (c) Llama-3.2-1B shape (tied embeddings, as released)
CONFIGS["llama1b"] = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    tie_word_embeddings=True,
    seq=2048,
    mbs=4,
)
ALIASES = {"a": "small", "b": "smollm135m"}
# Dense bf16 tensor-core peak (FLOP/s) by GPU name, as the planner's table has them
# (crates/plan/src/cluster.rs): the MFU denominator on a GPU.
GPU_BF16_PEAK = {"h200": 989.4e12, "h100": 989.4e12, "a100": 312e12}


def matmul_params(cfg: LlamaConfig) -> int:
    h, L, V, I = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.intermediate_size
    hd = cfg.head_dim
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    attn = h * nq * hd + 2 * h * nkv * hd + nq * hd * h
    mlp = 3 * h * I
    return L * (attn + mlp) + V * h


def measure_matmul_peak(n: int = 2048, reps: int = 8) -> float:
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    c = torch.empty(n, n)
    torch.mm(a, b, out=c)  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="small", help="small|a|smollm135m|b")
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=None, help="override sequence length")
    ap.add_argument("--mbs", type=int, default=None, help="override micro-batch size")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="HF attention impl")
    ap.add_argument("--no-peak", action="store_true", help="skip the torch.mm peak measurement")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16: autocast")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = args.device == "cuda"

    name = ALIASES.get(args.config, args.config)
    spec = dict(CONFIGS[name])
    seq = args.seq or spec.pop("seq")
    mbs = args.mbs or spec.pop("mbs")
    spec.pop("seq", None)
    spec.pop("mbs", None)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    cfg = LlamaConfig(
        max_position_embeddings=max(seq, 2048),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        use_cache=False,
        **spec,
    )
    model = LlamaForCausalLM(cfg).to(torch.float32).to(dev)
    model.config._attn_implementation = args.attn
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    n_matmul = matmul_params(cfg)

    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            fused=cuda)
    V = cfg.vocab_size
    tokens = torch.randint(0, V, (mbs, seq + 1), device=dev)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with autocast:
            logits = model(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits.view(-1, V), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss = loss.item()
        sync()
        return loss

    print(
        f"config {name}: params {n_params/1e6:.2f}M (matmul {n_matmul/1e6:.2f}M), "
        f"B={mbs} T={seq}, threads {args.threads}, attn {args.attn}, {args.precision}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}",
        file=sys.stderr,
    )
    # Peak measured before and after the timed loop; the max is used (less noise from
    # other load on a shared machine).
    gpu_peak = None
    if cuda:
        name_ = torch.cuda.get_device_name().lower()
        gpu_peak = next((v for k, v in GPU_BF16_PEAK.items() if k in name_), None)
        torch.cuda.reset_peak_memory_stats()
    peak_before = None if args.no_peak or cuda else measure_matmul_peak()
    for i in range(args.warmup):
        t0 = time.perf_counter()
        loss = step()
        print(f"warmup {i}: {time.perf_counter()-t0:.3f}s loss {loss:.4f}", file=sys.stderr)
    times, losses = [], []
    for i in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        dt = time.perf_counter() - t0
        times.append(dt)
        losses.append(loss)
        print(f"step {i}: {dt:.3f}s loss {loss:.4f}", file=sys.stderr)

    tok = mbs * seq
    L, h_attn = cfg.num_hidden_layers, cfg.num_attention_heads * cfg.head_dim
    dense = 6 * n_matmul * tok
    attention = 12 * L * h_attn * seq * seq * mbs
    flops = dense + attention
    med = statistics.median(times)
    peak_after = None if args.no_peak or cuda else measure_matmul_peak()
    peak = None if args.no_peak or cuda else max(peak_before, peak_after)
    if cuda and gpu_peak:
        # Model FLOPs, causal-aware (the MFU), against the dense bf16 peak.
        peak = gpu_peak / 1e9
        flops = dense + attention // 2
    achieved = flops / med / 1e9
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    res = {
        "bench": "pytorch_cpu_train_step",
        "config": name,
        "params": n_params,
        "matmul_params": n_matmul,
        "batch": mbs,
        "seq": seq,
        "tokens_per_step": tok,
        "threads": args.threads,
        "attn_impl": args.attn,
        "precision": args.precision,
        "steps": args.steps,
        "warmup": args.warmup,
        "step_times_s": [round(t, 4) for t in times],
        "median_step_s": med,
        "min_step_s": min(times),  # least disturbed by other load on a shared machine
        "tokens_per_s_at_min": tok / min(times),
        "tokens_per_s": tok / med,
        "flops_per_step": flops,
        "flops_per_step_causal": dense + attention // 2,
        "achieved_gflops": achieved,
        "matmul_peak_gflops": peak,
        "matmul_peak_before_after_gflops": None if peak is None else [peak_before, peak_after],
        "mfu": None if peak is None else achieved / peak,
        "peak_rss_mib": rss_mib,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "gpu_peak_allocated_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "gpu_peak_reserved_mib": torch.cuda.max_memory_reserved() / 2**20 if cuda else None,
        "losses": [round(l, 4) for l in losses],
        "loadavg_1m": os.getloadavg()[0],
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    print(
        f"median step {med:.3f}s | {tok/med:.0f} tok/s | {flops/1e9:.1f} GFLOP/step | "
        f"{achieved:.1f} GFLOP/s"
        + ("" if peak is None else f" | mm peak {peak:.1f} GFLOP/s | MFU {achieved/peak:.1%}")
        + f" | peak RSS {rss_mib:.0f} MiB | min step {min(times):.3f}s"
        + f" | load(1m) {os.getloadavg()[0]:.2f}"
    )
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
