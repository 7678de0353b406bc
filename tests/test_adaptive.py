"""Adaptive verification end to end on tiny models: lossless, within the schedule's cap, cuts by the step costs the
engine runs (set here by the engine's fake clock: each target forward advances it by a price of its rows and
tokens), learns them, bad input."""

import pytest
from conftest import priced as priced_by_clock

from rollout import RolloutGenerator, SamplingParams
from spec import Proposal

PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9], [3, 4], [10, 11, 12, 13, 14, 10, 11, 12], [20, 21, 22], [30] * 6, [8, 2]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
PER_ROW = 0.01  # seconds a target forward costs per row (the engine's clock)


def priced(generator: RolloutGenerator, clock, per_token: float = 0.005) -> RolloutGenerator:
    """The generator's target forwards advance the engine's clock by PER_ROW a row and per_token a further token (a
    draft, or a prompt's): at 0.005, half a row, a draft pays above a survival of about one half."""
    return priced_by_clock(generator, clock, per_token, PER_ROW)


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


def _generator(target, config, draft_model=None, max_num_seqs=4, **kwargs):
    return RolloutGenerator(target, speculative_config=config, draft_model=draft_model, max_num_seqs=max_num_seqs,
                            max_model_len=64, **kwargs)


@pytest.fixture(scope="module")
def plain_greedy(target):
    return RolloutGenerator(target, max_num_seqs=4, max_model_len=64).generate(PROMPTS, 2, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_output_is_unchanged_by_adaptive_verification(name, target, draft, plain_greedy, engine_clock):
    config, draft_model = CONFIGS[name](target, draft)
    batch = priced(_generator(target, config, draft_model), engine_clock).generate(PROMPTS, 2, GREEDY, use_tqdm=False)
    assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in plain_greedy.samples]
    for sample, plain in zip(batch.samples, plain_greedy.samples):
        assert sample.logprobs == pytest.approx(plain.logprobs, abs=1e-4)
    stats = batch.stats
    assert 0 < stats["num_draft_tokens"] < stats["num_proposed_draft_tokens"]  # it verified some drafts, not all
    assert stats["num_calibration_observations"] > 0 and "spec/calibration_error" in batch.metrics


def test_seeded_sampling_is_unchanged_by_adaptive_verification(target, draft, engine_clock):
    """Point proposals: however adaptive verification trims the drafts, each position's token is drawn from its own
    uniform, so a seeded run emits what plain sampling emits from the same seed (spec/rejection.py)."""
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=11)
    plain = RolloutGenerator(target, max_num_seqs=4, max_model_len=64).generate(PROMPTS, 2, params, use_tqdm=False)
    config, draft_model = CONFIGS["draft_model"](target, draft)
    batch = priced(_generator(target, config, draft_model), engine_clock).generate(PROMPTS, 2, params, use_tqdm=False)
    assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in plain.samples]
    assert 0 < batch.stats["num_draft_tokens"] < batch.stats["num_proposed_draft_tokens"]  # trimmed, not all or none


def test_the_policy_learns_the_step_costs_from_the_engines_own_steps(target, engine_clock):
    """No profile: the fit at the batch size the steps ran reads back the price the engine's clock charged per
    further token, and per step what it charged per row (a shared prompt's prefill is not the step's: the engine
    leaves it out); the price reads those costs at most one standard error lower (optimism): within 30% per token,
    5% per step."""
    config, _ = CONFIGS["custom_class"](target, None)
    generator = priced(_generator(target, config), engine_clock)
    generator.generate(PROMPTS, 2, GREEDY, use_tqdm=False)
    costs = generator.backend.speculation.policy.costs
    fitted = costs._sizes[(4).bit_length()].solution[2]
    price = costs.price(4)
    assert fitted == pytest.approx(0.005, rel=0.15) and 0.7 * 0.005 <= price.per_token <= fitted
    assert 0.95 * 4 * PER_ROW <= price.base <= 1.1 * 4 * PER_ROW


def test_allocation_never_exceeds_the_schedule_k(target, draft, engine_clock):
    config = _config("draft_model", num_speculative_tokens_per_batch_size=[[1, 64, 2]])
    batch = priced(_generator(target, config, draft), engine_clock, per_token=0.0).generate(
        PROMPTS, 2, GREEDY, use_tqdm=False)
    ks = [k for s in batch.samples for k in s.acceptance["k_per_step"]]
    assert max(ks) == 2  # free verification admits every draft, and there are never more than the cap
    assert sum(ks) == batch.stats["num_draft_tokens"]  # the per-request record has the K offered at each step


def test_costlier_verification_verifies_fewer_drafts(target, engine_clock):
    """The second call of each generator, after the first taught it the costs."""
    config, _ = CONFIGS["custom_class"](target, None)
    verified = []
    for per_token in (0.0, 0.0005, 0.05):  # the echoed drafts are accepted 4-8% of the time
        generator = priced(_generator(target, config), engine_clock, per_token)
        generator.generate(PROMPTS, 2, GREEDY, use_tqdm=False)
        verified.append(generator.generate(PROMPTS, 2, GREEDY, use_tqdm=False).stats[
            "verified_tokens_per_emitted_token"])
    assert verified[0] > verified[1] > verified[2]
    # nothing is worth 5 rows a token: plain decoding, but for the first draft every row verifies after 32 steps at a
    # batch size without drafts (spec/adaptive/policy.py: _EXPLORE_STEPS), at most one row-step in 33
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
