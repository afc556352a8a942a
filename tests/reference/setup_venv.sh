#!/usr/bin/env bash
# Create (or refresh) <repo>/.venv with the pinned PyTorch reference stack.
#   bash tests/reference/setup_venv.sh
#   .venv/bin/python tests/reference/llama_reference.py
# Env: PYTHON (default python3), VENV (default <repo>/.venv).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-$REPO/.venv}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet \
    -r "$HERE/requirements.txt" -c "$HERE/requirements.lock.txt"
"$VENV/bin/python" - <<'PY'
import torch, transformers, safetensors
x = torch.randn(4, 4)
assert torch.allclose(x @ torch.eye(4), x)
print(f"ok: torch {torch.__version__} (cuda available: {torch.cuda.is_available()}), "
      f"transformers {transformers.__version__}, safetensors {safetensors.__version__}")
PY
