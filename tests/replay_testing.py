"""Shared pieces of the closed-batch tests: a step-cost table and acceptance records built from their steps."""

from spec import RequestAcceptance
from spec.adaptive import StepCostModel

COSTS = StepCostModel({1: {1: 1.0, 2: 1.5}, 2: {2: 2.0, 4: 3.0}, 4: {4: 3.0, 8: 5.0}}, {1: 0.1, 4: 0.2})


def flat_costs(draft_seconds: float) -> StepCostModel:
    """Verification at 1 s a step whatever its tokens (the curves are flat beyond their last point too); a draft
    forward at draft_seconds."""
    return StepCostModel({n: {n: 1.0, 8 * n: 1.0} for n in (1, 2, 4)}, {1: draft_seconds, 4: draft_seconds})


def record(outcomes: list[tuple[int, int]]) -> RequestAcceptance:
    """A request's acceptance record from (drafts offered, accepted) per step."""
    acceptance = RequestAcceptance.sized(max(k for k, _ in outcomes))
    for offered, accepted in outcomes:
        acceptance.observe(offered, accepted)
    return acceptance
