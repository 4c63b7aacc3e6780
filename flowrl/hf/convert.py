"""A GGUF checkpoint de-quantised once into a plain model folder, so that every replica and
trainer rank loads safetensors instead of de-quantising the file itself (SmolLM2-135M's GGUF:
16-32 s per load on two CPU cores, its converted folder 0.5-4 s; docs/hf.md)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from .._core.errors import ConfigError

if TYPE_CHECKING:
    from .config import LM

MARK = "flowrl-gguf.json"  # in a converted folder: which file it came from


def convert_gguf(lm: LM, folder: str | Path) -> LM:
    """``lm`` read from ``folder`` instead of its GGUF file: the file de-quantised (float32) and
    saved there with ``save_pretrained``, with its tokenizer unless ``lm.tokenizer`` names one,
    on the first call; later calls reuse the folder while the file is the same (path, size and
    modification time) and so is the choice of tokenizer. An ``lm`` without ``gguf_file`` is
    returned as it is. ``folder`` must be new, empty or an earlier conversion: nothing else in it
    is overwritten."""
    if lm.gguf_file is None:
        return lm
    source = (Path(lm.path or ".").expanduser() / lm.gguf_file).resolve()
    if not source.is_file():
        raise ConfigError(f"convert_gguf: LM.gguf_file={lm.gguf_file!r}: no file {source}")
    info = source.stat()
    stamp = {"gguf": str(source), "size": info.st_size, "mtime_ns": info.st_mtime_ns, "tokenizer": lm.tokenizer is None}
    out = Path(folder).expanduser().resolve()
    if _stamp(out) != stamp:
        if out.exists() and (not out.is_dir() or (any(out.iterdir()) and _stamp(out) is None)):
            raise ConfigError(
                f"convert_gguf: {out} holds something else than a converted model; give a new or empty folder"
            )
        _convert(lm, source, out, stamp)
    return msgspec.structs.replace(lm, path=str(out), gguf_file=None)


def _stamp(folder: Path) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = json.loads((folder / MARK).read_text())
    except (OSError, ValueError):
        return None
    return found


def _convert(lm: LM, source: Path, out: Path, stamp: dict[str, Any]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    # written beside it, then renamed: a reader never sees half a folder
    part = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": lm.trust_remote_code}
        loaded = AutoModelForCausalLM.from_pretrained(
            str(source.parent), gguf_file=source.name, dtype=torch.float32, **kwargs
        )
        # transformers refuses to save a model it read from a GGUF file; a model of the same
        # config holding the same tensors saves as any other
        model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(part)
        if lm.tokenizer is None:
            AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name, **kwargs).save_pretrained(part)
        (part / MARK).write_text(json.dumps(stamp))
        if out.exists():  # an older conversion, or an empty folder (checked by the caller)
            shutil.rmtree(out, ignore_errors=True)
        try:
            part.rename(out)
        except OSError:
            if _stamp(out) != stamp:  # else another process converted the same file meanwhile
                raise
    finally:
        shutil.rmtree(part, ignore_errors=True)
