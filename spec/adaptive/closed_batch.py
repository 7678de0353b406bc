"""Closed batches: whether one drafts at all, and how many drafts per request it may offer.

A closed batch is a run of two or more requests that all start at its first step, none waiting. It is not done
until its last completion is, which per-step allocation does not see: drafting deep for the requests the drafter
predicts well finishes them early, while the batch waits on the ones it predicts badly, in a tail of small steps
where a token costs several times what it costs in a full batch. Uncapped, adaptive verification ran 7-22% behind
K = 1-2 drafts for every request at 16-128 requests on the benchmark's mixed workload (2-core CPU).

So each finished closed batch that drafted is replayed (spec/adaptive/batch_replay.py) at K = 0, 1, .. its K, and
per batch size (powers of two) the replays of its last batches decide both for the next closed batches of that size:

- Whether to draft. Where K = 0 replays fastest, the next closed batches decode without drafts, and one of them
  drafts again to see whether that still holds (the policy being trained, its prompts, a refreshed drafter all
  change it, and an undrafted batch is not replayed): the 2nd after the verdict, then, while K = 0 stays fastest,
  the 4th, the 8th, and every RECHECK-th.
- How deep. A drafting batch offers every request up to the smallest K >= 1 that the fastest does not beat by
  REPLAY_MIN_GAIN over the size's last batches (the last NUM_BATCHES, or more where those hold fewer than
  REPLAY_REQUESTS requests). The replays draw the same positions for every K, so the noise between Ks is small, and
  0.5% resolves gains that separately timed runs (`rollout tune`'s 2%) leave.

The replays charge every K >= 1 the drafter's prompt prefill at the median per request over the window's batches,
not each batch's own: one stall of the machine in a first step's drafting must not turn drafting off for a size.
A size with no drafted batch of its own is not capped: the per-step policy decides, and the batch's trace starts
its replays. A lone request is its own critical path: it is not a closed batch.
"""

import statistics
from collections import deque
from typing import NamedTuple

from spec.adaptive.batch_replay import BatchTiming, Trace, prefill_seconds, replayed_seconds
from spec.metrics import RequestAcceptance
from spec.adaptive.step_cost import StepCostModel
from spec.tuning import smallest_k_within

MIN_REQUESTS = 2  # a closed batch has at least 2 requests (module docstring)
NUM_BATCHES = 3  # a size's decisions use its last 3 batches at least: one batch replays with its own luck
FIRST_RECHECK = 2  # a size where drafting just lost drafts again at its 2nd closed batch, and each recheck that
# confirms the loss doubles the wait, up to RECHECK
RECHECK = 16  # at last every 16th closed batch drafts: at a 12-17% loss, under 1%
REPLAY_REQUESTS = 64  # a size follows its last batches' replays over at least 64 requests (and NUM_BATCHES batches):
# a small batch's few completions replay with their own luck (over 3 batches of 2 requests the K offered moved
# between 4 and 8)
REPLAY_MIN_GAIN = 1.005  # a deeper K must replay 0.5% faster than the K offered (module docstring)


class Replay(NamedTuple):
    """A drafted closed batch's replays: its requests, its seconds at K = 0, 1, .. less the drafter's prompt prefill,
    and that prefill as measured (spec/adaptive/batch_replay.py)."""
    num_reqs: int
    seconds: list[float]
    prefill: float


class ClosedBatchSchedule:
    """Per batch size, whether closed batches draft, and the K they offer every request (module docstring)."""

    def __init__(self):
        self._replays: dict[int, deque[Replay]] = {}  # log2 batch size -> its last drafted batches' replays
        self._since_drafted: dict[int, int] = {}  # closed batches of that size run without drafts since one drafted
        self._recheck: dict[int, int] = {}  # where drafting lost: the closed batch since one drafted that drafts again

    def k_max(self, num_reqs: int) -> int | None:
        """The most drafts a closed batch of num_reqs requests offers a request (0: no drafts); None where the
        size has no drafted batch yet: no cap, adaptive verification trims per request up to the config's or the
        schedule's K."""
        replays = self._replays.get(num_reqs.bit_length())
        if replays is None:
            return None
        return best_k(replays) if self.allows_drafting(num_reqs) else 0

    def allows_drafting(self, num_reqs: int) -> bool:
        """Whether a closed batch of num_reqs requests should draft: its size's replays found drafting fastest, or
        it is the recheck (module docstring)."""
        size = num_reqs.bit_length()
        replays = self._replays.get(size)
        if replays is None or drafting_wins(replays):
            return True
        return self._since_drafted.get(size, 0) + 1 >= self._recheck.get(size, FIRST_RECHECK)

    def observe(self, lengths: list[int], max_lengths: list[int], records: list[RequestAcceptance],
                timing: BatchTiming, costs: StepCostModel, k_limit: int) -> None:
        """One finished closed batch: each request's completion length, the most it had room for, and its acceptance
        record, the run's timing, and the most drafts per request it could have been allowed (the config's or the
        schedule's K)."""
        if not lengths or timing.num_steps < 2:
            return
        size = len(lengths).bit_length()
        if not k_limit or not any(record.num_draft_tokens for record in records):
            self._since_drafted[size] = self._since_drafted.get(size, 0) + 1
            return
        self._since_drafted[size] = 0
        replays = self._replays.setdefault(size, deque())
        paid = not replays or drafting_wins(replays)
        trace = Trace(records, lengths)
        replays.append(Replay(len(lengths), replayed_seconds(lengths, max_lengths, trace, k_limit, timing, costs),
                              prefill_seconds(trace, timing, costs)))
        while _is_full(list(replays)[1:]):  # the oldest batch is not needed to keep the window full
            replays.popleft()
        if drafting_wins(replays):
            self._recheck.pop(size, None)
        else:  # drafting lost with this batch, or lost again at its recheck: wait twice as long as before
            self._recheck[size] = FIRST_RECHECK if paid else min(2 * self._recheck.get(size, FIRST_RECHECK), RECHECK)


def drafting_wins(replays) -> bool:
    """Whether some K >= 1 replayed faster than K = 0, summed over the batches (Replay each, up to the least K any of
    them was allowed)."""
    totals = _totals(replays)
    return min(totals[1:]) < totals[0]


def best_k(replays) -> int:
    """The smallest K >= 1 whose replayed seconds, summed over the batches, the fastest K >= 1 does not beat by
    REPLAY_MIN_GAIN."""
    totals = _totals(replays)
    return smallest_k_within({k: 1.0 / totals[k] for k in range(1, len(totals))}, REPLAY_MIN_GAIN)


def _is_full(replays) -> bool:
    """Whether a size's window holds enough batches and requests (NUM_BATCHES, REPLAY_REQUESTS)."""
    return len(replays) >= NUM_BATCHES and sum(replay.num_reqs for replay in replays) >= REPLAY_REQUESTS


def _totals(replays) -> list[float]:
    """Seconds at K = 0, 1, .. summed over the batches, every K >= 1 charged the drafter's prompt prefill at the
    batches' median per request (module docstring)."""
    per_request = statistics.median(replay.prefill / replay.num_reqs for replay in replays)
    prefill = per_request * sum(replay.num_reqs for replay in replays)
    totals = [sum(seconds) for seconds in zip(*(replay.seconds for replay in replays))]
    return totals[:1] + [total + prefill for total in totals[1:]]
