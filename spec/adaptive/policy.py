"""Adaptive verification: the speculation policy (spec/policy.py) that sizes each request's drafts from the drafter's
confidence and the step costs measured on this hardware, step by step through the whole call: as a GRPO batch
drains from hundreds of rows to its last few long requests, the same rule finds shallow drafts worth verifying in a
full batch (where a verified token costs a fraction of a row's) and deep ones in the tail (where it costs almost
nothing), with no K fixed for the call.

Per step:
1. `draft_limits`, how deep each request drafts, decided depth by depth before the drafter runs. Extending the m rows
   with the best expected next survival costs one draft forward of m rows, D(m), and m more tokens to verify; the
   rows extended are the m that maximise sum(next survival - threshold) - rate x D(m), none where no m makes it
   positive. In a decoding step whose drafting rows are too many for the runner to split attention, a forward also
   widens every row's attention by a query, and pays for that too. A row's next survival is its survival so far times
   the position's acceptance rate (the calibrator's) times its request factor (below). `rate` (expected tokens per
   second) and `threshold` (the survival that pays for one more verified token) are the last allocation's at the
   nearest batch size by powers of 2, raised to this step's rate without drafts where that is higher: pricing time
   below a rate known to be reachable would draft more than pays (Dinkelbach).
2. `select`: every draft ranked by calibrated survival, the best budget verified (spec/adaptive/budget.py).
3. `observe`: the judged drafts teach the calibrator (spec/adaptive/calibration.py) and the request factors, and
   the step's measured times refine the cost model (spec/adaptive/step_cost.py).

Request factors. A drafter can be as sure of its drafts for a prompt it predicts badly as for one it predicts well,
so each request keeps its accepted drafts over their calibrated predictions (from a prior of 2 drafts as predicted,
fading by 0.8 a step, so that a request that stopped getting drafts drifts back and is tried again). Below 0.8 the
ratio scales the request's calibrated values; above it they stand, as a well-predicted request's ratio wanders by
chance and compounded over several drafts would trim drafts that pay.

Verification is unchanged and lossless: with point proposals every emitted token follows the target's distribution
whatever drafts are offered, so choosing them from the drafts' confidences costs nothing in exactness.
"""

import itertools
import operator

from spec.adaptive.budget import choose_budget
from spec.adaptive.calibration import ConfidenceCalibrator
from spec.adaptive.step_cost import StepCostModel
from spec.model_runner import splits_attention
from spec.policy import DraftPlan, StepInfo, StepOutcome
from spec.proposers.base import Proposal

_REQUEST_PRIOR = 2.0  # a request's factor starts as if 2 drafts had been accepted as predicted
_REQUEST_TOLERANCE = 0.8  # a request's factor counts only below this ratio of accepted to predicted drafts
_REQUEST_MEMORY = 0.8  # per step, the weight of a request's earlier outcomes
_EXPLORE_STEPS = 32  # after 32 steps without a verified draft, every row drafts and verifies a first draft: the
# calibrator learns only from verified drafts, and a drafter it wrote off (bad first steps, or one that got better
# since: a refresh, a prompt's history) would otherwise never be tried again; at most one step in 32
_OBSERVE_BATCH = 64  # judged drafts handed to the calibrator at once (or 1/16 of those it has, if more): an update
# costs a few hundred microseconds whatever its size, and the map moves little in that many


class AdaptivePolicy:
    """costs: the step-cost model (set before the first step); refine: learn it from the measured step times (off
    for a table the user supplied)."""

    def __init__(self, calibrator: ConfidenceCalibrator, costs: StepCostModel | None = None, refine: bool = True):
        self.calibrator = calibrator
        self.costs = costs
        self.refine = refine
        self.rate = 0.0  # expected tokens per second of the last allocation; 0 before one (draft up to k_max)
        self.threshold = 0.0  # survival that pays for one more verified token there
        self._by_batch_size: dict[int, tuple[float, float]] = {}  # log2 batch size -> (rate, threshold) there
        self._shape = None  # this step's VerifyShape
        self._num_drafting = 0  # rows given a first draft this step
        self._requests: dict[int, list[float]] = {}  # request -> [drafts accepted, calibrated predictions, the step
        # they were last updated at]; fading is applied when they are next read
        self._step = 0  # steps observed
        self._last_drafted = 0  # the last step that verified a draft
        self._is_exploring = False  # this step drafts and verifies a first draft for every row (_EXPLORE_STEPS)
        self._forward_prices: tuple[float, list[float]] = (0.0, [])  # rate x D(m) for m = 1, 2, .., and that rate

    def begin_run(self) -> None:
        self._requests.clear()

    def end_run(self) -> None:
        self._requests.clear()  # the run's requests are done

    def draft_limits(self, step: StepInfo) -> DraftPlan:
        self._price(step)
        self._is_exploring = self._step - self._last_drafted >= _EXPLORE_STEPS
        if self._is_exploring:
            return DraftPlan([min(1, most) for most in step.max_drafts], step.k_max)
        return DraftPlan(self._depths(step), step.k_max)

    def select(self, step: StepInfo, proposal: Proposal, draft_seconds: float) -> list[int]:
        if self._is_exploring:
            self._is_exploring = False
            return proposal.num_draft_tokens
        if self._shape is None or self._shape.num_reqs != step.num_reqs:
            self._shape = self.costs.verify_shape(step.num_reqs)
        survival = self.survival(step.req_ids, proposal.confidence)
        budget = choose_budget(survival, step.num_uncached, draft_seconds, self._shape.cost)
        if step.is_decoding:  # a step that prefills prompts runs at a one-off rate, not the rollout's
            self.rate, self.threshold = budget.rate, budget.threshold
            self._by_batch_size[step.num_reqs.bit_length()] = (budget.rate, budget.threshold)
        return budget.lengths

    def observe(self, step: StepInfo, outcome: StepOutcome) -> None:
        verified = outcome.verified
        self._step += 1
        if any(verified.num_draft_tokens):
            self._last_drafted = self._step
        self._judge(step.req_ids, verified.confidence, outcome.num_accepted)
        if self.refine:
            self._refine(step, verified, outcome.verify_seconds)

    def stats(self) -> dict:
        self.calibrator.flush()
        return {"calibration_error": self.calibrator.calibration_error(),
                "raw_calibration_error": self.calibrator.calibration_error("raw"),
                "num_calibration_observations": self.calibrator.num_observations}

    def _price(self, step: StepInfo) -> None:
        """This step's rate and threshold (module docstring), and its verify shape."""
        num_reqs = step.num_reqs
        self._shape, self._num_drafting = self.costs.verify_shape(num_reqs), 0
        bucket = num_reqs.bit_length()
        near = min(self._by_batch_size, key=lambda b: (abs(b - bucket), -b), default=None)
        rate, threshold = (self.rate, self.threshold) if near is None else self._by_batch_size[near]
        plain = num_reqs / self.costs.verify_cost(num_reqs, sum(step.num_uncached))
        if rate and plain > rate:
            rate, threshold = plain, threshold * plain / rate
        self.rate, self.threshold = rate, threshold

    def _depths(self, step: StepInfo) -> list[int]:
        """Drafts per row: depth by depth, the rows whose next draft pays for a forward (module docstring). A
        drafter without forwards to pay for (n-gram, suffix: no draft cost table) drafts up to each row's most."""
        if not self.rate or self.costs.draft is None:
            return list(step.max_drafts)
        acceptance_rate = self.calibrator.acceptance_rate
        factors = [self._factor(req_id) for req_id in step.req_ids]
        depths, survival = [0] * step.num_reqs, [1.0] * step.num_reqs
        rows = [row for row, most in enumerate(step.max_drafts) if most]
        for depth in range(max(step.max_drafts, default=0)):
            rate = acceptance_rate(depth)
            rows = self._worth_a_forward({row: survival[row] * rate * factors[row] for row in rows}, depth,
                                         step.is_decoding)
            for row in rows:
                survival[row] *= rate * factors[row]
                depths[row] += 1
            if depth == 0:
                self._num_drafting = len(rows)
            rows = [row for row in rows if depths[row] < step.max_drafts[row]]
            if not rows:
                break
        return depths

    def _worth_a_forward(self, next_survival: dict[int, float], depth: int, is_decoding: bool) -> list[int]:
        """The rows one more draft forward extends: of those above the threshold, the best m by next survival that
        maximise their gain over the forward's price (each further row adds less, and the forward only gets dearer)."""
        threshold = self.threshold
        candidates = sorted((row for row, value in next_survival.items() if value > threshold),
                            key=next_survival.__getitem__, reverse=True)
        best, best_net, gain = 0, 0.0, 0.0
        prices = self._step_prices(len(candidates), depth, is_decoding) if candidates else []
        for m, (row, price) in enumerate(zip(candidates, prices), start=1):
            gain += next_survival[row] - threshold
            if gain - price > best_net:
                best, best_net = m, gain - price
        return candidates[:best]

    def _step_prices(self, max_rows: int, depth: int, is_decoding: bool) -> list[float]:
        """What extending m = 1 .. max_rows rows to depth + 1 drafts costs, in tokens: a draft forward, and in a
        decoding step whose drafting rows are too many for the runner to split attention, the query it adds to every
        row's attention (spec/adaptive/step_cost.py)."""
        prices = self._prices(max_rows)[:max_rows]
        if not is_decoding:  # prompts set the width
            return prices
        shape = self._shape
        if depth and splits_attention(shape.num_reqs, self._num_drafting):
            return prices
        widening = self.rate * max(shape.width_cost(depth + 2) - shape.width_cost(depth + 1)
                                   - shape.per_token * shape.num_reqs, 0.0)
        if depth:
            return [price + widening for price in prices]
        return [price + (0.0 if splits_attention(shape.num_reqs, m) else widening)
                for m, price in enumerate(prices, start=1)]

    def _prices(self, max_rows: int) -> list[float]:
        """rate x D(m) for m = 1 .. max_rows (at least), computed once per rate and draft-cost refinement."""
        rate, prices = self._forward_prices
        if rate != self.rate or len(prices) < max_rows:
            prices = [self.rate * cost for cost in self.costs.draft_forward_costs(max_rows)]
            self._forward_prices = (self.rate, prices)
        return prices

    def survival(self, req_ids: list[int], confidences: list[list[float]]) -> list[list[float]]:
        """Per row, S(r, k) for k = 1 .. len(confidences[r]): the running products of its drafts' calibrated values,
        each scaled by the request's factor."""
        factors = [self._factor(req_id) for req_id in req_ids]
        return [list(itertools.accumulate((value * factor for value in self.calibrator.values(conf)), operator.mul))
                for factor, conf in zip(factors, confidences)]

    def _judge(self, req_ids: list[int], confidences: list[list[float]], num_accepted: list[int]) -> None:
        """Verified drafts and how many of each row's were accepted; drafts after a rejection are unjudged."""
        rows = [row for row, conf in enumerate(confidences) if conf]
        judged = [min(num_accepted[row] + 1, len(confidences[row])) for row in rows]
        for row, count in zip(rows, judged):
            self.calibrator.add(range(count), confidences[row][:count],
                                [True] * num_accepted[row] + [False] * (count - num_accepted[row]))  # 0 or 1 False
        for row, count in zip(rows, judged):
            accepted_before, predicted_before = self._faded(req_ids[row])
            predicted = sum(self.calibrator.values(confidences[row][:count]))
            self._requests[req_ids[row]] = [accepted_before + num_accepted[row], predicted_before + predicted,
                                            self._step]
        if self.calibrator.num_pending >= max(_OBSERVE_BATCH, self.calibrator.num_observations // 16):
            self.calibrator.flush()

    def _refine(self, step: StepInfo, verified: Proposal, verify_seconds: float) -> None:
        """The step's measured verification and draft forwards teach the cost model. A step that prefills a prompt
        does not refine the verify curve: a prompt costs more per token than decoding."""
        drafts = verified.num_draft_tokens
        if step.is_decoding:
            self.costs.observe_verify(step.num_reqs, step.num_reqs + sum(drafts), 1 + max(drafts, default=0),
                                      sum(n > 0 for n in drafts), verify_seconds)
        forwards = verified.forward_seconds or []
        self.costs.observe_draft([rows for rows, _ in forwards], [seconds for _, seconds in forwards])
        self._forward_prices = (0.0, [])  # the draft costs moved

    def _factor(self, req_id: int) -> float:
        """The request's accepted drafts over their calibrated predictions, from the prior (module docstring)."""
        if req_id not in self._requests:
            return 1.0
        accepted, predicted = self._faded(req_id)
        ratio = (accepted + _REQUEST_PRIOR) / (predicted + _REQUEST_PRIOR)
        return min(1.0, ratio / _REQUEST_TOLERANCE)

    def _faded(self, req_id: int) -> tuple[float, float]:
        """The request's accepted drafts and calibrated predictions, faded by _REQUEST_MEMORY for every step observed
        since they were last updated ((0, 0) without a record)."""
        record = self._requests.get(req_id)
        if record is None:
            return 0.0, 0.0
        fade = _REQUEST_MEMORY ** (self._step - record[2])
        return fade * record[0], fade * record[1]

