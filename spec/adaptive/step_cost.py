"""The step-cost model: seconds that one engine step spends drafting and verifying, on this hardware.

verify_cost(num_reqs, num_tokens): the target forward over `num_tokens` flattened tokens from `num_reqs` rows
    (plus what the step does per verified token: rejection sampling, commit), every row the same width. Table: per
    num_reqs grid point, seconds at a few token counts (1, 2, .. tokens per row); linear interpolation in
    num_tokens (extrapolated along the last segment), then in num_reqs at the same tokens per row.
verify_shape(num_reqs).cost(num_tokens, width, num_wide): the same forward with rows of different widths. The ragged
    runner pads attention's queries to the widest row's (spec/model_runner.py), so a row verifying 8 drafts costs
    every row 9 queries there, while its linear layers cost per token. So a step of rows at most `width` wide costs
    what `width` tokens in every row cost, less the per-token cost (table field `verify_per_token`, seconds per
    token at a fixed width) of the tokens it is short of that; where at most an eighth of the rows are wide, the
    runner splits attention instead, and the step costs one token per row plus the per-token cost of the rest.
draft_cost(num_reqs): one draft-model forward over `num_reqs` rows (one token each). Model-free drafters
    (n-gram, suffix) have no draft table: their cost is 0 here and their Python time shows up in the verify
    cells through online refinement.

Every cost is > 0 and non-decreasing in num_tokens (verify) and in num_reqs (draft): a table that breaks this is a
ValueError; measured tables are projected onto it (spec/adaptive/cost_profile.py). `observe_*` refine the curves that
produced a prediction from the step times the engine measures: each curve keeps its measured shape and learns a
scale from them (_Curve), so the model follows the machine's speed where the engine actually runs (a profile taken in
a slow or a fast spell, the engine's own per-step work) and stays as smooth as the profile: the slopes decide the
budget.
"""

import bisect
import itertools
import json
import math
from dataclasses import dataclass

from spec.model_runner import splits_attention


FIELD = "step_costs"
_MEMORY = 0.99  # per observation, the weight of a curve's earlier observations: it follows the last ~100
_PRIOR_WEIGHT = 1.0  # each measured table point counts as one observation of its cost
_MAX_RATIO = 1.5  # one observation counts at most as if it took 1.5x (or 0.5x) the prediction: a step stalled by
# another process or a garbage collection must not undo what many steps measured


class _Curve:
    """One cost curve: a measured shape p (seconds at increasing sizes, piecewise-linear between them, extended along
    its last segment and flat below the first), scaled by what the engine observes: cost(x) = scale x p(x). Plain
    Python: the engine reads and refines curves every step, between forwards, where numpy's per-call overhead would
    dwarf the arithmetic.

    Refinement is a least-squares fit of the one scale to the observed step times, older ones fading by _MEMORY per
    observation, with the measured table itself as a prior (each point one observation of its own cost). One
    parameter, not a level as well: the engine observes a curve over a narrow band of sizes, where a level and a scale
    trade off and a fitted level drifts; a common scale changes no allocation, a wrong level does. The shape must
    therefore be right, hence the profile's interleaved repeats (spec/adaptive/cost_profile.py)."""

    def __init__(self, points: dict[int, float], per_token: float | None = None):
        self.xs = [float(x) for x in points]
        self.ys = [float(y) for y in points.values()]  # the shape p
        # Seconds per token at a fixed padded width, part of the shape (scaled with it); without a measurement the
        # shape's least slope, so that widening a row never costs less than a token
        self.per_token = min((self._slope(i) for i in range(1, len(self.xs))), default=0.0) if per_token is None \
            else float(per_token)
        self.scale = 1.0
        self._prior = _PRIOR_WEIGHT * sum(y * y for y in self.ys)  # sum p^2 = sum p y over the prior's points
        self._observed = [0.0, 0.0]  # faded sums of p y and p^2 over observations

    def shape(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if x >= xs[-1]:
            return ys[-1] + self._slope() * (x - xs[-1])
        i = bisect.bisect_right(xs, x)
        if i == 0:
            return ys[0]
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])

    def at(self, x: float) -> float:
        return self.scale * self.shape(x)

    def run(self, first: float, step: float, count: int, weight: float = 1.0) -> list[float]:
        """weight x the costs at sizes first, first + step, .., count of them (step > 0): within a segment of the
        shape they are an arithmetic progression, summed at C speed (drafting decisions read one per row count, up
        to max_num_seqs, before each draft forward)."""
        xs, ys, costs = self.xs, self.ys, []
        scale = weight * self.scale
        while len(costs) < count:
            x = first + len(costs) * step
            i = bisect.bisect_right(xs, x)  # x lies in [xs[i - 1], xs[i])
            if i == len(xs):  # the last segment, extended: the rest of the run
                end = count
            else:  # sizes below xs[i]; the shape is continuous, so one that rounding puts across is still right
                end = min(count, max(len(costs) + 1, -int(-(xs[i] - first) // step)))
            slope = 0.0 if i == 0 else self._slope(min(i, len(xs) - 1))
            costs.extend(itertools.accumulate(itertools.repeat(scale * slope * step, end - len(costs) - 1),
                                              initial=scale * self.shape(x)))
        return costs

    def _slope(self, i: int = -1) -> float:
        """The shape's slope on segment i (from xs[i - 1] to xs[i]); the last by default, 0 with one point."""
        if len(self.xs) == 1:
            return 0.0
        i %= len(self.xs)
        return (self.ys[i] - self.ys[i - 1]) / (self.xs[i] - self.xs[i - 1])

    def padded(self, rows: float, num_tokens: float, width: int, split: bool) -> float:
        """The shape's cost of a step of `rows` rows, num_tokens tokens, the widest `width` (module docstring)."""
        return _padded(lambda w: self.shape(rows * w), self.per_token, rows, num_tokens, width, split)

    def learn(self, p: float, seconds: float, weight: float = 1.0) -> None:
        """One observed cost of a step whose shape cost is p (weight: its share, for a step between two curves),
        then the refit."""
        stats = self._observed
        stats[0] = _MEMORY * stats[0] + weight * p * seconds
        stats[1] = _MEMORY * stats[1] + weight * p * p
        self.scale = (self._prior + stats[0]) / (self._prior + stats[1])  # > 0, as the prior's sums are

    def to_dict(self) -> dict[int, float]:
        return {int(x): self.scale * y for x, y in zip(self.xs, self.ys)}


class VerifyShape:
    """The verify cost of one step's allocations at num_reqs rows (StepCostModel.verify_shape): read once per step,
    then O(1) per candidate allocation."""

    def __init__(self, model: "StepCostModel", num_reqs: int):
        self.num_reqs = num_reqs
        self._bracket = model._bracket(num_reqs)
        self._curves = model.verify
        # per_token: seconds per token at a fixed width, the bracketing curves' read at the same tokens per row
        self.per_token = sum(share * factor * self._curves[n].scale * self._curves[n].per_token
                             for n, share, factor in self._bracket)
        self._widths = [0.0]  # _widths[w]: seconds of w tokens in every row

    def width_cost(self, width: int) -> float:
        while len(self._widths) <= width:
            w = len(self._widths)
            self._widths.append(sum(share * self._curves[n].at(n * w) for n, share, _ in self._bracket))
        return self._widths[width]

    def cost(self, num_tokens: int, width: int, num_wide: int) -> float:
        """Seconds to verify num_tokens tokens, the widest row `width` tokens, num_wide rows wider than one."""
        return _padded(self.width_cost, self.per_token, self.num_reqs, num_tokens, width,
                       splits_attention(self.num_reqs, num_wide))


def _padded(width_cost, per_token: float, rows: float, num_tokens: float, width: int, split: bool) -> float:
    """A step's cost from width_cost(w), the cost of w tokens in every row (module docstring): split, one token per
    row plus the rest at the per-token cost; else the widest row's width in every row, less the tokens short of it."""
    if split:
        return width_cost(1) + per_token * (num_tokens - rows)
    return width_cost(width) - per_token * (rows * width - num_tokens)


@dataclass
class StepCostModel:
    verify: dict[int, dict[int, float]]  # num_reqs -> {num_tokens: seconds}
    draft: dict[int, float] | None = None  # num_reqs -> seconds per draft forward; None: model-free drafter
    verify_per_token: dict[int, float] | None = None  # num_reqs -> seconds per token at a fixed width; None (or a
    # num_reqs missing): the verify curve's least slope

    def __post_init__(self):
        per_token = _parse_per_token(self.verify_per_token, self.verify)
        self.verify = {n: _Curve(c, per_token.get(n)) for n, c in _parse_verify(self.verify).items()}
        self.draft = None if self.draft is None else _Curve(_parse_curve(self.draft, f"{FIELD}['draft']"))
        self._reqs = sorted(self.verify)

    @classmethod
    def from_dict(cls, table: dict) -> "StepCostModel":
        if not isinstance(table, dict) or "verify" not in table or set(table) - {"verify", "draft", "verify_per_token"}:
            got = sorted(table) if isinstance(table, dict) else table
            raise ValueError(f"{FIELD}: expected {{'verify': {{num_reqs: {{num_tokens: seconds}}}}, 'draft': "
                             f"{{num_reqs: seconds}}, 'verify_per_token': {{num_reqs: seconds}}}} (draft and "
                             f"verify_per_token optional); got keys {got!r}")
        return cls(table["verify"], table.get("draft"), table.get("verify_per_token"))

    @classmethod
    def load(cls, path: str) -> "StepCostModel":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict:
        return {"verify": {n: curve.to_dict() for n, curve in self.verify.items()},
                "draft": None if self.draft is None else self.draft.to_dict(),
                "verify_per_token": {n: curve.scale * curve.per_token for n, curve in self.verify.items()}}

    def verify_shape(self, num_reqs: int) -> VerifyShape:
        return VerifyShape(self, num_reqs)

    def verify_cost(self, num_reqs: int, num_tokens: float) -> float:
        """Seconds to verify num_tokens tokens at num_reqs rows."""
        return sum(share * self.verify[n].at(num_tokens * factor) for n, share, factor in self._bracket(num_reqs))

    def step_seconds(self, batch_size: int, k: int) -> float:
        """A decoding step with K drafts per row: K draft forwards of B rows and one verification of B (K + 1) tokens
        (the embedded engine's step, for spec/tuning.py)."""
        return self.draft_cost([batch_size] * k) + self.verify_cost(batch_size, batch_size * (k + 1))

    def draft_cost(self, rows_per_forward) -> float:
        """Seconds for draft forwards with the given numbers of rows (one entry per forward)."""
        return 0.0 if self.draft is None else sum(self.draft.at(n) for n in rows_per_forward)

    def draft_forward_costs(self, max_rows: int) -> list[float]:
        """Seconds of one draft forward of 1, 2, .., max_rows rows (zeros for a model-free drafter)."""
        return [0.0] * max_rows if self.draft is None else self.draft.run(1, 1, max_rows)

    def observe_verify(self, num_reqs: int, num_tokens: int, width: int, num_wide: int, seconds: float) -> None:
        """A measured step: num_tokens tokens from num_reqs rows, the widest `width`, num_wide rows wider than one."""
        split = splits_attention(num_reqs, num_wide)
        shapes = [(n, share, self.verify[n].padded(n, num_tokens * factor, width, split))
                  for n, share, factor in self._bracket(num_reqs)]
        delta = _bounded(seconds, sum(share * self.verify[n].scale * p for n, share, p in shapes))
        for n, share, p in shapes:  # each curve is told its own cost plus the step's error
            self.verify[n].learn(p, self.verify[n].scale * p + delta, share)

    def observe_draft(self, num_rows: list[int], seconds: list[float]) -> None:
        """Measured draft forwards: the rows and seconds of each."""
        if self.draft is not None:
            for n, s in zip(num_rows, seconds):
                predicted = self.draft.at(n)
                self.draft.learn(self.draft.shape(n), predicted + _bounded(s, predicted))

    def _bracket(self, num_reqs: int) -> list[tuple[int, float, float]]:
        """The grid num_reqs around num_reqs: (num_reqs there, interpolation weight, token factor). Between two
        grid points, each curve is read at the same tokens per row (n tokens at 126 rows are read as 128 at 128
        rows, not as 126, below anything measured there); beyond the grid, the nearest curve at the same tokens."""
        i = bisect.bisect_left(self._reqs, num_reqs)
        if i == 0 or i == len(self._reqs):
            return [(self._reqs[min(i, len(self._reqs) - 1)], 1.0, 1.0)]
        low, high = self._reqs[i - 1], self._reqs[i]
        if num_reqs == high:
            return [(high, 1.0, 1.0)]
        weight = (num_reqs - low) / (high - low)
        return [(low, 1 - weight, low / num_reqs), (high, weight, high / num_reqs)]


def _bounded(observed: float, predicted: float) -> float:
    """observed - predicted, at most (_MAX_RATIO - 1) x predicted either way."""
    limit = (_MAX_RATIO - 1) * predicted
    return min(max(observed - predicted, -limit), limit)


def _parse_verify(table) -> dict[int, dict[int, float]]:
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{FIELD}['verify']={table!r}: expected a non-empty {{num_reqs: {{num_tokens: seconds}}}}")
    return {n: _parse_curve(curve, f"{FIELD}['verify'][{n}]")
            for n, curve in sorted(((_positive_int(n, f"{FIELD}['verify']"), c) for n, c in table.items()))}


def _parse_per_token(table, verify) -> dict[int, float]:
    """{num_reqs: seconds per token}, each >= 0 and at most the verify curve's least slope there (a wider row must
    not cost less than its tokens); {} for None."""
    field = f"{FIELD}['verify_per_token']"
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise ValueError(f"{field}={table!r}: expected {{num_reqs: seconds per token}}")
    curves = _parse_verify(verify)
    parsed = {}
    for key, seconds in table.items():
        n = _positive_int(key, field)
        if n not in curves:
            raise ValueError(f"{field}: num_reqs {n} has no verify curve (have {sorted(curves)}); drop it or "
                             "measure that curve")
        if not isinstance(seconds, (int, float)) or not seconds >= 0:
            raise ValueError(f"{field}[{n}]={seconds!r}: a per-token cost must be seconds >= 0")
        points = sorted(curves[n].items())
        least = min(((s1 - s0) / (x1 - x0) for (x0, s0), (x1, s1) in zip(points, points[1:])), default=math.inf)
        if seconds > least * (1 + 1e-9):
            raise ValueError(f"{field}[{n}]={seconds:g} s exceeds the verify curve's least slope there ({least:g} s "
                             "per token): a row padded wider would cost less than its tokens; re-measure, or take "
                             "the least slope")
        parsed[n] = float(seconds)
    return parsed


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
