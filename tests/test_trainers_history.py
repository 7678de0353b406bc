"""The rollout history in trainer checkpoints (trainers/history_checkpoint.py): saved with each checkpoint, restored
on resume; a missing, truncated or foreign file warns and the run goes on with an empty history."""

import warnings

import pytest

from rollout import RolloutGenerator
from spec.proposers.history import HistoryStore
from trainers import SpecRolloutCallback
from trainers.history_checkpoint import history_path
from trainers_testing import default_tokenizer, grpo_config, grpo_trainer, tiny_policy


def _generator() -> RolloutGenerator:
    return RolloutGenerator(tiny_policy(1), tokenizer=default_tokenizer(), max_num_seqs=16, max_model_len=128,
                            speculative_config={"method": "history", "num_speculative_tokens": 3})


def _train(output_dir, generator, max_steps: int, resume=None):
    args = grpo_config(output_dir, max_steps=max_steps, save_strategy="steps", save_steps=1)
    trainer = grpo_trainer(tiny_policy(0), SpecRolloutCallback(generator), args)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _history(generator, path) -> dict:
    generator.rollout_history.save(path)
    store = HistoryStore()
    store.load(path)
    return {key: [(e.tokens.tolist(), e.count) for e in entries] for key, entries in store._prompts.items()}


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """One GRPO step (8 rows) with a checkpoint after it: (output dir, the generator's history then)."""
    output_dir = tmp_path_factory.mktemp("history_run")
    generator = _generator()
    _train(output_dir, generator, max_steps=1)
    return output_dir, _history(generator, output_dir / "expected.npz")


def test_the_history_is_saved_with_each_checkpoint(checkpointed):
    output_dir, expected = checkpointed
    path = history_path(output_dir, 1)
    assert path.exists()
    store = HistoryStore()
    store.load(path)
    assert store.num_rollouts == 8 and len(expected) == 2  # 2 prompts x 4 generations


def test_resuming_restores_the_history(checkpointed, tmp_path):
    output_dir, expected = checkpointed
    resumed = _generator()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a readable history restores without a warning
        _train(output_dir, resumed, max_steps=2, resume=str(output_dir / "checkpoint-1"))
    restored = _history(resumed, tmp_path / "restored.npz")
    # step 1's history, restored, and step 2's rollouts of two other prompts on top
    assert {key: restored[key] for key in expected} == expected and len(restored) == 4


@pytest.mark.parametrize("damage, message", [
    (lambda path: path.unlink(), "no rollout history"),
    (lambda path: path.write_bytes(path.read_bytes()[:64]), "cannot be used"),
])
def test_a_lost_history_warns_and_the_run_goes_on(checkpointed, tmp_path, damage, message):
    import shutil
    output_dir = tmp_path / "copy"
    shutil.copytree(checkpointed[0] / "checkpoint-1", output_dir / "checkpoint-1")
    damage(history_path(output_dir, 1))
    resumed = _generator()
    with pytest.warns(RuntimeWarning, match=message):
        trainer = _train(output_dir, resumed, max_steps=2, resume=str(output_dir / "checkpoint-1"))
    assert trainer.state.global_step == 2  # trained on from the checkpoint, with a history of its own
    assert _history(resumed, tmp_path / "after.npz")
