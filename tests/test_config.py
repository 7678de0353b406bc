import json

import pytest

from spec import SpecConfig

VLLM_STYLE = {
    "method": "draft_model",
    "model": "/models/draft",
    "num_speculative_tokens": 5,
    "num_speculative_tokens_per_batch_size": [[1, 4, 5], [5, 32, 2], [33, 256, 0]],
    "draft_tensor_parallel_size": 1,
    "rejection_sample_method": "standard",
}


def test_round_trip_with_vllm_style_json():
    config = SpecConfig.from_dict(json.loads(json.dumps(VLLM_STYLE)))
    out = config.to_dict()
    assert {k: out[k] for k in VLLM_STYLE} == VLLM_STYLE
    assert SpecConfig.from_dict(json.loads(json.dumps(out))) == config
    assert config.schedule.k_for_batch_size(3) == 5 and config.schedule.k_for_batch_size(20) == 2 and config.schedule.k_for_batch_size(300) == 0


def test_without_schedule_k_is_num_speculative_tokens():
    config = SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert [config.schedule.k_for_batch_size(b) for b in (1, 64, 4096)] == [3, 3, 3]


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ValueError, match="unknown key") as info:
        SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "num_spec_tokens": 4})
    assert "num_spec_tokens" in str(info.value) and "num_speculative_tokens_per_batch_size" in str(info.value)


@pytest.mark.parametrize("overrides, field", [
    ({"method": "draft_model"}, "model=None"),
    ({"method": "custom_class"}, "model=None"),
    ({"method": "suffix", "model": "/d"}, "model='/d' with method 'suffix'"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min=4 > prompt_lookup_max=2"),
])
def test_keys_that_must_agree_name_both(overrides, field):
    """Each key's own range: tests/test_config_keys.py; here the rules between keys."""
    with pytest.raises(ValueError) as info:
        SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, **overrides})
    assert field in str(info.value)


@pytest.mark.parametrize("missing", ["method", "num_speculative_tokens"])
def test_missing_required_key(missing):
    config = {"method": "ngram", "num_speculative_tokens": 3}
    del config[missing]
    with pytest.raises(ValueError, match=f"missing '{missing}'"):
        SpecConfig.from_dict(config)


def test_not_a_dict():
    with pytest.raises(ValueError, match="expected a dict"):
        SpecConfig.from_dict([("method", "ngram")])


@pytest.mark.parametrize("method", ["eagle3", "mtp", "dspark", "dflash"])
def test_vllm_only_methods_are_accepted_and_refused_by_the_embedded_engine(method):
    config = SpecConfig.from_dict({"method": method, "model": "/m", "num_speculative_tokens": 3})
    with pytest.raises(NotImplementedError, match="vllm"):
        config.check_embedded()


def test_non_standard_rejection_is_vllm_only():
    config = SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                   "rejection_sample_method": "block"})
    with pytest.raises(NotImplementedError, match="rejection_sample_method='block'"):
        config.check_embedded()


def test_adaptive_verification_runs_embedded_with_point_proposals_only():
    SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                          "enable_adaptive_verification": True}).check_embedded()
    config = SpecConfig.from_dict({"method": "draft_model", "model": "d", "num_speculative_tokens": 3,
                                   "enable_adaptive_verification": True, "draft_sample_method": "probabilistic"})
    with pytest.raises(NotImplementedError, match="draft_sample_method='greedy'"):
        config.check_embedded()


def test_json_text_is_parsed_with_a_clear_error():
    assert SpecConfig.parse_json('{"method": "ngram", "num_speculative_tokens": 4}')["method"] == "ngram"
    with pytest.raises(ValueError, match="speculative_config='{method: ngram}' is not valid JSON"):
        SpecConfig.parse_json("{method: ngram}")


def test_the_suffix_token_bound_is_this_projects_on_both_engines():
    from spec import build_proposer

    config = SpecConfig.from_dict({"method": "suffix", "num_speculative_tokens": 3})
    assert "suffix_decoding_max_cached_tokens" not in config.to_vllm()
    assert "suffix_decoding_max_cached_requests" in config.to_vllm()
    bounded = SpecConfig.from_dict({**config.to_vllm(), "suffix_decoding_max_cached_tokens": 500})
    assert build_proposer(bounded, max_num_seqs=2, max_model_len=64).max_cached_tokens == 500
    with pytest.raises(NotImplementedError, match="suffix_decoding_max_cached_tokens=500 runs only on the embedded "
                                                  "engine and vLLM with this project's drafters"):
        bounded.to_vllm()
    SpecConfig.from_dict({**bounded.to_dict(), "method": "history"}).check_vllm_protocol()  # history on vLLM reads it


@pytest.mark.parametrize("config, message", [
    ({"method": "history", "num_speculative_tokens": 4}, "method='history'"),
    ({"method": "suffix", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": [[1, 8, 4]]},
     "asserts one K"),
    ({"method": "suffix", "num_speculative_tokens": 4, "history_max_tokens": 10}, "history_max_tokens=10"),
])
def test_what_vllm_cannot_run_is_refused_with_the_reason(config, message):
    with pytest.raises(NotImplementedError, match=message):
        SpecConfig.from_dict(config).to_vllm()
