"""Drafter refresh (trainers/drafter_refresh.py): distilling the draft on fresh rollouts brings it toward the target
and raises acceptance; the callback runs it every N steps and logs its KL."""

import math

import pytest

from rollout import RolloutGenerator, SamplingParams
from trainers import DrafterRefresh, SpecRolloutCallback
from trainers_testing import (default_tokenizer, grpo_config, grpo_trainer, refresh_toward, shared_grpo_run,
                              tiny_generator, tiny_policy)

PROMPTS = [[1, 20, 17, 3 + i, 5, 14, 6, 19, 21] for i in range(8)]
PARAMS = SamplingParams(temperature=1.0, max_tokens=12, seed=0)


def test_refresh_raises_acceptance():
    generator = tiny_generator(target_seed=1, draft_seed=2)  # a random draft for a random target
    kls, before, after = refresh_toward(generator, tiny_policy(1), PROMPTS, PARAMS)  # toward the generator's target
    assert kls[-1] < 0.5 * kls[0]
    assert after.metrics["spec/acceptance_rate"] > before.metrics["spec/acceptance_rate"] + 0.1


def test_callback_refreshes_every_n_steps_and_logs_the_kl():
    run = shared_grpo_run()
    assert run.callback.drafter_refresh.num_refreshes == 2  # after steps 1 and 2
    steps = [entry for entry in run.trainer.state.log_history if "loss" in entry]
    assert "spec/drafter_refresh_kl" not in steps[0]  # the first refresh follows step 1's rollout
    assert steps[1]["spec/drafter_refresh_kl"] > 0


def test_refresh_needs_the_callback_in_the_trainer(tmp_path):
    callback = SpecRolloutCallback(tiny_generator(), drafter_refresh_steps=1)
    trainer = grpo_trainer(tiny_policy(0), callback.rollout_func, grpo_config(tmp_path, max_steps=1))  # not callbacks
    with pytest.raises(ValueError, match="callbacks=\\[callback\\]"):
        trainer.train()


def test_refresh_needs_a_draft_model():
    generator = RolloutGenerator(tiny_policy(1), tokenizer=default_tokenizer(), max_num_seqs=4, max_model_len=64,
                                 speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="'ngram'"):
        DrafterRefresh(generator, every_n_steps=1)
    with pytest.raises(ValueError, match="every_n_steps=0"):
        DrafterRefresh(tiny_generator(), every_n_steps=0)


def test_a_temperature_that_samples_greedily_distils_at_temperature_one():
    """Below GREEDY_TEMPERATURE sampling is greedy (rollout/sampling_params.py); dividing logits by such a temperature
    would overflow the KL to NaN, so the refresh distils at T = 1."""
    generator = tiny_generator()
    batch = generator.generate(PROMPTS[:2], 2, PARAMS, use_tqdm=False)
    refresh = DrafterRefresh(generator, every_n_steps=1)
    refresh.add(batch, temperature=1e-30)
    assert refresh.temperature == 1.0 and math.isfinite(refresh.refresh(tiny_policy(1)))
