"""Weight sync on the embedded backend (rollout/weights.py) is atomic: a bad or failing source leaves every
parameter bitwise as it was and the generator's completions unchanged; a good one is cast to the model's dtype."""

import copy

import pytest
import torch
from conftest import tiny_llama

from rollout import RolloutGenerator, SamplingParams

PROMPTS = [[5, 6, 7, 5], [9], [3, 4]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
WEIGHT = "model.layers.0.self_attn.q_proj.weight"


def _missing_key(named):
    return [(n, t) for n, t in named if n != WEIGHT]


def _wrong_shape(named):
    return [(n, t[:-1] if n == WEIGHT else t) for n, t in named]


def _unknown_name(named):
    return named + [("model.layers.9.self_attn.q_proj.weight", named[0][1])]


def _integer_tensor(named):
    return [(n, t.to(torch.int64) if n == WEIGHT else t) for n, t in named]


def _bool_tensor(named):
    return [(n, t > 0 if n == WEIGHT else t) for n, t in named]


def _raising_midway(named):
    def source():
        yield from named[:len(named) // 2]
        raise RuntimeError("the trainer's gather failed")
    return source()


BAD_SOURCES = {"missing_key": (_missing_key, ValueError, "were not given"),
               "wrong_shape": (_wrong_shape, ValueError, "has shape"),
               "unknown_name": (_unknown_name, ValueError, "no parameter of that name"),
               "integer_tensor": (_integer_tensor, ValueError, "dtype torch.int64"),
               "bool_tensor": (_bool_tensor, ValueError, "dtype torch.bool"),
               "raising_midway": (_raising_midway, RuntimeError, "gather failed")}


def _perturbed(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter of `model`, shifted: what a trained policy would send."""
    return [(name, p.detach() + 0.05) for name, p in model.named_parameters()]


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _assert_unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def _completions(generator) -> list[list[int]]:
    return [s.completion_ids for s in generator.generate(PROMPTS, 1, GREEDY, use_tqdm=False).samples]


@pytest.fixture(scope="module")
def generator(target, draft):
    return RolloutGenerator(copy.deepcopy(target), draft_model=copy.deepcopy(draft), max_num_seqs=4, max_model_len=32,
                            speculative_config={"method": "draft_model", "num_speculative_tokens": 2})


@pytest.mark.parametrize("source", BAD_SOURCES)
def test_a_bad_target_source_changes_nothing(generator, source):
    make, error, message = BAD_SOURCES[source]
    model = generator.backend.runner.model
    before, completions = _snapshot(model), _completions(generator)
    with pytest.raises(error, match=message):
        generator.load_weights(make(_perturbed(model)))
    _assert_unchanged(model, before)
    assert _completions(generator) == completions


@pytest.mark.parametrize("source", BAD_SOURCES)
def test_a_bad_draft_source_changes_nothing(generator, source):
    make, error, message = BAD_SOURCES[source]
    model = generator.backend.speculation.proposer.runner.model
    before, completions = _snapshot(model), _completions(generator)
    with pytest.raises(error, match=message):
        generator.load_draft_weights(make(_perturbed(model)))
    _assert_unchanged(model, before)
    assert _completions(generator) == completions


def test_a_float16_source_is_cast_into_a_float32_model():
    target = tiny_llama(3)
    generator = RolloutGenerator(target, max_num_seqs=2, max_model_len=32)
    source = [(name, p.detach().half() + 0.5) for name, p in target.named_parameters()]
    assert generator.load_weights(source) == len(source)
    for (name, tensor), param in zip(source, generator.backend.runner.model.parameters()):
        assert param.dtype == torch.float32 and torch.equal(param, tensor.float())


def test_draft_weights_need_a_draft_model(target):
    generator = RolloutGenerator(target, max_model_len=32,
                                 speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="method is 'ngram', which has no draft model.*method 'draft_model'"):
        generator.load_draft_weights(target.named_parameters())
