"""The model-runner protocol: what the engine (rollout/embedded_backend/engine.py), the draft-model drafter
(spec/proposers/draft_model.py) and the embedded backend (rollout/embedded_backend/backend.py, which hands adaptive
verification `padded_queries`) call on a runner. `RaggedRunner` (spec/model_runner.py, Llama-family models) and
`PaddedRunner` (spec/padded_runner.py, any causal LM) implement it; `build_runner` picks one.

A runner owns max_num_seqs cache *slots*, each holding the cached context of one sequence: positions
0 .. seq_len(slot) - 1. A forward appends each row's new tokens at positions seq_len(slot) ..; rolling back rejected
drafts is `crop` (the length moves back, nothing is recomputed), and a sibling sample reuses a prompt's prefill with
`copy_prefix`. Bad arguments (a slot not allocated, a length out of range, a row that would outgrow max_model_len)
raise ValueError.
"""

from typing import Protocol

import torch


class Runner(Protocol):
    """A cached forward over many rows, each in its own slot (module docstring)."""

    model: torch.nn.Module  # what forward computes with: the caller's model when already on `device` in the runner's
    # dtype (weights shared: in-place weight loads are seen by the next forward), else a converted copy
    device: torch.device  # the model's, and forward's logits'

    @property
    def num_free_slots(self) -> int:
        """Slots that `allocate` can still hand out."""
        ...

    def allocate(self) -> int:
        """The lowest free slot, holding nothing (seq_len 0); ValueError when all max_num_seqs are in use. Lowest
        first: a caller that moves its rows into freed slots keeps them in slots 0 .. n - 1."""
        ...

    def free(self, slot: int) -> None:
        """Give an allocated slot back, for `allocate` to hand out again."""
        ...

    def seq_len(self, slot: int) -> int:
        """Tokens the allocated slot holds."""
        ...

    def crop(self, slot: int, length: int) -> None:
        """Keep the slot's first `length` positions, 0 <= length <= seq_len(slot) (rollback)."""
        ...

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Make allocated slot `dst` hold the first `length` positions of slot `src`, 0 <= length <= seq_len(src);
        afterwards seq_len(dst) == length."""
        ...

    def release_all(self) -> None:
        """Free every slot, whatever state a failed caller left them in (a slot allocated and not recorded, a move
        half done): the reset after a failed call or drafter step. The next allocate hands out slot 0."""
        ...

    def forward(self, slots: list[int], token_ids: list[list[int]], num_logits: list[int]) -> torch.Tensor:
        """Append token_ids[i] (at least one token) to slots[i] (each slot at most once) and return float32 logits
        [sum(num_logits), vocab] of each row's last num_logits[i] new tokens (0 <= num_logits[i] <=
        len(token_ids[i])), row-major. Arguments are checked before any slot changes."""
        ...

    def padded_queries(self, num_rows: int, num_tokens: int, width: int, num_wide: int) -> int:
        """Query slots a forward pads (computed and thrown away) when num_rows rows feed num_tokens tokens, the widest
        row `width`, num_wide rows more than one: what adaptive verification prices beside the tokens."""
        ...
