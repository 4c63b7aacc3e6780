#!/usr/bin/env bash
# Wheels that a bare GPU machine without a package index needs to run flowrl (Python 3.12,
# x86-64), written to .whl/ (ignored by git). Ray's wheel is repacked without ray/jars/
# (Java worker support, unused from Python), which brings it under what one call may carry.
#   bash scripts/gpu_wheels.sh          # here, where pip reaches the registry
# There:  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#         export PYTHONPATH=$PWD:/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" -d .whl "$@"; }
get ray==2.60.0 msgspec jsonschema jsonschema-specifications referencing rpds-py
get gguf==0.19.0 py-spy  # transformers reads SmolLM2's GGUF with gguf (benchmarks/gpu/run.sh seeds); py-spy dumps a hung actor
python3 - .whl/ray-2.60.0-*.whl <<'PY'
import os, sys, zipfile
wheel = sys.argv[1]
slim = wheel + ".slim"
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        if info.filename.startswith("ray/jars/"):
            continue
        data = src.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"".join(l for l in data.splitlines(True) if not l.startswith(b"ray/jars/"))
        dst.writestr(info, data)
os.replace(slim, wheel)
PY
du -sh .whl
