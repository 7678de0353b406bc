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


# --- every argument checked: type and range, the field, the value and the fix ------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": True}, "temperature=True"),
    ({"top_p": "0.5"}, "top_p='0.5'"),
    ({"top_k": True}, "top_k=True"),
    ({"max_tokens": True}, "max_tokens=True"),
    ({"stop_token_ids": 5}, "stop_token_ids=5: must be a list"),
    ({"stop_token_ids": [True]}, r"stop_token_ids\[0\]=True"),
    ({"stop_token_ids": [3, -1]}, r"stop_token_ids\[1\]=-1"),
    ({"seed": "1"}, "seed='1'"),
    ({"seed": 1.5}, "seed=1.5"),
    ({"seed": True}, "seed=True"),
    ({"seed": -1}, "seed=-1"),
])
def test_sampling_params_check_types(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_an_underflowing_temperature_is_greedy(generator):
    """Below 1e-5 (vLLM's _SAMPLING_EPS) is greedy, with greedy logprobs (1e-30 once gave logprob 0 or NaN)."""
    assert SamplingParams(temperature=1e-30).temperature == 0.0 and SamplingParams(temperature=1e-5).temperature
    greedy, tiny = (generator.generate([[2, 3, 4]], 2, SamplingParams(temperature=t, max_tokens=6), use_tqdm=False)
                    for t in (0.0, 1e-30))
    for a, b in zip(greedy.samples, tiny.samples):
        assert a.completion_ids == b.completion_ids and a.logprobs == b.logprobs
    assert all(lp < 0 for lp in greedy.samples[0].logprobs)  # not the 0.0 of a one-hot distribution


@pytest.mark.parametrize("prompts, message", [
    ([[2, 48]], r"prompts\[0\]\[1\]=48: .*below the vocabulary size 48"),
    ([[2, 3], [-1, 2]], r"prompts\[1\]\[0\]=-1"),
    ([[True, 2]], r"prompts\[0\]\[0\]=True"),
])
def test_prompt_ids_outside_the_vocabulary(generator, prompts, message):
    """Once an IndexError deep in the model (or, for bools, accepted silently)."""
    with pytest.raises(ValueError, match=message):
        generator.generate(prompts, use_tqdm=False)


def test_stop_ids_outside_the_vocabulary(generator):
    with pytest.raises(ValueError, match=r"stop_token_ids\[0\]=48"):
        generator.generate([[2, 3]], sampling_params=SamplingParams(stop_token_ids=[48]), use_tqdm=False)


@pytest.mark.parametrize("bad", [{"temperature": 0.5}, "greedy"])
def test_sampling_params_must_be_sampling_params(generator, bad):
    with pytest.raises(ValueError, match="expected a rollout.SamplingParams"):
        generator.generate([[2, 3]], sampling_params=bad, use_tqdm=False)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_num_seqs": True}, "max_num_seqs=True"),
    ({"max_num_seqs": "4"}, "max_num_seqs='4'"),
    ({"max_model_len": 0}, "max_model_len=0"),
    ({"max_model_len": 65}, "max_model_len=65 is beyond the model's max_position_embeddings=64"),
    ({"seed": "0"}, "seed='0'"),
    ({"seed": 1.5}, "seed=1.5"),
    ({"seed": -1}, "seed=-1"),
    ({"seed": 2 ** 32}, "seed=4294967296"),
    ({"device": "gpu0"}, "device='gpu0'"),
    ({"device": "cuda:99"}, "device='cuda:99'"),
    ({"dtype": "int8"}, "dtype='int8'"),
    ({"dtype": "fp99"}, "dtype='fp99'"),
    ({"tokenizer": 5}, "tokenizer=5"),
    ({"draft_model": 5}, "draft_model=5"),
    ({"speculative_config": 5}, "speculative_config=5"),
    ({"speculative_config": "{method: ngram}"}, "is not valid JSON"),
    ({"speculative_config": '{"method": "ngram", "num_speculative_tokens": 2, "parallel_drafting": "false"}'},
     "parallel_drafting='false'"),
    ({"backend": "vllm", "device": "cpu"}, "device='cpu': backend='vllm' places the model itself"),
    ({"backend": "vllm", "vllm_kwargs": ["enforce_eager"]}, "vllm_kwargs=.*must be a dict"),
])
def test_generator_arguments(target, kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutGenerator(target, **kwargs)


def test_a_draft_model_without_a_draft_model_config_is_refused(target, draft):
    """It was loaded for nothing: a draft model without speculation is not speculation."""
    with pytest.raises(ValueError, match="draft_model=.* is given but the speculative method is None"):
        RolloutGenerator(target, draft_model=draft)
    with pytest.raises(ValueError, match="speculative method is 'ngram'"):
        RolloutGenerator(target, draft_model=draft, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_json_config_and_dtype_names_are_accepted(target):
    generator = RolloutGenerator(target, speculative_config='{"method": "ngram", "num_speculative_tokens": 2}',
                                 dtype="float32", device="cpu", max_num_seqs=2)
    assert generator.config.method == "ngram" and generator.backend.dtype == torch.float32
    assert len(generator.generate([[2, 3]], sampling_params=SamplingParams(max_tokens=3), use_tqdm=False).samples) == 1
