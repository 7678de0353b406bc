"""Deriving the per-batch-size schedule from measured acceptance and step costs (what `python -m rollout tune`
prints).

With r_j the acceptance rate of draft position j as vLLM reports it (accepted at j / drafted at j: the share of
steps whose first j + 1 drafts were all accepted), a step with K drafts per row emits 1 + r_0 + ... + r_{K-1}
tokens per row in expectation. With step(B, K) the seconds of a step at batch size B with K drafts per row, its
speed relative to no speculation is

    speedup(B, K) = (1 + sum_{j<K} r_j) x step(B, 0) / step(B, K).

The step times come from a `StepTimes`: `MeasuredSteps`, whole steps timed on an engine at a grid of batch sizes
(`doubling_grid`) and Ks (either engine's, rollout/step_times.py).

The schedule takes the best K per batch size, and K = 0 wherever no K beats no speculation by `min_gain`.
Measured or replayed speeds choose by `smallest_k_within`: the smallest K that the fastest does not beat by
`min_gain` (MIN_GAIN unless told).
"""

import bisect
from dataclasses import dataclass
from typing import Protocol

from spec.schedule import BatchSizeSchedule

MIN_GAIN = 1.02  # a deeper K (more verification) must win by 2%: the tuner's separately timed runs do not resolve
# less


class StepTimes(Protocol):
    def step_seconds(self, batch_size: int, k: int) -> float:
        """Seconds of one decoding step of batch_size requests with k drafts each."""


@dataclass
class MeasuredSteps:
    """Whole-step seconds measured at a grid: seconds[batch size][K]. Between grid points, linear in K and in the
    batch size; beyond the grid, the nearest point's."""

    seconds: dict[int, dict[int, float]]

    def step_seconds(self, batch_size: int, k: int) -> float:
        return _interpolate(self.seconds, batch_size, lambda by_k: _interpolate(by_k, k, float))


def _interpolate(table: dict, x: int, value) -> float:
    """value(table[x]) at a grid point, linearly between the two that bracket x, the nearest one beyond the grid."""
    xs = sorted(table)
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x or i == 0 or i == len(xs):
        return value(table[xs[min(i, len(xs) - 1)]])
    lo, hi = xs[i - 1], xs[i]
    w = (x - lo) / (hi - lo)
    return (1 - w) * value(table[lo]) + w * value(table[hi])


def predicted_speedup(acceptance: list[float], costs: StepTimes, batch_size: int, k: int) -> float:
    """speedup(B, K) above; acceptance[j] = r_j (K may not exceed len(acceptance))."""
    if k > len(acceptance):
        raise ValueError(f"k={k}: acceptance was measured for {len(acceptance)} positions only")
    return (1.0 + sum(acceptance[:k])) * costs.step_seconds(batch_size, 0) / costs.step_seconds(batch_size, k)


def best_k(acceptance: list[float], costs: StepTimes, batch_size: int, min_gain: float) -> tuple[int, float]:
    """(K, predicted speedup) at one batch size: K = 0 (speedup 1.0) unless some K wins by min_gain."""
    k, speedup = max(((k, predicted_speedup(acceptance, costs, batch_size, k)) for k in range(1, len(acceptance) + 1)),
                     key=lambda pair: pair[1], default=(0, 1.0))
    return (k, speedup) if speedup >= min_gain else (0, 1.0)


def tuned_schedule(acceptance: list[float], costs: StepTimes, max_batch_size: int,
                   min_gain: float = MIN_GAIN) -> list[list[int]]:
    """[[range_start, range_end, K], ...] covering batch sizes 1 .. max_batch_size (spec/schedule.py rules)."""
    ranges: list[list[int]] = []
    for batch_size in range(1, max_batch_size + 1):
        k, _ = best_k(acceptance, costs, batch_size, min_gain)
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = batch_size
        else:
            ranges.append([batch_size, batch_size, k])
    BatchSizeSchedule(ranges, max(len(acceptance), 1))  # valid by construction; a broken one fails here
    return ranges


def smallest_k_within(speeds: dict[int, float], min_gain: float = MIN_GAIN) -> int:
    """The smallest K that the fastest does not beat by min_gain (speeds: K -> tokens per second, or any measure
    that grows with speed): K = 0, where offered, unless speculation wins by min_gain, and no deeper drafting (more
    verification work) for a gain within the measurement's noise."""
    fastest = max(speeds.values())
    return min(k for k, speed in speeds.items() if speed * min_gain >= fastest)


def doubling_grid(limit: int) -> list[int]:
    """1, 2, 4, ... below limit, then limit."""
    grid, n = [], 1
    while n < limit:
        grid.append(n)
        n *= 2
    return grid + [limit]
