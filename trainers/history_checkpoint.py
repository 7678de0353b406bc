"""The rollout history in trainer checkpoints.

A drafter that keeps each prompt's latest rollouts (method "history") drafts best when a run resumes with them:
after a restart, an epoch's first visit to each prompt would otherwise draft from siblings only. Each process
writes its generator's history into the trainer's checkpoint folder when the trainer saves one
(`rollout_history_<process index>.npz`), and reads it back when training resumes from that checkpoint. A missing,
truncated or foreign file (written for another model's vocabulary) warns and the run goes on with an empty history:
drafts only change speed, never the samples, so a lost history must never fail a run.
"""

import warnings
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from rollout import RolloutGenerator


def history_path(output_dir, global_step: int, process_index: int) -> Path:
    """Where process `process_index` keeps its history in the checkpoint of `global_step` under output_dir."""
    return Path(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{global_step}", f"rollout_history_{process_index}.npz")


def save_history(generator: RolloutGenerator, path: Path) -> bool:
    """Write the generator's history to `path` (its folder is the checkpoint's); False where it keeps none."""
    if not keeps_history(generator):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    return generator.save_rollout_history(path)


def restore_history(generator: RolloutGenerator, path: Path) -> None:
    """Load the generator's history from `path`; a missing or unreadable file warns and leaves it empty."""
    if not keeps_history(generator):
        return
    if not path.exists():
        warnings.warn(f"no rollout history at {path}: resuming with an empty history (drafts from each prompt's "
                      "earlier rollouts come back as the prompts are rolled out again)", RuntimeWarning, stacklevel=2)
        return
    try:
        generator.load_rollout_history(path)
    except ValueError as e:
        warnings.warn(f"the rollout history at {path} cannot be used ({e}); resuming with an empty history",
                      RuntimeWarning, stacklevel=2)


def keeps_history(generator: RolloutGenerator) -> bool:
    config = generator.config
    return config is not None and config.method == "history"
