"""Adaptive verification for an engine seen from its drafter: vLLM runs this project's drafters through its
custom_class hook (rollout/vllm_backend/proposer.py), which returns each step's drafts and learns what became of them,
and what the step cost, only at the next call. `ObservedPolicy` chooses per request how many of the drafter's drafts
to return, from their calibrated survival and the step costs it learns from the time between calls.

Cost. vLLM verifies every row's tokens flattened into one forward (no padding to the widest row), so a step costs
a + c x R + b x D seconds for R rows verifying D drafts: c is what a row costs whatever it verifies (its token, and
vLLM's per-request scheduling, sampling and output handling), b what one more draft costs. Fitting one slope per
token instead (a + b x (R + D)) let b absorb the per-row cost, since steps with more rows verify more drafts too, and
priced drafts at several times their cost. a, c and b are fitted per batch size (by powers of 2) by least squares
over that size's steps, older steps fading by _MEMORY a step, b held >= 0. Until a size has a fit (steps at
_MIN_SPREAD or more distinct draft counts), the nearest fitted size's serves; with none, drafts are returned up to a
depth that steps through K, K - 1, .., K - _MIN_SPREAD + 1 (otherwise a drafter that always fills K would verify
the same draft count every step, and no cost per draft could be fitted).

Allocation. S(r, k), the running product of request r's calibrated confidences (ConfidenceCalibrator), ranks the
drafts; choose_budget (budget.py) returns the prefix lengths that maximise expected tokens per second, with cost
a + c x R + b x D and the drafter's own time this step as the draft cost.

Outcomes. A request given L drafts that is back at the next call with s new tokens accepted s - 1 of them: drafts
0 .. s - 2 accepted, draft s - 1 (when < L) rejected, the rest unjudged. Requests that finished in between are not
judged (a stop may have cut their last step).

Exploration. After _EXPLORE_STEPS steps without a returned draft, one step returns every request's first draft: the
calibrator learns only from verified drafts, and a drafter written off early (or one that got better since: a
prompt's history) would otherwise never be tried again.

Verification stays lossless: vLLM verifies point drafts, and which prefix is offered changes only the speed.
"""

import itertools
import operator

import numpy as np

from spec.adaptive.budget import choose_budget, every_draft_pays
from spec.adaptive.calibration import ConfidenceCalibrator

_MEMORY = 0.95  # per fitted step, the weight of a size's earlier steps: the fit follows its last ~20
_MIN_SPREAD = 4  # distinct draft counts a size's steps must span before its fit is used
_EXPLORE_STEPS = 32
_OBSERVE_EVERY = 8  # steps whose outcomes reach the calibrator in one update: its numpy update costs per call about
# as much as the rest of a 64-row step's policy, and it refits its maps only as outcomes grow by 2% anyway


class _StepFit:
    """seconds = a + c x rows + b x drafts, by exponentially weighted least squares."""

    def __init__(self):
        self.moments = np.zeros((3, 3))  # sum of w x x^T, x = (1, rows, drafts)
        self.targets = np.zeros(3)  # sum of w x seconds
        self.draft_counts: set[int] = set()
        self._solution = None  # (a, c, b), solved at the first use after an add

    def add(self, rows: int, drafts: int, seconds: float) -> None:
        x = np.array([1.0, rows, drafts])
        self.moments = _MEMORY * self.moments + np.outer(x, x)
        self.targets = _MEMORY * self.targets + x * seconds
        self._solution = None
        if len(self.draft_counts) < _MIN_SPREAD:
            self.draft_counts.add(drafts)

    @property
    def is_ready(self) -> bool:
        return len(self.draft_counts) >= _MIN_SPREAD

    def costs(self, rows: int) -> tuple[float, float]:
        """(seconds of a step of `rows` rows without drafts, seconds a draft). Minimum-norm least squares: where
        a size's steps all had the same rows, a and c are not separable, and only a + c x rows is used."""
        if self._solution is None:
            self._solution = np.linalg.lstsq(self.moments, self.targets, rcond=None)[0].tolist()
        a, c, b = self._solution
        return max(a + c * rows, 1e-6), max(b, 0.0)  # a step costs something: rates stay finite


class ObservedPolicy:
    """max_positions: the most drafts a request gets (K); the calibrator pools deeper positions with the last."""

    def __init__(self, max_positions: int):
        self.calibrator = ConfidenceCalibrator(max_positions=max(max_positions, 1))
        self._fits: dict[int, _StepFit] = {}  # batch size's bit length -> its cost fit
        self._returned: dict = {}  # request -> raw confidences of the drafts returned last step
        self._num_pending_steps = 0  # steps whose outcomes the calibrator holds, not yet observed
        self._steps_without_drafts = 0
        self._num_unfitted = 0  # steps chosen without a fit

    def observe(self, new_tokens: dict, step_seconds: float | None) -> None:
        """What became of last step's drafts: new_tokens[request] = tokens it gained since (a request missing has
        finished), and the seconds of the step that verified them (None where it also prefilled requests)."""
        num_drafts = 0
        for request, confidences in self._returned.items():
            gained = new_tokens.get(request)
            if gained is None:
                continue
            num_drafts += len(confidences)
            judged = min(gained, len(confidences))  # accepted gained - 1, plus the first rejected if any
            self.calibrator.add(range(judged), confidences[:judged], [j < gained - 1 for j in range(judged)])
        self._num_pending_steps += 1
        if self._num_pending_steps >= _OBSERVE_EVERY:
            self.calibrator.flush()
            self._num_pending_steps = 0
        num_rows = sum(request in new_tokens for request in self._returned)
        if step_seconds is not None and num_rows == len(new_tokens) and num_rows:
            self._fits.setdefault(num_rows.bit_length(), _StepFit()).add(num_rows, num_drafts, step_seconds)

    def choose(self, requests: list, confidences: list[list[float]], draft_seconds: float) -> list[int]:
        """Drafts to return per request (a prefix of each request's), given their raw confidences."""
        fit = self._fit(len(requests))
        if self._steps_without_drafts >= _EXPLORE_STEPS:
            lengths = [min(1, len(c)) for c in confidences]
        elif fit is None:
            depth = max(self.calibrator.max_positions - self._num_unfitted % _MIN_SPREAD, 0)
            self._num_unfitted += 1
            lengths = [min(len(c), depth) for c in confidences]
        else:
            num_rows = len(requests)
            base, per_draft = fit.costs(num_rows)
            values = self.calibrator.values
            survival = [list(itertools.accumulate(values(conf), operator.mul)) for conf in confidences]
            if every_draft_pays(survival, draft_seconds + base, per_draft):  # the common case, without a sort
                lengths = [len(conf) for conf in confidences]
            else:
                lengths = choose_budget(survival, [1] * num_rows, draft_seconds,
                                        lambda tokens, width, num_wide: base + per_draft * (tokens - num_rows)).lengths
        self._steps_without_drafts = 0 if any(lengths) else self._steps_without_drafts + 1
        self._returned = {request: conf[:n] for request, conf, n in zip(requests, confidences, lengths)}
        return lengths

    def _fit(self, num_rows: int) -> _StepFit | None:
        """The fit at this batch size's power of 2, else the nearest ready one."""
        bucket = num_rows.bit_length()
        ready = [b for b, fit in self._fits.items() if fit.is_ready]
        near = min(ready, key=lambda b: (abs(b - bucket), -b), default=None)
        return None if near is None else self._fits[near]
