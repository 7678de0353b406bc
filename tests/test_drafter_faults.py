"""Drafter faults degrade, target faults fail (rollout/embedded_backend/engine.py, Failures): a drafter that raises or
proposes
something malformed costs its step's drafts, the completions stay those of plain decoding, and the call counts,
warns once, and stops drafting after max_drafter_faults; a drafter proposing ids outside the vocabulary is a bug."""

import copy
import math
import warnings

import pytest
import torch
from conftest import tiny_llama

from rollout import RolloutGenerator, SamplingParams
from spec import DrafterConfigError, Proposal

PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9], [3, 4], [10, 11, 12, 13, 14, 10, 11, 12]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
SEEDED = SamplingParams(temperature=0.9, top_k=20, max_tokens=16, seed=3)
VOCAB_SIZE = 48  # conftest's tiny_llama


def _echo(requests, max_num_tokens) -> Proposal:
    """Drafts that repeat each request's last tokens, confidence 0.5."""
    tokens = [r.token_ids[-k:] if k else [] for r, k in zip(requests, max_num_tokens)]
    return Proposal(tokens, [[0.5] * len(t) for t in tokens])


class Flaky:
    """Echo drafts, but every other call (the 2nd, 4th, ...) goes wrong in the way `fault` names."""

    fault = "raises"

    def __init__(self, config):
        self.num_calls = 0

    def propose(self, requests, max_num_tokens):
        self.num_calls += 1
        proposal = _echo(requests, max_num_tokens)
        if self.num_calls % 2:
            return proposal
        rows = [i for i, t in enumerate(proposal.token_ids) if t]
        return _break(proposal, rows[0], self.fault)


def _break(proposal: Proposal, row: int, fault: str) -> Proposal:
    if fault == "raises":
        raise RuntimeError("the drafter's index is corrupt")
    if fault == "nan_confidence":
        proposal.confidence[row][0] = math.nan
    elif fault == "confidence_above_one":
        proposal.confidence[row][0] = 1.5
    elif fault == "too_many_drafts":
        proposal.token_ids[row] = proposal.token_ids[row] * 20
    elif fault == "missing_confidences":
        proposal.confidence[row] = []
    elif fault == "nan_draft_probs":
        proposal.draft_probs = [torch.full((len(t), VOCAB_SIZE), 1.0 / VOCAB_SIZE) for t in proposal.token_ids]
        proposal.draft_probs[row][0, 0] = math.nan
    elif fault == "wrong_vocab_draft_probs":
        proposal.draft_probs = [torch.full((len(t), VOCAB_SIZE - 1), 1.0 / VOCAB_SIZE) for t in proposal.token_ids]
    elif fault in ("id_past_vocab", "negative_id"):
        proposal.token_ids[row][0] = VOCAB_SIZE if fault == "id_past_vocab" else -1
    return proposal


FAULTS = ["raises", "nan_confidence", "confidence_above_one", "too_many_drafts", "missing_confidences",
          "nan_draft_probs", "wrong_vocab_draft_probs"]


def _flaky_class(fault: str) -> str:
    """The import path of the Flaky drafter with this fault, for the config's `model`."""
    return f"{__name__}.Flaky_{fault}"


for _fault in FAULTS + ["id_past_vocab", "negative_id"]:  # one importable class per fault
    globals()[f"Flaky_{_fault}"] = type(f"Flaky_{_fault}", (Flaky,), {"fault": _fault})


def _generator(target, model: str, **kwargs) -> RolloutGenerator:
    config = {"method": "custom_class", "model": model, "num_speculative_tokens": 3}
    return RolloutGenerator(target, speculative_config=config, max_num_seqs=8, max_model_len=64, **kwargs)


def _completions(batch) -> list[list[int]]:
    return [s.completion_ids for s in batch.samples]


@pytest.fixture(scope="module")
def plain(target):
    generator = RolloutGenerator(target, max_num_seqs=8, max_model_len=64)
    return {params.temperature: _completions(generator.generate(PROMPTS, 2, params, use_tqdm=False))
            for params in (GREEDY, SEEDED)}


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_faulting_drafter_costs_its_steps_drafts_not_the_completions(target, plain, fault, params):
    generator = _generator(target, _flaky_class(fault), max_drafter_faults=100)
    with pytest.warns(RuntimeWarning) as caught:
        batch = generator.generate(PROMPTS, 2, params, use_tqdm=False)
    calls = generator.backend.speculation.proposer.inner.num_calls
    assert _completions(batch) == plain[params.temperature]
    assert batch.stats["num_drafter_faults"] == calls // 2 >= 2  # every other call
    assert batch.metrics["spec/num_drafter_faults"] == calls // 2
    assert batch.stats["num_draft_tokens"] > 0  # the good calls' drafts were verified
    faults = [w for w in caught if "faulted" in str(w.message)]
    assert len(faults) == 1 and f"Flaky_{fault}" in str(faults[0].message)  # once a call, naming the drafter


def test_the_warning_names_the_first_fault(target):
    generator = _generator(target, _flaky_class("raises"))
    with pytest.warns(RuntimeWarning, match="RuntimeError: the drafter's index is corrupt.*max_drafter_faults=8"):
        generator.generate(PROMPTS, 1, GREEDY, use_tqdm=False)


class AlwaysRaises:
    def __init__(self, config):
        self.num_calls = 0

    def propose(self, requests, max_num_tokens):
        self.num_calls += 1
        raise RuntimeError("no drafts today")


def test_speculation_stops_after_max_drafter_faults(target, plain):
    generator = _generator(target, f"{__name__}.AlwaysRaises", max_drafter_faults=3)
    for _ in range(2):  # the limit is per call
        with pytest.warns(RuntimeWarning):
            batch = generator.generate(PROMPTS, 2, GREEDY, use_tqdm=False)
        assert _completions(batch) == plain[0.0]
        assert batch.stats["num_drafter_faults"] == 3 and batch.stats["num_draft_tokens"] == 0
    assert generator.backend.speculation.proposer.inner.num_calls == 6


def test_max_drafter_faults_zero_makes_a_fault_fail_the_call(target):
    generator = _generator(target, f"{__name__}.AlwaysRaises", max_drafter_faults=0)
    with pytest.raises(RuntimeError, match="no drafts today"):
        generator.generate(PROMPTS, 2, GREEDY, use_tqdm=False)
    assert generator.backend.runner.num_free_slots == 8


@pytest.mark.parametrize("value", [-1, 2.5, True, "8", None])
def test_bad_max_drafter_faults(target, value):
    with pytest.raises(ValueError, match=f"max_drafter_faults={value!r}: must be an integer >= 0"):
        _generator(target, f"{__name__}.AlwaysRaises", max_drafter_faults=value)


@pytest.mark.parametrize("fault", ["id_past_vocab", "negative_id"])
def test_draft_ids_outside_the_vocabulary_are_a_bug_not_a_fault(target, fault):
    generator = _generator(target, _flaky_class(fault))
    with pytest.raises(DrafterConfigError, match=rf"Flaky_{fault}.*outside the target's vocabulary \[0, 48\).*bug"):
        generator.generate(PROMPTS, 2, GREEDY, use_tqdm=False)
    assert generator.backend.runner.num_free_slots == 8


def _draft_model_generator(target, draft, **kwargs) -> RolloutGenerator:
    return RolloutGenerator(target, draft_model=draft, max_num_seqs=8, max_model_len=64,
                            speculative_config={"method": "draft_model", "num_speculative_tokens": 3}, **kwargs)


def test_a_transient_draft_model_fault_is_resynced(target, plain, monkeypatch):
    """The target drafting for itself is always right. A fault halfway through its second step (caches extended by a
    draft, the step's drafts lost, the drafter's state dropped) leaves the completions as they were, and every
    request drafts again in the steps after, as right as before."""
    generator = _draft_model_generator(target, target)
    proposer = generator.backend.speculation.proposer
    propose, forward, calls = proposer.propose, proposer.runner.forward, {"propose": 0, "forward": 0}

    def counting_propose(*args, **kwargs):
        calls["propose"], calls["forward"] = calls["propose"] + 1, 0
        return propose(*args, **kwargs)

    def failing_forward(*args):
        calls["forward"] += 1
        if calls["propose"] == 2 and calls["forward"] == 2:
            raise RuntimeError("transient")
        return forward(*args)

    monkeypatch.setattr(proposer, "propose", counting_propose)
    monkeypatch.setattr(proposer.runner, "forward", failing_forward)
    with pytest.warns(RuntimeWarning, match="transient"):
        batch = generator.generate(PROMPTS, 2, GREEDY, use_tqdm=False)
    assert batch.stats["num_drafter_faults"] == 1
    assert _completions(batch) == plain[0.0]
    assert all(s.acceptance["k_per_step"][1] == 0 and sum(s.acceptance["k_per_step"][2:]) > 0 for s in batch.samples)
    assert batch.stats["draft_acceptance_rate"] > 0.95
    assert proposer.num_requests == 0 and proposer.runner.num_free_slots == 8


def test_a_draft_model_with_nan_weights_degrades_and_recovers_once_repaired(target, plain):
    """Non-finite draft logits are a drafter fault (their confidences are NaN); once the draft weights are good
    again (a copy of the target's: always right), the next call drafts without faults: no NaN keys stayed in the
    draft model's freed slots."""
    generator = _draft_model_generator(target, copy.deepcopy(target), max_drafter_faults=2)
    good = {name: p.detach().clone() for name, p in generator.backend.speculation.proposer.runner.model.named_parameters()}
    generator.load_draft_weights({**good, "model.layers.0.self_attn.v_proj.weight": torch.full_like(
        good["model.layers.0.self_attn.v_proj.weight"], math.nan)}.items())
    with pytest.warns(RuntimeWarning, match="confidence nan"):
        batch = generator.generate(PROMPTS, 2, GREEDY, use_tqdm=False)
    assert _completions(batch) == plain[0.0] and batch.stats["num_drafter_faults"] == 2
    generator.load_draft_weights(good.items())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batch = generator.generate(PROMPTS, 2, GREEDY, use_tqdm=False)
    assert _completions(batch) == plain[0.0]
    assert batch.stats["num_drafter_faults"] == 0 and batch.stats["draft_acceptance_rate"] > 0.95


def test_a_failed_shared_prompt_prefill_leaks_no_draft_slot(target, draft, plain, monkeypatch):
    """The draft model's first step prefills each shared prompt alone (num_logits 0); a fault there costs the step's
    drafts and no slot."""
    generator = _draft_model_generator(target, draft)
    runner = generator.backend.speculation.proposer.runner
    forward = runner.forward

    def failing_prefill(slots, token_ids, num_logits):
        if num_logits == [0]:
            raise RuntimeError("prefill failed")
        return forward(slots, token_ids, num_logits)

    monkeypatch.setattr(runner, "forward", failing_prefill)
    with pytest.warns(RuntimeWarning, match="prefill failed"):
        batch = generator.generate(PROMPTS, 2, GREEDY, use_tqdm=False)
    assert _completions(batch) == plain[0.0]
    assert runner.num_free_slots == 8 and generator.backend.speculation.proposer.num_requests == 0


def test_non_finite_target_logits_stay_an_error():
    broken = tiny_llama(6)
    with torch.no_grad():
        broken.model.layers[1].mlp.down_proj.weight[0, 0] = math.inf
    generator = RolloutGenerator(broken, max_num_seqs=4)
    with pytest.raises(ValueError, match=r"non-finite logits .* for 3 of 3 running requests .*likely causes"):
        generator.generate([[2, 3]], num_generations=3, use_tqdm=False)
