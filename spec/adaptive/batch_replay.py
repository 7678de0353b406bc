"""Replaying a finished closed batch at a uniform K: what it would have cost with K drafts offered to every request.

The replay keeps the batch's completions (verification is lossless: drafting does not change what a seeded batch
emits, nor what an unseeded one emits in distribution) and its measured prompt step and per-step overhead, and
re-decides where each step ends. It reads the batch's trace: at each position of each completion, whether the draft
the batch verified there was accepted or rejected, or that it verified none there (the token after a run of drafts
all accepted, a step that offered none). A replayed step at K from position s accepts the drafts from s up to the
first rejected one, at most K, and emits one token more: a draft depends on the tokens before it, which the replay
keeps, not on where its step began. A draft-model drafter drafting greedily reveals the outcome at the positions that
verified no draft (RequestAcceptance.revealed, spec/proposers/draft_model.py); positions still unseen (other
drafters, sampled drafts) are drawn, REPLAYS times, at their chances under a two-state Markov chain along each
completion (Trace.unseen_acceptance), by systematic sampling (Trace.draws), the same draws for every K.

A replayed step drafts, for each running request, K drafts or as many as its room allows (max_tokens and
max_model_len: k drafts emit up to k + 1 tokens), and none past its stop token where the drafter drafted it, as the
engine does. It costs the step-cost model's draft forwards over the rows still drafting at each depth (the first one
a token more per row whose drafts the replay accepted in full the step before), verifying one token per running
request plus its drafts, and the batch's measured time per step outside drafting and verification; once per batch,
at every K, its measured time moving requests down the cache past finished ones (a copy per finished request,
whatever K). Its first step (prompts) is the measured one less its drafting and its drafts' verification, plus the
replayed drafts' forwards and verification. The drafter's prompt prefill, what the measured first step's drafting
took beyond its own draft forwards in the model, is charged at every K >= 1 by the caller (`prefill_seconds`;
spec/adaptive/closed_batch.py takes its median over batches). At K = 0 a step is one token per running request.
"""

from dataclasses import dataclass

import numpy as np

from spec.metrics import RequestAcceptance
from spec.adaptive.step_cost import StepCostModel

ACCEPTED, REJECTED, UNSEEN = 1, 0, -1  # a position's draft in the batch's trace
PRIOR = 2.0  # a request's rates at unseen positions count the batch's with the weight of 2 of its own positions: a
# request with one or two verified drafts (or none) is not judged by them alone
REPLAYS = 8  # draws of the unseen positions: at 16 requests, one K's replayed time over another's moves by at most
# 0.6% (sd) between seeds
_SEED = 0  # common random numbers: every K and every batch replays the same draws


@dataclass
class BatchTiming:
    """Measured seconds of one engine run, filled step by step."""
    seconds: float = 0.0  # every step
    draft_seconds: float = 0.0  # proposing
    verify_seconds: float = 0.0  # target forward, rejection sampling, commit
    first_step_seconds: float = 0.0  # the first step (it prefills the prompts), less its drafting
    first_step_draft_seconds: float = 0.0  # the first step's drafting (the drafter prefills the prompts too)
    first_step_drafts: int = 0  # drafts the first step verified
    condense_seconds: float = 0.0  # moving requests down the cache past finished ones
    num_steps: int = 0

    def observe_step(self, seconds: float, draft_seconds: float, verify_seconds: float, num_drafts: int = 0,
                     condense_seconds: float = 0.0) -> None:
        if not self.num_steps:
            self.first_step_seconds, self.first_step_drafts = seconds - draft_seconds, num_drafts
            self.first_step_draft_seconds = draft_seconds
        self.seconds += seconds
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        self.condense_seconds += condense_seconds
        self.num_steps += 1

    @property
    def other_seconds_per_step(self) -> float:
        """Mean seconds per step outside drafting, verification and moving requests (scheduling, bookkeeping)."""
        outside = self.seconds - self.draft_seconds - self.verify_seconds - self.condense_seconds
        return outside / max(self.num_steps, 1)


class Trace:
    """Per request and completion position: whether the draft the batch verified there was accepted or rejected (or
    would have been, where the drafter revealed it), or that it verified none there (module docstring)."""

    def __init__(self, records: list[RequestAcceptance], lengths: list[int]):
        self.outcomes = np.full((len(records), max(lengths)), UNSEEN, dtype=np.int8)
        self.first_drafts = np.array([record.k_per_step[0] if record.k_per_step else 0 for record in records])
        for row, record in zip(self.outcomes, records):
            start = 0  # the step's first position: its first draft's, or its one token's where it offered none
            for offered, accepted in zip(record.k_per_step, record.num_accepted_per_step):
                row[start:start + accepted] = ACCEPTED
                if accepted < offered and start + accepted < len(row):
                    row[start + accepted] = REJECTED
                start += accepted + 1
            for position, was_accepted in record.revealed.items():  # positions that verified no draft
                row[position] = ACCEPTED if was_accepted else REJECTED

    def unseen_acceptance(self) -> np.ndarray:
        """[request, position]: the chance a draft at the position would be accepted, where no draft was verified.
        Acceptance as a two-state Markov chain along the completion, per request (its rates counting the batch's with
        weight PRIOR): after an accepted draft, at its rate after accepted drafts, given the position after it where
        that is seen (the chain's posterior: the token after a run of drafts all accepted, where the next step's first
        draft was accepted too, is likelier accepted than that rate says); its rate over all positions otherwise. The
        trace must hold a verified draft."""
        seen, accepted = self.outcomes != UNSEEN, self.outcomes == ACCEPTED
        rejected = seen & ~accepted
        after_accepted, after_rejected = _shifted(accepted, 1), _shifted(rejected, 1)
        overall, batch = _rates(seen, accepted, None)
        following = _rates(seen & after_accepted, accepted, batch)[0][:, None]  # P(accepted | accepted before)
        recovering = _rates(seen & after_rejected, accepted, batch)[0][:, None]  # P(accepted | rejected before)
        next_accepted, next_rejected = _shifted(accepted, -1), _shifted(rejected, -1)
        likely = following * np.where(next_accepted, following, np.where(next_rejected, 1 - following, 1.0))
        unlikely = (1 - following) * np.where(next_accepted, recovering, np.where(next_rejected, 1 - recovering, 1.0))
        return np.where(after_accepted, likely / np.maximum(likely + unlikely, 1e-12), overall[:, None])

    def draws(self, num_draws: int, rng: np.random.Generator) -> np.ndarray:
        """[draw, request, position]: whether a draft there is accepted, the unseen positions drawn by systematic
        sampling along each completion: each at its chance, and as many accepted in a request as the sum of their
        chances, rounded up or down. Drawn independently, the counts spread, and a batch's slowest request with them:
        from batches run at K = 4, the replays ran K = 8 9.6% too many steps, against 5.9% (default workload, 16
        requests; from K = 1 and 2, 11-18% against 7-14%)."""
        unseen = self.outcomes == UNSEEN
        chance = np.where(unseen, self.unseen_acceptance(), 0.0)
        cumulative = np.cumsum(chance, axis=1)
        offset = rng.random((num_draws, len(chance), 1))
        drawn = np.floor(cumulative + offset) > np.floor(cumulative - chance + offset)
        return np.where(unseen, drawn, self.outcomes == ACCEPTED)


def _shifted(mask: np.ndarray, by: int) -> np.ndarray:
    """mask moved `by` positions along each row (1: each position reads the one before it), False where it runs off."""
    out = np.zeros_like(mask)
    if by > 0:
        out[:, by:] = mask[:, :-by]
    else:
        out[:, :by] = mask[:, -by:]
    return out


def _rates(where: np.ndarray, accepted: np.ndarray, fallback: float | None) -> tuple[np.ndarray, float]:
    """Per request, the acceptance rate over `where`, counting the batch's (or `fallback` where `where` is empty)
    with weight PRIOR; and the batch's."""
    num, num_accepted = where.sum(1), (where & accepted).sum(1)
    batch = num_accepted.sum() / num.sum() if num.sum() else fallback
    return (num_accepted + PRIOR * batch) / (num + PRIOR), batch


def replayed_seconds(lengths: list[int], max_lengths: list[int], trace: Trace | None, k_max: int,
                     timing: BatchTiming, costs: StepCostModel) -> list[float]:
    """Mean seconds of REPLAYS replays of the batch with k drafts offered to every running request per step, for
    k = 0 .. k_max, less the drafter's prompt prefill (module docstring); lengths: the completions', max_lengths: the
    most each request had room for. Every k replays the same draws, so their differences are not the draws' noise."""
    lengths, max_lengths = np.asarray(lengths), np.asarray(max_lengths)
    running = np.arange(lengths.max()) < lengths[:, None]  # without drafts, one token a step
    none = np.zeros(running.shape, dtype=np.int64)[None, None]
    seconds = _seconds(running[None, None], none, none, timing, costs)
    if k_max:
        accepted = trace.draws(REPLAYS, np.random.default_rng(_SEED))
        seconds += _seconds(*_steps(accepted, lengths, max_lengths, k_max), timing, costs)
    return seconds


def prefill_seconds(trace: Trace, timing: BatchTiming, costs: StepCostModel) -> float:
    """The measured first step's drafting beyond what its draft forwards cost in the model: the drafter prefills the
    prompts there (at 256 requests that is most of the step's drafting), at any K >= 1; 0 where it drafted nothing."""
    first_drafts = trace.first_drafts
    if not first_drafts.any():
        return 0.0
    forward = costs.draft_forward_costs(len(first_drafts))
    rows = [(first_drafts >= depth).sum() for depth in range(1, first_drafts.max() + 1)]  # per draft forward
    return max(timing.first_step_draft_seconds - sum(forward[n - 1] for n in rows), 0.0)


def _steps(accepted: np.ndarray, lengths: np.ndarray, max_lengths: np.ndarray, k_max: int):
    """Per k = 1 .. k_max, each replayed step's running requests, the drafts it offers them, and whether the drafter
    is fed 2 tokens there, not 1: [k, draw, request, step]. A step offers k drafts, or as many as the request's room
    allows (k drafts emit up to k + 1 tokens), and none past its stop token where the drafter drafted it (its draft
    there accepted: the engine drops a proposal's drafts after a stop token); it emits the accepted run from where the
    request stands, plus one token. Where every draft of the request's last step was accepted, the drafter's first
    forward feeds it that step's last draft (never fed: it was drafted from the one before) and the token after it
    (spec/proposers/draft_model.py); at K = 1 on the default workload that is 9 rows in 10, and at 256 requests such
    a forward took 17-18 ms where the draft curve's one token per row reads 10."""
    num_draws, num_reqs, longest = accepted.shape
    positions = np.arange(longest)
    first_rejected = np.minimum.accumulate(np.where(accepted, longest, positions)[..., ::-1], axis=2)[..., ::-1]
    runs = (first_rejected - positions).ravel()  # drafts accepted from each position on
    stop_drafted = accepted[:, np.arange(num_reqs), lengths - 1]  # [draw, request]
    ends = np.where(stop_drafted, np.minimum(lengths + 1, max_lengths), max_lengths)  # the most tokens a step reaches
    offset = (np.arange(num_draws)[:, None] * num_reqs + np.arange(num_reqs)) * longest  # [draw, request] in runs
    ks = np.arange(1, k_max + 1)[:, None, None]
    before = np.zeros((k_max, num_draws, num_reqs), dtype=np.int64)  # tokens emitted before the step
    all_accepted = np.zeros(before.shape, dtype=bool)  # the last step's drafts, if any
    steps_running, steps_drafts, steps_wide = [], [], []
    while True:
        running = before < lengths
        if not running.any():
            return np.stack(steps_running, axis=3), np.stack(steps_drafts, axis=3), np.stack(steps_wide, axis=3)
        drafts = np.where(running, np.minimum(ks, ends - before - 1), 0)
        steps_wide.append(all_accepted & (drafts > 0))
        emitted = np.minimum(runs[offset + np.minimum(before, longest - 1)], drafts)
        all_accepted = (drafts > 0) & (emitted == drafts)
        before = before + emitted + 1
        steps_running.append(running)
        steps_drafts.append(drafts)


def _seconds(running: np.ndarray, drafts: np.ndarray, wide: np.ndarray, timing: BatchTiming,
             costs: StepCostModel) -> list[float]:
    """Per k, the mean seconds of the replays of the steps given by running, drafts and wide ([k, draw, request,
    step]): the measured first step, less its own drafts' verification, plus its replayed drafts' forwards and
    verification; then each step's draft forwards (the first one a token per row, and another per wide row),
    verification and measured time outside both."""
    num_reqs = running.shape[2]
    forward = np.array([0.0, *costs.draft_forward_costs(2 * num_reqs)])  # [m]: one draft forward of m tokens
    rows, tokens = running.sum(2), (running + drafts).sum(2)  # [k, draw, step]
    drafting = sum((forward[(drafts >= depth).sum(2) + (wide.sum(2) if depth == 1 else 0)]
                    for depth in range(1, int(drafts.max()) + 1)), np.zeros(rows.shape))
    own_drafts = costs.verify_cost(num_reqs, num_reqs + timing.first_step_drafts)
    first = [timing.first_step_seconds + drafted + costs.verify_cost(num_reqs, verified) - own_drafts
             for drafted, verified in zip(drafting[:, 0, 0].tolist(), tokens[:, 0, 0].tolist())]
    later = rows[..., 1:] > 0
    width = int(tokens.max()) + 1
    # each later step's (rows, tokens) as one number, and the verification cost of each such shape once
    shapes, where = np.unique(rows[..., 1:][later] * width + tokens[..., 1:][later], return_inverse=True)
    verify = np.zeros(later.shape)
    verify[later] = np.array([costs.verify_cost(*divmod(shape, width)) for shape in shapes.tolist()])[where]
    total = (verify + (drafting[..., 1:] + timing.other_seconds_per_step) * later).sum((1, 2)) / rows.shape[1]
    return [f + t + timing.condense_seconds for f, t in zip(first, total.tolist())]
