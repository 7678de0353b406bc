"""AdaptiveVerifier under a closed batch's cap (spec/closed_batch.py): every request drafts, further drafts are priced
on the batch's critical path, and steps of 32 rows or more verify the drafts that pay at the batch's rate."""

import itertools
from types import SimpleNamespace

import pytest

from spec import AdaptiveVerifier, ConfidenceCalibrator, StepCostModel


def test_under_a_closed_batch_cap_every_request_drafts_and_further_drafts_are_priced_on_the_critical_path():
    # 4 rows: verification 1 s plus 0.1 s a token beyond one per row; a draft forward 0.3 s whatever its rows
    costs = StepCostModel({4: {4: 1.0, 20: 2.6}}, {1: 0.3, 4: 0.3})
    adaptive = AdaptiveVerifier(ConfidenceCalibrator(max_positions=4, num_bins=10), costs)  # rates: the 1/2 prior
    adaptive.trims = False
    adaptive.begin_step(4, 4, 2)
    # One request's tokens per step at the cap, 1 + 1/2 + 1/4, over the modelled step: verifying 12 tokens (1.8 s)
    # and 2 draft forwards (0.6 s). A verified token costs 0.1 s at that rate.
    assert adaptive.rate == pytest.approx(1.75 / 2.4) and adaptive.threshold == pytest.approx(0.1 * 1.75 / 2.4)
    adaptive.begin_step(4, 40, 2)  # a step that prefills prompts is priced at the decoding step's rate
    assert adaptive.rate == pytest.approx(1.75 / 2.4)
    ids = [0, 1, 2, 3]
    assert adaptive.keep_drafting(ids, [[]] * 4) == [True] * 4  # the replays decided that the batch drafts
    # Next survivals 0.95 x 1/2 (three rows) and 0.05 x 1/2: a forward is worth 0.3 x 0.729 = 0.219 tokens, and
    # the three sure rows net 3 x (0.475 - 0.073) - 0.219 > 0; the unsure one is below the threshold.
    unsure = [[0.95], [0.95], [0.95], [0.05]]
    assert adaptive.keep_drafting(ids, unsure) == [True, True, True, False]
    # Priced at the batch's rate (4 requests' tokens in the same step), the sure rows would net 3 x (0.475 - 0.292)
    # - 0.875 < 0 and stop: the request the batch waits on would lose its drafts.
    adaptive.rate, adaptive.threshold = 4 * adaptive.rate, 4 * adaptive.threshold
    assert adaptive.keep_drafting(ids, unsure) == [False] * 4


def test_under_a_closed_batch_cap_a_request_verifies_its_first_draft_and_the_next_that_pay_at_the_batch_s_rate():
    # The step above: a verified token costs 0.1 s, at the critical path's rate 0.073 tokens' worth, at the batch's
    # (4 requests' tokens in the same step) 0.292. The calibrator's prior maps each confidence to its bin's middle.
    costs = StepCostModel({4: {4: 1.0, 20: 2.6}}, {1: 0.3, 4: 0.3})
    adaptive = AdaptiveVerifier(ConfidenceCalibrator(max_positions=4, num_bins=10), costs)
    adaptive.trims = False
    adaptive.begin_step(4, 4, 2)
    assert 4 * adaptive.threshold == pytest.approx(0.2917, abs=1e-4)
    ids, confidences = [0, 1, 2, 3], [[0.95, 0.95], [0.9, 0.2], [0.25, 0.9], [0.6, 0.6]]
    survival = adaptive.survival(ids, confidences)
    assert survival == [pytest.approx(s) for s in ([0.95, 0.9025], [0.95, 0.2375], [0.25, 0.2375], [0.65, 0.4225])]
    # every survival pays at the critical path's rate; at the batch's, the prefix of each request's above 0.292, and
    # a first draft whatever its survival (request 2's 0.25)
    assert all(value > adaptive.threshold for values in survival for value in values)
    assert adaptive.verified_under_cap(ids, confidences) == [2, 1, 1, 2]


def test_under_a_closed_batch_cap_only_steps_of_32_rows_or_more_with_a_second_draft_cut_drafts():
    costs = StepCostModel({1: {1: 1.0}}, {1: 0.1})
    adaptive = AdaptiveVerifier(ConfidenceCalibrator(max_positions=4, num_bins=10), costs)
    assert adaptive.cuts_under_cap([2] + [1] * 31)
    assert not adaptive.cuts_under_cap([4] * 31)  # too few rows: every draft is verified
    assert not adaptive.cuts_under_cap([1] * 64)  # first drafts only, which are always verified
    assert not adaptive.cuts_under_cap([])


def test_under_a_closed_batch_cap_further_draft_decisions_that_do_not_pay_are_made_every_8th_call(monkeypatch):
    ticks = itertools.count(step=0.01)  # each clock read 10 ms after the last: a decision takes 10 ms
    monkeypatch.setattr("spec.adaptive.time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    costs = StepCostModel({4: {4: 1.0, 20: 2.6}}, {1: 0.3, 4: 0.3})  # as in the test above

    def capped():
        adaptive = AdaptiveVerifier(ConfidenceCalibrator(max_positions=4, num_bins=10), costs)
        adaptive.trims = False
        adaptive.begin_step(4, 4, 2)
        decided, keep = [], adaptive._keep
        monkeypatch.setattr(adaptive, "_keep", lambda *args: decided.append(len(decided)) or keep(*args))
        return adaptive, decided

    ids = [0, 1, 2, 3]
    adaptive, decided = capped()
    sure = [[0.95]] * 4  # nothing to cut: deciding is worth nothing and takes 10 ms
    calls = [adaptive.keep_drafting(ids, sure) for _ in range(17)]
    assert calls == [[True] * 4] * 17 and len(decided) == 3  # the 1st, 9th and 17th call
    adaptive, decided = capped()
    unsure = [[0.95], [0.95], [0.95], [0.05]]  # cutting the unsure row is worth 0.066 s (test above) > 10 ms
    calls = [adaptive.keep_drafting(ids, unsure) for _ in range(17)]
    assert calls == [[True, True, True, False]] * 17 and len(decided) == 17


def test_under_a_closed_batch_cap_draft_extensions_are_timed_too(monkeypatch):
    clock = iter([9.0, 10.0, 10.0, 10.5, 10.5, 11.0, 12.0, 12.0, 13.0])  # a further-draft decision reads it twice
    monkeypatch.setattr("spec.adaptive.time", SimpleNamespace(perf_counter=lambda: next(clock)))
    costs = StepCostModel({2: {2: 1.0, 10: 2.0}}, {1: 0.2, 2: 0.2, 8: 0.3})
    adaptive = AdaptiveVerifier(ConfidenceCalibrator(max_positions=4, num_bins=10), costs)
    adaptive.trims = False  # every request gets every draft, and no step is planned
    assert adaptive.keep_drafting([0, 1], [[], []]) == [True, True]  # at 9.0: the first forward, not timed
    adaptive.keep_drafting([0, 1], [[0.1], [0.1]])  # at 10.0: both rows extended, however unsure
    adaptive.keep_drafting([0, 1], [[0.1, 0.1], [0.1, 0.1]])  # at 10.5: that extension took 0.5 s
    adaptive.observe_times([1, 1], [3, 3], 1.0)
    # as in test_adaptive.py's test_draft_extensions_are_timed_from_one_keep_drafting_call_to_the_next
    assert costs.draft_cost([2]) == pytest.approx(0.2 * 23 / 21)
    adaptive.keep_drafting([0, 1], [[], []])  # at 11.0: the next step's first forward
    adaptive.keep_drafting([0, 1], [[0.1], [0.1]])  # at 12.0: extended; then verification ends the step
    adaptive.observe_times([1, 1], [2, 2], 1.0)
    adaptive.keep_drafting([0, 1], [[], []])  # at 13.0: a new step; the last one's verification is no extension
    adaptive.observe_times([1, 1], [0, 0], 1.0)
    assert costs.draft_cost([2]) == pytest.approx(0.2 * 23 / 21)


def test_under_a_closed_batch_cap_the_calibration_still_learns_and_no_request_factor_is_kept():
    costs = StepCostModel({2: {2: 1.0, 10: 1.8}}, {1: 0.01, 2: 0.01})
    adaptive = AdaptiveVerifier(ConfidenceCalibrator(max_positions=4, num_bins=10), costs)
    adaptive.trims = False  # the engine's setting under a cap: its requests end with the batch
    sure = [[0.95, 0.95, 0.95, 0.95]] * 2
    for _ in range(10):
        adaptive.observe([7, 8], sure, [0, 4])  # judged: 1 draft of request 7's, 4 of 8's, a step
    assert adaptive.stats()["num_calibration_observations"] == 50 and adaptive._requests == {}
    adaptive.trims = True
    adaptive.observe([7, 8], sure, [0, 4])
    assert set(adaptive._requests) == {7, 8}
