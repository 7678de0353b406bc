"""The speculation policy: the one seam where the engine asks how many drafts each request drafts and verifies.

An engine step is plan -> propose -> select -> verify -> commit -> observe. The policy answers twice a step:
before drafting, `draft_limits` (how many drafts each request may draft, within the schedule's K and the request's
room), and after it, `select` (how many of each request's drafts are verified: a prefix). After verification,
`observe` hands it what was found and what the step cost. `begin_run` and `end_run` bracket one run of the engine
(one `generate` call): a policy's per-request state lasts a run. Whatever a policy decides, verification stays lossless: with point proposals the emitted
tokens do not depend on which drafts are offered, only how fast they come.

Everything a drafter tells the policy (confidences, its forwards' times) travels in its `Proposal`; a policy never calls the drafter, and the drafter never calls the policy.

`StaticPolicy` is the per-batch-size schedule as vLLM runs it: every request drafts K = schedule[batch size]
(capped by its room) and verifies all of them. Adaptive verification (spec/adaptive/) is the other policy: it cuts
each request's drafts inside the same cap, on the embedded engine and, through an adapter, in vLLM's workers.
"""

from dataclasses import dataclass
from typing import Protocol

from spec.proposers.base import Proposal


@dataclass
class StepInfo:
    """One engine step as a policy sees it, one entry per running request in the engine's row order."""

    req_ids: list[int]
    num_uncached: list[int]  # tokens each row feeds besides drafts: 1 when decoding, more where it prefills
    max_drafts: list[int]  # the most drafts each row may get: the schedule's K, capped by the row's room
    k_max: int  # the schedule's K at this batch size
    num_left: list[int] | None = None  # tokens each row may still emit (max_tokens, max_model_len); None: unknown
    num_waiting: int | None = None  # requests of the call queued behind this batch; None: unknown (vLLM's workers)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def is_draining(self) -> bool:
        """No request of the call waits: the call ends when its rows with the most tokens left end."""
        return self.num_waiting == 0 and self.num_left is not None

    def advance(self, num_accepted: list[int]) -> int:
        """The tokens by which the most tokens left fell in this step, given each row's accepted drafts: 1 in a step
        without drafts, more only where every row with the most left accepted (rows that finish count as running):
        the call ends when the most tokens left reach 0."""
        return max(self.num_left) - max(n - 1 - a for n, a in zip(self.num_left, num_accepted))

    @property
    def is_decoding(self) -> bool:
        """Every row feeds one token: no prompt is prefilled in this step."""
        return sum(self.num_uncached) == len(self.num_uncached)


@dataclass
class DraftPlan:
    """What the engine asks of the drafter this step."""

    num_drafts: list[int]  # the most drafts per row (0: none); never above StepInfo.max_drafts
    k: int  # the step's K, for the metrics (`k_per_batch_size`): the most drafts any row was allowed


@dataclass
class StepOutcome:
    """What one step verified and found, and what it cost."""

    verified: Proposal  # the drafts verified (the selected prefix of what was drafted)
    num_accepted: list[int | None]  # per row; None where unknown (vLLM: a request that finished before it said)
    num_drafted: list[int]  # per row, before select
    seconds: float | None  # the whole step; None where unknown (an engine seen from its drafter: a step that did
    # other work as well)
    draft_seconds: float  # proposing
    verify_seconds: float | None  # the target forward, rejection sampling and the commit
    condense_seconds: float  # moving requests down the cache past finished ones


class SpeculationPolicy(Protocol):
    def begin_run(self) -> None:
        """A run (one generate call) starts."""

    def draft_limits(self, step: StepInfo) -> DraftPlan:
        ...

    def select(self, step: StepInfo, proposal: Proposal, draft_seconds: float) -> list[int]:
        """Drafts verified per row: a prefix of each row's, at most its proposal's."""
        ...

    def observe(self, step: StepInfo, outcome: StepOutcome) -> None:
        ...

    def end_run(self) -> None:
        """The run finished."""

    def stats(self) -> dict:
        """The policy's own figures for a call's stats (flat, numeric)."""
        ...


class StaticPolicy:
    """The per-batch-size schedule: every row drafts the schedule's K (within its room) and verifies them all."""

    def begin_run(self) -> None:
        pass

    def draft_limits(self, step: StepInfo) -> DraftPlan:
        return DraftPlan(list(step.max_drafts), step.k_max)

    def select(self, step: StepInfo, proposal: Proposal, draft_seconds: float) -> list[int]:
        return proposal.num_draft_tokens

    def observe(self, step: StepInfo, outcome: StepOutcome) -> None:
        pass

    def end_run(self) -> None:
        pass

    def stats(self) -> dict:
        return {}
