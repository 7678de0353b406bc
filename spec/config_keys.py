"""Every key of the speculative config (SpecConfig, spec/config.py), defined once: its check (the one place its value
is validated: SpecConfig and the drafters that take it as an argument call check_keys) and the engines that honour
it. docs/config.md's table is KEYS written out; tests/test_config_keys.py holds the two equal.

Engines:
- EMBEDDED: this package's engine (SpecConfig.check_embedded);
- VLLM: vLLM running one of its own drafters (SpecConfig.to_vllm);
- VLLM_PROJECT: vLLM running this project's drafters (PROTOCOL_METHODS: `history`, `custom_class`) through its
  custom_class hook (0.32/0.33) or as a registered speculator (0.34+); the drafter in vLLM's workers reads the whole
  config (SpecConfig.check_vllm_protocol).
An engine that does not honour a key refuses it (NotImplementedError) when it is set away from its default: a config
never means less on one engine than on another without saying so.
"""

from dataclasses import dataclass
from typing import Callable

from spec.checks import check_bool, check_int, check_number, check_optional_int
from spec.schedule import validate_ranges

EMBEDDED, VLLM, VLLM_PROJECT = "embedded", "vllm", "vllm_project"
ENGINE_NAMES = {EMBEDDED: "the embedded engine", VLLM: "vLLM with its own drafters",
                VLLM_PROJECT: "vLLM with this project's drafters (history, custom_class)"}
ALL = frozenset(ENGINE_NAMES)

EMBEDDED_METHODS = ("draft_model", "ngram", "suffix", "history", "custom_class")
# drafters to this project's Proposer protocol (spec/proposers/base.py): vLLM runs them through the project's own
# classes (rollout/vllm_backend/: its custom_class hook or a registered speculator, by vLLM version), not to_vllm
PROTOCOL_METHODS = ("history", "custom_class")
VLLM_ONLY_METHODS = ("eagle", "eagle3", "mtp", "dflash", "dspark", "medusa", "mlp_speculator")
REJECTION_SAMPLE_METHODS = ("standard", "synthetic", "block")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")


@dataclass(frozen=True)
class Key:
    check: Callable[[str, object], None]  # (name, value): ValueError naming the key, the value and the fix
    engines: frozenset = ALL
    why: str = ""  # for an engine that does not honour it: why, and what to do instead
    also_default: tuple = ()  # values that mean what the default means (a drafter on one device)


def _choice(choices: tuple) -> Callable[[str, object], None]:
    def check(name: str, value) -> None:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{name}={value!r} is not supported; choose one of {list(choices)}")
    return check


def _int(minimum: int, hint: str = "") -> Callable[[str, object], None]:
    return lambda name, value: check_int(name, value, minimum, hint=hint)


def _optional_int(minimum: int, hint: str = "") -> Callable[[str, object], None]:
    return lambda name, value: check_optional_int(name, value, minimum, hint=hint)


def _number(expected: str, is_within) -> Callable[[str, object], None]:
    return lambda name, value: check_number(name, value, expected, is_within)


def _model(name: str, value) -> None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{name}={value!r}: must be a path (str) or \"pkg.module.Class\" (custom_class)")


def _schedule(name: str, value) -> None:
    if value is not None:
        validate_ranges(value)


EMBEDDED_AND_PROJECT = frozenset({EMBEDDED, VLLM_PROJECT})
ONLY_VLLM = frozenset({VLLM})
NGRAM_ONLY = "read by method 'ngram', which vLLM runs as its own drafter; drop it"
HISTORY_ONLY = "read by method 'history', this project's drafter; drop it, or use method 'history'"
VLLMS_OWN = "a setting of vLLM's own drafters; drop it, or use one of them"
KEYS: dict[str, Key] = {
    "method": Key(_choice(EMBEDDED_METHODS + VLLM_ONLY_METHODS)),
    "num_speculative_tokens": Key(_int(1, hint="; to turn speculation off at some batch sizes use "
                                                "num_speculative_tokens_per_batch_size with K=0, or pass no "
                                                "speculative config at all")),
    "model": Key(_model),
    "num_speculative_tokens_per_batch_size": Key(_schedule),
    "enable_adaptive_verification": Key(check_bool),
    "enable_measured_guard": Key(check_bool, EMBEDDED_AND_PROJECT,
                                 "the guard runs around this project's drafting host, which vLLM's own drafters do "
                                 "not use; drop it, or use method 'history'"),
    "rejection_sample_method": Key(_choice(REJECTION_SAMPLE_METHODS), ONLY_VLLM,
                                   "the others verify losslessly with 'standard'; drop it, or use one of vLLM's own "
                                   "drafters"),
    "draft_sample_method": Key(_choice(DRAFT_SAMPLE_METHODS), frozenset({EMBEDDED, VLLM}),
                               "vLLM verifies this project's drafters' drafts as point proposals; use 'greedy'"),
    "prompt_lookup_min": Key(_int(1), frozenset({EMBEDDED, VLLM}), NGRAM_ONLY),
    "prompt_lookup_max": Key(_int(1), frozenset({EMBEDDED, VLLM}), NGRAM_ONLY),
    "suffix_decoding_max_tree_depth": Key(_int(2, hint=" (vLLM's default is 24; matching needs a context token and "
                                                       "a continuation)")),
    "suffix_decoding_max_cached_requests": Key(_int(0, hint=" (0 disables the global cache of finished outputs)")),
    "suffix_decoding_max_cached_tokens": Key(_int(0, hint=" (0 disables the global cache of finished outputs)"),
                                             EMBEDDED_AND_PROJECT,
                                             "vLLM's own suffix cache is bounded by "
                                             "suffix_decoding_max_cached_requests alone; drop it, or use method "
                                             "'history'"),
    "suffix_decoding_max_spec_factor": Key(_number(">= 0 (vLLM's default is 1.0)", lambda factor: factor >= 0)),
    "suffix_decoding_min_token_prob": Key(_number("in [0, 1] (vLLM's default is 0.1)", lambda prob: 0 <= prob <= 1)),
    "history_max_rollouts_per_prompt": Key(_int(0, hint=" (outputs kept per prompt; 0 keeps no history)"),
                                           EMBEDDED_AND_PROJECT, HISTORY_ONLY),
    "history_max_tokens": Key(_int(0, hint=" (tokens kept over all prompts; 0 keeps no history)"),
                              EMBEDDED_AND_PROJECT, HISTORY_ONLY),
    "draft_tensor_parallel_size": Key(_optional_int(1), ONLY_VLLM, VLLMS_OWN, also_default=(1,)),
    "max_model_len": Key(_optional_int(1, hint=" (None: the target's)"), ONLY_VLLM, VLLMS_OWN),
    "parallel_drafting": Key(check_bool, ONLY_VLLM, VLLMS_OWN),
    "use_heterogeneous_vocab": Key(check_bool, ONLY_VLLM, VLLMS_OWN),
}


def check_keys(**values) -> None:
    """Each value checked by its key's check (ValueError naming the key)."""
    for name, value in values.items():
        KEYS[name].check(name, value)


def check_prompt_lookup(prompt_lookup_min: int, prompt_lookup_max: int) -> None:
    check_keys(prompt_lookup_min=prompt_lookup_min, prompt_lookup_max=prompt_lookup_max)
    if prompt_lookup_min > prompt_lookup_max:
        raise ValueError(f"prompt_lookup_min={prompt_lookup_min} > prompt_lookup_max={prompt_lookup_max}: set "
                         "prompt_lookup_min <= prompt_lookup_max")


def unhonoured(values: dict, defaults: dict, engine: str) -> str | None:
    """The refusal of the first key in `values` that `engine` does not honour and that is set away from its default
    (None: every key set is honoured)."""
    for name, key in KEYS.items():
        value = values[name]
        if engine not in key.engines and value != defaults[name] and value not in key.also_default:
            runs_on = " and ".join(ENGINE_NAMES[e] for e in ENGINE_NAMES if e in key.engines)
            return f"{name}={value!r} runs only on {runs_on}, not on {ENGINE_NAMES[engine]}: {key.why}"
    return None
