"""Adaptive verification as vLLM's workers see it (rollout/vllm_backend/late_outcomes.py): the policy's steps drafted
by the drafting host, outcomes judged from the tokens each request gained by the next call, step times fitted from the
time between calls. Simulated steps; costs and acceptance are set, not measured. No vLLM needed."""

import random

import pytest

from rollout.vllm_backend.late_outcomes import LateOutcomes
from spec import DraftRequest, Proposal, StepInfo
from spec.adaptive import AdaptivePolicy
from spec.drafting_host import DraftingHost

K = 4


class Replay:
    """Drafts the confidences it is given (token 3 each), as many as the host allows."""

    confidences: list[list[float]] = []

    def propose(self, requests, max_num_tokens) -> Proposal:
        drafts = [conf[:cap] for conf, cap in zip(self.confidences, max_num_tokens)]
        return Proposal([[3] * len(d) for d in drafts], drafts)


def _adapter() -> LateOutcomes:
    """vLLM's adaptive verification: a host with the adaptive policy, whose drafting takes no time."""
    return LateOutcomes(DraftingHost(Replay(), AdaptivePolicy(K), vocab_size=8, verifies_draft_probs=False,
                                     clock=lambda: 0.0))


def _call(adapter: LateOutcomes, requests: list, confidences: list[list[float]]) -> list[int]:
    """One propose call: the policy's caps, then its cut of drafts with these confidences."""
    adapter.host.drafter.confidences = confidences
    step = StepInfo(requests, [1] * len(requests), [K] * len(requests), K)
    drafts = adapter.host.draft(step, lambda: [DraftRequest(r, 0, [3], 1) for r in requests])
    adapter.drafted(drafts)
    return drafts.verified.num_draft_tokens


def test_outcomes_are_judged_from_the_tokens_gained_by_the_next_call():
    adapter = _adapter()
    policy = adapter.host.policy
    assert _call(adapter, ["a", "b", "c"], [[0.5] * 3, [0.5] * 2, [0.5]]) == [3, 2, 1]  # unfitted: depth K
    adapter.report({"a": 2, "b": 3}, None)  # a: 1 accepted, 1 rejected (the third unjudged); b: both; c: finished
    assert policy.stats()["num_calibration_observations"] == 4
    rates = [policy.calibrator.acceptance_rate(j) for j in range(2)]
    # position 0: 2 accepted of 2, position 1: 1 of 2, each from a prior of 4 outcomes at the rate before it
    assert rates == pytest.approx([(2 + 4 * 0.5) / 6, (1 + 4 * rates[0]) / 6])
    adapter.report({"a": 1}, 1.0)  # nothing returned since: nothing to judge
    assert policy.costs.price(3) is None


def _simulate(acceptance, num_steps: int, cost, rows_at, seed: int = 0) -> list[float]:
    """Each step's verified drafts over offered, on a simulated vLLM whose step takes cost(rows, drafts) seconds;
    drafts have raw confidence 0.9 and are accepted with probability acceptance (given the ones before)."""
    rng, adapter = random.Random(seed), _adapter()
    shares, lengths, requests, seconds = [], [], [], None
    for step in range(num_steps):
        gained = {r: next((j for j in range(n) if rng.random() >= acceptance), n) + 1
                  for r, n in zip(requests, lengths)}
        requests = list(range(rows_at(step)))
        gained = {r: g for r, g in gained.items() if r in requests}  # the rest finished
        adapter.report(gained, seconds if len(gained) == len(requests) else None)
        lengths = _call(adapter, requests, [[0.9] * K for _ in requests])
        seconds = cost(len(requests), sum(lengths)) + rng.uniform(-0.001, 0.001)
        shares.append(sum(lengths) / (K * len(requests)))
    return shares


def test_drafts_that_rarely_survive_stop_and_drafts_that_do_keep_coming():
    """8 rows, a step 1 s plus 0.1 s a verified token (8 tokens in 1.8 s: 4.4 tokens a second), so a draft must
    survive with 0.44 to pay: at acceptance 0.2 none does (exploration returns first drafts at most one step in 33),
    at 0.95 even the fourth (0.81) does."""
    def cost(rows, drafts):
        return 1.0 + 0.1 * (rows + drafts)
    rare = _simulate(0.2, 200, cost, lambda step: 8)[100:]
    assert sum(share > 0 for share in rare) <= len(rare) / 32 and max(rare) <= 1 / K
    sure = _simulate(0.95, 200, cost, lambda step: 8)[100:]
    assert sum(share == 1.0 for share in sure) >= 0.9 * len(sure)


def test_a_cost_per_row_is_not_charged_to_the_drafts():
    """vLLM's steps cost mostly per row (scheduling, sampling, output handling) and little per draft. Rows drain a
    row a step, and a step with more rows verifies more drafts, so one slope per verified token would take part of
    the per-row cost for a per-draft one and cut drafts whose survival is under about 0.67: the third and fourth at
    acceptance 0.8 (0.51, 0.41), which pay at 0.002 s. With a cost per row and one per draft, nine drafts in ten
    come back."""
    def cost(rows, drafts):
        return 0.02 + 0.01 * rows + 0.002 * drafts
    shares = _simulate(0.8, 630, cost, lambda step: 64 - step % 63)[315:]
    assert sum(shares) / len(shares) >= 0.9
