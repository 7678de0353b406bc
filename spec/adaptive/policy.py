"""Adaptive verification: the speculation policy (spec/policy.py) that sizes each request's drafts from the drafter's
confidence and the step costs the engine has run, on either engine (vLLM's workers learn each step's outcome one call
late: rollout/vllm_backend/late_outcomes.py). The schedule's K at the live batch size caps each request's drafts.

Per step:
1. `draft_limits`: how deep each request drafts. A drafter without forwards of its own drafts up to its cap; for one
   with forwards (the draft model), depth by depth, the m rows with the best expected next survival are extended
   where sum(next survival - threshold) - rate x D(m) > 0, `rate` and `threshold` being the last allocation's at the
   nearest batch size by powers of 2 (raised to this step's rate without drafts where that is higher).
2. `select`: every draft ranked by calibrated survival, the budget that maximises expected tokens per second
   verified (spec/adaptive/budget.py), priced by the step-cost fit (spec/adaptive/step_fit.py).
3. `observe`: judged drafts teach the calibrator (calibration.py) and the request factors (request_factors.py, a
   prompt's drafts can be as confident as another's and worse); step times teach the fit (prefill steps do not).

Exploration: before a batch size has a fit, the verified depth steps through K, K - 1, .., K - 3 (else no cost per
draft could be fitted); after _EXPLORE_STEPS steps at a size without a verified draft, one step there verifies every
row's first draft, so a size whose first fit priced drafts too dearly can draft again. Verification is unchanged and
lossless: with point proposals the emitted tokens do not depend on which drafts are offered.
"""

import itertools

import numpy as np

from spec.adaptive.budget import choose_budget
from spec.adaptive.calibration import ConfidenceCalibrator
from spec.adaptive.request_factors import RequestFactors
from spec.adaptive.step_fit import Padding, StepFit, StepPrice
from spec.policy import DraftPlan, StepInfo, StepOutcome
from spec.proposers.base import Proposal

_EXPLORE_STEPS = 32  # at most one step in 33 at a batch size verifies first drafts that the policy wrote off
_UNFITTED_DEPTHS = 4  # verified depths stepped through before any fit: K, K - 1, K - 2, K - 3
_CUT_MARGIN = 0.03  # every draft is verified where that is within this share of the best allocation's rate
_JUDGE_STEPS = 4  # steps whose outcomes reach the calibrator and the request factors at once
_OBSERVE_BATCH = 64  # judged drafts handed to the calibrator at once (or 1/16 of those it has, if more): an update
# costs a few hundred microseconds whatever its size, and the map moves little in that many


class AdaptivePolicy:
    """max_positions: the most drafts a request gets (the config's K); the calibrator pools deeper positions with the
    last. padding: the engine's padded query slots of a forward (spec/adaptive/step_fit.py; None: it pads none)."""

    def __init__(self, max_positions: int, padding: Padding | None = None):
        self.calibrator = ConfidenceCalibrator(max_positions=max(max_positions, 1))
        self.costs = StepFit(padding)
        self.rate = 0.0  # expected tokens per second of the last allocation; 0 before one (draft up to the cap)
        self.threshold = 0.0  # survival that pays for one more verified token there
        self._allocations: dict[int, tuple] = {}  # log2 batch size -> (rate, threshold, widest row's drafts) of
        # the last allocation there
        self._unjudged: list[tuple] = []  # (req_ids, verified confidences, num_accepted) of the steps since a judge
        self._price: StepPrice | None = None  # this step's
        self.factors = RequestFactors()
        self._step = 0  # steps observed
        self._undrafted: dict[int, int] = {}  # log2 batch size -> steps there since one verified a draft
        self._num_unfitted = 0  # steps chosen without a fit
        self._is_exploring = False  # this step verifies a first draft for every row (_EXPLORE_STEPS)

    def begin_run(self) -> None:
        self.factors.clear()

    def end_run(self) -> None:
        self.factors.clear()  # the run's requests are done

    def draft_limits(self, step: StepInfo) -> DraftPlan:
        self._is_exploring = self._undrafted.get(step.num_reqs.bit_length(), 0) >= _EXPLORE_STEPS
        self._price = self.costs.price(step.num_reqs)
        if self._is_exploring:
            return DraftPlan([min(1, most) for most in step.max_drafts], step.k_max)
        if self._price is None:
            depth = max(self.calibrator.max_positions - self._num_unfitted % _UNFITTED_DEPTHS, 0)
            self._num_unfitted += 1
            return DraftPlan([min(most, depth) for most in step.max_drafts], step.k_max)
        if not self.costs.has_forwards:  # a model-free drafter: up to 2 deeper than the last allocation verified
            last = self._allocations.get(step.num_reqs.bit_length())
            depth = step.k_max if last is None else last[2] + 2
            return DraftPlan([min(most, depth) for most in step.max_drafts], step.k_max)
        self._set_rate(step)
        return DraftPlan(self._depths(step), step.k_max)

    def select(self, step: StepInfo, proposal: Proposal, draft_seconds: float) -> list[int]:
        price = self._price
        if self._is_exploring or price is None:
            return proposal.num_draft_tokens
        uncached = step.num_uncached
        fixed = draft_seconds + price.cost(sum(uncached), max(uncached), sum(u > 1 for u in uncached))
        per_padded = price.per_padded if step.is_decoding else 0.0  # prompts set a prefilling step's width
        budget = choose_budget(self.survival(step.req_ids, proposal.confidence), fixed, price.per_token, per_padded,
                               _CUT_MARGIN)
        if step.is_decoding:  # a step that prefills prompts runs at a one-off rate, not the rollout's
            self.rate, self.threshold = budget.rate, budget.threshold
            self._allocations[step.num_reqs.bit_length()] = (budget.rate, budget.threshold, budget.width)
        return budget.lengths

    def observe(self, step: StepInfo, outcome: StepOutcome) -> None:
        """What the step verified and found; outcome.seconds None: its time is unknown (it did other work too)."""
        verified = outcome.verified
        self._step += 1
        bucket = step.num_reqs.bit_length()
        self._undrafted[bucket] = 0 if any(verified.num_draft_tokens) else self._undrafted.get(bucket, 0) + 1
        self._unjudged.append((step.req_ids, verified.confidence, outcome.num_accepted))
        if len(self._unjudged) >= _JUDGE_STEPS:
            self._judge()
        if step.is_decoding and outcome.seconds is not None:
            widths = [1 + n for n in verified.num_draft_tokens]
            self.costs.observe_step(widths, outcome.seconds - outcome.draft_seconds)
        self.costs.observe_forwards(verified.forward_seconds or [])

    def stats(self) -> dict:
        self._judge()
        self.calibrator.flush()
        return {"calibration_error": self.calibrator.calibration_error(),
                "raw_calibration_error": self.calibrator.calibration_error("raw"),
                "num_calibration_observations": self.calibrator.num_observations}

    def survival(self, req_ids: list[int], confidences: list[list[float]]) -> list[list[float]]:
        """Every draft's S(r, k), per request: the running product of its calibrated values up to it, each scaled by
        the request's factor. Plain Python (spec/adaptive/request_factors.py says why)."""
        table, num_bins = self.calibrator.table_rows, self.calibrator.num_bins
        longest = max(map(len, confidences), default=0)
        rows = table + table[-1:] * (longest - len(table))  # positions past the calibrator's last pool with it
        survival = []
        for conf, factor in zip(confidences, self.factors.factors(req_ids, self._step)):
            value, values = 1.0, []
            for row, raw in zip(rows, conf):  # raw confidences lie in [0, 1]
                value *= row[int(raw * num_bins)] * factor
                values.append(value)
            survival.append(values)
        return survival

    def _set_rate(self, step: StepInfo) -> None:
        """This step's rate and threshold (module docstring)."""
        bucket = step.num_reqs.bit_length()
        near = min(self._allocations, key=lambda b: (abs(b - bucket), -b), default=None)
        rate, threshold = (self.rate, self.threshold) if near is None else self._allocations[near][:2]
        uncached = step.num_uncached
        plain = step.num_reqs / self._price.cost(sum(uncached), max(uncached), sum(u > 1 for u in uncached))
        if rate and plain > rate:
            rate, threshold = plain, threshold * plain / rate
        self.rate, self.threshold = rate, threshold

    def _depths(self, step: StepInfo) -> list[int]:
        """Drafts per row: depth by depth, the rows whose next draft pays for a forward (module docstring)."""
        if not self.rate:
            return list(step.max_drafts)
        acceptance_rate = self.calibrator.acceptance_rate
        factors = self.factors.factors(step.req_ids, self._step)
        forward_costs = self.costs.forward_costs(step.num_reqs)
        depths, survival = [0] * step.num_reqs, [1.0] * step.num_reqs
        rows, num_drafting = [row for row, most in enumerate(step.max_drafts) if most], 0
        for depth in range(max(step.max_drafts, default=0)):
            rate = acceptance_rate(depth)
            next_survival = {row: survival[row] * rate * factors[row] for row in rows}
            wide = (step.num_reqs + sum(depths), num_drafting)  # tokens and rows wider than one before this depth
            rows = self._worth_a_forward(next_survival, forward_costs, step, depth, wide)
            for row in rows:
                survival[row], depths[row] = next_survival[row], depths[row] + 1
            num_drafting = num_drafting or len(rows)
            rows = [row for row in rows if depths[row] < step.max_drafts[row]]
            if not rows:
                break
        return depths

    def _worth_a_forward(self, next_survival: dict[int, float], forward_costs: list[float], step: StepInfo,
                         depth: int, wide: tuple[int, int]) -> list[int]:
        """The rows one more draft forward extends: of those above the threshold, the best m by next survival that
        maximise their gain over the forward's price in tokens (each further row adds less)."""
        threshold = self.threshold
        candidates = sorted((row for row, value in next_survival.items() if value > threshold),
                            key=next_survival.__getitem__, reverse=True)
        best, best_net, gain = 0, 0.0, 0.0
        for m, row in enumerate(candidates, start=1):
            gain += next_survival[row] - threshold
            net = gain - self.rate * (forward_costs[m - 1] + self._padding_cost(step, depth, wide, m))
            if net > best_net:
                best, best_net = m, net
        return candidates[:best]

    def _padding_cost(self, step: StepInfo, depth: int, wide: tuple[int, int], m: int) -> float:
        """Seconds of the query slots by which extending m rows to depth + 1 drafts pads the other rows (none in a
        step that prefills: its prompts set the width); wide: (tokens, rows wider than one) before."""
        price = self._price
        if not step.is_decoding or price.padding is None:
            return 0.0
        (num_tokens, num_wide), num_reqs = wide, step.num_reqs
        before = price.padding(num_reqs, num_tokens, depth + 1, num_wide)
        after = price.padding(num_reqs, num_tokens + m, depth + 2, max(m, num_wide))
        return price.per_padded * max(after - before, 0)

    def _judge(self) -> None:
        """The verified drafts of the steps since the last judge and how many of each row's were accepted (None:
        unknown); drafts after a rejection are unjudged. The request factors add each request's outcomes as of now."""
        if not self._unjudged:
            return
        req_ids = [req_id for ids, _, _ in self._unjudged for req_id in ids]
        confidences = [conf for _, step, _ in self._unjudged for conf in step]
        accepted = np.array([-1 if n is None else n for _, _, step in self._unjudged for n in step], dtype=np.int64)
        self._unjudged = []
        judged = np.minimum(accepted + 1, [len(conf) for conf in confidences])  # per row: accepted, then 0 or 1 not
        owner = np.repeat(np.arange(len(judged)), judged)
        position = np.arange(len(owner)) - (np.cumsum(judged) - judged)[owner]
        raw = np.fromiter(itertools.chain.from_iterable(conf[:n] for conf, n in zip(confidences, judged.tolist())),
                          float, len(owner))
        self.calibrator.add(position, raw, position < accepted[owner])
        predicted = np.bincount(owner, self.calibrator.calibrated(position, raw), len(judged))
        rows = np.flatnonzero(judged).tolist()
        self.factors.add([req_ids[row] for row in rows], accepted[rows].tolist(), predicted[rows].tolist(), self._step)
        if self.calibrator.num_pending >= max(_OBSERVE_BATCH, self.calibrator.num_observations // 16):
            self.calibrator.flush()
