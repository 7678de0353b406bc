"""Adaptive verification's allocation (spec/budget.py) against a brute-force search over every allocation."""

import itertools

import numpy as np
import pytest

from spec.budget import choose_budget


def _random_case(rng: np.random.Generator):
    num_reqs = int(rng.integers(1, 5))
    survival = [np.cumprod(rng.uniform(0.0, 1.0, size=int(rng.integers(0, 5)))) for _ in range(num_reqs)]
    if rng.uniform() < 0.3:  # exact ties across and within requests
        survival = [np.round(s, 1) for s in survival]
    increments = rng.uniform(0.0, 1.0, size=64) * rng.choice([0.01, 0.2, 2.0])  # flat to steep
    table = 1.0 + np.concatenate([[0.0], np.cumsum(increments)])  # non-decreasing seconds by token count
    fixed_tokens = int(rng.integers(1, 8))
    return survival, fixed_tokens, float(rng.choice([0.0, 0.3])), _costs(lambda tokens: float(table[tokens]))


def _costs(cost_of):
    """verify_costs(first, count) for choose_budget, from the seconds of one token count."""
    return lambda first, count: [cost_of(tokens) for tokens in range(first, first + count)]


def _rate(survival, lengths, fixed_tokens, draft_cost, verify_costs) -> float:
    tokens = len(survival) + sum(float(s[:n].sum()) for s, n in zip(survival, lengths))
    return tokens / (draft_cost + verify_costs(fixed_tokens + sum(lengths), 1)[0])


@pytest.mark.parametrize("seed", range(200))
def test_allocation_is_the_brute_force_optimum(seed):
    survival, fixed_tokens, draft_cost, verify_costs = _random_case(np.random.default_rng(seed))
    budget = choose_budget(survival, fixed_tokens, draft_cost, verify_costs)
    best = max(_rate(survival, lengths, fixed_tokens, draft_cost, verify_costs)
               for lengths in itertools.product(*(range(len(s) + 1) for s in survival)))
    achieved = _rate(survival, budget.lengths, fixed_tokens, draft_cost, verify_costs)
    assert achieved == pytest.approx(best, rel=1e-12)
    assert budget.expected_tokens / budget.seconds == pytest.approx(achieved, rel=1e-12)
    assert all(0 <= n <= len(s) for n, s in zip(budget.lengths, survival))  # never above the drafts offered


@pytest.mark.parametrize("seed", range(50))
def test_admitted_slots_are_a_prefix_of_the_best_survivals(seed):
    survival, fixed_tokens, draft_cost, verify_costs = _random_case(np.random.default_rng(1000 + seed))
    lengths = choose_budget(survival, fixed_tokens, draft_cost, verify_costs).lengths
    admitted = [v for s, n in zip(survival, lengths) for v in s[:n]]
    left_out = [v for s, n in zip(survival, lengths) for v in s[n:]]
    assert not admitted or not left_out or min(admitted) >= max(left_out)


def test_free_verification_admits_every_draft_and_steep_verification_none():
    survival = [np.array([0.9, 0.5, 0.1]), np.array([0.2])]
    free = choose_budget(survival, 2, 0.0, _costs(lambda tokens: 1.0))
    assert free.lengths == [3, 1] and free.threshold == 0.0
    steep = choose_budget(survival, 2, 0.0, _costs(float))
    assert steep.lengths == [0, 0]  # a token costs a full row's time; no draft is accepted surely enough
    assert steep.threshold == pytest.approx(1.0)  # rate 1 token/s x 1 s per extra token


def test_threshold_separates_what_a_further_draft_needs():
    """With linear costs the marginal condition is exact: a draft is worth its slot iff S > rate x slope."""
    survival = [np.array([0.95, 0.9, 0.6, 0.3]), np.array([0.8, 0.4])]
    budget = choose_budget(survival, 2, 0.0, _costs(lambda tokens: 2.0 + 0.25 * tokens))
    admitted = [v for s, n in zip(survival, budget.lengths) for v in s[:n]]
    left_out = [v for s, n in zip(survival, budget.lengths) for v in s[n:]]
    assert min(admitted) >= budget.threshold > max(left_out)
