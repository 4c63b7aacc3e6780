#!/usr/bin/env bash
# examples/grpo_smollm2.py once per seed, one after the other (on CPUs), then held-out accuracy
# as mean +- sample std over the seeds. Each run's JSON summary, log and resident memory
# (VmRSS every 10 s) go to OUT (default runs/seeds).
#   bash benchmarks/grpo_smollm2_seeds.sh 0 1 2 3
set -u
out="${OUT:-runs/seeds}"
mkdir -p "$out"
for seed in "$@"; do
  python examples/grpo_smollm2.py --seed "$seed" --summary "$out/seed-$seed.json" \
    --run-dir "$out/run-$seed" > "$out/seed-$seed.log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    echo "$(date +%s) $(awk '/VmRSS/ {print $2}' "/proc/$pid/status" 2>/dev/null)" >> "$out/rss-$seed.txt"
    sleep 10
  done
  wait "$pid"
  echo "seed $seed: rc=$? $(tail -1 "$out/seed-$seed.log")"
done
python - "$out" "$@" <<'PY'
import json, statistics, sys
from pathlib import Path
out, seeds = Path(sys.argv[1]), sys.argv[2:]
runs = [json.loads((out / f"seed-{s}.json").read_text()) for s in seeds if (out / f"seed-{s}.json").exists()]
def line(name, values):
    sd = statistics.stdev(values) if len(values) > 1 else float("nan")
    return f"{name}: {statistics.fmean(values):.3f} +- {sd:.3f} over {len(values)} runs ({', '.join(f'{v:.3f}' for v in values)})"
print(line("before", [r["before"] for r in runs]))
for i in range(min(len(r["after"]) for r in runs)):
    print(line(f"after episode {(i + 1) * runs[0]['eval_every']}", [r["after"][i] for r in runs]))
print(line("wall s", [r["wall_s"] for r in runs]))
PY
