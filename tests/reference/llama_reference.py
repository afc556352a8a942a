#!/usr/bin/env python3
"""Golden fixtures for ferrotron, produced with HF transformers (PyTorch, CPU, fp32).

For each small config this writes tests/fixtures/<name>/:

  config.json                 HF config (model.config.to_json_file)
  params.safetensors          every parameter at init, HF names (tied: no lm_head.weight)
  io.safetensors              input_ids, targets, logits, loss
  grads.safetensors           d loss / d param at init, same names as params
  activations.safetensors     hidden states after embedding / each layer / final norm (debug aid)
  adamw.json                  optimizer hyperparameters + 10-step loss / grad-norm trajectory
  params_after_10.safetensors parameters after 10 AdamW steps on the same batch
  params_after_1.safetensors  (tiny-tied only) parameters after the first AdamW step

See tests/reference/README.md for the exact formats.  Regenerate with
  bash tests/reference/setup_venv.sh && .venv/bin/python tests/reference/llama_reference.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import transformers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"

B, T = 2, 16
IGNORE_INDEX = -100
# (batch, position) of targets set to IGNORE_INDEX to exercise loss masking.
IGNORED_POSITIONS = [(0, 3), (1, 0), (1, 15)]

ADAMW = {
    "lr": 1e-2,
    "betas": [0.9, 0.95],
    "eps": 1e-8,
    "weight_decay": 0.1,
    "max_grad_norm": 1.0,
    "steps": 10,
}

CONFIGS = {
    "tiny-tied": dict(
        cls="llama",
        seed=1234,
        vocab_size=96,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
    ),
    "tiny-gqa": dict(
        cls="llama",
        seed=2345,
        vocab_size=128,
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
    ),
    "tiny-qwen2": dict(
        cls="qwen2",
        seed=3456,
        vocab_size=112,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
    ),
    # Mixture of experts: 4 experts, 2 per token, a load-balancing loss weight large enough
    # that its gradient is visible in every router gradient.
    "tiny-mixtral": dict(
        cls="mixtral",
        seed=4567,
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.05,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
    ),
}

# Only these fixtures get params_after_1.safetensors (kept to one for size).
WITH_PARAMS_AFTER_1 = {"tiny-tied"}


def make_model(spec: dict):
    spec = dict(spec)
    kind = spec.pop("cls")
    spec.pop("seed")
    rope_theta = spec.pop("rope_theta")
    common = dict(
        initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        hidden_act="silu",
        attention_dropout=0.0,
        use_cache=False,
        **spec,
    )
    if kind == "llama":
        config = LlamaConfig(attention_bias=False, mlp_bias=False, **common)
        model = LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = Qwen2Config(use_sliding_window=False, **common)
        model = Qwen2ForCausalLM(config)
    elif kind == "mixtral":
        config = MixtralConfig(output_router_logits=True, router_jitter_noise=0.0, **common)
        model = MixtralForCausalLM(config)
    else:
        raise ValueError(kind)
    # Eager attention: plain softmax(QK^T/sqrt(d) + causal mask) V, no fused kernels.
    model.config._attn_implementation = "eager"
    # Experts as the plain per-expert loop of MixtralExperts.forward (no grouped GEMM, which
    # has no float64 path).
    model.config._experts_implementation = "eager"
    model.to(torch.float32)
    return model


@torch.no_grad()
def perturb(model: torch.nn.Module) -> None:
    """Move norm weights away from 1 and biases away from 0 so every grad is exercised."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn_like(p))


def hub_names(named) -> dict[str, torch.Tensor]:
    """transformers 5 keeps a Mixtral layer's experts fused (`mlp.experts.gate_up_proj`
    [E, 2F, C], `mlp.experts.down_proj` [E, C, F]) and its router as `mlp.gate`; checkpoints
    on the Hub, and ferrotron, name them per expert: `block_sparse_moe.experts.{e}.w1/w3/w2`
    and `block_sparse_moe.gate`. Split and rename."""
    out = {}
    for n, t in named:
        t = t.detach().clone()
        if ".mlp.experts.gate_up_proj" in n:
            layer = n.split(".mlp.")[0]
            f = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{layer}.block_sparse_moe.experts.{e}.w1.weight"] = t[e, :f].contiguous()
                out[f"{layer}.block_sparse_moe.experts.{e}.w3.weight"] = t[e, f:].contiguous()
        elif ".mlp.experts.down_proj" in n:
            layer = n.split(".mlp.")[0]
            for e in range(t.shape[0]):
                out[f"{layer}.block_sparse_moe.experts.{e}.w2.weight"] = t[e].contiguous()
        elif ".mlp.gate.weight" in n and t.dim() == 2 and "experts" not in n:
            out[n.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = t.contiguous()
        else:
            out[n] = t.contiguous()
    return out


def params_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # named_parameters() de-duplicates tied weights, so a tied model has no lm_head.weight.
    return hub_names(model.named_parameters())


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # targets are already shifted: logits[:, t] is scored against targets[:, t].
    V = logits.shape[-1]
    return F.cross_entropy(
        logits.reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE_INDEX
    )


def forward(model, input_ids):
    return model(input_ids=input_ids, use_cache=False).logits


def train_loss(model, input_ids, targets):
    """The training loss: cross-entropy, plus for a mixture of experts
    router_aux_loss_coef × the load-balancing loss over all layers (as MixtralForCausalLM
    adds it when output_router_logits)."""
    out = model(input_ids=input_ids, use_cache=False)
    loss = loss_fn(out.logits, targets)
    cfg = model.config
    if getattr(cfg, "num_local_experts", None):
        aux = load_balancing_loss_func(
            out.router_logits, cfg.num_local_experts, cfg.num_experts_per_tok
        )
        loss = loss + cfg.router_aux_loss_coef * aux
    return out.logits, loss


def capture_activations(model, input_ids) -> dict[str, torch.Tensor]:
    acts: dict[str, torch.Tensor] = {}
    hooks = []
    base = model.model

    def save(name):
        def hook(_mod, _inp, out):
            t = out[0] if isinstance(out, (tuple, list)) else out
            acts[name] = t.detach().clone().contiguous()

        return hook

    hooks.append(base.embed_tokens.register_forward_hook(save("embed")))
    for i, layer in enumerate(base.layers):
        hooks.append(layer.register_forward_hook(save(f"layer.{i}")))
    hooks.append(base.norm.register_forward_hook(save("norm")))
    with torch.no_grad():
        forward(model, input_ids)
    for h in hooks:
        h.remove()
    return acts


def run_adamw(model, input_ids, targets, on_step0=None):
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=ADAMW["lr"],
        betas=tuple(ADAMW["betas"]),
        eps=ADAMW["eps"],
        weight_decay=ADAMW["weight_decay"],
        amsgrad=False,
        foreach=False,
        fused=False,
    )
    losses, grad_norms = [], []
    for step in range(ADAMW["steps"]):
        opt.zero_grad(set_to_none=True)
        _, loss = train_loss(model, input_ids, targets)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(
            model.parameters(), max_norm=ADAMW["max_grad_norm"], foreach=False
        )
        losses.append(loss.item())
        grad_norms.append(gn.item())
        opt.step()
        if step == 0 and on_step0 is not None:
            on_step0(model)
    return losses, grad_norms


def build(name: str, spec: dict, outdir: Path) -> dict:
    seed = spec["seed"]
    torch.manual_seed(seed)
    model = make_model(spec)
    perturb(model)
    model.train()  # dropout is 0 anyway
    V = model.config.vocab_size

    g = torch.Generator().manual_seed(seed + 1)
    seq = torch.randint(0, V, (B, T + 1), generator=g, dtype=torch.int64)
    input_ids = seq[:, :T].contiguous()
    targets = seq[:, 1:].contiguous()
    for b, t in IGNORED_POSITIONS:
        targets[b, t] = IGNORE_INDEX

    outdir.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(str(outdir / "config.json"))
    # One key only: safetensors serialises metadata from a hash map, so several keys
    # would come out in random order and the files would not be byte-reproducible.
    meta = {"format": "pt"}

    params0 = params_dict(model)
    save_file(params0, str(outdir / "params.safetensors"), metadata=meta)

    # ---- forward / backward at init -------------------------------------------------
    model.zero_grad(set_to_none=True)
    logits, loss = train_loss(model, input_ids, targets)
    loss.backward()
    grads = hub_names((n, p.grad) for n, p in model.named_parameters())
    assert set(grads) == set(params0)
    save_file(
        {
            "input_ids": input_ids,
            "targets": targets,
            "logits": logits.detach().contiguous(),
            "loss": loss.detach().reshape(1).contiguous(),
        },
        str(outdir / "io.safetensors"),
        metadata=meta,
    )
    save_file(grads, str(outdir / "grads.safetensors"), metadata=meta)
    save_file(capture_activations(model, input_ids), str(outdir / "activations.safetensors"), metadata=meta)

    # ---- float64 cross-check: how far is fp32 from "exact"? -------------------------
    m64 = make_model(spec).to(torch.float64)
    m64.load_state_dict(model.state_dict())
    m64.to(torch.float64)
    m64.zero_grad(set_to_none=True)
    logits64, loss64 = train_loss(m64, input_ids, targets)
    loss64.backward()
    grads64 = hub_names((n, p.grad) for n, p in m64.named_parameters())
    fp32_vs_fp64 = {
        "logits_max_abs": (logits.detach().double() - logits64.detach()).abs().max().item(),
        "loss_abs": abs(loss.item() - loss64.item()),
        "grads_max_abs": max((grads[n].double() - g).abs().max().item() for n, g in grads64.items()),
        "grads_max_rel_to_tensor_absmax": max(
            ((grads[n].double() - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
            for n, g in grads64.items()
        ),
    }

    # ---- 10 AdamW steps on the same batch -------------------------------------------
    def on_step0(m):
        if name in WITH_PARAMS_AFTER_1:
            save_file(params_dict(m), str(outdir / "params_after_1.safetensors"), metadata=meta)

    losses, grad_norms = run_adamw(model, input_ids, targets, on_step0)

    # Same trajectory in float64, only to report how much fp32 rounding moves it.
    losses64, grad_norms64 = run_adamw(m64, input_ids, targets)
    traj_vs_fp64 = {
        "losses_max_abs": max(abs(a - b) for a, b in zip(losses, losses64)),
        "grad_norms_max_abs": max(abs(a - b) for a, b in zip(grad_norms, grad_norms64)),
        "params_after_10_max_abs": max(
            (p.detach().double() - q.detach()).abs().max().item()
            for p, q in zip(model.parameters(), m64.parameters())
        ),
    }
    del m64

    with torch.no_grad():
        loss_after = train_loss(model, input_ids, targets)[1].item()
    save_file(params_dict(model), str(outdir / "params_after_10.safetensors"), metadata=meta)

    adamw = dict(ADAMW)
    adamw.update(
        {
            "optimizer": "torch.optim.AdamW(amsgrad=False, foreach=False, fused=False)",
            "weight_decay_applies_to": "all parameters (embeddings, norms, biases included)",
            "grad_clip": "torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False): "
            "total = ||all grads||_2; coef = min(1, max_norm / (total + 1e-6)); grads *= coef",
            "step_order": "zero_grad, forward, loss, backward, clip (record pre-clip norm), step",
            "losses": losses,
            "grad_norms": grad_norms,
            "loss_after_10": loss_after,
        }
    )
    with open(outdir / "adamw.json", "w") as f:
        json.dump(adamw, f, indent=2)
        f.write("\n")

    n_params = sum(p.numel() for p in model.parameters())
    return {
        "name": name,
        "n_params": n_params,
        "loss": loss.item(),
        "fp32_vs_fp64": fp32_vs_fp64,
        "adamw_fp32_vs_fp64": traj_vs_fp64,
        "losses": losses,
        "grad_norms": grad_norms,
        "loss_after_10": loss_after,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=FIXTURES, help="fixtures root (default tests/fixtures)")
    ap.add_argument("--only", nargs="*", default=None, help="subset of fixture names")
    args = ap.parse_args()

    torch.set_num_threads(1)  # reproducible reduction order
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float32)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}", file=sys.stderr)

    names = args.only or list(CONFIGS)
    summary = []
    for name in names:
        res = build(name, CONFIGS[name], args.out / name)
        summary.append(res)
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
