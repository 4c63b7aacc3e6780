#!/usr/bin/env bash
# The load test on the lent GPU machine's 16 CPU cores (no GPU used): docs/benchmarks-16-cores.md.
#   bash benchmarks/gpu/cpu16.sh [OUT_DIR] [loadtest args...]   # default $OUT, else /tmp/flowrl-cpu16
# Installs the carried wheels (bash benchmarks/gpu/wheels.sh, into .whl/) when Ray is missing.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-${OUT:-/tmp/flowrl-cpu16}}
shift || true
mkdir -p "$out"
source benchmarks/gpu/wheels_env.sh
ray stop --force >/dev/null || exit 1
python3 -m flowrl loadtest --no-ray-data --out "$out/benchmarks-16-cores.md" "$@" 2>&1 | grep -v "WARNING\|INFO" | tail -60 >"$out/loadtest.log"
exit "${PIPESTATUS[0]}"
