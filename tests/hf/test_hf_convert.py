"""``hf.convert_gguf``: a GGUF checkpoint de-quantised once into a plain model folder that loads
to the very weights and tokenizer the GGUF gives, reused while the file is unchanged and made
again when it changes; a folder holding anything else is refused."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import hf_tiny
import pytest
import torch

import flowrl
from flowrl import hf

if TYPE_CHECKING:
    from pathlib import Path

pytest.importorskip("gguf")


def weights(path: str, **gguf: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True, **gguf)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_gguf_file_is_converted_once_to_the_same_weights_and_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    source = tmp_path / "src"
    lm = hf.LM(path=str(source), gguf_file=hf_tiny.write_gguf(source))
    out = hf.convert_gguf(lm, tmp_path / "converted")
    assert out.gguf_file is None and out.path == str((tmp_path / "converted").resolve())
    expected = weights(str(source), gguf_file="tiny.gguf")
    got = weights(out.path)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    text = "what is seven plus two"
    ours, theirs = (
        AutoTokenizer.from_pretrained(out.path),
        AutoTokenizer.from_pretrained(str(source), gguf_file="tiny.gguf"),
    )
    assert ours(text)["input_ids"] == theirs(text)["input_ids"] and ours.pad_token == "<|pad|>"
    # the same file again: the folder is reused, not written anew
    saved = (tmp_path / "converted" / "model.safetensors").stat().st_mtime_ns
    assert hf.convert_gguf(lm, tmp_path / "converted") == out
    assert (tmp_path / "converted" / "model.safetensors").stat().st_mtime_ns == saved
    # a policy reads it like any model folder
    policy = hf.HFPolicy("policy", lm=out, sampling={"max_new_tokens": 2})
    policy.setup()
    assert all(torch.equal(policy.module.state_dict()[k], v) for k, v in expected.items())


def test_a_converted_folder_names_no_gguf_quantization(tmp_path: Path) -> None:
    """Other loaders (vLLM) read a config's quantization and would look for the GGUF file."""
    import json

    source = tmp_path / "src"
    out = hf.convert_gguf(hf.LM(path=str(source), gguf_file=hf_tiny.write_gguf(source)), tmp_path / "converted")
    config = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert out.gguf_file is None


def test_a_model_of_random_weights_is_saved_once_with_the_weights_every_replica_builds(tmp_path: Path) -> None:
    from flowrl.hf.convert import saved_random

    lm = hf.LM(config=hf_tiny.llama(), tokenizer=hf_tiny.make_tokenizer(tmp_path / "tok"), seed=7)
    out = saved_random(lm, tmp_path / "random")
    assert out.config is None and out.path == str((tmp_path / "random").resolve())
    built = hf.HFReference("built", lm=lm)
    built.setup()
    got = weights(out.path)
    assert all(torch.equal(got[k], v) for k, v in built.module.state_dict().items())
    saved = (tmp_path / "random" / "model.safetensors").stat().st_mtime_ns
    assert saved_random(lm, tmp_path / "random") == out  # the same config and seed: reused
    assert (tmp_path / "random" / "model.safetensors").stat().st_mtime_ns == saved
    other = saved_random(hf.LM(config=hf_tiny.llama(), tokenizer=lm.tokenizer, seed=8), tmp_path / "random")
    # another seed: saved anew
    assert not torch.equal(weights(str(other.path))["lm_head.weight"], got["lm_head.weight"])


def test_a_changed_gguf_file_is_converted_again(tmp_path: Path) -> None:
    source = tmp_path / "src"
    lm = hf.LM(path=str(source), gguf_file=hf_tiny.write_gguf(source, seed=0))
    first = weights(hf.convert_gguf(lm, tmp_path / "converted").path)
    hf_tiny.write_gguf(source, seed=1)
    stat = (source / "tiny.gguf").stat()  # a new modification time, even on a coarse clock
    os.utime(source / "tiny.gguf", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    second = weights(hf.convert_gguf(lm, tmp_path / "converted").path)
    key = "model.embed_tokens.weight"
    assert not torch.equal(first[key], second[key])
    assert torch.equal(second[key], weights(str(source), gguf_file="tiny.gguf")[key])


def test_convert_gguf_refuses_what_it_cannot_use_and_keeps_other_models(tmp_path: Path) -> None:
    plain = hf.LM(path=str(tmp_path))
    assert hf.convert_gguf(plain, tmp_path / "x") is plain  # nothing to convert
    with pytest.raises(flowrl.ConfigError, match=r"convert_gguf: LM.gguf_file='none.gguf': no file .*none.gguf"):
        hf.convert_gguf(hf.LM(path=str(tmp_path), gguf_file="none.gguf"), tmp_path / "x")
    source = tmp_path / "src"
    lm = hf.LM(path=str(source), gguf_file=hf_tiny.write_gguf(source))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(flowrl.ConfigError, match=r"holds something else than a converted model"):
        hf.convert_gguf(lm, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
