#!/usr/bin/env bash
# Create (or refresh) the separate virtual environment for NVIDIA kvpress 0.5.5, the reference peer.
#
# kvpress pins transformers<5.3 and patches transformers' attention functions process-wide on
# import, so it must never be installed into, or imported from, criticalkv's own environment.
# It lives in its own venv (outside the repo) and is only run as a separate process
# (benchmarks/kvpress/run_kvpress.py), exchanging inputs and results as files.
#
# Idempotent: re-running reuses the venv and only installs what is missing.
# Override the location with CRITICALKV_KVPRESS_VENV (default ~/.cache/criticalkv/kvpress-venv).
# Override the interpreter with CRITICALKV_KVPRESS_PYTHON (default python3, needs >= 3.10).
set -euo pipefail

VENV="${CRITICALKV_KVPRESS_VENV:-$HOME/.cache/criticalkv/kvpress-venv}"
PY="${CRITICALKV_KVPRESS_PYTHON:-python3}"
TORCH_VERSION="2.13.0"
KVPRESS_VERSION="0.5.5"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[kvpress-env] creating venv at $VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"

# A constraints file keeps every later resolve on the CPU torch (no CUDA wheels, no torch upgrade).
CONSTRAINTS="$VENV/kvpress-constraints.txt"
printf 'torch==%s\nkvpress==%s\n' "$TORCH_VERSION" "$KVPRESS_VERSION" > "$CONSTRAINTS"

have() {  # have DIST VERSION -> exit 0 if that exact distribution version is installed in the venv
    "$VPY" - "$1" "$2" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    v = version(sys.argv[1])
except PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if v.split("+")[0] == sys.argv[2] else 1)
PYEOF
}

# 1. torch first, CPU build. The CPU wheel (torch-2.13.0+cpu) is found through pip's configured
#    find-links (/opt/wheels here). Elsewhere, point pip at the CPU index yourself, e.g.
#    PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu, before running this script.
if ! have torch "$TORCH_VERSION"; then
    echo "[kvpress-env] installing torch==$TORCH_VERSION (CPU)"
    "$VPY" -m pip install --upgrade pip >/dev/null 2>&1 || true
    "$VPY" -m pip install "torch==$TORCH_VERSION" -c "$CONSTRAINTS"
fi

# 2. kvpress, with torch held at the version above.
if ! have kvpress "$KVPRESS_VERSION"; then
    echo "[kvpress-env] installing kvpress==$KVPRESS_VERSION"
    "$VPY" -m pip install "kvpress==$KVPRESS_VERSION" -c "$CONSTRAINTS"
fi

# 3. Check: torch is still the CPU build, kvpress imports.
"$VPY" - <<'PYEOF'
import torch, transformers, kvpress  # noqa: E401
from importlib.metadata import version
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert torch.version.cuda is None, f"a CUDA torch slipped in: {torch.version.cuda}"
print(f"[kvpress-env] ok: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"kvpress {version('kvpress')}")
PYEOF
# Record what was resolved (transformers<5.3 etc.), for reproducibility of reference numbers.
"$VPY" -m pip freeze > "$VENV/kvpress-freeze.txt"
echo "[kvpress-env] python: $VPY (pip freeze in $VENV/kvpress-freeze.txt)"
