"""Turning user prompts (text, chat messages, token ids, a datasets.Dataset) into token-id lists."""

from spec.checks import check_token_ids


def to_token_ids(prompts, tokenizer, max_model_len: int, vocab_size: int | None = None) -> list[list[int]]:
    """One token-id list per prompt; ValueError naming the prompt for an empty or too-long one, or for a token id
    that is not an int in [0, vocab_size) (a bool, a negative id, one past the model's vocabulary), before any
    model runs."""
    if hasattr(prompts, "column_names"):  # a datasets.Dataset
        if "prompt" not in prompts.column_names:
            raise ValueError(f"prompts: the dataset has columns {prompts.column_names}; it needs a 'prompt' column")
        prompts = list(prompts["prompt"])
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError(f"prompts={_short(prompts)}: expected a non-empty list of prompts (strings, chat "
                         "message lists or token-id lists)")
    token_ids = [_one(p, tokenizer, i) for i, p in enumerate(prompts)]
    for i, ids in enumerate(token_ids):
        if not ids:
            raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
        if len(ids) >= max_model_len:
            raise ValueError(f"prompts[{i}] has {len(ids)} tokens, leaving no room under max_model_len="
                             f"{max_model_len}; shorten the prompt or raise max_model_len")
        check_token_ids(f"prompts[{i}]", ids, vocab_size)
    return token_ids


def _one(prompt, tokenizer, index: int) -> list[int]:
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    is_chat = isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt)
    if not (isinstance(prompt, str) or is_chat):
        raise ValueError(f"prompts[{index}]={_short(prompt)}: expected a string, a list of chat messages "
                         "({'role': ..., 'content': ...}) or a list of token ids")
    if tokenizer is None:
        raise ValueError(f"prompts[{index}] is text but no tokenizer is loaded; pass tokenizer=... or token ids")
    if is_chat:
        text = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def _short(value) -> str:
    text = repr(value)
    return text if len(text) < 80 else text[:77] + "..."
