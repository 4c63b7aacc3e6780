#!/usr/bin/env bash
# Usage: install.sh DIR     (run assemble.sh DIR first)
# Installs the vLLM 0.26.0 bundle into the SYSTEM env (the one with torch 2.11.0+cu130),
# offline, no dependency resolution. Wheels listed in CONDITIONAL.txt are skipped when
# the target already has a version satisfying vLLM's requirement (FORCE_ALL=1: install all).
# PY=/path/to/python3 overrides the interpreter.
set -euo pipefail
DIR=$(cd "${1:?usage: install.sh DIR}" && pwd)
PY=${PY:-/opt/torch/.venv/bin/python3}
[ -x "$PY" ] || PY=python3
echo "python: $PY ($("$PY" -V 2>&1))"
# every wheel must be assembled
missing=0
while read -r sum name; do [ -f "$DIR/${name#\*}" ] || { echo "MISSING $name (run assemble.sh $DIR)"; missing=1; }; done < "$DIR/SHA256SUMS"
[ $missing -eq 0 ] || exit 1

mapfile -t WHEELS < <(DIR="$DIR" FORCE_ALL="${FORCE_ALL:-0}" "$PY" - <<'PYEOF'
import os, sys
from importlib.metadata import version, PackageNotFoundError
try:
    from packaging.specifiers import SpecifierSet
except ImportError:
    from pip._vendor.packaging.specifiers import SpecifierSet
d = os.environ["DIR"]; force = os.environ["FORCE_ALL"] == "1"
wheels = sorted(l.split()[1].lstrip("*") for l in open(os.path.join(d, "SHA256SUMS")) if l.strip())
cond = {}
for l in open(os.path.join(d, "CONDITIONAL.txt")):
    if l.startswith("#") or not l.strip(): continue
    w, dist, spec = (l.rstrip("\n").split("\t") + [""])[:3]
    cond[w] = (dist, spec)
for w in wheels:
    if w in cond and not force:
        dist, spec = cond[w]
        try:
            have = version(dist)
        except PackageNotFoundError:
            have = None
        if have is not None and SpecifierSet(spec).contains(have, prereleases=True):
            print(f"keep installed {dist} {have} (needs {spec})", file=sys.stderr); continue
        print(f"will install {w} (installed: {have}, needs {spec})", file=sys.stderr)
    print(os.path.join(d, w))
PYEOF
)
echo "installing ${#WHEELS[@]} wheels"
grep -q '^numpy-2\.3' <(printf '%s\n' "${WHEELS[@]##*/}") && \
  echo "NOTE: numpy will be set to 2.3.5 (vLLM deps: mistral_common needs numpy<2.4, numba 0.65.0 needs <2.5; target had 2.5.2)"
"$PY" -m pip install --no-index --find-links "$DIR" --no-deps "${WHEELS[@]}"

echo "=== pip check (vllm-related lines) ==="
names=$(cut -d' ' -f3 "$DIR/SHA256SUMS" | sed 's/^\*//; s/-[0-9].*//' | tr '_' '-' | sort -u | paste -sd'|')
chk=$("$PY" -m pip check 2>&1 || true)
rel=$(printf '%s\n' "$chk" | tr '_' '-' | grep -iE "(^|[ ,])(vllm|torch|${names})[ ,]" || true)
if [ -n "$rel" ]; then printf '%s\n' "$rel"; else echo "(no vllm-related problems)"; fi
echo "=== import test ==="
"$PY" -c "import vllm; print('vllm', vllm.__version__)"
