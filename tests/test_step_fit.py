"""The online step-cost fit (spec/adaptive/step_fit.py) and the ragged runner's padding rule it prices
(spec/model_runner.py): no profile, only the steps an engine reports."""

import random

import pytest

from spec.adaptive.step_fit import StepFit
from spec.model_runner import padded_queries

A, C, B, W = 0.02, 0.001, 0.0004, 0.0001  # seconds per step, per row, per further token, per padded slot


def _padded_to_widest(rows, tokens, width, num_wide):
    return rows * width - tokens


def _steps(fit: StepFit, rng: random.Random, num_steps: int, rows=(16, 31), k=4, noise=0.0005) -> None:
    """Decoding steps of 16-31 rows verifying 0 .. k drafts each, timed at the known costs plus uniform noise."""
    for _ in range(num_steps):
        widths = [1 + rng.randint(0, k) for _ in range(rng.randint(*rows))]
        tokens, padded = sum(widths), len(widths) * max(widths) - sum(widths)
        seconds = A + C * len(widths) + B * (tokens - len(widths)) + W * padded
        fit.observe_step(widths, seconds + rng.uniform(-noise, noise))


def test_the_fit_recovers_the_costs_of_the_steps_it_is_shown():
    fit = StepFit(_padded_to_widest)
    _steps(fit, random.Random(0), 200)
    price = fit.price(20)
    assert price.base == pytest.approx(A + C * 20, rel=0.05)
    assert price.per_token == pytest.approx(B, rel=0.1) and price.per_padded == pytest.approx(W, rel=0.3)
    # a step of 20 rows verifying 40 tokens, the widest 5 (all rows wide: padded to 5)
    assert price.cost(40, 5, 10) == pytest.approx(A + C * 20 + B * 20 + W * 60, rel=0.05)


def test_steps_that_show_no_cost_of_a_draft_apart_from_a_rows_price_drafts_free():
    """Every row verifying 4 drafts every step: only c + 4b is in the data; the prior reads it as c, drafts free, so
    the policy verifies them and the drafter's varying draft counts show what they cost (priced as a row's share
    instead, drafts that were not verified never taught the fit otherwise). None verified: the same."""
    fit = StepFit()
    rng = random.Random(1)
    for _ in range(100):
        rows = rng.randint(16, 31)
        fit.observe_step([5] * rows, A + (C + 4 * B) * rows)
    price = fit.price(24)
    assert price.per_token == pytest.approx(0.0, abs=1e-9)
    assert price.cost(24 * 5, 5, 24) == pytest.approx(A + (C + 4 * B) * 24, rel=0.01)  # the data's own steps hold
    undrafted = StepFit()
    for rows in range(16, 32):
        undrafted.observe_step([1] * rows, A + C * rows)
    assert undrafted.price(24).per_token == pytest.approx(0.0, abs=1e-9)
    _steps(undrafted, random.Random(2), 60)  # then steps that verify 0-4 drafts a row: the fit reads the cost
    assert undrafted.price(24).per_token == pytest.approx(B, rel=0.15)


def test_a_draft_is_priced_one_standard_error_below_its_fit_until_the_steps_pin_it_down():
    """Eight 512-row steps timed within +-15% (a shared machine), two of them verifying a draft a row: over 8 seeds
    the fitted b scatters to 1.38 B, dear enough to write off drafts that pay; the price reads it at least 0.15 B
    lower (its standard error here is 0.2-0.3 B), and no seed's price exceeds 1.1 B. Then 200 steps that vary their
    drafts at the true costs pin b down: the bound is within 5% of B."""
    fitted, priced = [], []
    for seed in range(8):
        rng, fit = random.Random(seed), StepFit()
        for drafts in (0, 1, 0, 0, 0, 1, 0, 0):
            fit.observe_step([1 + drafts] * 512, (A + C * 512 + B * drafts * 512) * rng.uniform(0.85, 1.15))
        fitted.append(fit._sizes[(512).bit_length()].solution[2])
        priced.append(fit.price(512).per_token)
    assert max(fitted) > 1.3 * B and max(priced) < 1.1 * B
    assert all(f - p >= 0.15 * B for f, p in zip(fitted, priced))
    rng = random.Random(3)
    for _ in range(200):
        widths = [1 + rng.randint(0, 4) for _ in range(512)]
        fit.observe_step(widths, A + C * 512 + B * (sum(widths) - 512))
    assert fit.price(512).per_token == pytest.approx(B, rel=0.05)


def test_a_batch_size_is_priced_from_its_own_steps_once_it_has_eight_else_from_the_nearest():
    fit = StepFit()
    assert fit.price(20) is None  # nothing fitted: the policy steps its depth
    _steps(fit, random.Random(2), 7)
    assert fit.price(20) is None
    _steps(fit, random.Random(3), 1)
    assert fit.price(20) is not None and fit.price(500) is not None  # 500 rows: the 16-31 fit, the nearest
    for _ in range(8):
        fit.observe_step([1] * 500, 1.0)  # a size of its own, one slow second a step
    assert fit.price(500).base > 0.5 and fit.price(20).base < 0.1


def test_negative_marginal_costs_are_held_at_zero_and_a_step_costs_something():
    fit = StepFit(_padded_to_widest)
    for drafts in range(40):  # more drafts, less time: noise the fit must not turn into free time
        fit.observe_step([1 + drafts % 5] * 8, 0.1 - 0.001 * (drafts % 5))
    price = fit.price(8)
    assert price.per_token == 0.0 and price.per_padded >= 0.0 and price.base > 0


def test_draft_forwards_are_fitted_by_their_rows():
    fit = StepFit()
    assert not fit.has_forwards
    fit.observe_forwards([(m, 0.002 + 0.0001 * m) for m in (1, 4, 16, 64) for _ in range(5)])
    assert fit.has_forwards
    costs = fit.forward_costs(64)
    assert costs[0] == pytest.approx(0.0021, rel=0.02) and costs[63] == pytest.approx(0.0084, rel=0.02)


@pytest.mark.parametrize("rows, widths, split", [
    (8, [3] + [1] * 7, True),  # one wide row in eight: its queries after the first in a block of their own
    (8, [3, 2] + [1] * 6, False),  # two in eight: every row padded to the widest
    (16, [4, 2] + [1] * 14, True),
    (4, [2, 2, 2, 2], False),
])
def test_the_padding_rule_counts_the_query_slots_the_ragged_runner_pads(rows, widths, split):
    tokens, width, wide = sum(widths), max(widths), [w for w in widths if w > 1]
    expected = sum(width - w for w in wide) if split else sum(width - w for w in widths)
    assert padded_queries(rows, tokens, width, len(wide)) == expected
