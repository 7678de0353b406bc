"""Rollout history from elsewhere (rollout/history_sharing.py, RolloutGenerator.rollout_history.add and
share_rollout_history), on one process: what a rollout added from another process does to drafts and samples, the
checks on what is added, the packing one all-gather sends, and the hit rate. Several processes for real:
tests/test_history_processes.py (slow stage)."""

import warnings

import pytest
import torch.distributed as dist

from rollout import RolloutGenerator, SamplingParams, default_prompts
from rollout.history_sharing import gather_rollouts, pack, unpack
from spec.proposers.history import HistoryStore

HISTORY = {"method": "history", "num_speculative_tokens": 8}
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)


@pytest.fixture(scope="module")
def rolled_out():
    """Another process's rollouts: the default target's greedy completions of 8 prompts."""
    return RolloutGenerator("default", max_num_seqs=16).generate(default_prompts(8, seed=3), 1, GREEDY,
                                                                 use_tqdm=False)


def test_rollouts_added_from_elsewhere_draft_the_prompts_next_time(rolled_out):
    fresh, fed = (RolloutGenerator("default", speculative_config=HISTORY, max_num_seqs=16) for _ in range(2))
    prompts = [s.prompt_ids for s in rolled_out.samples]
    fed.rollout_history.add(prompts, [s.completion_ids for s in rolled_out.samples])
    first, second = (g.generate(prompts, 1, GREEDY, use_tqdm=False) for g in (fresh, fed))
    assert [s.completion_ids for s in second.samples] == [s.completion_ids for s in rolled_out.samples]
    assert second.stats["history_hit_rate"] == 1.0 and first.stats["history_hit_rate"] == 0.0
    assert second.metrics["spec/history_hit_rate"] == 1.0
    # greedy: the earlier rollout is the whole completion, drafted K at a time
    assert second.stats["mean_acceptance_length"] > first.stats["mean_acceptance_length"] + 2


def test_added_history_changes_drafts_never_seeded_samples(rolled_out):
    params = SamplingParams(temperature=1.0, max_tokens=48, seed=11)
    prompts = [s.prompt_ids for s in rolled_out.samples]
    reference = RolloutGenerator("default", max_num_seqs=32).generate(prompts, 4, params, use_tqdm=False)
    fed = RolloutGenerator("default", speculative_config=HISTORY, max_num_seqs=32)
    fed.rollout_history.add(prompts, [s.completion_ids for s in rolled_out.samples])
    batch = fed.generate(prompts, 4, params, use_tqdm=False)
    assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in reference.samples]
    assert batch.stats["num_accepted_draft_tokens"] > 0


def test_bad_rollouts_are_refused_and_nothing_is_added(tmp_path):
    gen = RolloutGenerator("default", speculative_config=HISTORY, max_num_seqs=4)
    for prompts, completions, message in [
        ([[5, 6]], [[7], [8]], r"expected two lists of token-id lists of the same length"),
        ([[5, 6], [5, 99]], [[7], [8]], r"prompt_ids\[1\]\[1\]=99: .* below the vocabulary size 28"),
        ([[5, 6]], [[7, -1]], r"completion_ids\[0\]\[1\]=-1"),
        ([[]], [[7]], r"prompt_ids\[0\]=\[\]: expected a non-empty list"),
        ("56", [[7]], r"prompt_ids \(str\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            gen.rollout_history.add(prompts, completions)
    gen.rollout_history.save(tmp_path / "h.npz")
    store = HistoryStore()
    store.load(tmp_path / "h.npz")
    assert store.num_prompts == 0
    assert RolloutGenerator("default", max_num_seqs=4).rollout_history is None  # no history kept


def test_one_process_has_nothing_to_share(rolled_out):
    gen = RolloutGenerator("default", speculative_config=HISTORY, max_num_seqs=4)
    assert not dist.is_initialized()
    assert gen.share_rollout_history(rolled_out) == {"num_shared": 0, "seconds": 0.0}


def test_a_batch_packs_each_prompt_once_and_unpacks_to_its_rollouts(rolled_out):
    batch = RolloutGenerator("default", max_num_seqs=16).generate(default_prompts(3), 4, SamplingParams(
        temperature=1.0, max_tokens=24, seed=1), use_tqdm=False)
    packed = pack(batch)
    assert len(packed["prompt_lengths"]) == 3 and len(packed["completion_lengths"]) == 12
    assert unpack(packed) == ([s.prompt_ids for s in batch.samples], [s.completion_ids for s in batch.samples])
    empty = pack(type(batch)([]))
    assert unpack(empty) == ([], [])


def test_a_failed_collective_warns_and_shares_nothing(rolled_out):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert gather_rollouts(rolled_out, group=None) is None  # no process group: the all-gather raises
    assert "sharing rollout history across processes failed" in str(caught[0].message)
