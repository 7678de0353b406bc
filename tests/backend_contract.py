"""The Backend protocol's contract (rollout/backend.py) as checks that every backend must pass, whatever it runs on:
tests/test_backend_contract.py runs them on the embedded engine (the default stage), tests/test_vllm_backend_contract.py
on vLLM in this process and on a vLLM server (the vLLM stage). A check takes a Subject: the backend, the prompts it
rolls out, the target's weights under HF names, and the methods the backend documents as NotImplementedError (a
server cannot change its schedule). Every check runs on every backend: it checks the behaviour, or, for a method the
backend refuses, the refusal and that nothing changed. Shapes stay tiny: a few prompts, a few tokens."""

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

from rollout import SamplingParams
from rollout.backend import Backend
from spec import SpecConfig

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
ATTRIBUTES = ("config", "max_model_len", "max_num_seqs", "eos_token_ids", "is_shared", "base_url", "target_source")
METHODS = tuple(name for name, value in vars(Backend).items() if callable(value) and not name.startswith("_"))


@dataclass
class Subject:
    backend: Backend
    prompt_ids: list[list[int]]
    target_weights: Callable[[], list[tuple[str, torch.Tensor]]]  # the target's weights as it runs now
    tmp_path: Path
    refuses: frozenset[str] = frozenset()  # Backend methods this backend documents as NotImplementedError


def _text(token_ids: list[int]) -> str:
    """The decode a check passes: its text shows which tokens it was given."""
    return " ".join(map(str, token_ids))


def _greedy(subject: Subject) -> list[tuple[list[int], list[float]]]:
    batch = subject.backend.generate(subject.prompt_ids, 1, GREEDY, seed=0, decode=_text, use_tqdm=False)
    return [(sample.completion_ids, sample.logprobs) for sample in batch.samples]


def _assert_same_rollouts(actual, expected) -> None:
    assert [ids for ids, _ in actual] == [ids for ids, _ in expected]
    for (_, logprobs), (_, reference) in zip(actual, expected):
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(reference), atol=1e-4, rtol=0)


def check_attributes(subject: Subject) -> None:
    """Every attribute and method the protocol names, with the types it states."""
    backend = subject.backend
    assert all(hasattr(backend, name) for name in ATTRIBUTES)
    assert all(callable(getattr(backend, name)) for name in METHODS) and "generate" in METHODS
    assert backend.config is None or isinstance(backend.config, SpecConfig)
    assert isinstance(backend.max_model_len, int) and backend.max_model_len > MAX_TOKENS
    assert isinstance(backend.max_num_seqs, int) and backend.max_num_seqs >= 1
    assert isinstance(backend.eos_token_ids, set) and all(isinstance(t, int) for t in backend.eos_token_ids)
    assert isinstance(backend.is_shared, bool)
    assert isinstance(backend.base_url, str) if backend.is_shared else backend.base_url is None


def check_generate(subject: Subject) -> None:
    """num_generations samples per prompt in input order, each with one logprob a token, a finish reason that
    matches how it ended, and its acceptance record; the batch's stats and spec/ metrics."""
    num_generations, params = 2, SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS)
    batch = subject.backend.generate(subject.prompt_ids, num_generations, params, seed=3, decode=_text,
                                     use_tqdm=False)
    assert [(s.prompt_index, s.sample_index) for s in batch.samples] == [
        (i, j) for i in range(len(subject.prompt_ids)) for j in range(num_generations)]
    for sample in batch.samples:
        assert sample.prompt_ids == subject.prompt_ids[sample.prompt_index]
        assert 1 <= len(sample.completion_ids) <= MAX_TOKENS and len(sample.logprobs) == len(sample.completion_ids)
        assert sample.text == _text(sample.completion_ids)
        assert all(math.isfinite(lp) and lp <= 1e-6 for lp in sample.logprobs)
        stopped = sample.completion_ids[-1] in subject.backend.eos_token_ids
        assert sample.finish_reason == ("stop" if stopped else "length")
        assert stopped or len(sample.completion_ids) == MAX_TOKENS
        record = sample.acceptance
        assert 0 <= record["num_accepted_draft_tokens"] <= record["num_draft_tokens"]
    assert batch.stats["num_requests"] == len(batch.samples)
    assert batch.metrics and all(key.startswith("spec/") for key in batch.metrics)


def check_greedy_is_lossless_call_after_call(subject: Subject) -> None:
    """Greedy rollouts are the same call after call, whatever the drafter learnt from the calls before."""
    first = _greedy(subject)
    _assert_same_rollouts(_greedy(subject), first)


def check_weight_loads_are_all_or_nothing(subject: Subject) -> None:
    """A bad name, a missing parameter or a source that fails part-way is a ValueError (or the source's error) and
    leaves the target as it was; the full set loads and counts its tensors."""
    backend, weights, before = subject.backend, subject.target_weights(), _greedy(subject)

    def failing():
        yield weights[0]
        raise RuntimeError("the source failed")

    with pytest.raises(ValueError):
        backend.load_weights(iter([("model.no_such_layer.weight", weights[0][1]), *weights]))
    with pytest.raises(ValueError):
        backend.load_weights(iter(weights[:-1]))
    with pytest.raises(RuntimeError, match="the source failed"):
        backend.load_weights(failing())
    _assert_same_rollouts(_greedy(subject), before)
    assert backend.load_weights(iter(weights)) == len(weights)
    _assert_same_rollouts(_greedy(subject), before)


def check_draft_model(subject: Subject) -> None:
    """Where the method has a draft model: a copy of it, which loads back; elsewhere a ValueError."""
    backend = subject.backend
    if backend.config is None or backend.config.method != "draft_model":
        with pytest.raises(ValueError):
            backend.draft_model_copy()
        with pytest.raises(ValueError):
            backend.load_draft_weights(iter([]))
        return
    before = _greedy(subject)
    copy = backend.draft_model_copy()
    weights = [(name, param.detach()) for name, param in copy.named_parameters()]
    assert backend.load_draft_weights(iter(weights)) == len(weights)
    _assert_same_rollouts(_greedy(subject), before)


def _refusal_changes_nothing(subject: Subject, name: str, *args) -> None:
    """A method the backend refuses raises NotImplementedError and leaves the rollouts and the schedule as they were."""
    backend, before = subject.backend, _greedy(subject)
    schedule = backend.config.schedule.ranges if backend.config else None
    with pytest.raises(NotImplementedError):
        getattr(backend, name)(*args)
    assert (backend.config.schedule.ranges if backend.config else None) == schedule
    _assert_same_rollouts(_greedy(subject), before)


def check_schedule(subject: Subject) -> None:
    """use_schedule: K follows the new schedule from the next call on (or the documented refusal: an engine that
    runs the schedule it was started with)."""
    backend = subject.backend
    if backend.config is None:
        return
    if "use_schedule" in subject.refuses:
        return _refusal_changes_nothing(subject, "use_schedule", [[1, backend.max_num_seqs, 1]])
    original = backend.config.num_speculative_tokens_per_batch_size or [[1, 1, backend.config.num_speculative_tokens]]
    backend.use_schedule([[1, backend.max_num_seqs, 1]])
    try:
        assert backend.config.schedule.k_for_batch_size(1) == 1
        batch = backend.generate(subject.prompt_ids, 1, GREEDY, seed=0, decode=_text, use_tqdm=False)
        assert all(max(s.acceptance["k_per_step"], default=0) <= 1 for s in batch.samples)
    finally:
        backend.use_schedule(original)


def check_speculation_swap(subject: Subject) -> None:
    """build_speculation and use_speculation swap the drafter in (greedy rollouts unchanged), or the documented
    refusal (an engine built with its config)."""
    backend = subject.backend
    if "build_speculation" in subject.refuses:
        _refusal_changes_nothing(subject, "build_speculation", backend.config)
        return _refusal_changes_nothing(subject, "use_speculation", None)
    before = _greedy(subject)
    speculation = backend.build_speculation(backend.config)
    backend.use_speculation(speculation)
    _assert_same_rollouts(_greedy(subject), before)


def check_history_file(subject: Subject) -> None:
    """backend.history: None exactly where the drafter keeps no rollout history (rollout/history.py); elsewhere save
    writes one file, load reads it back, and a file that is not a history is a ValueError."""
    backend, path = subject.backend, subject.tmp_path / "history.npz"
    history = backend.history
    assert (history is None) == (backend.config is None or backend.config.method != "history")
    if history is None:
        return
    history.save(path)
    assert path.exists()
    history.load(path)
    garbage = subject.tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a rollout history")
    with pytest.raises(ValueError):
        history.load(garbage)


def check_step_times(subject: Subject) -> None:
    """measure_step_times: positive seconds at the batch sizes and Ks asked for, the schedule as it was (or the
    documented refusal: an engine not in this process). Without a speculative config there is no K to time: a
    ValueError."""
    backend = subject.backend
    if "measure_step_times" in subject.refuses:
        return _refusal_changes_nothing(subject, "measure_step_times", subject.prompt_ids, [1, 2], [0, 1])
    if backend.config is None:
        with pytest.raises(ValueError):
            backend.measure_step_times(subject.prompt_ids, [1, 2], [0, 1])
        return
    schedule = backend.config.schedule
    times = backend.measure_step_times(subject.prompt_ids, [1, 2], [0, 1])
    assert all(times.step_seconds(b, k) > 0 for b in (1, 2) for k in (0, 1))
    backend.use_schedule([list(r) for r in schedule.ranges])


CHECKS = (check_attributes, check_generate, check_greedy_is_lossless_call_after_call,
          check_weight_loads_are_all_or_nothing, check_draft_model, check_schedule, check_speculation_swap,
          check_history_file, check_step_times)
