"""Choosing how many drafts each request verifies in one step: adaptive verification's allocation.

Terms (as in vLLM's DSpark adaptive verification, extended to every drafter). A step runs N requests; the
target forward reads T non-draft tokens (each row's uncached tokens) plus the admitted drafts. S(r, k), the
*survival* of request r's first k drafts, estimates P(all k accepted) (calibrated confidences multiplied,
spec/calibration.py); it never grows with k. Admitting a draft budget b, the step emits in expectation
N + (sum of the admitted S) tokens (each row emits one token past its accepted drafts) and costs
draft_cost + verify_cost(T + b) seconds. The allocation picks

    b* = argmax_b (N + sum of the b largest S) / (draft_cost + verify_cost(T + b)),

and admits those b* slots. Ranking ties go to the earlier position, so with S non-increasing in k the admitted
slots form a contiguous prefix of each request's drafts: request r verifies lengths[r] drafts. Whichever b wins,
the top b slots are the best b slots of any prefix-closed allocation, so this is the optimum over all of them.

`threshold` is the survival a further draft would need to pay for itself at the optimum: rate* x the marginal
verify cost of one more token. A drafter can stop extending a request whose survival has fallen below it.
"""

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass
class Budget:
    lengths: list[int]  # drafts admitted per request
    expected_tokens: float  # N + sum of the admitted survivals
    seconds: float  # predicted step cost
    threshold: float  # survival a further draft needs to be worth verifying

    @property
    def num_drafts(self) -> int:
        return sum(self.lengths)

    @property
    def rate(self) -> float:
        """Expected tokens per second of the chosen allocation."""
        return self.expected_tokens / self.seconds


def choose_budget(survival: list[np.ndarray], num_fixed_tokens: int, draft_cost: float,
                  verify_cost: Callable[[np.ndarray], np.ndarray]) -> Budget:
    """survival[r]: [num_drafts_r] non-increasing S(r, 1..); verify_cost maps token counts [m] to seconds [m]."""
    num_reqs = len(survival)
    lengths = [len(s) for s in survival]
    values = np.concatenate(survival) if sum(lengths) else np.zeros(0)  # [M]
    owners = np.repeat(np.arange(num_reqs), lengths)  # [M]
    positions = np.concatenate([np.arange(n) for n in lengths]) if num_reqs else np.zeros(0, dtype=np.int64)
    order = np.lexsort((positions, -values))  # best survival first; ties: earlier position first
    gains = num_reqs + np.concatenate([[0.0], np.cumsum(values[order])])  # [M + 1]: tokens for b = 0 .. M
    costs = draft_cost + verify_cost(num_fixed_tokens + np.arange(len(values) + 2))  # [M + 2]
    rates = gains / costs[:-1]
    best = int(np.argmax(rates))  # the first maximum: the smallest budget among equals
    admitted = np.bincount(owners[order[:best]], minlength=num_reqs)
    marginal = max(float(costs[best + 1] - costs[best]), 0.0)
    return Budget(admitted.tolist(), float(gains[best]), float(costs[best]), float(rates[best]) * marginal)
