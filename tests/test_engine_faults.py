"""A failed call leaves the generator as it was (rollout/embedded_backend/engine.py, Failures): whatever raises inside
`generate`, at
any stage of a step, every cache slot of the target and of the draft model is free afterwards, the drafter holds no
request's state, the error seen is the original one, and the next call's greedy completions are a fresh generator's."""

import random

import pytest
import torch
from conftest import tiny_llama

import rollout.embedded_backend.engine
from rollout import RolloutGenerator, SamplingParams

PROMPTS = [[3, 4], [9], [10, 11, 12, 13, 14, 10], [5, 6, 7, 5, 6, 7, 5]]  # the longest completions last
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[43, 16])  # rows of 2-12 tokens
SPEC = {"method": "draft_model", "num_speculative_tokens": 3}
MAX_NUM_SEQS = 3  # below the 8 requests: admissions wait for slots, and finished rows leave holes to condense


class Injected(Exception):
    """The fault the tests raise."""


class Tripwire:
    """Counts the calls of every method it wraps, together, and raises `error` at call number `at` (1-based),
    before the wrapped call or after it."""

    def __init__(self, at: int | None = None, error: BaseException | None = None, after: bool = False):
        self.at, self.error, self.after = at, error, after
        self.num_calls = 0

    @property
    def fired(self) -> bool:
        return self.at is not None and self.num_calls >= self.at

    def wrap(self, function):
        def wrapped(*args, **kwargs):
            self.num_calls += 1
            if self.num_calls != self.at:
                return function(*args, **kwargs)
            if self.after:
                function(*args, **kwargs)
            raise self.error
        return wrapped


# (owner, method): the runners' slot operations and forwards, the drafter, the policy, and the engine's own stages
# (plan = schedule + prefill + condense, propose, verify = forward + rejection sampling, commit).
STAGES = [("target", "allocate"), ("target", "copy_prefix"), ("target", "forward"), ("target", "crop"),
          ("target", "free"), ("drafter", "propose"), ("drafter", "finish"), ("draft_runner", "allocate"),
          ("draft_runner", "copy_prefix"), ("draft_runner", "forward"), ("draft_runner", "crop"),
          ("draft_runner", "free"), ("policy", "begin_run"), ("policy", "draft_limits"), ("policy", "select"),
          ("policy", "observe"), ("policy", "end_run"), ("engine", "_plan"), ("engine", "_condense"),
          ("engine", "_verify"), ("engine", "_commit"), ("engine_module", "rejection_sample")]
# Called only inside the drafter's propose: an Exception there is a drafter fault, which costs the step its drafts
DRAFTER_STAGES = {("drafter", "propose"), ("draft_runner", "allocate"), ("draft_runner", "copy_prefix"),
                  ("draft_runner", "forward"), ("draft_runner", "crop")}


def _owners(generator) -> dict:
    backend = generator.backend
    return {"target": backend.runner, "drafter": backend.speculation.proposer, "draft_runner": backend.speculation.proposer.runner,
            "policy": backend.speculation.policy, "engine": rollout.embedded_backend.engine.Engine, "engine_module": rollout.embedded_backend.engine}


def _patch(monkeypatch, generator, stages, tripwire: Tripwire) -> None:
    owners = _owners(generator)
    for owner, name in stages:
        monkeypatch.setattr(owners[owner], name, tripwire.wrap(getattr(owners[owner], name)))


def _completions(batch) -> list[list[int]]:
    return [s.completion_ids for s in batch.samples]


def _assert_released_and_usable(generator, expected) -> None:
    backend = generator.backend
    assert backend.runner.num_free_slots == MAX_NUM_SEQS
    assert backend.speculation.proposer.runner.num_free_slots == MAX_NUM_SEQS
    assert backend.speculation.proposer.num_requests == 0
    assert _completions(generator.generate(PROMPTS, 2, GREEDY, use_tqdm=False)) == expected


@pytest.fixture(scope="module")
def plain(target):
    return _completions(RolloutGenerator(target, max_num_seqs=MAX_NUM_SEQS, max_model_len=48).generate(
        PROMPTS, 2, GREEDY, use_tqdm=False))


@pytest.fixture(scope="module")
def generator(target, draft):
    """One generator for every fault below: each must leave it as usable as new."""
    return RolloutGenerator(target, speculative_config=SPEC, draft_model=draft, max_num_seqs=MAX_NUM_SEQS,
                            max_model_len=48)


@pytest.fixture(scope="module")
def num_calls(generator) -> dict:
    """How often one call runs each stage; it must condense (move rows), or one stage would go untested."""
    tripwires = {stage: Tripwire() for stage in STAGES}
    with pytest.MonkeyPatch.context() as monkeypatch:
        for stage, tripwire in tripwires.items():
            _patch(monkeypatch, generator, [stage], tripwire)
        generator.generate(PROMPTS, 2, GREEDY, use_tqdm=False)
    counts = {stage: tripwire.num_calls for stage, tripwire in tripwires.items()}
    assert counts["target", "allocate"] > 2 * len(PROMPTS)  # more slots than requests: condense moved rows
    return counts


@pytest.mark.parametrize("stage", STAGES, ids=["-".join(stage) for stage in STAGES])
def test_a_fault_at_any_stage_leaves_nothing_behind(stage, generator, num_calls, plain, monkeypatch):
    """At every call of a stage run at most 10 times a call (the slot operations: every prefill copy and condense
    move), else at its first, a middle and its last: the call raises the injected error itself, or, inside the
    drafter's propose, loses that step's drafts and completes with the plain completions."""
    count = num_calls[stage]
    for at in range(1, count + 1) if count <= 10 else sorted({1, (count + 1) // 2, count}):
        error = Injected(f"{stage} call {at}")
        with monkeypatch.context() as patch:
            tripwire = Tripwire(at, error)
            _patch(patch, generator, [stage], tripwire)
            if stage in DRAFTER_STAGES:
                with pytest.warns(RuntimeWarning, match="faulted"):
                    batch = generator.generate(PROMPTS, 2, GREEDY, use_tqdm=False)
                assert batch.stats["num_drafter_faults"] == 1 and _completions(batch) == plain
            else:
                with pytest.raises(Injected) as raised:
                    generator.generate(PROMPTS, 2, GREEDY, use_tqdm=False)
                assert raised.value is error
        assert tripwire.fired
        _assert_released_and_usable(generator, plain)


def test_keyboard_interrupts_at_random_moments(generator, num_calls, plain, monkeypatch):
    """A KeyboardInterrupt (never a drafter fault) at a random call of any stage, raised before the call or after it
    (a slot allocated and not yet recorded, a slot freed and still recorded, ...), 50 seeded times."""
    total = sum(num_calls.values())
    rng = random.Random(0)
    for trial in range(50):
        interrupt = KeyboardInterrupt(f"trial {trial}")
        with monkeypatch.context() as patch:
            tripwire = Tripwire(rng.randint(1, total), interrupt, after=rng.random() < 0.5)
            _patch(patch, generator, STAGES, tripwire)
            with pytest.raises(KeyboardInterrupt) as raised:
                generator.generate(PROMPTS, 2, GREEDY, use_tqdm=False)
            assert raised.value is interrupt
        _assert_released_and_usable(generator, plain)


def _failing_finish(request):
    raise RuntimeError("finish failed")


def test_a_cleanup_that_fails_too_is_noted_on_the_original_error(target, monkeypatch):
    """A drafter without release_all whose finish() raises as well: the target's slots are all freed all the same,
    and the error seen is the original one, the finish() errors noted on it."""
    generator = RolloutGenerator(target, speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                                 max_num_seqs=4, max_model_len=48)
    error = Injected("the verification forward failed")
    tripwire = Tripwire(1, error)
    monkeypatch.setattr(generator.backend.runner, "forward", tripwire.wrap(generator.backend.runner.forward))
    monkeypatch.setattr(generator.backend.speculation.proposer, "finish", _failing_finish)
    with pytest.raises(Injected) as raised:
        generator.generate(PROMPTS, 2, GREEDY, use_tqdm=False)
    assert raised.value is error
    assert any("RuntimeError: finish failed" in note for note in raised.value.__notes__)
    assert generator.backend.runner.num_free_slots == 4


def test_non_finite_keys_of_a_failed_call_do_not_poison_the_next(plain):
    """A call whose target has a NaN weight fails (non-finite logits); with the weights restored, the next calls
    are a fresh generator's. The NaN keys and values it wrote stayed in the slots it used, where later rows read them
    at masked positions (NaN - inf and 0 * NaN are NaN) unless the failed call's release zeroes them."""
    target = tiny_llama(0)
    good = {name: p.detach().clone() for name, p in target.named_parameters()}
    generator = RolloutGenerator(target, max_num_seqs=MAX_NUM_SEQS, max_model_len=48)
    broken = dict(good, **{"model.layers.0.self_attn.v_proj.weight": good[
        "model.layers.0.self_attn.v_proj.weight"].clone().fill_(float("nan"))})
    generator.load_weights(broken.items())
    with pytest.raises(ValueError, match="non-finite logits.*non-finite target weights"):
        generator.generate([[2, 3] * 20] * MAX_NUM_SEQS, 1, GREEDY, use_tqdm=False)  # long: every slot, far in
    generator.load_weights(good.items())
    for _ in range(2):
        assert _completions(generator.generate(PROMPTS, 2, GREEDY, use_tqdm=False)) == plain
    assert not torch.isnan(generator.backend.runner.cache.keys).any()
