"""Replaying a closed batch at a uniform K: judged steps resampled, and the replay's steps and costs."""

import numpy as np
import pytest

from replay_testing import COSTS, record
from spec import RequestAcceptance
from spec.batch_replay import BatchTiming, JudgedSteps, replayed_seconds


def _timing(first: float = 4.0, other: float = 0.5) -> BatchTiming:
    """A two-step run: the first step `first` seconds without drafting, `other` seconds a step outside drafting and
    verification."""
    timing = BatchTiming()
    timing.observe_step(seconds=first + 1.0, draft_seconds=1.0, verify_seconds=first - other)
    timing.observe_step(seconds=2.0, draft_seconds=0.5, verify_seconds=1.5 - other)
    return timing


def _accepted(records: list, k: int, num_replays: int = 200, num_steps: int = 20) -> np.ndarray:
    """Drafts accepted per replayed step at K = k: (replays, requests, steps)."""
    return JudgedSteps(records).accepted_at(k, (num_replays, len(records), num_steps), np.random.default_rng(0))


def test_a_replayed_step_replays_a_judged_one_and_a_rejection_ends_it_at_any_k():
    rejected_at_2 = [record([(3, 1)] * 4)]  # drafts offered at 0 steps are not judged
    assert all((_accepted(rejected_at_2, k) == 1).all() for k in (1, 2, 3, 8))
    sure = [record([(1, 1)] * 5)] * 2  # all accepted: a step goes on with another one while K has room
    assert all((_accepted(sure, k) == k).all() for k in (1, 2, 5))


def test_a_step_whose_drafts_were_all_accepted_goes_on_with_another_drawn_step():
    # Half the steps accept both drafts, half none. At K = 4: 0 (half), else 2 plus 0 or 2 (a quarter each): mean 1.5
    # (sd 1.66 a step; over 4000 steps the mean's sd is 0.026, so 0.1 is 4 of them).
    accepted = _accepted([record([(2, 2), (2, 0)] * 5)], 4)
    assert set(np.unique(accepted)) == {0, 2, 4}
    assert accepted.mean() == pytest.approx(1.5, abs=0.1)
    assert _accepted([record([(2, 2), (2, 0)] * 5)], 1).mean() == pytest.approx(0.5, abs=0.05)


def test_a_request_with_few_judged_steps_draws_from_the_batch_s_too():
    # A request with 18 steps accepted, one whose 2 were rejected: the second replays its own half the time (2 against
    # a prior of 2), the batch's 20 (18 accepted) otherwise: mean 0.5 x 0.9 = 0.45 at K = 1 (sd of the mean over its
    # 4000 replayed steps 0.008); the first its own 18 of 20 times: 0.9 + 0.1 x 0.9 = 0.99. A request never offered
    # drafts replays the batch's alone (0.9).
    accepted = _accepted([record([(1, 1)] * 18), record([(1, 0)] * 2), record([(0, 0)] * 3)], 1)
    assert accepted[:, 0].mean() == pytest.approx(0.99, abs=0.01)
    assert accepted[:, 1].mean() == pytest.approx(0.45, abs=0.03)
    assert accepted[:, 2].mean() == pytest.approx(0.9, abs=0.03)
    assert len(JudgedSteps([record([(0, 0)] * 3), RequestAcceptance()])) == 0


def test_a_replay_without_drafts_is_the_first_step_then_one_token_per_running_request_per_step():
    timing = _timing()
    assert timing.first_step_seconds == 4.0 and timing.other_seconds_per_step == pytest.approx(0.5)
    # lengths 1, 2, 4, 4: step 2 runs the 3 with at least 2 tokens, steps 3 and 4 the 2 with 4
    expected = 4.0 + sum(COSTS.verify_cost(n, n) + 0.5 for n in (3, 2, 2))
    assert replayed_seconds([4, 1, 4, 2], [9] * 4, None, 0, timing, COSTS) == [pytest.approx(expected)]
    assert COSTS.verify_cost(3, 3) == pytest.approx(2.5)  # between the 2- and 4-row curves at 1 token per row


def test_the_first_step_s_own_drafts_are_taken_out_of_its_measured_time():
    timing = BatchTiming()
    timing.observe_step(seconds=5.0, draft_seconds=1.0, verify_seconds=3.5, num_drafts=4)  # 4 drafts verified
    timing.observe_step(seconds=2.0, draft_seconds=0.5, verify_seconds=1.0)
    assert (timing.first_step_seconds, timing.first_step_drafts) == (4.0, 4)
    # one request of 1 token: the first step alone, less its 4 drafts' verification (5 - 3 on the 1-row curve)
    assert replayed_seconds([1], [9], None, 0, timing, COSTS) == [pytest.approx(4.0 - (COSTS.verify_cost(1, 5) - 1.0))]
    assert COSTS.verify_cost(1, 5) == pytest.approx(3.0)


SURE, NEVER = JudgedSteps([record([(1, 1)] * 3)] * 4), JudgedSteps([record([(1, 0)] * 3)] * 4)


def test_a_replay_with_sure_drafts_emits_k_plus_one_tokens_a_step():
    # K = 1, every draft accepted: 2 tokens a step, so the requests of 4, 1, 4, 2 tokens run 2, 1, 2, 1 steps
    first = 4.0 + COSTS.draft_cost([4]) + COSTS.verify_cost(4, 8) - COSTS.verify_cost(4, 4)
    expected = first + 0.5 + COSTS.verify_cost(2, 4) + COSTS.draft_cost([2])
    assert replayed_seconds([4, 1, 4, 2], [9] * 4, SURE, 1, _timing(), COSTS)[1] == pytest.approx(expected)


def test_drafts_that_always_fail_replay_slower_and_sure_ones_faster():
    lengths, timing = [9, 12, 7, 12], _timing()
    plain, *never = replayed_seconds(lengths, lengths, NEVER, 3, timing, COSTS)
    assert plain == pytest.approx(replayed_seconds(lengths, lengths, None, 0, timing, COSTS)[0])
    assert len(never) == 3 and all(seconds > plain for seconds in never)
    sure = replayed_seconds(lengths, lengths, SURE, 3, timing, COSTS)
    assert sure == sorted(sure, reverse=True) and sure[0] == pytest.approx(plain)


def test_a_draw_at_the_largest_k_cut_at_a_smaller_one_is_a_draw_at_that_k():
    # The replay draws once, at k_max, and cuts the runs at each smaller k. Steps accept 2 of 2 drafts (half of
    # them), 1 of 3 or 0 of 1 (a quarter each): a draw at K = 1, 2, 3 accepts 0.75, 1.25 and 1.625 on average (at 3,
    # a step of 2 of 2 goes on with one more draw cut at 1: 2 + 0.75). Over 4000 steps the sd of a mean is at most
    # 0.02, so 0.06 is 3 of them.
    records = [record([(2, 2), (2, 2), (3, 1), (1, 0)] * 3)]
    for k, mean in ((1, 0.75), (2, 1.25), (3, 1.625)):
        assert np.minimum(_accepted(records, 5), k).mean() == pytest.approx(mean, abs=0.06)
        assert _accepted(records, k).mean() == pytest.approx(mean, abs=0.06)


def test_a_request_drafts_no_more_than_its_room_allows():
    # 3 tokens at K = 8, every draft accepted. With room for 3 (max_tokens): one step of 2 drafts, their 2 forwards of
    # 1 row. With room for more, 8 drafts (a drafter that drafts the stop token stops there, which the replay does
    # not foresee), 8 forwards.
    sure = JudgedSteps([record([(1, 1)] * 3)])
    for room, num_drafts in ((3, 2), (20, 8)):
        first = COSTS.draft_cost([1] * num_drafts) + COSTS.verify_cost(1, 1 + num_drafts) - COSTS.verify_cost(1, 1)
        expected = 4.0 + first
        assert replayed_seconds([3], [room], sure, 8, _timing(), COSTS)[8] == pytest.approx(expected)
