"""The drafting host: what an engine does around its drafter, one code for the embedded engine
(rollout/embedded_backend/engine.py) and
vLLM's workers (rollout/vllm_backend/drafting.py).

Each step, `draft(step, views)`:
1. plan: the policy's `draft_limits`, the most drafts each request may draft (within StepInfo.max_drafts);
2. propose: the drafter's proposal, validated (the Proposer protocol, the target's vocabulary), refused where it
   carries draft_probs and the engine verifies point proposals only, counted, and cut after each request's first
   draft stop id (an accepted stop ends the request: what follows it would be verified for nothing);
3. select: the policy's choice of the prefix of each request's drafts that is verified.
After verification, `observe` tells the policy what the step found and cost. `begin_run`/`end_run` bracket a run.

Faults. A drafter whose propose raises an Exception or breaks the protocol costs the step its drafts, not the run:
verification is lossless, so the tokens follow the target all the same. The host counts the fault, warns at a run's
first, drops the drafter's state (`release_all`, where it has one), and stops drafting after max_drafter_faults faults
in a run; with max_drafter_faults = 0 the first fault raises. A DrafterConfigError (draft ids outside the vocabulary,
draft_probs the engine cannot verify) is a bug, and always raises.

A GRPO group is the live requests with the same prompt token ids (PromptGroups): they share a group id.
"""

import time
import warnings
from dataclasses import KW_ONLY, dataclass, field
from typing import Callable, Sequence

from spec.policy import DraftPlan, SpeculationPolicy, StepInfo, StepOutcome
from spec.proposers.base import DrafterConfigError, DraftRequest, Proposal, Proposer

MAX_DRAFTER_FAULTS = 8  # the default on both engines


@dataclass
class StepDrafts:
    """One step's drafting."""

    step: StepInfo
    plan: DraftPlan
    proposed: Proposal  # validated and cut at stop ids, before the policy's select
    verified: Proposal  # the prefix of `proposed` that the policy selected
    seconds: float  # proposing, with the checks and the cut


@dataclass(eq=False)
class DraftingHost:
    """drafter: None drafts nothing. vocab_size: the target's. verifies_draft_probs: whether the engine verifies
    probabilistic proposals (else draft_probs are a DrafterConfigError). max_drafter_faults: the faults a run tolerates
    (module docstring). clock: seconds, for the drafting time the policy is told."""

    drafter: Proposer | None
    policy: SpeculationPolicy
    _: KW_ONLY
    vocab_size: int
    verifies_draft_probs: bool
    max_drafter_faults: int = MAX_DRAFTER_FAULTS
    clock: Callable[[], float] = time.perf_counter
    num_proposed_drafts: int = field(default=0, init=False)  # drafted, before the stop cut and the policy's select
    num_faults: int = field(default=0, init=False)
    seconds: float = field(default=0.0, init=False)  # proposing, over every step
    _num_run_faults: int = field(default=0, init=False, repr=False)

    @property
    def name(self) -> str:
        return getattr(self.drafter, "name", None) or type(self.drafter).__name__

    @property
    def is_drafting(self) -> bool:
        """A drafter, which has not used up this run's faults."""
        return self.drafter is not None and not 0 < self.max_drafter_faults <= self._num_run_faults

    def begin_run(self) -> None:
        self._num_run_faults = 0
        self.policy.begin_run()

    def end_run(self) -> None:
        self.policy.end_run()

    def draft(self, step: StepInfo, views: Callable[[], Sequence[DraftRequest]]) -> StepDrafts:
        """This step's drafts; views: the drafter's views of the step's requests in step.req_ids' order, built only
        where the step drafts."""
        plan = self.policy.draft_limits(step)
        start = self.clock()
        proposed = self._propose(views, plan.num_drafts)
        seconds = self.clock() - start
        self.seconds += seconds
        verified = proposed.prefix(self.policy.select(step, proposed, seconds))
        return StepDrafts(step, plan, proposed, verified, seconds)

    def observe(self, drafts: StepDrafts, num_accepted: list[int | None], seconds: float | None,
                verify_seconds: float | None, condense_seconds: float = 0.0) -> None:
        """What the verified drafts of `drafts` found (None: unknown) and what the step cost (spec/policy.py)."""
        self.policy.observe(drafts.step, StepOutcome(drafts.verified, num_accepted, drafts.proposed.num_draft_tokens,
                                                     seconds, drafts.seconds, verify_seconds, condense_seconds))

    def fault(self, error: Exception) -> None:
        """A drafter fault: counted, warned at a run's first, the drafter's state dropped; raised where the rule says
        (a DrafterConfigError, or max_drafter_faults = 0)."""
        if isinstance(error, DrafterConfigError) or not self.max_drafter_faults:
            raise error
        self.num_faults += 1
        self._num_run_faults += 1
        release = getattr(self.drafter, "release_all", None)
        if release is not None:
            release()
        if self._num_run_faults == 1:
            warnings.warn(f"the drafter {self.name} faulted ({type(error).__name__}: {error}); that step verified no "
                          "drafts and the rollout goes on (verification is lossless: only speed is lost); this call "
                          "counts faults in stats['num_drafter_faults'] and stops drafting after "
                          f"max_drafter_faults={self.max_drafter_faults} of them", RuntimeWarning, stacklevel=2)

    def _propose(self, views: Callable[[], Sequence[DraftRequest]], limits: list[int]) -> Proposal:
        """The drafter's proposal, checked and cut at stop ids; no drafts where it faults."""
        if not self.is_drafting or not any(limits):
            return _no_drafts(len(limits))
        requests = views()
        try:
            proposal = self.drafter.propose(requests, limits)
            self._check(proposal, limits)
        except Exception as error:
            self.fault(error)
            return _no_drafts(len(limits))
        self.num_proposed_drafts += sum(proposal.num_draft_tokens)
        return _cut_at_stop(requests, proposal)

    def _check(self, proposal: Proposal, limits: list[int]) -> None:
        proposal.validate(limits, source=self.name, vocab_size=self.vocab_size)
        if proposal.draft_probs is not None and not self.verifies_draft_probs:
            raise DrafterConfigError(f"{self.name} returned draft_probs: this engine verifies the project's drafters' "
                                     "drafts as point proposals, which is lossless only for drafts that are not "
                                     "sampled from them; return draft_probs=None")


class PromptGroups:
    """GRPO groups: requests with the same prompt token ids share a group id while any of them is live."""

    def __init__(self):
        self._groups: dict[tuple[int, ...], list[int]] = {}  # prompt token ids -> [group id, live requests]

    def join(self, prompt_ids: Sequence[int], new_id: int) -> int:
        """The group id of a request of this prompt: its live siblings', else `new_id`."""
        group = self._groups.setdefault(tuple(prompt_ids), [new_id, 0])
        group[1] += 1
        return group[0]

    def leave(self, prompt_ids: Sequence[int]) -> None:
        key = tuple(prompt_ids)
        group = self._groups[key]
        group[1] -= 1
        if not group[1]:
            del self._groups[key]


def _cut_at_stop(requests: Sequence[DraftRequest], proposal: Proposal) -> Proposal:
    """Each request's drafts up to its first stop id, that one included."""
    lengths = [next((j + 1 for j, t in enumerate(drafts) if t in r.stop_ids), len(drafts))
               for r, drafts in zip(requests, proposal.token_ids)]
    return proposal.prefix(lengths)


def _no_drafts(num_reqs: int) -> Proposal:
    return Proposal([[] for _ in range(num_reqs)], [[] for _ in range(num_reqs)])
