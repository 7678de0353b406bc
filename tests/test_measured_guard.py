"""MeasuredGuard (spec/measured_guard.py): driven through the drafting host by a fake engine whose step costs and
acceptance are set (seeded noise, no wall time), then on the embedded engine with its clock priced per token. It
keeps drafting where drafts pay, turns them off where they lose, bucket by bucket, tolerates unknown outcomes and
times, decides the same way from the same observations, and changes no sample."""

import random

import pytest
from conftest import priced

from rollout import RolloutGenerator, SamplingParams
from spec import DraftRequest, Proposal, StaticPolicy, StepInfo
from spec.drafting_host import DraftingHost
from spec.measured_guard import MeasuredGuard

K = 4


class Repeat:
    """Drafts token 3 as deep as the host allows. Each call costs it, on its engine's clock, `catch_up` seconds a row
    for every step since its last call: the tokens it skipped, which it syncs (as the suffix drafters do)."""

    def __init__(self, engine: "FakeEngine", catch_up: float):
        self.engine, self.catch_up, self.last_step = engine, catch_up, None

    def propose(self, requests, max_num_tokens) -> Proposal:
        skipped = 0 if self.last_step is None else self.engine.num_steps - self.last_step - 1
        self.engine.now += self.catch_up * skipped * len(requests)
        self.last_step = self.engine.num_steps
        return Proposal([[3] * n for n in max_num_tokens], [[0.5] * n for n in max_num_tokens])


class FakeEngine:
    """Steps whose rows are offered K drafts, each accepted with probability `acceptance` given the ones before it,
    and which cost the drafter's seconds plus seconds(rows, verified drafts) times a seeded noise of 4%. unknown: the
    share of rows whose acceptance is unknown (None), and of steps whose seconds are. draining: the steps are a
    call's drain, every row as far from its end."""

    def __init__(self, policy, seconds, acceptance: float, seed: int = 0, unknown: float = 0.0,
                 catch_up: float = 0.0, draining: bool = False):
        self.now = 0.0  # the drafter's clock
        self.host = DraftingHost(Repeat(self, catch_up), policy, vocab_size=8, verifies_draft_probs=False,
                                 clock=lambda: self.now)
        self.seconds, self.acceptance, self.unknown = seconds, acceptance, unknown
        self.draining = draining  # the steps are a call's drain, every row with as many tokens left
        self.rng = random.Random(seed)
        self.num_tokens, self.elapsed = 0, 0.0  # emitted and true seconds, over every step
        self.drafted: list[bool] = []  # per step: drafts verified

    @property
    def num_steps(self) -> int:
        return len(self.drafted)

    def run(self, num_rows: int, num_steps: int) -> None:
        for _ in range(num_steps):
            self.step(num_rows)

    def step(self, num_rows: int) -> None:
        step = StepInfo(list(range(num_rows)), [1] * num_rows, [K] * num_rows, K,
                        *(([1000] * num_rows, 0) if self.draining else ()))
        drafts = self.host.draft(step, lambda: [DraftRequest(r, 0, [3], 1) for r in range(num_rows)])
        verified = drafts.verified.num_draft_tokens
        accepted = [next((j for j in range(n) if self.rng.random() >= self.acceptance), n) for n in verified]
        seconds = drafts.seconds + self.seconds(num_rows, sum(verified)) * self.rng.uniform(0.96, 1.04)
        self.num_tokens += num_rows + sum(accepted)
        self.elapsed += seconds
        self.drafted.append(any(verified))
        reported = [None if self.rng.random() < self.unknown else n for n in accepted]
        self.host.observe(drafts, reported, None if self.rng.random() < self.unknown else seconds, seconds)

    @property
    def rate(self) -> float:
        return self.num_tokens / self.elapsed


def _rates(seconds, acceptance: float, num_rows: int, num_steps: int, **kwargs) -> tuple[float, float, FakeEngine]:
    """Tokens per second with drafts always offered, with none, and the guarded engine (whose steps it returns)."""
    always = FakeEngine(StaticPolicy(), seconds, acceptance)
    always.run(num_rows, num_steps)
    plain = FakeEngine(StaticPolicy(), seconds, acceptance)
    plain.host.drafter = None
    plain.run(num_rows, num_steps)
    guarded = FakeEngine(MeasuredGuard(StaticPolicy()), seconds, acceptance, **kwargs)
    guarded.run(num_rows, num_steps)
    return always.rate, plain.rate, guarded


def _cpu(num_rows: int, num_drafts: int) -> float:
    """A CPU-like step: every token verified costs nearly as much as a row."""
    return 0.01 + 0.005 * num_rows + 0.0005 * num_drafts


def _gpu(num_rows: int, num_drafts: int) -> float:
    """A step with a fixed cost that small batches do not fill: drafts are nearly free at one row, dear at 64."""
    return 0.02 + 0.0002 * (num_rows + num_drafts)


def test_where_drafts_pay_the_guard_keeps_drafting():
    """Drafts accepted 80% of the time and almost free: drafting runs at 3x no drafts. The guard's probes (steps
    without drafts: 4 while the arms alternate, then hardly any, the rates being far apart) cost it under 1%."""
    always, plain, guarded = _rates(lambda r, d: 0.028 + 0.0001 * d, 0.8, num_rows=8, num_steps=2000)
    assert always > 2.5 * plain
    assert guarded.rate >= 0.99 * always
    stats = guarded.host.policy.stats()
    assert stats["guard_num_buckets_off"] == 0 and 0 < stats["guard_num_probe_steps"]
    assert stats["guard_off_fraction"] == pytest.approx(1 - sum(guarded.drafted) / 2000) and \
        stats["guard_off_fraction"] < 0.01


def test_where_drafts_lose_the_guard_turns_them_off():
    """Drafts accepted 20% of the time, each verified one costing a tenth of a row: drafting runs at 0.9x no drafts.
    The guard stops drafting after its first 10 steps (the arms alternate until each has 4), then drafts only in
    probes, about one step in 200: it runs at 0.99x no drafts or better."""
    always, plain, guarded = _rates(_cpu, 0.2, num_rows=64, num_steps=2000)
    assert 0.85 < always / plain < 0.95
    assert not any(guarded.drafted[10:100])
    assert 0 < sum(guarded.drafted[10:]) <= 0.01 * 1990
    assert guarded.rate >= 0.99 * plain


def test_drafts_that_start_to_pay_are_turned_back_on():
    """Acceptance rises from 0.2 (drafting at 0.9x) to 0.7 (2x) after 1000 steps, as a prompt's history grows; the
    drafter syncs the steps it skipped when it drafts again (0.1 ms a row and step: a probe 200 steps after the last
    drafts for 1.3 s, 4 plain steps). The guard probes, finds drafts pay, and drafts again within 300 steps: its
    first probes after long skips, charged their own drafting time, would read drafts as losing."""
    guarded = FakeEngine(MeasuredGuard(StaticPolicy()), _cpu, 0.2, catch_up=0.0001)
    guarded.run(64, 1000)
    assert sum(guarded.drafted[500:]) < 10
    guarded.acceptance = 0.7
    guarded.run(64, 1000)
    assert all(guarded.drafted[1300:])


def test_the_buckets_are_independent():
    """One cost, two batch sizes: drafting wins at 1 row (1.9x) and loses at 64 (0.76x); calls of 30 steps at 64
    rows then 30 at one, as a drain would run them. The guard drafts at 1 row and not at 64."""
    guard = MeasuredGuard(StaticPolicy())
    engine = FakeEngine(guard, _gpu, 0.5)
    for _ in range(40):
        engine.run(64, 30)
        engine.run(1, 30)
    last_call = engine.drafted[-60:]
    assert sum(last_call[:30]) <= 2 and sum(last_call[30:]) >= 28
    assert guard.stats()["guard_num_buckets_off"] == 1


def test_a_drained_step_advances_the_calls_end_by_the_fall_of_the_most_tokens_left():
    draining = StepInfo([0, 1, 2, 3], [1] * 4, [4] * 4, 4, num_left=[5, 7, 7, 3], num_waiting=0)
    assert draining.is_draining
    for unknown in (dict(num_left=[5, 7, 7, 3], num_waiting=2), dict(num_left=None, num_waiting=0), {}):
        assert not StepInfo([0, 1, 2, 3], [1] * 4, [4] * 4, 4, **unknown).is_draining  # requests wait, or unknown
    assert draining.advance([0, 0, 0, 0]) == 1
    assert draining.advance([4, 3, 0, 0]) == 1  # row 2, with the most left, accepted none
    assert draining.advance([0, 2, 1, 0]) == 2  # rows 1 and 2 at 4 and 5 left: the most left fell from 7 to 5
    assert draining.advance([0, 4, 4, 0]) == 3  # row 0 (5 left, then 4) now has the most: 7 - 4


def test_in_a_calls_drain_the_guard_counts_what_brings_its_end_closer():
    """16 rows, all as far from their ends, drafts accepted half the time at a third of a row's cost each: drafted
    steps emit 1.25x the tokens a second of plain ones, yet the call's end comes closer faster only where all 16 rows
    accept (2^-16 of steps): in a drain the guard turns drafting off, where a call with requests waiting keeps it."""
    cost = lambda rows, drafts: 0.02 + 0.0006 * rows + 0.0002 * drafts  # noqa: E731
    always, plain, waiting = _rates(cost, 0.5, num_rows=16, num_steps=1000)
    assert always > 1.2 * plain and sum(waiting.drafted) > 0.95 * 1000
    draining = FakeEngine(MeasuredGuard(StaticPolicy()), cost, 0.5, draining=True)
    draining.run(16, 1000)
    assert sum(draining.drafted[20:]) < 0.02 * 980


def test_unknown_outcomes_and_times_are_tolerated():
    """A third of the rows' acceptance and a third of the steps' seconds unknown: the guard still turns losing
    drafts off; with every step's seconds unknown it measures nothing, and never turns them off."""
    _, plain, guarded = _rates(_cpu, 0.2, num_rows=64, num_steps=2000, unknown=1 / 3)
    assert guarded.rate >= 0.98 * plain
    unmeasured = FakeEngine(MeasuredGuard(StaticPolicy()), _cpu, 0.2, unknown=1.0)
    unmeasured.run(64, 200)
    assert unmeasured.host.policy.stats()["guard_num_buckets_off"] == 0


def test_the_same_observations_give_the_same_decisions():
    runs = []
    for _ in range(2):
        engine = FakeEngine(MeasuredGuard(StaticPolicy()), _gpu, 0.5, seed=7)
        for num_rows in (64, 17, 5, 1) * 10:
            engine.run(num_rows, 20)
        runs.append(engine.drafted)
    assert runs[0] == runs[1] and 0 < sum(runs[0]) < len(runs[0])


PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9], [3, 4], [10, 11, 12, 13, 14, 10, 11, 12], [20, 21, 22], [30] * 6, [8, 2]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
HISTORY = {"method": "history", "num_speculative_tokens": K}  # the default drafter, K and (below) policy


def _priced(generator: RolloutGenerator, clock) -> RolloutGenerator:
    """Each target forward advances the engine's clock by 0.01 a row and 0.02 a further token (a draft, or a
    prompt's): a draft costs two rows, and even an accepted one loses time."""
    return priced(generator, clock, per_token=0.02, per_row=0.01)


@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "static"])
def test_on_the_engine_drafts_that_cannot_pay_are_turned_off(target, engine_clock, adaptive):
    """The history drafter, under adaptive verification or the static K, on a tiny target whose every verified draft
    costs two rows: guarded, 12 calls roll out what no speculation does, and from the 9th on run at its rate (by the
    engine's clock), drafting in at most one step in 20. The drafter's history makes its drafts right every time from
    the second call on: unguarded, the static K runs at 0.59x."""
    plain = _priced(RolloutGenerator(target, max_num_seqs=8, max_model_len=64), engine_clock)
    expected = plain.generate(PROMPTS, 2, GREEDY, use_tqdm=False)
    generator = _priced(RolloutGenerator(target, max_num_seqs=8, max_model_len=64), engine_clock)
    speculation = generator.build_speculation({**HISTORY, "enable_adaptive_verification": adaptive})
    speculation.policy = MeasuredGuard(speculation.policy)
    generator.use_speculation(speculation)
    batches = [generator.generate(PROMPTS, 2, GREEDY, use_tqdm=False) for _ in range(12)]
    for batch in batches:
        assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in expected.samples]
    assert batches[0].stats["num_draft_tokens"] > 0
    late = batches[8:]
    rate = sum(b.stats["num_completion_tokens"] for b in late) / sum(b.stats["elapsed_s"] for b in late)
    assert rate >= 0.98 * expected.stats["tokens_per_s"]
    assert min(b.stats["guard_off_fraction"] for b in late) >= 0.95
    assert late[-1].metrics["spec/guard_off_fraction"] == late[-1].stats["guard_off_fraction"]
