"""Closed batches: whether they draft and how deep (both replayed), and the engine running both."""

from collections import deque

import pytest
import torch

from replay_testing import COSTS, flat_costs, record
from rollout import RolloutGenerator, SamplingParams
from spec import RequestAcceptance
from spec.adaptive import StepCostModel
from spec.adaptive.batch_replay import UNSEEN, BatchTiming, Trace
from spec.adaptive.closed_batch import FIRST_RECHECK, NUM_BATCHES, RECHECK, REPLAY_REQUESTS, ClosedBatchSchedule, Replay, \
    best_k, drafting_wins

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def _timing(seconds: float = 1e6) -> BatchTiming:
    """A two-step run: the first step 0 s, nothing outside verification (a replay reads only these)."""
    timing = BatchTiming()
    timing.observe_step(0.0, 0.0, 0.0)
    timing.observe_step(seconds, 0.0, seconds)
    return timing


def _observe(schedule: ClosedBatchSchedule, lengths: list[int], drafted: bool, costs: StepCostModel = COSTS,
             records: list | None = None, k_limit: int = 0, seconds: float = 1e6) -> None:
    """A closed batch; with drafts, every one accepted unless `records` says otherwise."""
    if records is None:
        records = [record([(1, 1)]) if drafted else RequestAcceptance() for _ in lengths]
    schedule.observe(lengths, [64] * len(lengths), records, _timing(seconds), costs, k_limit)


# 64 requests of 40 tokens (a size's window is then its last NUM_BATCHES batches), their drafts always rejected: at
# 1 s a verification and 0.02 s a draft forward, K = 0 replays at 39 s (the first step is free here), K = 1 at 39.8
# (each step a forward more)
NEVER, WIDE = [record([(1, 0)] * 40)] * REPLAY_REQUESTS, [40] * REPLAY_REQUESTS


def test_a_size_where_no_drafts_replay_fastest_decodes_without_them_and_rechecks_sooner_than_later():
    schedule, cheap = ClosedBatchSchedule(), flat_costs(0.02)
    assert schedule.allows_drafting(64) and schedule.k_max(64) is None  # nothing known: draft, no cap
    _observe(schedule, WIDE, drafted=True, costs=cheap, records=NEVER, k_limit=3)
    assert schedule._replays[7][0][1][:2] == [pytest.approx(39.0), pytest.approx(39.8)]
    assert not schedule.allows_drafting(64) and schedule.k_max(64) == 0 and schedule.k_max(127) == 0
    assert schedule.k_max(63) is None and schedule.k_max(128) is None  # other powers of two have no batch yet
    # The 2nd batch after the verdict drafts again (the K >= 1 replayed fastest); each recheck that confirms the loss
    # doubles the wait, up to RECHECK
    for wait in (FIRST_RECHECK, 2 * FIRST_RECHECK, 4 * FIRST_RECHECK, RECHECK, RECHECK):
        for _ in range(wait - 1):
            assert not schedule.allows_drafting(64) and schedule.k_max(64) == 0
            _observe(schedule, WIDE, drafted=False)
        assert schedule.allows_drafting(64) and schedule.k_max(64) == 1
        _observe(schedule, WIDE, drafted=True, costs=cheap, records=NEVER, k_limit=3)
        assert not schedule.allows_drafting(64)
    assert 4 * FIRST_RECHECK < RECHECK
    for _ in range(RECHECK - 1):
        _observe(schedule, WIDE, drafted=False)
    # Two drafts accepted in three: K = 2 replays at about 14 s, against 39 without drafts, and outweighs the window's
    # two losing batches (0.8 and 1.6 s each at K = 1 and 2)
    _observe(schedule, WIDE, drafted=True, costs=cheap, records=[record([(3, 2)] * 14)] * len(WIDE), k_limit=3)
    assert schedule.allows_drafting(64) and schedule.k_max(64) == 2
    for _ in range(NUM_BATCHES):  # the window turns to losing batches again: the 2nd batch rechecks
        _observe(schedule, WIDE, drafted=True, costs=cheap, records=NEVER, k_limit=3)
    assert not schedule.allows_drafting(64)
    _observe(schedule, WIDE, drafted=False)
    assert schedule.allows_drafting(64)


# 4 requests of 40 tokens whose drafts are accepted twice, then rejected, over and over (every position seen, so the
# replays draw nothing): a step emits 2 tokens at K = 1, 3 at K = 2 and at K = 3, whose third draft is always
# rejected. At 0.3 s a draft forward and 1 s a verification, K = 0-3 replay at 39.0, 34.1, 21.1, 25.0 s
# (spec/adaptive/batch_replay.py). Accepted three times, then rejected: 4 tokens a step at K = 3.
TWO_IN_THREE = [record([(3, 2)] * 14)] * 4
THREE_IN_FOUR = [record([(4, 3)] * 10)] * 4
LONG = [40] * 4


def test_a_size_offers_the_k_its_replays_found_fastest():
    schedule = ClosedBatchSchedule()
    _observe(schedule, LONG, drafted=True, costs=flat_costs(0.3), records=TWO_IN_THREE, k_limit=3)
    assert schedule._replays[3][0] == (4, [pytest.approx(s) for s in (39.0, 34.1, 21.1, 25.0)], 0.0)
    assert schedule.k_max(4) == 2 and schedule.k_max(7) == 2
    assert schedule.k_max(8) is None and schedule.k_max(3) is None  # other powers of two have no batch yet: no cap
    for _ in range(REPLAY_REQUESTS // len(LONG)):  # their third drafts are accepted
        assert schedule._replays[3][0][1][3] == pytest.approx(25.0)  # the first batch's replay still counts
        _observe(schedule, LONG, drafted=True, costs=flat_costs(0.02), records=THREE_IN_FOUR, k_limit=3)
    # The batches replayed hold REPLAY_REQUESTS requests: the first one has gone
    assert len(schedule._replays[3]) == REPLAY_REQUESTS // len(LONG) and schedule._replays[3][0][1][3] < 25.0
    assert schedule.k_max(4) == 3
    wide = [40] * REPLAY_REQUESTS  # batches as large as REPLAY_REQUESTS: the last NUM_BATCHES decide
    _observe(schedule, wide, drafted=True, costs=flat_costs(0.3), records=TWO_IN_THREE[:1] * len(wide), k_limit=3)
    assert schedule.k_max(len(wide)) == 2
    for _ in range(NUM_BATCHES):
        _observe(schedule, wide, drafted=True, costs=flat_costs(0.02), records=THREE_IN_FOUR[:1] * len(wide),
                 k_limit=3)
    assert len(schedule._replays[len(wide).bit_length()]) == NUM_BATCHES and schedule.k_max(len(wide)) == 3
    schedule = ClosedBatchSchedule()
    _observe(schedule, LONG, drafted=True, costs=flat_costs(0.3), records=TWO_IN_THREE, k_limit=0)
    assert schedule.k_max(4) is None  # a batch allowed no drafts is not replayed


def test_a_k_the_fastest_replay_beats_by_less_than_min_gain_is_offered_where_it_is_smaller_but_drafting_needs_a_win():
    # seconds at K = 0 .. 3, summed over the window's batches: K = 3 is fastest, K = 2 within 0.5% of it over two
    # batches (8.02 + 8.02 against 8.0 + 7.99: 0.3%; REPLAY_MIN_GAIN is 0.5%), K = 1 not (1.2%)
    window = [Replay(4, [10.0, 8.1, 8.02, 8.0], 0.0), Replay(4, [10.0, 8.1, 8.02, 7.99], 0.0)]
    assert best_k(window) == 2 and drafting_wins(window)
    assert best_k([Replay(4, [10.0, 8.2, 8.1, 8.0], 0.0)]) == 3  # 1.25% behind: the deeper K is worth it
    # Whether to draft takes no margin: a verdict for K = 0 is not replayed again until its recheck
    assert drafting_wins([Replay(64, [10.0, 9.95, 9.99], 0.0)]) and best_k([Replay(64, [10.0, 9.95, 9.99], 0.0)]) == 1
    assert not drafting_wins([Replay(64, [10.0, 10.01, 10.2], 0.0)])
    schedule = ClosedBatchSchedule()
    schedule._replays[7] = deque([Replay(64, [10.0, 9.95, 9.99], 0.0)])
    assert schedule.k_max(64) == 1
    schedule._replays[7] = deque([Replay(64, [10.0, 10.01, 10.2], 0.0)])
    assert schedule.k_max(64) == 0


def test_a_stall_in_one_batchs_prompt_prefill_does_not_turn_drafting_off():
    # Batches of 1 request whose drafting replays well ahead of K = 0 (0.06 s at K = 2 against 0.1), the drafter's
    # prompt prefill measured at 0.005 s, in one batch at 2 s (the machine stalled there). Charged its own, that batch
    # alone would put K = 0 ahead over the three (2.2 s against 0.3); each is charged the window's median per request
    steady, stalled = Replay(1, [0.1, 0.08, 0.06], 0.005), Replay(1, [0.1, 0.08, 0.06], 2.0)
    assert drafting_wins([steady, stalled, steady]) and best_k([steady, stalled, steady]) == 2
    assert drafting_wins([stalled, steady, steady])  # the first batch of a size no more than a later one
    # per request: a batch of 4 whose prefill took 4 times one of 1 is charged alike
    assert best_k([Replay(4, [0.4, 0.33, 0.3], 0.02), stalled, steady]) == 2
    assert not drafting_wins([stalled, stalled, steady])  # a prefill dear in most batches counts


def _adaptive(target, draft, max_num_seqs=4, draft_seconds=0.01, token_seconds=0.0):
    """Verification 1 s a step plus token_seconds a token beyond one per row; a draft forward draft_seconds."""
    config = {"method": "draft_model", "num_speculative_tokens": 3, "enable_adaptive_verification": True}
    costs = {"verify": {n: {n: 1.0, 4 * n: 1.0 + 3 * n * token_seconds} for n in (1, 2, 4)},
             "draft": {1: draft_seconds, 4: draft_seconds}}
    return RolloutGenerator(target, speculative_config=config, draft_model=draft, max_num_seqs=max_num_seqs,
                            max_model_len=64, step_costs=costs)



def test_the_engine_skips_drafting_where_drafting_lost_and_teaches_the_schedule(target, draft):
    prompts = [[5, 6, 7, 5, 6, 7], [3, 4], [9, 9, 9]]
    plain = RolloutGenerator(target, max_num_seqs=4, max_model_len=64).generate(prompts, 1, GREEDY, use_tqdm=False)
    generator = _adaptive(target, draft)
    schedule, costs, lengths = generator.backend.speculation.policy.closed_batch, generator.backend.speculation.policy.costs, [12, 12, 12]
    # fabricated: every draft rejected, so each draft forward replays as a loss
    _observe(schedule, lengths, drafted=True, costs=costs, records=[record([(1, 0)] * 12)] * 3, k_limit=3)
    batch = generator.generate(prompts, 1, GREEDY, use_tqdm=False)
    assert batch.stats["num_proposed_draft_tokens"] == 0
    assert batch.stats["draft_cap"] == 0 and batch.metrics["spec/draft_cap"] == 0.0
    assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in plain.samples]
    # The run was an undrafted closed batch of 3, the 1st since the verdict: the next one rechecks
    assert schedule.allows_drafting(3) and schedule.k_max(3) == 1

    fresh = _adaptive(target, target)  # the target drafting for itself: greedy, every draft accepted
    caps = []  # nothing known: no cap; then the K the batches replayed fastest
    for _ in range(NUM_BATCHES):
        expected = fresh.backend.speculation.policy.closed_batch.k_max(3)
        batch = fresh.generate(prompts, 1, GREEDY, use_tqdm=False)
        caps.append(batch.stats["draft_cap"])
        assert batch.stats["draft_cap"] == (3 if expected is None else expected)
        assert batch.stats["num_proposed_draft_tokens"] > 0
        assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in plain.samples]
    # Every step a second in the table, a draft forward 0.01 s, every draft accepted: the deepest K replays fastest
    assert caps == [3, 3, 3]


def test_under_its_cap_a_closed_batch_drafts_and_verifies_the_cap_for_every_request(target, draft):
    prompts = [[5, 6, 7, 5, 6, 7], [3, 4], [9, 9, 9]]
    plain = RolloutGenerator(target, max_num_seqs=4, max_model_len=64).generate(prompts, 1, GREEDY, use_tqdm=False)
    # dear draft forwards: per step none pays, yet under the cap every request drafts and verifies it
    generator = _adaptive(target, draft, draft_seconds=10.0)
    open_batch = generator.generate(prompts + prompts[:2], 1, GREEDY, use_tqdm=False)  # 5 > 4: not closed
    assert open_batch.stats["draft_cap"] == 3  # no cap: the per-step policy drafts nothing from its second step on
    assert all(0 in s.acceptance["k_per_step"][1:-1] for s in open_batch.samples)
    _observe(generator.backend.speculation.policy.closed_batch, LONG[:3], drafted=True, costs=flat_costs(0.3),
             records=TWO_IN_THREE[:3], k_limit=3)  # size 3: K = 2
    batch = generator.generate(prompts, 1, GREEDY, use_tqdm=False)
    assert batch.stats["draft_cap"] == 2 and batch.metrics["spec/draft_cap"] == 2.0
    assert batch.stats["num_draft_tokens"] == batch.stats["num_proposed_draft_tokens"]  # every draft verified
    for sample in batch.samples:  # at every step, 2 drafts or as many as the request had room for
        before = 0
        for offered, accepted in zip(sample.acceptance["k_per_step"], sample.acceptance["num_accepted_per_step"]):
            assert offered == min(2, GREEDY.max_tokens - before - 1)
            before += accepted + 1
    assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in plain.samples]


def test_a_closed_batchs_trace_holds_the_outcomes_its_drafter_revealed_where_it_verified_no_draft(target):
    # The target drafting for itself, sampled: its greedy drafts are accepted at their probability, often but not
    # always. Where a step's drafts were all accepted, the position after them verified none; the drafter's next
    # forward reveals whether its draft there would have been accepted: whether the target's argmax there, from the
    # committed tokens before it (one HF forward over the completion), is the committed token.
    prompts = [[5, 6, 7, 5, 6, 7], [3, 4], [9, 9, 9], [2, 8, 2, 8]]
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=3)
    generator = _adaptive(target, target)
    schedule, records = generator.backend.speculation.policy.closed_batch, []
    observe = schedule.observe
    schedule.observe = lambda lengths, max_lengths, batch_records, *rest, **kw: (
        records.extend(batch_records), observe(lengths, max_lengths, batch_records, *rest, **kw))
    samples = generator.generate(prompts, 1, params, use_tqdm=False).samples
    revealed, expected = [], []
    for sample, record in zip(samples, records):
        with torch.no_grad():
            argmax = target(torch.tensor([sample.prompt_ids + sample.completion_ids])).logits[0].argmax(-1).tolist()
        start = len(sample.prompt_ids) - 1  # the logit that predicts the completion's first token
        revealed += [record.revealed[p] for p in sorted(record.revealed)]
        expected += [argmax[start + p] == sample.completion_ids[p] for p in sorted(record.revealed)]
    assert revealed == expected and len(revealed) >= 5 and set(revealed) == {True, False}
    # what is left unseen is at most each completion's last token (it ends the request: nothing drafts after it)
    outcomes = Trace(records, [len(s.completion_ids) for s in samples]).outcomes
    assert sum((row[:len(s.completion_ids)] == UNSEEN).sum() for row, s in zip(outcomes, samples)) <= len(samples)


def test_a_batch_larger_than_max_num_seqs_is_not_a_closed_batch(target, draft):
    generator = _adaptive(target, draft, max_num_seqs=2)
    _observe(generator.backend.speculation.policy.closed_batch, LONG[:3], drafted=True, costs=flat_costs(0.3), records=TWO_IN_THREE[:3],
             k_limit=3)  # size 3: K = 2
    batch = generator.generate([[5, 6, 7], [3, 4], [9, 9]], 1, GREEDY, use_tqdm=False)  # waits for a slot
    assert batch.stats["draft_cap"] == 3  # the per-step policy alone decides
    assert max(k for s in batch.samples for k in s.acceptance["k_per_step"]) > 1


def test_a_lone_request_is_not_a_closed_batch(target, draft):
    generator = _adaptive(target, draft)
    schedule = generator.backend.speculation.policy.closed_batch
    _observe(schedule, [12], drafted=True, costs=generator.backend.speculation.policy.costs, records=[record([(1, 0)] * 12)],
             k_limit=3)  # fabricated: every draft rejected, so a closed batch of 1 would decode without drafts
    assert schedule.k_max(1) == 0
    plain = RolloutGenerator(target, max_num_seqs=4, max_model_len=64).generate([[5, 6, 7]], 1, GREEDY, use_tqdm=False)
    batch = generator.generate([[5, 6, 7]], 1, GREEDY, use_tqdm=False)
    assert batch.stats["draft_cap"] == 3 and batch.stats["num_proposed_draft_tokens"] > 0  # the per-step policy
    assert generator.backend.speculation.policy.cap is None
    assert not schedule.allows_drafting(1)  # not observed: an undrafted closed batch of 1 would bring its recheck
    assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in plain.samples]
