"""Choosing how many drafts each request verifies in one step: adaptive verification's allocation.

Terms (as in vLLM's DSpark adaptive verification, extended to every drafter). A step runs N requests. S(r, k), the
*survival* of request r's first k drafts, estimates P(all k accepted) (calibrated confidences multiplied,
spec/adaptive/calibration.py); it never grows with k. Verifying D drafts in all, L the most any request verifies, the
step emits N + (sum of the admitted S) tokens in expectation and costs fixed + per_draft x D + per_padded x (N x L - D)
seconds (spec/adaptive/step_fit.py; an engine that pads no rows has per_padded = 0). With m = per_draft - per_padded,
the allocation maximises expected tokens per second:

    max over L = 0 .. K and D of (N + sum of the D largest S(r, k) with k <= L) / (fixed + per_padded x N x L + m x D)

For a given L the cost counts only D, so the D best slots are the best allocation of width at most L, and this is the
optimum (tested against a brute force), found in one vectorised pass over every L. Ranking ties go to the earlier
position, so the admitted drafts are a prefix of each request's. `threshold` = rate* x m is the survival a further draft
needs to pay for itself: a drafter can stop extending a request below it.

Every draft in: a good drafter's steps mostly admit every draft, so that case is tested first, in plain Python (a numpy
call costs 5-10 us): at its rate rho it is the optimum when every draft has S > rho x m and, for each l = 1 .. L, the
drafts at positions l .. L have sum(S - rho x m) > rho x per_padded x N x (L - l + 1) (ties: the search).
"""

from dataclasses import dataclass

import numpy as np


@dataclass
class Budget:
    lengths: list[int]  # drafts admitted per request
    rate: float  # expected tokens per second of the allocation
    threshold: float  # survival a further draft needs to be worth verifying
    width: int  # L: the most drafts a request may verify at the optimum


def choose_budget(survival: list[list[float]], fixed: float, per_draft: float, per_padded: float = 0.0,
                  margin: float = 0.0) -> Budget:
    """The allocation (module docstring); survival[r][k - 1] = S(r, k), non-increasing in k; fixed > 0 seconds,
    0 <= per_padded <= per_draft. margin > 0: every draft, wherever that allocation's rate is within this share of
    the optimum's."""
    full, is_optimal = _every_draft(survival, fixed, per_draft, per_padded)
    if is_optimal:
        return full
    best = _search(survival, fixed, per_draft, per_padded)
    return full if full is not None and full.rate >= (1.0 - margin) * best.rate else best


def _every_draft(survival: list[list[float]], fixed: float, per_draft: float,
                 per_padded: float) -> tuple[Budget | None, bool]:
    """Every draft admitted (None without drafts), and whether that is the optimum by the module docstring's test."""
    num_rows, marginal = len(survival), per_draft - per_padded
    lengths = [len(row) for row in survival]
    depth, num_drafts = max(lengths, default=0), sum(lengths)
    if not num_drafts:
        return None, False
    rate = (num_rows + sum(map(sum, survival))) / (fixed + per_padded * num_rows * depth + marginal * num_drafts)
    threshold = rate * marginal
    full = Budget(lengths, rate, threshold, depth)
    if min(row[-1] for row in survival if row) <= threshold:
        return full, False
    if per_padded:
        surplus = [0.0] * depth  # per position: sum(S - threshold) of the drafts there
        for row in survival:
            for k, value in enumerate(row):
                surplus[k] += value - threshold
        level_cost, deeper = rate * per_padded * num_rows, 0.0
        for k in range(depth - 1, -1, -1):
            deeper += surplus[k]
            if deeper <= level_cost * (depth - k):
                return full, False
    return full, True


def _search(survival: list[list[float]], fixed: float, per_draft: float, per_padded: float) -> Budget:
    """The optimum over every L and D, as the module docstring says: one vectorised pass."""
    num_rows, marginal = len(survival), per_draft - per_padded
    flat = np.fromiter((value for row in survival for value in row), float)
    position = np.fromiter((k for row in survival for k in range(len(row))), np.int64, len(flat))
    owner = np.repeat(np.arange(num_rows), [len(row) for row in survival])
    order = np.lexsort((position, -flat))  # best survival first; ties: earlier position first
    flat, position, owner = flat[order], position[order], owner[order]
    depth = int(position.max()) + 1 if len(position) else 0
    widths = np.arange(1, depth + 1)[:, None] if per_padded else np.array([[depth]])  # L per row of the table
    is_in = position[None, :] < widths  # [num L, num_drafts]: the slots each L admits, in rank order
    counts = np.cumsum(is_in, axis=1)  # D after each admitted slot
    rates = (num_rows + np.cumsum(flat * is_in, axis=1)) / (fixed + per_padded * num_rows * widths
                                                             + marginal * counts)
    rates[~is_in] = 0.0  # only an admitted slot ends an allocation
    best = int(np.argmax(rates)) if rates.size else 0  # row-major: the smallest L, then the smallest D among equals
    if not rates.size or rates.flat[best] <= num_rows / fixed:
        return Budget([0] * num_rows, num_rows / fixed, num_rows / fixed * marginal, 0)
    row, column = divmod(best, rates.shape[1])
    lengths = np.bincount(owner[: column + 1][is_in[row, : column + 1]], minlength=num_rows).tolist()
    rate = float(rates[row, column])
    return Budget(lengths, rate, rate * marginal, int(widths[row, 0]))
