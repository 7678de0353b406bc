"""AdaptivePolicy (spec/adaptive/policy.py) on its own: survival, the draft depths it plans before drafting, the
budget it selects, the rate it prices with, what it learns from each step, and how it follows a batch's drain."""

import numpy as np
import pytest

from spec import Proposal, StepInfo, StepOutcome
from spec.adaptive import AdaptivePolicy, ConfidenceCalibrator, StepCostModel

FLAT = {"verify": {n: {n: 1.0, 9 * n: 1.0} for n in (1, 2, 4, 8)}, "draft": {1: 0.01, 8: 0.01}}


def _policy(costs) -> AdaptivePolicy:
    costs = costs if isinstance(costs, StepCostModel) else StepCostModel.from_dict(costs)
    return AdaptivePolicy(ConfidenceCalibrator(max_positions=4, num_bins=10), costs)


def _step(req_ids, max_drafts, uncached=None, k_max=4) -> StepInfo:
    return StepInfo(list(req_ids), uncached or [1] * len(req_ids), list(max_drafts), k_max)


def _outcome(verified: Proposal, num_accepted, verify_seconds=1.0, forward_seconds=None) -> StepOutcome:
    verified.forward_seconds = forward_seconds
    return StepOutcome(verified, list(num_accepted), verified.num_draft_tokens, verify_seconds + 0.1, 0.1,
                       verify_seconds, 0.0)


def _sure(num_rows: int, k: int = 4) -> Proposal:
    return Proposal([[3] * k for _ in range(num_rows)], [[0.95] * k for _ in range(num_rows)])


def test_survival_is_the_running_product_of_calibrated_confidences():
    calibrator = ConfidenceCalibrator(max_positions=4, num_bins=10)
    policy = AdaptivePolicy(calibrator, StepCostModel.from_dict(FLAT))
    survival = policy.survival([0, 1, 2], [[0.95, 0.55], [], [0.05]])
    assert survival[0] == pytest.approx([0.95, 0.95 * 0.55])  # before any outcome the map is the identity
    assert survival[1] == [] and survival[2] == pytest.approx([0.05])
    calibrator.observe(np.zeros(8, dtype=int), np.full(8, 0.95), np.ones(8, dtype=bool))  # 8 of 8 in 0.95's bin
    assert policy.survival([0], [[0.95]])[0] == pytest.approx([(8 + 4 * 0.95) / (8 + 4)])  # prior: 4 at 0.95


def test_draft_depths_follow_the_drafts_that_pay_for_a_forward():
    """Depth by depth, the rows whose expected next survival (survival x the position's acceptance rate) beats
    the threshold by more than the forward costs (rate x D(m)) are extended; all decided before drafting."""
    costs = StepCostModel({2: {2: 1.0, 20: 1.0}}, {1: 0.2, 8: 0.2})  # a draft forward: 0.2 s whatever its rows
    calibrator = ConfidenceCalibrator(max_positions=4, num_bins=10)
    policy = AdaptivePolicy(calibrator, costs)
    assert policy.draft_limits(_step([0, 1], [4, 4])).num_drafts == [4, 4]  # nothing priced yet: up to k_max
    policy.rate, policy.threshold = 2.0, 0.1  # a forward is worth 0.4 tokens; a verified token pays above 0.1
    # prior rates 1/2: depth 0 gains 2 x (0.5 - 0.1) = 0.8 > 0.4 for both rows (one alone: 0.4, not more);
    # depth 1 (0.25 each) gains 0.3 < 0.4: stop
    assert policy.draft_limits(_step([0, 1], [4, 4])).num_drafts == [1, 1]
    calibrator.observe(np.repeat(np.arange(4), 20), np.full(80, 0.95), np.ones(80, dtype=bool))
    rates = [calibrator.acceptance_rate(j) for j in range(4)]
    assert min(rates) > 0.85  # 20 of 20 at every position
    assert policy.draft_limits(_step([0, 1], [4, 2])).num_drafts == [4, 2]  # within each row's most
    policy.rate = 20.0  # a forward now costs 4 tokens' worth: nothing pays for one
    assert policy.draft_limits(_step([0, 1], [4, 4])).num_drafts == [0, 0]


def test_a_draft_forward_that_widens_every_row_pays_for_the_width():
    """The runner pads attention to the widest row unless at most an eighth of the rows are wide: extending more
    rows than that by a draft costs every row a query (spec/adaptive/step_cost.py)."""
    # 8 rows: each token per row 1 s, of which 0.01 s per token at a fixed width; a draft forward 0.01 s
    costs = StepCostModel({8: {8: 1.0, 16: 2.0, 24: 3.0}}, {1: 0.01, 8: 0.01}, {8: 0.01})
    policy = _policy(costs)
    policy.rate, policy.threshold = 8.0, 0.1
    # Each first draft: survival 0.5 (the prior rate), 0.4 over the threshold. Widening all 8 rows costs
    # 8 tokens/s x (1 - 8 x 0.01) s = 7.4 tokens, more than 8 x 0.4; one row alone is split off and pays its forward.
    assert sum(policy.draft_limits(_step(range(8), [1] * 8)).num_drafts) == 1
    # prompts set this step's width: drafting adds none
    assert policy.draft_limits(_step(range(8), [1] * 8, uncached=[10] * 8)).num_drafts == [1] * 8


def test_select_verifies_the_budget_that_maximises_tokens_per_second_and_learns_its_rate():
    costs = StepCostModel({2: {2: 1.0, 10: 1.8}}, {1: 0.01, 2: 0.01})  # each verified draft costs 0.1 s
    policy = _policy(costs)
    step = _step([0, 1], [4, 4])
    policy.draft_limits(step)
    proposal = Proposal([[3] * 4, [3] * 4], [[0.95] * 4, [0.05] * 4])
    assert policy.select(step, proposal, draft_seconds=0.0) == [4, 0]  # 0.05 does not pay for 0.1 s
    assert policy.rate > 2.0 and 0 < policy.threshold < 0.95  # faster than the 2 tokens/s without drafts


def test_drafting_decisions_use_the_rate_last_seen_at_a_similar_batch_size():
    costs = StepCostModel({n: {n: 1.0, 9 * n: 1.0 + 0.1 * n} for n in (1, 2, 4, 8, 16, 32)}, {1: 0.1, 32: 0.2})
    policy = _policy(costs)
    big_step, small_step = _step(range(32), [2] * 32), _step([0], [2])
    policy.draft_limits(big_step)
    policy.select(big_step, _sure(32, 2), draft_seconds=0.5)
    big = policy.rate, policy.threshold
    policy.draft_limits(small_step)
    policy.select(small_step, _sure(1, 2), draft_seconds=0.2)
    assert policy.rate < big[0] / 4  # a lone request: far fewer tokens for a step of similar cost
    policy.draft_limits(_step(range(40), [2] * 40))  # a batch of 32-63 again: back to what was seen at 32
    assert (policy.rate, policy.threshold) == big
    policy.draft_limits(_step(range(200), [2] * 200, uncached=[10] * 200))  # nothing at this size: the nearest's
    assert (policy.rate, policy.threshold) == big


def test_drafting_never_prices_time_below_the_rate_of_a_step_without_drafts():
    costs = StepCostModel({n: {n: 1.0, 9 * n: 1.0 + 0.1 * n} for n in (1, 2, 4, 8, 16, 32)}, {1: 0.1, 32: 0.2})
    policy = _policy(costs)
    step = _step(range(32), [1] * 32)
    policy.draft_limits(step)
    unsure = Proposal([[3]] * 32, [[0.3]] * 32)
    policy.select(step, unsure, draft_seconds=2.0)  # unsure drafts after a long drafting time
    low_rate, low_threshold = policy.rate, policy.threshold
    assert low_rate < 32.0
    assert policy.draft_limits(step).num_drafts == [0] * 32  # at plain decoding's rate no draft pays
    assert policy.rate == pytest.approx(32.0)  # 32 rows in the 1 s a step without drafts costs
    assert policy.threshold == pytest.approx(low_threshold * 32.0 / low_rate)  # the same marginal cost, priced
    prefill = _step(range(32), [1] * 32, uncached=[20] * 32)  # prompts make a step a one-off: no rate recorded
    policy.draft_limits(prefill)
    policy.select(prefill, _sure(32, 1), draft_seconds=0.5)
    policy.draft_limits(step)
    assert policy.rate == pytest.approx(32.0)


def test_a_request_whose_confident_drafts_keep_failing_stops_being_offered_drafts():
    costs = StepCostModel({2: {2: 1.0, 10: 1.8}}, {1: 0.01, 2: 0.01})  # a verified draft costs 0.1 s
    policy = _policy(costs)
    policy.begin_run()
    step, sure = _step([7, 8], [4, 4]), _sure(2)

    def observed(num_accepted, rounds, verified=sure):
        for _ in range(rounds):
            policy.draft_limits(step)
            policy.select(step, sure, draft_seconds=0.0)
            policy.observe(step, _outcome(verified, num_accepted))

    assert policy.select(step, sure, draft_seconds=0.0) == [4, 4]
    observed([0, 4], 10)  # the drafter is as sure of both, but request 7's first draft is always rejected
    assert policy.select(step, sure, draft_seconds=0.0) == [0, 4]
    observed([0, 4], 20, verified=Proposal([[], [3] * 4], [[], [0.95] * 4]))  # 7 gets none: its record fades
    assert policy.select(step, sure, draft_seconds=0.0) == [4, 4]
    observed([0, 4], 10)
    policy.begin_run()  # a new run starts every request from the prior
    assert policy.select(step, sure, draft_seconds=0.0) == [4, 4]


def test_steps_refine_the_costs_from_their_times_but_prefills_not_the_verify_curve():
    costs = StepCostModel({2: {2: 1.0, 10: 2.0}}, {1: 0.2, 2: 0.2, 8: 0.3})
    policy = _policy(costs)
    prefill = _step([0, 1], [0, 0], uncached=[10, 10])
    policy.observe(prefill, _outcome(Proposal([[], []], [[], []]), [0, 0], verify_seconds=10.0))
    assert costs.to_dict()["verify"] == {2: {2: 1.0, 10: 2.0}}
    # a decode step: one token per row plus 4 drafts, 3 s; and one further draft forward of 2 rows that took 0.5 s
    policy.observe(_step([0, 1], [2, 2]), _outcome(_sure(2, 2), [2, 2], verify_seconds=3.0,
                                                  forward_seconds=[(2, 0.5)]))
    assert costs.verify_cost(2, 6) > 1.5
    # 0.5 s against 0.2 predicted counts as 0.3 (1.5x at most); least squares with the table's 3 points as one
    # observation each: scale = (0.2 x 0.2 + 0.2 x 0.2 + 0.3 x 0.3 + 0.2 x 0.3) / (0.04 + 0.04 + 0.09 + 0.04)
    assert costs.draft_cost([2]) == pytest.approx(0.2 * 23 / 21)


def test_the_verified_depth_follows_the_live_batch_size_through_a_call():
    """No K is fixed for a call: as a batch drains, the same drafts are verified shallow where a verified token costs
    a large share of a row (a full batch) and deep where it costs little (its tail), and a later small call drafts
    whatever the size of the call before it."""
    # a step of n rows verifying t tokens costs n x 0.01 + 0.5 x (t - n) x 0.01 s: a draft half a row-token at any
    # size, plus a fixed 0.05 s a step, which a large batch spreads over many rows
    costs = StepCostModel({n: {n: 0.05 + 0.01 * n, 9 * n: 0.05 + 0.05 * n} for n in (1, 4, 64, 512)})
    policy = _policy(costs)
    drafts = Proposal([[3] * 4], [[0.95, 0.9, 0.6, 0.3]])
    depth = {}
    for num_reqs in (512, 64, 4, 1, 512, 4):
        step = _step(range(num_reqs), [4] * num_reqs)
        proposal = Proposal(drafts.token_ids * num_reqs, drafts.confidence * num_reqs)
        assert policy.draft_limits(step).num_drafts == [4] * num_reqs  # a model-free drafter drafts to the cap
        depth.setdefault(num_reqs, []).append(policy.select(step, proposal, draft_seconds=0.0)[0])
    assert depth[512][0] < depth[4][0] <= depth[1][0]
    assert depth[512] == [depth[512][0]] * 2 and depth[4] == [depth[4][0]] * 2  # the big call left nothing behind
    assert depth[512][0] >= 1  # a draft surviving with 0.95 pays in a full batch at half a row-token
