"""Choosing how many drafts each request verifies in one step: adaptive verification's allocation.

Terms (as in vLLM's DSpark adaptive verification, extended to every drafter). A step runs N requests; the
target forward reads each row's uncached tokens (T in all) plus its admitted drafts. S(r, k), the *survival* of
request r's first k drafts, estimates P(all k accepted) (calibrated confidences multiplied,
spec/adaptive/calibration.py); it never grows with k. Admitting a draft budget b, the step emits in expectation
N + (sum of the admitted S) tokens (each row emits one token past its accepted drafts) and costs
draft_cost + verify_cost(T + b, W, wide) seconds, W the widest row's tokens and wide the rows wider than one (the
runner pads attention to the widest row: spec/adaptive/step_cost.py). The allocation picks

    b* = argmax_b (N + sum of the b largest S) / (draft_cost + verify_cost(T + b, W_b, wide_b)),

and admits those b* slots. Ranking ties go to the earlier position, so with S non-increasing in k the admitted
slots form a contiguous prefix of each request's drafts: request r verifies lengths[r] drafts. Where the cost
follows the tokens alone, whichever b wins, the top b slots are the best b slots of any prefix-closed allocation,
so this is the optimum over all of them; with the width's cost it is the best of the top-b allocations (a deep
slot is admitted when its survival outranks the shallow ones, and then pays for the width it adds).

`threshold` is the survival a further draft would need to pay for itself at the optimum, within the chosen width:
rate* x the cost of one more token there. A drafter can stop extending a request whose survival has fallen below
it.
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


def choose_budget(survival: list, uncached: list[int], draft_cost: float,
                  verify_cost: Callable[[int, int, int], float]) -> Budget:
    """survival[r]: non-increasing S(r, 1..) (a sequence of floats); uncached[r]: row r's tokens other than drafts;
    verify_cost(num_tokens, width, num_wide): seconds to verify num_tokens tokens with the widest row `width` tokens
    and num_wide rows wider than one. Plain Python: it runs every step, mostly on a few dozen drafts."""
    num_reqs = len(survival)
    slots = sorted((-float(value), position, owner) for owner, values in enumerate(survival)
                   for position, value in enumerate(values))  # best survival first; ties: earlier position first
    widths = list(uncached)
    width, num_wide, num_tokens = max(widths, default=0), sum(w > 1 for w in widths), sum(widths)
    gain = best_gain = float(num_reqs)
    best, best_seconds, best_shape = 0, draft_cost + verify_cost(num_tokens, width, num_wide), (width, num_wide)
    best_rate = gain / best_seconds
    for b, (negative_value, _, owner) in enumerate(slots, start=1):
        gain -= negative_value
        num_wide += widths[owner] == 1
        widths[owner] += 1
        width = max(width, widths[owner])
        seconds = draft_cost + verify_cost(num_tokens + b, width, num_wide)
        if gain / seconds > best_rate:  # strictly: the smallest budget among equals
            best, best_rate, best_gain, best_seconds, best_shape = b, gain / seconds, gain, seconds, (width, num_wide)
    admitted = [0] * num_reqs
    for _, _, owner in slots[:best]:
        admitted[owner] += 1
    total = num_tokens + best
    marginal = max(verify_cost(total + 1, *best_shape) - verify_cost(total, *best_shape), 0.0)
    return Budget(admitted, best_gain, best_seconds, best_rate * marginal)


def every_draft_pays(survival: list, fixed_seconds: float, per_draft_seconds: float) -> bool:
    """Whether choose_budget admits every draft when a step costs fixed_seconds + per_draft_seconds x drafts (no
    width term: vLLM's flattened rows), found in one pass instead of a sort. With the slots in falling survival, the
    rate after slot b is a weighted mean of the rate before it and S_b / per_draft_seconds, so the rate rises at slot
    b iff S_b > per_draft_seconds x rate(b - 1); once a slot fails to raise it no later slot can. So every draft pays
    iff the last-ranked one (the smallest S) still raises the rate of all the others."""
    values = [value for values in survival for value in values]
    if not values:
        return True
    lowest = min(values)
    others = (len(survival) + sum(values) - lowest) / (fixed_seconds + per_draft_seconds * (len(values) - 1))
    return lowest > per_draft_seconds * others
