"""Checks of user-given settings, shared by the config classes: each raises a ValueError that names the field, the
value and what to pass instead. Bools are refused where a number is expected (True is an int to Python, never a
count to a user)."""

import math
import numbers


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int, maximum: int | None = None, hint: str = "") -> None:
    """An int (not a bool) in [minimum, maximum]; hint: what the bounds mean, appended to the message."""
    if not is_int(value) or value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name}={value!r}: must be an integer {bounds}{hint}")


def check_optional_int(name: str, value, minimum: int, hint: str = "") -> None:
    if value is not None:
        check_int(name, value, minimum, hint=f" or None{hint}")


def check_number(name: str, value, expected: str, is_within=lambda value: True) -> None:
    """A finite real number (not a bool) for which is_within holds; `expected` states that range."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) \
            or not is_within(value):
        raise ValueError(f"{name}={value!r}: must be a finite number {expected}")


def check_bool(name: str, value) -> None:
    """True or False: a string like "false" or an int like 1 would read as true."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: must be true or false (a bool; a string or a number is ambiguous)")


def check_token_ids(name: str, token_ids, vocab_size: int | None = None) -> None:
    """Each id an int (not a bool) in [0, vocab_size); the message names the offending position. The common case
    is checked with C-level builtins (a call's prompts run to millions of ids), the loop only finds the culprit."""
    if set(map(type, token_ids)) <= {int} and (not token_ids or (
            min(token_ids) >= 0 and (vocab_size is None or max(token_ids) < vocab_size))):
        return
    for i, token in enumerate(token_ids):
        if not is_int(token) or token < 0 or (vocab_size is not None and token >= vocab_size):
            limit = "" if vocab_size is None else f" below the vocabulary size {vocab_size}"
            raise ValueError(f"{name}[{i}]={token!r}: a token id must be an integer (not a bool) >= 0{limit}; use "
                             "ids of the target's tokenizer")
