#!/usr/bin/env python3
"""bf16 mixed-precision references for ferrotron, from the committed fp32 fixtures.

For each fixture in tests/fixtures/{tiny-tied,tiny-gqa,tiny-qwen2}/ this script loads the
committed params.safetensors, io.safetensors (input_ids, targets) and config.json. It does
not regenerate them. It runs two bf16 references with HF transformers on CPU and writes:

  bf16.safetensors  F32 tensors:
      autocast.logits [B,T,V], autocast.loss [1], autocast.grad.<param name>
      pure_bf16.logits,        pure_bf16.loss,    pure_bf16.grad.<param name>
  bf16.json         errors of each reference against the fp32 golden (io.safetensors
                    logits/loss, grads.safetensors), plus versions and notes

The references:

  A. "autocast": the standard PyTorch mixed-precision recipe. The fp32 model (fp32
     weights, which act as the master weights) runs forward under
     torch.autocast("cpu", dtype=torch.bfloat16). Linear layers and matmuls take
     bf16-cast inputs and weights and produce bf16 outputs (accumulation is f32 inside
     the kernel). Ops outside the autocast list stay in fp32: embedding lookup, the
     residual adds (fp32 + bf16 promotes to fp32, so the residual stream stays fp32), and
     HF's RMSNorm and softmax, which upcast to fp32 themselves. The bf16 logits are
     upcast to fp32, and the loss is F.cross_entropy(ignore_index=-100, mean) in fp32.
     The recorded grads are the fp32 .grad of the fp32 parameters.
  B. "pure_bf16": model.to(torch.bfloat16). Weights, activations (residual stream
     included) and gradients are all stored in bf16. Each PyTorch op computes in f32
     internally and rounds its output to bf16. HF RMSNorm and softmax compute in fp32
     and cast back to bf16. The logits are upcast to fp32 before the same fp32 loss. The
     bf16 grads are upcast to fp32 to be stored. There is no fp32 master copy.

bf16.json also has "emulated_spread". It holds error statistics, and no tensors, over
--spread (default 40) engine-like emulations in fp32 math with bf16 rounding at module
boundaries (see run_emulated). They show how much the error of a valid bf16 implementation
varies with its rounding pattern, and the tolerances in BF16.md are based on that spread.

ferrotron's bf16 mode (bf16 storage for params, activations and grads, f32 math inside
each kernel, f32 logits and loss, fp32 master weights) sits between the two: its storage
is like B, and its logits and loss are like A or better. See tests/reference/BF16.md for
the measured errors and the tolerances proposed for the Rust tests.

Run with: .venv/bin/python tests/reference/llama_autocast.py [--only tiny-gqa]
Output is deterministic for a given machine: one thread, fixed inputs, seeded generators.
bf16 CPU GEMMs go through oneDNN, whose kernel choice depends on the CPU's ISA (AVX512-BF16,
AMX, ...). Other CPUs can therefore produce slightly different bits. The error
magnitudes in bf16.json are what matter, not the bits.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Import-safe: llama_reference only parses arguments inside main().
from llama_reference import CONFIGS, FIXTURES, forward, loss_fn, make_model  # noqa: E402

PREFIXES = ("autocast", "pure_bf16")
# Config keys that must agree between CONFIGS and the committed config.json.
CHECK_KEYS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "tie_word_embeddings", "rms_norm_eps",
    "rope_parameters",
)


def load_model(name: str, fixdir: Path, params: dict[str, torch.Tensor]):
    model = make_model(CONFIGS[name])
    with open(fixdir / "config.json") as f:
        committed = json.load(f)
    mine = model.config.to_dict()
    for k in CHECK_KEYS:
        assert committed.get(k) == mine.get(k), (name, k, committed.get(k), mine.get(k))
    names = [n for n, _ in model.named_parameters()]
    assert set(names) == set(params), (name, set(names) ^ set(params))
    with torch.no_grad():
        for n, p in model.named_parameters():
            assert p.shape == params[n].shape, (n, p.shape, params[n].shape)
            p.copy_(params[n])
    model.train()  # dropout is 0 anyway
    return model


def run_fp32(model, input_ids, targets):
    model.zero_grad(set_to_none=True)
    logits = forward(model, input_ids)
    loss = loss_fn(logits, targets)
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
    return logits.detach().float(), loss.detach().float(), grads


def run_autocast(model, input_ids, targets):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = forward(model, input_ids)
    assert logits.dtype == torch.bfloat16, logits.dtype
    logits = logits.float()
    loss = loss_fn(logits, targets)  # fp32, outside autocast
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, n
        grads[n] = p.grad.detach().clone()
    return logits.detach(), loss.detach(), grads


def run_pure_bf16(model, input_ids, targets):
    model = model.to(torch.bfloat16)
    model.zero_grad(set_to_none=True)
    logits = forward(model, input_ids)
    assert logits.dtype == torch.bfloat16, logits.dtype
    logits = logits.float()
    loss = loss_fn(logits, targets)
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        assert p.grad.dtype == torch.bfloat16, n
        grads[n] = p.grad.detach().float()
    return logits.detach(), loss.detach(), grads


class _RoundBF16(torch.autograd.Function):
    """Round to bf16 and back (RNE) in forward, and round the incoming gradient in backward."""

    @staticmethod
    def forward(ctx, x):
        return x.bfloat16().float()

    @staticmethod
    def backward(ctx, g):
        return g.bfloat16().float()


def _round_output(_mod, _inp, out):
    if isinstance(out, tuple):
        return (_RoundBF16.apply(out[0]),) + tuple(out[1:])
    return _RoundBF16.apply(out)


def _rounded(mod) -> bool:
    cls = type(mod).__name__  # exact for Linear/Embedding: LlamaRotaryEmbedding is not rounded
    return cls in ("Linear", "Embedding") or cls.endswith(("RMSNorm", "Attention", "MLP", "DecoderLayer"))


def run_emulated(model, input_ids, targets, sample: int):
    """Engine-like bf16 emulation in fp32 math, used only to measure the spread of bf16 errors.

    The weights are rounded to bf16. The outputs of the Embedding, Linear, RMSNorm,
    Attention, MLP and DecoderLayer modules (and the gradients flowing back into them) are
    rounded to bf16. The logits stay fp32 and the param grads are rounded to bf16. Sample 0
    does exactly this. A sample s > 0 is a different but equally valid rounding pattern: it
    rounds at a random 80% of those points (the engine fuses differently than HF's module
    split), and it first scales each weight by (1 + 2^-10 (u - 0.5)), with u ~ U[0, 1),
    which changes which way about a quarter of the weights round. That perturbation is
    about 1/4 of bf16's rounding noise, so the spread is slightly conservative.
    """
    rng = torch.Generator().manual_seed(1000 + sample)
    with torch.no_grad():
        for p in model.parameters():
            if sample > 0:
                p.mul_(1 + 2.0**-10 * (torch.rand(p.shape, generator=rng) - 0.5))
            p.copy_(p.bfloat16().float())
    for mod in model.modules():
        if _rounded(mod):
            if sample == 0 or torch.rand((), generator=rng).item() < 0.8:
                mod.register_forward_hook(_round_output)
    model.zero_grad(set_to_none=True)
    logits = forward(model, input_ids)
    loss = loss_fn(logits, targets)
    loss.backward()
    grads = {n: p.grad.detach().bfloat16().float() for n, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads


def rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm()).item()


def cosine(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double().flatten(), ref.double().flatten()
    return (a @ ref / (a.norm() * ref.norm())).item()


def compare(logits, loss, grads, gold_io, gold_grads) -> dict:
    g_rel = {n: rel_l2(grads[n], gold_grads[n]) for n in sorted(gold_grads)}
    g_cos = {n: cosine(grads[n], gold_grads[n]) for n in sorted(gold_grads)}
    worst = max(g_rel, key=g_rel.get)
    return {
        "logits_rel_l2": rel_l2(logits, gold_io["logits"]),
        "logits_max_abs": (logits.double() - gold_io["logits"].double()).abs().max().item(),
        "loss": loss.item(),
        "loss_abs": abs(loss.item() - gold_io["loss"].item()),
        "grads_rel_l2": g_rel,
        "grads_rel_l2_max": g_rel[worst],
        "grads_rel_l2_argmax": worst,
        "grads_cosine": g_cos,
        "grads_cosine_min": min(g_cos.values()),
    }


def build(name: str, fixdir: Path, n_spread: int) -> dict:
    params = load_file(str(fixdir / "params.safetensors"))
    gold_io = load_file(str(fixdir / "io.safetensors"))
    gold_grads = load_file(str(fixdir / "grads.safetensors"))
    input_ids, targets = gold_io["input_ids"], gold_io["targets"]

    # Sanity check: the fp32 path reproduces the committed golden outputs.
    lg, ls, gr = run_fp32(load_model(name, fixdir, params), input_ids, targets)
    fp32_recheck = {
        "logits_max_abs": (lg - gold_io["logits"]).abs().max().item(),
        "loss_abs": abs(ls.item() - gold_io["loss"].item()),
        "grads_max_abs": max((gr[n] - gold_grads[n]).abs().max().item() for n in gold_grads),
    }
    assert fp32_recheck["logits_max_abs"] < 1e-5 and fp32_recheck["grads_max_abs"] < 1e-5, fp32_recheck

    out_tensors: dict[str, torch.Tensor] = {}
    result = {}
    for prefix, fn in (("autocast", run_autocast), ("pure_bf16", run_pure_bf16)):
        logits, loss, grads = fn(load_model(name, fixdir, params), input_ids, targets)
        out_tensors[f"{prefix}.logits"] = logits.contiguous()
        out_tensors[f"{prefix}.loss"] = loss.reshape(1).contiguous()
        for n in sorted(grads):
            out_tensors[f"{prefix}.grad.{n}"] = grads[n].contiguous()
        result[prefix] = compare(logits, loss, grads, gold_io, gold_grads)

    # Spread of bf16 errors over several engine-like rounding patterns (metrics only).
    runs = []
    for sample in range(n_spread):
        logits, loss, grads = run_emulated(load_model(name, fixdir, params), input_ids, targets, sample)
        runs.append(compare(logits, loss, grads, gold_io, gold_grads))
    if runs:
        ref_g = {n: max(result["autocast"]["grads_rel_l2"][n], result["pure_bf16"]["grads_rel_l2"][n])
                 for n in gold_grads}
        ref_l = max(result["autocast"]["logits_rel_l2"], result["pure_bf16"]["logits_rel_l2"])
        stats = lambda xs: {"median": float(torch.tensor(xs).median()), "max": max(xs), "min": min(xs)}
        result["emulated_spread"] = {
            "samples": len(runs),
            "sample0": {k: runs[0][k] for k in ("logits_rel_l2", "loss_abs", "grads_rel_l2_max",
                                                "grads_rel_l2_argmax", "grads_cosine_min")},
            "logits_rel_l2": stats([r["logits_rel_l2"] for r in runs]),
            "loss_abs": stats([r["loss_abs"] for r in runs]),
            "loss_abs_rms": (sum(r["loss_abs"] ** 2 for r in runs) / len(runs)) ** 0.5,
            "grads_rel_l2_max": stats([r["grads_rel_l2_max"] for r in runs]),
            "grads_cosine_min": min(r["grads_cosine_min"] for r in runs),
            "logits_ratio_to_ref_max": max(r["logits_rel_l2"] for r in runs) / ref_l,
            "grads_ratio_to_ref_max": max(r["grads_rel_l2"][n] / ref_g[n] for r in runs for n in ref_g),
        }

    save_file(out_tensors, str(fixdir / "bf16.safetensors"), metadata={"format": "pt"})
    result.update(
        {
            "fixture": name,
            "golden_loss": gold_io["loss"].item(),
            "fp32_recheck": fp32_recheck,
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "notes": (
                "Errors are against the fp32 golden in io.safetensors and grads.safetensors. "
                "rel_l2(a, ref) = ||a - ref||_2 / ||ref||_2 over the whole tensor, computed in "
                "float64; cosine is per tensor. autocast: fp32 weights under "
                "torch.autocast('cpu', bfloat16), with the fp32 loss on the bf16 logits upcast; "
                "grads are the fp32 .grad of the fp32 params. pure_bf16: model.to(bfloat16) "
                "(bf16 weights, activations and grads), logits upcast to fp32 before the loss, "
                "and bf16 grads upcast to fp32. fp32_recheck is this script's fp32 run against "
                "the golden (sanity). Tensors are in bf16.safetensors under the prefixes "
                "'autocast.' and 'pure_bf16.': logits, loss, grad.<param name>. "
                "emulated_spread (metrics only, no tensors) summarises the same errors over "
                "'samples' engine-like emulations, as described in run_emulated in "
                "llama_autocast.py. *_ratio_to_ref_max is the largest rel_l2 divided by "
                "max(autocast, pure_bf16) for the same tensor. "
                "See tests/reference/BF16.md."
            ),
        }
    )
    with open(fixdir / "bf16.json", "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", type=Path, default=FIXTURES, help="fixtures root (default tests/fixtures)")
    ap.add_argument("--only", nargs="*", default=None, help="subset of fixture names")
    ap.add_argument("--spread", type=int, default=40, help="emulated rounding patterns (0: skip)")
    args = ap.parse_args()

    torch.manual_seed(0)  # nothing random is drawn; set anyway
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float32)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}", file=sys.stderr)

    for name in args.only or list(CONFIGS):
        r = build(name, args.fixtures / name, args.spread)
        short = {
            p: {k: r[p][k] for k in ("logits_rel_l2", "loss_abs", "grads_rel_l2_max",
                                     "grads_rel_l2_argmax", "grads_cosine_min")}
            for p in PREFIXES
        }
        print(json.dumps({"fixture": name, **short}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
