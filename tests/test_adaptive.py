"""Adaptive verification end to end on tiny models: lossless, within k_max, trims by cost, learns, bad input."""

import json

import pytest

from rollout import RolloutGenerator, SamplingParams
from spec import Proposal
from spec.adaptive import StepCostModel

PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9], [3, 4], [10, 11, 12, 13, 14, 10, 11, 12], [20, 21, 22], [30] * 6, [8, 2]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def linear_costs(extra_per_token: float, drafted: bool = False) -> dict:
    """Verification costs 1 s plus extra_per_token s for each row's every token beyond its first (9 per row); with
    drafted, a draft-model forward costs 0.01 s (model-free drafters have no draft table)."""
    grid = [1, 2, 4, 8, 16, 32, 64]
    costs = {"verify": {n: {n: 1.0, 9 * n: 1.0 + 8 * extra_per_token} for n in grid}}
    return {**costs, "draft": {1: 0.01, 64: 0.01}} if drafted else costs


MODERATE = linear_costs(0.5)  # a draft pays for itself above survival ~0.5


class EchoDrafter:
    """Repeats the request's last tokens; confidence falls with the position."""

    def __init__(self, config):
        pass

    def propose(self, requests, max_num_tokens):
        tokens = [r.token_ids[-k:] if k else [] for r, k in zip(requests, max_num_tokens)]
        return Proposal(tokens, [[0.9 / (j + 1) for j in range(len(t))] for t in tokens])


class Unsure(EchoDrafter):
    """Gives no confidence."""

    def propose(self, requests, max_num_tokens):
        return Proposal(super().propose(requests, max_num_tokens).token_ids, None)


class UnsureWithFallback(Unsure):
    confidence_fallback = "acceptance_rate"


class NeverSure(Unsure):
    gives_confidence = False


class Sampling(EchoDrafter):
    """Returns draft distributions (probabilistic proposals)."""

    def propose(self, requests, max_num_tokens):
        import torch
        proposal = super().propose(requests, max_num_tokens)
        proposal.draft_probs = [torch.full((len(t), 48), 1 / 48) for t in proposal.token_ids]
        return proposal


def _config(method, **extra):
    return {"method": method, "num_speculative_tokens": 4, "enable_adaptive_verification": True,
            "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 64, 3]], **extra}


CONFIGS = {
    "ngram": lambda target, draft: (_config("ngram", prompt_lookup_min=1), None),
    "suffix": lambda target, draft: (_config("suffix"), None),
    "history": lambda target, draft: (_config("history"), None),
    "draft_model": lambda target, draft: (_config("draft_model"), draft),
    "custom_class": lambda target, draft: (_config("custom_class", model=f"{__name__}.EchoDrafter"), None),
}


def _generator(target, config, draft_model=None, step_costs="moderate", max_num_seqs=4, **kwargs):
    if step_costs == "moderate":
        step_costs = linear_costs(0.5, drafted=config["method"] == "draft_model")
    return RolloutGenerator(target, speculative_config=config, draft_model=draft_model, max_num_seqs=max_num_seqs,
                            max_model_len=64, step_costs=step_costs, **kwargs)


@pytest.fixture(scope="module")
def plain_greedy(target):
    return RolloutGenerator(target, max_num_seqs=4, max_model_len=64).generate(PROMPTS, 2, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_output_is_unchanged_by_adaptive_verification(name, target, draft, plain_greedy):
    config, draft_model = CONFIGS[name](target, draft)
    batch = _generator(target, config, draft_model).generate(PROMPTS, 2, GREEDY, use_tqdm=False)
    assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in plain_greedy.samples]
    for sample, plain in zip(batch.samples, plain_greedy.samples):
        assert sample.logprobs == pytest.approx(plain.logprobs, abs=1e-4)
    stats = batch.stats
    assert 0 < stats["num_draft_tokens"] < stats["num_proposed_draft_tokens"]  # it verified some drafts, not all
    assert stats["num_calibration_observations"] > 0 and "spec/calibration_error" in batch.metrics


def test_seeded_sampling_is_unchanged_by_adaptive_verification(target, draft):
    """Point proposals: however adaptive verification trims the drafts, each position's token is drawn from its own
    uniform, so a seeded run emits what plain sampling emits from the same seed (spec/rejection.py)."""
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=11)
    plain = RolloutGenerator(target, max_num_seqs=4, max_model_len=64).generate(PROMPTS, 2, params, use_tqdm=False)
    config, draft_model = CONFIGS["draft_model"](target, draft)
    batch = _generator(target, config, draft_model).generate(PROMPTS, 2, params, use_tqdm=False)
    assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in plain.samples]
    assert 0 < batch.stats["num_draft_tokens"] < batch.stats["num_proposed_draft_tokens"]  # trimmed, not all or none


def test_measured_costs_work_and_are_cached(target, draft, plain_greedy, step_cost_cache):
    config, draft_model = CONFIGS["draft_model"](target, draft)
    cached_before = set(step_cost_cache.glob("step_costs-*.json"))
    generator = _generator(target, config, draft_model, step_costs=None)
    batch = generator.generate(PROMPTS, 2, GREEDY, use_tqdm=False)
    assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in plain_greedy.samples]
    [path] = set(step_cost_cache.glob("step_costs-*.json")) - cached_before  # measured, refined, cached
    refined = json.loads(path.read_text())["costs"]
    again = _generator(target, config, draft_model, step_costs=None)  # loads the refined table
    assert again.backend.speculation.policy.costs.to_dict() == StepCostModel.from_dict(refined).to_dict()


def test_allocation_never_exceeds_the_schedule_k(target, draft):
    config = _config("draft_model", num_speculative_tokens_per_batch_size=[[1, 64, 2]])
    batch = _generator(target, config, draft, step_costs=linear_costs(0.0, drafted=True)).generate(
        PROMPTS, 2, GREEDY, use_tqdm=False)
    ks = [k for s in batch.samples for k in s.acceptance["k_per_step"]]
    assert max(ks) == 2  # free verification admits every draft, and there are never more than the cap
    assert batch.stats["num_draft_tokens"] == batch.stats["num_proposed_draft_tokens"]
    assert sum(ks) == batch.stats["num_draft_tokens"]  # the per-request record has the K offered at each step


def test_costlier_verification_verifies_fewer_drafts(target, draft):
    config, draft_model = CONFIGS["custom_class"](target, draft)
    verified = []
    for extra in (0.0, 0.5, 5.0):
        stats = _generator(target, config, step_costs=linear_costs(extra)).generate(
            PROMPTS, 2, GREEDY, use_tqdm=False).stats
        verified.append(stats["verified_tokens_per_emitted_token"])
    assert verified[0] > verified[1] > verified[2]
    # nothing is worth 5 s per token: plain decoding, but for the first draft every row verifies after 32 steps
    # without drafts (spec/adaptive/policy.py: _EXPLORE_STEPS), at most one row-step in 32
    assert 1.0 < verified[2] <= 1.0 + 1 / 32


def test_a_drafter_without_confidence_needs_a_fallback(target):
    config = _config("custom_class", model=f"{__name__}.NeverSure")
    with pytest.raises(ValueError, match="gives no confidence.*confidence_fallback = 'acceptance_rate'"):
        _generator(target, config)
    with pytest.raises(ValueError, match="gives no confidence"):
        _generator(target, _config("custom_class", model=f"{__name__}.Unsure")).generate(PROMPTS, 1, GREEDY,
                                                                                          use_tqdm=False)
    generator = _generator(target, _config("custom_class", model=f"{__name__}.UnsureWithFallback"))
    batch = generator.generate(PROMPTS, 2, GREEDY, use_tqdm=False)
    assert batch.stats["num_calibration_observations"] > 0
    plain = _generator(target, {k: v for k, v in _config("custom_class", model=f"{__name__}.Unsure").items()
                                if k != "enable_adaptive_verification"})
    assert plain.generate(PROMPTS, 1, GREEDY, use_tqdm=False).stats["num_draft_tokens"] > 0  # fine without


def test_probabilistic_proposals_are_refused(target):
    with pytest.raises(ValueError, match="lossless only for point proposals"):
        _generator(target, _config("custom_class", model=f"{__name__}.Sampling")).generate(
            PROMPTS, 1, SamplingParams(temperature=1.0, max_tokens=4), use_tqdm=False)


@pytest.mark.parametrize("step_costs, message", [
    ({"verify": {1: {1: 1.0, 2: 0.5}}}, "cost falls from"),
    ({"verify": {1: {1: 0.0}}}, "is not positive"),
])
def test_bad_cost_tables_are_refused_before_any_loading(step_costs, message):
    with pytest.raises(ValueError, match=message):
        RolloutGenerator("/no/such/model", speculative_config=_config("ngram"), step_costs=step_costs)


def test_a_cost_table_can_be_a_json_file(target, tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(MODERATE))
    generator = _generator(target, _config("ngram", prompt_lookup_min=1), step_costs=str(path))
    assert generator.backend.speculation.policy.costs.to_dict() == StepCostModel.from_dict(MODERATE).to_dict()


