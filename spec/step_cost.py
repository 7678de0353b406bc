"""The step-cost model: seconds that one engine step spends drafting and verifying, on this hardware.

verify_cost(num_reqs, num_tokens): the target forward over `num_tokens` flattened tokens from `num_reqs` rows
    (plus what the step does per verified token: rejection sampling, commit). Table: per num_reqs grid point,
    seconds at a few token counts; linear interpolation in num_tokens (extrapolated along the last segment),
    then in num_reqs.
draft_cost(num_reqs): one draft-model forward over `num_reqs` rows (one token each). Model-free drafters
    (n-gram, suffix) have no draft table: their cost is 0 here and their Python time shows up in the verify
    cells through online refinement.

Every cost is > 0 and non-decreasing in num_tokens (verify) and in num_reqs (draft): a table that breaks this is a
ValueError; measured tables are projected onto it (spec/cost_profile.py). `observe_*` refine the curves that
produced a prediction from the step times the engine measures: each observation moves the points around its size
by a tenth of the (bounded) error, so the model learns what the profile misses (per-step bookkeeping, a noisy or
stale profile) in level and in slope where the engine actually runs; the slopes decide the budget.
"""

import bisect
import json
from dataclasses import dataclass

import numpy as np


FIELD = "step_costs"
_REFINE_RATE = 0.1  # weight of one observed step time in a cell's running estimate
_MAX_RATIO = 2.0  # one observation counts at most as if it took 2x (or 0x) the prediction: a step stalled by
# another process or a garbage collection must not undo what many steps measured
_MIN_SECONDS = 1e-6


class _Curve:
    """One cost curve: seconds at increasing sizes, piecewise-linear between them, extended along its last segment
    (and flat below the first). The engine reads and refines curves every step, mostly one size at a time: that is
    plain Python (`at`, `learn`); arrays of sizes go through numpy."""

    def __init__(self, points: dict[int, float]):
        self.xs = [float(x) for x in points]
        self.ys = [float(y) for y in points.values()]
        self._arrays = None  # (xs, ys) as numpy arrays, rebuilt after a change

    def at(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if x >= xs[-1]:
            return ys[-1] + (self._slope() * (x - xs[-1]) if len(xs) > 1 else 0.0)
        i = bisect.bisect_right(xs, x)
        if i == 0:
            return ys[0]
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])

    def __call__(self, x):
        if self._arrays is None:
            self._arrays = np.array(self.xs), np.array(self.ys)
        xs, ys = self._arrays
        y = np.interp(x, xs, ys)
        return np.where(x > xs[-1], ys[-1] + self._slope() * (x - xs[-1]), y) if len(xs) > 1 else y

    def _slope(self) -> float:
        return (self.ys[-1] - self.ys[-2]) / (self.xs[-1] - self.xs[-2])

    def learn(self, x: float, delta: float) -> None:
        """Move the curve by delta seconds at size x: the two points around x in proportion to their interpolation
        weights (past either end, the end segment as a whole), then kept non-decreasing. Observed steps so correct the
        profile's level and slope where the engine runs, and leave the rest as measured."""
        xs, ys = self.xs, self.ys
        i = bisect.bisect_left(xs, x)
        if i == 0:
            ys[0] += delta
        elif i == len(xs):
            ys[-1] += delta
            if len(xs) > 1:
                ys[-2] += delta
        else:
            upper = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            step = delta / ((1 - upper) ** 2 + upper ** 2)  # so that the curve at x moves by exactly delta
            ys[i - 1] += (1 - upper) * step
            ys[i] += upper * step
        floor = _MIN_SECONDS
        for j, y in enumerate(ys):  # a point lowered below a smaller size's cost is held at it
            floor = ys[j] = max(y, floor)
        self._arrays = None

    def to_dict(self) -> dict[int, float]:
        return {int(x): float(y) for x, y in zip(self.xs, self.ys)}


@dataclass
class StepCostModel:
    verify: dict[int, dict[int, float]]  # num_reqs -> {num_tokens: seconds}
    draft: dict[int, float] | None = None  # num_reqs -> seconds per draft forward; None: model-free drafter

    def __post_init__(self):
        self.verify = {n: _Curve(c) for n, c in _parse_verify(self.verify).items()}  # num_reqs -> curve
        self.draft = None if self.draft is None else _Curve(_parse_curve(self.draft, f"{FIELD}['draft']"))
        self._reqs = sorted(self.verify)

    @classmethod
    def from_dict(cls, table: dict) -> "StepCostModel":
        if not isinstance(table, dict) or "verify" not in table or set(table) - {"verify", "draft"}:
            got = sorted(table) if isinstance(table, dict) else table
            raise ValueError(f"{FIELD}: expected {{'verify': {{num_reqs: {{num_tokens: seconds}}}}, 'draft': "
                             f"{{num_reqs: seconds}}}} (draft optional); got keys {got!r}")
        return cls(table["verify"], table.get("draft"))

    @classmethod
    def load(cls, path: str) -> "StepCostModel":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict:
        return {"verify": {n: curve.to_dict() for n, curve in self.verify.items()},
                "draft": None if self.draft is None else self.draft.to_dict()}

    def verify_cost(self, num_reqs: int, num_tokens) -> np.ndarray:
        """Seconds for each entry of num_tokens (scalar or array) at num_reqs rows."""
        (low, high), weight = self._bracket(num_reqs)
        num_tokens = np.asarray(num_tokens, dtype=np.float64)
        if weight == 0.0:
            return self.verify[low](num_tokens)
        return (1 - weight) * self.verify[low](num_tokens) + weight * self.verify[high](num_tokens)

    def draft_cost(self, rows_per_forward) -> float:
        """Seconds for draft forwards with the given numbers of rows (one entry per forward)."""
        return float(self.draft_forward_costs(rows_per_forward).sum())

    def draft_forward_costs(self, num_rows) -> np.ndarray:
        """Seconds of one draft forward for each entry of num_rows (zeros for a model-free drafter)."""
        num_rows = np.asarray(num_rows, dtype=np.float64)
        return np.zeros_like(num_rows) if self.draft is None else self.draft(num_rows)

    def observe_verify(self, num_reqs: int, num_tokens: int, seconds: float) -> None:
        (low, high), weight = self._bracket(num_reqs)
        predicted = (1 - weight) * self.verify[low].at(num_tokens) + weight * self.verify[high].at(num_tokens)
        delta = _bounded(seconds, predicted)
        for n, share in ((low, 1 - weight), (high, weight)):
            if share > 0:
                self.verify[n].learn(num_tokens, _REFINE_RATE * share * delta)

    def observe_draft(self, num_rows: list[int], seconds: list[float]) -> None:
        """Measured draft forwards (rows and seconds of each): one refinement step at their mean size."""
        if self.draft is not None and num_rows:
            deltas = [_bounded(s, self.draft.at(n)) for n, s in zip(num_rows, seconds)]
            self.draft.learn(sum(num_rows) / len(num_rows), _REFINE_RATE * sum(deltas) / len(deltas))

    def _bracket(self, num_reqs: int) -> tuple[tuple[int, int], float]:
        """The two grid num_reqs around num_reqs and the interpolation weight of the upper one."""
        i = bisect.bisect_left(self._reqs, num_reqs)
        if i == 0 or i == len(self._reqs):
            n = self._reqs[min(i, len(self._reqs) - 1)]
            return (n, n), 0.0
        low, high = self._reqs[i - 1], self._reqs[i]
        return (low, high), (num_reqs - low) / (high - low)


def _bounded(observed: float, predicted: float) -> float:
    """observed - predicted, at most (_MAX_RATIO - 1) x predicted either way."""
    limit = (_MAX_RATIO - 1) * predicted
    return min(max(observed - predicted, -limit), limit)


def _parse_verify(table) -> dict[int, dict[int, float]]:
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{FIELD}['verify']={table!r}: expected a non-empty {{num_reqs: {{num_tokens: seconds}}}}")
    return {n: _parse_curve(curve, f"{FIELD}['verify'][{n}]")
            for n, curve in sorted(((_positive_int(n, f"{FIELD}['verify']"), c) for n, c in table.items()))}


def _parse_curve(curve, field: str) -> dict[int, float]:
    """{x: seconds} sorted by x, every cost > 0 and non-decreasing in x; ValueError naming the field otherwise."""
    if not isinstance(curve, dict) or not curve:
        raise ValueError(f"{field}={curve!r}: expected a non-empty {{size: seconds}} table")
    points = sorted((_positive_int(x, field), float(seconds)) for x, seconds in curve.items())
    for x, seconds in points:
        if not seconds > 0:
            raise ValueError(f"{field}: cost {seconds!r} at {x} is not positive; costs are seconds > 0 "
                             "(re-measure, or drop the entry)")
    for (x0, s0), (x1, s1) in zip(points, points[1:]):
        if s1 < s0:
            raise ValueError(f"{field}: cost falls from {s0:g} s at {x0} to {s1:g} s at {x1}; a cost table must "
                             "be non-decreasing in size (re-measure, or take the running maximum)")
    return dict(points)


def _positive_int(value, field: str) -> int:
    try:
        number = int(value)  # JSON object keys arrive as strings
    except (TypeError, ValueError):
        number = 0
    if number < 1 or str(number) != str(value).strip():
        raise ValueError(f"{field}: key {value!r} is not a positive integer size")
    return number
