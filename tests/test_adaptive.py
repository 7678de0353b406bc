"""Adaptive verification end to end on tiny models: lossless, within k_max, trims by cost, learns, bad input."""

from types import SimpleNamespace

import numpy as np
import pytest

from rollout import RolloutGenerator, SamplingParams
from spec import AdaptiveVerifier, ConfidenceCalibrator, DraftRequest, Proposal, StepCostModel
from spec import cost_profile
from spec.proposers.draft_model import DraftModelProposer

PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9], [3, 4], [10, 11, 12, 13, 14, 10, 11, 12], [20, 21, 22], [30] * 6, [8, 2]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def linear_costs(extra_per_token: float, max_num_seqs: int = 64) -> dict:
    """Verification costs 1 s plus extra_per_token s for each row's every token beyond its first (9 per row)."""
    grid = [1, 2, 4, 8, 16, 32, 64][:max_num_seqs.bit_length()]
    return {"verify": {n: {n: 1.0, 9 * n: 1.0 + 8 * extra_per_token} for n in grid}, "draft": {1: 0.01, 64: 0.01}}


MODERATE = linear_costs(0.5)  # a draft pays for itself above survival ~0.5
FLAT = linear_costs(0.0)  # verification is free: every draft is worth it


class EchoDrafter:
    """Repeats the request's last tokens; confidence falls with the position."""

    def __init__(self, config):
        pass

    def propose(self, requests, max_num_tokens):
        tokens = [r.token_ids[-k:] if k else [] for r, k in zip(requests, max_num_tokens)]
        return Proposal(tokens, [[0.9 / (j + 1) for j in range(len(t))] for t in tokens])


class Unsure(EchoDrafter):
    """Gives no confidence."""

    def propose(self, requests, max_num_tokens):
        return Proposal(super().propose(requests, max_num_tokens).token_ids, None)


class UnsureWithFallback(Unsure):
    confidence_fallback = "acceptance_rate"


class NeverSure(Unsure):
    gives_confidence = False


class Sampling(EchoDrafter):
    """Returns draft distributions (probabilistic proposals)."""

    def propose(self, requests, max_num_tokens):
        import torch
        proposal = super().propose(requests, max_num_tokens)
        proposal.draft_probs = [torch.full((len(t), 48), 1 / 48) for t in proposal.token_ids]
        return proposal


def _config(method, **extra):
    return {"method": method, "num_speculative_tokens": 4, "enable_adaptive_verification": True,
            "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 64, 3]], **extra}


CONFIGS = {
    "ngram": lambda target, draft: (_config("ngram", prompt_lookup_min=1), None),
    "suffix": lambda target, draft: (_config("suffix"), None),
    "draft_model": lambda target, draft: (_config("draft_model"), draft),
    "custom_class": lambda target, draft: (_config("custom_class", model=f"{__name__}.EchoDrafter"), None),
}


def _generator(target, config, draft_model=None, step_costs=MODERATE, max_num_seqs=4, **kwargs):
    return RolloutGenerator(target, speculative_config=config, draft_model=draft_model, max_num_seqs=max_num_seqs,
                            max_model_len=64, step_costs=step_costs, **kwargs)


@pytest.fixture(scope="module")
def plain_greedy(target):
    return RolloutGenerator(target, max_num_seqs=4, max_model_len=64).generate(PROMPTS, 2, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_output_is_unchanged_by_adaptive_verification(name, target, draft, plain_greedy):
    config, draft_model = CONFIGS[name](target, draft)
    batch = _generator(target, config, draft_model).generate(PROMPTS, 2, GREEDY, use_tqdm=False)
    assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in plain_greedy.samples]
    for sample, plain in zip(batch.samples, plain_greedy.samples):
        assert sample.logprobs == pytest.approx(plain.logprobs, abs=1e-4)
    stats = batch.stats
    assert 0 < stats["num_draft_tokens"] < stats["num_proposed_draft_tokens"]  # it verified some drafts, not all
    assert stats["num_calibration_observations"] > 0 and "spec/calibration_error" in batch.metrics


def test_seeded_sampling_is_unchanged_by_adaptive_verification(target, draft):
    """Point proposals: however adaptive verification trims the drafts, each position's token is drawn from its own
    uniform, so a seeded run emits what plain sampling emits from the same seed (spec/rejection.py)."""
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=11)
    plain = RolloutGenerator(target, max_num_seqs=4, max_model_len=64).generate(PROMPTS, 2, params, use_tqdm=False)
    config, draft_model = CONFIGS["draft_model"](target, draft)
    batch = _generator(target, config, draft_model).generate(PROMPTS, 2, params, use_tqdm=False)
    assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in plain.samples]
    assert 0 < batch.stats["num_draft_tokens"] < batch.stats["num_proposed_draft_tokens"]  # trimmed, not all or none


def test_measured_costs_work_and_are_cached(target, draft, plain_greedy, step_cost_cache):
    config, draft_model = CONFIGS["draft_model"](target, draft)
    generator = _generator(target, config, draft_model, step_costs=None)
    batch = generator.generate(PROMPTS, 2, GREEDY, use_tqdm=False)
    assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in plain_greedy.samples]
    path = cost_profile.cache_path(generator._cost_key)
    assert path.parent == step_cost_cache and path.exists()
    again = _generator(target, config, draft_model, step_costs=None)  # loads the refined table
    assert again.adaptive.costs.to_dict() == generator.adaptive.costs.to_dict()


def test_allocation_never_exceeds_the_schedule_k(target, draft):
    config = _config("draft_model", num_speculative_tokens_per_batch_size=[[1, 64, 2]])
    batch = _generator(target, config, draft, step_costs=FLAT).generate(PROMPTS, 2, GREEDY, use_tqdm=False)
    ks = [k for s in batch.samples for k in s.acceptance["k_per_step"]]
    assert max(ks) == 2  # free verification admits every draft, and there are never more than the cap
    assert batch.stats["num_draft_tokens"] == batch.stats["num_proposed_draft_tokens"]
    assert sum(ks) == batch.stats["num_draft_tokens"]  # the per-request record has the K offered at each step


def test_costlier_verification_verifies_fewer_drafts(target, draft):
    config, draft_model = CONFIGS["custom_class"](target, draft)
    verified = []
    for extra in (0.0, 0.5, 5.0):
        stats = _generator(target, config, step_costs=linear_costs(extra)).generate(
            PROMPTS, 2, GREEDY, use_tqdm=False).stats
        verified.append(stats["verified_tokens_per_emitted_token"])
    assert verified[0] > verified[1] > verified[2]
    assert verified[2] == pytest.approx(1.0)  # nothing is worth 5 s per token: plain decoding


def test_draft_model_stops_extending_rows_that_are_not_worth_it(draft):
    seen = []

    def keep_drafting(req_ids, confidences):
        seen.append([len(c) for c in confidences])
        return [len(c) < 2 for c in confidences]

    proposer = DraftModelProposer(draft, max_num_seqs=2, max_model_len=64, keep_drafting=keep_drafting)
    requests = [DraftRequest(0, 0, [5, 6, 7], 3), DraftRequest(1, 1, [9], 1)]
    proposal = proposer.propose(requests, [4, 4])
    assert proposal.num_draft_tokens == [2, 2] and seen == [[0, 0], [1, 1], [2, 2]]  # asked before the first, too
    assert all(0 <= c <= 1 for conf in proposal.confidence for c in conf)


def test_a_row_refused_its_first_draft_drafts_nothing_and_catches_up_later(draft):
    refuse = {1}
    proposer = DraftModelProposer(draft, max_num_seqs=2, max_model_len=64,
                                  keep_drafting=lambda ids, conf: [i not in refuse for i in ids])
    requests = [DraftRequest(0, 0, [5, 6, 7], 3), DraftRequest(1, 1, [9, 4], 1)]
    assert proposer.propose(requests, [3, 3]).num_draft_tokens == [3, 0]
    assert proposer.runner.num_free_slots == 1  # the refused row was not synced: no cache slot, nothing fed
    requests[1].token_ids += [8, 3]  # decoded without drafts meanwhile
    refuse.clear()
    fresh = DraftModelProposer(draft, max_num_seqs=1, max_model_len=64)
    assert proposer.propose(requests, [3, 3]).token_ids[1] == fresh.propose([requests[1]], [3]).token_ids[0]


def test_a_drafter_without_confidence_needs_a_fallback(target):
    config = _config("custom_class", model=f"{__name__}.NeverSure")
    with pytest.raises(ValueError, match="gives no confidence.*confidence_fallback = 'acceptance_rate'"):
        _generator(target, config)
    with pytest.raises(ValueError, match="gives no confidence"):
        _generator(target, _config("custom_class", model=f"{__name__}.Unsure")).generate(PROMPTS, 1, GREEDY,
                                                                                          use_tqdm=False)
    generator = _generator(target, _config("custom_class", model=f"{__name__}.UnsureWithFallback"))
    batch = generator.generate(PROMPTS, 2, GREEDY, use_tqdm=False)
    assert batch.stats["num_calibration_observations"] > 0
    plain = _generator(target, {k: v for k, v in _config("custom_class", model=f"{__name__}.Unsure").items()
                                if k != "enable_adaptive_verification"})
    assert plain.generate(PROMPTS, 1, GREEDY, use_tqdm=False).stats["num_draft_tokens"] > 0  # fine without


def test_probabilistic_proposals_are_refused(target):
    with pytest.raises(ValueError, match="lossless only for point proposals"):
        _generator(target, _config("custom_class", model=f"{__name__}.Sampling")).generate(
            PROMPTS, 1, SamplingParams(temperature=1.0, max_tokens=4), use_tqdm=False)


@pytest.mark.parametrize("step_costs, message", [
    ({"verify": {1: {1: 1.0, 2: 0.5}}}, "cost falls from"),
    ({"verify": {1: {1: 0.0}}}, "is not positive"),
])
def test_bad_cost_tables_are_refused_before_any_loading(step_costs, message):
    with pytest.raises(ValueError, match=message):
        RolloutGenerator("/no/such/model", speculative_config=_config("ngram"), step_costs=step_costs)


def test_a_cost_table_can_be_a_json_file(target, tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(__import__("json").dumps(MODERATE))
    generator = _generator(target, _config("ngram", prompt_lookup_min=1), step_costs=str(path))
    assert generator.adaptive.costs.to_dict() == StepCostModel.from_dict(MODERATE).to_dict()


def test_survival_is_the_running_product_of_calibrated_confidences_computed_once_per_step():
    calibrator = ConfidenceCalibrator(max_positions=4, num_bins=10)
    adaptive = AdaptiveVerifier(calibrator, StepCostModel.from_dict(FLAT))
    adaptive.begin_step(3, 3, 4)
    survival = adaptive.survival([0, 1, 2], [[0.95, 0.55], [], [0.05]])
    assert survival[0] == pytest.approx([0.95, 0.95 * 0.55])
    assert len(survival[1]) == 0 and survival[2] == pytest.approx([0.05])
    # The step's later calls extend or cut what it calibrated; other drafts for the same request start over.
    assert adaptive.survival([0], [[0.95, 0.55, 0.75]])[0] == pytest.approx([0.95, 0.95 * 0.55, 0.95 * 0.55 * 0.75])
    assert adaptive.survival([0], [[0.95]])[0] == pytest.approx([0.95])
    assert adaptive.survival([0], [[0.15, 0.55]])[0] == pytest.approx([0.15, 0.15 * 0.55])
    # A refit of the calibration makes every calibrated value stale: 8 of 8 accepted in the 0.95 bin (prior 4 at 0.95).
    calibrator.observe(np.zeros(8, dtype=int), np.full(8, 0.95), np.ones(8, dtype=bool))
    assert adaptive.survival([0], [[0.95]])[0] == pytest.approx([(8 + 4 * 0.95) / (8 + 4)])


def test_drafting_extends_the_requests_whose_next_drafts_pay_for_a_forward():
    costs = StepCostModel({1: {1: 1.0, 10: 1.0}}, {1: 0.2, 8: 0.2})  # a draft forward: 0.2 s whatever its rows
    calibrator = ConfidenceCalibrator(max_positions=4, num_bins=10)
    adaptive = AdaptiveVerifier(calibrator, costs)
    assert adaptive.keep_drafting([0, 1], [[0.95], [0.05]]) == [True, True]  # before any allocation: up to k_max
    calibrator.observe(np.ones(10, dtype=np.int64), np.full(10, 0.95), np.array([True] * 9 + [False]))
    assert calibrator.acceptance_rate(1) == pytest.approx((9 + 2) / (10 + 4))  # observed, with the 1/2 prior
    adaptive.rate, adaptive.threshold = 1.0, 0.1  # 1 token/s; a verified token pays above survival 0.1
    # Next survival = survival x the next position's acceptance rate (11/14): 0.95 -> 0.746, 0.05 -> 0.039.
    # Extending the first alone nets 0.746 - 0.1 - 1.0 x 0.2 = 0.45 tokens; the second is below the threshold.
    assert adaptive.keep_drafting([0, 1], [[0.95], [0.05]]) == [True, False]
    # 0.3 x 11/14 = 0.236 each: one alone nets 0.136 - 0.2 < 0, both share the forward and net 0.07
    assert adaptive.keep_drafting([0, 1], [[0.3], [0.3]]) == [True, True]
    adaptive.rate = 2.0  # a forward now costs 0.4 tokens' worth: a lone 0.746 still pays, a pair of 0.236 not
    assert adaptive.keep_drafting([0], [[0.95]]) == [True]
    assert adaptive.keep_drafting([0, 1], [[0.3], [0.3]]) == [False, False]
    # Before the first draft: survival 1 x position 0's rate (1/2, the prior). At 2.5 tokens/s a forward is worth
    # 0.5 tokens: a lone row nets 0.5 - 0.1 - 0.5 < 0 and drafts nothing; two share the forward and draft.
    adaptive.rate = 2.5
    assert adaptive.keep_drafting([0], [[]]) == [False]
    assert adaptive.keep_drafting([0, 1], [[], []]) == [True, True]
    # An unsure draft does not make the next one look unsure: after 0.95 (calibrated 0.95) and 0.3 (0.35, its bin's
    # prior) the survival is 0.3325; position 2 accepted 20 of 20 (rate (20 + 4 x 11/14) / 24, its prior the rate
    # before it), so the next survival is 0.321 and extending nets 0.321 - 0.1 - 0.5 x 0.2 > 0. Taking the last
    # draft's 0.35 again (0.116) would stop.
    calibrator.observe(np.full(20, 2), np.full(20, 0.95), np.ones(20, dtype=bool))
    adaptive.rate = 0.5
    assert adaptive.keep_drafting([0], [[0.95, 0.3]]) == [True]
def test_a_draft_forward_that_widens_every_row_pays_for_the_width():
    """The runner pads attention to the widest row unless at most an eighth of the rows are wide: extending more
    rows than that by a draft costs every row a query (spec/step_cost.py)."""
    # 8 rows: each token per row 1 s, of which 0.01 s per token at a fixed width; a draft forward 0.01 s
    costs = StepCostModel({8: {8: 1.0, 16: 2.0, 24: 3.0}}, {1: 0.01, 8: 0.01}, {8: 0.01})
    adaptive = AdaptiveVerifier(ConfidenceCalibrator(max_positions=4, num_bins=10), costs)
    adaptive.begin_step(8, 8, 4)
    adaptive.rate, adaptive.threshold = 8.0, 0.1
    # Each first draft: survival 0.5 (the prior rate), 0.4 over the threshold. Widening all 8 rows costs
    # 8 tokens/s x (1 - 8 x 0.01) s = 7.4 tokens, more than 8 x 0.4; one row alone is split off and pays its forward.
    assert sum(adaptive.keep_drafting(list(range(8)), [[]] * 8)) == 1
    assert adaptive.keep_drafting([0], [[0.95]]) == [True]  # still split: no width to pay for
    adaptive.begin_step(8, 80, 4)  # prompts set this step's width: drafting adds none
    adaptive.rate, adaptive.threshold = 8.0, 0.1
    assert adaptive.keep_drafting(list(range(8)), [[]] * 8) == [True] * 8


def test_draft_extensions_are_timed_from_one_keep_drafting_call_to_the_next(monkeypatch):
    clock = iter([9.0, 10.0, 10.5, 11.0])
    monkeypatch.setattr("spec.adaptive.time", SimpleNamespace(perf_counter=lambda: next(clock)))
    costs = StepCostModel({2: {2: 1.0, 10: 2.0}}, {1: 0.2, 2: 0.2, 8: 0.3})
    adaptive = AdaptiveVerifier(ConfidenceCalibrator(max_positions=4, num_bins=10), costs)
    # at 9.0, before the first draft: that forward also feeds the tokens verified last step, so it is not timed
    assert adaptive.keep_drafting([0, 1], [[], []]) == [True, True]
    assert adaptive.keep_drafting([0, 1], [[0.9], [0.9]]) == [True, True]  # at 10.0: both rows extended
    assert adaptive.keep_drafting([0, 1], [[0.9, 0.9], [0.9]]) == [True, True]  # at 10.5: that extension took 0.5 s
    budget = adaptive.allocate([0, 1], [[0.9, 0.9, 0.9], [0.9, 0.9]], uncached=[1, 1], draft_seconds=0.75)
    # the step is charged the drafting time it took, not a modelled one
    widths = [1 + n for n in budget.lengths]
    assert budget.seconds == pytest.approx(0.75 + costs.verify_shape(2).cost(sum(widths), max(widths), 2))
    adaptive.observe_times([1, 1], budget.lengths, budget.seconds - 0.75)
    # One extension of 2 rows in 0.5 s, against 0.2 predicted (bounded to 1.5x that: 0.3); the drafting after the
    # third call (ended by the step's verification) is not an extension. With the table's 3 points as one
    # observation each, the least-squares cost = scale x table through (0.2, 0.2), (0.2, 0.2), (0.3, 0.3),
    # (0.2, 0.3) has scale 0.23 / 0.21 (sum of table x cost over sum of table^2).
    assert costs.draft_cost([2]) == pytest.approx(0.2 * 23 / 21)
    adaptive.keep_drafting([0], [[0.9]])  # at 11.0: a new step, nothing extended yet
    adaptive.observe_times([1], [0], 1.0)
    assert costs.draft_cost([2]) == pytest.approx(0.2 * 23 / 21)


def test_steps_that_prefill_prompts_do_not_refine_the_verify_costs():
    costs = StepCostModel({2: {2: 1.0, 10: 2.0}})
    adaptive = AdaptiveVerifier(ConfidenceCalibrator(max_positions=4, num_bins=10), costs)
    adaptive.observe_times([10, 10], [0, 0], 10.0)  # two rows prefill 20 prompt tokens
    assert costs.to_dict()["verify"] == {2: {2: 1.0, 10: 2.0}}
    adaptive.observe_times([1, 1], [2, 2], 3.0)  # a decode step: one uncached token per row, then 4 drafts
    assert costs.verify_cost(2, 6) > 1.5


def test_drafting_decisions_use_the_rate_last_seen_at_a_similar_batch_size():
    costs = StepCostModel({n: {n: 1.0, 9 * n: 1.0 + 0.1 * n} for n in (1, 2, 4, 8, 16, 32)}, {1: 0.1, 32: 0.2})
    adaptive = AdaptiveVerifier(ConfidenceCalibrator(max_positions=4, num_bins=10), costs)
    adaptive.begin_step(32, 32, 4)
    big = adaptive.allocate(list(range(32)), [[0.9, 0.9]] * 32, uncached=[1] * 32, draft_seconds=0.5)
    adaptive.begin_step(1, 1, 4)
    small = adaptive.allocate([0], [[0.9, 0.9]], uncached=[1], draft_seconds=0.2)
    assert small.rate < big.rate / 4  # a lone request: far fewer tokens for a step of similar cost
    adaptive.begin_step(40, 40, 4)  # a batch of 32-63 again: back to the rate and threshold seen at 32
    assert (adaptive.rate, adaptive.threshold) == (big.rate, big.threshold)
    adaptive.begin_step(200, 2000, 4)  # no allocation at this size yet (a first step, prefilling): the nearest size's
    assert (adaptive.rate, adaptive.threshold) == (big.rate, big.threshold)


def test_drafting_never_prices_time_below_the_rate_of_a_step_without_drafts():
    costs = StepCostModel({n: {n: 1.0, 9 * n: 1.0 + 0.1 * n} for n in (1, 2, 4, 8, 16, 32)}, {1: 0.1, 32: 0.2})
    adaptive = AdaptiveVerifier(ConfidenceCalibrator(max_positions=4, num_bins=10), costs)
    adaptive.begin_step(32, 32, 4)
    # unsure drafts after a long drafting time: this allocation's rate is below the 32 tokens/s of plain decoding
    low = adaptive.allocate(list(range(32)), [[0.3]] * 32, uncached=[1] * 32, draft_seconds=2.0)
    assert low.rate < 32.0
    adaptive.begin_step(32, 32, 4)
    assert adaptive.rate == pytest.approx(32.0)  # 32 rows in the 1 s a step without drafts costs
    assert adaptive.threshold == pytest.approx(low.threshold * 32.0 / low.rate)  # the same marginal cost, priced
    assert adaptive.keep_drafting(list(range(32)), [[]] * 32) == [False] * 32  # at that rate no draft pays
    # A step that prefills prompts records no rate: its prompts make it a one-off, not the rollout's pace.
    adaptive.begin_step(32, 32 * 20, 4)
    adaptive.allocate(list(range(32)), [[0.9]] * 32, uncached=[20] * 32, draft_seconds=0.5)
    adaptive.begin_step(32, 32, 4)
    assert adaptive.rate == pytest.approx(32.0)


def test_a_request_whose_confident_drafts_keep_failing_stops_being_offered_drafts():
    costs = StepCostModel({2: {2: 1.0, 10: 1.8}}, {1: 0.01, 2: 0.01})  # a verified draft costs 0.1 s
    adaptive = AdaptiveVerifier(ConfidenceCalibrator(max_positions=4, num_bins=10), costs)
    sure = [[0.95, 0.95, 0.95, 0.95]] * 2
    assert adaptive.allocate([7, 8], sure, uncached=[1, 1], draft_seconds=0.0).lengths == [4, 4]
    for _ in range(10):  # the drafter is as sure of both, but request 7's first draft is always rejected
        adaptive.observe([7, 8], sure, [0, 4])
    assert adaptive.allocate([7, 8], sure, uncached=[1, 1], draft_seconds=0.0).lengths == [0, 4]
    for _ in range(20):  # steps in which request 7 got no drafts: its record fades and it is tried again
        adaptive.observe([7, 8], [[], sure[1]], [0, 4])
    assert adaptive.allocate([7, 8], sure, uncached=[1, 1], draft_seconds=0.0).lengths == [4, 4]
    for _ in range(10):
        adaptive.observe([7, 8], sure, [0, 4])
    adaptive.finish(7)  # a new request reusing the id starts from the prior again
    assert adaptive.allocate([7, 8], sure, uncached=[1, 1], draft_seconds=0.0).lengths == [4, 4]


def test_finished_requests_leave_no_adaptive_record(target, draft):
    config, draft_model = CONFIGS["draft_model"](target, draft)
    generator = _generator(target, config, draft_model=draft_model)
    generator.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_tokens=12, seed=0))
    assert generator.adaptive._requests == {}  # every request's acceptance factor went with it
