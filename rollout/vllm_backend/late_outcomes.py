"""Adaptive verification (spec/adaptive/policy.py, the embedded engine's policy) as vLLM's workers see it: the
project's drafter is called once a step with the rows vLLM runs (drafting.py), and learns what became of its drafts,
and what the step cost, only at its next call. This adapter turns those calls into the policy's steps: the StepInfo
before drafting, the verified prefix after it, and at the next call the StepOutcome of the step before.

A request given L drafts that is back with s new tokens accepted s - 1 of them: drafts 0 .. s - 2 accepted, draft
s - 1 (when < L) rejected, the rest unjudged. A request that finished in between is not judged (a stop may have cut
its last step), though its drafts were verified in the step timed. The step's time is vLLM's between the calls plus
the drafter's own; it is unknown (None) where vLLM also prefilled or admitted a request then (the caller says). vLLM
flattens the rows of its forward and pads none, so the policy prices no padding.
"""

from spec.adaptive import AdaptivePolicy
from spec.policy import StepInfo, StepOutcome
from spec.proposers import Proposal


class LateOutcomes:
    """The policy for one worker's drafter; max_positions: the config's K."""

    def __init__(self, max_positions: int):
        self.policy = AdaptivePolicy(max_positions)
        self._info: StepInfo | None = None  # this call's step
        self._last: tuple[StepInfo, Proposal, float] | None = None  # the last call's step, verified drafts, draft s

    def limits(self, req_ids: list[int], caps: list[int], k: int) -> list[int]:
        """The most drafts each request drafts this step, within its cap (the policy's plan)."""
        self._info = StepInfo(req_ids, [1] * len(req_ids), caps, k)
        return self.policy.draft_limits(self._info).num_drafts

    def cut(self, proposal: Proposal, draft_seconds: float) -> list[int]:
        """Drafts returned per request: the prefix of each request's that the policy verifies."""
        lengths = self.policy.select(self._info, proposal, draft_seconds)
        self._last = (self._info, proposal.prefix(lengths), draft_seconds)
        return lengths

    def report(self, gained: dict[int, int], seconds: float | None) -> None:
        """What became of the last call's drafts: gained[request] = tokens it gained since (missing: it finished, and
        its drafts go unjudged); seconds: vLLM's time between the two calls (None: unknown)."""
        if self._last is None:
            return
        info, verified, draft_seconds = self._last
        self._last = None
        accepted = [None if req_id not in gained else min(max(gained[req_id] - 1, 0), n)
                    for req_id, n in zip(info.req_ids, verified.num_draft_tokens)]
        total = None if seconds is None else seconds + draft_seconds
        self.policy.observe(info, StepOutcome(verified, accepted, verified.num_draft_tokens, total, draft_seconds,
                                              seconds, 0.0))
