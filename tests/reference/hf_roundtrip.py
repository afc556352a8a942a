"""Round trip between ferrotron and Hugging Face transformers (not needed by CI).

  bash tests/reference/setup_venv.sh
  cargo build --release -p ferrotron
  .venv/bin/python tests/reference/hf_roundtrip.py [--bin target/release/ferrotron] [--work DIR]

Both directions, on the same token sequences, compared within 1e-4 relative:

1. ferrotron -> transformers: `ferrotron train` writes checkpoints (fp32, and bf16 weights) of
   a small Llama; `AutoModelForCausalLM.from_pretrained(checkpoint)` loads each, and its loss
   equals `ferrotron eval --checkpoint` on it.
2. transformers -> ferrotron: random Llama (tied, GQA), Qwen2 (q/k/v bias) and Mistral models
   saved by `save_pretrained` (sharded into several files, and once in bf16); `ferrotron eval`
   on each folder equals transformers' own loss.
3. (`train --init-from` reads folders through the same loader; its Rust test is
   crates/train/tests/hf_models.rs.)

The loss is the mean next-token cross-entropy over every predicted token of every sequence (the
sum of per-sequence `CrossEntropyLoss(reduction="sum")`, divided by the token count), in fp32.
Prints one line per case and exits non-zero if any case is off.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 1e-4


def hf_loss(folder, seqs):
    """transformers' mean next-token loss of the model in `folder` (computed in fp32)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s], dtype=torch.long)
            logits = model(ids).logits[0, :-1].double()
            target = ids[0, 1:]
            total += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
            count += len(s) - 1
    return total / count, count


def ferrotron(bin_path, *args):
    out = subprocess.run([bin_path, *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"ferrotron {' '.join(args)} failed:\n{out.stderr}")
    return out.stdout


def ferrotron_loss(bin_path, folder, tokens_file):
    r = json.loads(ferrotron(bin_path, "eval", "--checkpoint", folder, "--tokens", tokens_file, "--json"))
    return r["loss"], r["tokens"]


def sequences(vocab, rng, n=4):
    return [rng.integers(0, vocab, size=int(rng.integers(9, 40))).tolist() for _ in range(n)]


def compare(name, ours, theirs, results):
    rel = abs(ours[0] - theirs[0]) / abs(theirs[0])
    ok = rel < TOL and ours[1] == theirs[1]
    results.append(ok)
    print(f"{'ok  ' if ok else 'FAIL'} {name:<44} ferrotron {ours[0]:.7f}  transformers {theirs[0]:.7f}  "
          f"rel {rel:.1e}  tokens {ours[1]}")


def random_models(work):
    """(name, folder, save kwargs) of random transformers models of each supported family."""
    torch.manual_seed(0)
    common = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, vocab_size=256, rms_norm_eps=1e-5)
    cases = [
        ("llama (tied, GQA)", transformers.LlamaConfig(**common, tie_word_embeddings=True, rope_theta=10000.0)),
        ("qwen2 (q/k/v bias)", transformers.Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1e6)),
        ("mistral", transformers.MistralConfig(**common, tie_word_embeddings=False, rope_theta=1e6,
                                               sliding_window=None)),
    ]
    out = []
    for name, cfg in cases:
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():
            for p in model.parameters():  # larger than the default init, so logits differ
                p.normal_(0.0, 0.2)
        folder = os.path.join(work, name.split()[0])
        model.save_pretrained(folder, max_shard_size="100KB")
        out.append((name + ", sharded", folder))
        if name.startswith("llama"):
            b16 = folder + "-bf16"
            model.to(torch.bfloat16).save_pretrained(b16)
            out.append((name + ", bf16 file", b16))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.path.join(REPO, "target/release/ferrotron"))
    ap.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    a = ap.parse_args()
    work = a.work or tempfile.mkdtemp(prefix="ferrotron-hf-")
    os.makedirs(work, exist_ok=True)
    rng = np.random.default_rng(1234)
    results = []
    print(f"transformers {transformers.__version__}, torch {torch.__version__}; work dir {work}")

    # 1. ferrotron -> transformers.
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 8192, "max_position_embeddings": 128,
           "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
    model_json = os.path.join(work, "tiny.json")
    with open(model_json, "w") as f:
        json.dump(cfg, f)
    tokens = os.path.join(work, "tokens-8192.json")
    with open(tokens, "w") as f:
        json.dump(sequences(8192, rng), f)
    for precision in ["fp32", "bf16"]:
        ck = os.path.join(work, f"ck-{precision}")
        ferrotron(a.bin, "train", "--model", model_json, "--seq", "64", "--mbs", "4", "--steps", "5",
                  "--lr", "1e-2", "--warmup", "1", "--eval-interval", "0", "--precision", precision,
                  "--out-dir", os.path.join(work, f"run-{precision}"), "--checkpoint-dir", ck, "--quiet")
        compare(f"ferrotron {precision} checkpoint -> transformers", ferrotron_loss(a.bin, ck, tokens),
                hf_loss(ck, json.load(open(tokens))), results)

    # 2. transformers -> ferrotron.
    tokens256 = os.path.join(work, "tokens-256.json")
    with open(tokens256, "w") as f:
        json.dump(sequences(256, rng), f)
    seqs = json.load(open(tokens256))
    for name, folder in random_models(work):
        compare(f"transformers {name} -> ferrotron", ferrotron_loss(a.bin, folder, tokens256),
                hf_loss(folder, seqs), results)

    n_ok = sum(results)
    print(f"{n_ok} passed, {len(results) - n_ok} failed")
    sys.exit(0 if n_ok == len(results) else 1)


if __name__ == "__main__":
    main()
