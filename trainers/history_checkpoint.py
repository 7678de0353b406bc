"""The rollout history in trainer checkpoints.

A drafter that keeps each prompt's latest rollouts (method "history") drafts best when a run resumes with them:
after a restart, an epoch's first visit to each prompt would otherwise draft from siblings only. The job's history
is one file in the trainer's checkpoint folder (`rollout_history.npz`), written by the main process when the
trainer saves a checkpoint: the processes share their rollouts (rollout/history_sharing.py), so each holds the
job's history, and on backend="server" the file merges the servers' histories. When training resumes from that
checkpoint every process loads it (on backend="server" the main process, into every server). A missing, truncated
or foreign file (written for another model's vocabulary), or one that cannot be written, warns and the run goes on:
drafts only change speed, never the samples, so a lost history must never fail a run.
"""

import warnings
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from rollout import RolloutGenerator


def history_path(output_dir, global_step: int) -> Path:
    """Where the job keeps its history in the checkpoint of `global_step` under output_dir."""
    return Path(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{global_step}", "rollout_history.npz")


def save_history(generator: RolloutGenerator, path: Path) -> bool:
    """Write the generator's history to `path` (its folder is the checkpoint's); False where it keeps none or it
    cannot be written (a warning)."""
    history = generator.rollout_history
    if history is None:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        history.save(path)
        return True
    except (OSError, ValueError) as e:
        warnings.warn(f"the rollout history was not saved to {path} ({e}); a resume from this checkpoint starts with "
                      "an empty history", RuntimeWarning, stacklevel=2)
        return False


def restore_history(generator: RolloutGenerator, path: Path, process_index: int = 0) -> None:
    """Load the generator's history from `path` (on a server backend, process 0 loads it into the servers); a
    missing or unreadable file warns and leaves it empty."""
    history = generator.rollout_history
    if history is None or (generator.is_shared and process_index != 0):
        return
    if not path.exists():
        warnings.warn(f"no rollout history at {path}: resuming with an empty history (drafts from each prompt's "
                      "earlier rollouts come back as the prompts are rolled out again)", RuntimeWarning, stacklevel=2)
        return
    try:
        history.load(path)
    except ValueError as e:
        warnings.warn(f"the rollout history at {path} cannot be used ({e}); resuming with an empty history",
                      RuntimeWarning, stacklevel=2)
