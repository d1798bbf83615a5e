#!/usr/bin/env bash
# Creates ./.venv (Python >= 3.12) with requirements.txt and megatron_mok installed editable.
# Idempotent: re-installs only when requirements.txt or setup.py changed. Works without a GPU
# (torch's CUDA wheels run on a CPU-only machine; the CUDA extension is then skipped).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

find_python() {
    local candidate
    for candidate in "${PYTHON:-}" python3.12 python3.13 /root/.pyenv/versions/3.12*/bin/python3.12 \
        "$HOME"/.pyenv/versions/3.12*/bin/python3.12 python3; do
        [ -n "$candidate" ] || continue
        command -v "$candidate" >/dev/null 2>&1 || [ -x "$candidate" ] || continue
        if "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

if [ ! -x .venv/bin/python ]; then
    python=$(find_python) || {
        echo "bootstrap: need Python >= 3.12 (megatron-core 0.19 requires it); set PYTHON=/path/to/python3.12" >&2
        exit 1
    }
    echo "bootstrap: creating .venv with $python"
    "$python" -m venv .venv
fi

stamp=.venv/.megatron_mok_installed
want=$(cat requirements.txt setup.py $(find csrc -type f | sort) | sha256sum | cut -c1-16)
pip_quiet() {
    # pip's own output goes to a log, shown in full when it fails.
    local log
    log=$(mktemp)
    if ! .venv/bin/python -m pip "$@" >"$log" 2>&1; then
        grep -v "^WARNING: Location" "$log" | tail -60 >&2
        echo "bootstrap: pip $* failed" >&2
        rm -f "$log"
        return 1
    fi
    rm -f "$log"
}

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "bootstrap: installing requirements (torch, megatron-core 0.19.x, ...) into .venv"
    pip_quiet install -q --upgrade pip
    pip_quiet install -q -r requirements.txt
    # Builds the CUDA extension (sm_90a) where nvcc and a CUDA build of torch exist.
    echo "bootstrap: installing megatron_mok (editable)"
    pip_quiet install -q --no-deps --no-build-isolation -e .
    .venv/bin/python -c 'import torch, megatron.core, megatron_mok' || { echo "bootstrap: install failed" >&2; exit 1; }
    echo "$want" > "$stamp"
fi
.venv/bin/python - <<'PY'
import importlib.util, torch
te = importlib.util.find_spec("transformer_engine") is not None
apex = importlib.util.find_spec("apex") is not None
from megatron_mok.ops import extension_error
ext = extension_error()
print(f"bootstrap: torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}, "
      f"transformer-engine: {'yes' if te else 'no (optional)'}, apex: {'yes' if apex else 'no (optional)'}, "
      f"CUDA extension: {'built' if ext is None else 'not built'}")
PY
