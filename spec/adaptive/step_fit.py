"""The step-cost model of adaptive verification, fitted online from the steps the engine ran: nothing is profiled.

A step verifies R rows: one token per row, D further tokens (drafts, and a prompt's tokens in a step that prefills)
and, on an engine that pads each row's attention queries to the widest row's, P padded query slots (the engine's
`padding` rule; vLLM flattens the rows and pads none). Outside its drafter it costs seconds = a + c x R + b x D + w x P:
a per step, c per row, b per further token, w per padded slot, fitted per batch size (by powers of 2: a GRPO batch
drains from hundreds of rows to one, and the marginal costs move with the size) by least squares over that size's
steps, older ones fading by _MEMORY a step. A size is used from _MIN_STEPS steps on; until then the nearest one that
is. A drafter with forwards of its own (Proposal.forward_seconds) costs e + f x m a forward of m rows, fitted likewise.

Prior: where a size's steps cannot tell b from c, a further token costs nothing, so drafts are verified and show what
they cost (priced dearly they would go unverified and teach the fit nothing; the schedule's cap bounds how deep free
drafts go); a padded slot costs a token. Reading: 0 <= w <= b <= (a + c R) / R; at R rows a step costs the fit's at its
steps' mean rows plus c for each row more (or less), c held between 0 and that cost over the mean rows (and equal to it
where the steps all had the same rows). Optimism: b and w are read one standard error below their fit, or a size whose
few steps priced drafts too dear would verify none there again and learn nothing more. Stalls: once a size is used, a
step counts as at most _MAX_RATIO times what it could cost (every token and slot as dear as a row), at least
1/_MAX_RATIO of the prediction.
"""

from dataclasses import dataclass
from typing import Callable

import numpy as np

_MEMORY = 0.97  # per step, the weight of a size's earlier steps: the fit follows its last ~30
_FORWARD_MEMORY = 0.99  # per draft forward: a step runs several
_MIN_STEPS = 8  # a size's fit is used from its first solve after this many of its steps
_SOLVE_EVERY = 4
_RIDGE = 1e-12  # on every coefficient, so that a direction no observation has seen solves to ~0
_MAX_RATIO = 1.5  # one step stalled by another process or a garbage collection must not undo what many showed
_OPTIMISM = 1.0  # b and w are read this many standard errors below their fit (module docstring: Optimism)
_PRIOR_WEIGHT = 0.01  # the prior's rows, scaled by this, count as 1e-4 of a step: they settle what the data leave
# open and bend little of what they show (at 0.1, 16-31 rows with 0.5 ms of noise read c 33% low)

Padding = Callable[[int, int, int, int], int]  # (rows, tokens, widest row's tokens, rows wider than one) -> slots


class LeastSquares:
    """Exponentially weighted least squares y ~ x . theta, plus prior rows (x, y) that count one observation each.
    Observations are kept as they come and folded into the moments every _SOLVE_EVERY of them, when theta and its
    standard errors are solved anew (a fold and solve per step had cost most of the policy's time between forwards,
    where each numpy call costs 5-10 us)."""

    def __init__(self, num_features: int, memory: float, prior: list[tuple[list[float], float]]):
        self.memory = memory
        self.moments = np.zeros((num_features, num_features))  # faded sum of x x^T, as of the last fold
        self.targets = np.zeros(num_features)  # faded sum of x y
        self.squares = 0.0  # faded sum of y^2
        self.num_observations = 0
        self._pending: list[tuple[list[float], float]] = []  # observations since the last fold
        prior_x = np.array([x for x, _ in prior], dtype=float)
        self._prior = (prior_x.T @ prior_x, prior_x.T @ np.array([y for _, y in prior], dtype=float))
        self.solution: list[float] = [0.0] * num_features  # theta as of the last solve
        self.errors: list[float] = [0.0] * num_features  # theta's standard errors as of the last solve

    def add(self, x: list[float], y: float) -> bool:
        """One observation; True where it completed a batch and theta was solved anew."""
        self._pending.append((x, y))
        self.num_observations += 1
        if len(self._pending) < _SOLVE_EVERY:
            return False
        xs = np.array([x for x, _ in self._pending])
        ys = np.array([y for _, y in self._pending])
        fade = self.memory ** np.arange(len(ys) - 1, -1, -1)  # the latest counts whole
        scale = self.memory ** len(ys)
        self.moments = scale * self.moments + (xs * fade[:, None]).T @ xs
        self.targets = scale * self.targets + xs.T @ (fade * ys)
        self.squares = scale * self.squares + float(fade @ (ys * ys))
        self._pending = []
        inverse = np.linalg.inv(self.moments + self._prior[0] + _RIDGE * np.eye(len(x)))  # ~0 where nothing was seen
        theta = inverse @ (self.targets + self._prior[1])
        weight = self.moments[0, 0]  # the faded count of observations (x[0] = 1)
        residual = (max(self.squares - 2 * theta @ self.targets + theta @ self.moments @ theta, 0.0)
                    / max(weight - len(x), 1.0))
        self.solution = theta.tolist()
        self.errors = np.sqrt(np.maximum(np.diag(inverse) * residual, 0.0)).tolist()
        return True


@dataclass
class StepPrice:
    """The fitted cost of a step at num_rows rows, outside the drafter."""

    num_rows: int
    base: float  # seconds with one token per row (a + c x rows)
    per_token: float  # b
    per_padded: float  # w
    padding: Padding | None

    def cost(self, num_tokens: int, width: int, num_wide: int) -> float:
        """Seconds verifying num_tokens tokens, the widest row `width` tokens, num_wide rows wider than one (the
        verify_cost of budget.choose_budget)."""
        padded = 0 if self.padding is None else self.padding(self.num_rows, num_tokens, width, num_wide)
        return self.base + self.per_token * (num_tokens - self.num_rows) + self.per_padded * padded


class StepFit:
    """The step costs by batch size, and the drafter's forward costs. padding: the engine's padded query slots of a
    forward (None: it pads none)."""

    def __init__(self, padding: Padding | None = None):
        self.padding = padding
        self._sizes: dict[int, LeastSquares] = {}  # batch size's bit length -> its fit of (a, c, b, w)
        self._read: dict[int, tuple] = {}  # the same -> (level, mean rows, per row, b, w) of its last solve
        self.forwards = LeastSquares(2, _FORWARD_MEMORY, [([0.0, 1.0], 0.0)])  # (e, f); prior f = 0

    def observe_step(self, widths: list[int], seconds: float) -> None:
        """A decoding step's seconds outside the drafter; widths: each row's verified tokens (1 + its drafts)."""
        rows, tokens = len(widths), sum(widths)
        bucket = rows.bit_length()
        if bucket not in self._sizes:
            r = _PRIOR_WEIGHT * 2 ** (bucket - 1)  # a size's b and w move its steps' seconds by r times as much
            self._sizes[bucket] = LeastSquares(4, _MEMORY, [([0.0, 0.0, r, 0.0], 0.0), ([0.0, 0.0, -r, r], 0.0)])
        num_wide = sum(w > 1 for w in widths)
        padded = 0 if self.padding is None else self.padding(rows, tokens, max(widths), num_wide)
        if bucket in self._read:  # a stalled step counts as at most 1.5x what it could cost
            price = self._price(bucket, rows)
            predicted = price.cost(tokens, max(widths), num_wide)
            dearest = price.base * (tokens + padded) / rows  # every token and padded slot at a row's cost
            seconds = min(max(seconds, predicted / _MAX_RATIO), max(predicted, dearest) * _MAX_RATIO)
        fit = self._sizes[bucket]
        if fit.add([1.0, rows, tokens - rows, padded], seconds) and fit.num_observations >= _MIN_STEPS:
            self._read[bucket] = self._reading(fit)

    def observe_forwards(self, forwards: list[tuple[int, float]]) -> None:
        """The drafter's forwards after its first of a step: (rows, seconds) each."""
        for rows, seconds in forwards:
            self.forwards.add([1.0, rows], seconds)

    @property
    def has_forwards(self) -> bool:
        return self.forwards.num_observations > 0

    def forward_costs(self, max_rows: int) -> list[float]:
        """Seconds of one draft forward of 1 .. max_rows rows (each > 0)."""
        e, f = self.forwards.solution
        return [max(e + f * m, 1e-6) for m in range(1, max_rows + 1)]

    def price(self, num_rows: int) -> StepPrice | None:
        """The step's price at num_rows rows from the fit at its batch size, else the nearest one used; None before
        any size is."""
        bucket = num_rows.bit_length()
        near = min(self._read, key=lambda b: (abs(b - bucket), -b), default=None)
        return None if near is None else self._price(near, num_rows)

    def _price(self, bucket: int, num_rows: int) -> StepPrice:
        level, mean_rows, per_row, b, w = self._read[bucket]
        base = max(level + per_row * (num_rows - mean_rows), 1e-6)
        per_token = min(b, base / num_rows)
        per_padded = 0.0 if self.padding is None else min(w, per_token)  # an engine that pads nothing: free
        return StepPrice(num_rows, base, per_token, per_padded, self.padding)

    @staticmethod
    def _reading(fit: LeastSquares) -> tuple:
        """(a step's cost at the size's mean rows, those rows, the cost per row more, b, w), held as the module
        docstring says."""
        a, c, b, w = fit.solution
        b, w = b - _OPTIMISM * fit.errors[2], w - _OPTIMISM * fit.errors[3]
        mean_rows = float(fit.moments[0, 1] / fit.moments[0, 0])
        level = max(a + c * mean_rows, 1e-6)
        spread = fit.moments[1, 1] / fit.moments[0, 0] - mean_rows ** 2  # the steps' variance in rows
        per_row = min(max(c, 0.0), level / mean_rows) if spread >= 1.0 else level / mean_rows
        return float(level), float(mean_rows), float(per_row), max(b, 0.0), max(w, 0.0)
