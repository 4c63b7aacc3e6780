#!/usr/bin/env bash
# The GPU run (docs/gpu.md), on a machine with a CUDA GPU and its own torch. Where Ray and
# msgspec are missing and nothing can be fetched, build the wheels first where pip reaches the
# registry (bash benchmarks/gpu/wheels.sh, into .whl/) and carry them along.
#   bash benchmarks/gpu/run.sh [OUT_DIR]      # default $OUT, else /tmp/flowrl-gpu
# Writes device.txt, gpu-tests.txt and ppo-tiny.txt to OUT_DIR.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-${OUT:-/tmp/flowrl-gpu}}
mkdir -p "$out"
source benchmarks/gpu/wheels_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, ray; print('python', sys.version.split()[0], '| torch', torch.__version__, '| ray', ray.__version__, '|', torch.cuda.get_device_name(0))"
} 2>&1 | tee "$out/device.txt"
status=0
python3 -m pytest -q -m gpu tests/engine/test_gpu.py tests/hf/test_hf_empty_cache.py tests/hf/test_smollm2_layout_gpu.py -p no:cacheprovider -o strict_config=false -o addopts="-p no:anyio -ra" 2>&1 | tail -40 | tee "$out/gpu-tests.txt" || status=1
[ "${PIPESTATUS[0]}" = 0 ] || status=1
timeout 300 python3 examples/ppo_tiny.py 2>&1 | grep -v "WARNING\|INFO" | tail -40 | tee "$out/ppo-tiny.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
exit $status
