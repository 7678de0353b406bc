"""The default task: column arithmetic with a worked solution and a checkable answer.

A problem is ``a + b`` or ``a - b`` with 2- or 3-digit operands (``a >= b`` for subtraction, so every
answer is a non-negative integer). The worked solution goes column by column from the units, one line
per column, with the carry or borrow written out, then states the answer::

    Q: 731-58           <- prompt (``format_prompt``)
    A:
    11-8-0=3            <- completion (``format_solution``): 1 - 8 borrows, so the line shows 11
    13-5-1=7
    7-0-1=6
    answer: 673

An addition line is ``x+y+carry=s``; the next column's carry is the tens digit of ``s``. A
subtraction line is ``x-y-borrow=d``, with ``x`` shown plus 10 when the column borrows. Completions
are 25 to 40 characters, i.e. tokens under the default character-level tokenizer.

The default model pair (``rollout/default_models/``) was trained on this task by
``examples/train_default_pair.py``; ``reward`` scores a completion against the question parsed
back from its prompt.
"""

import random
import re

MIN_DIGITS = 2
MAX_DIGITS = 3
_PROMPT_RE = re.compile(r"Q:\s*(\d+)\s*([+-])\s*(\d+)")
_ANSWER_RE = re.compile(r"answer:\s*(-?\d+)")


def make_problem(rng: random.Random) -> tuple[str, int]:
    """Draw one problem from ``rng``; return ``(question, answer)``, e.g. ``("731-58", 673)``."""
    a, b = (_random_operand(rng) for _ in range(2))
    op = rng.choice("+-")
    if op == "-" and a < b:
        a, b = b, a
    return f"{a}{op}{b}", _evaluate(a, op, b)


def format_prompt(question: str) -> str:
    """The text the model is conditioned on for ``question`` (the chat template renders the same)."""
    return f"Q: {question}\nA:\n"


def format_solution(question: str, answer: int) -> str:
    """The worked completion for ``question``: one line per column, then ``answer: <answer>``."""
    a, op, b = _parse_question(question)
    if _evaluate(a, op, b) != answer:
        raise ValueError(f"answer={answer} is wrong for question={question!r}; pass the value of the question")
    lines = _addition_lines(a, b) if op == "+" else _subtraction_lines(a, b)
    return "\n".join(lines + [f"answer: {answer}"])


def default_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` prompts drawn with ``random.Random(seed)``; the same ``(n, seed)`` gives the same list."""
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    rng = random.Random(seed)
    return [format_prompt(make_problem(rng)[0]) for _ in range(n)]


def extract_answer(completion: str) -> int | None:
    """The integer after the first ``answer:`` in ``completion``, or None when there is none."""
    match = _ANSWER_RE.search(completion)
    return int(match.group(1)) if match else None


def reward(prompt: str, completion: str) -> float:
    """1.0 when the completion's answer equals the value of the question in ``prompt``, else 0.0.

    Only the first ``answer:`` counts, so a completion cannot hedge with several answers. Raises
    ``ValueError`` when ``prompt`` holds no question of this task.
    """
    match = _PROMPT_RE.search(prompt)
    if match is None:
        raise ValueError(f"prompt={prompt!r} holds no question; build prompts with format_prompt()")
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return 1.0 if extract_answer(completion) == _evaluate(a, op, b) else 0.0


def _random_operand(rng: random.Random) -> int:
    num_digits = rng.randint(MIN_DIGITS, MAX_DIGITS)
    return rng.randint(10 ** (num_digits - 1), 10**num_digits - 1)


def _evaluate(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def _parse_question(question: str) -> tuple[int, str, int]:
    match = _PROMPT_RE.fullmatch("Q: " + question.strip())
    if match is None:
        raise ValueError(f"question={question!r} is not '<int>+<int>' or '<int>-<int>'; use make_problem()")
    return int(match.group(1)), match.group(2), int(match.group(3))


def _columns(a: int, b: int) -> list[tuple[int, int]]:
    """Digit pairs of ``a`` and ``b``, units first, the shorter operand padded with zeros."""
    num_columns = max(len(str(a)), len(str(b)))
    return [(a // 10**i % 10, b // 10**i % 10) for i in range(num_columns)]


def _addition_lines(a: int, b: int) -> list[str]:
    lines, carry = [], 0
    for x, y in _columns(a, b):
        total = x + y + carry
        lines.append(f"{x}+{y}+{carry}={total}")
        carry = total // 10
    return lines


def _subtraction_lines(a: int, b: int) -> list[str]:
    lines, borrow = [], 0
    for x, y in _columns(a, b):
        next_borrow = int(x - y - borrow < 0)
        top = x + 10 * next_borrow
        lines.append(f"{top}-{y}-{borrow}={top - y - borrow}")
        borrow = next_borrow
    return lines
