"""Loading models and tokenizers from local paths or objects, offline, with clear errors."""

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel

from rollout.gguf import convert_gguf


def default_device_dtype(device, dtype) -> tuple[torch.device, torch.dtype]:
    """Defaults chosen before any model is loaded (spec's runners default to the loaded model's device instead):
    CUDA when available, else CPU; float32 on CPU (fast there, and exact logprobs), bfloat16 on GPU. A device or
    dtype given as a string ("cuda:0", "bfloat16") is parsed here; one this machine cannot honour is a ValueError."""
    device = _as_device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        return device, torch.float32 if device.type == "cpu" else torch.bfloat16
    return device, _as_dtype(dtype)


def _as_device(device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r}: not a device ({e}); pass e.g. 'cpu', 'cuda' or 'cuda:1'") from e
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        raise ValueError(f"device={str(device)!r}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                         "pass device='cpu' or an index below that count (None picks one)")
    return device


def _as_dtype(dtype) -> torch.dtype:
    name = dtype.removeprefix("torch.") if isinstance(dtype, str) else None
    value = getattr(torch, name, None) if name else dtype
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype={dtype!r}: expected a floating-point torch dtype or its name, e.g. torch.float32, "
                         "'float32', 'bfloat16' or 'float16'")
    return value


def gguf_folder(model):
    """`model` as the backends load it: a `.gguf` file path becomes the plain HF folder converted from it (once,
    then cached: rollout/gguf.py), so every backend reads a folder; anything else is returned as given."""
    if isinstance(model, (str, os.PathLike)) and os.fspath(model).endswith(".gguf"):
        return str(convert_gguf(model))
    return model


def load_model(model, device: torch.device, dtype: torch.dtype, field: str) -> PreTrainedModel:
    """A loaded causal LM in eval mode: `model` itself when it is one (the runners copy it when its device or
    dtype differ), else loaded from its local folder onto `device` in `dtype`."""
    if isinstance(model, PreTrainedModel):
        return model.eval()
    if not isinstance(model, (str, Path)) or not Path(model).is_dir():
        raise ValueError(f"{field}={model!r}: expected a local model folder, a .gguf file or a loaded "
                         "PreTrainedModel (nothing is downloaded; save the model with save_pretrained and pass its "
                         "folder)")
    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype, local_files_only=True).to(device).eval()


def load_tokenizer(model, tokenizer):
    """The tokenizer given (object or path), else the one saved beside a model path; None if there is none
    (then prompts must be token-id lists)."""
    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        return tokenizer
    path = tokenizer if tokenizer is not None else (model if isinstance(model, (str, Path)) else None)
    if path is None:
        return None
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        if tokenizer is not None:
            raise ValueError(f"tokenizer={tokenizer!r}: cannot load a tokenizer from it ({e})") from e
        return None


def check_same_vocab(target: PreTrainedModel, draft: PreTrainedModel) -> None:
    target_size = target.get_output_embeddings().weight.shape[0]
    draft_size = draft.get_output_embeddings().weight.shape[0]
    if target_size != draft_size:
        raise ValueError(f"draft_model has a vocabulary of {draft_size} tokens, the target {target_size}; "
                         "the draft model must share the target's tokenizer and vocabulary")


DEFAULT_MAX_MODEL_LEN = 2048


def default_max_model_len(config, max_model_len: int | None) -> int:
    """max_model_len, else the model's max_position_embeddings capped at DEFAULT_MAX_MODEL_LEN (the KV cache is
    allocated up front for max_num_seqs x max_model_len positions). Beyond max_position_embeddings is a
    ValueError: the model was not trained for those positions."""
    limit = getattr(config.get_text_config(), "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN
    if max_model_len is None:
        return min(limit, DEFAULT_MAX_MODEL_LEN)
    if max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len} is beyond the model's max_position_embeddings={limit}; "
                         f"pass max_model_len <= {limit} (or None: {min(limit, DEFAULT_MAX_MODEL_LEN)})")
    return max_model_len


def eos_token_ids(generation_config, config) -> set[int]:
    """EOS ids: the generation config's, else the model config's (either may hold one id or a list)."""
    eos = generation_config.eos_token_id if generation_config is not None else None
    eos = config.eos_token_id if eos is None else eos
    return set(eos) if isinstance(eos, (list, tuple)) else ({eos} if eos is not None else set())


def generation_config(path: str) -> GenerationConfig | None:
    """The generation config saved in a model folder (EOS ids), None where there is none."""
    try:
        return GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:
        return None
