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


def choose_budget(survival: list, num_fixed_tokens: int, draft_cost: float,
                  verify_costs: Callable[[int, int], list[float]]) -> Budget:
    """survival[r]: non-increasing S(r, 1..) (a sequence of floats); verify_costs(first, count) gives the seconds to
    verify first, first + 1, .. tokens (count of them). Plain Python: it runs every step, mostly on a few dozen
    drafts."""
    num_reqs = len(survival)
    slots = sorted((-float(value), position, owner) for owner, values in enumerate(survival)
                   for position, value in enumerate(values))  # best survival first; ties: earlier position first
    costs = [draft_cost + cost for cost in verify_costs(num_fixed_tokens, len(slots) + 2)]  # b = 0 .. M + 1
    gain = best_gain = float(num_reqs)
    best, best_rate = 0, gain / costs[0]
    for b, (negative_value, _, _) in enumerate(slots, start=1):
        gain -= negative_value
        if gain / costs[b] > best_rate:  # strictly: the smallest budget among equals
            best, best_rate, best_gain = b, gain / costs[b], gain
    admitted = [0] * num_reqs
    for _, _, owner in slots[:best]:
        admitted[owner] += 1
    marginal = max(costs[best + 1] - costs[best], 0.0)
    return Budget(admitted, best_gain, costs[best], best_rate * marginal)
