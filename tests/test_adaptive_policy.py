"""AdaptivePolicy (spec/adaptive/policy.py) on its own, driven through fake engines whose step costs and acceptance are
set: the prefixes it verifies against a brute force, the draft depths it plans, what it learns from each step, and
how it follows a batch's drain. Seeded; no wall time."""

import itertools
import random

import numpy as np
import pytest

from spec import Proposal, StepInfo, StepOutcome
from spec.adaptive import AdaptivePolicy


def _padded_to_widest(rows, tokens, width, num_wide):
    return rows * width - tokens


class FakeEngine:
    """Steps of num_rows rows costing a + c R + b D + w P seconds (D drafts verified, P query slots padded to the
    widest row), each row offered k drafts whose confidences are drawn per step and which are accepted with exactly
    that probability (a calibrated drafter)."""

    def __init__(self, policy: AdaptivePolicy, costs: tuple, num_rows: int, k: int, seed: int, low: float = 0.3):
        self.policy, self.costs, self.num_rows, self.k = policy, costs, num_rows, k
        self.rng, self.low, self.step_id = random.Random(seed), low, 0

    def seconds(self, lengths: list[int]) -> float:
        a, c, b, w = self.costs
        widths = [1 + n for n in lengths]
        return a + c * len(widths) + b * sum(lengths) + w * _padded_to_widest(len(widths), sum(widths), max(widths), 0)

    def confidences(self) -> list[list[float]]:
        return [[self.rng.uniform(self.low, 1.0) for _ in range(self.k)] for _ in range(self.num_rows)]

    def run(self, num_steps: int) -> None:
        for _ in range(num_steps):
            self.step(self.confidences())

    def step(self, confidences: list[list[float]]) -> list[int]:
        """One step (rows with new ids every 50 steps); the verified lengths."""
        info = StepInfo([self.step_id // 50 * self.num_rows + r for r in range(self.num_rows)], [1] * self.num_rows,
                        [self.k] * self.num_rows, self.k)
        self.step_id += 1
        plan = self.policy.draft_limits(info)
        drafted = [conf[:n] for conf, n in zip(confidences, plan.num_drafts)]
        proposal = Proposal([[3] * len(conf) for conf in drafted], drafted)
        lengths = self.policy.select(info, proposal, 0.0)
        verified = proposal.prefix(lengths)
        accepted = [next((j for j, p in enumerate(conf) if self.rng.random() >= p), len(conf))
                    for conf in verified.confidence]
        seconds = self.seconds(lengths)
        self.policy.observe(info, StepOutcome(verified, accepted, proposal.num_draft_tokens, seconds, 0.0, seconds,
                                              0.0))
        return lengths

    def rate(self, confidences: list[list[float]], lengths) -> float:
        """True expected tokens per second of verifying these prefixes."""
        survival = sum(float(np.prod(conf[:j + 1])) for conf, n in zip(confidences, lengths) for j in range(n))
        return (self.num_rows + survival) / self.seconds(list(lengths))


def test_on_a_fake_engine_the_policy_verifies_the_rate_maximising_prefixes():
    """After 1000 steps of learning (calibration and the cost fit, from the outcomes and times alone: the fit then
    reads the engine's costs to 4 digits), the verified prefixes of 40 new steps are the best allocation of all 3125
    (5 rows x 4 drafts, brute force at the true survival and costs) on the median step, within 0.5% of its rate on
    average and 3% on every step: what is left is the calibration's, learned from random outcomes in bins 0.05 wide.
    Ignoring the padding (the allocation before this one: the best of the allocations that admit the b best drafts)
    fell to 0.93 of the best here."""
    policy = AdaptivePolicy(4, padding=_padded_to_widest)
    engine = FakeEngine(policy, (0.02, 0.004, 0.002, 0.0008), num_rows=5, k=4, seed=0)
    engine.run(1000)
    shares = []
    for _ in range(40):
        confidences = engine.confidences()
        best = max(engine.rate(confidences, lengths) for lengths in itertools.product(range(5), repeat=5))
        shares.append(engine.rate(confidences, engine.step(confidences)) / best)
    assert float(np.median(shares)) == pytest.approx(1.0) and np.mean(shares) >= 0.995 and min(shares) >= 0.97


def test_until_a_batch_size_is_fitted_the_verified_depth_steps_down_from_k():
    """A drafter that always fills K would verify the same drafts per row every step, and b could not be told from c."""
    policy = AdaptivePolicy(4)
    engine = FakeEngine(policy, (0.02, 0.004, 0.002, 0.0), num_rows=3, k=4, seed=1)
    lengths = [engine.step(engine.confidences()) for _ in range(9)]
    assert [n[0] for n in lengths[:8]] == [4, 3, 2, 1, 4, 3, 2, 1]  # 8 steps fit a size
    assert policy.costs.price(3) is not None


def test_drafts_that_rarely_survive_are_not_verified_but_for_a_first_draft_every_32_steps():
    """At a draft's cost of half a row and survivals of 0.02-0.1 no draft pays (each needs about 0.3): after the fit,
    only the exploration steps verify, every row's first draft, at most one step in 33."""
    policy = AdaptivePolicy(4)
    engine = FakeEngine(policy, (0.01, 0.004, 0.002, 0.0), num_rows=8, k=4, seed=2, low=0.02)
    engine.confidences = lambda: [[engine.rng.uniform(0.02, 0.1)] * 4 for _ in range(8)]
    lengths = [engine.step(engine.confidences()) for _ in range(200)][50:]
    drafted = [n for n in lengths if any(n)]
    assert len(drafted) <= len(lengths) / 32 and all(n == [1] * 8 for n in drafted)


def test_a_request_whose_confident_drafts_keep_failing_stops_being_offered_drafts():
    policy = AdaptivePolicy(4)
    _fit(policy, rows=2, base=1.0, per_draft=0.1)  # a verified draft costs 0.1 s of a 1 s step
    step, sure = StepInfo([7, 8], [1, 1], [4, 4], 4), Proposal([[3] * 4] * 2, [[0.95] * 4] * 2)

    def observed(num_accepted, rounds, verified=sure):
        for _ in range(rounds):
            policy.draft_limits(step)
            policy.select(step, sure, 0.0)
            policy.observe(step, StepOutcome(verified, num_accepted, sure.num_draft_tokens, None, 0.0, None, 0.0))

    policy.draft_limits(step)
    assert policy.select(step, sure, 0.0) == [4, 4]
    observed([0, 4], 12)  # the drafter is as sure of both, but request 7's first draft is always rejected
    policy.draft_limits(step)
    assert policy.select(step, sure, 0.0) == [0, 4]
    observed([0, 4], 20, verified=Proposal([[], [3] * 4], [[], [0.95] * 4]))  # 7 gets none: its record fades
    policy.draft_limits(step)
    assert policy.select(step, sure, 0.0) == [4, 4]
    observed([0, 4], 10)
    policy.begin_run()  # a new run starts every request from the prior
    policy.draft_limits(step)
    assert policy.select(step, sure, 0.0) == [4, 4]


def test_the_verified_depth_follows_the_live_batch_size_through_a_call():
    """As a batch drains the same drafts are verified shallow where a draft costs a large share of a step (a full
    batch) and deep where it costs little (the tail), and a small call after a big one is priced at its own size."""
    policy = AdaptivePolicy(4)
    for rows in (512, 64, 4, 1):  # a draft costs half a row-token at any size; a step 0.05 s besides
        _fit(policy, rows, base=0.05 + 0.01 * rows, per_draft=0.005)
    confidences = [0.95, 0.9, 0.6, 0.3]
    depth = {}
    for rows in (512, 64, 4, 1, 512, 4):
        step = StepInfo(list(range(rows)), [1] * rows, [4] * rows, 4)
        assert policy.draft_limits(step).num_drafts == [4] * rows  # a model-free drafter drafts to the cap
        proposal = Proposal([[3] * 4] * rows, [confidences] * rows)
        depth.setdefault(rows, []).append(policy.select(step, proposal, 0.0)[0])
    assert depth[512][0] < depth[4][0] <= depth[1][0]
    assert depth[512] == [depth[512][0]] * 2 and depth[4] == [depth[4][0]] * 2  # the big call left nothing behind
    assert depth[512][0] >= 1  # a draft surviving with 0.95 pays in a full batch at half a row-token


def test_draft_forwards_are_planned_where_they_pay_and_pad_the_other_rows():
    """A drafter with forwards of its own (the draft model): before drafting, depth by depth, the rows whose next
    draft beats the threshold by more than the forward's price are extended; where the runner pads every row to the
    widest, extending a few rows pads the others by a query each, and that is priced too. First drafts survive with
    1/2 (the calibrator's prior rate), 0.4 over the threshold of 0.1 each; 8 tokens a second."""
    for padding in (None, _padded_to_widest):
        policy = AdaptivePolicy(4, padding=padding)
        _fit(policy, rows=8, base=1.0, per_draft=0.05, per_padded=0.05)
        policy.costs.observe_forwards([(m, 0.01) for m in (1, 8)] * 4)  # a forward: 0.01 s, 0.08 tokens' worth
        policy.rate, policy.threshold = 8.0, 0.1
        assert min(policy.draft_limits(StepInfo(list(range(8)), [1] * 8, [2] * 8, 2)).num_drafts) >= 1
        few = StepInfo(list(range(8)), [1] * 8, [2, 2] + [0] * 6, 2)  # 2 rows may draft: padding 6 costs 2.4 tokens
        assert (policy.draft_limits(few).num_drafts[:2] == [0, 0]) == (padding is not None)
        prefill = StepInfo(list(range(8)), [10] * 8, [2, 2] + [0] * 6, 2)  # prompts set the width: no padding
        assert min(policy.draft_limits(prefill).num_drafts[:2]) >= 1
    policy.rate, policy.threshold = 8.0, 0.45  # 8 first drafts gain 0.4 tokens over the threshold in all
    assert min(policy.draft_limits(StepInfo(list(range(8)), [1] * 8, [2] * 8, 2)).num_drafts) >= 1
    policy.costs.observe_forwards([(m, 0.1) for m in (1, 8)] * 100)  # a forward now costs 0.8 tokens' worth
    assert policy.draft_limits(StepInfo(list(range(8)), [1] * 8, [2] * 8, 2)).num_drafts == [0] * 8


def test_unknown_times_and_prefills_teach_the_calibrator_but_not_the_fit():
    policy = AdaptivePolicy(4)
    step, prefill = StepInfo([0, 1], [1, 1], [4, 4], 4), StepInfo([0, 1], [5, 5], [4, 4], 4)
    verified = Proposal([[3, 3], [3]], [[0.9, 0.9], [0.9]])
    for info, seconds in ((step, None), (prefill, 1.0)):
        policy.observe(info, StepOutcome(verified, [2, 0], [2, 1], seconds, 0.0, seconds, 0.0))
    assert policy.stats()["num_calibration_observations"] == 2 * 3 and policy.costs._sizes == {}


def _fit(policy: AdaptivePolicy, rows: int, base: float, per_draft: float, per_padded: float = 0.0) -> None:
    """Teach the policy's fit at `rows` rows: 20 steps at these exact costs, verifying at most L = 0 .. 4 drafts a
    row and fewer in some rows (so that drafts and padded slots vary apart)."""
    for n in range(20):
        widths = [1 + min(n % 5, (n // 5 + r) % 5) for r in range(rows)]
        padded = 0 if policy.costs.padding is None else rows * max(widths) - sum(widths)
        policy.costs.observe_step(widths, base + per_draft * (sum(widths) - rows) + per_padded * padded)
