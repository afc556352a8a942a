#!/usr/bin/env python3
"""transformers' `generate` on a ferrotron checkpoint: the peer of `ferrotron sample`
(docs/BENCHMARKS.md, "Sampling"). A ferrotron checkpoint directory is a Hugging Face model
folder (config.json, model.safetensors, tokenizer.json), so `LlamaForCausalLM` loads it as it is.

  .venv/bin/python tests/reference/bench_generate.py --checkpoint runs/ck --tokens 200 800 2000
  .venv/bin/python tests/reference/bench_generate.py --checkpoint runs/ck --greedy 64

Timing: `generate` alone (the model loaded and warmed up first), fp32, `--threads` intra-op
threads, with its KV cache (`use_cache=True`, the default) and the sampling of `ferrotron
sample`'s defaults (temperature 0.8, top-k 40); `min_new_tokens` keeps EOS from stopping a run
early, so every run makes exactly the tokens asked. Medians of `--rounds` runs per size.

`--greedy N` prints the prompt and N greedy tokens instead, decoded, for comparison with
`ferrotron sample --temperature 0 --tokens N` on the same checkpoint.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import LlamaForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--prompt", default="ROMEO:")
    ap.add_argument("--tokens", type=int, nargs="+", default=[200, 800, 2000])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--greedy", type=int, default=0)
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(a.checkpoint, dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(a.checkpoint / "tokenizer.json"))
    ids = torch.tensor([tok.encode(a.prompt).ids])
    pad = tok.token_to_id("<|endoftext|>") or 0

    def run(n: int, **kw) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(
                ids, max_new_tokens=n, min_new_tokens=n, pad_token_id=pad, **kw
            )

    if a.greedy:
        out = run(a.greedy, do_sample=False)
        print(a.prompt + tok.decode(out[0, ids.shape[1] :].tolist()))
        return

    sampling = dict(do_sample=True, temperature=0.8, top_k=40)
    run(16, **sampling)  # warm-up: first-call allocations and oneDNN primitives
    rows = []
    for n in a.tokens:
        secs = []
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            out = run(n, **sampling)
            secs.append(time.perf_counter() - t0)
            assert out.shape[1] - ids.shape[1] == n
        med = statistics.median(secs)
        rows.append({"tokens": n, "seconds": med, "tokens_per_s": n / med, "runs": secs})
        print(f"transformers generate: {n} tokens in {med:.2f} s ({n / med:.0f} tokens/s)")
    print(
        json.dumps(
            {
                "torch": torch.__version__,
                "threads": a.threads,
                "prompt_tokens": ids.shape[1],
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
