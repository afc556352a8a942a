#!/usr/bin/env bash
# `import ferrotron` (python/): builds the wheel as a user would (`pip install ./python`, which
# fetches maturin from PyPI and compiles the extension with cargo) into a fresh venv, then runs
# its pytest suite against the `ferrotron` binary of this checkout (built here if missing).
# Needs python3 with venv and network access to PyPI. FERROTRON_PYTHON=0 in scripts/test.sh
# skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET="${CARGO_TARGET_DIR:-$PWD/target}"
VENV="$TARGET/python-venv"
if [ ! -x "$TARGET/release/ferrotron" ]; then
    cargo build --release -p ferrotron
fi
rm -rf "$VENV"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q ./python pytest
FERROTRON_BIN="$TARGET/release/ferrotron" "$VENV/bin/python" -m pytest -q python/tests "$@"
