"""Whether drafting pays over a whole closed batch: adaptive verification's check on its per-step choices.

Per step, adaptive verification maximises the step's expected tokens per second (spec/budget.py). A closed batch
(every request admitted at its first step, none waiting) is not done until its last completion is, and that is not
the same thing: drafting deep for the requests the drafter predicts well finishes them early, and the requests it
predicts badly are left to a tail of small steps, where a token costs several times what it costs in a full batch.
On the benchmark's mixed workload (2-core CPU) each step's predictions held, drafting made the full-batch steps
emit 13% more tokens per second at 64 requests, and the batch still took 12-17% longer than decoding without drafts
at 64-256 requests.

So after each closed batch the check compares its measured time with what decoding without drafts would have taken
on the same completions (verification is lossless: drafting does not change what a seeded batch emits, nor what an
unseeded one emits in distribution): one token per running request per step, the requests running at step t being
those whose completion has at least t tokens, each step priced by the step-cost model (verify_cost(n, n)) plus the
batch's measured time per step outside drafting and verification, and its first step (prompts) as measured less its
drafting. Per batch size (powers of two) it keeps the log ratio of measured over predicted time of its last
NUM_BATCHES batches that drafted, and of those that did not (these measure the model's own error, which then
cancels; 0 until one is seen). Where the median drafted batch came out slower than the median undrafted one, the
next closed batches of that size decode without drafts, and every RECHECK-th of them drafts again to see whether
that still holds (the policy being trained, its prompts, a refreshed drafter all change it). A size with fewer than
NUM_BATCHES drafted batches follows the nearest smaller size that has them (and drafts where none has): per token,
verification only gets dearer relative to a step's fixed cost as the batch grows.
"""

import math
import statistics
from collections import deque
from dataclasses import dataclass

from spec.step_cost import StepCostModel

RECHECK = 16  # a size where drafting lost drafts again every RECHECK-th closed batch: at a 12-17% loss, under 1%
NUM_BATCHES = 3  # a size's verdict is the median of its last 3 drafted batches: one batch's time is noisy, and the
# first at a new size can be far off (the benchmark's default workload, 64 requests: a first batch at 0.79 of
# decoding without drafts, where adaptive verification had averaged 1.10 over a whole benchmark)


@dataclass
class BatchTiming:
    """Measured seconds of one engine run, filled step by step."""
    seconds: float = 0.0  # every step
    draft_seconds: float = 0.0  # proposing
    verify_seconds: float = 0.0  # target forward, rejection sampling, commit
    first_step_seconds: float = 0.0  # the first step (it prefills the prompts), less its drafting
    num_steps: int = 0

    def observe_step(self, seconds: float, draft_seconds: float, verify_seconds: float) -> None:
        if not self.num_steps:
            self.first_step_seconds = seconds - draft_seconds
        self.seconds += seconds
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        self.num_steps += 1


def undrafted_seconds(lengths: list[int], timing: BatchTiming, costs: StepCostModel) -> float:
    """Predicted seconds of the same batch decoded without drafts: its first step as measured (less drafting),
    then steps t = 2 .. max(lengths) of the requests with at least t tokens, each at verify_cost(n, n) plus the run's
    mean seconds per step outside drafting and verification."""
    other = (timing.seconds - timing.draft_seconds - timing.verify_seconds) / max(timing.num_steps, 1)
    seconds = timing.first_step_seconds
    lengths = sorted(lengths)
    num_done = 0  # requests with fewer than t tokens
    for t in range(2, max(lengths, default=0) + 1):
        while lengths[num_done] < t:
            num_done += 1
        running = len(lengths) - num_done
        seconds += costs.verify_cost(running, running) + other
    return seconds


class ClosedBatchCheck:
    """Per batch size, whether closed batches that drafted beat those that did not (module docstring)."""

    def __init__(self):
        # log2 batch size -> log(measured / predicted undrafted seconds) of its last NUM_BATCHES batches
        self._drafted: dict[int, deque[float]] = {}
        self._undrafted: dict[int, deque[float]] = {}
        self._since_drafted: dict[int, int] = {}  # closed batches of that size run without drafts since one drafted

    def allows_drafting(self, num_reqs: int) -> bool:
        """Whether a closed batch of num_reqs requests should draft (module docstring)."""
        size = num_reqs.bit_length()
        known = [s for s, ratios in self._drafted.items() if s <= size and len(ratios) == NUM_BATCHES]
        if not known or self._pays(max(known)):
            return True
        return self._since_drafted.get(size, 0) + 1 >= RECHECK

    def _pays(self, size: int) -> bool:
        """Drafted batches of this size took no longer, relative to the model's prediction, than undrafted ones."""
        undrafted = self._undrafted.get(size)
        return statistics.median(self._drafted[size]) <= (statistics.median(undrafted) if undrafted else 0.0)

    def observe(self, lengths: list[int], timing: BatchTiming, costs: StepCostModel, drafted: bool) -> None:
        """One finished closed batch: each request's completion length, the run's timing, whether it drafted."""
        if not lengths or timing.num_steps < 2:
            return
        size = len(lengths).bit_length()
        ratios = (self._drafted if drafted else self._undrafted).setdefault(size, deque(maxlen=NUM_BATCHES))
        ratios.append(math.log(timing.seconds / undrafted_seconds(lengths, timing, costs)))
        self._since_drafted[size] = 0 if drafted else self._since_drafted.get(size, 0) + 1
