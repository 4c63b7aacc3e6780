#!/usr/bin/env bash
# Usage: assemble.sh DIR
# DIR holds the files of all partNN folders copied flat. Rejoins split wheels
# (<wheel>.partaa, .partab, ... concatenated in order), then checks every wheel
# against SHA256SUMS. Exits non-zero and names every missing/mismatching file
# (every one: the checks collect failures instead of stopping at the first).
set -euo pipefail
DIR=${1:?usage: assemble.sh DIR}
cd "$DIR" || { echo "ERROR: cannot cd to $DIR" >&2; exit 2; }
[ -f SHA256SUMS ] || { echo "ERROR: $DIR/SHA256SUMS missing" >&2; exit 2; }
shopt -s nullglob
rc=0
# rejoin split wheels
for first in *.whl.partaa; do
  whl=${first%.partaa}
  pieces=( "$whl".part?? )            # glob sorts lexically: partaa, partab, ...
  echo "joining ${#pieces[@]} pieces -> $whl"
  cat "${pieces[@]}" > "$whl.tmp" && mv -f "$whl.tmp" "$whl" || { echo "ERROR: join failed for $whl" >&2; rc=1; }
done
# verify
bad=()
while read -r sum name; do
  [ -z "${sum:-}" ] && continue
  name=${name#\*}
  if [ ! -f "$name" ]; then bad+=("MISSING $name"); continue; fi
  got=$(sha256sum "$name" | cut -d' ' -f1)
  [ "$got" = "$sum" ] || bad+=("MISMATCH $name")
done < SHA256SUMS
n=$(grep -c . SHA256SUMS)
if [ ${#bad[@]} -gt 0 ]; then
  printf 'ERROR: %s\n' "${bad[@]}" >&2
  echo "FAILED: ${#bad[@]} of $n wheels missing or corrupt" >&2
  exit 1
fi
if [ $rc -ne 0 ]; then exit $rc; fi
echo "OK: all $n wheels present and sha256 verified"
echo "(split pieces *.whl.part?? may now be deleted)"
