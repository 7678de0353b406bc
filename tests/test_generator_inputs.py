"""Bad input: each a clear error naming the field, the value and the fix; nothing dropped silently."""

import pytest
import torch
from conftest import tiny_llama

from rollout import RolloutGenerator, SamplingParams


@pytest.fixture(scope="module")
def generator(target):
    return RolloutGenerator(target, max_model_len=16)


@pytest.mark.parametrize("prompts, message", [
    ([], "non-empty list of prompts"),
    ("1 + 1", "non-empty list of prompts"),
    ([[1, 2], []], r"prompts\[1\] is empty"),
    ([list(range(2, 18))], r"prompts\[0\] has 16 tokens.*max_model_len=16"),
    (["text without a tokenizer"], "no tokenizer"),
    ([3.5], "expected a string, a list of chat messages"),
])
def test_bad_prompts(generator, prompts, message):
    with pytest.raises(ValueError, match=message):
        generator.generate(prompts, use_tqdm=False)


@pytest.mark.parametrize("num_generations", [0, -1, 1.5])
def test_bad_num_generations(generator, num_generations):
    with pytest.raises(ValueError, match=f"num_generations={num_generations}"):
        generator.generate([[2, 3]], num_generations=num_generations, use_tqdm=False)


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature=-0.1"),
    ({"temperature": float("nan")}, "temperature=nan"),
    ({"top_p": 0.0}, "top_p=0.0"),
    ({"top_p": 1.5}, "top_p=1.5"),
    ({"top_k": 0}, "top_k=0"),
    ({"top_k": -2}, "top_k=-2"),
    ({"max_tokens": 0}, "max_tokens=0"),
    ({"stop_token_ids": ["</s>"]}, "stop_token_ids"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_draft_with_another_vocabulary(target):
    other = tiny_llama(5, vocab_size=40)
    with pytest.raises(ValueError, match="vocabulary of 40 tokens, the target 48"):
        RolloutGenerator(target, draft_model=other,
                         speculative_config={"method": "draft_model", "num_speculative_tokens": 2})


def test_draft_model_without_a_model(target):
    with pytest.raises(ValueError, match="model=None"):
        RolloutGenerator(target, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})


def test_draft_model_path_that_is_not_a_folder(target, tmp_path):
    with pytest.raises(ValueError, match="draft_model=.*expected a local model folder"):
        RolloutGenerator(target, speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                                     "model": str(tmp_path / "missing")})


def test_non_finite_logits_are_an_error():
    broken = tiny_llama(6)
    with torch.no_grad():
        broken.lm_head.weight[0, 0] = float("nan")
    generator = RolloutGenerator(broken, max_num_seqs=4)
    with pytest.raises(ValueError, match="non-finite logits"):
        generator.generate([[2, 3]], num_generations=3, use_tqdm=False)
    assert generator.backend.runner.num_free_slots == 4  # the failed call gave its cache slots back


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_vllm_only_method(target, method):
    with pytest.raises(NotImplementedError, match='backend="vllm"'):
        RolloutGenerator(target, speculative_config={"method": method, "model": "/m", "num_speculative_tokens": 2})


def test_text_chat_and_dataset_prompts_tokenise_alike():
    from datasets import Dataset

    from rollout.default_task import format_prompt

    generator = RolloutGenerator("default", max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    text = generator.generate([format_prompt("58+67")], sampling_params=params, use_tqdm=False)
    chat = generator.generate([[{"role": "user", "content": "58+67"}]], sampling_params=params, use_tqdm=False)
    dataset = generator.generate(Dataset.from_dict({"prompt": [format_prompt("58+67")]}), sampling_params=params,
                                 use_tqdm=False)
    assert text.samples[0].prompt_ids == chat.samples[0].prompt_ids == dataset.samples[0].prompt_ids
    assert text.samples[0].prompt_ids[0] == generator.tokenizer.bos_token_id
    assert text.samples[0].completion_ids == chat.samples[0].completion_ids
    assert text.samples[0].text == generator.tokenizer.decode(text.samples[0].completion_ids,
                                                              skip_special_tokens=True)


def test_dataset_without_a_prompt_column():
    from datasets import Dataset

    generator = RolloutGenerator("default", max_num_seqs=2)
    with pytest.raises(ValueError, match="needs a 'prompt' column"):
        generator.generate(Dataset.from_dict({"question": ["1+1"]}), use_tqdm=False)
