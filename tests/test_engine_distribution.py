"""The engine's sampled completions follow the target's distribution exactly, with speculation on."""

import itertools
import math

import pytest
import torch
from conftest import chi2_critical, tiny_llama

from rollout import RolloutGenerator, SamplingParams
from spec.sampling import SamplingTensors, processed_logprobs

VOCAB, PROMPT, LENGTH, NUM_SAMPLES = 5, [0, 3, 1], 3, 3000


def _exact_distribution(model, params: SamplingParams) -> dict[tuple, float]:
    """P(completion | PROMPT) under the processed target distribution, enumerating all LENGTH-token completions."""
    sampling = SamplingTensors.build([params.temperature], [params.top_k], [params.top_p])
    probs = {}
    for completion in itertools.product(range(VOCAB), repeat=LENGTH):
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(completion[:-1])])).logits[0, -LENGTH:]  # [LENGTH, vocab]
        logp = processed_logprobs(logits, sampling.select([0] * LENGTH))
        probs[completion] = math.exp(float(logp[torch.arange(LENGTH), list(completion)].sum()))
    return probs


def _chi2_with_merged_bins(counts: dict, probs: dict) -> tuple[float, int]:
    """Pearson statistic; outcomes expected fewer than 5 times are merged into one bin (the usual validity rule)."""
    n = sum(counts.values())
    assert all(probs[o] > 0 for o in counts), "an outcome outside the target's support was sampled"
    big = [o for o in probs if probs[o] * n >= 5]
    small = [o for o in probs if probs[o] * n < 5 and probs[o] > 0]
    bins = [([o], probs[o]) for o in big] + ([(small, sum(probs[o] for o in small))] if small else [])
    stat = sum((sum(counts.get(o, 0) for o in outs) - p * n) ** 2 / (p * n) for outs, p in bins)
    return stat, len(bins) - 1


# Adaptive verification under step costs that make it verify some drafts and skip others (asserted below): each target
# forward advances the engine's clock by 10 ms a row and 7 ms a further token, so a draft pays above a survival of
# about two thirds (at 5 ms the target drafting for itself at top-k 3 verified every draft).
PER_ROW, PER_TOKEN = 0.01, 0.007


@pytest.mark.parametrize("method", ["suffix", "draft_model", "suffix_adaptive", "draft_model_adaptive"])
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, -1, 1.0), (0.9, 3, 0.9)])
def test_sampled_completions_follow_the_target(method, temperature, top_k, top_p, engine_clock):
    """3000 sibling completions of one prompt. Suffix drafting proposes from the siblings' outputs (point
    proposals); the draft model samples its drafts (probabilistic q), or, with adaptive verification choosing
    which drafts to verify, is the target itself drafting greedily (its confidences then vary with the context).
    Fixed seeds fix the sampling's uniforms; the 1e-3 chi-square quantile bounds the false-alarm rate of a correct
    sampler, and the test fails for a sampler that returns drafts unverified (checked by hand: statistic > 10x the
    threshold)."""
    target = tiny_llama(10, vocab_size=VOCAB, eos_token_id=None)
    drafter = method.removesuffix("_adaptive")
    config = {"method": drafter, "num_speculative_tokens": 2, "enable_adaptive_verification": drafter != method}
    draft = None
    if method == "draft_model":
        config["draft_sample_method"] = "probabilistic"
        draft = tiny_llama(11, vocab_size=VOCAB, num_layers=1, eos_token_id=None)
    elif method == "draft_model_adaptive":
        draft = target
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=LENGTH)
    generator = RolloutGenerator(target, speculative_config=config, draft_model=draft, max_num_seqs=64, seed=3)
    forward = generator.backend.runner.forward
    generator.backend.runner.forward = lambda slots, ids, num_logits: engine_clock.advance(
        PER_ROW * len(slots) + PER_TOKEN * sum(len(row) - 1 for row in ids)) or forward(slots, ids, num_logits)
    batch = generator.generate([PROMPT], NUM_SAMPLES, params, use_tqdm=False)
    assert batch.stats["num_draft_tokens"] > NUM_SAMPLES // 10  # speculation was active
    if drafter != method:  # adaptive verification verified some of the drafts, not all
        assert batch.stats["num_draft_tokens"] < batch.stats["num_proposed_draft_tokens"]
    counts = {}
    for sample in batch.samples:
        counts[tuple(sample.completion_ids)] = counts.get(tuple(sample.completion_ids), 0) + 1
    stat, df = _chi2_with_merged_bins(counts, _exact_distribution(target, params))
    assert stat < chi2_critical(df), (stat, df)
