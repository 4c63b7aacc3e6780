#!/usr/bin/env bash
# Install flowrl and its test tools into the current Python environment.
# torch: an installed torch (e.g. a CUDA build on a GPU machine) is kept as it is; without one,
# the CPU build torch==2.13.0 is installed first, so nothing pulls a multi-GB CUDA build.
# Set FLOWRL_TORCH_SPEC to install another torch requirement instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
if "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "install.sh: keeping the installed torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
else
    "$PYTHON" -m pip install --quiet "${FLOWRL_TORCH_SPEC:-torch==2.13.0}"
fi
"$PYTHON" -m pip install --quiet -e ".[test]"
