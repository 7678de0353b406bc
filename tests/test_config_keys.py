"""Every speculative-config key (spec/config_keys.py): docs/config.md's table says which engines honour it and the code
declares the same; each engine takes the keys it honours (vLLM's own drafters get them passed) and refuses the others
when set; and every key the table lists has a bad value that is refused with a ValueError naming the key, the empty
schedule included, by the one check the config and the drafters share."""

import math
from pathlib import Path

import pytest

from spec import SpecConfig
from spec.config_keys import EMBEDDED, KEYS, VLLM, VLLM_PROJECT
from spec.proposers.history import HistoryStore
from spec.proposers.ngram import NgramProposer
from spec.proposers.suffix import SuffixProposer

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = {"embedded": EMBEDDED, "vLLM, own drafters": VLLM, "vLLM, `history` / `custom_class`": VLLM_PROJECT}


def _readme_table() -> list[tuple[str, frozenset]]:
    """(key, the engines marked yes) per row of docs/config.md's table, in order."""
    lines = (ROOT / "docs" / "config.md").read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| key |"))
    columns = [cell.strip() for cell in lines[header].strip("|").split("|")]
    assert columns[0] == "key" and columns[4] == "meaning" and set(columns[1:4]) == set(COLUMNS), columns
    engines = [COLUMNS[column] for column in columns[1:4]]
    rows = []
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert all(cell in ("yes", "—") for cell in cells[1:4]), line
        rows.append((cells[0].strip("`"), frozenset(e for e, cell in zip(engines, cells[1:4]) if cell == "yes")))
    return rows


TABLE = dict(_readme_table())


def test_the_table_lists_every_key_once_in_the_configs_order():
    assert [key for key, _ in _readme_table()] == SpecConfig.keys() == list(KEYS)


def test_the_code_declares_the_engines_the_table_says():
    assert {key: KEYS[key].engines for key in KEYS} == TABLE
    assert all(key.why for key in KEYS.values() if len(key.engines) < 3)  # a refusal says why and what to do


# --- each engine takes what it honours and refuses the rest -------------------------------------------------------

NON_DEFAULT = {"model": "/d", "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 64, 1]],
               "enable_adaptive_verification": True, "enable_measured_guard": True, "rejection_sample_method": "block",
               "draft_sample_method": "probabilistic", "prompt_lookup_min": 1, "prompt_lookup_max": 6,
               "suffix_decoding_max_tree_depth": 8, "suffix_decoding_max_cached_requests": 5,
               "suffix_decoding_max_cached_tokens": 500, "suffix_decoding_max_spec_factor": 2.0,
               "suffix_decoding_min_token_prob": 0.3, "history_max_rollouts_per_prompt": 4,
               "history_max_tokens": 1000, "draft_tensor_parallel_size": 2, "max_model_len": 512,
               "parallel_drafting": True, "use_heterogeneous_vocab": True}


def _config(engine: str, key: str) -> SpecConfig:
    """A config of a method that reads `key` on `engine`, with `key` set away from its default."""
    if engine == VLLM_PROJECT:
        base = {"method": "custom_class", "model": "pkg.module.Drafter"} if key == "model" else {"method": "history"}
    elif key.startswith(("suffix_decoding_", "history_")):
        base = {"method": "suffix"}
    else:
        base = {"method": "ngram"} if key.startswith("prompt_lookup_") else {"method": "draft_model",
                                                                            "model": NON_DEFAULT["model"]}
    value = base.get(key, NON_DEFAULT[key])
    return SpecConfig.from_dict({**base, "num_speculative_tokens": 4, key: value})


def _run(engine: str, config: SpecConfig):
    return {EMBEDDED: config.check_embedded, VLLM: config.to_vllm, VLLM_PROJECT: config.check_vllm_protocol}[engine]()


def test_every_settable_key_has_a_sample():
    assert set(NON_DEFAULT) == set(KEYS) - {"method", "num_speculative_tokens"}  # the two required keys: every engine


@pytest.mark.parametrize("engine", [EMBEDDED, VLLM, VLLM_PROJECT])
@pytest.mark.parametrize("key", sorted(NON_DEFAULT))
def test_an_engine_takes_the_keys_it_honours_and_refuses_the_others(key, engine):
    config = _config(engine, key)
    if engine not in TABLE[key]:
        with pytest.raises(NotImplementedError, match=f"{key}=.* runs only on"):
            _run(engine, config)
        return
    result = _run(engine, config)
    if engine == VLLM:  # vLLM's own drafters get the key passed
        assert result[key] == getattr(config, key)


def test_the_single_device_value_of_a_vllm_key_is_accepted_everywhere():
    config = SpecConfig.from_dict({"method": "history", "num_speculative_tokens": 4, "draft_tensor_parallel_size": 1})
    config.check_embedded()
    config.check_vllm_protocol()


# --- every key's bad values ------------------------------------------------------------------------------------------

BAD_VALUES = [  # (key, value, what the message says; None: "key=value")
    ("method", "lookahead", None), ("method", None, None),
    ("num_speculative_tokens", 0, None), ("num_speculative_tokens", -2, None), ("num_speculative_tokens", 2.0, None),
    ("model", 5, None),
    ("num_speculative_tokens_per_batch_size", [], "num_speculative_tokens_per_batch_size=[]: must not be empty"),
    ("num_speculative_tokens_per_batch_size", [[2, 8, 1]], "must start at batch size 1"),
    ("num_speculative_tokens_per_batch_size", "1-8:4", None),
    ("enable_adaptive_verification", "false", "must be true or false"),  # "false" and 1 once turned it on
    ("enable_adaptive_verification", 1, "must be true or false"),
    ("enable_measured_guard", "yes", "must be true or false"),
    ("rejection_sample_method", "fast", None), ("draft_sample_method", "topk", None),
    ("prompt_lookup_min", 0, None), ("prompt_lookup_max", 0, None),
    ("suffix_decoding_max_tree_depth", 1, None), ("suffix_decoding_max_cached_requests", -1, None),
    ("suffix_decoding_max_cached_tokens", -1, None), ("suffix_decoding_max_cached_tokens", 1.5, None),
    ("suffix_decoding_max_spec_factor", -0.5, None), ("suffix_decoding_max_spec_factor", "1", None),
    ("suffix_decoding_max_spec_factor", math.inf, None),
    ("suffix_decoding_min_token_prob", 1.5, None), ("suffix_decoding_min_token_prob", None, None),
    ("history_max_rollouts_per_prompt", -1, None), ("history_max_tokens", 1.5, None),
    ("history_max_tokens", True, None),
    ("draft_tensor_parallel_size", 0, None), ("draft_tensor_parallel_size", "2", None),
    ("max_model_len", 0, None), ("max_model_len", 512.0, None),
    ("parallel_drafting", "true", "must be true or false"), ("use_heterogeneous_vocab", 0, "must be true or false"),
]


def test_every_key_in_the_table_has_bad_values():
    assert {key for key, _, _ in BAD_VALUES} == set(TABLE)


@pytest.mark.parametrize("key, value, message", BAD_VALUES)
def test_a_bad_value_is_refused_naming_the_key(key, value, message):
    base = {"method": "draft_model", "model": "/d"} if key == "model" else {"method": "ngram"}
    with pytest.raises(ValueError) as info:
        SpecConfig.from_dict({**base, "num_speculative_tokens": 3, key: value})
    assert key in str(info.value) and (message or f"{key}={value!r}") in str(info.value)


@pytest.mark.parametrize("build, key, value", [
    (lambda v: SuffixProposer(max_spec_factor=v), "suffix_decoding_max_spec_factor", -0.5),
    (lambda v: SuffixProposer(max_tree_depth=v), "suffix_decoding_max_tree_depth", 1),
    (lambda v: SuffixProposer(max_cached_tokens=v), "suffix_decoding_max_cached_tokens", -1),
    (lambda v: SuffixProposer(min_token_prob=v), "suffix_decoding_min_token_prob", 1.5),
    (lambda v: HistoryStore(max_tokens=v), "history_max_tokens", 1.5),
    (lambda v: HistoryStore(max_rollouts_per_prompt=v), "history_max_rollouts_per_prompt", -1),
    (lambda v: NgramProposer(v, 5), "prompt_lookup_min", 0),
])
def test_a_drafter_refuses_a_bad_argument_as_the_config_does(build, key, value):
    """One check per key: a drafter built directly says what the config says."""
    with pytest.raises(ValueError) as from_drafter:
        build(value)
    with pytest.raises(ValueError) as from_config:
        SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, key: value})
    assert str(from_drafter.value) == str(from_config.value)


def test_a_spec_factor_of_zero_is_valid_as_in_vllm():
    assert SpecConfig.from_dict({"method": "suffix", "num_speculative_tokens": 3,
                                 "suffix_decoding_max_spec_factor": 0.0}).suffix_decoding_max_spec_factor == 0.0
    assert SuffixProposer(max_spec_factor=0.0).max_spec_factor == 0.0
