#!/usr/bin/env bash
# .ci/run on a fresh clone of this repository's HEAD, in a new venv, while a CPU hog keeps
# each of two cores busy: the suite must pass on a loaded machine (issue 18). Prints the result
# and the wall time; stops the hogs it started.
set -u
here="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
git clone -q "$here" "$work/clone"
python -m venv "$work/venv"
python -c "while True: pass" & hog1=$!
python -c "while True: pass" & hog2=$!
trap 'kill $hog1 $hog2 2>/dev/null' EXIT
start=$(date +%s)
(cd "$work/clone" && PATH="$work/venv/bin:$PATH" bash .ci/run) > "$work/ci.log" 2>&1
rc=$?
echo "rc=$rc in $(( $(date +%s) - start )) s; log: $work/ci.log"
exit $rc
