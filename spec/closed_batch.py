"""Closed batches: whether one drafts at all, and how many drafts per request it may offer.

Per step, adaptive verification maximises the step's expected tokens per second (spec/budget.py). A closed batch
(two or more requests, all admitted at its first step, none waiting) is not done until its last completion is, and
that is not the same thing: drafting deep for the requests the drafter predicts well finishes them early, while the
batch waits on the ones it predicts badly, in a tail of small steps where a token costs several times what it costs
in a full batch. On the benchmark's mixed workload (2-core CPU) each step's predictions held, and yet uncapped adaptive
verification ran at 0.78-0.93 of K = 1-2 drafts for every request at 16-128 requests, and 12-17% behind decoding
without drafts at 64-256.

So each finished closed batch that drafted is replayed (spec/batch_replay.py) at K = 0, 1, .. its K, and per batch
size (powers of two) the replays of its last batches decide both for the next closed batches of that size. Small
batches are replayed less often: once a size's window is full, its replays take at most REPLAY_SHARE of its
batches' time.

Whether to draft: replayed. Where K = 0 replays fastest, the next closed batches decode without drafts, and one of
them drafts again to see whether that still holds (the policy being trained, its prompts, a refreshed drafter all
change it, and an undrafted batch is not replayed): the 2nd after the verdict, then, while K = 0 stays fastest, the
4th, the 8th, and every RECHECK-th (FIRST_RECHECK). The replays price the drafter's own prompt prefill from the
batch's measured first step, and a forward that feeds a row 2 tokens where its drafts were all accepted
(spec/batch_replay.py); without those, replays priced drafting 5-8% low at 256 requests (default workload: K = 1
replayed 5-15% ahead of no drafts, where paired runs put it 3-9% ahead; mixed: 2-7% ahead, where no drafts ran 4%
ahead). With them, K = 0 replayed 3-4% ahead on the mixed workload, and K = 3-4 1-10% ahead of it on the default one
(paired runs: K = 1 and 3 4-5% ahead; K = 1 replays about 4% behind K = 3 there, the 2-token rows priced as whole
rows). The prefill is the one measured time that the replays charge to drafting alone, so a size's window charges
every batch its median per request over the window's batches, not the batch's own: one stall of the machine in a
first step's drafting (a pause of 1.5-2 s, seen in a benchmark run at 1 request, where a batch takes 0.1 s) made
K = 0 replay fastest by far, and with the stalled batch kept among a size's last 64 requests, where only rechecks
draft, 26 of the next 51 closed batches of 1 request went undrafted (2 s injected by hand, mixed workload, while a
lone request still made a closed batch; none with the median; in that benchmark run schedule + adaptive ran at 0.48
of K = 8 over all 128 repeats of its second stage). The verdict before this one was measured (each batch's time over
its replay without drafts, the median of the last 3 drafted batches against the last 3 undrafted): on a noisy 2-core
VM, where one batch of 256 takes 2.2-3.1 s for the same work, it flipped between drafting and not, and the adaptive
arms ran at 0.83-0.85 of K = 1 there.

How deep: replayed. Where it drafts, a batch offers every request up to the K >= 1 chosen from the replays
over the size's last batches (the last NUM_BATCHES, or more where those hold fewer than REPLAY_REQUESTS requests): the
smallest K that the fastest does not beat by REPLAY_MIN_GAIN (0.5%). The replays draw the same positions for every K,
so their noise between Ks is small; `rollout tune`'s MIN_GAIN (2%), which compares separately timed runs, left gains
the replays resolve: K = 3 offered at 64 requests on the default workload where K = 4 ran 2.3% faster (paired), and
K = 7 at 4 requests in some windows where K = 8 ran 3% faster. Not so for whether to draft: an undrafted batch is not
replayed, so a verdict for K = 0 stands until its recheck, where one for drafting keeps being replayed (with a 2%
margin on it, most closed batches of 64 on the default workload went undrafted in a benchmark run, 12% behind the
schedule's K = 4, paired).
The replays take each batch's own steps at the K it ran and find, from its trace, the steps and verified tokens of
the others within 2% (default and mixed workloads, 16 and 64 requests, from batches run at K = 4 and 8), but for K =
8 from K = 4 at 16 requests on the default workload (6% too many steps). That was from drawing the positions that
verified no draft; a draft-model drafter now reveals them (spec/proposers/draft_model.py), and from batches run at
K = 4, 5 and 8 (8 requests, 40 batches each) the replays put K = 4 and 5 at 1.018-1.019 and 1.003 of K = 8 whichever
K ran, against 1.020 and 0.999 measured. Where a size's batches ran a K below the best, drawing had also kept them
there: at 64 requests on the default workload closed batches offered K = 3 in 14 of 16 batches, drawing, and K = 4 in
12 of 16, revealing, 4.5% faster in total (median 4.0%; paired, one process; static K = 4 led there). An earlier
replay that resampled whole steps priced K = 8 8-14% high relative to K = 4, and the largest K within 5% of the best
was offered to make up for it. What is left is the step-cost model's error from one K's steps to another's (mixed
workload, 8 requests: the replays priced K = 2's own batches 2.3% above their measured time and K = 3's within
0.2%). Correcting each cap's replays by its own batches' measured over replayed seconds was tried and dropped: one
batch's ratio ranged 0.85-1.37 at 64 requests on the default workload (24 batches), so the median of a cap's last
3-8 moved its K by 3-4% on a single batch, more than the error it was to correct, and the offer switched between
K = 3, 4 and 5 (benchmark at 64: 0.92 of the best other arm, confirmed, against 0.99 in the run before).
Under the cap every request gets a first draft, and a further draft only where it pays on the batch's critical path
(spec/adaptive.py: priced at one request's tokens per second, not the batch's), not where the per-step policy's
allocation would admit it: trimming at the batch's rate is what loses in a closed batch. It cuts the drafts of the
requests the drafter predicts badly, which are the ones the batch waits on, and each step's rate counts a token of
any request alike, where the batch's time is its slowest request's steps. Capped at the best K and trimming below it
so, adaptive verification ran 2-9% behind that K for every request (mixed workload, 16 requests); not capped at all,
5-8% behind K = 8 for every request on the default workload at 4-16 requests (10.5 steps a batch of 8 where K = 8
took 8.9). A size with no drafted batch of its own is not capped: the per-step policy trims, and the batch's records
start its replays.

A batch of one request is not a closed batch here: it is its own critical path, so the per-step policy's rate is its
request's, which is what its time follows, and neither a cap nor a replay has anything to add; each would only cost
(default workload, 1 request, about 45 ms a batch: the replay 1.0-1.2 ms in the engine's loop, where it runs cold,
against 0.45 ms on its own). Paired, 60-80 batches each timed against static K = 8 on the same prompts: under the cap
0.947-0.959 of K = 8 (medians; totals 0.954-0.970), as a lone open request 0.976-0.982 (0.988-0.992); on prompts the
drafter predicts badly (the mixed workload's strings), level (1.537 and 1.508 of K = 8, totals 1.512 and 1.506). At 2
requests the cap stays: 0.988 of K = 8 against 0.976 without (the batch of 2 took 7.2 steps against 7.9).
"""

import statistics
import time
from collections import deque
from typing import NamedTuple

from spec.batch_replay import BatchTiming, Trace, prefill_seconds, replayed_seconds
from spec.metrics import RequestAcceptance
from spec.step_cost import StepCostModel
from spec.tuning import smallest_k_within

MIN_REQUESTS = 2  # a closed batch has at least 2 requests (module docstring)
NUM_BATCHES = 3  # a size's decisions use its last 3 batches at least: one batch replays with its own luck
FIRST_RECHECK = 2  # a size where drafting just lost drafts again at its 2nd closed batch, and each recheck that
# confirms the loss doubles the wait, up to RECHECK
RECHECK = 16  # at last every 16th closed batch drafts: at a 12-17% loss, under 1%
REPLAY_REQUESTS = 64  # a size follows its last batches' replays over at least 64 requests (and NUM_BATCHES batches):
# a small batch's few completions replay with their own luck. Over 3 batches, the K offered moved between 4 and 8 at 2
# requests on the default workload, 8% behind K = 8 (median of 24 batches, each timed against K = 8's on the same
# prompts), and between 1 and 4 at 4 requests on the mixed one, 5% behind K = 2; over 64 requests, K = 8 throughout
# (3% behind, on the same steps as K = 8), and 2-3 (even with K = 2)
REPLAY_MIN_GAIN = 1.005  # a deeper K must replay 0.5% faster than the K offered (module docstring)
REPLAY_SHARE = 0.005  # once a size's window is full (REPLAY_REQUESTS requests, NUM_BATCHES batches), its replays
# take at most 0.5% of its closed batches' time: while they have taken more, its drafted batches are not replayed (a
# recheck always is), and the engine learns nothing from them either (spec/adaptive.py). A replay costs about 1 ms of
# numpy at 2 requests, 1.2-1.5% of a batch there (default workload), so about one batch in 3 is replayed; at 256
# requests 25 ms of 3-4 s. Not before the window is full: throttled from the start, a benchmark's 27 batches of 2 left
# 9 in the window, and adaptive verification offered K = 4 where 8 wins


class Replay(NamedTuple):
    """A drafted closed batch's replays: its requests, its seconds at K = 0, 1, .. less the drafter's prompt prefill,
    and that prefill as measured (spec/batch_replay.py)."""
    num_reqs: int
    seconds: list[float]
    prefill: float


class ClosedBatchSchedule:
    """Per batch size, whether closed batches draft, and the K they offer every request (module docstring)."""

    def __init__(self):
        self._replays: dict[int, deque[Replay]] = {}  # log2 batch size -> its last drafted batches' replays
        self._batch_seconds: dict[int, float] = {}  # its closed batches' seconds
        self._replay_seconds: dict[int, float] = {}  # its replays' seconds
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

    def records(self, num_reqs: int) -> bool:
        """Whether the next closed batch of num_reqs requests is replayed if it drafts: until its size's window is
        full, and at a recheck, always; then while the size's replays have taken at most REPLAY_SHARE of its closed
        batches' time. The engine learns only from the batches this records (spec/adaptive.py: `learns`)."""
        size = num_reqs.bit_length()
        replays = self._replays.get(size)
        if not replays or not drafting_wins(replays) or not _is_full(replays):
            return True
        return self._replay_seconds.get(size, 0.0) <= REPLAY_SHARE * self._batch_seconds.get(size, 0.0)

    def observe(self, lengths: list[int], max_lengths: list[int], records: list[RequestAcceptance],
                timing: BatchTiming, costs: StepCostModel, k_limit: int) -> None:
        """One finished closed batch: each request's completion length, the most it had room for, and its acceptance
        record, the run's timing, and the most drafts per request it could have been allowed (the config's or the
        schedule's K)."""
        if not lengths or timing.num_steps < 2:
            return
        size = len(lengths).bit_length()
        recorded = self.records(len(lengths))  # as the engine read it when the batch started
        self._batch_seconds[size] = self._batch_seconds.get(size, 0.0) + timing.seconds
        if not k_limit or not any(record.num_draft_tokens for record in records):
            self._since_drafted[size] = self._since_drafted.get(size, 0) + 1
            return
        self._since_drafted[size] = 0
        if not recorded:
            return  # the replays have had their share of the size's time
        replays = self._replays.setdefault(size, deque())
        paid = not replays or drafting_wins(replays)
        start = time.perf_counter()  # the trace is part of the replays' share
        trace = Trace(records, lengths)
        replays.append(Replay(len(lengths), replayed_seconds(lengths, max_lengths, trace, k_limit, timing, costs),
                              prefill_seconds(trace, timing, costs)))
        self._replay_seconds[size] = self._replay_seconds.get(size, 0.0) + time.perf_counter() - start
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
