"""Contract tests: the TRL 1.16 / transformers 5.x / peft / accelerate behaviour that trainers/rollout_func.py and
trainers/ rely on. A failure here means an upstream change to adapt to, before anything else breaks subtly."""

import dataclasses
import inspect
import typing

import torch
from accelerate.utils import gather_object
from peft.tuners.lora import LoraModel
from transformers import Trainer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.grpo_trainer import RepeatSampler, RolloutFunc

from trainers import SpecRolloutCallback
from trainers_testing import grpo_config, grpo_trainer, tiny_generator, tiny_policy


def _source(function) -> str:
    return inspect.getsource(function)


def test_grpo_trainer_takes_a_rollout_func_called_with_prompts_and_itself():
    params = inspect.signature(GRPOTrainer.__init__).parameters
    assert {"rollout_func", "callbacks", "peft_config", "processing_class"} <= set(params)
    assert typing.get_args(RolloutFunc) == ([list[str], "GRPOTrainer"], dict[str, typing.Any])
    source = _source(GRPOTrainer._generate)
    assert "output = self.rollout_func(prompts, self)" in source
    assert 'required_keys = {"prompt_ids", "completion_ids", "logprobs"}' in source
    assert "extra_fields = {k: v for k, v in output.items() if k not in required_keys}" in source


def test_prompts_arrive_repeated_in_adjacent_rows():
    sampler = RepeatSampler(list(range(3)), mini_repeat_count=2, batch_size=3, repeat_count=1, shuffle=False)
    assert list(sampler) == [0, 0, 1, 1, 2, 2]
    assert "mini_repeat_count=self.num_generations" in _source(GRPOTrainer._get_train_sampler)


def test_grpo_config_fields_read_by_the_rollout_func():
    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    assert {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0,
            "generation_kwargs": None, "chat_template_kwargs": None, "use_vllm": False,
            "vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_mask",
            "ds3_gather_for_generation": True}.items() <= defaults.items()
    assert "max_completion_length" in defaults and "num_generations_eval" in defaults


def test_trainer_attributes_read_and_set(tmp_path):
    trainer = grpo_trainer(tiny_policy(0), SpecRolloutCallback(tiny_generator()), grpo_config(tmp_path))
    assert trainer.num_generations == 4 and trainer.num_generations_eval == 4
    assert set(trainer._metrics) == {"train", "eval"} and trainer._metrics["train"]["x"] == []
    assert trainer.use_vllm is False and trainer.vllm_importance_sampling_correction is True
    assert not trainer.tools and trainer.rollout_func is not None
    assert {trainer.loss_type, trainer.vllm_importance_sampling_mode} == {"dapo", "sequence_mask"}
    assert trainer.accelerator.process_index == 0 and trainer.model is trainer.accelerator.unwrap_model(trainer.model)


def test_use_vllm_gates_weight_sync_and_the_correction_on_the_rollout_func_path():
    generate = _source(GRPOTrainer._generate)
    assert "if self.use_vllm and self.state.global_step != self._last_loaded_step:" in generate
    assert "self.vllm_generation.sync_weights()" in generate
    score = _source(GRPOTrainer._generate_and_score_completions)
    assert score.count("self.use_vllm and self.vllm_importance_sampling_correction") >= 3
    assert "per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask" in score
    assert 'inputs["importance_sampling_ratio"]' in _source(GRPOTrainer._compute_loss)


def test_metrics_dict_is_merged_into_the_logs_before_log_history_and_callbacks():
    grpo_log = _source(GRPOTrainer.log)
    assert "for key, val in self._metrics[mode].items():" in grpo_log
    assert grpo_log.index("logs.update(metrics)") < grpo_log.index("super().log(logs, start_time)")
    base_log = _source(Trainer.log)
    assert base_log.index("self.state.log_history.append(output)") < base_log.index("callback_handler.on_log")


def test_callback_hooks_and_upstream_helpers():
    for hook in ("on_init_end", "on_train_begin", "on_step_end"):
        assert list(inspect.signature(getattr(TrainerCallback, hook)).parameters) == ["self", "args", "state",
                                                                                     "control", "kwargs"]
    assert "remove_duplicate" in inspect.signature(torch.nn.Module.named_parameters).parameters
    assert LoraModel.prefix == "lora_"
    assert gather_object(["a", "b"]) == ["a", "b"]  # one process: the list itself
