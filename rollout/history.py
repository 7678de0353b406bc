"""Rollout history as one capability: where the drafter keeps each prompt's earlier rollouts (method "history",
spec/proposers/history.py), a backend's `history` is a RolloutHistory that adds, saves and loads them; elsewhere it
is None (`keeps_history`, the one predicate). One implementation per place the history lives:

    DrafterHistory   a drafter in this process: the embedded engine's, and each vLLM worker rank's (worker.py)
    WorkerHistory    vLLM's workers, from the in-process backend (vllm_backend/inprocess.py)
    ServerHistory    a pool of servers, each holding its own prompts' share (server_backend/history.py)

`RolloutGenerator.rollout_history` hands users a GeneratorHistory over its backend's: rollouts are checked before any
is added, and each method waits for a running call.
"""

import threading
from typing import Protocol

from rollout.arguments import check_rollouts


def keeps_history(config) -> bool:
    """Whether a speculative config's drafter keeps a rollout history (method "history")."""
    return config is not None and config.method == "history"


class RolloutHistory(Protocol):
    def add(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> None:
        """Add finished rollouts (checked), as if the drafter had rolled them out: rollout i is prompt_ids[i]
        followed by completion_ids[i]."""
        ...

    def save(self, path) -> None:
        """Write the history to `path`, one .npz file."""
        ...

    def load(self, path) -> None:
        """Replace the history with the one saved at `path`; ValueError, the history unchanged, for a file that is
        not a complete history for this model."""
        ...


class DrafterHistory:
    """The history of `drafter`, a history drafter (spec/proposers/suffix.py) in this process; vocab_size: the
    target's, which a loaded file's ids must lie below."""

    def __init__(self, drafter, vocab_size: int | None):
        self.drafter, self.vocab_size = drafter, vocab_size

    def add(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> None:
        self.drafter.add_rollouts(prompt_ids, completion_ids)

    def save(self, path) -> None:
        self.drafter.history.save(path)

    def load(self, path) -> None:
        self.drafter.history.load(path, vocab_size=self.vocab_size)


class GeneratorHistory:
    """A generator's view of its backend's `history`: `add` checks the rollouts first (ValueError, nothing added, for
    lists of different lengths, an empty prompt, or ids outside the target's vocabulary); every method holds the
    generator's `lock`, so that no history change meets a running call."""

    def __init__(self, history: RolloutHistory, lock: threading.Lock, vocab_size: int | None):
        self.history, self.lock, self.vocab_size = history, lock, vocab_size

    def add(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> None:
        check_rollouts(prompt_ids, completion_ids, self.vocab_size)
        with self.lock:
            self.history.add(prompt_ids, completion_ids)

    def save(self, path) -> None:
        with self.lock:
            self.history.save(path)

    def load(self, path) -> None:
        with self.lock:
            self.history.load(path)
