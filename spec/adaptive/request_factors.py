"""Per-request factors of adaptive verification: a drafter can be as sure of its drafts for a prompt it predicts badly
as for one it predicts well, so each running request keeps its accepted drafts over their calibrated predictions,
from a prior of _PRIOR drafts as predicted, faded by _MEMORY a step (a request that stopped getting drafts drifts
back and is tried again). Below _TOLERANCE the ratio scales the request's calibrated values (the factor is
ratio / _TOLERANCE); above it they stand (factor 1), as a well-predicted request's ratio wanders by chance and,
compounded over several drafts, would trim drafts that pay.

The records are arrays indexed through a dict of request ids, read and written for a whole step at once: kept per
request in Python, they had cost the policy a third of its time. A record not updated for _EXPIRY steps, faded below
1e-6 of itself, is dropped (vLLM's workers see no end of a run: the records of finished requests would pile up).
"""

import numpy as np

_PRIOR = 2.0  # a request's factor starts as if 2 drafts had been accepted as predicted
_TOLERANCE = 0.8  # a request's factor counts only below this ratio of accepted to predicted drafts
_MEMORY = 0.8  # per step, the weight of a request's earlier outcomes
_EXPIRY = 64  # steps


class RequestFactors:
    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self._index: dict[int, int] = {}  # request -> its row in the arrays; row 0: no record (factor 1)
        self._records = np.zeros((3, 64))  # accepted, predicted, the step they were last updated at

    def factors(self, req_ids: list[int], step: int) -> np.ndarray:
        """[len(req_ids)] the factor of each request at `step` (1 without a record)."""
        rows = np.fromiter((self._index.get(req_id, 0) for req_id in req_ids), np.int64, len(req_ids))
        accepted, predicted = self._faded(rows, step)
        return np.minimum(1.0, (accepted + _PRIOR) / (predicted + _PRIOR) / _TOLERANCE)

    def add(self, req_ids: list[int], accepted: np.ndarray, predicted: np.ndarray, step: int) -> None:
        """Each request's drafts accepted and their calibrated predictions at `step`, added to its faded record."""
        if step % _EXPIRY == 0:
            self._expire(step)
        rows = np.fromiter((self._row(req_id) for req_id in req_ids), np.int64, len(req_ids))
        before_accepted, before_predicted = self._faded(rows, step)
        self._records[:, rows] = [before_accepted + accepted, before_predicted + predicted, np.full(len(rows), step)]

    def _faded(self, rows: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
        accepted, predicted, updated = self._records[:, rows]
        fade = _MEMORY ** (step - updated)
        return fade * accepted, fade * predicted

    def _row(self, req_id: int) -> int:
        row = self._index.get(req_id)
        if row is None:
            row = self._index[req_id] = len(self._index) + 1
            if row >= self._records.shape[1]:
                self._records = np.concatenate([self._records, np.zeros_like(self._records)], axis=1)
        return row

    def _expire(self, step: int) -> None:
        """Keep the records updated within _EXPIRY steps, compacted."""
        kept = {req_id: row for req_id, row in self._index.items() if step - self._records[2, row] < _EXPIRY}
        records = np.zeros((3, max(64, 2 * len(kept) + 1)))
        records[:, 1:len(kept) + 1] = self._records[:, list(kept.values())]
        self._index = {req_id: i for i, req_id in enumerate(kept, start=1)}
        self._records = records
