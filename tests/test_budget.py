"""Adaptive verification's allocation (spec/adaptive/budget.py) against a brute-force search over every allocation."""

import itertools

import numpy as np
import pytest

from spec.adaptive.budget import choose_budget, every_draft_pays


def _random_case(rng: np.random.Generator):
    num_reqs = int(rng.integers(1, 5))
    survival = [np.cumprod(rng.uniform(0.0, 1.0, size=int(rng.integers(0, 5)))) for _ in range(num_reqs)]
    if rng.uniform() < 0.3:  # exact ties across and within requests
        survival = [np.round(s, 1) for s in survival]
    increments = rng.uniform(0.0, 1.0, size=64) * rng.choice([0.01, 0.2, 2.0])  # flat to steep
    table = 1.0 + np.concatenate([[0.0], np.cumsum(increments)])  # non-decreasing seconds by token count
    uncached = rng.integers(1, 3, size=num_reqs).tolist()
    return survival, uncached, float(rng.choice([0.0, 0.3])), _by_tokens(lambda tokens: float(table[tokens]))


def _by_tokens(cost_of):
    """A verify cost that follows the tokens alone (whatever the widths)."""
    return lambda num_tokens, width, num_wide: cost_of(num_tokens)


def _rate(survival, lengths, uncached, draft_cost, verify_cost) -> float:
    tokens = len(survival) + sum(float(s[:n].sum()) for s, n in zip(survival, lengths))
    widths = [u + n for u, n in zip(uncached, lengths)]
    return tokens / (draft_cost + verify_cost(sum(widths), max(widths), sum(w > 1 for w in widths)))


@pytest.mark.parametrize("seed", range(200))
def test_allocation_is_the_brute_force_optimum(seed):
    survival, uncached, draft_cost, verify_cost = _random_case(np.random.default_rng(seed))
    budget = choose_budget(survival, uncached, draft_cost, verify_cost)
    best = max(_rate(survival, lengths, uncached, draft_cost, verify_cost)
               for lengths in itertools.product(*(range(len(s) + 1) for s in survival)))
    achieved = _rate(survival, budget.lengths, uncached, draft_cost, verify_cost)
    assert achieved == pytest.approx(best, rel=1e-12)
    assert budget.expected_tokens / budget.seconds == pytest.approx(achieved, rel=1e-12)
    assert all(0 <= n <= len(s) for n, s in zip(budget.lengths, survival))  # never above the drafts offered


@pytest.mark.parametrize("seed", range(50))
def test_admitted_slots_are_a_prefix_of_the_best_survivals(seed):
    survival, uncached, draft_cost, verify_cost = _random_case(np.random.default_rng(1000 + seed))
    lengths = choose_budget(survival, uncached, draft_cost, verify_cost).lengths
    admitted = [v for s, n in zip(survival, lengths) for v in s[:n]]
    left_out = [v for s, n in zip(survival, lengths) for v in s[n:]]
    assert not admitted or not left_out or min(admitted) >= max(left_out)


def test_free_verification_admits_every_draft_and_steep_verification_none():
    survival = [np.array([0.9, 0.5, 0.1]), np.array([0.2])]
    free = choose_budget(survival, [1, 1], 0.0, _by_tokens(lambda tokens: 1.0))
    assert free.lengths == [3, 1] and free.threshold == 0.0
    steep = choose_budget(survival, [1, 1], 0.0, _by_tokens(float))
    assert steep.lengths == [0, 0]  # a token costs a full row's time; no draft is accepted surely enough
    assert steep.threshold == pytest.approx(1.0)  # rate 1 token/s x 1 s per extra token


def test_threshold_separates_what_a_further_draft_needs():
    """With linear costs the marginal condition is exact: a draft is worth its slot iff S > rate x slope."""
    survival = [np.array([0.95, 0.9, 0.6, 0.3]), np.array([0.8, 0.4])]
    budget = choose_budget(survival, [1, 1], 0.0, _by_tokens(lambda tokens: 2.0 + 0.25 * tokens))
    admitted = [v for s, n in zip(survival, budget.lengths) for v in s[:n]]
    left_out = [v for s, n in zip(survival, budget.lengths) for v in s[n:]]
    assert min(admitted) >= budget.threshold > max(left_out)


def _padded(rng: np.random.Generator, num_reqs: int):
    """A verify cost with the ragged runner's shape (spec/adaptive/step_cost.py): the widest row's width in every row, less a
    per-token cost for the tokens short of it."""
    per_width = 1.0 + np.cumsum(rng.uniform(0.1, 1.0, size=16))
    per_token = float(rng.uniform(0.0, 0.1)) / num_reqs
    return lambda num_tokens, width, num_wide: float(per_width[width] - per_token * (num_reqs * width - num_tokens))


@pytest.mark.parametrize("seed", range(100))
def test_with_the_widths_cost_the_allocation_is_the_best_of_the_top_b(seed):
    rng = np.random.default_rng(2000 + seed)
    survival, uncached, draft_cost, _ = _random_case(rng)
    verify_cost = _padded(rng, len(survival))
    budget = choose_budget(survival, uncached, draft_cost, verify_cost)
    slots = sorted((-v, position, owner) for owner, values in enumerate(survival) for position, v in enumerate(values))
    rates = []
    for b in range(len(slots) + 1):
        lengths = [sum(1 for _, _, owner in slots[:b] if owner == r) for r in range(len(survival))]
        rates.append(_rate(survival, lengths, uncached, draft_cost, verify_cost))
    assert _rate(survival, budget.lengths, uncached, draft_cost, verify_cost) == pytest.approx(max(rates), rel=1e-12)
    assert budget.expected_tokens / budget.seconds == pytest.approx(max(rates), rel=1e-12)


def test_each_candidate_is_priced_at_its_widest_row_and_wide_rows():
    seen = []
    survival = [np.array([0.9, 0.8]), np.array([0.7])]
    choose_budget(survival, [1, 1], 0.0, lambda tokens, width, wide: seen.append((tokens, width, wide)) or 1.0)
    # b = 0 .. 3 (0.9, 0.8 of the first row, then 0.7 of the second), then the threshold's two reads
    assert seen[:4] == [(2, 1, 0), (3, 2, 1), (4, 3, 1), (5, 3, 2)]


def test_every_draft_pays_iff_the_linear_allocation_admits_them_all():
    rng = np.random.default_rng(3)
    outcomes = set()
    for _ in range(500):
        num_rows = int(rng.integers(1, 9))
        survival = [np.cumprod(rng.uniform(0.3, 1.0, int(rng.integers(0, 5)))).tolist() for _ in range(num_rows)]
        fixed, per_draft = float(rng.uniform(0.01, 1.0)), float(rng.uniform(0.0, 0.3))
        budget = choose_budget(survival, [1] * num_rows, 0.0,
                               lambda tokens, width, num_wide: fixed + per_draft * (tokens - num_rows))
        admits_all = budget.lengths == [len(values) for values in survival]
        assert every_draft_pays(survival, fixed, per_draft) == admits_all
        outcomes.add(admits_all)
    assert outcomes == {True, False}  # both sides of the rule were exercised
