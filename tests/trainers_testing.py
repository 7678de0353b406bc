"""Shared pieces of the trainers tests: tiny Llamas on the default pair's tokenizer, GRPO configs, datasets, and
one recorded 2-step GRPO run (`shared_grpo_run()`, made once per session)."""

import copy
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from conftest import tiny_llama
from rollout import RolloutGenerator, default_model_paths, default_prompts
from trainers import SpecRolloutCallback

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL 1.16
VOCAB_SIZE, EOS = 28, 2  # the default pair's character tokenizer
NUM_SPECULATIVE_TOKENS = 3
ROOT = Path(__file__).resolve().parents[1]
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "1",
          "--mixed_precision", "no", "--dynamo_backend", "no", "--num_processes"]  # then the number


def accelerate_launch(script: Path, *args: str, timeout: int = 900, env: dict[str, str] | None = None,
                      num_processes: int = 2) -> subprocess.CompletedProcess:
    """`script args` on num_processes CPU processes (the command in the README), tests/ and the
    project on PYTHONPATH, `env` added; asserts a zero exit status, with the output's tail as the message."""
    env = {**os.environ, **(env or {}), "ACCELERATE_USE_CPU": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([*LAUNCH, str(num_processes), str(script), *args], env=env, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def default_tokenizer():
    return AutoTokenizer.from_pretrained(default_model_paths()["target"])


def tiny_policy(seed: int, num_layers: int = 2):
    return tiny_llama(seed, vocab_size=VOCAB_SIZE, num_layers=num_layers, eos_token_id=EOS, max_len=128)


def tiny_generator(target_seed: int = 1, draft_seed: int = 2, seed: int = 0) -> RolloutGenerator:
    """A speculative generator whose target starts from other weights than `tiny_policy(0)`."""
    return RolloutGenerator(tiny_policy(target_seed), tokenizer=default_tokenizer(),
                            draft_model=tiny_policy(draft_seed, num_layers=1), max_num_seqs=16, max_model_len=128,
                            speculative_config={"method": "draft_model",
                                                "num_speculative_tokens": NUM_SPECULATIVE_TOKENS},
                            seed=seed)


def grpo_config(output_dir, **overrides) -> GRPOConfig:
    settings = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=12, max_steps=2,
                    logging_steps=1, learning_rate=1e-3, report_to=[], save_strategy="no", bf16=False,
                    use_cpu=True, seed=0, disable_tqdm=True)
    return GRPOConfig(output_dir=str(output_dir), **{**settings, **overrides})


def prompt_dataset(num_prompts: int = 16) -> Dataset:
    return Dataset.from_dict({"prompt": default_prompts(num_prompts)})


def length_reward(completions, **kwargs) -> list[float]:
    """Varies within a group, so advantages are non-zero and a step changes the policy."""
    return [len(c) / 12 for c in completions]


def grpo_trainer(policy, rollout, args: GRPOConfig, callbacks=(), reward=length_reward, **kwargs) -> GRPOTrainer:
    """rollout: a SpecRolloutCallback (the trainer gets its rollout_func and runs it as a callback, after
    `callbacks`), or a rollout function (the trainer gets `callbacks` only)."""
    if isinstance(rollout, SpecRolloutCallback):
        rollout, callbacks = rollout.rollout_func, [*callbacks, rollout]
    return GRPOTrainer(model=policy, reward_funcs=reward, args=args, train_dataset=prompt_dataset(),
                       processing_class=default_tokenizer(), rollout_func=rollout, callbacks=list(callbacks),
                       **kwargs)


def refresh_toward(generator: RolloutGenerator, teacher, prompts, params, num_refreshes: int = 20):
    """(the refresh's KL per pass, the batch before, the batch after): DrafterRefresh (learning rate 1e-2) distils
    the generator's draft toward `teacher` on one batch of its rollouts, num_refreshes times."""
    from trainers import DrafterRefresh
    before = generator.generate(prompts, 4, params, use_tqdm=False)
    refresh = DrafterRefresh(generator, every_n_steps=1, learning_rate=1e-2)
    kls = []
    for _ in range(num_refreshes):
        refresh.add(before, temperature=1.0)
        kls.append(refresh.refresh(teacher))
    return kls, before, generator.generate(prompts, 4, params, use_tqdm=False)


@torch.no_grad()
def logits(model, input_ids: list[list[int]]) -> torch.Tensor:
    was_training = model.training
    model.eval()
    out = model(input_ids=torch.tensor(input_ids)).logits
    model.train(was_training)
    return out


PROBE_IDS = [[1, 20, 17, 18, 5, 14, 6, 19, 21], [1, 20, 17, 9, 9, 4, 7, 19, 21]]  # "Q: 3+2\nA:\n"-like rows


class RecordingCallback(SpecRolloutCallback):
    """SpecRolloutCallback that also keeps every rollout's batch and a copy of the policy as it was synced for the
    latest rollout. A fresh model loads its state dict: a deepcopy of the prepared model would keep accelerate's
    forward, bound to the original."""

    def __init__(self, generator, **kwargs):
        super().__init__(generator, **kwargs)
        self.batches, self.policy = [], None

    def after_rollout(self, trainer, batch):
        super().after_rollout(trainer, batch)
        self.batches.append(batch)
        policy = type(trainer.model)(trainer.model.config)
        policy.load_state_dict(trainer.model.state_dict())
        self.policy = policy.eval()


class RecordLogs(TrainerCallback):
    """What the report_to integrations see: the logs dict handed to every callback's on_log."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


@dataclass
class GRPORun:
    trainer: GRPOTrainer
    generator: RolloutGenerator
    callback: SpecRolloutCallback
    initial_policy: torch.nn.Module
    batches: list  # the RolloutBatch of each training step
    logs: list  # the logs every callback's on_log received
    rewarded_acceptance: list  # the `acceptance` column the reward function received


_shared_run: GRPORun | None = None


def shared_grpo_run() -> GRPORun:
    """The run below, made once per test session and shared by the test modules that use it."""
    global _shared_run
    if _shared_run is None:
        _shared_run = _grpo_run(tempfile.mkdtemp(prefix="grpo_run_"))
    return _shared_run


def _grpo_run(output_dir) -> GRPORun:
    """Two GRPO steps on CPU in float32 with the generator as rollout function and SpecRolloutCallback (drafter
    refresh every step, importance sampling on: TRL's default); the generator's target starts from other weights
    than the policy."""
    policy, generator = tiny_policy(0), tiny_generator(target_seed=1)
    initial = copy.deepcopy(policy)
    callback = RecordingCallback(generator, drafter_refresh_steps=1)
    logs, rewarded = RecordLogs(), []

    def reward(completions, acceptance, **kwargs):
        rewarded.extend(acceptance)
        return length_reward(completions)

    trainer = grpo_trainer(policy, callback, grpo_config(output_dir), callbacks=[logs], reward=reward)
    trainer.train()
    return GRPORun(trainer, generator, callback, initial, list(callback.batches), list(logs.logs), rewarded)
