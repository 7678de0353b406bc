import random

import pytest

from rollout.default_task import (default_prompts, extract_answer, format_prompt, format_solution, make_problem,
                                  reward)


def test_worked_solutions_by_hand():
    assert format_solution("58+67", 125) == "8+7+0=15\n5+6+1=12\nanswer: 125"
    assert format_solution("402-58", 344) == "12-8-0=4\n10-5-1=4\n4-0-1=3\nanswer: 344"


def test_random_problems_have_their_value_as_answer():
    rng = random.Random(0)
    for _ in range(200):
        question, answer = make_problem(rng)
        a, b = (int(x) for x in question.replace("+", " ").replace("-", " ").split())
        assert answer == (a + b if "+" in question else a - b) and answer >= 0
        assert extract_answer(format_solution(question, answer)) == answer


def test_reward_checks_the_first_answer():
    prompt = format_prompt("58+67")
    assert reward(prompt, "8+7+0=15\n5+6+1=12\nanswer: 125") == 1.0
    assert reward(prompt, "answer: 124") == 0.0
    assert reward(prompt, "answer: 124\nanswer: 125") == 0.0  # no hedging
    assert reward(prompt, "no answer here") == 0.0


def test_default_prompts_are_deterministic_per_seed():
    assert default_prompts(5, seed=3) == default_prompts(5, seed=3)
    assert default_prompts(5, seed=3) != default_prompts(5, seed=4)
    assert all(p.startswith("Q: ") and p.endswith("A:\n") for p in default_prompts(5))


@pytest.mark.parametrize("call, message", [
    (lambda: reward("hello", "answer: 1"), "holds no question"),
    (lambda: format_solution("58+67", 124), "answer=124 is wrong"),
    (lambda: format_solution("58*67", 0), "is not"),
    (lambda: default_prompts(-1), "n=-1"),
])
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()
