"""A TRL reward for code completions checked by tests (HumanEval's form: `test` defines `check(candidate)`)."""

import ast
import re
from concurrent.futures import ThreadPoolExecutor

from trainers.python_sandbox import run_python

NO_CODE, PARSES, PASSES = 0.0, 0.1, 1.0
MAX_WORKERS = 4  # sandboxed subprocesses at once
_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.DOTALL)  # the first fenced block; unclosed when truncated


def code_reward(prompts, completions, test, entry_point, code_prompt=None, **kwargs) -> list[float]:
    """Per completion: PASSES (1.0) when its code passes the tests, PARSES (0.1) when the code parses but fails
    them (an error, a wrong answer, a timeout or a limit), NO_CODE (0.0) when there is no code or it does not parse.

    TRL's reward-function form: `completions` are strings or chat messages (the contents of a message list are
    joined); `test`, `entry_point` and `code_prompt` are the dataset's columns, one per completion. The code is the
    completion's first fenced block (```python ... ```), else its whole text. The program run is the problem's
    `code_prompt` (its imports and helpers; a completion may also continue the function's body), the code, `test`
    and `check(<entry_point>)`, in a sandboxed subprocess (trainers/python_sandbox.py), MAX_WORKERS at a time.
    """
    heads = code_prompt if code_prompt is not None else [""] * len(completions)
    programs = [_program(head, _code(c)) for head, c in zip(heads, completions)]
    runs = [f"{p}\n\n{t}\n\ncheck({e})\n" for p, t, e in zip(programs, test, entry_point) if p is not None]
    with ThreadPoolExecutor(MAX_WORKERS) as pool:
        passed = iter(pool.map(run_python, runs))
    return [NO_CODE if p is None else PASSES if next(passed) else PARSES for p in programs]


def _code(completion) -> str:
    text = completion if isinstance(completion, str) else "".join(m.get("content") or "" for m in completion)
    fenced = _FENCE.search(text)
    return fenced.group(1) if fenced else text


def _program(head: str, code: str) -> str | None:
    """`head` followed by `code`, None when the code is blank or the two do not parse."""
    if not code.strip():
        return None
    program = f"{head}\n{code}"
    try:
        ast.parse(program)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: null bytes
        return None
    return program
