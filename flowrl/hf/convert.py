"""A GGUF checkpoint de-quantised once into a plain model folder, so that every replica and
trainer rank loads safetensors instead of de-quantising the file itself (SmolLM2-135M's GGUF:
16-32 s per load on two CPU cores, its converted folder 0.5-4 s; docs/hf.md)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from .._core.errors import ConfigError

if TYPE_CHECKING:
    from .config import LM


def cache_folder() -> Path:
    """Where converted and saved models go: ``$XDG_CACHE_HOME/flowrl`` or ``~/.cache/flowrl``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flowrl"


MARK = "flowrl-gguf.json"  # in a converted folder: which file it came from
FORMAT = 2  # 2: the config no longer names the GGUF quantization (vLLM refused such a folder)


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
    stamp = {
        "gguf": str(source),
        "size": info.st_size,
        "mtime_ns": info.st_mtime_ns,
        "tokenizer": lm.tokenizer is None,
        "format": FORMAT,
    }
    out = Path(folder).expanduser().resolve()
    if _stamp(out) != stamp:
        _check_free(out)
        _write(out, stamp, lambda part: _convert(lm, source, part))
    return msgspec.structs.replace(lm, path=str(out), gguf_file=None)


def saved_random(lm: LM, folder: str | Path) -> LM:
    """``lm`` built from ``config=`` (random weights from ``seed``, as every replica and trainer
    builds them) and read from ``folder`` instead: saved there in float32 with its tokenizer on
    the first call, reused while the config, seed and tokenizer are the same. For loaders that
    read only folders (vLLM). An ``lm`` with ``path`` is returned as it is."""
    if lm.config is None:
        return lm
    # as the stamp file reads back (a config's tuples become lists)
    stamp = json.loads(json.dumps({"config": lm.config, "seed": lm.seed, "tokenizer": lm.tokenizer, "format": FORMAT}))
    out = Path(folder).expanduser().resolve()
    if _stamp(out) != stamp:
        _check_free(out)
        _write(out, stamp, lambda part: _save_random(lm, part))
    return msgspec.structs.replace(lm, path=str(out), config=None)


def _save_random(lm: LM, part: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from .loading import load_tokenizer, random_model

    tokenizer = load_tokenizer(lm, "saved_random")
    random_model(AutoModelForCausalLM, lm, torch.float32, tokenizer).save_pretrained(part)
    tokenizer.save_pretrained(part)


def _check_free(out: Path) -> None:
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and _stamp(out) is None)):
        raise ConfigError(f"{out} holds something else than a converted model; give a new or empty folder")


def _write(out: Path, stamp: dict[str, Any], save: Any) -> None:
    """``save(folder)`` into a folder beside ``out``, then renamed to it with ``stamp``: a
    reader never sees half a folder."""
    out.parent.mkdir(parents=True, exist_ok=True)
    part = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        save(part)
        (part / MARK).write_text(json.dumps(stamp))
        if out.exists():  # an older conversion, or an empty folder (checked by the caller)
            shutil.rmtree(out, ignore_errors=True)
        try:
            part.rename(out)
        except OSError:
            if _stamp(out) != stamp:  # else another process wrote the same meanwhile
                raise
    finally:
        shutil.rmtree(part, ignore_errors=True)


def _stamp(folder: Path) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = json.loads((folder / MARK).read_text())
    except (OSError, ValueError):
        return None
    return found


def _convert(lm: LM, source: Path, part: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": lm.trust_remote_code}
    folder, name = str(source.parent), source.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, **kwargs)
    # transformers refuses to save a model it read from a GGUF file; a model of the same
    # config holding the same tensors saves as any other. The tensors are de-quantised: a
    # config still naming the GGUF quantization would send other loaders (vLLM) to the file
    config = loaded.config
    config.__dict__.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(part)
    if lm.tokenizer is None:
        AutoTokenizer.from_pretrained(folder, gguf_file=name, **kwargs).save_pretrained(part)
