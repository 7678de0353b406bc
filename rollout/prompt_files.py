"""Prompts and the output path of `python -m rollout generate`, checked before any model loads.

`--prompts FILE`, by its extension: `.jsonl` / `.json` hold one JSON value per line, either a prompt (a string, a
list of chat messages `{"role": ..., "content": ...}`, or a list of token ids) or an object with a "prompt" key
holding one; any other extension is plain text, one prompt per line (use JSONL for prompts with newlines). Blank
lines are skipped. `--dataset PATH` is a `datasets` dataset saved with `save_to_disk`, with a "prompt" column.
"""

import json
import os

JSONL_SUFFIXES = (".jsonl", ".json")
_EXPECTED = ('a JSON string, a list of chat messages ({"role": ..., "content": ...}), a list of token ids, or an '
             'object with a "prompt" key holding one of those')


def read_prompts(path: str) -> list:
    """The prompts of a --prompts file; ValueError naming the file, the line and what was expected."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--prompts {path}: cannot read it ({e}); pass a UTF-8 text or JSONL file") from e
    is_jsonl = path.lower().endswith(JSONL_SUFFIXES)
    prompts = [_parse_line(line, path, number) if is_jsonl else line
               for number, line in enumerate(lines, start=1) if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts {path}: the file holds no prompts; write one prompt per line")
    return prompts


def _parse_line(line: str, path: str, number: int):
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"--prompts {path}, line {number}: not valid JSON ({e.msg}); expected {_EXPECTED} "
                         "(a plain-text file of one prompt per line must not end in .jsonl or .json)") from e
    prompt = value.get("prompt") if isinstance(value, dict) else value
    if not _is_prompt(prompt):
        raise ValueError(f"--prompts {path}, line {number}: expected {_EXPECTED}; got {_short(line)}")
    return prompt


def _is_prompt(value) -> bool:
    if isinstance(value, str):
        return bool(value)
    if not isinstance(value, list) or not value:
        return False
    is_chat = all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in value)
    return is_chat or all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def load_dataset_prompts(path: str) -> list:
    """The "prompt" column of a dataset saved with `Dataset.save_to_disk`; ValueError saying what is wrong."""
    import datasets

    try:
        dataset = datasets.load_from_disk(path)
    except FileNotFoundError as e:
        raise ValueError(f"--dataset {path}: no dataset saved there ({e}); pass a folder written by "
                         "Dataset.save_to_disk") from e
    if isinstance(dataset, datasets.DatasetDict):
        raise ValueError(f"--dataset {path}: a DatasetDict with splits {list(dataset)}; pass one split's folder, "
                         f"e.g. {os.path.join(path, next(iter(dataset), 'train'))}")
    if "prompt" not in dataset.column_names:
        raise ValueError(f"--dataset {path}: columns {dataset.column_names}; it needs a 'prompt' column")
    return list(dataset["prompt"])


def check_output(path: str) -> None:
    """--output: '-' (stdout), or a file path whose folder exists and can be written."""
    if path == "-":
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--output {path}: the folder {folder} does not exist; create it, or pass another path "
                         "(or - for stdout)")
    if os.path.isdir(path):
        raise ValueError(f"--output {path} is a folder; pass a file path, e.g. {os.path.join(path, 'rollouts.jsonl')}")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"--output {path}: not writable here; pass a path in a folder you can write (or - for "
                         "stdout)")


def _short(text: str) -> str:
    return text if len(text) < 80 else text[:77] + "..."
