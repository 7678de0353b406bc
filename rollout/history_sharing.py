"""Rollout history across the processes of one training job: after each rollout, every process's finished rollouts
reach every other process's history, so that a prompt drafts from all of its earlier rollouts wherever TRL's
sampler sends it next epoch (it reshuffles the prompts and hands each process a contiguous slice of them).

One all-gather of Python objects per rollout on the job's process group (torch.distributed's default group, gloo on
CPU): each process sends its rollouts as int32 arrays, its prompts once per group (one array holding them all,
with their lengths) and its completions likewise, with the prompt index of each. 64 prompts x 8 x 500 tokens is
about 1 MB. A process adds the other processes' rollouts only: its own reached its history as its requests
finished. A collective that fails leaves every history as it was, with a warning: drafts change speed, never the
samples, so sharing must never fail a training step.
"""

import time
import warnings

import numpy as np
import torch.distributed as dist

from rollout.outputs import RolloutBatch


def default_group():
    """torch.distributed's default group when it is initialized with more than one process, else None."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.group.WORLD


def gather_rollouts(batch: RolloutBatch, group) -> tuple[list[list[int]], list[list[int]]] | None:
    """(prompt ids, completion ids) of every other process's rollouts in `group`, this process's `batch` sent to
    them; None, with a warning, when the collective fails."""
    packed = pack(batch)
    try:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, packed, group=group)
        rank = dist.get_rank(group)
    except Exception as e:  # a peer gone, a timeout: the rollouts are fine, only their sharing failed
        warnings.warn(f"sharing rollout history across processes failed ({type(e).__name__}: {e}); every process "
                      "keeps the history it had, and training goes on", RuntimeWarning, stacklevel=2)
        return None
    prompts, completions = [], []
    for other in (g for r, g in enumerate(gathered) if r != rank):
        p, c = unpack(other)
        prompts += p
        completions += c
    return prompts, completions


def share(generator, batch: RolloutBatch, group) -> dict:
    """gather_rollouts, then the others' rollouts into `generator`'s history; {"num_shared", "seconds"}."""
    start = time.perf_counter()
    gathered = gather_rollouts(batch, group)
    num_shared = 0
    if gathered is not None and gathered[0]:
        generator.rollout_history.add(*gathered)
        num_shared = len(gathered[0])
    return {"num_shared": num_shared, "seconds": time.perf_counter() - start}


def pack(batch: RolloutBatch) -> dict[str, np.ndarray]:
    """A batch's rollouts as flat int32 token arrays with lengths; each distinct prompt once."""
    prompt_index: dict[tuple, int] = {}
    of_sample = [prompt_index.setdefault(tuple(s.prompt_ids), len(prompt_index)) for s in batch.samples]
    prompts = list(prompt_index)
    completions = [s.completion_ids for s in batch.samples]
    return {"prompt_tokens": _flat(prompts), "prompt_lengths": np.array([len(p) for p in prompts], np.int64),
            "completion_tokens": _flat(completions),
            "completion_lengths": np.array([len(c) for c in completions], np.int64),
            "prompt_of_completion": np.array(of_sample, np.int64)}


def unpack(packed: dict[str, np.ndarray]) -> tuple[list[list[int]], list[list[int]]]:
    """pack's inverse: (prompt ids, completion ids), one pair per rollout, as Python ints."""
    prompts = _split(packed["prompt_tokens"], packed["prompt_lengths"])
    completions = _split(packed["completion_tokens"], packed["completion_lengths"])
    return [prompts[i] for i in packed["prompt_of_completion"].tolist()], completions


def _flat(rows) -> np.ndarray:
    return np.concatenate([np.asarray(row, dtype=np.int32) for row in rows]) if rows else np.zeros(0, np.int32)


def _split(tokens: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    return [part.tolist() for part in np.split(tokens, np.cumsum(lengths)[:-1])] if len(lengths) else []
