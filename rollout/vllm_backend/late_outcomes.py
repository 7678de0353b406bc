"""A step's outcome as vLLM's workers learn it: the project's drafter is called once a step with the rows vLLM runs
(drafting.py), and learns what became of its drafts, and what the step cost, only at its next call. This adapter keeps
the step the drafting host (spec/drafting_host.py) drafted last, and at the next call tells the host its outcome,
which the host hands the speculation policy as the embedded engine's outcomes are handed to it.

A request given L drafts that is back with s new tokens accepted s - 1 of them: drafts 0 .. s - 2 accepted, draft
s - 1 (when < L) rejected, the rest unjudged. A request that finished in between is not judged (a stop may have cut
its last step), though its drafts were verified in the step timed. The step's time is vLLM's between the calls plus
the drafter's own; it is unknown (None) where vLLM also prefilled or admitted a request then (the caller says). vLLM
flattens the rows of its forward and pads none, so the policy prices no padding.
"""

from spec.drafting_host import DraftingHost, StepDrafts


class LateOutcomes:
    """The outcomes of `host`'s steps, each reported at the call after it."""

    def __init__(self, host: DraftingHost):
        self.host = host
        self._last: StepDrafts | None = None  # the last call's step

    def drafted(self, drafts: StepDrafts) -> None:
        """The step just drafted, whose outcome the next report tells."""
        self._last = drafts

    def report(self, gained: dict[int, int], seconds: float | None) -> None:
        """What became of the last call's drafts: gained[request] = tokens it gained since (missing: it finished, and
        its drafts go unjudged); seconds: vLLM's time between the two calls (None: unknown)."""
        if self._last is None:
            return
        last, self._last = self._last, None
        accepted = [None if req_id not in gained else min(max(gained[req_id] - 1, 0), n)
                    for req_id, n in zip(last.step.req_ids, last.verified.num_draft_tokens)]
        total = None if seconds is None else seconds + last.seconds
        self.host.observe(last, accepted, total, seconds)
