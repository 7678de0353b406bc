"""Loading models and tokenizers from local paths or objects, offline, with clear errors."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel


def default_device_dtype(device, dtype) -> tuple[torch.device, torch.dtype]:
    """Defaults chosen before any model is loaded (spec's runners default to the loaded model's device instead):
    CUDA when available, else CPU; float32 on CPU (fast there, and exact logprobs), bfloat16 on GPU."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    return device, dtype


def load_model(model, device: torch.device, dtype: torch.dtype, field: str) -> PreTrainedModel:
    """A loaded causal LM in eval mode: `model` itself when it is one (the runners copy it when its device or
    dtype differ), else loaded from its local folder onto `device` in `dtype`."""
    if isinstance(model, PreTrainedModel):
        return model.eval()
    if not isinstance(model, (str, Path)) or not Path(model).is_dir():
        raise ValueError(f"{field}={model!r}: expected a local model folder or a loaded PreTrainedModel "
                         "(nothing is downloaded; save the model with save_pretrained and pass its folder)")
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
    allocated up front for max_num_seqs x max_model_len positions)."""
    return max_model_len or min(config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)


def eos_token_ids(generation_config, config) -> set[int]:
    """EOS ids: the generation config's, else the model config's (either may hold one id or a list)."""
    eos = generation_config.eos_token_id if generation_config is not None else None
    eos = config.eos_token_id if eos is None else eos
    return set(eos) if isinstance(eos, (list, tuple)) else ({eos} if eos is not None else set())
