"""Per-request factors of adaptive verification: a drafter can be as sure of its drafts for a prompt it predicts badly
as for one it predicts well, so each running request keeps its accepted drafts over their calibrated predictions,
from a prior of _PRIOR drafts as predicted, faded by _MEMORY a step (a request that stopped getting drafts drifts
back and is tried again). Below _TOLERANCE the ratio scales the request's calibrated values (the factor is
ratio / _TOLERANCE); above it they stand (factor 1), as a well-predicted request's ratio wanders by chance and,
compounded over several drafts, would trim drafts that pay.

Plain Python: the policy reads a few dozen factors a step between forwards, where each numpy call cost 5-10 us (the
forward leaves the caches cold) against well under one for a dict lookup. A record not updated for _EXPIRY steps,
faded below 1e-6 of itself, is dropped (vLLM's workers see no end of a run: finished requests would pile up).
"""

_PRIOR = 2.0  # a request's factor starts as if 2 drafts had been accepted as predicted
_TOLERANCE = 0.8  # a request's factor counts only below this ratio of accepted to predicted drafts
_MEMORY = 0.8  # per step, the weight of a request's earlier outcomes
_EXPIRY = 64  # steps


class RequestFactors:
    def __init__(self):
        self._records: dict[int, tuple[float, float, int]] = {}  # request -> (accepted, predicted, step updated)
        self._expired = 0  # the last expiry, in _EXPIRY steps

    def clear(self) -> None:
        self._records.clear()

    def factors(self, req_ids: list[int], step: int) -> list[float]:
        """The factor of each request at `step` (1 without a record)."""
        records, factors = self._records, []
        for req_id in req_ids:
            record = records.get(req_id)
            if record is None:
                factors.append(1.0)
                continue
            fade = _MEMORY ** (step - record[2])
            ratio = (fade * record[0] + _PRIOR) / (fade * record[1] + _PRIOR)
            factors.append(min(1.0, ratio / _TOLERANCE))
        return factors

    def add(self, req_ids: list[int], accepted: list[float], predicted: list[float], step: int) -> None:
        """Drafts accepted and their calibrated predictions, added at `step` to each request's faded record (a request
        may come more than once: its sums)."""
        if step // _EXPIRY > self._expired:
            self._expired = step // _EXPIRY
            self._records = {r: record for r, record in self._records.items() if step - record[2] < _EXPIRY}
        records = self._records
        for req_id, num_accepted, num_predicted in zip(req_ids, accepted, predicted):
            before = records.get(req_id)
            fade = 0.0 if before is None else _MEMORY ** (step - before[2])
            records[req_id] = (num_accepted + (fade * before[0] if before else 0.0),
                               num_predicted + (fade * before[1] if before else 0.0), step)
