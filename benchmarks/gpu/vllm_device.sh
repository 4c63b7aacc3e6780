#!/usr/bin/env bash
# vLLM on the GPU machine (no package index there): the bundle of scripts/vllm_gpu_bundle.sh travels in
# parts, one a device call, each in a folder git ignores (.vp01 ... .vpNN, in .git/info/exclude), and waits
# in /tmp/vw while the machine stays warm (it goes back after 30 s idle: make the calls back to back).
#   here:    PY312=... bash scripts/vllm_gpu_bundle.sh /tmp/vb; for d in /tmp/vb/part*; do
#              mkdir -p .vp${d##*part}; cp -l $d/* .vp${d##*part}/; done
#            .hf/smollm2-tokenizer (see smollm2_seeds.sh); .whl (benchmarks/gpu/wheels.sh) for Ray
#   there, every call, carrying .vpNN:        bash benchmarks/gpu/vllm_device.sh stage
#   the last part's call, also carrying .hf:  bash benchmarks/gpu/vllm_device.sh stage install rollout
#   then, carrying .whl:                      bash benchmarks/gpu/vllm_device.sh install ppo
# Steps: stage (copy the parts here to /tmp/vw), install (assemble, install into the system Python, import
# vllm), rollout (vllm_rollout.py for SmolLM2-135M and Qwen2.5-0.5B shapes, or $ARCHS; $PROMPTS prompts, 256 by default), own (the engine's
# own generate, its core in a process of its own), invariance (a sample's tokens alone, reversed, in a call of 17;
# without and with --batch-invariant), graphs ($PROMPTS prompts, CUDA graphs up to 512 sequences and up to $PROMPTS), ppo (seed_ppo.py, $ENGINES: vLLM and generate; $SCORERS
# replicas of each scorer, 8 by default; $KV_GIB each engine's KV cache, 4 by default; $SLEEP its sleep level, 0 by
# default; the H200 runs of docs/vllm.md used KV_GIB=1 SLEEP=1; the seed's layout outgrows an H100's 80 GB).
# Logs and results under $OUT (or /tmp/flowrl-gpu). Exit status: 0 only if every step passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/flowrl-gpu}
mkdir -p /tmp/vw "$out"
status=0
step() {  # step NAME SECONDS: the function NAME in its own shell, its log under $out, a line of its outcome
  local name=$1 limit=$2 rc=0
  timeout "$limit" bash -c "$name" > "$out/$name.log" 2>&1 || rc=$?
  echo "step $name: rc=$rc, $(tail -1 "$out/$name.log")"
  [ "$rc" = 0 ] || status=1
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
    python3 benchmarks/gpu/vllm_rollout.py --tokenizer .hf/smollm2-tokenizer --arch qwen2.5-0.5b --invariance 64 \
      --new 128 $flag --out "$out" || return 1
  done
}
graphs() {  # $PROMPTS (1,024 by default) prompts with CUDA graphs captured up to vLLM's default 512 sequences, then up to $PROMPTS
  local n=${PROMPTS:-1024}
  for size in 512 "$n"; do
    python3 benchmarks/gpu/vllm_rollout.py --tokenizer .hf/smollm2-tokenizer --arch qwen2.5-0.5b --prompts "$n" --skip-hf \
      --engine-args "{\"compilation_config\": {\"max_cudagraph_capture_size\": $size}}" --out "$out/graphs-$size" || return 1
  done
}
ppo() {
  source benchmarks/gpu/wheels_env.sh
  for engine in ${ENGINES:-vllm hf}; do
    python3 benchmarks/gpu/seed_ppo.py --arch qwen2.5-0.5b --episodes 3 --empty-cache on --micro-batch-tokens 2048 \
      --modes sync,async --engine "$engine" --vllm-kv-gib "${KV_GIB:-4}" --vllm-sleep "${SLEEP:-0}" \
      --scorer-replicas "${SCORERS:-8}" \
      --out "$out/ppo-$engine" || return 1
  done
}
export -f installed rollout own invariance graphs ppo
# FlashInfer's sampler compiles kernels with nvcc, which the machine lacks
export out PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
for what in "$@"; do
  case $what in
    stage) for part in .vp[0-9][0-9]; do [ -d "$part" ] && cp "$part"/* /tmp/vw/; done; echo "staged: $(ls /tmp/vw | wc -l) files" ;;
    install) step installed 300 ;;
    rollout) step rollout 540 ;;
    own) step own 540 ;;
    invariance) step invariance 540 ;;
    graphs) step graphs 540 ;;
    ppo) step ppo 560 ;;
    *) echo "unknown step $what" >&2; exit 2 ;;
  esac
done
exit $status
