#!/usr/bin/env bash
# The README's main command: build ferrotron, train the default ~16M-parameter Llama on the
# bundled Shakespeare corpus for a few minutes on the CPU, print planned vs measured memory,
# save a checkpoint and sample text from it. Needs only cargo (the Rust toolchain); installs
# oneDNN for faster GEMMs where it can (scripts/install_onednn.sh; optional).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_onednn.sh || echo "== carrying on without oneDNN"
cargo build --release -p ferrotron
OUT=${OUT:-runs/default}
./target/release/ferrotron train --out-dir "$OUT" --checkpoint-dir "$OUT/checkpoint" "$@"
./target/release/ferrotron sample --checkpoint "$OUT/checkpoint" --prompt "ROMEO:" --tokens 120
