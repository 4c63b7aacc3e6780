"""Resolve, download and split the offline vLLM bundle for the GPU machine; run by scripts/vllm_gpu_bundle.sh as
`VENV_PYTHON resolve.py OUTDIR` (OUTDIR/build/ already holds assemble.sh and install.sh).

Stand-in wheels (empty, no requirements) take the place of the target's torch, torchvision, torchaudio and triton;
`pip install --dry-run --report` resolves vLLM for the target's Python and platforms, pinned to what the target has;
every resolved wheel the target lacks, or has in a version vLLM refuses, is downloaded and split into parts.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import string
import subprocess
import sys
import zipfile
from pathlib import Path
from urllib.parse import unquote

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

VLLM = "vllm==0.26.0"
PART_LIMIT = 59_900_000  # bytes a part, notes included: one call carries at most ~60 MB
MAX_PARTS = 18  # calls the carrying session has for it

# Requirements of vLLM that a text model on a Hopper GPU never imports (each is imported inside a function or by
# a module of another model family, a Blackwell kernel, a video or image input, or a JIT path): about 440 MB left
# behind. install.sh installs with --no-deps, so nothing asks for them there. CUTLASS's DSL is left out too: vLLM's
# attention selector imports FlashInfer, which imports `cutlass` when it is there and then fails ("No CTK flavor
# installed") unless the DSL finds its CUDA-13 library; without the DSL FlashInfer imports (H100, 2026-12-05).
UNUSED = frozenset(canonicalize_name(n) for n in """
tokenspeed-triton nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base
nvidia-cutlass-dsl-libs-cu12 nvidia-cutlass-dsl-libs-cu13
nvidia-nvvm nvidia-cuda-nvcc
opencv-python-headless tilelang z3-solver pynvvideocodec torchcodec
""".split())  # fmt: skip

# --- The target ------------------------------------------------------------------------------------------------------
# Source: /work/.library/device/KINDS.md, nvidia-h200 table: its 'pip list' row (2026-11; python3 there is Python
# 3.12.3, /opt/torch/.venv/bin/python3, torch 2.11.0+cu130) and 'Python packages already there' (2026-11-17).
TARGET_PYTHON = "3.12"
TARGET_MARKERS = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "implementation_version": "3.12.3", "platform_python_implementation": "CPython", "os_name": "posix",
    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
    "platform_release": "", "platform_version": "",
}  # fmt: skip
# glibc there not read: manylinux_2_35 at most. pip 23.2.1 does not widen manylinux_2_X to older tags, so all are
# named; the order is pip's preference between two wheels of one version (as the first bundle had it).
TARGET_PLATFORMS = [
    "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux2010_x86_64", "manylinux_2_17_x86_64",
    *(f"manylinux_2_{m}_x86_64" for m in (24, *range(26, 36))), "linux_x86_64",
]  # fmt: skip
# Versions known: the 'pip list' row
TARGET_VERSIONS = {
    "accelerate": "1.15.0", "botorch": "0.18.1", "cupy-cuda13x": "14.2.0", "gpytorch": "1.15.2",
    "huggingface-hub": "1.33.0", "jax": "0.11.2", "jax-cuda13-pjrt": "0.11.2", "jax-cuda13-plugin": "0.11.2",
    "jaxlib": "0.11.2", "jaxtyping": "0.3.11", "numpy": "2.5.2", "numpyro": "0.21.0", "onnx": "1.23.1",
    "onnx-ir": "1.0.0", "onnxruntime": "1.30.0", "onnxscript": "0.7.2", "pytorch-lightning": "2.6.6",
    "safetensors": "0.8.0", "sentence-transformers": "6.0.1", "sentencepiece": "0.2.2", "tiktoken": "0.14.0",
    "tokenizers": "0.23.2", "torch": "2.11.0+cu130", "torch-geometric": "2.8.0.post1", "torchaudio": "2.11.0",
    "torchdiffeq": "0.2.5", "torchmetrics": "1.9.0", "torchvision": "0.26.0", "transformers": "5.17.0",
    "triton": "3.6.0",
    # not in KINDS.md: pinned by torch 2.11.0+cu130's own metadata (cuda-toolkit[...]==13.0.2), so there with it
    "cuda-toolkit": "13.0.2", "nvidia-cuda-runtime": "13.0.96", "nvidia-cuda-nvrtc": "13.0.88",
}  # fmt: skip
# Present, most in versions not known: 'Python packages already there'
TARGET_PRESENT = frozenset(canonicalize_name(n) for n in """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())  # fmt: skip
# The target's own builds; a local label no index has, so pip takes the stand-in
STAND_INS = {
    "torch": "2.11.0+cu130", "torchvision": "0.26.0+cu130", "torchaudio": "2.11.0+cu130", "triton": "3.6.0+dummy",
}  # fmt: skip
# What the target's torch requires (its metadata) and the stand-in does not
TORCH_REQUIRES = ["setuptools<82", "cuda-bindings>=13.0.3,<14"]
# Known versions pip may replace: mistral_common needs numpy<2.4, numba 0.65.0 <2.5; the target has 2.5.2
MAY_REPLACE = {"numpy"}
# Where vLLM leaves room: CUDA compiler pieces of the target's toolkit (13.0.2; nvcc 13.0 there), torchcodec as
# documented for torch 2.11, OpenCV 4 as there
CHOICES = [
    "nvidia-cuda-nvcc==13.0.88.*", "nvidia-cuda-crt==13.0.88.*", "nvidia-nvvm==13.0.88.*",
    "nvidia-cuda-cccl==13.0.85.*", "torchcodec<0.17", "opencv-python-headless<5",
]  # fmt: skip
# ---------------------------------------------------------------------------------------------------------------------


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet", *args], check=True)


def target_flags() -> list[str]:
    return ["--only-binary=:all:", "--python-version", TARGET_PYTHON, *(f"--platform={p}" for p in TARGET_PLATFORMS)]


def make_stand_in(name: str, version: str, folder: Path) -> None:
    """A wheel of METADATA, WHEEL and RECORD only: it satisfies `name==version` and requires nothing."""
    info = f"{name}-{version}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: stand-in\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: resolve.py\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = ""
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record += f"{path},sha256={digest},{len(text)}\n"
    files[f"{info}/RECORD"] = record + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)


def resolve(build: Path) -> list[dict]:
    stand_ins = build / "stand-ins"
    stand_ins.mkdir(exist_ok=True)
    for name, version in STAND_INS.items():
        make_stand_in(name, version, stand_ins)
    pins = [f"{n}=={v}" for n, v in (TARGET_VERSIONS | STAND_INS).items() if n not in MAY_REPLACE]
    (build / "constraints.txt").write_text("\n".join(pins + TORCH_REQUIRES + CHOICES) + "\n")
    # pip 23.2.1 takes --platform only with --target (a dry run writes nothing there); --target also ignores what
    # the venv has, so its own packaging is in the report too
    pip("install", "--dry-run", "--target", str(build / "target"), "--report", str(build / "report.json"),
        *target_flags(), "--find-links", str(stand_ins), "-c", str(build / "constraints.txt"), VLLM)  # fmt: skip
    return json.loads((build / "report.json").read_text())["install"]


def requirements_on(items: list[dict]) -> dict[str, SpecifierSet]:
    """Each name -> the requirements on it in the other wheels' metadata (markers as on the target), joined."""
    lines = list(TORCH_REQUIRES)
    for it in items:
        extras = {"", *(it.get("requested_extras") or [])}
        for line in it["metadata"].get("requires_dist") or []:
            marker = Requirement(line).marker
            if marker is None or any(marker.evaluate({**TARGET_MARKERS, "extra": e}) for e in extras):
                lines.append(line)
    specs: dict[str, list[str]] = {}
    for req in map(Requirement, lines):
        specs.setdefault(canonicalize_name(req.name), []).append(str(req.specifier))
    return {name: SpecifierSet(",".join(s for s in parts if s)) for name, parts in specs.items()}


def category(name: str, spec: SpecifierSet) -> str:
    """'missing', 'known-conflict' and 'conditional' are carried; 'skip-...' are left to the target."""
    if name in UNUSED:
        return "skip-unused"
    if name in STAND_INS:
        return "skip-stand-in"
    if name in TARGET_VERSIONS:
        have = Version(TARGET_VERSIONS[name])
        ok = spec.contains(have, prereleases=True) or spec.contains(Version(have.public), prereleases=True)
        return "skip-known-ok" if ok else "known-conflict"
    if name in TARGET_PRESENT:  # version not known: install.sh checks it there (CONDITIONAL.txt)
        return "conditional" if str(spec) else "skip-present-any-version"
    return "missing"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def pack(wheels: list[Path], every: list[Path], first: list[Path], out: Path) -> list[Path]:
    """Wheels larger than a part are cut into pieces (one a part, named as split(1) names them: .partaa, .partab,
    ...; assemble.sh joins them); the rest go first-fit, largest first. `every` is in each part, `first` in part01."""
    overhead = sum(p.stat().st_size for p in every)
    piece = PART_LIMIT - overhead - sum(p.stat().st_size for p in first)  # so that a piece fits part01 too
    parts: list[list[tuple[str, Path, int, int]]] = [[]]  # (name, source, offset, length)
    used = [PART_LIMIT - piece]
    for wheel in sorted(wheels, key=lambda p: (-p.stat().st_size, p.name)):
        size = wheel.stat().st_size
        if size > piece:
            for i, offset in enumerate(range(0, size, piece)):
                if parts[-1]:
                    parts.append([])
                    used.append(overhead)
                suffix = string.ascii_lowercase[i // 26] + string.ascii_lowercase[i % 26]
                parts[-1].append((f"{wheel.name}.part{suffix}", wheel, offset, min(piece, size - offset)))
                used[-1] += min(piece, size - offset)
            continue
        k = next((k for k, u in enumerate(used) if u + size <= PART_LIMIT), len(parts))
        if k == len(parts):
            parts.append([])
            used.append(overhead)
        parts[k].append((wheel.name, wheel, 0, size))
        used[k] += size
    folders = []
    for k, items in enumerate(parts, 1):
        folder = out / f"part{k:02d}"
        folder.mkdir()
        for name, src, offset, length in items:
            if length == src.stat().st_size:
                os.link(src, folder / name)  # a hard link: no second copy on disk
            else:
                with src.open("rb") as f:
                    f.seek(offset)
                    (folder / name).write_bytes(f.read(length))
        for note in every + (first if k == 1 else []):
            shutil.copy2(note, folder / note.name)
        assert sum(p.stat().st_size for p in folder.iterdir()) <= PART_LIMIT, folder
        folders.append(folder)
    return folders


def main(out: Path) -> None:
    build = out / "build"
    items = sorted(resolve(build), key=lambda it: canonicalize_name(it["metadata"]["name"]))
    specs = requirements_on(items)
    carried: list[tuple[Path, str, str, str]] = []  # (wheel, category, name, requirement)
    kept: list[str] = []
    reqs: list[str] = []
    for it in items:
        name = canonicalize_name(it["metadata"]["name"])
        cat = category(name, specs.get(name, SpecifierSet()))
        if cat.startswith("skip"):
            kept.append(f"{name}({cat})")
            continue
        wheel = build / "wheels" / unquote(it["download_info"]["url"].rsplit("/", 1)[1])
        carried.append((wheel, cat, name, str(specs.get(name, ""))))
        # the pin names the version, the report's hash the very file pip chose in the resolution
        algo, digest = it["download_info"]["archive_info"]["hash"].split("=", 1)
        reqs.append(f"{name}=={it['metadata']['version']} --hash={algo}:{digest}\n")
    (build / "carry-reqs.txt").write_text("".join(reqs))
    pip("download", "--no-deps", *target_flags(), "-d", str(build / "wheels"), "-r", str(build / "carry-reqs.txt"))
    if lost := [w.name for w, *_ in carried if not w.is_file()]:
        sys.exit(f"resolve.py: pip download did not give {lost}")

    (build / "SHA256SUMS").write_text("".join(f"{sha256(w)}  {w.name}\n" for w, *_ in sorted(carried)))
    conditional = [f"{w.name}\t{n}\t{s}\n" for w, c, n, s in sorted(carried) if c == "conditional"]
    (build / "CONDITIONAL.txt").write_text(
        "# wheel<TAB>dist<TAB>specifier  -- installed by install.sh only if the target's installed version does "
        "not satisfy specifier\n" + "".join(conditional)
    )
    by_size = sorted(carried, key=lambda r: (-r[0].stat().st_size, r[0].name))
    (build / "CARRIED.txt").write_text(
        "# size_bytes\tcategory\twheel\tspec(aggregated requirement)\n"
        + "".join(f"{w.stat().st_size}\t{c}\t{w.name}\t{s}\n" for w, c, _, s in by_size)
        + f"# NOT carried (target has them): {', '.join(kept)}\n"
    )

    for old in out.glob("part[0-9][0-9]"):  # a rerun's parts replace the last run's
        shutil.rmtree(old)
    notes = [build / n for n in ("SHA256SUMS", "CONDITIONAL.txt", "assemble.sh", "install.sh", "CARRIED.txt")]
    folders = pack([w for w, *_ in carried], notes[:2], notes[2:], out)
    total = sum(w.stat().st_size for w, *_ in carried)
    print(f"resolve.py: {len(carried)} wheels ({total:,} bytes) carried, {len(kept)} left to the target")
    for folder in folders:
        files = list(folder.iterdir())
        print(f"  {folder.name} {sum(p.stat().st_size for p in files):>11,} bytes, {len(files)} files")
    if len(folders) > MAX_PARTS:
        print(f"resolve.py: WARNING: {len(folders)} parts, more than the {MAX_PARTS} calls planned", file=sys.stderr)


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
