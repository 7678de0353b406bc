"""Closed batches: whether one drafts at all, and how many drafts per request it may offer.

Per step, adaptive verification maximises the step's expected tokens per second (spec/budget.py). A closed batch
(every request admitted at its first step, none waiting) is not done until its last completion is, and that is not
the same thing: drafting deep for the requests the drafter predicts well finishes them early, while the batch waits
on the ones it predicts badly, in a tail of small steps where a token costs several times what it costs in a full
batch. On the benchmark's mixed workload (2-core CPU) each step's predictions held, and yet uncapped adaptive
verification ran at 0.78-0.93 of K = 1-2 drafts for every request at 16-128 requests, and 12-17% behind decoding
without drafts at 64-256.

So each finished closed batch is replayed (spec/batch_replay.py), and per batch size (powers of two) two decisions
follow for the next closed batches of that size.

Whether to draft: measured. The log ratio of each batch's measured time over its replay without drafts is kept for
the last NUM_BATCHES batches that drafted, and for those that did not (these measure the model's own error, which then
cancels; 0 until one is seen). Where the median drafted batch came out slower than the median undrafted one, the next
closed batches decode without drafts, and one of them drafts again to see whether that still holds (the policy being
trained, its prompts, a refreshed drafter all change it, and so does the machine: a verdict of 3 batches on a shared
VM whose speed drifts can be a slow spell's): the 2nd after the verdict, then, while drafting keeps losing, the 4th,
the 8th, and every RECHECK-th (FIRST_RECHECK). Rechecking only every 16th, schedule + adaptive verification drafted
next to nothing from 16 requests on through a whole benchmark run (default workload, noisy 2-core VM: 0.70-0.80 of the
schedule at 16-64). A size with fewer than NUM_BATCHES drafted batches follows the nearest smaller size that has them
(and drafts where none has): per token, verification only gets dearer relative to a step's fixed cost as the batch
grows. Measured, not replayed, because drafting over every prompt in a batch's first step costs 20-30% more than the
step-cost model says at 64 requests and more.

How deep: replayed. Where it drafts, a batch offers every request, untrimmed, the K >= 1 whose replays over the
size's last batches took least (the last NUM_BATCHES, or more where those hold fewer than REPLAY_REQUESTS requests).
The replays take each batch's own steps at the K it ran and find, from its trace, the steps and verified tokens of
the others within 2% (default and mixed workloads, 16 and 64 requests, from batches run at K = 4 and 8), but for K =
8 from K = 4 at 16 requests on the default workload (6% too many steps); an earlier replay that resampled whole
steps priced K = 8 8-14% high relative to K = 4, and the largest K within 5% of the best was offered to make up for
it. What is left is the step-cost model's error from one K's steps to another's. Untrimmed, because per-request
trimming is what loses in a closed batch: it cuts the drafts of the requests the drafter predicts badly, which are
the ones the batch waits on, and each step's rate counts a token of any request alike, where the batch's time is its
slowest request's steps. Capped at the best K and trimming below it, adaptive verification ran 2-9% behind that K
for every request (mixed workload, 16 requests); not capped at all, 5-8% behind K = 8 for every request on the
default workload at 4-16 requests (10.5 steps a batch of 8 where K = 8 took 8.9). A size with no batch of its own is
not capped: the per-step policy trims, and the batch's records start its replays.
"""

import math
import statistics
from collections import deque

from spec.batch_replay import BatchTiming, Trace, replayed_seconds
from spec.metrics import RequestAcceptance
from spec.step_cost import StepCostModel

NUM_BATCHES = 3  # a size's decisions use its last 3 batches: one batch's time is noisy, and the first at a new size
# can be far off (the benchmark's default workload, 64 requests: a first batch at 0.79 of decoding without drafts,
# where adaptive verification had averaged 1.10 over a whole benchmark)
FIRST_RECHECK = 2  # a size where drafting just lost drafts again at its 2nd closed batch (the 1st measures decoding
# without drafts), and each recheck that confirms the loss doubles the wait, up to RECHECK
RECHECK = 16  # at last every 16th closed batch drafts: at a 12-17% loss, under 1%
REPLAY_REQUESTS = 64  # how deep a size drafts follows its last batches' replays over at least 64 requests (and
# NUM_BATCHES batches): a small batch's few completions replay with their own luck. Over 3 batches, the K offered
# moved between 4 and 8 at 2 requests on the default workload, 8% behind K = 8 (median of 24 batches, each timed
# against K = 8's on the same prompts), and between 1 and 4 at 4 requests on the mixed one, 5% behind K = 2; over 64
# requests, K = 8 throughout (3% behind, on the same steps as K = 8), and 2-3 (even with K = 2)


class ClosedBatchSchedule:
    """Per batch size, whether closed batches draft, and the K they offer every request (module docstring)."""

    def __init__(self):
        # log2 batch size -> log(measured / replayed undrafted seconds) of its last NUM_BATCHES batches
        self._drafted: dict[int, deque[float]] = {}
        self._undrafted: dict[int, deque[float]] = {}
        self._since_drafted: dict[int, int] = {}  # closed batches of that size run without drafts since one drafted
        self._recheck: dict[int, int] = {}  # where drafting lost: the closed batch since one drafted that drafts again
        # log2 batch size -> its last batches' sizes and replayed seconds at K = 0, 1, ..
        self._replays: dict[int, deque[tuple[int, list[float]]]] = {}

    def k_max(self, num_reqs: int) -> int | None:
        """The K a closed batch of num_reqs requests offers every request, untrimmed (0: no drafts); None where the
        size has no batch yet: no cap, adaptive verification trims per request up to the config's or the schedule's
        K."""
        if not self.allows_drafting(num_reqs):
            return 0
        replays = self._replays.get(num_reqs.bit_length())
        return None if replays is None else best_k([seconds for _, seconds in replays])

    def allows_drafting(self, num_reqs: int) -> bool:
        """Whether a closed batch of num_reqs requests should draft (module docstring)."""
        size = num_reqs.bit_length()
        recheck = self._recheck.get(size, FIRST_RECHECK)
        return self._drafting_pays(size) or self._since_drafted.get(size, 0) + 1 >= recheck

    def _drafting_pays(self, size: int) -> bool:
        """What this size's drafted batches (or the nearest smaller size's, or none) say (module docstring)."""
        known = [s for s, ratios in self._drafted.items() if s <= size and len(ratios) == NUM_BATCHES]
        return not known or self._pays(max(known))

    def _pays(self, size: int) -> bool:
        """Drafted batches of this size took no longer, relative to their replay without drafts, than undrafted ones."""
        undrafted = self._undrafted.get(size)
        return statistics.median(self._drafted[size]) <= (statistics.median(undrafted) if undrafted else 0.0)

    def observe(self, lengths: list[int], max_lengths: list[int], records: list[RequestAcceptance],
                timing: BatchTiming, costs: StepCostModel, k_limit: int) -> None:
        """One finished closed batch: each request's completion length, the most it had room for, and its acceptance
        record, the run's timing, and the most drafts per request it could have been allowed (the config's or the
        schedule's K)."""
        if not lengths or timing.num_steps < 2:
            return
        size = len(lengths).bit_length()
        trace = Trace(records, lengths)
        drafted = trace.drafted
        seconds = replayed_seconds(lengths, max_lengths, trace, k_limit if drafted else 0, timing, costs)
        paid = self._drafting_pays(size)
        ratios = (self._drafted if drafted else self._undrafted).setdefault(size, deque(maxlen=NUM_BATCHES))
        ratios.append(math.log(timing.seconds / seconds[0]))
        self._since_drafted[size] = 0 if drafted else self._since_drafted.get(size, 0) + 1
        if self._drafting_pays(size):
            self._recheck.pop(size, None)
        elif drafted:  # drafting lost with this batch, or lost again at its recheck: wait twice as long as before
            self._recheck[size] = FIRST_RECHECK if paid else min(2 * self._recheck.get(size, FIRST_RECHECK), RECHECK)
        if len(seconds) > 1:
            replays = self._replays.setdefault(size, deque())
            replays.append((len(lengths), seconds))
            while len(replays) > NUM_BATCHES and sum(n for n, _ in replays) - replays[0][0] >= REPLAY_REQUESTS:
                replays.popleft()


def best_k(replays) -> int:
    """The K >= 1 with the least replayed seconds summed over the batches (up to the least K any of them was
    allowed)."""
    totals = [sum(seconds) for seconds in zip(*replays)]
    return min(range(1, len(totals)), key=totals.__getitem__)
