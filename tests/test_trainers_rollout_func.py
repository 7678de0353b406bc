"""SpecRolloutCallback.rollout_func as GRPOTrainer's rollout_func (trainers/rollout_func.py): the output contract,
prompt groups, sampling settings from the GRPOConfig, and the inputs it refuses."""

import pytest
from transformers import AutoTokenizer

from rollout import default_model_paths
from trainers import SpecRolloutCallback
from trainers.rollout_func import TrainerRollout, group_spans, run_rollout, sampling_params
from rollout.sampling_params import SamplingParams
from trainers_testing import default_tokenizer, grpo_config, grpo_trainer, shared_grpo_run, tiny_generator, tiny_policy

@pytest.fixture(scope="module")
def generator():
    return tiny_generator()


@pytest.fixture(scope="module")
def trainer(generator, tmp_path_factory):
    return _trainer(generator, tmp_path_factory.mktemp("rf"), max_completion_length=5)


def _trainer(generator, output_dir, **overrides):
    return grpo_trainer(tiny_policy(0), SpecRolloutCallback(generator), grpo_config(output_dir, **overrides))


def _rows(trainer, num_prompts: int, num_generations: int = 4) -> list[str]:
    prompts = [trainer.train_dataset[i]["prompt"] for i in range(num_prompts)]
    return [p for p in prompts for _ in range(num_generations)]


def test_one_completion_per_row_in_order(generator, trainer):
    rows = _rows(trainer, 3)
    out = trainer.rollout_func(rows, trainer)
    tokenizer = default_tokenizer()
    assert len(out["prompt_ids"]) == len(out["completion_ids"]) == len(out["logprobs"]) == len(out["acceptance"]) == 12
    for row, prompt_ids, completion_ids, logprobs in zip(rows, out["prompt_ids"], out["completion_ids"],
                                                         out["logprobs"]):
        assert prompt_ids == tokenizer(row)["input_ids"]
        assert 1 <= len(completion_ids) <= 5 and len(logprobs) == len(completion_ids)
    assert any(len(c) == 5 for c in out["completion_ids"])  # truncated at max_completion_length
    groups = [out["completion_ids"][i:i + 4] for i in range(0, 12, 4)]
    assert all(len({tuple(c) for c in group}) > 1 for group in groups)  # siblings are distinct samples
    assert set(out["acceptance"][0]) >= {"num_draft_tokens", "num_accepted_draft_tokens", "k_per_step"}


def test_acceptance_records_reach_the_reward_functions():
    run = shared_grpo_run()
    rows = [s for batch in run.batches for s in batch.samples]
    assert len(run.rewarded_acceptance) == len(rows) == 16  # 2 steps x 8 rows
    assert run.rewarded_acceptance == [s.acceptance for s in rows]


@pytest.mark.parametrize("chat_template_kwargs", [None, {"unused_variable": 1}])
def test_chat_prompts_are_rendered_as_grpo_trainer_renders_them(chat_template_kwargs, generator, tmp_path):
    trainer = _trainer(generator, tmp_path, chat_template_kwargs=chat_template_kwargs)
    messages = [{"role": "user", "content": "731-58"}]
    out = trainer.rollout_func([messages] * 4, trainer)
    expected, _, _ = trainer._tokenize_prompts([messages])
    assert out["prompt_ids"] == [list(expected[0])] * 4


def test_evaluation_rollouts_use_num_generations_eval(generator, tmp_path):
    trainer = _trainer(generator, tmp_path, num_generations_eval=2)
    trainer.model.eval()
    assert len(trainer.rollout_func(_rows(trainer, 2, num_generations=2), trainer)["completion_ids"]) == 4
    with pytest.raises(ValueError, match="num_generations=2"):
        trainer.rollout_func(_rows(trainer, 4, num_generations=1), trainer)  # four prompts once each


@pytest.mark.parametrize("num_rows, num_generations, offset, spans", [
    (8, 4, 0, [(0, 4), (4, 4)]),
    (6, 4, 0, [(0, 4), (4, 2)]),  # the last group continues on the next process
    (6, 4, 2, [(0, 2), (2, 4)]),  # the first group started on the previous process
    (2, 4, 1, [(0, 2)]),
    (5, 2, 1, [(0, 1), (1, 2), (3, 2)]),
])
def test_group_spans(num_rows, num_generations, offset, spans):
    assert group_spans(num_rows, num_generations, offset) == spans


def test_groups_cut_by_the_slice_come_back_in_row_order(generator):
    rows = [[1, 20, 5]] * 2 + [[1, 20, 6]] * 4 + [[1, 20, 7]] * 1
    spans = group_spans(len(rows), 4, offset=2)
    batch = run_rollout(generator, TrainerRollout(rows, spans, SamplingParams(max_tokens=4), process_index=1))
    assert [s.prompt_ids for s in batch.samples] == rows
    assert [s.prompt_index for s in batch.samples] == [0, 0, 1, 1, 1, 1, 2]
    assert [s.sample_index for s in batch.samples] == [0, 1, 0, 1, 2, 3, 0]
    assert batch.stats["num_generate_calls"] == 3


def test_processes_draw_different_samples_for_a_shared_group(generator):
    rows = [[1, 20, 5]] * 4
    spans = group_spans(4, 4)
    params = SamplingParams(max_tokens=8)
    first, second = (run_rollout(generator, TrainerRollout(rows, spans, params, process_index=i)) for i in (0, 1))
    assert [s.completion_ids for s in first.samples] != [s.completion_ids for s in second.samples]


def test_rows_not_repeated_num_generations_times(generator, trainer):
    rows = [trainer.train_dataset[i]["prompt"] for i in range(8)]  # each prompt once, num_generations=4
    with pytest.raises(ValueError, match="num_generations=4: rows 0..3"):
        trainer.rollout_func(rows, trainer)


def test_trainer_tokenizer_must_match(generator, tmp_path):
    other = AutoTokenizer.from_pretrained(default_model_paths()["target"])
    other.add_tokens(["<tool>"])
    trainer = _trainer(generator, tmp_path)
    trainer.processing_class = other
    with pytest.raises(ValueError, match="processing_class"):
        trainer.rollout_func(_rows(trainer, 1), trainer)


def test_sampling_settings_come_from_the_grpo_config(tmp_path):
    args = grpo_config(tmp_path, temperature=0.7, top_p=0.9, top_k=5, max_completion_length=33)
    assert sampling_params(args, max_model_len=128) == SamplingParams(temperature=0.7, top_p=0.9, top_k=5,
                                                                      max_tokens=33)
    assert sampling_params(grpo_config(tmp_path, top_k=0), 128).top_k == -1  # TRL's "off"
    assert sampling_params(grpo_config(tmp_path, max_completion_length=None), 128).max_tokens == 128


@pytest.mark.parametrize("setting, match", [
    ({"min_p": 0.1}, "min_p=0.1"),
    ({"repetition_penalty": 1.1}, "repetition_penalty=1.1"),
    ({"generation_kwargs": {"num_beams": 2}}, "generation_kwargs"),
])
def test_sampling_settings_the_engine_cannot_honour(setting, match, generator, tmp_path):
    trainer = _trainer(generator, tmp_path, **setting)
    with pytest.raises(ValueError, match=match):
        trainer.train()
