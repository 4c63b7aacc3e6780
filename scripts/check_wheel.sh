#!/usr/bin/env bash
# Build flowrl's sdist and wheel (python -m build: the wheel is built from the sdist), install the
# wheel into a fresh venv and run it from a folder outside the checkout, so that only the installed
# package can be imported: flowrl.__file__ must lie in the venv, `flowrl --version` must say the
# project's version, and the README's first command (smoke mode) and `flowrl run` must work.
# The venv sees the machine's packages (--system-site-packages) for the heavy dependencies (torch,
# ray); the wheel goes in with --no-deps. An editable install of the checkout there does not
# shadow it: the venv's site-packages come first on sys.path, and setuptools' editable finder
# comes after the path finder.
#   bash scripts/check_wheel.sh            (PYTHON=... picks the interpreter; KEEP=1 keeps the folder)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/flowrl-wheel.XXXXXX")"
[[ "${KEEP:-0}" == 1 ]] || trap 'rm -rf "$WORK"' EXIT
unset PYTHONPATH  # nothing but the venv decides what `import flowrl` finds
export PYTHONNOUSERSITE=1

echo "== build (sdist, then the wheel from it) into $WORK/dist"
"$PYTHON" -m build --outdir "$WORK/dist" "$REPO" >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; exit 1; }
WHEELS=("$WORK"/dist/*.whl)
[[ ${#WHEELS[@]} == 1 ]] || { echo "check_wheel: expected one wheel, found ${WHEELS[*]}"; exit 1; }

echo "== a fresh venv, the wheel installed with --no-deps"
"$PYTHON" -m venv --system-site-packages "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$VPY" -m pip install --quiet --no-deps "${WHEELS[0]}"

cd "$WORK"  # outside the checkout: its flowrl/ folder is not on sys.path here
echo "== the installed package, from $WORK"
"$VPY" - "$WORK/venv" "$REPO/pyproject.toml" <<'EOF'
import importlib.metadata, importlib.util, pathlib, sys, tomllib

import flowrl

venv, pyproject = pathlib.Path(sys.argv[1]).resolve(), pathlib.Path(sys.argv[2])
where = pathlib.Path(flowrl.__file__).resolve()
assert where.is_relative_to(venv), f"flowrl was imported from {where}, not from the venv {venv}"
wanted = tomllib.loads(pyproject.read_text())["project"]["version"]
assert importlib.metadata.version("flowrl") == wanted, (importlib.metadata.version("flowrl"), wanted)
for name in ("_core", "_sim", "_backends", "_pipeline", "_engine", "_tools", "hf", "rl"):
    spec = importlib.util.find_spec(f"flowrl.{name}")
    assert spec is not None and spec.origin is not None, f"flowrl.{name} is not in the wheel"
    assert pathlib.Path(spec.origin).resolve().is_relative_to(venv), f"flowrl.{name} from {spec.origin}"
assert (where.parent / "py.typed").is_file(), "py.typed is not in the wheel"
print(f"flowrl {wanted} from {where.parent}")
EOF
VERSION="$("$WORK/venv/bin/flowrl" --version)"
[[ "$VERSION" == "flowrl $("$VPY" -c 'import importlib.metadata as m; print(m.version("flowrl"))')" ]] \
    || { echo "check_wheel: flowrl --version said '$VERSION'"; exit 1; }
echo "$VERSION"

echo "== the README's first command, smoke mode"
# under 10 episodes the example does not judge its reward: exit status 0 means it ran through
status=0
"$VPY" "$REPO/examples/ppo_tiny.py" --backend inprocess --episodes 2 >"$WORK/example.log" 2>&1 || status=$?
cat "$WORK/example.log"
if ! grep -q "^mean reward: first" "$WORK/example.log" || [[ $status != 0 ]] || grep -q "^Traceback" "$WORK/example.log"; then
    echo "check_wheel: examples/ppo_tiny.py did not run to its summary (exit status $status)"
    exit 1
fi

echo "== flowrl run on the example's run file, from outside its folder; then flowrl trace on the run folder"
"$WORK/venv/bin/flowrl" run "$REPO/examples/ppo_tiny.yaml" --set run.num_episode=1 --set run.progress=off \
    --set run.pipeline.backend=inprocess --set models.ppo_policy.num_replicas=1
RUNS=(runs/ppo_tiny-*)
[[ ${#RUNS[@]} == 1 && -f "${RUNS[0]}/metrics.jsonl" ]] || { echo "check_wheel: no run folder in $WORK/runs"; exit 1; }
"$WORK/venv/bin/flowrl" trace "${RUNS[0]}" --no-png >/dev/null
echo "check_wheel: the wheel installs and runs"
