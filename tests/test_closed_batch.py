"""Closed batches: whether they draft (measured against their replay without drafts), how deep (replayed), and the
engine running both."""

import pytest

from replay_testing import COSTS, flat_costs, record
from rollout import RolloutGenerator, SamplingParams
from spec import RequestAcceptance, StepCostModel
from spec.batch_replay import BatchTiming, replayed_seconds
from spec.closed_batch import FIRST_RECHECK, NUM_BATCHES, RECHECK, REPLAY_REQUESTS, ClosedBatchSchedule

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def _timing(lengths: list[int], ratio: float, costs: StepCostModel = COSTS) -> BatchTiming:
    """A run that took `ratio` times its replay without drafts (first step 0 s, nothing outside verification)."""
    timing = BatchTiming()
    timing.observe_step(0.0, 0.0, 0.0)
    timing.observe_step(1.0, 0.0, 1.0)
    predicted, = replayed_seconds(lengths, lengths, None, 0, timing, costs)
    timing.seconds = timing.verify_seconds = ratio * predicted
    return timing


def _observe(schedule: ClosedBatchSchedule, lengths: list[int], ratio: float, drafted: bool,
             costs: StepCostModel = COSTS, records: list | None = None, k_limit: int = 0) -> None:
    """A closed batch that took `ratio` times its replay without drafts; with drafts, every one accepted unless
    `records` says otherwise."""
    if records is None:
        records = [record([(1, 1)]) if drafted else RequestAcceptance() for _ in lengths]
    schedule.observe(lengths, [64] * len(lengths), records, _timing(lengths, ratio, costs), costs, k_limit)


def test_a_size_where_drafting_lost_decodes_without_drafts_and_rechecks_sooner_than_later():
    schedule, lengths = ClosedBatchSchedule(), [3, 5, 8, 2]
    assert schedule.allows_drafting(4) and schedule.k_max(4) is None  # nothing known: draft, no cap
    for ratio in (0.7, 1.15, 1.2):  # one batch drafted fast, two slow: the median is what counts
        assert schedule.allows_drafting(4)
        _observe(schedule, lengths, ratio, drafted=True)
    assert not schedule.allows_drafting(4) and schedule.k_max(4) == 0
    assert not schedule.allows_drafting(7) and not schedule.allows_drafting(200)  # its power of two and larger ones
    assert schedule.allows_drafting(3) and schedule.allows_drafting(1)  # smaller ones do not
    # The 2nd batch after the verdict drafts again; each recheck that confirms the loss doubles the wait, up to RECHECK
    for wait, ratio in ((FIRST_RECHECK, 1.3), (2 * FIRST_RECHECK, 1.25), (4 * FIRST_RECHECK, 1.3), (RECHECK, 1.2),
                        (RECHECK, 0.8)):
        for _ in range(wait - 1):
            assert not schedule.allows_drafting(4)
            _observe(schedule, lengths, 1.0, drafted=False)
        assert schedule.allows_drafting(4) and schedule.k_max(4) is None  # the recheck (no replays: K = 0 limit)
        _observe(schedule, lengths, ratio, drafted=True)
        assert not schedule.allows_drafting(4)  # the median of the last 3 drafted batches is above 1.0
    assert 4 * FIRST_RECHECK < RECHECK
    for _ in range(RECHECK - 1):
        _observe(schedule, lengths, 1.0, drafted=False)
    _observe(schedule, lengths, 0.9, drafted=True)  # 1.2, 0.8, 0.9: median 0.9 < 1.0, drafting pays again
    assert schedule.allows_drafting(4) and schedule.allows_drafting(200)
    for _ in range(2):
        _observe(schedule, lengths, 1.3, drafted=True)  # 0.9, 1.3, 1.3: lost again, the 2nd batch rechecks
    assert not schedule.allows_drafting(4)
    _observe(schedule, lengths, 1.0, drafted=False)
    assert schedule.allows_drafting(4)


def test_the_model_error_seen_without_drafts_cancels():
    """Drafted batches 10% over their replay without drafts, undrafted ones 20% over it: drafting wins."""
    schedule, lengths = ClosedBatchSchedule(), [6, 6, 3]
    _observe(schedule, lengths, 1.2, drafted=False)
    for _ in range(NUM_BATCHES):
        _observe(schedule, lengths, 1.1, drafted=True)
    assert schedule.allows_drafting(3)
    for _ in range(NUM_BATCHES // 2 + 1):
        _observe(schedule, lengths, 1.3, drafted=True)  # now the median is 1.3 > 1.2
    assert not schedule.allows_drafting(3)


# 4 requests of 40 tokens whose drafts are accepted twice, then rejected, over and over (every position seen, so the
# replays draw nothing): a step emits 2 tokens at K = 1, 3 at K = 2 and at K = 3, whose third draft is always
# rejected. At 0.3 s a draft forward and 1 s a verification, K = 0-3 replay at 39.0, 34.1, 21.1, 25.0 s
# (spec/batch_replay.py). Accepted three times, then rejected: 4 tokens a step at K = 3.
TWO_IN_THREE = [record([(3, 2)] * 14)] * 4
THREE_IN_FOUR = [record([(4, 3)] * 10)] * 4
LONG = [40] * 4


def test_a_size_offers_the_k_its_replays_found_fastest():
    schedule = ClosedBatchSchedule()
    _observe(schedule, LONG, 1.0, drafted=True, costs=flat_costs(0.3), records=TWO_IN_THREE, k_limit=3)
    assert schedule._replays[3][0] == (4, [pytest.approx(s) for s in (39.0, 34.1, 21.1, 25.0)])
    assert schedule.k_max(4) == 2 and schedule.k_max(7) == 2
    assert schedule.k_max(8) is None and schedule.k_max(3) is None  # other powers of two have no batch yet: no cap
    for _ in range(REPLAY_REQUESTS // len(LONG)):  # their third drafts are accepted
        assert schedule._replays[3][0][1][3] == pytest.approx(25.0)  # the first batch's replay still counts
        _observe(schedule, LONG, 1.0, drafted=True, costs=flat_costs(0.02), records=THREE_IN_FOUR, k_limit=3)
    # The batches replayed hold REPLAY_REQUESTS requests: the first one has gone
    assert len(schedule._replays[3]) == REPLAY_REQUESTS // len(LONG) and schedule._replays[3][0][1][3] < 25.0
    assert schedule.k_max(4) == 3
    wide = [40] * REPLAY_REQUESTS  # batches as large as REPLAY_REQUESTS: the last NUM_BATCHES decide
    _observe(schedule, wide, 1.0, drafted=True, costs=flat_costs(0.3), records=TWO_IN_THREE[:1] * len(wide), k_limit=3)
    assert schedule.k_max(len(wide)) == 2
    for _ in range(NUM_BATCHES):
        _observe(schedule, wide, 1.0, drafted=True, costs=flat_costs(0.02), records=THREE_IN_FOUR[:1] * len(wide),
                 k_limit=3)
    assert len(schedule._replays[len(wide).bit_length()]) == NUM_BATCHES and schedule.k_max(len(wide)) == 3
    schedule = ClosedBatchSchedule()
    _observe(schedule, LONG, 1.0, drafted=True, costs=flat_costs(0.3), records=TWO_IN_THREE, k_limit=0)
    assert schedule.k_max(4) is None  # a batch allowed no drafts is not replayed


def test_where_drafting_lost_the_replays_do_not_bring_it_back():
    schedule = ClosedBatchSchedule()
    for _ in range(NUM_BATCHES):  # replays say K = 2, but the batches ran 30% over their replay without drafts
        _observe(schedule, LONG, 1.3, drafted=True, costs=flat_costs(0.3), records=TWO_IN_THREE, k_limit=3)
    assert schedule.k_max(4) == 0


def _adaptive(target, draft, max_num_seqs=4, draft_seconds=0.01):
    config = {"method": "draft_model", "num_speculative_tokens": 3, "enable_adaptive_verification": True}
    flat = {"verify": {n: {n: 1.0, 4 * n: 1.0} for n in (1, 2, 4)}, "draft": {1: draft_seconds, 4: draft_seconds}}
    return RolloutGenerator(target, speculative_config=config, draft_model=draft, max_num_seqs=max_num_seqs,
                            max_model_len=64, step_costs=flat)


def test_the_engine_skips_drafting_where_drafting_lost_and_teaches_the_schedule(target, draft):
    prompts = [[5, 6, 7, 5, 6, 7], [3, 4], [9, 9, 9]]
    plain = RolloutGenerator(target, max_num_seqs=4, max_model_len=64).generate(prompts, 1, GREEDY, use_tqdm=False)
    generator = _adaptive(target, draft)
    schedule, costs, lengths = generator.adaptive.closed_batch, generator.adaptive.costs, [12, 12, 12]
    for _ in range(NUM_BATCHES):  # fabricated: drafting lost
        _observe(schedule, lengths, 2.0, drafted=True, costs=costs)
    batch = generator.generate(prompts, 1, GREEDY, use_tqdm=False)
    assert batch.stats["num_proposed_draft_tokens"] == 0
    assert batch.stats["draft_cap"] == 0 and batch.metrics["spec/draft_cap"] == 0.0
    assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in plain.samples]
    # The run was an undrafted closed batch of 3: its steps took milliseconds where the table says a second, and a
    # drafted batch must now beat that ratio to draft again.
    for _ in range(NUM_BATCHES):
        _observe(schedule, lengths, 0.5, drafted=True, costs=costs)
    assert not schedule.allows_drafting(3)

    fresh = _adaptive(target, draft)
    caps = []  # nothing known: no cap; then the K the batches replayed fastest
    for _ in range(NUM_BATCHES):
        expected = fresh.adaptive.closed_batch.k_max(3)
        batch = fresh.generate(prompts, 1, GREEDY, use_tqdm=False)
        caps.append(batch.stats["draft_cap"])
        assert batch.stats["draft_cap"] == (3 if expected is None else expected)
        assert batch.stats["num_proposed_draft_tokens"] > 0
        assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in plain.samples]
    # Measured far below the table's seconds: drafting paid
    assert caps[0] == 3 and all(1 <= cap <= 3 for cap in caps[1:])
    assert fresh.adaptive.closed_batch.allows_drafting(3) and fresh.adaptive.closed_batch.k_max(3) >= 1


def test_under_its_cap_a_closed_batch_offers_every_request_the_cap_untrimmed(target, draft):
    prompts = [[5, 6, 7, 5, 6, 7], [3, 4], [9, 9, 9]]
    plain = RolloutGenerator(target, max_num_seqs=4, max_model_len=64).generate(prompts, 1, GREEDY, use_tqdm=False)
    generator = _adaptive(target, draft, draft_seconds=10.0)  # per step, a draft forward would never pay
    open_batch = generator.generate(prompts + prompts[:2], 1, GREEDY, use_tqdm=False)  # 5 > max_num_seqs: not closed
    assert open_batch.stats["draft_cap"] == 3  # no cap: the per-step policy trims, from its second step on
    assert all(0 in s.acceptance["k_per_step"][1:-1] for s in open_batch.samples)
    _observe(generator.adaptive.closed_batch, LONG[:3], 1.0, drafted=True, costs=flat_costs(0.3), records=TWO_IN_THREE[:3],
             k_limit=3)  # size 3: K = 2
    batch = generator.generate(prompts, 1, GREEDY, use_tqdm=False)
    assert batch.stats["draft_cap"] == 2 and batch.metrics["spec/draft_cap"] == 2.0
    for sample in batch.samples:  # at every step, 2 drafts or as many as the request had room for (max_tokens)
        before = 0
        for offered, accepted in zip(sample.acceptance["k_per_step"], sample.acceptance["num_accepted_per_step"]):
            assert offered == min(2, GREEDY.max_tokens - before - 1)
            before += accepted + 1
    assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in plain.samples]


def test_a_batch_larger_than_max_num_seqs_is_not_a_closed_batch(target, draft):
    generator = _adaptive(target, draft, max_num_seqs=2)
    _observe(generator.adaptive.closed_batch, LONG[:3], 1.0, drafted=True, costs=flat_costs(0.3), records=TWO_IN_THREE[:3],
             k_limit=3)  # size 3: K = 2
    batch = generator.generate([[5, 6, 7], [3, 4], [9, 9]], 1, GREEDY, use_tqdm=False)  # waits for a slot
    assert batch.stats["draft_cap"] == 3  # the per-step policy alone decides
    assert max(k for s in batch.samples for k in s.acceptance["k_per_step"]) > 1
