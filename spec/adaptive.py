"""Adaptive verification: the per-step policy that joins calibration, the cost model and the allocation.

Per step the engine (1) lets the drafter propose up to k_max drafts per request, with `keep_drafting` deciding,
before each draft-model forward (the first included), which requests it extends (below); (2) calls `allocate`,
which ranks every draft by calibrated survival and returns how many each request verifies (spec/budget.py); (3) after
verification, `observe` feeds the judged drafts back into the calibrator. Verification itself is unchanged and
lossless: for point proposals (q one-hot at the draft) every emitted token follows the target's distribution
whatever drafts are offered, so choosing the offer from the drafts' confidences costs nothing in exactness.

Drafting further. Extending the m requests with the best expected next survival costs one draft forward of m rows,
D(m), and then m more tokens to verify. With the last allocation's rate (tokens per second) and threshold (the
survival that pays for one verified token), raised to this step's rate without drafts where that is higher (see
begin_step), extending them is worth rate x D(m) seconds' worth of tokens against sum over those m of (next survival
minus threshold); in a decoding step where the m rows are too many for the runner to split attention, each forward
also widens every row's attention by a query, and pays for that too (spec/step_cost.py). The drafter extends the m
that maximise the difference, or none when no m makes it positive. The
next survival is estimated as the current survival times the position's acceptance rate: the next draft's confidence
is not known before the forward, and the last one's is a poor guess (drafts are accepted after an unsure draft far
more often than that draft's confidence). A forward of a few rows costs about as much as one of many, so a lone
confident request keeps drafting only while its own expected tokens pay for a whole forward. The first draft is
decided the same way (survival 1, the first position's rate): where verification is dear and drafts are unsure (a
large batch on a CPU, a request the drafter predicts badly) a step drafts nothing and costs what decoding without
speculation does, instead of a draft forward over every row for drafts it then trims.

Under a closed batch's cap (spec/closed_batch.py) no allocation runs: its replays chose the cap, and deciding the
drafting at the step's rate loses there (the batch waits on its slowest request, and a step's rate counts every
request's tokens alike). Every request gets a first draft, and further drafts are decided as above at one request's rate
on the batch's critical path (begin_step): a draft that does not pay even for the request the batch waits on is not
drafted. Once drafted, each request verifies its first draft, which the cap's replays found paying for every request,
and the further ones whose survival pays for its verification at the batch's rate, the critical path's threshold times
the step's rows (`verified_under_cap`): cut on each draft's own confidence, after drafting, in steps of CUT_MIN_ROWS
(32) rows or more only. Below 32 rows every request's drafts under the cap are verified: there the critical path's
pricing already verified fewer tokens per emitted token than the schedule (benchmark, default workload, 2-16 requests:
1.282-1.308 against 1.299-1.323), and the cut cost speed where it was measured, at most a few percent (benchmark: 0.965
and 0.962 of the best other arm at default 8 and mixed 16, confirmed; cap forced, mixed 16: 0.976 of K = 2 against 0.983
without it), where from 32 rows on its medians were level or ahead (below). Cap forced (the K shown), paired against
static K on the same prompts (medians / totals of 10-50 batches): without the cut, with it, and cutting first drafts
too, then the verified tokens per emitted token of each: default workload, 32 requests (K = 8, 4 batches): 0.999 /
0.995, 1.008 / 1.005 and 1.014 / 1.002, 1.302, 1.165 and 1.144; 128 (K = 4): 1.002 / 0.994, 1.037 / 1.015 and 1.029 /
1.036, 1.184, 1.085 and 1.062; 256 (K = 4): 0.999 / 0.997, 1.015 / 0.971 and 1.071 / 1.040, 1.189, 1.081 and 1.059.
Mixed workload, against K = 2, 8 requests (K = 3): 1.003 / 1.001, 1.004 / 0.994 and 1.004 / 0.994, 1.504, 1.451 and
1.453; 16 (K = 2): 0.983 / 0.976, 0.976 / 0.975 and 0.972 / 0.973, 1.360, 1.326 and 1.313. With the caps from the
replays (K = 3-4), paired against K = 1 at default 128 and 256: 0.983 and 0.980 with the cut, 0.965 and 0.971 without
(medians of 30 and 20 batches). Cutting first drafts too met the verified-work target everywhere in two benchmark runs,
but the adaptive arms read 1-2% lower on the mixed workload (0.956-0.985 of the best other arm at 4-128 requests,
confirmed) than in the runs before it, most at 32-128 requests, where a request is offered 1 draft and this cut has
nothing to cut (the batch waits on the requests the drafter predicts badly, whose tokens come from first drafts: a
likely cause, not shown; paired as above, the two cuts ran level). The per-step policy under the cap (drafting decided
at the batch's rate as well) ran at 0.934 / 0.943 of K = 8 at 4 requests and 0.960 / 0.972 at 16 (default workload).
Before the cut, the pricing of further drafts on the critical path, at 2 requests on the default workload (cap K = 8),
verified 1.232 tokens per emitted token where the cap for every request verified 1.279, in the same time within this
machine's noise (40 batches, each timed against the cap on the same prompts: median 0.97, total 1.005); at 4-64
requests, and 4 on the mixed workload, 0.95-1.03 (30).
Deciding has its own cost, which the cuts must pay: per number of rows, a decision's worth (the time its cuts save,
net of the tokens they lose, at the rate it prices with) and the time it took are tracked, and where the worth falls
short, only every 8th call decides and the others extend every row (_gated_keep). In situ (default workload, cap
K = 4) the decisions then took 0.6 / 0.9 / 2.6 ms of a batch of 2 / 16 / 128 requests, against 1.1 / 2.3 / 9.2, and
cut 3.1% / 0.3% of the rows at 2 / 16 requests (cap K = 8 and 3), against 5.2% / 0.5%.
Learning costs time as well: handing the judged drafts to the calibrator and refining the costs from the step times
took 0.9% of closed batches of 2 requests on the default workload (cap K = 8), 0.6% at 8. A closed batch that its
size's replays do not record (ClosedBatchSchedule.records: once the size's window is full and its replays have had
their share of its time) learns nothing (`learns`), and decides from what the recorded ones taught: at a size run
over and over, what it would have learned itself. At 2 requests, after 60 batches, 28 of 438 steps then refined the
costs, and adaptive verification's own work (decisions, learning, replays) fell from 2.0% to 1.2% of the batches'
time; at 8, from 1.9% to 1.6% (about 2 batches in 5 are replayed there).

Per request. The calibrator maps confidence to acceptance for all requests alike, but a drafter can be as sure of its
drafts for a prompt it predicts badly as for one it predicts well (on the benchmark's mixed workload, drafts with
confidence >= 0.9 are accepted 99.7% of the time on task prompts and 54% on noise). So each running request keeps
its accepted drafts over their calibrated predictions (from a prior of 2 drafts as predicted; older steps fade by
0.8 a step, so a request that stopped getting drafts drifts back and is tried again). Below 0.8 that ratio scales
the request's calibrated values (ratio / 0.8, in its survival and its next-draft estimate); above it they stand: a
well-predicted request's ratio wanders by chance, and compounded over several drafts that would trim drafts that pay.

Costs. The allocation charges the step the drafting time it actually took (measured by the engine); the drafter's
further forwards are charged D(m) from the cost model, whose cost at m rows is refined from the measured time of every
extension (from one `keep_drafting` call to the next: the decision, the forward over the extended rows and their
sampling), so per-forward overhead the profile does not see is learned, and a step's one-off drafting work (its
first forward over the tokens verified last step) is not mistaken for a per-forward cost.
"""

import itertools
import operator
import time

import numpy as np

from spec.budget import Budget, choose_budget
from spec.calibration import ConfidenceCalibrator
from spec.closed_batch import ClosedBatchSchedule
from spec.step_cost import StepCostModel, is_split
from spec.tuning import step_seconds

CONFIDENCE_FALLBACKS = ("acceptance_rate",)
_REQUEST_PRIOR = 2.0  # a request's acceptance factor starts as if 2 drafts had been accepted as predicted
_REQUEST_TOLERANCE = 0.8  # a request's factor counts only below this ratio of accepted to predicted drafts: a
# well-predicted request's own ratio wanders +-10-20% by chance, and compounded over several drafts that would trim
# drafts that pay
_REQUEST_MEMORY = 0.8  # per step: a request's past outcomes fade, so one that got no drafts drifts back to the
# prior and is tried again (a streak of rejections must not end its drafting for good)
_GATE_PERIOD = 8  # under a closed batch's cap, a further-draft decision that has not been paying is still made every
# 8th call (_gated_keep): its measures stay current, and a size where it pays again gets it back within 8 calls
_GATE_MEMORY = 0.9  # per decision made, the weight of the earlier ones in those measures
CUT_MIN_ROWS = 32  # under a closed batch's cap, steps of fewer rows verify every draft drafted (module docstring)
_OBSERVE_BATCH = 64  # judged drafts handed to the calibrator at once (or 1/16 of those it has, if more): an update
# costs a few hundred microseconds in the engine's loop whatever its size, and the map moves little in that many


class _Drafts:
    """One request's drafts this step: raw confidences, calibrated values and survival (scaled by its factor)."""

    def __init__(self, factor: float):
        self.factor = factor
        self.source: list[float] | None = None  # the list last read: a drafter's grow in place within a step
        self.raw: list[float] = []
        self.values: list[float] = []
        self.survival: list[float] = []

    def extend(self, confidences: list[float], value) -> None:
        running = self.survival[-1] if self.survival else 1.0
        for position in range(len(self.raw), len(confidences)):
            raw = confidences[position]
            calibrated = value(position, raw)
            running *= calibrated * self.factor  # both at most 1
            self.raw.append(raw)
            self.values.append(calibrated)
            self.survival.append(running)

    def prefix(self, length: int) -> "_Drafts":
        cut = _Drafts(self.factor)
        cut.raw, cut.values, cut.survival = self.raw[:length], self.values[:length], self.survival[:length]
        return cut


class AdaptiveVerifier:
    def __init__(self, calibrator: ConfidenceCalibrator, costs: StepCostModel | None = None, refine: bool = True):
        self.calibrator = calibrator
        self.costs = costs  # set before the first step (the generator profiles it once runners exist)
        self.refine = refine  # refine the costs from measured step times (off for a table the user supplied)
        self.learns = True  # False in a closed batch that its size's replays do not record: its judged drafts and
        # step times teach neither the calibrator nor the costs (module docstring)
        self.closed_batch = ClosedBatchSchedule()  # whether and how deep closed batches draft, per size
        self.traced = False  # the run is a closed batch that its size's replays record: a draft-model drafter
        # reveals the outcomes at positions that verify no draft (spec/proposers/draft_model.py)
        self.trims = True  # False in a closed batch under its cap: no allocation (each request verifies the drafts
        # that pay at the batch's rate: verified_under_cap), every request gets a first draft, and further drafts are
        # priced on the critical path (begin_step); observe hands the calibrator the judged drafts, and the draft
        # extensions are timed as ever (the closed-batch replays price drafting with the refined costs)
        self.rate = 0.0  # expected tokens per second of the last allocation (under a closed batch's cap, of one
        # request: _price_critical_path); 0 (draft up to k_max) before one
        self.threshold = 0.0  # survival that pays for one more verified token, at the last allocation
        self._by_batch_size: dict[int, tuple[float, float]] = {}  # log2 batch size -> (rate, threshold) there
        self._batch_size_bucket = 0
        self._extension: tuple[int, float] | None = None  # rows the last keep_drafting call extended, and when
        self._extension_times: list[tuple[int, float]] = []  # this step's extensions: (rows, seconds)
        self._judged: tuple[list[int], list[float], list[bool]] = ([], [], [])  # not yet handed to the calibrator
        self._requests: dict[int, list[float]] = {}  # running request -> [drafts accepted, calibrated predictions,
        # the step they were last updated at]; steps without drafts fade them when they are next read or updated
        self._step = 0  # steps observed
        self._forward_prices: tuple[float, list[float]] = (0.0, [])  # rate x D(m), m = 1, 2, .., and that rate
        self._drafts: dict[int, _Drafts] = {}  # this step's drafts per request, calibrated as they come
        self._drafts_version = calibrator.version  # the calibration they were calibrated with
        self._shape = None  # this step's VerifyShape
        self._is_decoding = False  # this step feeds each row one uncached token (no prompt)
        self._num_drafting = 0  # rows given a first draft this step
        self._gates: dict[int, list] = {}  # log2 rows -> _gated_keep's faded worth and time (s) of its decisions
        # there, and the calls it has passed on since the last
        self._num_refinements = 0  # steps whose times refined the costs
        self._priced = None  # what the critical path's rate was last priced for (_price_critical_path)

    def begin_step(self, num_reqs: int, num_uncached: int, k_max: int) -> None:
        """A step of num_reqs requests with num_uncached non-draft tokens and at most k_max drafts per request
        starts: drafting decisions use the rate and threshold of the last allocation at the nearest batch size (by
        powers of 2) where one was made (a draining batch's lone last request runs at a fraction of a full batch's
        rate, and a fresh full batch, whose first step prefills and records none, must not inherit it), or the last
        allocation's before any; but never a rate below this step's without drafts (Dinkelbach: pricing time below
        the best rate known to be reachable drafts more than pays; at 126 rows the last allocation's 4.2 tokens/ms
        against 6 without drafts). Under a closed batch's cap, the critical path's rate (_price_critical_path)."""
        self._drafts = {}
        self._is_decoding, self._num_drafting = num_uncached == num_reqs, 0
        if not self.trims:
            self._price_critical_path(num_reqs, k_max)
            return
        self._shape, self._priced = self.costs.verify_shape(num_reqs), None
        bucket = self._batch_size_bucket = num_reqs.bit_length()
        near = min(self._by_batch_size, key=lambda b: (abs(b - bucket), -b), default=None)
        rate, threshold = (self.rate, self.threshold) if near is None else self._by_batch_size[near]
        plain = num_reqs / self.costs.verify_cost(num_reqs, num_uncached)
        if rate and plain > rate:
            rate, threshold = plain, threshold * plain / rate
        self.rate, self.threshold = rate, threshold

    def _price_critical_path(self, num_reqs: int, k_max: int) -> None:
        """A closed batch is done when its slowest request is, and any request may be that one: a draft is worth its
        request's expected tokens, each worth the time one of that request's tokens takes, the step's time over the
        tokens a request emits per step (not over the batch's, which would price time num_reqs times dearer). So
        under the cap the rate is one request's: at k_max drafts, 1 + the sum of the positions' survivals (the
        calibrator's acceptance rates multiplied) over a decoding step as spec/tuning.py models it (a step that
        prefills prompts is a one-off, as in begin_step). A draft that does not pay at that rate does not pay for
        any request; one that does is not cut, so the requests the batch waits on keep theirs. Priced again only
        where the size, k_max, the calibration or the costs changed since the last step's: in a batch that does not
        learn, once per number of requests."""
        key = (num_reqs, k_max, self.calibrator.version, id(self.costs), self._num_refinements)
        if key == self._priced:
            return
        self._priced, self._shape = key, self.costs.verify_shape(num_reqs)
        rates = (self.calibrator.acceptance_rate(position) for position in range(k_max))
        tokens = 1.0 + sum(itertools.accumulate(rates, operator.mul))
        self.rate = tokens / step_seconds(self.costs, num_reqs, k_max)
        self.threshold = self.rate * self._shape.per_token

    def keep_drafting(self, req_ids: list[int], confidences: list[list[float]]) -> list[bool]:
        """Per request (its id, the raw confidences of its drafts so far, none before the first): does it get one
        more draft?"""
        now = time.perf_counter()
        if self._extension is not None:
            self._extension_times.append((self._extension[0], now - self._extension[1]))
        # The first forward of a step also feeds each row the tokens verified last step: it is not timed as one.
        is_first = bool(confidences) and not confidences[0]
        if self.trims:
            keep = self._keep(req_ids, confidences)[0]
        elif is_first:  # under a closed batch's cap its replays decided that it drafts
            keep, self._num_drafting = [True] * len(confidences), len(confidences)
        else:
            keep = self._gated_keep(req_ids, confidences, now)
        num_kept = sum(keep)
        self._extension = (num_kept, now) if num_kept and not is_first else None
        return keep

    def _gated_keep(self, req_ids: list[int], confidences: list[list[float]], start: float) -> list[bool]:
        """Under a closed batch's cap: _keep, unless its recent decisions at this many rows were worth less than they
        took (then every row is extended, as _keep would have done had it cut nothing), deciding at least every
        _GATE_PERIOD-th call to keep both measures current. A decision is worth the time its cuts save net of the
        tokens they lose, at the rate it prices with (module docstring). At 1-2 requests a cut often saves
        a whole draft forward, hundreds of times what deciding takes; from 32 requests on the default workload it
        cut under 0.3% of the rows at 0.1-0.35 ms a call, 0.6-1% of a batch's time for next to nothing."""
        gate = self._gates.setdefault(len(confidences).bit_length(), [0.0, 0.0, 0])
        value, cost, skipped = gate
        if value < cost and skipped < _GATE_PERIOD - 1:
            gate[2] += 1
            return [True] * len(confidences)
        keep, worth = self._keep(req_ids, confidences)
        gate[0] = (_GATE_MEMORY * value + (1 - _GATE_MEMORY) * worth / self.rate) if self.rate else value
        gate[1] = _GATE_MEMORY * cost + (1 - _GATE_MEMORY) * (time.perf_counter() - start)
        gate[2] = 0
        return keep

    def _keep(self, req_ids: list[int], confidences: list[list[float]]) -> tuple[list[bool], float]:
        """Which rows get one more draft, and under a closed batch's cap what that choice is worth over extending
        every row (tokens, >= 0; 0 where trimming)."""
        if not self.rate:
            return [True] * len(confidences), 0.0
        # Plain Python: this runs before every draft forward, mostly on a few rows.
        rate = self.calibrator.acceptance_rate
        if any(confidences):
            next_survival = [(d.survival[-1] if d.survival else 1.0) * rate(len(d.survival)) * d.factor
                             for d in self._calibrated(req_ids, confidences)]
        else:  # the first draft of every row: at 256 rows, 0.45 ms a step through the general path
            first = rate(0)
            next_survival = [first * self._factor(req_id) for req_id in req_ids]
        # Extending the top m gains sum(next survival - threshold) and costs a forward of m rows; only rows above
        # the threshold can be worth it (each further row adds a loss and the forward only gets dearer).
        threshold = self.threshold
        keep = [False] * len(confidences)
        candidates = sorted((row for row, value in enumerate(next_survival) if value > threshold),
                            key=next_survival.__getitem__, reverse=True)
        best, best_net, gain = 0, 0.0, 0.0
        prices = self._step_prices(len(candidates), confidences) if candidates else []
        for m, (row, price) in enumerate(zip(candidates, prices), start=1):
            gain += next_survival[row] - threshold
            if gain - price > best_net:
                best, best_net = m, gain - price
        for row in candidates[:best]:
            keep[row] = True
        if best and not any(confidences):
            self._num_drafting = best
        if best == len(confidences) or self.trims:  # only a closed batch's gate reads the worth
            return keep, 0.0
        every_row = sum(next_survival) - threshold * len(confidences) - self._step_prices(len(confidences),
                                                                                         confidences)[-1]
        return keep, best_net - every_row

    def _step_prices(self, max_rows: int, confidences: list[list[float]]) -> list[float]:
        """What extending m = 1, 2, .., max_rows rows by one draft costs, in tokens: a draft forward, and in a
        decoding step whose drafting rows are too many for the runner to split attention, the width it adds to every
        row's attention (spec/step_cost.py; at 128 rows a width costs 1.5 ms beyond its tokens, a draft forward of 64
        rows about 2). Each forward extends rows to one more draft than any has, so each widens the step."""
        prices = self._prices(max_rows)[:max_rows]
        if not self._is_decoding:  # prompts set the width
            return prices
        shape, depth = self._shape, max(map(len, confidences), default=0)
        if depth and is_split(shape.num_reqs, self._num_drafting):
            return prices
        widening = self.rate * max(shape.width_cost(depth + 2) - shape.width_cost(depth + 1)
                                   - shape.per_token * shape.num_reqs, 0.0)
        if depth:
            return [p + widening for p in prices]
        return [p + (0.0 if is_split(shape.num_reqs, m) else widening) for m, p in enumerate(prices, start=1)]

    def _prices(self, max_rows: int) -> list[float]:
        """rate x D(m) for m = 1 .. max_rows (at least): a forward's worth in tokens, computed once per rate and
        draft-cost refinement (a step asks before each of its forwards)."""
        rate, prices = self._forward_prices
        if rate != self.rate or len(prices) < max_rows:
            prices = [self.rate * cost for cost in self.costs.draft_forward_costs(max_rows)]
            self._forward_prices = (self.rate, prices)
        return prices

    def allocate(self, req_ids: list[int], confidences: list[list[float]], uncached: list[int],
                 draft_seconds: float) -> Budget:
        """Drafts to verify per request, given the requests' ids, their raw draft confidences (already capped at
        k_max), their tokens other than drafts and the seconds this step's drafting took."""
        num_reqs = len(confidences)
        shape = self._shape if self._shape is not None and self._shape.num_reqs == num_reqs else \
            self.costs.verify_shape(num_reqs)
        budget = choose_budget(self.survival(req_ids, confidences), uncached, draft_seconds, shape.cost)
        if sum(uncached) <= num_reqs:  # a step that prefills prompts runs at a one-off rate: not the rollout's
            self.rate, self.threshold = budget.rate, budget.threshold
            self._by_batch_size[self._batch_size_bucket] = (budget.rate, budget.threshold)
        return budget

    def observe(self, req_ids: list[int], confidences: list[list[float]], num_accepted: list[int]) -> None:
        """Verified drafts and how many of each request's were accepted; drafts after a rejection are unjudged."""
        positions, raw, accepted = self._judged
        self._step += 1
        if not self.learns:
            return
        rows = [row for row, conf in enumerate(confidences) if conf]  # a record without drafts only fades (lazily)
        judged = [min(num_accepted[row] + 1, len(confidences[row])) for row in rows]
        for row, count in zip(rows, judged):
            n = num_accepted[row]
            positions.extend(range(count))
            raw.extend(confidences[row][:count])
            accepted.extend([True] * n + [False] * (count - n))  # count - n: 0 or 1
        if self.trims:  # only trimming reads the factors (a closed batch's requests under its cap end with it)
            ids = [req_ids[row] for row in rows]
            for req_id, row, count, drafts in zip(ids, rows, judged,
                                                  self._calibrated(ids, [confidences[row] for row in rows])):
                accepted_before, predicted_before = self._faded(req_id)
                self._requests[req_id] = [accepted_before + num_accepted[row],
                                          predicted_before + sum(drafts.values[:count]), self._step]
            self._drafts = {}  # the factors changed
        if len(positions) >= max(_OBSERVE_BATCH, self.calibrator.num_observations // 16):
            self._calibrate()

    def finish(self, req_id: int) -> None:
        self._requests.pop(req_id, None)
        self._drafts.pop(req_id, None)

    def cuts_under_cap(self, num_drafts: list[int]) -> bool:
        """Whether a step under a closed batch's cap, its requests drafting num_drafts each, cuts drafts
        (verified_under_cap): where it has CUT_MIN_ROWS rows or more and some request 2 drafts or more (module
        docstring)."""
        return len(num_drafts) >= CUT_MIN_ROWS and max(num_drafts, default=0) > 1

    def verified_under_cap(self, req_ids: list[int], confidences: list[list[float]]) -> list[int]:
        """Under a closed batch's cap: how many of its drafts each request verifies, its first (the cap's replays
        found a first draft for every request paying) and the further ones whose survival pays for their verification
        at the batch's rate, the critical path's threshold times the step's rows (module docstring)."""
        threshold = self.threshold * len(req_ids)
        return [max(min(1, len(drafts.survival)), sum(value >= threshold for value in drafts.survival))
                for drafts in self._calibrated(req_ids, confidences)]

    def survival(self, req_ids: list[int], confidences: list[list[float]]) -> list[list[float]]:
        """Per request, S(r, k) for k = 1 .. len(confidences[r]): the running products of its drafts' calibrated
        values, each scaled by the request's factor (below)."""
        return [d.survival for d in self._calibrated(req_ids, confidences)]

    def _calibrated(self, req_ids: list[int], confidences: list[list[float]]) -> list["_Drafts"]:
        """The requests' drafts calibrated. A step asks about the same drafts several times (before each further
        draft forward, then to allocate and to observe them), so each request's are calibrated once, as they come:
        drafts that extend, or are a prefix of, those already seen reuse them (until the calibration or the
        request's factor changes). The list a drafter passes for a request is the same object from one forward to the
        next, grown by the new drafts: the prefix seen is not compared again."""
        if self._drafts_version != self.calibrator.version:
            self._drafts, self._drafts_version = {}, self.calibrator.version
        cache, calibrated = self._drafts, []
        for req_id, conf in zip(req_ids, confidences):
            drafts = cache.get(req_id)
            if drafts is None or (drafts.source is not conf and drafts.raw != conf[:len(drafts.raw)]):
                if drafts is not None and drafts.raw[:len(conf)] == conf:  # cut at a stop token, or trimmed
                    calibrated.append(drafts.prefix(len(conf)))
                    continue
                drafts = cache[req_id] = _Drafts(self._factor(req_id))
            if len(conf) > len(drafts.raw):
                drafts.extend(conf, self.calibrator.value)
            drafts.source = conf
            calibrated.append(drafts)
        return calibrated

    def _factor(self, req_id: int) -> float:
        """The request's drafts' accepted count over their calibrated predictions (from the prior): the
        calibrator maps a drafter's confidence to acceptance for all requests alike, and a drafter can be as sure
        of its drafts for a prompt it predicts badly as for one it predicts well."""
        if req_id not in self._requests:
            return 1.0
        accepted, predicted = self._faded(req_id)
        ratio = (accepted + _REQUEST_PRIOR) / (predicted + _REQUEST_PRIOR)
        return min(1.0, ratio / _REQUEST_TOLERANCE)

    def _faded(self, req_id: int) -> tuple[float, float]:
        """The request's drafts accepted and calibrated predictions, faded by _REQUEST_MEMORY for every step observed
        since its record was last updated ((0, 0) without one)."""
        record = self._requests.get(req_id)
        if record is None:
            return 0.0, 0.0
        fade = _REQUEST_MEMORY ** (self._step - record[2])
        return fade * record[0], fade * record[1]

    def _calibrate(self) -> None:
        positions, raw, accepted = self._judged
        self.calibrator.observe(np.array(positions, dtype=np.int64), np.array(raw, dtype=np.float64),
                                np.array(accepted, dtype=bool))
        self._judged = ([], [], [])

    def observe_times(self, uncached: list[int], num_drafts: list[int], verify_seconds: float) -> None:
        """Measured seconds of one step's verification (forward, sampling, commit) of each row's uncached tokens
        and drafts; the step's draft extensions were timed by keep_drafting. A step that prefills a prompt (more
        than one uncached token in a row) does not refine the verify curve: a prompt costs more per token than
        decoding, and at 256 rows such steps had tilted the curve to predict 7 ms for a 32 ms step."""
        extensions, self._extension_times = self._extension_times, []
        self._extension = None  # drafting is over: the time from the last extension on is not a forward's
        if not self.refine or not self.learns:
            return
        self._num_refinements += 1
        if sum(uncached) <= len(uncached):
            self.costs.observe_verify(len(uncached), len(uncached) + sum(num_drafts), 1 + max(num_drafts, default=0),
                                      sum(n > 0 for n in num_drafts), verify_seconds)
        self.costs.observe_draft([rows for rows, _ in extensions], [seconds for _, seconds in extensions])
        self._forward_prices = (0.0, [])  # the draft costs moved

    def stats(self) -> dict:
        self._calibrate()
        return {"calibration_error": self.calibrator.calibration_error(),
                "raw_calibration_error": self.calibrator.calibration_error("raw"),
                "num_calibration_observations": self.calibrator.num_observations}
