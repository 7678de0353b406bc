"""Replaying a closed batch at a uniform K: its trace, the draws at unseen positions, the replay's steps and costs."""

import numpy as np
import pytest

from replay_testing import COSTS, flat_costs, record
from spec import RequestAcceptance
from spec.adaptive.batch_replay import ACCEPTED as A, PRIOR, REJECTED as R, UNSEEN as U, BatchTiming, Trace, \
    prefill_seconds, replayed_seconds

STEPS = flat_costs(1e-9)  # draft forwards next to free: a replay's seconds count its steps


def _timing(first: float = 4.0, other: float = 0.5, first_draft: float = 1.0) -> BatchTiming:
    """A two-step run: the first step `first` seconds without drafting (and first_draft drafting), `other` seconds a
    step outside drafting and verification."""
    timing = BatchTiming()
    timing.observe_step(seconds=first + first_draft, draft_seconds=first_draft, verify_seconds=first - other)
    timing.observe_step(seconds=2.0, draft_seconds=0.5, verify_seconds=1.5 - other)
    return timing


def _later_steps(records: list, lengths: list[int], k_max: int) -> list[float]:
    """Mean replayed steps after the first, per k = 0 .. k_max (STEPS costs, nothing outside verification)."""
    seconds = replayed_seconds(lengths, [64] * len(lengths), Trace(records, lengths), k_max, _timing(0.0, 0.0, 0.0),
                               STEPS)
    return [round(s, 6) for s in seconds]


def test_the_trace_marks_each_position_accepted_rejected_or_unseen():
    # 1 of 3 accepted; no drafts; 2 of 2 (the token after them unseen); 1 of 4; then the completion's last token
    trace = Trace([record([(3, 1), (0, 0), (2, 2), (4, 1)]), RequestAcceptance()], [9, 2])
    assert trace.outcomes.tolist() == [[A, R, U, A, A, U, A, R, U], [U] * 2 + [U] * 7]
    assert (Trace([record([(0, 0)] * 3), RequestAcceptance()], [3, 1]).outcomes == U).all()


def test_revealed_positions_are_seen_and_replayed_as_they_would_have_gone():
    # 2 of 2 accepted, the token after them revealed accepted; 1 of 1; no drafts for two steps, revealed rejected and
    # accepted; then the completion's last token, unseen
    steps = [(2, 2), (1, 1), (0, 0), (0, 0), (1, 0)]
    revealed = record(steps)
    revealed.revealed.update({2: True, 5: False, 6: True})
    trace = Trace([revealed], [9])
    assert trace.outcomes.tolist() == [[A, A, A, A, U, R, A, R, U]]
    assert (Trace([record(steps)], [9]).outcomes == U).sum() == 5  # without them
    # the rates count them: position 8 follows a rejection and reads the rate over all seen positions, 5 of 7
    # (with the batch's, the same, at weight PRIOR), where without them it read 3 of 4 (positions 0, 1, 3, 7)
    assert trace.unseen_acceptance()[0, 8] == pytest.approx(5 / 7)
    assert Trace([record(steps)], [9]).unseen_acceptance()[0, 8] == pytest.approx(3 / 4)


def test_an_unseen_position_after_an_accepted_draft_reads_the_chain_s_posterior():
    # A A U A R R A A U R U, the same in every request (so each one's rates are the batch's). Seen: 5 of 8 accepted;
    # after an accepted draft 2 of 3 (f), after a rejected one 1 of 2 (g). Position 2 lies between two accepted
    # drafts: f^2 / (f^2 + (1 - f) g) = 8/11; position 8 between an accepted and a rejected one:
    # f (1 - f) / (f (1 - f) + (1 - f)(1 - g)) = 4/7; position 10 follows a rejected one: the rate over all, 5/8.
    steps = [(2, 2), (2, 1), (1, 0), (2, 2), (1, 0)]
    trace = Trace([record(steps)] * 3, [11] * 3)
    assert trace.outcomes[0].tolist() == [A, A, U, A, R, R, A, A, U, R, U]
    chance = trace.unseen_acceptance()
    assert chance[:, [2, 8, 10]].tolist() == [pytest.approx([8 / 11, 4 / 7, 5 / 8])] * 3


def test_a_request_s_rates_count_the_batch_s_with_weight_prior():
    # Rejected, rejected, then unseen; in a batch whose other request accepts 6 of its 8 seen drafts (A A A R twice):
    # the batch's rate 6/10, the first request's (0 + PRIOR 0.6) / (2 + PRIOR), the second's (6 + PRIOR 0.6) / (8 +
    # PRIOR), each at its position after a rejected draft.
    trace = Trace([record([(1, 0), (1, 0)]), record([(4, 3)] * 2)], [3, 9])
    chance = trace.unseen_acceptance()
    assert chance[0, 2] == pytest.approx(PRIOR * 0.6 / (2 + PRIOR))
    assert chance[1, 8] == pytest.approx((6 + PRIOR * 0.6) / (8 + PRIOR))


def test_draws_keep_the_seen_positions_and_draw_the_unseen_at_their_chance():
    trace = Trace([record([(2, 2), (2, 1), (1, 0), (2, 2), (1, 0)])], [11])
    draws = trace.draws(4000, np.random.default_rng(0))
    seen = trace.outcomes[0] != U
    assert (draws[:, 0, seen] == (trace.outcomes[0, seen] == A)).all()
    # 4000 draws: the sd of a drawn frequency is at most 0.008, so 0.03 is nearly 4 of them
    assert draws[:, 0, ~seen].mean(axis=0) == pytest.approx(trace.unseen_acceptance()[0, ~seen], abs=0.03)


def test_a_request_accepts_as_many_unseen_drafts_as_their_chances_add_up_to():
    # 20 unseen positions after accepted drafts (one accepted draft a step, then the token after it), each at the
    # chance f^2 / (f^2 + (1 - f) g) of the chain, every draw accepts the sum of those chances, rounded down or up
    trace = Trace([record([(1, 1)] * 20 + [(1, 0)] * 4)], [44])
    unseen = trace.outcomes[0] == U
    total = trace.unseen_acceptance()[0, unseen].sum()
    counts = trace.draws(500, np.random.default_rng(0))[:, 0, unseen].sum(axis=1)
    assert 0 < total % 1 and set(counts.tolist()) == {int(total), int(total) + 1}


def test_a_replay_ends_each_step_at_its_first_rejected_draft_at_any_k():
    # A A A R, three times, every position seen: K = 3 and 4 emit 4 tokens a step (3 steps), K = 1 and 2 emit 2 a
    # step (6: at K = 2, A A then R alone); without drafts 12
    assert _later_steps([record([(4, 3)] * 3)], [12], 4) == [11, 5, 5, 2, 2]


def test_at_the_k_the_batch_ran_the_replay_takes_its_steps_whatever_it_draws():
    # every draft accepted at two of its four steps: the token after them was never drafted, and is drawn
    records = [record([(3, 3), (3, 1), (3, 3), (3, 0)]), record([(3, 1), (3, 3), (3, 2)])]
    assert _later_steps(records, [11, 9], 3)[3] == 3


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


def _sure(lengths: list[int]) -> Trace:
    """Every draft accepted: one at each step, the token after it unseen (and drawn at the batch's rate, 1)."""
    return Trace([record([(1, 1)] * 8)] * len(lengths), lengths)


def _never(lengths: list[int]) -> Trace:
    return Trace([record([(1, 0)] * 16)] * len(lengths), lengths)


def test_a_replay_with_sure_drafts_emits_k_plus_one_tokens_a_step():
    # K = 1, every draft accepted: 2 tokens a step, so the requests of 4, 1, 4, 2 tokens run 2, 1, 2, 1 steps. The
    # first step drafted 1 s, where one draft forward of its 4 rows reads 0.2: the 0.8 beyond is the drafter's prompt
    # prefill, left to the caller to charge at every K >= 1. The second step's 2 rows had all their drafts accepted:
    # the drafter is fed 2 tokens in each, a forward of 4 tokens.
    first = 4.0 + COSTS.draft_cost([4]) + COSTS.verify_cost(4, 8) - COSTS.verify_cost(4, 4)
    expected = first + 0.5 + COSTS.verify_cost(2, 4) + COSTS.draft_cost([4])
    lengths = [4, 1, 4, 2]
    assert replayed_seconds(lengths, [9] * 4, _sure(lengths), 1, _timing(), COSTS)[1] == pytest.approx(expected)
    assert prefill_seconds(_sure(lengths), _timing(), COSTS) == pytest.approx(1.0 - COSTS.draft_cost([4]))
    assert prefill_seconds(_sure(lengths), _timing(first_draft=0.1), COSTS) == 0.0  # never below the model's


def test_drafts_that_always_fail_replay_slower_and_sure_ones_faster():
    lengths, timing = [9, 12, 7, 12], _timing()
    plain, *never = replayed_seconds(lengths, lengths, _never(lengths), 3, timing, COSTS)
    assert plain == pytest.approx(replayed_seconds(lengths, lengths, None, 0, timing, COSTS)[0])
    assert len(never) == 3 and all(seconds > plain for seconds in never)
    sure = replayed_seconds(lengths, lengths, _sure(lengths), 3, timing, COSTS)
    assert sure == sorted(sure, reverse=True) and sure[0] == pytest.approx(plain)


@pytest.mark.parametrize("steps, room, num_drafts", [
    ([(3, 3)], 3, 2),  # room for 3 tokens (max_tokens): 2 drafts emit them
    ([(3, 3)], 20, 3),  # the drafter drafted the stop token (its last position accepted): no drafts after it
    ([(3, 2)], 20, 8),  # it drafted another token there (rejected), and goes on drafting
])
def test_a_request_drafts_no_more_than_its_room_allows_nor_past_a_drafted_stop(steps, room, num_drafts):
    # a request of 3 tokens at K = 8, in one step: num_drafts forwards of 1 row, and their verification (the first
    # step drafted 3 times, 0.3 s in the model: the 0.7 s more it took is the prompt's prefill, not replayed)
    first = COSTS.draft_cost([1] * num_drafts) + COSTS.verify_cost(1, 1 + num_drafts) - COSTS.verify_cost(1, 1)
    assert replayed_seconds([3], [room], Trace([record(steps)], [3]), 8, _timing(), COSTS)[8] == \
        pytest.approx(4.0 + first)


def test_moving_requests_down_the_cache_is_charged_once_at_every_k_not_per_step():
    # The batch moved requests past finished ones for 0.3 s in its second step (Engine._condense: a copy per
    # finished request, whatever K). It is not part of a step's time outside drafting and verification, which a
    # replay charges per step (K = 0 takes 12 steps here, K = 1 6); it is charged as measured, once, at every K.
    lengths = [12]
    moved = BatchTiming()
    moved.observe_step(seconds=5.0, draft_seconds=1.0, verify_seconds=3.5)
    moved.observe_step(seconds=2.3, draft_seconds=0.5, verify_seconds=1.0, condense_seconds=0.3)
    assert moved.condense_seconds == 0.3 and moved.other_seconds_per_step == pytest.approx(0.5)  # as _timing()'s
    plain, with_moves = (replayed_seconds(lengths, [64], _sure(lengths), 2, timing, COSTS)
                         for timing in (_timing(), moved))
    assert [b - a for a, b in zip(plain, with_moves)] == pytest.approx([0.3] * 3)
