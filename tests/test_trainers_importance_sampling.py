"""TRL's importance-sampling correction on the rollout logprobs (trainers/importance_sampling.py)."""

import math

import pytest

from trainers import SpecRolloutCallback, enable_importance_sampling
from trainers_testing import grpo_config, grpo_trainer, shared_grpo_run, tiny_generator, tiny_policy


def _step_logs(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def test_correction_runs_and_our_logprobs_match_the_trainers():
    run = shared_grpo_run()
    trainer = run.trainer
    assert trainer.use_vllm and trainer.vllm_importance_sampling_correction
    assert "importance_sampling_ratio" in trainer._buffered_inputs[0]  # what compute_loss multiplies the loss by
    for entry in _step_logs(trainer):
        # float32 policy and target with the same weights: the trainer recomputes our logprobs to rounding
        assert entry["sampling/sampling_logp_difference/max"] < 1e-4
        assert entry["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-4)


def test_the_ratio_is_computed_from_the_returned_logprobs(tmp_path):
    callback = SpecRolloutCallback(tiny_generator())
    shift = 0.1

    def shifted(prompts, trainer):  # the same rollouts, reported 0.1 nats likelier than they are
        out = callback.rollout_func(prompts, trainer)
        return {**out, "logprobs": [[lp + shift for lp in row] for row in out["logprobs"]]}

    args = grpo_config(tmp_path, max_steps=1, vllm_importance_sampling_mode="token_truncate")
    trainer = grpo_trainer(tiny_policy(0), shifted, args, callbacks=[callback])
    trainer.train()
    [entry] = _step_logs(trainer)
    assert entry["sampling/sampling_logp_difference/mean"] == pytest.approx(shift, abs=1e-4)
    assert entry["sampling/importance_sampling_ratio/mean"] == pytest.approx(math.exp(-shift), abs=1e-4)


def test_correction_off_when_the_config_says_so(tmp_path):
    generator = tiny_generator()
    args = grpo_config(tmp_path, max_steps=1, vllm_importance_sampling_correction=False)
    trainer = grpo_trainer(tiny_policy(0), SpecRolloutCallback(generator), args)
    trainer.train()
    assert not trainer.use_vllm
    assert not any(key.startswith("sampling/") for key in _step_logs(trainer)[0])


def test_enable_refuses_what_it_cannot_correct(tmp_path):
    callback = SpecRolloutCallback(tiny_generator())
    trainer = grpo_trainer(tiny_policy(0), callback, grpo_config(tmp_path))
    trainer.rollout_func = None
    with pytest.raises(ValueError, match="rollout_func=None"):
        enable_importance_sampling(trainer)
    vespo = grpo_trainer(tiny_policy(0), callback, grpo_config(tmp_path, loss_type="vespo"))
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode='sequence_mask'"):
        enable_importance_sampling(vespo)
    assert not vespo.use_vllm
