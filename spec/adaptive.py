"""Adaptive verification: the per-step policy that joins calibration, the cost model and the allocation.

Per step the engine (1) lets the drafter propose up to k_max drafts per request, with `keep_drafting` deciding,
before each further draft-model forward, which requests it extends (below); (2) calls `allocate`, which ranks
every draft by calibrated survival and returns how many each request verifies (spec/budget.py); (3) after
verification, `observe` feeds the judged drafts back into the calibrator. Verification itself is unchanged and
lossless: for point proposals (q one-hot at the draft) every emitted token follows the target's distribution
whatever drafts are offered, so choosing the offer from the drafts' confidences costs nothing in exactness.

Drafting further. Extending the m requests with the best expected next survival costs one draft forward of m rows,
D(m), and then m more tokens to verify. With the last allocation's rate (tokens per second) and threshold (the
survival that pays for one verified token), extending them is worth rate x D(m) seconds' worth of tokens against
sum over those m of (next survival - threshold); the drafter extends the m that maximise the difference, or none
when no m makes it positive. The next survival is estimated as the current survival times the request's last
calibrated confidence. A forward of a few rows costs about as much as one of many, so a lone confident request
keeps drafting only while its own expected tokens pay for a whole forward.
"""

import numpy as np

from spec.budget import Budget, choose_budget
from spec.calibration import ConfidenceCalibrator
from spec.step_cost import StepCostModel, rows_per_draft_forward

CONFIDENCE_FALLBACKS = ("acceptance_rate",)


class AdaptiveVerifier:
    def __init__(self, calibrator: ConfidenceCalibrator, costs: StepCostModel | None = None, refine: bool = True):
        self.calibrator = calibrator
        self.costs = costs  # set before the first step (the generator profiles it once runners exist)
        self.refine = refine  # refine the costs from measured step times (off for a table the user supplied)
        self.rate = 0.0  # expected tokens per second of the last allocation; 0 (draft up to k_max) before one
        self.threshold = 0.0  # survival that pays for one more verified token, at the last allocation

    def keep_drafting(self, confidences: list[list[float]]) -> list[bool]:
        """Per request (raw confidences of its drafts so far): does it get one more draft?"""
        if not self.rate:
            return [True] * len(confidences)
        survival = np.array([s[-1] for s in self.calibrator.survival(confidences)])  # [n]
        last = self.calibrator.calibrate(np.array([len(c) - 1 for c in confidences]),
                                         np.array([c[-1] for c in confidences]))  # [n]
        next_survival = survival * last
        order = np.argsort(-next_survival, kind="stable")
        draft_seconds = self.costs.draft_forward_costs(np.arange(1, len(order) + 1))  # [n]: D(m)
        net = np.cumsum(next_survival[order] - self.threshold) - self.rate * draft_seconds  # [n]: extend the top m
        keep = np.zeros(len(order), dtype=bool)
        best = int(np.argmax(net))
        if net[best] > 0:
            keep[order[:best + 1]] = True
        return keep.tolist()

    def allocate(self, confidences: list[list[float]], num_fixed_tokens: int) -> Budget:
        """Drafts to verify per request, given each request's raw draft confidences (already capped at k_max)."""
        num_reqs = len(confidences)
        budget = choose_budget(self.calibrator.survival(confidences), num_fixed_tokens,
                               self.costs.draft_cost(rows_per_draft_forward([len(c) for c in confidences])),
                               lambda num_tokens: self.costs.verify_cost(num_reqs, num_tokens))
        self.rate, self.threshold = budget.rate, budget.threshold
        return budget

    def observe(self, confidences: list[list[float]], num_accepted: list[int]) -> None:
        """Verified drafts and how many of each request's were accepted; drafts after a rejection are unjudged."""
        positions, raw, accepted = [], [], []
        for conf, n in zip(confidences, num_accepted):
            judged = min(n + 1, len(conf))
            positions.extend(range(judged))
            raw.extend(conf[:judged])
            accepted.extend(j < n for j in range(judged))
        self.calibrator.observe(np.array(positions, dtype=np.int64), np.array(raw), np.array(accepted, dtype=bool))

    def observe_times(self, num_reqs: int, num_verified_tokens: int, verify_seconds: float,
                      rows_per_draft_forward: list[int], draft_seconds: float) -> None:
        """Measured seconds of one step's verification (forward, sampling, commit) and drafting."""
        if not self.refine:
            return
        self.costs.observe_verify(num_reqs, num_verified_tokens, verify_seconds)
        if rows_per_draft_forward:
            self.costs.observe_draft(rows_per_draft_forward[0], draft_seconds / len(rows_per_draft_forward))

    def stats(self) -> dict:
        return {"calibration_error": self.calibrator.calibration_error(),
                "raw_calibration_error": self.calibrator.calibration_error("raw"),
                "num_calibration_observations": self.calibrator.num_observations}
