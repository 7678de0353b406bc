"""End-to-end engine behaviour on tiny random models: losslessness, logprobs, stops, records, determinism."""

import gc

import pytest
import torch

from rollout import RolloutGenerator, SamplingParams
from spec import Proposal, StaticPolicy
from spec.sampling import SamplingTensors, processed_logprobs

PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9], [3, 4], [10, 11, 12, 13, 14, 10, 11, 12], [20, 21, 22], [30] * 6, [8, 2]]
SCHEDULE = [[1, 2, 4], [3, 4, 2], [5, 64, 1]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


class EchoDrafter:
    """A custom drafter for the tests: repeats the request's last tokens."""

    def __init__(self, config):
        pass

    def propose(self, requests, max_num_tokens):
        tokens = [r.token_ids[-k:] if k else [] for r, k in zip(requests, max_num_tokens)]
        return Proposal(tokens, [[0.5] * len(t) for t in tokens])


class StopThenMore:
    """Proposes the EOS token (id 1) followed by two more drafts."""

    def __init__(self, config):
        pass

    def propose(self, requests, max_num_tokens):
        tokens = [[1, 5, 6][:k] for k in max_num_tokens]
        return Proposal(tokens, [[0.5] * len(t) for t in tokens])


def _generator(target, config=None, draft_model=None, max_num_seqs=3, seed=0):
    return RolloutGenerator(target, speculative_config=config, draft_model=draft_model,
                            max_num_seqs=max_num_seqs, max_model_len=64, seed=seed)


def _spec(method, **extra):
    return {"method": method, "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": SCHEDULE,
            **extra}


SPECS = {
    "ngram": lambda target, draft: (_spec("ngram", prompt_lookup_min=1), None),
    "suffix": lambda target, draft: (_spec("suffix"), None),
    "history": lambda target, draft: (_spec("history"), None),
    "draft_model_self": lambda target, draft: (_spec("draft_model"), target),
    "draft_model_other": lambda target, draft: (_spec("draft_model"), draft),
    "draft_model_probabilistic": lambda target, draft: (_spec("draft_model", draft_sample_method="probabilistic"),
                                                        draft),
    "custom_class": lambda target, draft: (_spec("custom_class", model=f"{__name__}.EchoDrafter"), None),
}


@pytest.fixture(scope="module")
def plain_greedy(target):
    return _generator(target).generate(PROMPTS, 2, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("name", SPECS)
def test_greedy_speculative_equals_greedy_plain(name, target, draft, plain_greedy):
    config, draft_model = SPECS[name](target, draft)
    batch = _generator(target, config, draft_model).generate(PROMPTS, 2, GREEDY, use_tqdm=False)
    assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in plain_greedy.samples]
    for spec_sample, plain_sample in zip(batch.samples, plain_greedy.samples):
        assert spec_sample.logprobs == pytest.approx(plain_sample.logprobs, abs=1e-4)
    assert batch.stats["num_draft_tokens"] > 0  # speculation really ran
    if name == "draft_model_self":
        assert batch.stats["draft_acceptance_rate"] > 0.95  # the target drafting for itself is always right


SAMPLED = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, max_tokens=24, seed=3)


@pytest.fixture(scope="module")
def plain_sampled(target):
    return _generator(target).generate(PROMPTS, 2, SAMPLED, use_tqdm=False)


@pytest.mark.parametrize("name", [name for name in SPECS if name != "draft_model_probabilistic"])
def test_seeded_sampling_with_point_proposals_equals_seeded_plain_sampling(name, target, draft, plain_sampled):
    """Each position's token is drawn from its own uniform (spec/uniforms.py), so with point proposals the drafts
    change how many forwards a completion takes, never its tokens."""
    config, draft_model = SPECS[name](target, draft)
    batch = _generator(target, config, draft_model).generate(PROMPTS, 2, SAMPLED, use_tqdm=False)
    assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in plain_sampled.samples]
    for spec_sample, plain_sample in zip(batch.samples, plain_sampled.samples):
        assert spec_sample.logprobs == pytest.approx(plain_sample.logprobs, abs=1e-4)
    assert batch.stats["num_accepted_draft_tokens"] > 0  # drafts were accepted: positions were split across steps


def test_samples_come_back_in_input_order(plain_greedy):
    assert [(s.prompt_index, s.sample_index) for s in plain_greedy.samples] == \
           [(i, j) for i in range(len(PROMPTS)) for j in range(2)]
    assert [s.prompt_ids for s in plain_greedy.samples[::2]] == PROMPTS


def test_k_follows_the_live_batch_size(target):
    batch = _generator(target, _spec("ngram", prompt_lookup_min=1), max_num_seqs=5).generate(
        PROMPTS, 2, GREEDY, use_tqdm=False)
    k_per_batch_size = batch.stats["k_per_batch_size"]
    expected = {1: 4, 2: 4, 3: 2, 4: 2, 5: 1}
    assert {b: set(counts) for b, counts in k_per_batch_size.items()} == {b: {expected[b]} for b in k_per_batch_size}
    assert 5 in k_per_batch_size and len(k_per_batch_size) > 1  # the batch really fluctuated
    assert all(k <= 4 for s in batch.samples for k in s.acceptance["k_per_step"])


def test_logprobs_equal_a_fresh_forward_of_the_target(target, draft):
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=16)
    batch = _generator(target, _spec("draft_model", draft_sample_method="probabilistic"), draft).generate(
        PROMPTS, 2, params, use_tqdm=False)
    sampling = SamplingTensors.build([0.8], [20], [0.9])
    for sample in batch.samples:
        ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
        logits = target(ids).logits[0, len(sample.prompt_ids) - 1:-1]  # [num_completion, vocab]
        logp = processed_logprobs(logits, sampling.select([0] * logits.shape[0]))
        expected = logp[torch.arange(len(sample.completion_ids)), sample.completion_ids].tolist()
        # float32 ragged vs full forward differ by ~1e-6 in logits; 1e-4 leaves room for accumulation order
        assert sample.logprobs == pytest.approx(expected, abs=1e-4)


def test_the_batch_is_condensed_into_its_lowest_slots(target, draft):
    """Rows finish out of slot order (at max_model_len: the longest prompt first); the engine moves the rows above
    the holes down, so every target forward reads slots 0 .. n - 1 (one slice of the cache), and the moved caches
    still give the target's own logprobs."""
    gen = RolloutGenerator(target, speculative_config=_spec("draft_model"), draft_model=draft, max_num_seqs=8,
                           max_model_len=24)
    seen = []
    forward = gen.backend.runner.forward
    gen.backend.runner.forward = lambda slots, token_ids, num_logits: seen.append(list(slots)) or forward(
        slots, token_ids, num_logits)
    prompts = [[5 + i] * length for i, length in enumerate((2, 9, 4, 12, 1, 7, 3, 6))]
    batch = gen.generate(prompts, 1, SamplingParams(temperature=1.0, max_tokens=30, seed=3), use_tqdm=False)
    sizes = {len(slots) for slots in seen}
    assert 8 in sizes and len(sizes) >= 4  # the batch shrank through holes
    assert all(sorted(slots) == list(range(len(slots))) for slots in seen)
    for sample in batch.samples:
        ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
        logits = target(ids).logits[0, len(sample.prompt_ids) - 1:-1]
        logp = torch.log_softmax(logits, dim=-1)
        expected = logp[torch.arange(len(sample.completion_ids)), sample.completion_ids].tolist()
        assert sample.logprobs == pytest.approx(expected, abs=1e-4)  # as in the test above


def test_the_moves_are_timed_apart_from_a_step_s_other_work(target, engine_clock):
    """The policy is told each step's moves apart from its drafting and verification (spec/policy.py StepOutcome;
    closed-batch replays charge the moves once per batch). On a clock that only a move (1 s) and a target forward
    (100 s) advance, each step's condense_seconds is its moves, its verify_seconds its one forward, its other parts
    nothing, and the run's seconds are its steps'."""
    gen = RolloutGenerator(target, max_num_seqs=8, max_model_len=24)
    outcomes, moves = [], []
    gen.backend.speculation.policy = Recording(outcomes)
    runner = gen.backend.runner
    copy_prefix, forward = runner.copy_prefix, runner.forward
    runner.copy_prefix = lambda *args: moves.append(engine_clock.advance(1.0)) or copy_prefix(*args)
    runner.forward = lambda *args: engine_clock.advance(100.0) or forward(*args)
    prompts = [[5 + i] * length for i, length in enumerate((2, 9, 4, 12, 1, 7, 3, 6))]
    batch = gen.generate(prompts, 1, SamplingParams(temperature=1.0, max_tokens=30, seed=3), use_tqdm=False)
    assert moves and sum(o.condense_seconds for o in outcomes) == len(moves)
    assert all(o.verify_seconds == 100.0 and o.draft_seconds == 0.0 for o in outcomes)
    assert all(o.seconds == o.condense_seconds + o.verify_seconds for o in outcomes)
    assert batch.stats["elapsed_s"] == sum(o.seconds for o in outcomes) == engine_clock.now


def test_the_drafters_time_is_reported(target, engine_clock):
    """A call's stats carry its proposing seconds (as vLLM's workers report theirs): on a clock that only a forward
    (100 s) and a proposal (2 s) advance, 2 s a drafting step; a call without a drafter reports none."""
    gen = _generator(target, _spec("custom_class", model=f"{__name__}.EchoDrafter"))
    propose, proposals = gen.backend.speculation.proposer.propose, []
    gen.backend.speculation.proposer.propose = lambda *args: proposals.append(engine_clock.advance(2.0)) or \
        propose(*args)
    forward = gen.backend.runner.forward
    gen.backend.runner.forward = lambda *args: engine_clock.advance(100.0) or forward(*args)
    batch = gen.generate(PROMPTS, 1, GREEDY, use_tqdm=False)
    assert proposals and batch.stats["drafter_seconds"] == 2 * len(proposals)
    assert batch.metrics["spec/drafter_time_fraction"] == batch.stats["drafter_seconds"] / batch.stats["elapsed_s"]
    assert "drafter_seconds" not in _generator(target).generate(PROMPTS, 1, GREEDY, use_tqdm=False).stats


class Recording(StaticPolicy):
    """The static policy, keeping every step's outcome (and, given `steps`, every step)."""

    def __init__(self, outcomes: list, steps: list | None = None):
        self.outcomes, self.steps = outcomes, steps

    def observe(self, step, outcome):
        self.outcomes.append(outcome)
        if self.steps is not None:
            self.steps.append(step)


def test_the_policy_sees_each_rows_tokens_left_and_the_requests_waiting(target):
    """7 prompts x 2 on 5 slots: requests wait until 9 have finished, then the call drains; each row's tokens left are
    max_tokens, or what max_model_len leaves, less its output so far."""
    gen = _generator(target, _spec("ngram", prompt_lookup_min=1), max_num_seqs=5)
    steps = []
    gen.backend.speculation.policy = Recording([], steps)
    batch = gen.generate(PROMPTS, 2, GREEDY, use_tqdm=False)
    waiting = [step.num_waiting for step in steps]
    assert waiting[0] == 2 * len(PROMPTS) - 5 and waiting == sorted(waiting, reverse=True) and waiting[-1] == 0
    assert [step.is_draining for step in steps] == [n == 0 for n in waiting]
    emitted = {}  # req_id -> tokens emitted before the step
    for step, outcome in zip(steps, gen.backend.speculation.policy.outcomes):
        for req_id, left, accepted in zip(step.req_ids, step.num_left, outcome.num_accepted):
            assert left == GREEDY.max_tokens - emitted.get(req_id, 0)
            emitted[req_id] = emitted.get(req_id, 0) + 1 + accepted
    assert sorted(emitted.values()) >= sorted(len(s.completion_ids) for s in batch.samples)


def test_the_start_up_heap_is_frozen_out_of_the_garbage_collectors_scans(target):
    """The generator's models and runners move to the permanent generation (gc.freeze, rollout/generator.py), so the
    collector's full scans during rollouts do not walk them; they still serve rollouts."""
    gc.unfreeze()  # what earlier tests froze is scanned again, the target among it
    assert any(obj is target for obj in gc.get_objects())
    gen = RolloutGenerator(target, max_model_len=16)
    scanned = {id(obj) for obj in gc.get_objects()}
    assert id(target) not in scanned and id(gen.backend.runner) not in scanned and gc.get_freeze_count() > 0
    batch = gen.generate([[2, 3]], 1, SamplingParams(max_tokens=4), use_tqdm=False)
    assert 1 <= len(batch.samples[0].completion_ids) <= 4


def test_records_sum_to_the_aggregate(target, draft):
    batch = _generator(target, _spec("draft_model"), draft).generate(PROMPTS, 3, SamplingParams(max_tokens=20),
                                                                     use_tqdm=False)
    for key in ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens"):
        assert batch.stats[key] == sum(s.acceptance[key] for s in batch.samples)
    for key in ("acceptance_histogram", "num_drafted_per_position", "num_accepted_per_position"):
        assert batch.stats[key] == [sum(col) for col in zip(*(s.acceptance[key] for s in batch.samples))]
    assert batch.stats["num_requests"] == len(batch.samples)
    emitted = sum(len(s.completion_ids) for s in batch.samples)
    assert batch.stats["num_completion_tokens"] == emitted
    assert sum(len(s.acceptance["k_per_step"]) for s in batch.samples) <= emitted  # >= 1 token per step
    verified = sum(len(s.acceptance["k_per_step"]) + s.acceptance["num_draft_tokens"] for s in batch.samples)
    assert batch.stats["verified_tokens_per_emitted_token"] == pytest.approx(verified / emitted)
    assert batch.metrics["spec/verified_tokens_per_emitted_token"] == batch.stats["verified_tokens_per_emitted_token"]


def test_finish_reasons(target):
    gen = _generator(target)
    batch = gen.generate(PROMPTS, 8, SamplingParams(temperature=1.0, max_tokens=12), use_tqdm=False)
    for s in batch.samples:
        assert 1 <= len(s.completion_ids) <= 12
        if s.finish_reason == "stop":
            assert s.completion_ids[-1] == 1 and 1 not in s.completion_ids[:-1]
        else:
            assert s.finish_reason == "length" and len(s.completion_ids) == 12 and 1 not in s.completion_ids
    assert {s.finish_reason for s in batch.samples} == {"stop", "length"}


def test_stop_token_ids_and_max_model_len(target, plain_greedy):
    first = plain_greedy.samples[0].completion_ids
    stop = first[2]
    batch = _generator(target).generate(PROMPTS[:1], 1, SamplingParams(temperature=0.0, max_tokens=24,
                                                                       stop_token_ids=[stop]), use_tqdm=False)
    sample = batch.samples[0]
    assert sample.finish_reason == "stop" and sample.completion_ids == first[:first.index(stop) + 1]
    short = RolloutGenerator(target, max_model_len=10).generate(PROMPTS[:1], 1, GREEDY, use_tqdm=False)
    assert short.samples[0].finish_reason == "length" and len(short.samples[0].completion_ids) == 10 - 7


@pytest.mark.parametrize("config_name", ["none", "draft_model_probabilistic"])
def test_determinism_with_a_seed(target, draft, config_name):
    config, draft_model = (None, None) if config_name == "none" else SPECS[config_name](target, draft)
    params = SamplingParams(temperature=1.0, max_tokens=16)

    def run(seed):
        gen = _generator(target, config, draft_model, seed=seed)
        return [s.completion_ids for s in gen.generate(PROMPTS, 2, params, use_tqdm=False).samples]

    assert run(0) == run(0)
    assert run(0) != run(1)
    gen = _generator(target, config, draft_model)
    first, second = (gen.generate(PROMPTS, 2, params, use_tqdm=False) for _ in range(2))
    assert [s.completion_ids for s in first.samples] != [s.completion_ids for s in second.samples]


def test_siblings_share_the_prompt_prefill(target):
    gen = _generator(target, max_num_seqs=8)
    fed = []
    forward = gen.backend.runner.forward
    gen.backend.runner.forward = lambda slots, token_ids, num_logits: fed.append(sum(map(len, token_ids))) or forward(
        slots, token_ids, num_logits)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]]
    batch = gen.generate(prompts, 4, SamplingParams(temperature=1.0, max_tokens=3), use_tqdm=False)
    # Each prompt but its last token is computed once, not 4 times; then every step feeds one token per row.
    assert fed[0] == (6 - 1) + (4 - 1)
    assert sum(fed) == fed[0] + sum(len(s.completion_ids) for s in batch.samples)


def test_drafts_after_a_stop_token_are_not_verified(target, plain_greedy):
    config = _spec("custom_class", model=f"{__name__}.StopThenMore")
    batch = _generator(target, config).generate(PROMPTS, 2, GREEDY, use_tqdm=False)
    assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in plain_greedy.samples]
    assert max(k for s in batch.samples for k in s.acceptance["k_per_step"]) == 1  # [1, 5, 6] cut to [1]


def test_sampling_params_seed_pins_a_call(target):
    gen = _generator(target)
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=5)
    first, second = (gen.generate(PROMPTS, 2, params, use_tqdm=False) for _ in range(2))
    assert [s.completion_ids for s in first.samples] == [s.completion_ids for s in second.samples]
    other = gen.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_tokens=12, seed=6), use_tqdm=False)
    assert [s.completion_ids for s in other.samples] != [s.completion_ids for s in first.samples]
