#!/usr/bin/env bash
# Install flowrl and its test tools into the current Python environment.
# torch: an installed torch (e.g. a CUDA build on a GPU machine) is kept as it is; without one,
# torch==2.13.0 is installed first (on machines with the local CPU wheel that pip finds, the
# CPU build; elsewhere point FLOWRL_TORCH_INDEX at a CPU wheel index, or set
# FLOWRL_TORCH_SPEC to another requirement), so the project's own install adds no torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
if "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "install.sh: keeping the installed torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
else
    "$PYTHON" -m pip install --quiet ${FLOWRL_TORCH_INDEX:+--index-url "$FLOWRL_TORCH_INDEX"} \
        "${FLOWRL_TORCH_SPEC:-torch==2.13.0}"
fi
# track: the TensorBoard, W&B and MLflow loggers (the examples' --tensorboard flag, their tests)
"$PYTHON" -m pip install --quiet -e ".[test,plot,metrics,track]"
