"""The step-cost model: seconds that one engine step spends drafting and verifying, on this hardware.

verify_cost(num_reqs, num_tokens): the target forward over `num_tokens` flattened tokens from `num_reqs` rows
    (plus what the step does per verified token: rejection sampling, commit). Table: per num_reqs grid point,
    seconds at a few token counts; linear interpolation in num_tokens (extrapolated along the last segment),
    then in num_reqs.
draft_cost(num_reqs): one draft-model forward over `num_reqs` rows (one token each). Model-free drafters
    (n-gram, suffix) have no draft table: their cost is 0 here and their Python time shows up in the verify
    cells through online refinement.

Every cost is > 0 and non-decreasing in num_tokens (verify) and in num_reqs (draft): a table that breaks this is a
ValueError; measured tables are projected onto it by isotonic regression. `observe_*` refine the cells that
produced a prediction from the step times the engine measures (multiplicative, exponentially weighted).
"""

import json
from dataclasses import dataclass

import numpy as np

from spec.monotone import isotonic

FIELD = "step_costs"
_REFINE_RATE = 0.1  # weight of one observed step time in a cell's running estimate


@dataclass
class StepCostModel:
    verify: dict[int, dict[int, float]]  # num_reqs -> {num_tokens: seconds}
    draft: dict[int, float] | None = None  # num_reqs -> seconds per draft forward; None: model-free drafter

    def __post_init__(self):
        self.verify = _parse_verify(self.verify)
        self.draft = None if self.draft is None else _parse_curve(self.draft, f"{FIELD}['draft']")
        self._reqs = np.array(sorted(self.verify), dtype=np.float64)

    @classmethod
    def from_dict(cls, table: dict) -> "StepCostModel":
        if not isinstance(table, dict) or "verify" not in table or set(table) - {"verify", "draft"}:
            raise ValueError(f"{FIELD}: expected {{'verify': {{num_reqs: {{num_tokens: seconds}}}}, 'draft': "
                             f"{{num_reqs: seconds}}}} (draft optional); got keys {sorted(table) if isinstance(table, dict) else table!r}")
        return cls(table["verify"], table.get("draft"))

    @classmethod
    def load(cls, path: str) -> "StepCostModel":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict:
        return {"verify": {n: dict(curve) for n, curve in self.verify.items()},
                "draft": None if self.draft is None else dict(self.draft)}

    def verify_cost(self, num_reqs: int, num_tokens) -> np.ndarray:
        """Seconds for each entry of num_tokens (scalar or array) at num_reqs rows."""
        (low, high), weight = self._bracket(num_reqs)
        num_tokens = np.asarray(num_tokens, dtype=np.float64)
        return (1 - weight) * _interp(self.verify[low], num_tokens) + weight * _interp(self.verify[high], num_tokens)

    def draft_cost(self, rows_per_forward) -> float:
        """Seconds for draft forwards with the given numbers of rows (one entry per forward)."""
        if self.draft is None or not len(rows_per_forward):
            return 0.0
        return float(_interp(self.draft, np.asarray(rows_per_forward, dtype=np.float64)).sum())

    def observe_verify(self, num_reqs: int, num_tokens: int, seconds: float) -> None:
        (low, high), weight = self._bracket(num_reqs)
        ratio = seconds / float(self.verify_cost(num_reqs, num_tokens))
        for n, share in ((low, 1 - weight), (high, weight)):
            if share > 0:
                _refine(self.verify[n], num_tokens, ratio, share)

    def observe_draft(self, num_reqs: int, seconds_per_forward: float) -> None:
        if self.draft is not None:
            _refine(self.draft, num_reqs, seconds_per_forward / self.draft_cost([num_reqs]), 1.0)

    def _bracket(self, num_reqs: int) -> tuple[tuple[int, int], float]:
        """The two grid num_reqs around num_reqs and the interpolation weight of the upper one."""
        i = int(np.searchsorted(self._reqs, num_reqs))
        if i == 0 or i == len(self._reqs):
            n = int(self._reqs[min(i, len(self._reqs) - 1)])
            return (n, n), 0.0
        low, high = int(self._reqs[i - 1]), int(self._reqs[i])
        return (low, high), (num_reqs - low) / (high - low)


def rows_per_draft_forward(num_drafts: list[int]) -> list[int]:
    """Rows in each sequential draft-model forward when request i drafts num_drafts[i] tokens."""
    return [sum(n > j for n in num_drafts) for j in range(max(num_drafts, default=0))]


def _interp(curve: dict[int, float], x: np.ndarray) -> np.ndarray:
    """Piecewise-linear through the curve's points, extended along its last segment (and flat below the first)."""
    xs = np.fromiter(curve, dtype=np.float64)
    ys = np.fromiter(curve.values(), dtype=np.float64)
    y = np.interp(x, xs, ys)
    if len(xs) > 1:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        y = np.where(x > xs[-1], ys[-1] + slope * (x - xs[-1]), y)
    return y


def _refine(curve: dict[int, float], x: float, ratio: float, share: float) -> None:
    """Scale the (at most two) points around x towards the observed/predicted ratio, then restore monotonicity."""
    xs = list(curve)
    i = int(np.searchsorted(xs, x))
    if i == 0 or i == len(xs):
        neighbours = {xs[min(i, len(xs) - 1)]: 1.0}
    else:
        w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        neighbours = {xs[i - 1]: 1 - w, xs[i]: w}
    for point, w in neighbours.items():
        curve[point] *= 1 + _REFINE_RATE * share * w * (ratio - 1)
    for point, value in zip(xs, isotonic(list(curve.values()))):
        curve[point] = float(value)


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
