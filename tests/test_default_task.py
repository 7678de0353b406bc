import random
import statistics

import pytest

from rollout import default_task
from rollout.default_task import (default_prompts, extract_answer, format_prompt, format_solution, make_problem,
                                  reward)


def test_worked_solutions_by_hand():
    assert format_prompt("7+35+12+9") == "Q: 7+35+12+9\nA:\n"
    assert format_solution("7+35+12+9", 63) == "  42+12+9\n     54+9\n       63\nanswer: 63"
    assert format_solution("58+67", 125) == "  125\nanswer: 125"
    assert format_solution("99+99+99+1+5", 303) == ("  198+99+1+5\n"
                                                    "     297+1+5\n"
                                                    "       298+5\n"
                                                    "         303\n"
                                                    "answer: 303")


def test_random_problems_have_their_value_as_answer():
    rng = random.Random(0)
    for _ in range(300):
        question, answer = make_problem(rng)
        operands = [int(x) for x in question.split("+")]
        assert default_task.MIN_OPERANDS <= len(operands) <= default_task.MAX_OPERANDS
        assert all(default_task.MIN_OPERAND <= x <= default_task.MAX_OPERAND for x in operands)
        assert answer == sum(operands)
        solution = format_solution(question, answer)
        lines = solution.split("\n")
        assert len(lines) == len(operands)  # n - 1 steps, then the answer
        assert all(len(line) == len(question) for line in lines[:-1])  # right-aligned to the question
        assert [int(x) for x in lines[0].split("+")] == [operands[0] + operands[1]] + operands[2:]
        assert question.endswith(lines[0].strip()[len(str(operands[0] + operands[1])):])  # the rest copied in place
        assert lines[-2].strip() == str(answer) and extract_answer(solution) == answer


def test_completion_lengths_are_long_tailed():
    rng = random.Random(1)
    lengths = sorted(len(format_solution(*make_problem(rng))) + 1 for _ in range(4000))  # + 1: the EOS token
    median = statistics.median(lengths)
    assert 15 <= median <= 35
    assert lengths[int(0.9 * len(lengths))] >= 2.5 * median
    assert lengths[-1] >= 8 * median and lengths[-1] <= 320


def test_reward_checks_the_first_answer():
    prompt = format_prompt("7+35+12+9")
    assert reward(prompt, "  42+12+9\n     54+9\n       63\nanswer: 63") == 1.0
    assert reward(prompt, "answer: 63") == 1.0  # the answer is what counts
    assert reward(prompt, "answer: 62") == 0.0
    assert reward(prompt, "answer: 62\nanswer: 63") == 0.0  # no hedging
    assert reward(prompt, "  42+12+9\n     54+9\n       63") == 0.0  # no answer line
    assert reward(format_prompt("58+67"), "  125\nanswer: 125") == 1.0


def test_default_prompts_are_deterministic_per_seed():
    assert default_prompts(5, seed=3) == default_prompts(5, seed=3)
    assert default_prompts(5, seed=3) != default_prompts(5, seed=4)
    assert default_prompts(0) == []
    assert all(p.startswith("Q: ") and p.endswith("\nA:\n") for p in default_prompts(50))


@pytest.mark.parametrize("call, message", [
    (lambda: reward("hello", "answer: 1"), "holds no question"),
    (lambda: reward("Q: 12\nA:\n", "answer: 12"), "holds no question"),
    (lambda: format_solution("7+35+12+9", 62), "answer=62 is wrong"),
    (lambda: format_solution("58*67", 0), "is not"),
    (lambda: format_solution("58", 58), "is not"),
    (lambda: default_prompts(-1), "n=-1"),
])
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()
