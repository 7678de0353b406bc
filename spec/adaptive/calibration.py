"""Confidence calibration: a drafter's raw confidence (draft-model probability, n-gram or suffix match frequency)
is not the probability that verification accepts the draft. `ConfidenceCalibrator` learns that map online.

Terms. Draft j of a request (0-based position) comes with a raw confidence c in [0, 1]. Its *outcome* is
observed only when every draft before it was accepted: accepted (1) or rejected (0); drafts after the first
rejection are never judged. The calibrated confidence a(j, c) estimates P(draft j accepted | drafts < j
accepted, raw confidence c), the conditional probability whose running product is the survival
S(r, k) = a(0, c_0) x ... x a(k - 1, c_{k-1}) that adaptive verification ranks (spec/adaptive/budget.py).

Estimate. Per position (the last one pooled with all later positions) the raw confidences fall into equal-width
bins; each bin starts from a prior of `prior_weight` pseudo-outcomes at its centre (the identity map: trust the
drafter until the outcomes say otherwise) and adds the observed outcomes; the bin estimates are then made
non-decreasing in c by weighted isotonic regression, since a more confident draft should not be accepted less.
A position's map is refitted once its new outcomes reach 2% of those it has (every step at first, rarely once
thousands are in), which keeps the per-step cost low.

Calibration error. Every judged draft's prediction (the calibrated value used for it) and outcome are also
counted in ten bins of the prediction; the expected calibration error is sum over bins |predicted - observed| /
num_judged (Naeini et al. 2015). The same is kept for the raw confidences, for comparison.
"""

import numpy as np

from spec.adaptive.monotone import isotonic

_NUM_ERROR_BINS = 10


class ConfidenceCalibrator:
    _REFIT_SHARE = 0.02  # a position's map is refitted once its new outcomes reach 2% of those it has

    def __init__(self, max_positions: int = 16, num_bins: int = 20, prior_weight: float = 4.0):
        if max_positions < 1 or num_bins < 1 or prior_weight <= 0:
            raise ValueError(f"max_positions={max_positions}, num_bins={num_bins}, prior_weight={prior_weight}: "
                             "need max_positions >= 1, num_bins >= 1 and prior_weight > 0")
        self.max_positions, self.num_bins, self.prior_weight = max_positions, num_bins, prior_weight
        self.centres = (np.arange(num_bins) + 0.5) / num_bins  # [num_bins]
        self.num_accepted = np.zeros((max_positions, num_bins))
        self.num_judged = np.zeros((max_positions, num_bins))
        self.table = np.tile(self.centres, (max_positions, 1))  # [max_positions, num_bins]: a(j, bin)
        self.table_rows = [_lookup_row(row) for row in self.table]  # the same, for the policy's lookups
        # Acceptance rate per position, whatever the confidence: the first from a prior of 1/2, each later one from
        # the rate before it (positions drafted rarely would otherwise sit near 1/2 and never be drafted to learn
        # better: a good drafter's deep drafts are accepted as often as its early ones, or more)
        self._rates = [0.5] * max_positions
        self._num_unfitted = np.zeros(max_positions)  # outcomes per position since its last refit
        self.num_observations = 0  # judged drafts observed (a plain int: the engine reads it every step)
        self._error = {name: np.zeros((3, _NUM_ERROR_BINS)) for name in ("calibrated", "raw")}
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # added, not yet observed
        self.num_pending = 0

    def calibrated(self, positions: np.ndarray, raw: np.ndarray) -> np.ndarray:
        """a(position, raw) of each draft: positions [n] (0-based), raw confidences [n]."""
        return self.table[self._rows(positions), self._bins(raw)]

    def acceptance_rate(self, position: int) -> float:
        """P(draft `position` accepted | the drafts before it accepted), before its confidence is known: the
        position's observed rate (as of its last refit), from a prior of the rate before it (1/2 for the first)."""
        return self._rates[min(position, self.max_positions - 1)]

    def add(self, positions: np.ndarray, raw: np.ndarray, accepted: np.ndarray) -> None:
        """Judged drafts (as observe's), kept until flush(): an update costs a few hundred microseconds whatever its
        size, so the policy hands several steps' outcomes over at once."""
        self._pending.append((positions, raw, accepted))
        self.num_pending += len(positions)

    def flush(self) -> None:
        """Observe the drafts added since the last flush."""
        if self._pending:
            positions, raw, accepted = (np.concatenate(parts) for parts in zip(*self._pending))
            self._pending, self.num_pending = [], 0
            self.observe(positions, raw, accepted)

    def observe(self, positions: np.ndarray, raw: np.ndarray, accepted: np.ndarray) -> None:
        """Judged drafts: positions [n], raw confidences [n], outcomes [n] (bool)."""
        if not len(positions):
            return
        accepted = np.asarray(accepted, dtype=np.float64)
        self.num_observations += len(accepted)
        rows, bins = self._rows(positions), self._bins(raw)
        self._count_error("calibrated", self.table[rows, bins], accepted)
        self._count_error("raw", np.clip(raw, 0.0, 1.0), accepted)
        cells, size = rows * self.num_bins + bins, self.num_judged.size
        self.num_judged += np.bincount(cells, minlength=size).reshape(self.num_judged.shape)
        self.num_accepted += np.bincount(cells, weights=accepted, minlength=size).reshape(self.num_accepted.shape)
        self._num_unfitted += np.bincount(rows, minlength=self.max_positions)
        is_due = self._num_unfitted >= np.maximum(1.0, self._REFIT_SHARE * self.num_judged.sum(axis=1))
        due = np.flatnonzero(is_due).tolist()
        for row in due:
            self._refit(row)
        if due:
            self._refit_rates(due[0])

    def _refit(self, row: int) -> None:
        self._num_unfitted[row] = 0
        weight = self.num_judged[row] + self.prior_weight
        estimate = (self.num_accepted[row] + self.prior_weight * self.centres) / weight
        self.table[row] = isotonic(estimate, weight)
        self.table_rows[row] = _lookup_row(self.table[row])

    def _refit_rates(self, first: int) -> None:
        """The rates from position `first` on: each refitted one, and the later ones whose prior it is."""
        accepted, judged = self.num_accepted.sum(axis=1).tolist(), self.num_judged.sum(axis=1).tolist()
        for j in range(first, self.max_positions):
            prior = self._rates[j - 1] if j else 0.5
            self._rates[j] = (accepted[j] + prior * self.prior_weight) / (judged[j] + self.prior_weight)

    def _count_error(self, name: str, predicted: np.ndarray, accepted: np.ndarray) -> None:
        bins = np.minimum((predicted * _NUM_ERROR_BINS).astype(np.int64), _NUM_ERROR_BINS - 1)
        sums = self._error[name]  # rows: predicted sum, outcome sum, count
        sums[0] += np.bincount(bins, weights=predicted, minlength=_NUM_ERROR_BINS)
        sums[1] += np.bincount(bins, weights=accepted, minlength=_NUM_ERROR_BINS)
        sums[2] += np.bincount(bins, minlength=_NUM_ERROR_BINS)

    def calibration_error(self, name: str = "calibrated") -> float:
        """Expected calibration error of the judged drafts so far (0.0 before any); name: calibrated or raw."""
        predicted, observed, count = self._error[name]
        return float(np.abs(predicted - observed).sum() / max(count.sum(), 1.0))

    def _rows(self, positions: np.ndarray) -> np.ndarray:
        return np.minimum(np.asarray(positions, dtype=np.int64), self.max_positions - 1)

    def _bins(self, raw: np.ndarray) -> np.ndarray:
        raw = np.asarray(raw, dtype=np.float64)
        return np.clip((raw * self.num_bins).astype(np.int64), 0, self.num_bins - 1)


def _lookup_row(row: np.ndarray) -> list[float]:
    """A position's map as a list for the policy's per-draft lookups in plain Python, its last bin once more (a
    confidence of exactly 1 lands there without a clamp)."""
    values = row.tolist()
    return values + values[-1:]
