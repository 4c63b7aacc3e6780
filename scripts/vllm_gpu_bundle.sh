#!/usr/bin/env bash
# vLLM 0.26.0 for the GPU machine (nvidia-h200: Python 3.12, torch 2.11.0+cu130 there, no network), as
# wheels carried over in parts of at most 59,900,000 bytes, one part a call.
#   bash scripts/vllm_gpu_bundle.sh OUTDIR        (on a CPU machine with pip access to PyPI)
# OUTDIR/partNN/ are the parts: every one holds SHA256SUMS and CONDITIONAL.txt, part01 also assemble.sh,
# install.sh and CARRIED.txt. OUTDIR/build/ keeps the venv, the pip report and the wheels; a rerun reuses them.
# On the GPU machine: copy every part's files into one folder DIR, then
#   bash DIR/assemble.sh DIR && bash DIR/install.sh DIR
# What the target has, and so what is carried, is in scripts/vllm_gpu/resolve.py's data section.
# PY312=/path/to/python3.12 picks the interpreter; it must be 3.12, because pip evaluates the requirements'
# environment markers against the interpreter that runs it, whatever --python-version says.
set -euo pipefail
OUT=$(realpath -m "${1:?usage: bash scripts/vllm_gpu_bundle.sh OUTDIR}")
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
start=$SECONDS

# pip 23.2.1 made the first bundle; pinned so that a rerun resolves the same way
PIP_PIN="pip==23.2.1"
PACKAGING_PIN="packaging==24.2"

PY312=${PY312:-}
if [ -z "$PY312" ]; then
    for cand in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
        if "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
            PY312=$cand
            break
        fi
    done
fi
if [ -z "$PY312" ] || ! "$PY312" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
    echo "vllm_gpu_bundle.sh: no Python 3.12 found; set PY312=/path/to/python3.12" >&2
    exit 2
fi

mkdir -p "$OUT/build"
VENV=$OUT/build/venv
# a throwaway venv: nothing goes into the interpreter's own environment
[ -x "$VENV/bin/python" ] || "$PY312" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$PIP_PIN" "$PACKAGING_PIN"

cp "$HERE/vllm_gpu/assemble.sh" "$HERE/vllm_gpu/install.sh" "$OUT/build/"
chmod +x "$OUT/build/assemble.sh" "$OUT/build/install.sh"
"$VENV/bin/python" "$HERE/vllm_gpu/resolve.py" "$OUT"

echo "vllm_gpu_bundle.sh: done in $((SECONDS - start)) s; parts in $OUT/part*"
