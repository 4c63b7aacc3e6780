# Sourced by the device scripts: Ray, msgspec and the rest from the carried wheels (.whl/, made by
# benchmarks/gpu/wheels.sh) into /tmp/site where the machine lacks them, with their `ray` command
# first on PATH (a bare `ray` is not there: installed with --target, it lands in /tmp/site/bin). A call
# after the one that installed them (the machine still warm) need not carry the wheels again.
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
if ! python3 -c "import ray, msgspec, gguf" 2>/dev/null; then
  ls .whl/*.whl > /dev/null 2>&1 || { echo "no Ray here and no wheels in .whl/: run benchmarks/gpu/wheels.sh and carry .whl" >&2; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing the wheels of .whl/ failed" >&2; exit 1; }
fi
if [ -d /tmp/site ]; then
  case ":${PYTHONPATH:-}:" in *:/tmp/site:*) ;; *) export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} ;; esac
  export PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0
command -v ray > /dev/null || { echo "the ray command is not on PATH" >&2; exit 1; }
