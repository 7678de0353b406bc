"""Adaptive verification's allocation (spec/adaptive/budget.py) against a brute-force search over every allocation."""

import itertools

import numpy as np
import pytest

from spec.adaptive.budget import _every_draft, _search, choose_budget


def _slots(survival: list[np.ndarray]) -> list[list[float]]:
    return [np.asarray(s, float).tolist() for s in survival]


def _random_case(rng: np.random.Generator):
    num_reqs = int(rng.integers(1, 5))
    survival = [np.cumprod(rng.uniform(0.0, 1.0, size=int(rng.integers(0, 5)))) for _ in range(num_reqs)]
    if rng.uniform() < 0.3:  # exact ties across and within requests
        survival = [np.round(s, 1) for s in survival]
    per_draft = float(rng.uniform(0.0, 1.0) * rng.choice([0.01, 0.2, 2.0]))  # flat to steep
    per_padded = float(rng.uniform(0.0, per_draft)) if rng.uniform() < 0.7 else 0.0
    return survival, float(rng.uniform(0.1, 2.0)), per_draft, per_padded


def _rate(survival, lengths, fixed, per_draft, per_padded) -> float:
    drafts = sum(lengths)
    padded = len(lengths) * max(lengths, default=0) - drafts
    return (len(survival) + sum(float(s[:n].sum()) for s, n in zip(survival, lengths))) / (
        fixed + per_draft * drafts + per_padded * padded)


@pytest.mark.parametrize("seed", range(300))
def test_allocation_is_the_brute_force_optimum(seed):
    survival, fixed, per_draft, per_padded = _random_case(np.random.default_rng(seed))
    budget = choose_budget(_slots(survival), fixed, per_draft, per_padded)
    best = max(_rate(survival, lengths, fixed, per_draft, per_padded)
               for lengths in itertools.product(*(range(len(s) + 1) for s in survival)))
    achieved = _rate(survival, budget.lengths, fixed, per_draft, per_padded)
    assert achieved == pytest.approx(best, rel=1e-12)
    assert budget.rate == pytest.approx(achieved, rel=1e-12)
    assert all(0 <= n <= len(s) for n, s in zip(budget.lengths, survival))  # never above the drafts offered


@pytest.mark.parametrize("seed", range(50))
def test_without_padding_the_admitted_slots_are_the_best_survivals(seed):
    survival, fixed, per_draft, _ = _random_case(np.random.default_rng(1000 + seed))
    lengths = choose_budget(_slots(survival), fixed, per_draft).lengths
    admitted = [v for s, n in zip(survival, lengths) for v in s[:n]]
    left_out = [v for s, n in zip(survival, lengths) for v in s[n:]]
    assert not admitted or not left_out or min(admitted) >= max(left_out)


def test_free_verification_admits_every_draft_and_steep_verification_none():
    survival = [np.array([0.9, 0.5, 0.1]), np.array([0.2])]
    free = choose_budget(_slots(survival), 1.0, 0.0)
    assert free.lengths == [3, 1] and free.threshold == 0.0
    steep = choose_budget(_slots(survival), 1.0, 1.0)  # a draft costs what a step does
    assert steep.lengths == [0, 0] and steep.threshold == pytest.approx(2.0)  # rate 2 tokens/s x 1 s per draft


def test_threshold_separates_what_a_further_draft_needs():
    """With the cost linear in the drafts the marginal condition is exact: a draft is admitted iff S > rate x cost."""
    survival = [np.array([0.95, 0.9, 0.6, 0.3]), np.array([0.8, 0.4])]
    budget = choose_budget(_slots(survival), 2.5, 0.25)
    admitted = [v for s, n in zip(survival, budget.lengths) for v in s[:n]]
    left_out = [v for s, n in zip(survival, budget.lengths) for v in s[n:]]
    assert min(admitted) >= budget.threshold > max(left_out)


def test_padding_keeps_the_rows_level():
    """Padded to the widest row, one deep row costs every other row its queries: at a padded slot's cost near a
    draft's, the allocation verifies level rows, where without padding it verifies the sure row deeper."""
    survival = [np.cumprod([0.99] * 4), np.array([0.7, 0.35]), np.array([0.7, 0.35])]
    assert choose_budget(_slots(survival), 1.0, 0.1).lengths == [4, 1, 1]
    assert choose_budget(_slots(survival), 1.0, 0.1, per_padded=0.095).lengths == [2, 2, 2]


def test_the_every_draft_shortcut_answers_only_where_the_search_admits_every_draft():
    """500 cases of sure drafters (survival products of 0.6-1.0) at flat to steep costs: wherever the shortcut answers,
    the search admits every draft at the same rate; it answers in a fair share of them (else it saves nothing) and
    declines some (else the cases do not test that it can)."""
    rng = np.random.default_rng(7)
    answered = 0
    for _ in range(500):
        survival = [np.cumprod(rng.uniform(0.6, 1.0, size=int(rng.integers(0, 6)))).tolist()
                    for _ in range(int(rng.integers(1, 9)))]
        per_draft = float(rng.uniform(0.0, 0.3))
        per_padded = float(rng.uniform(0.0, per_draft)) if rng.uniform() < 0.7 else 0.0
        fast, is_optimal = _every_draft(survival, 1.0, per_draft, per_padded)
        if not is_optimal:
            continue
        answered += 1
        slow = _search(survival, 1.0, per_draft, per_padded)
        assert fast.lengths == slow.lengths == [len(row) for row in survival]
        assert fast.rate == pytest.approx(slow.rate, rel=1e-12) and fast.width == slow.width
    assert 100 <= answered <= 450, answered
