"""Replaying a finished closed batch at a uniform K: what it would have cost with K drafts offered to every request.

The replay keeps the batch's completions (verification is lossless: drafting does not change what a seeded batch
emits, nor what an unseeded one emits in distribution) and its measured prompt step and per-step overhead, and
re-decides how many drafts each step accepts. Each replayed step of a request replays one of its own steps that
offered drafts (how many were offered, how many accepted), or with weight PRIOR_STEPS one of the batch's: a draft
rejected at position j ends the step's run at j - 1 whatever K is; a step whose drafts were all accepted goes on, where
K is larger, with another drawn step. Resampling whole steps keeps the runs of easy tokens that a per-request
acceptance rate loses: with a geometric rate per request, the replay of the default workload's batch of 16 ran 9.3
steps where the batch ran 8.5 at K = 8, and priced K = 8 22% above its measured time. REPLAYS Monte Carlo runs; every
K replays the same draws, made once at the largest K and cut at each smaller one.

A replayed step drafts, for each running request, K drafts or as many as its room allows if fewer (max_tokens and
max_model_len: k drafts emit up to k + 1 tokens), as the engine does; a drafter that drafts its request's stop token
stops there, which the replay does not foresee. It costs the step-cost model's draft forwards over the rows still
drafting at each depth, and verifying one token per running request plus its drafts, plus the batch's measured time
per step outside drafting and verification. Its first step (prompts) is the measured one less its drafting and its
drafts' verification, plus the replayed drafts' forwards and verification. At K = 0 that is one token per running
request per step, and no draws.

Measured (2-core CPU, 8 requests, 8 batches timed at each static K): the replays of the batches run at K = 4 and
K = 8 priced K = 0-8 at 0.94-1.09 of their measured times on the default workload (K = 8 at 1.07-1.09, K = 4 at
0.95-0.99), and at 0.98-1.14 on the mixed one (K = 8 at 1.12-1.14, K = 2 at 1.00-1.05). Replaying K = 0-8 takes
0.5-1 ms after a batch of 2 requests, 1-2 ms after one of 16, 12-24 ms after one of 256.
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
    first_step_drafts: int = 0  # drafts the first step verified
    num_steps: int = 0

    def observe_step(self, seconds: float, draft_seconds: float, verify_seconds: float, num_drafts: int = 0) -> None:
        if not self.num_steps:
            self.first_step_seconds, self.first_step_drafts = seconds - draft_seconds, num_drafts
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


def replayed_seconds(lengths: list[int], max_lengths: list[int], judged: JudgedSteps | None, k_max: int,
                     timing: BatchTiming, costs: StepCostModel) -> list[float]:
    """Mean seconds of REPLAYS replays of the batch with k drafts offered to every running request per step, for
    k = 0 .. k_max (module docstring); lengths: the completions', max_lengths: the most each request had room for.
    Every k replays the same drawn steps (the accepted run of a draw at k_max, cut at k, is the run a draw at k would
    have found), so their differences are not the draws' noise."""
    lengths, max_lengths = np.asarray(lengths), np.asarray(max_lengths)
    num_reqs, longest = len(lengths), int(lengths.max())
    runs = np.zeros((1, num_reqs, longest), dtype=np.int64) if not k_max else \
        judged.accepted_at(k_max, (REPLAYS, num_reqs, longest), np.random.default_rng(_SEED))
    forward = np.array([0.0, *costs.draft_forward_costs(num_reqs)])  # [m]: one draft forward of m rows
    seconds = []
    for k in range(k_max + 1):
        advance = np.minimum(runs, k) + 1  # tokens each step emits, while its request runs
        before = np.cumsum(advance, axis=2) - advance  # tokens before each step
        running = before < lengths[:, None]
        drafts = np.where(running, np.minimum(k, max_lengths[:, None] - before - 1), 0)  # room for k + 1 tokens
        rows, tokens = running.sum(1), (running + drafts).sum(1)  # [replay, step]
        drafting = sum((forward[(drafts >= depth).sum(1)] for depth in range(1, k + 1)), np.zeros(rows.shape))
        first = timing.first_step_seconds + drafting[0, 0] + costs.verify_cost(num_reqs, tokens[0, 0]) - \
            costs.verify_cost(num_reqs, num_reqs + timing.first_step_drafts)
        later = rows[:, 1:] > 0
        shapes, where = np.unique(rows[:, 1:][later] * (num_reqs * (k + 1) + 1) + tokens[:, 1:][later],
                                  return_inverse=True)  # each step's (rows, tokens), as one number
        verify = np.array([costs.verify_cost(*divmod(shape, num_reqs * (k + 1) + 1)) for shape in shapes.tolist()])
        total = verify[where].sum() + drafting[:, 1:][later].sum() + \
            timing.other_seconds_per_step * later.sum()
        seconds.append(first + total / len(rows))
    return seconds
