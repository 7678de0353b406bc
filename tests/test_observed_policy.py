"""Adaptive verification seen from the drafter (spec/adaptive/observed.py, vLLM's custom_class path): outcomes judged
from the tokens each request gained, step costs fitted from the time between calls, and drafts returned where their
survival pays for their tokens. Simulated steps on a fake clock: costs and acceptance are set, not measured."""

import random

import pytest

from spec.adaptive.observed import _OBSERVE_EVERY, ObservedPolicy

NUM_ROWS, K = 8, 4
BASE_S, PER_TOKEN_S = 1.0, 0.1  # a step: 1 s plus 0.1 s a verified token (8 rows verifying 1 token: 1.8 s)


def _run(acceptance: float, num_steps: int, seed: int = 0) -> list[int]:
    """Drafts returned per step over num_steps simulated steps; every draft has raw confidence 0.9 and is accepted
    with probability `acceptance` (given the ones before it)."""
    rng, policy = random.Random(seed), ObservedPolicy(K)
    requests, returned, lengths, seconds = list(range(NUM_ROWS)), [], [0] * NUM_ROWS, None
    for _ in range(num_steps):
        gained = {}
        for request, n in zip(requests, lengths):
            accepted = next((j for j in range(n) if rng.random() >= acceptance), n)
            gained[request] = accepted + 1
        policy.observe(gained, seconds)
        lengths = policy.choose(requests, [[0.9] * K for _ in requests], draft_seconds=0.0)
        seconds = BASE_S + PER_TOKEN_S * (NUM_ROWS + sum(lengths)) + rng.uniform(-0.02, 0.02)
        returned.append(sum(lengths))
    return returned


def test_until_the_costs_are_fitted_the_depth_steps_down_from_k():
    policy = ObservedPolicy(K)
    lengths = [policy.choose([1, 2], [[0.1] * K, [0.9, 0.2]], 0.0) for _ in range(5)]
    assert lengths == [[4, 2], [3, 2], [2, 2], [1, 1], [4, 2]]  # distinct token counts to fit a cost per token


def test_drafts_that_rarely_survive_stop_and_drafts_that_do_keep_coming():
    """At acceptance 0.2 a first draft is worth 0.2 tokens; the step makes about 4.4 tokens a second (8 tokens in
    1.8 s), so a token verified (0.1 s) must survive with at least 0.44 to pay: none does. At 0.95 even the fourth
    draft survives with 0.81: all are returned. Exploration returns first drafts at most one step in 33."""
    rare = _run(acceptance=0.2, num_steps=200)[100:]
    assert sum(n > 0 for n in rare) <= len(rare) / 16 and max(rare) <= NUM_ROWS
    sure = _run(acceptance=0.95, num_steps=200)[100:]
    assert sum(n == NUM_ROWS * K for n in sure) >= 0.9 * len(sure)


def test_a_cost_per_row_is_not_charged_to_the_drafts():
    """vLLM's steps cost mostly per row (scheduling, sampling, output handling) and little per draft. Rows drain a row
    a step, and a step with more rows verifies more drafts, so one slope per verified token would take part of the
    per-row cost for a per-draft one (about 0.0036 s a token here, against 0.002 s a draft) and cut drafts whose
    survival is under about 0.67: the third and fourth at acceptance 0.8 (0.51, 0.41), which pay at 0.002 s. With
    a cost per row and one per draft, nine drafts in ten come back."""
    rng, policy = random.Random(0), ObservedPolicy(K)
    returned, lengths, seconds = [], [], None
    for step in range(630):
        num_rows = 64 - step % 63  # drains 64 -> 2 rows a row a step, then again
        requests = list(range(num_rows))
        gained = {r: next((j for j in range(n) if rng.random() >= 0.8), n) + 1 for r, n in zip(requests, lengths)}
        policy.observe(gained, seconds if len(gained) == num_rows else None)
        lengths = policy.choose(requests, [[0.9] * K for _ in requests], draft_seconds=0.0)
        seconds = 0.02 + 0.01 * num_rows + 0.002 * sum(lengths) + rng.uniform(-0.001, 0.001)
        if step >= 315:
            returned.append(sum(lengths) / (K * num_rows))
    assert sum(returned) / len(returned) >= 0.9


def test_outcomes_are_judged_from_the_tokens_gained():
    policy = ObservedPolicy(K)
    assert policy.choose(["a", "b", "c"], [[0.5] * 3, [0.5] * 2, [0.5]], 0.0) == [3, 2, 1]
    policy.observe({"a": 2, "b": 3}, None)  # a: 1 accepted then 1 rejected (the third unjudged); b: both; c: gone
    assert policy.calibrator.num_observations == 0  # outcomes reach the calibrator every _OBSERVE_EVERY steps
    for _ in range(_OBSERVE_EVERY - 1):
        policy.observe({}, None)  # every request gone: nothing more judged
    assert policy.calibrator.num_observations == 4
    rates = [policy.calibrator.acceptance_rate(j) for j in range(2)]
    # position 0: 2 accepted of 2, position 1: 1 of 2, each from a prior of 4 outcomes at the rate before it
    assert rates == pytest.approx([(2 + 4 * 0.5) / 6, (1 + 4 * rates[0]) / 6])


def test_a_prefilling_step_is_not_fitted():
    policy = ObservedPolicy(K)
    for tokens in range(10):
        policy.choose([1], [[0.9] * (tokens % K)], 0.0)
        policy.observe({1: 1}, None)  # no step time: a step that prefilled
    assert policy.choose([1], [[0.01] * K], 0.0) == [K - 10 % 4]  # still unfitted: the depth steps on
