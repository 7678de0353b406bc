"""Adaptive verification: the per-step policy that joins calibration, the cost model and the allocation.

Per step the engine (1) lets the drafter propose up to k_max drafts per request, with `keep_drafting` telling
a draft model to stop extending a request whose calibrated survival has fallen below the previous step's
`draft_floor`: the survival a further draft needs to pay for its verification (spec/budget.py's threshold) and
for its row's share of one more draft forward; (2) calls `allocate`, which
ranks every draft by calibrated survival and returns how many each request verifies; (3) after verification,
`observe` feeds the judged drafts back into the calibrator. Verification itself is unchanged and lossless:
for point proposals (q one-hot at the draft) every emitted token follows the target's distribution whatever
drafts are offered, so choosing the offer from the drafts' confidences costs nothing in exactness.
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
        self.draft_floor = 0.0  # from the last allocation; 0 (draft up to k_max) until one happened

    def keep_drafting(self, confidences: list[list[float]]) -> list[bool]:
        """Per request (raw confidences of its drafts so far): is one more draft worth producing?"""
        if not self.draft_floor:
            return [True] * len(confidences)
        return [bool(s[-1] >= self.draft_floor) for s in self.calibrator.survival(confidences)]

    def allocate(self, confidences: list[list[float]], num_fixed_tokens: int) -> Budget:
        """Drafts to verify per request, given each request's raw draft confidences (already capped at k_max)."""
        num_reqs = len(confidences)
        budget = choose_budget(self.calibrator.survival(confidences), num_fixed_tokens,
                               self.costs.draft_cost(rows_per_draft_forward([len(c) for c in confidences])),
                               lambda num_tokens: self.costs.verify_cost(num_reqs, num_tokens))
        self.draft_floor = budget.threshold + budget.rate * self.costs.draft_cost([num_reqs]) / num_reqs
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
