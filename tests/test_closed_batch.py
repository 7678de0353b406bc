"""The closed-batch check: the undrafted counterfactual, the per-size decision, and the engine running it."""

import pytest

from rollout import RolloutGenerator, SamplingParams
from spec import StepCostModel
from spec.closed_batch import NUM_BATCHES, RECHECK, BatchTiming, ClosedBatchCheck, undrafted_seconds

COSTS = StepCostModel({1: {1: 1.0, 2: 1.5}, 2: {2: 2.0, 4: 3.0}, 4: {4: 3.0, 8: 5.0}}, {1: 0.1, 4: 0.2})
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def test_undrafted_time_is_the_first_step_then_one_token_per_running_request_per_step():
    timing = BatchTiming()
    timing.observe_step(seconds=5.0, draft_seconds=1.0, verify_seconds=3.0)  # prompts: 4 s without drafting
    timing.observe_step(seconds=2.0, draft_seconds=0.5, verify_seconds=1.5)  # 1 s outside both over 2 steps
    # lengths 1, 2, 4, 4: step 2 runs the 3 with at least 2 tokens, steps 3 and 4 the 2 with 4
    expected = 4.0 + sum(COSTS.verify_cost(n, n) + 0.5 for n in (3, 2, 2))
    assert undrafted_seconds([4, 1, 4, 2], timing, COSTS) == pytest.approx(expected)
    assert COSTS.verify_cost(3, 3) == pytest.approx(2.5)  # between the 2- and 4-row curves at 1 token per row


def _timing(lengths: list[int], ratio: float) -> BatchTiming:
    """A run that took `ratio` times its undrafted prediction (first step 0 s, nothing outside verification)."""
    timing = BatchTiming()
    timing.observe_step(0.0, 0.0, 0.0)
    timing.observe_step(1.0, 0.0, 1.0)
    predicted = undrafted_seconds(lengths, timing, COSTS)
    timing.seconds = timing.verify_seconds = ratio * predicted
    return timing


def _lost(check: ClosedBatchCheck, lengths: list[int], ratios=(0.7, 1.15, 1.2)) -> None:
    """NUM_BATCHES drafted batches, the median 15% slower than the model's undrafted prediction."""
    assert len(ratios) == NUM_BATCHES
    for ratio in ratios:
        assert check.allows_drafting(len(lengths))
        check.observe(lengths, _timing(lengths, ratio), COSTS, drafted=True)


def test_a_size_where_drafting_lost_decodes_without_drafts_and_rechecks():
    check, lengths = ClosedBatchCheck(), [3, 5, 8, 2]
    assert check.allows_drafting(4)  # nothing known: draft
    _lost(check, lengths)  # one batch drafted fast, two slow: the median is what counts
    assert not check.allows_drafting(4)
    assert not check.allows_drafting(7) and not check.allows_drafting(200)  # its power of two and larger ones
    assert check.allows_drafting(3) and check.allows_drafting(1)  # smaller ones do not
    for _ in range(RECHECK - 1):
        assert not check.allows_drafting(4)
        check.observe(lengths, _timing(lengths, 1.0), COSTS, drafted=False)
    assert check.allows_drafting(4)  # the recheck
    check.observe(lengths, _timing(lengths, 0.8), COSTS, drafted=True)  # drafting pays now: 0.8, 1.15, 1.2
    assert not check.allows_drafting(4)
    check.observe(lengths, _timing(lengths, 1.0), COSTS, drafted=False)  # on a par with the undrafted ones (1.0)
    for _ in range(RECHECK - 2):
        check.observe(lengths, _timing(lengths, 1.0), COSTS, drafted=False)
    check.observe(lengths, _timing(lengths, 0.9), COSTS, drafted=True)  # 0.8, 0.9, 1.2: median 0.9 < 1.0
    assert check.allows_drafting(4) and check.allows_drafting(200)


def test_the_model_error_seen_without_drafts_cancels():
    """Drafted batches 10% over the model's undrafted prediction, undrafted ones 20% over it: drafting wins."""
    check, lengths = ClosedBatchCheck(), [6, 6, 3]
    check.observe(lengths, _timing(lengths, 1.2), COSTS, drafted=False)
    for _ in range(NUM_BATCHES):
        check.observe(lengths, _timing(lengths, 1.1), COSTS, drafted=True)
    assert check.allows_drafting(3)
    for _ in range(NUM_BATCHES // 2 + 1):
        check.observe(lengths, _timing(lengths, 1.3), COSTS, drafted=True)  # now the median is 1.3 > 1.2
    assert not check.allows_drafting(3)


def _adaptive(target, draft, max_num_seqs=4):
    config = {"method": "draft_model", "num_speculative_tokens": 3, "enable_adaptive_verification": True}
    flat = {"verify": {n: {n: 1.0, 4 * n: 1.0} for n in (1, 2, 4)}, "draft": {1: 0.01, 4: 0.01}}  # drafts are free
    return RolloutGenerator(target, speculative_config=config, draft_model=draft, max_num_seqs=max_num_seqs,
                            max_model_len=64, step_costs=flat)


def test_the_engine_skips_drafting_where_the_check_says_so_and_teaches_it(target, draft):
    prompts = [[5, 6, 7, 5, 6, 7], [3, 4], [9, 9, 9]]
    plain = RolloutGenerator(target, max_num_seqs=4, max_model_len=64).generate(prompts, 1, GREEDY, use_tqdm=False)
    generator = _adaptive(target, draft)
    check = generator.adaptive.closed_batch
    lengths = [12, 12, 12]
    for _ in range(NUM_BATCHES):  # fabricated: drafting lost
        check.observe(lengths, _timing(lengths, 2.0), generator.adaptive.costs, drafted=True)
    batch = generator.generate(prompts, 1, GREEDY, use_tqdm=False)
    assert batch.stats["num_proposed_draft_tokens"] == 0
    assert batch.stats["drafting_allowed"] is False and batch.metrics["spec/drafting_allowed"] == 0.0
    assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in plain.samples]
    # The run was an undrafted closed batch of 3: its steps took milliseconds where the table says a second, and a
    # drafted batch must now beat that ratio to draft again.
    for _ in range(NUM_BATCHES):
        check.observe(lengths, _timing(lengths, 0.5), generator.adaptive.costs, drafted=True)
    assert not check.allows_drafting(3)

    fresh = _adaptive(target, draft)
    batch = fresh.generate(prompts, 1, GREEDY, use_tqdm=False)
    assert batch.stats["num_proposed_draft_tokens"] > 0 and batch.metrics["spec/drafting_allowed"] == 1.0
    assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in plain.samples]
    for _ in range(NUM_BATCHES - 1):
        fresh.generate(prompts, 1, GREEDY, use_tqdm=False)
    assert fresh.adaptive.closed_batch.allows_drafting(3)  # measured far below the table's seconds: drafting paid


def test_a_batch_larger_than_max_num_seqs_is_not_a_closed_batch(target, draft):
    generator = _adaptive(target, draft, max_num_seqs=2)
    check = generator.adaptive.closed_batch
    lengths = [12, 12, 12]
    for _ in range(NUM_BATCHES):  # size 3 lost
        check.observe(lengths, _timing(lengths, 2.0), generator.adaptive.costs, drafted=True)
    batch = generator.generate([[5, 6, 7], [3, 4], [9, 9]], 1, GREEDY, use_tqdm=False)  # waits for a slot
    assert batch.stats["num_proposed_draft_tokens"] > 0  # the per-step policy alone decides
