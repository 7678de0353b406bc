"""Replaying a finished closed batch at a uniform K: what it would have cost with K drafts offered to every request.

The replay keeps the batch's completions (verification is lossless: drafting does not change what a seeded batch
emits, nor what an unseeded one emits in distribution) and its measured prompt step and per-step overhead, and
re-decides how many drafts each step accepts. Each replayed step of a request replays one of its own steps that
offered drafts (how many were offered, how many accepted), or with weight PRIOR_STEPS one of the batch's: a draft
rejected at position j ends the step's run at j - 1 whatever K is; a step whose drafts were all accepted goes on, where
K is larger, with another drawn step. Resampling whole steps keeps the runs of easy tokens that a per-request
acceptance rate loses: with a geometric rate per request, the replay of the default workload's batch of 16 ran 9.3
steps where the batch ran 8.5 at K = 8, and priced K = 8 22% above its measured time. REPLAYS Monte Carlo runs on
common random numbers. A replayed step costs the step-cost model's K draft forwards and K + 1 tokens per running
request to verify, plus the batch's measured time per step outside drafting and verification; its first step
(prompts) is the measured one less drafting, plus the K drafts' forwards and verification. At K = 0 that is one token
per running request per step, and no draws.

Measured (2-core CPU): from uncapped adaptive batches' records at 4-64 requests on both workloads (5 batches each, the
same completions timed at every static K), the replay's fastest K was the measured fastest or within 1% of it, and
its times were within 0.92-1.07 of the measured ones at each K at 4-32 requests (mixed workload). Replaying K = 0-8
takes 2 ms after a batch of 16 requests, about 50 after one of 256 (1-3% of such a batch's time).
"""

from dataclasses import dataclass

import numpy as np

from spec.metrics import RequestAcceptance
from spec.step_cost import StepCostModel

PRIOR_STEPS = 2.0  # a request's replayed steps draw from the batch's judged steps with the weight of 2 of its own: a
# request that was offered drafts at one or two steps (or none) is not judged by them alone
REPLAYS = 8  # Monte Carlo runs per K: the mean of 8 batch times moves by about 1% between seeds at 16 requests
_SEED = 0  # common random numbers: every K and every batch replays the same draws


@dataclass
class BatchTiming:
    """Measured seconds of one engine run, filled step by step."""
    seconds: float = 0.0  # every step
    draft_seconds: float = 0.0  # proposing
    verify_seconds: float = 0.0  # target forward, rejection sampling, commit
    first_step_seconds: float = 0.0  # the first step (it prefills the prompts), less its drafting
    num_steps: int = 0

    def observe_step(self, seconds: float, draft_seconds: float, verify_seconds: float) -> None:
        if not self.num_steps:
            self.first_step_seconds = seconds - draft_seconds
        self.seconds += seconds
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        self.num_steps += 1

    @property
    def other_seconds_per_step(self) -> float:
        """Mean seconds per step outside drafting and verification (scheduling, bookkeeping, the policy itself)."""
        return (self.seconds - self.draft_seconds - self.verify_seconds) / max(self.num_steps, 1)


class JudgedSteps:
    """Each request's steps that offered drafts: how many, and how many of them were accepted."""

    def __init__(self, records: list[RequestAcceptance]):
        steps = [[(k, a) for k, a in zip(r.k_per_step, r.num_accepted_per_step) if k] for r in records]
        self.counts = np.array([len(own) for own in steps])
        self.starts = np.cumsum(self.counts) - self.counts
        self.offered = np.array([k for own in steps for k, _ in own], dtype=np.int64)
        self.accepted = np.array([a for own in steps for _, a in own], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.offered)

    def accepted_at(self, k: int, shape: tuple[int, int, int], rng: np.random.Generator) -> np.ndarray:
        """Drafts accepted at each of `shape` = (replays, requests, steps) steps offering k drafts: each step
        replays one of the request's own judged steps, or with weight PRIOR_STEPS one of the batch's; where all the
        replayed step's drafts were accepted and k is larger, the step goes on with another one."""
        total = np.zeros(shape, dtype=np.int64)
        owners = np.broadcast_to(np.arange(shape[1])[None, :, None], shape).ravel()
        live, room = np.arange(total.size), np.full(total.size, k)
        while len(live):
            offered, accepted = self._draw(owners[live], rng)
            total.flat[live] += np.minimum(accepted, room)
            more = (accepted == offered) & (offered < room)
            live, room = live[more], (room - offered)[more]
        return total

    def _draw(self, owners: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        counts = self.counts[owners]
        pick = rng.random(len(owners)) * (counts + PRIOR_STEPS)
        own = np.minimum(self.starts[owners] + pick.astype(np.int64), len(self) - 1)
        index = np.where(pick < counts, own, rng.integers(0, len(self), len(owners)))
        return self.offered[index], self.accepted[index]


def replayed_seconds(lengths: list[int], judged: JudgedSteps | None, k: int, timing: BatchTiming,
                     costs: StepCostModel) -> float:
    """Mean seconds of REPLAYS replays of the batch with k drafts offered to every running request per step
    (module docstring)."""
    lengths = np.asarray(lengths)
    num_reqs, longest = len(lengths), int(lengths.max())
    if k:
        accepted = judged.accepted_at(k, (REPLAYS, num_reqs, longest), np.random.default_rng(_SEED))
        emitted = np.cumsum(accepted + 1, axis=2)  # tokens after each step
    else:
        emitted = np.broadcast_to(np.arange(1, longest + 1), (1, num_reqs, longest))
    num_steps = (emitted < lengths[None, :, None]).sum(2) + 1  # steps each request runs
    other = timing.other_seconds_per_step
    first = timing.first_step_seconds
    if k:
        first += costs.draft_cost([num_reqs] * k) + costs.verify_cost(num_reqs, num_reqs * (k + 1))
        first -= costs.verify_cost(num_reqs, num_reqs)
    step_cost = {}
    total = 0.0
    for steps in num_steps:
        running = np.bincount(steps, minlength=longest + 1)[::-1].cumsum()[::-1]  # [t]: requests with >= t steps
        for m in running[2:steps.max() + 1].tolist():
            if m not in step_cost:
                step_cost[m] = other + costs.verify_cost(m, m * (k + 1)) + costs.draft_cost([m] * k)
            total += step_cost[m]
        total += first
    return total / len(num_steps)
