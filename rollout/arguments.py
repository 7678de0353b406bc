"""Checks of `RolloutGenerator`'s arguments, run before anything loads: each bad value is a ValueError naming the
argument, the value and the fix; a value the chosen backend cannot honour is refused, never substituted."""

import os

from transformers import AutoConfig, PreTrainedModel

from rollout.defaults import BACKENDS
from rollout.sampling_params import SamplingParams
from spec import SpecConfig
from spec.drafting_host import MAX_DRAFTER_FAULTS
from spec.checks import check_bool, check_int, check_optional_int, check_token_ids

MAX_SEED = 2 ** 32 - 1  # vLLM seeds numpy's global RNG with the generator's seed, which takes 32 bits


def check_generator_args(*, model, tokenizer, draft_model, max_num_seqs, max_model_len, device, seed, backend,
                         vllm_kwargs, base_url=None, server_kwargs=None, speculative_config=None,
                         max_drafter_faults=MAX_DRAFTER_FAULTS) -> None:
    """Types and ranges of RolloutGenerator's arguments (dtype and device strings are parsed by
    rollout.loading.default_device_dtype; max_model_len is checked against the model once its config is read),
    and arguments the chosen backend never reads."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: choose 'embedded' (this package's engine), 'vllm' (vllm.LLM in this "
                         "process) or 'server' (a running vLLM server at base_url)")
    _check_backend_fields(backend, vllm_kwargs=vllm_kwargs, base_url=base_url,
                          server_kwargs=server_kwargs, speculative_config=speculative_config)
    check_int("max_drafter_faults", max_drafter_faults, 0,
              hint=" (drafter faults a call tolerates before it stops drafting; 0 makes the first one fail the call)")
    if backend == "server" and max_drafter_faults != MAX_DRAFTER_FAULTS:
        raise ValueError(f"max_drafter_faults={max_drafter_faults} with backend='server': a server runs the drafter "
                         "with the limit it was started with; pass --max-drafter-faults to python -m rollout serve")
    if backend == "server" and model is None:
        return  # the server's own folders, read from it
    if model is None:
        raise ValueError(f"model=None: backend={backend!r} needs a model (a local HF folder, a loaded model, or "
                         "'default')")
    _check_model("model", model)
    if draft_model is not None:
        _check_model("draft_model", draft_model)
    _check_tokenizer(tokenizer)
    check_int("max_num_seqs", max_num_seqs, 1, hint=" (running requests at most)")
    check_optional_int("max_model_len", max_model_len, 1,
                       hint=" (None: the model's max_position_embeddings, capped at 2048)")
    check_int("seed", seed, 0, MAX_SEED)
    if backend != "embedded" and device is not None:
        raise ValueError(f"device={device!r}: backend={backend!r} places the model itself; drop device (or pass "
                         "vllm_kwargs for vLLM's own placement settings)")
    if vllm_kwargs is not None and not isinstance(vllm_kwargs, dict):
        raise ValueError(f"vllm_kwargs={vllm_kwargs!r}: must be a dict of vllm.LLM arguments, e.g. "
                         '{"gpu_memory_utilization": 0.5}')


def _check_backend_fields(backend: str, *, vllm_kwargs, base_url, server_kwargs,
                          speculative_config) -> None:
    if backend == "server" and not base_url:
        raise ValueError("backend='server' needs base_url, the running server's URL (e.g. 'http://127.0.0.1:8000'; "
                         "start one with python -m rollout serve --model FOLDER --speculative-config JSON)")
    read_only_by = {"vllm_kwargs": ("vllm", vllm_kwargs), "base_url": ("server", base_url),
                    "server_kwargs": ("server", server_kwargs)}
    for name, (reader, value) in read_only_by.items():
        if value is not None and backend != reader:
            raise ValueError(f"{name} is only read with backend={reader!r}; drop it or set backend={reader!r}")
    if backend == "server" and speculative_config is not None:
        raise ValueError("speculative_config with backend='server': the server runs the config it was started with "
                         "(read from its /server_info); drop speculative_config, or restart the server with "
                         "--speculative-config JSON")


def as_spec_config(speculative_config, draft_model) -> SpecConfig | None:
    """The SpecConfig of a dict, a JSON string (as vLLM's CLI takes it) or a SpecConfig; None stays None.

    For method "draft_model", `draft_model` fills in a missing `model` (its path, or a loaded model's name);
    a draft_model without a draft_model config is refused: it would be loaded for nothing.
    """
    if isinstance(speculative_config, str):
        speculative_config = SpecConfig.parse_json(speculative_config)
    if speculative_config is not None and not isinstance(speculative_config, (dict, SpecConfig)):
        raise ValueError(f"speculative_config={speculative_config!r}: expected a dict (or its JSON), e.g. "
                         '{"method": "ngram", "num_speculative_tokens": 4}, a SpecConfig, or None')
    method = getattr(speculative_config, "method", None) or (speculative_config or {}).get("method")
    if draft_model is not None and method != "draft_model":
        raise ValueError(f"draft_model={_name(draft_model)!r} is given but the speculative method is {method!r}; "
                         'pass speculative_config={"method": "draft_model", "num_speculative_tokens": 4} to draft '
                         "with it, or drop draft_model")
    if not isinstance(speculative_config, dict):
        return speculative_config
    config = dict(speculative_config)
    if draft_model is not None and not config.get("model"):
        config["model"] = _name(draft_model)
    return SpecConfig.from_dict(config)


def model_vocab_size(model) -> int | None:
    """The target's vocabulary size (a loaded model's config, else the config.json in its folder); None where
    the config does not say."""
    if isinstance(model, PreTrainedModel):
        config = model.config
    else:
        config = AutoConfig.from_pretrained(model, local_files_only=True)
    return getattr(config.get_text_config(), "vocab_size", None)


def check_call_args(params, num_generations, use_tqdm, vocab_size: int | None) -> None:
    """generate()'s arguments: params a SamplingParams (or, for backend='vllm', a vllm.SamplingParams), its stop
    ids inside the model's vocabulary."""
    if not isinstance(params, SamplingParams) and not type(params).__module__.startswith("vllm"):
        raise ValueError(f"sampling_params={params!r}: expected a rollout.SamplingParams, e.g. "
                         "SamplingParams(temperature=1.0, max_tokens=64)")
    check_int("num_generations", num_generations, 1)
    check_bool("use_tqdm", use_tqdm)
    check_token_ids("stop_token_ids", getattr(params, "stop_token_ids", None) or (), vocab_size)


def _check_model(name: str, model) -> None:
    if not isinstance(model, (str, os.PathLike, PreTrainedModel)):
        raise ValueError(f"{name}={model!r}: expected a local model folder (str or Path) or a loaded "
                         "PreTrainedModel")


def _check_tokenizer(tokenizer) -> None:
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        return
    if not (callable(tokenizer) and hasattr(tokenizer, "decode")):
        raise ValueError(f"tokenizer={tokenizer!r}: expected a tokenizer folder (str or Path) or a loaded "
                         "transformers tokenizer (callable, with decode)")


def _name(draft_model) -> str:
    if isinstance(draft_model, (str, os.PathLike)):
        return os.fspath(draft_model)
    return getattr(draft_model, "name_or_path", None) or "draft"


def check_rollouts(prompt_ids, completion_ids, vocab_size: int | None) -> None:
    """Finished rollouts for the rollout history: two lists of token-id lists of one length (rollout i is
    prompt_ids[i] followed by completion_ids[i]), each prompt non-empty, every id in the target's vocabulary."""
    if not isinstance(prompt_ids, (list, tuple)) or not isinstance(completion_ids, (list, tuple)) \
            or len(prompt_ids) != len(completion_ids):
        raise ValueError(f"prompt_ids ({_describe(prompt_ids)}) and completion_ids ({_describe(completion_ids)}): "
                         "expected two lists of token-id lists of the same length, rollout i being prompt_ids[i] "
                         "followed by completion_ids[i]")
    for i, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError(f"prompt_ids[{i}]={prompt!r}: expected a non-empty list of token ids")
        if not isinstance(completion, (list, tuple)):
            raise ValueError(f"completion_ids[{i}]={completion!r}: expected a list of token ids")
        check_token_ids(f"prompt_ids[{i}]", prompt, vocab_size)
        check_token_ids(f"completion_ids[{i}]", completion, vocab_size)


def _describe(value) -> str:
    return f"{len(value)} items" if isinstance(value, (list, tuple)) else type(value).__name__
