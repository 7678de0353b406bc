"""Rollout history: per prompt, the outputs of its recent rollouts, as compact token arrays.

RL revisits its prompts: a GRPO group samples one prompt G times, and every epoch over a fixed dataset comes back to it.
A prompt's earlier rollouts are the best drafts for its next ones (SPEC-RL, DAS, RhymeRL), however far the policy has
moved since: verification keeps the samples on-policy whatever the drafts, so history survives weight syncs and drafter
refreshes, and only its acceptance fades as the policy drifts.

The store keeps, per prompt (keyed by its token ids), the last `max_rollouts_per_prompt` outputs, each one int32 array:
4.4 bytes a stored rollout token in all (the README's measured figure, at 500-token outputs: 4 of id, the rest each
output's bookkeeping); identical outputs of a prompt, common in RL, are kept once with a count. Its memory is bounded by
`max_tokens` tokens over all prompts: past it, the least recently used prompts (read or written) are evicted first.
Tries are built from it only while a prompt's group runs (spec/proposers/suffix.py).

`save` and `load` write and read the whole store as one .npz file (the trainer callback checkpoints it with the
trainer); `load` refuses a file written for another vocabulary.
"""

import io
import os
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spec.config_keys import check_keys

FORMAT = 1  # in every file: a file of another format is not read


@dataclass(eq=False, slots=True)
class HistoryEntry:
    tokens: np.ndarray  # int32 [n]
    count: int  # how many of the prompt's recent rollouts produced exactly these tokens


class HistoryStore:
    """max_rollouts_per_prompt: outputs kept per prompt (the latest); max_tokens: tokens kept over all prompts (least
    recently used prompts evicted first); 0 keeps nothing."""

    def __init__(self, max_rollouts_per_prompt: int = 16, max_tokens: int = 50_000_000):
        check_keys(history_max_rollouts_per_prompt=max_rollouts_per_prompt, history_max_tokens=max_tokens)
        self.max_rollouts_per_prompt = max_rollouts_per_prompt
        self.max_tokens = max_tokens
        self._prompts: OrderedDict[bytes, list[HistoryEntry]] = OrderedDict()  # least recently used first
        self.num_tokens = 0  # stored, each distinct output once

    @property
    def num_prompts(self) -> int:
        return len(self._prompts)

    @property
    def num_rollouts(self) -> int:
        return sum(entry.count for entries in self._prompts.values() for entry in entries)

    def nbytes(self) -> int:
        """The token arrays' bytes (what max_tokens bounds; keys and bookkeeping add the rest, module docstring)."""
        return sum(entry.tokens.nbytes for entries in self._prompts.values() for entry in entries)

    def outputs(self, prompt_ids) -> list[HistoryEntry]:
        """The prompt's stored outputs, oldest first (empty for a prompt not seen); marks it recently used."""
        key = _key(prompt_ids)
        entries = self._prompts.get(key)
        if entries is None:
            return []
        self._prompts.move_to_end(key)
        return list(entries)

    def add(self, prompt_ids, output_ids) -> None:
        """Record one rollout's output of the prompt; the oldest beyond the window and the least recently used
        prompts beyond the token budget go."""
        if self.max_rollouts_per_prompt == 0 or len(output_ids) > self.max_tokens or not len(output_ids):
            return
        key = _key(prompt_ids)
        entries = self._prompts.setdefault(key, [])
        self._prompts.move_to_end(key)
        tokens = np.asarray(output_ids, dtype=np.int32)
        same = next((i for i, e in enumerate(entries) if np.array_equal(e.tokens, tokens)), None)
        if same is not None:  # the newest now: it moves to the end of the window
            entry = entries.pop(same)
            entry.count += 1
            entries.append(entry)
        else:
            entries.append(HistoryEntry(tokens, 1))
            self.num_tokens += len(tokens)
        self._trim_window(entries)
        self._evict()

    def update(self, other: "HistoryStore") -> None:
        """Add every rollout of `other` (each output as many times as its count), its least recently used prompts
        first: what merging two processes' or servers' histories takes."""
        for key, entries in list(other._prompts.items()):
            prompt = np.frombuffer(key, dtype=np.int32)
            for entry in entries:
                for _ in range(entry.count):
                    self.add(prompt, entry.tokens)

    def subset(self, keep) -> "HistoryStore":
        """A store with this one's bounds that holds the prompts for which keep(prompt token ids) is true, with their
        outputs and recency: what one server of a pool loads."""
        part = HistoryStore(self.max_rollouts_per_prompt, self.max_tokens)
        for key, entries in self._prompts.items():
            if keep(np.frombuffer(key, dtype=np.int32).tolist()):
                part._prompts[key] = [HistoryEntry(e.tokens, e.count) for e in entries]
                part.num_tokens += sum(len(e.tokens) for e in entries)
        return part

    def _trim_window(self, entries: list[HistoryEntry]) -> None:
        """Drop the oldest rollouts until at most max_rollouts_per_prompt remain."""
        excess = sum(e.count for e in entries) - self.max_rollouts_per_prompt
        while excess > 0:
            oldest = entries[0]
            taken = min(oldest.count, excess)
            oldest.count -= taken
            excess -= taken
            if oldest.count == 0:
                entries.pop(0)
                self.num_tokens -= len(oldest.tokens)

    def _evict(self) -> None:
        """Evict the least recently used prompts until the budget holds; a prompt alone over it (the one just
        written is the most recently used) loses its oldest outputs."""
        while self.num_tokens > self.max_tokens:
            key, entries = next(iter(self._prompts.items()))
            if len(self._prompts) > 1:
                removed = self._prompts.pop(key)
            else:
                removed = [entries.pop(0)]
                if not entries:
                    del self._prompts[key]
            self.num_tokens -= sum(len(e.tokens) for e in removed)

    def save(self, path) -> None:
        """Write the store to `path` (.npz), atomically (a temporary file renamed into place)."""
        prompts, entries = list(self._prompts), list(self._prompts.values())
        outputs = [e for group in entries for e in group]
        arrays = {
            "format": np.array([FORMAT]),
            "prompt_tokens": np.frombuffer(b"".join(prompts), dtype=np.int32),
            "prompt_lengths": np.array([len(k) // 4 for k in prompts], dtype=np.int64),
            "outputs_per_prompt": np.array([len(group) for group in entries], dtype=np.int64),
            "output_tokens": np.concatenate([e.tokens for e in outputs]) if outputs else np.zeros(0, np.int32),
            "output_lengths": np.array([len(e.tokens) for e in outputs], dtype=np.int64),
            "output_counts": np.array([e.count for e in outputs], dtype=np.int64),
        }
        path = Path(path)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        with open(partial, "wb") as f:
            np.savez(f, **arrays)
        os.replace(partial, path)

    def load(self, path, vocab_size: int | None = None) -> None:
        """Replace the store with the one saved at `path`. ValueError (the store unchanged) for a file that is not a
        complete history of this format, or holds token ids outside [0, vocab_size) when vocab_size is given."""
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {name: data[name] for name in data.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, io.UnsupportedOperation) as e:
            raise ValueError(f"{path}: not a readable rollout history ({type(e).__name__}: {e})") from None
        prompts = _unpack(arrays, path, vocab_size)
        self._prompts.clear()
        self.num_tokens = 0
        for key, group in prompts:
            self._prompts[key] = group
            self.num_tokens += sum(len(e.tokens) for e in group)
        for entries in self._prompts.values():
            self._trim_window(entries)
        self._evict()


def _key(prompt_ids) -> bytes:
    return np.asarray(prompt_ids, dtype=np.int32).tobytes()


def _unpack(arrays: dict, path, vocab_size: int | None) -> list[tuple[bytes, list[HistoryEntry]]]:
    """(key, entries) per prompt, least recently used first; ValueError naming what is wrong."""
    needed = ("format", "prompt_tokens", "prompt_lengths", "outputs_per_prompt", "output_tokens", "output_lengths",
              "output_counts")
    missing = [name for name in needed if name not in arrays]
    if missing or arrays["format"].tolist() != [FORMAT]:
        raise ValueError(f"{path}: not a rollout history of format {FORMAT} (missing {missing or 'nothing'}, format "
                         f"{arrays.get('format', np.array([])).tolist()})")
    prompt_lengths, per_prompt = arrays["prompt_lengths"], arrays["outputs_per_prompt"]
    output_lengths, counts = arrays["output_lengths"], arrays["output_counts"]
    tokens = [arrays["prompt_tokens"], arrays["output_tokens"]]
    if (len(prompt_lengths) != len(per_prompt) or per_prompt.sum() != len(output_lengths)
            or len(output_lengths) != len(counts)
            or prompt_lengths.sum() != len(tokens[0]) or output_lengths.sum() != len(tokens[1])
            or (counts < 1).any()):
        raise ValueError(f"{path}: the rollout history's arrays do not agree in length (a truncated or edited file)")
    if vocab_size is not None and any(len(t) and (t.min() < 0 or t.max() >= vocab_size) for t in tokens):
        raise ValueError(f"{path}: the rollout history holds token ids outside this model's vocabulary "
                         f"[0, {vocab_size}): it was written for another model")
    prompt_ends, output_ends = np.cumsum(prompt_lengths), np.cumsum(output_lengths)
    result, first = [], 0
    for i, num_outputs in enumerate(per_prompt.tolist()):
        prompt = tokens[0][prompt_ends[i] - prompt_lengths[i]:prompt_ends[i]].astype(np.int32).tobytes()
        entries = [HistoryEntry(tokens[1][output_ends[j] - output_lengths[j]:output_ends[j]].astype(np.int32).copy(),
                                int(counts[j])) for j in range(first, first + num_outputs)]
        result.append((prompt, entries))
        first += num_outputs
    return result
