"""The measured guard: a speculation policy (spec/policy.py) around another, which lets it draft at a batch size only
where its drafted steps emitted tokens faster than steps without drafts, as this engine measured them: a policy's
model of what drafts cost and return can be wrong on a new model or machine; the guard trusts only the outcomes.

Per batch-size bucket (StepInfo.num_reqs by powers of 2: 1, 2-3, 4-7, ...), two arms: `drafted` (the inner policy
decides) and `plain` (K = 0), each with discounted sums over its measured decoding steps of tokens (rows + accepted
drafts; in a call's drain rows x StepInfo.advance, what brings the call's end closer) and seconds: its rate, tokens /
seconds, and that rate's standard error. Each measured step of a bucket discounts both arms by 1 - 1/_WINDOW: both cover
the same steps (batch sizes within the bucket, the machine's load), and old ones fade as acceptance changes. A bucket
runs its favoured arm (at first the nearest bucket's, else drafted), which changes when the other's rate beats it by
_MARGIN. Until each arm has _MIN_SAMPLES steps the arms alternate; then a step probes the other arm, at most once in
_PROBE_SPACING, while the rates' difference is unresolved (_Z standard errors wider than it and than _MARGIN): a faded
arm's error grows, so it is probed again, the sooner the closer the rates. A drafted step after two or more steps the
drafter skipped is charged for its drafting at most the mean a row of warm steps (the drafter catches up there on the
skipped tokens, which steady drafting spreads over its steps). Not measured: steps that prefill or admit a request (its
prompt's prefill, on the embedded engine, is in the step's seconds where the step itself decodes), unknown seconds, and
a step whose rows that verified drafts all have unknown acceptance (others count at the known rows' rate); a stalled
step counts _STALL times its arm's mean seconds at most. Verification is lossless, so a plain step emits the very tokens
a drafted one would: the guard costs speed only, never exactness.
"""

import math

from spec.policy import DraftPlan, SpeculationPolicy, StepInfo, StepOutcome
from spec.proposers.base import Proposal

PLAIN, DRAFTED = 0, 1  # the arms
_WINDOW = 512  # measured steps a bucket remembers (discount 1 - 1/512 a step: half-life 355 steps, several calls)
_MIN_SAMPLES = 4  # measured steps of each arm before a bucket's favoured arm may change (discounted: 3.5 of weight);
# until then the arms alternate, the quickest way to both
_PROBE_SPACING = 8  # then at most one step in 8 probes, and only while the rates' difference is within their errors
_Z = 2.0  # standard errors that resolve the rates' difference
_MARGIN = 0.01  # the other arm's rate must beat the favoured one's by this share to become favoured
_STALL = 3.0  # a step counts this many times its arm's mean seconds at most
_TIME_NOISE = 0.04  # the least relative spread of a step's seconds assumed (measured here: 3-5%)
_DRAFT_EMA = 1 / 16  # weight of a warm step in the mean drafting seconds per row
_DECAY = 1 - 1 / _WINDOW


class _Bucket:
    """One bucket: per arm [PLAIN, DRAFTED], the discounted sums of [1, tokens, seconds, tokens^2, seconds^2,
    tokens x seconds, accepted drafts] over its measured steps; the favoured arm."""

    def __init__(self, favoured: int):
        self.sums = [[0.0] * 7, [0.0] * 7]
        self.favoured = favoured
        self.is_measured = False  # each arm has had _MIN_SAMPLES measured steps
        self.since_probe = 0  # steps since the last probe

    def choose(self) -> int:
        """The arm of a decoding step: the favoured one, or a probe of the other."""
        self.since_probe += 1
        if self.since_probe >= (_PROBE_SPACING if self.is_measured else 2) and self.is_unresolved():
            self.since_probe = 0
            return 1 - self.favoured
        return self.favoured

    def add(self, arm: int, num_rows: int, num_accepted: float, seconds: float) -> None:
        weight, _, total = self.sums[arm][:3]
        if self.is_measured:
            seconds = min(seconds, _STALL * total / weight)
        tokens = num_rows + num_accepted
        sample = (1.0, tokens, seconds, tokens * tokens, seconds * seconds, tokens * seconds, num_accepted)
        self.sums = [[_DECAY * x + (a == arm) * y for x, y in zip(sums, sample)] for a, sums in enumerate(self.sums)]
        self.is_measured = self.is_measured or min(self.sums[PLAIN][0], self.sums[DRAFTED][0]) > _MIN_SAMPLES - 0.5
        other = 1 - self.favoured
        if self.is_measured and self.rate(other)[0] > self.rate(self.favoured)[0] * (1 + _MARGIN):
            self.favoured = other

    def is_unresolved(self) -> bool:
        """Not yet measured, or the rates' difference within _Z standard errors (and those wider than _MARGIN): as an
        arm's weight fades, its error grows, and it is probed again, the sooner the closer the rates."""
        if not self.is_measured:
            return True
        (plain, plain_error), (drafted, drafted_error) = self.rate(PLAIN), self.rate(DRAFTED)
        favoured = drafted if self.favoured == DRAFTED else plain
        return _Z * math.hypot(plain_error, drafted_error) > max(abs(drafted - plain), _MARGIN * favoured)

    def rate(self, arm: int) -> tuple[float, float]:
        """The arm's tokens per second and its standard error: a ratio estimator's (the spread of tokens - rate x
        seconds over the steps, over the seconds), but at least _TIME_NOISE / sqrt(weight) of the rate, and for drafted
        steps at least a Poisson count's of their accepted drafts plus one: a few steps that happened to accept
        alike (none, at low acceptance) do not pass for a precise rate. An arm that has weight."""
        weight, tokens, seconds, tokens2, seconds2, cross, accepted = self.sums[arm]
        rate = tokens / seconds
        spread = max(tokens2 - 2 * rate * cross + rate * rate * seconds2, accepted + 1 if arm == DRAFTED else 0.0)
        return rate, max(math.sqrt(spread) / tokens, _TIME_NOISE / math.sqrt(weight)) * rate


class MeasuredGuard:
    """`inner` drafts where its measured steps beat plain ones (module docstring); its state lasts across runs."""

    def __init__(self, inner: SpeculationPolicy):
        self.inner = inner
        self._buckets: dict[int, _Bucket] = {}  # log2 batch size -> its bucket
        self._last: tuple[StepInfo, int | None] | None = None  # the step last planned and its arm (None: the
        # schedule gave it no drafts, so it is no arm's)
        self._drafter_ran = False  # in the step last planned
        self._num_skipped = 0  # steps the drafter skipped before the step last planned
        self._draft_per_row: float | None = None  # mean drafting seconds a row of warm drafted steps
        self._running: set = set()  # the requests of the step last observed
        self.num_steps = self.num_plain_steps = self.num_probe_steps = 0  # this run's steps with an arm (the
        # schedule gave them drafts), those without drafts, the probes

    def begin_run(self) -> None:
        self.num_steps = self.num_plain_steps = self.num_probe_steps = 0
        self.inner.begin_run()

    def end_run(self) -> None:
        self.inner.end_run()

    def draft_limits(self, step: StepInfo) -> DraftPlan:
        arm = self._choose(step)
        plan = DraftPlan([0] * step.num_reqs, 0) if arm == PLAIN else self.inner.draft_limits(step)
        self._num_skipped = 0 if self._drafter_ran else self._num_skipped + 1
        self._drafter_ran, self._last = any(plan.num_drafts), (step, arm)
        return plan

    def select(self, step: StepInfo, proposal: Proposal, draft_seconds: float) -> list[int]:
        if self._last is not None and self._last[1] == PLAIN:
            return proposal.num_draft_tokens  # none
        return self.inner.select(step, proposal, draft_seconds)

    def observe(self, step: StepInfo, outcome: StepOutcome) -> None:
        self.inner.observe(step, outcome)
        is_admitting = not self._running.issuperset(step.req_ids)
        self._running = set(step.req_ids)
        if self._last is None or self._last[0] is not step or self._last[1] is None:
            return
        arm = self._last[1]
        if step.is_draining and None not in outcome.num_accepted:  # the call's end is what counts
            num_accepted = step.num_reqs * (step.advance(outcome.num_accepted) - 1)
        else:
            num_accepted = _num_accepted(outcome)
        if step.is_decoding and not is_admitting and outcome.seconds and num_accepted is not None:
            seconds = self._drafting_charged(step, outcome) if arm == DRAFTED else outcome.seconds
            self._buckets[step.num_reqs.bit_length()].add(arm, step.num_reqs, num_accepted, seconds)

    def stats(self) -> dict:
        """The inner policy's, and this run's share of steps the guard ran without drafts (of those the schedule
        gave drafts), its probe steps, and the buckets where it favours no drafts."""
        return {**self.inner.stats(), "guard_off_fraction": self.num_plain_steps / max(self.num_steps, 1),
                "guard_num_probe_steps": self.num_probe_steps,
                "guard_num_buckets_off": sum(b.favoured == PLAIN for b in self._buckets.values())}

    def _choose(self, step: StepInfo) -> int | None:
        """The step's arm; a step that prefills runs its bucket's favoured arm and probes nothing (it is not
        measured)."""
        if not any(step.max_drafts):
            return None
        bucket = self._bucket(step.num_reqs.bit_length())
        arm = bucket.choose() if step.is_decoding else bucket.favoured
        self.num_steps += 1
        self.num_plain_steps += arm == PLAIN
        self.num_probe_steps += arm != bucket.favoured
        return arm

    def _bucket(self, key: int) -> _Bucket:
        if key not in self._buckets:
            nearest = min(self._buckets, key=lambda b: (abs(b - key), -b), default=None)
            self._buckets[key] = _Bucket(DRAFTED if nearest is None else self._buckets[nearest].favoured)
        return self._buckets[key]

    def _drafting_charged(self, step: StepInfo, outcome: StepOutcome) -> float:
        """A drafted step's seconds, its drafting charged at most the mean a row of warm steps (the drafter ran
        after skipping one step at most) where the drafter skipped more (it caught up on their tokens there); a warm
        step teaches that mean."""
        per_row = outcome.draft_seconds / step.num_reqs
        if self._num_skipped <= 1:
            if not self._drafter_ran:
                return outcome.seconds
            mean = self._draft_per_row
            self._draft_per_row = per_row if mean is None else mean + _DRAFT_EMA * (per_row - mean)
            return outcome.seconds
        if self._draft_per_row is None:
            return outcome.seconds
        return outcome.seconds - max(per_row - self._draft_per_row, 0.0) * step.num_reqs


def _num_accepted(outcome: StepOutcome) -> float | None:
    """The step's accepted drafts; a row's unknown count (None) at the rate of the step's known rows; None where no
    known row verified a draft and an unknown one did."""
    if None not in outcome.num_accepted:
        return sum(outcome.num_accepted)
    verified = outcome.verified.num_draft_tokens
    known = [(n, v) for n, v in zip(outcome.num_accepted, verified) if n is not None]
    num_known = sum(v for _, v in known)
    unknown = sum(v for n, v in zip(outcome.num_accepted, verified) if n is None)
    if unknown and not num_known:
        return None
    num_accepted = sum(n for n, _ in known)
    return num_accepted + unknown * num_accepted / max(num_known, 1)
