"""The default task: rewrite the remaining sum, a long-tailed arithmetic task with a checkable answer.

A problem is a sum of ``n`` one-digit operands (1 to 9). The worked solution adds the first two operands and
rewrites the rest, one line (a *step*) per addition, until one number remains, then states the answer; each step is
right-aligned to the question's width, so an operand still to add sits in the same columns as in the question::

    Q: 7+5+2+9          <- prompt (``format_prompt``)
    A:
     12+2+9             <- completion (``format_solution``): 7 + 5 = 12, the rest copied
       14+9
         23
    answer: 23

A sum never has more characters than the two operands and the ``+`` it replaces, so ``n`` operands give ``n - 1``
steps of ``2 n`` characters, about ``2 n**2`` tokens under the default character-level tokenizer. ``n`` is drawn
with ``P(n) ~ NUM_OPERANDS_DECAY ** (n - 2)`` on ``MIN_OPERANDS..MAX_OPERANDS``: most completions are short and a
few long, the long tail of lengths that an RL rollout waits on. The model decides when to stop. ``reward`` scores a
completion against the question parsed back from its prompt; ``examples/train_default_pair.py`` trains the default
model pair (``rollout/default_models/``) on this task.
"""

import random
import re

MIN_OPERANDS = 2
MAX_OPERANDS = 12
NUM_OPERANDS_DECAY = 0.65
MIN_OPERAND = 1
MAX_OPERAND = 9
_SUM = r"\d+(?:\+\d+)+"
_PROMPT_RE = re.compile(rf"Q:[ \t]*({_SUM})")
_QUESTION_RE = re.compile(_SUM)
_ANSWER_RE = re.compile(r"answer:\s*(-?\d+)")
_NUM_OPERANDS = list(range(MIN_OPERANDS, MAX_OPERANDS + 1))
_NUM_OPERANDS_WEIGHTS = [NUM_OPERANDS_DECAY ** (n - MIN_OPERANDS) for n in _NUM_OPERANDS]


def make_problem(rng: random.Random) -> tuple[str, int]:
    """Draw one problem from ``rng``; return ``(question, answer)``, e.g. ``("7+5+2+9", 23)``."""
    num_operands = rng.choices(_NUM_OPERANDS, weights=_NUM_OPERANDS_WEIGHTS)[0]
    operands = [rng.randint(MIN_OPERAND, MAX_OPERAND) for _ in range(num_operands)]
    return "+".join(map(str, operands)), sum(operands)


def format_prompt(question: str) -> str:
    """The text the model is conditioned on for ``question`` (the chat template renders the same)."""
    return f"Q: {question}\nA:\n"


def format_solution(question: str, answer: int) -> str:
    """The worked completion for ``question``: one right-aligned line per step, then ``answer: <answer>``."""
    operands = _parse_question(question)
    width = len("+".join(map(str, operands)))
    if sum(operands) != answer:
        raise ValueError(f"answer={answer} is wrong for question={question!r}; pass the value of the question")
    lines = []
    while len(operands) > 1:
        operands = [operands[0] + operands[1]] + operands[2:]
        lines.append("+".join(map(str, operands)).rjust(width))
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
    return 1.0 if extract_answer(completion) == sum(map(int, match.group(1).split("+"))) else 0.0


def _parse_question(question: str) -> list[int]:
    if _QUESTION_RE.fullmatch(question.strip()) is None:
        raise ValueError(f"question={question!r} is not a sum of two or more integers like '7+35+12'; "
                         "use make_problem()")
    return [int(x) for x in question.strip().split("+")]
