"""The data of examples/train_default_pair.py: the character-level tokenizer, training rows of the default task
packed into length-sorted batches under a padded-token budget, evaluation prompts, and completions sampled from a
model (the draft's distillation data and the evaluation's rollouts)."""

import random

import torch
from tokenizers import Tokenizer, decoders, models, processors
from transformers import PreTrainedTokenizerFast

from rollout import default_task

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
TASK_CHARS = "0123456789+-=: \nQAanswer"
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{ 'Q: ' + message['content'] + '\n' }}"
    "{%- elif message['role'] == 'assistant' %}{{ 'A:\n' + message['content'] + eos_token }}"
    "{%- else %}{{ raise_exception('only user and assistant messages are supported') }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ 'A:\n' }}{%- endif %}"
)


def build_tokenizer(model_max_length: int) -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one token per task character, plus the special tokens."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in TASK_CHARS:
        vocab.setdefault(ch, len(vocab))
    # BPE without merges and without a pre-tokenizer splits text into single characters.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.add_special_tokens(SPECIAL_TOKENS)
    core.decoder = decoders.Fuse()
    bos_id = vocab["<bos>"]
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        chat_template=CHAT_TEMPLATE, padding_side="left", model_max_length=model_max_length,
    )


def encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def pack(rows: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad ``(prompt_ids, completion_ids)`` rows; ``labels`` are -100 outside completions."""
    max_len = max(len(p) + len(c) for p, c in rows)
    input_ids = torch.full((len(rows), max_len), pad_id)
    labels = torch.full((len(rows), max_len), -100)
    attention_mask = torch.zeros((len(rows), max_len), dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        n = len(p) + len(c)
        input_ids[i, :n] = torch.tensor(p + c)
        labels[i, len(p) : n] = torch.tensor(c)
        attention_mask[i, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def completion_mask(batch) -> torch.Tensor:
    """[B, T-1] True where the logit at t predicts a completion token at t+1."""
    return batch["labels"][:, 1:] != -100


def length_batches(rows: list[tuple[list, list]], batch_tokens: int, rng: random.Random) -> list[list[tuple]]:
    """Cut ``rows`` sorted by length into batches of at most ``batch_tokens`` padded tokens, in random order.

    A row longer than the budget makes a batch of its own.
    """
    batches, batch = [], []
    for row in sorted(rows, key=lambda r: len(r[0]) + len(r[1])):
        if batch and (len(batch) + 1) * (len(row[0]) + len(row[1])) > batch_tokens:
            batches.append(batch)
            batch = []
        batch.append(row)
    batches.append(batch)
    rng.shuffle(batches)
    return batches


def batch_stream(rng: random.Random, make_rows, pool_size: int, batch_tokens: int, pad_id: int):
    """``batch_fn(step)`` for ``train_loop``: packed length batches of pools of ``make_rows(pool_size)``."""
    queue: list[list[tuple]] = []

    def batch_fn(step: int) -> dict[str, torch.Tensor]:
        if not queue:
            queue.extend(length_batches(make_rows(pool_size), batch_tokens, rng))
        return pack(queue.pop(), pad_id)

    return batch_fn


def reference_rows(rng: random.Random, tokenizer, num_rows: int, p_drop_bos: float) -> list[tuple[list, list]]:
    """``num_rows`` fresh problems as ``(prompt_ids, solution_ids + [eos])``."""
    problems = [default_task.make_problem(rng) for _ in range(num_rows)]
    prompts = encode(tokenizer, [default_task.format_prompt(q) for q, _ in problems])
    solutions = encode(tokenizer, [default_task.format_solution(q, a) for q, a in problems])
    bos = [tokenizer.bos_token_id]
    return [
        ((bos if rng.random() >= p_drop_bos else []) + p, s + [tokenizer.eos_token_id])
        for p, s in zip(prompts, solutions)
    ]


def eval_prompts(tokenizer, num_prompts: int, seed: int) -> tuple[list[str], list[list[int]]]:
    """``default_task.default_prompts(num_prompts, seed)`` and their token ids, <bos> first."""
    texts = default_task.default_prompts(num_prompts, seed=seed)
    return texts, [[tokenizer.bos_token_id] + ids for ids in encode(tokenizer, texts)]


@torch.inference_mode()
def generate(model, tokenizer, prompt_ids: list[list[int]], args, temperature: float, seed: int, chunk: int = 128):
    """Completions (token ids, through the first <eos> inclusive) of ``model`` for each prompt.

    Prompts run in chunks of similar length (a longer prompt has more operands, so a longer
    completion): a chunk stops when its longest completion does.
    """
    torch.manual_seed(seed)
    order = sorted(range(len(prompt_ids)), key=lambda i: (len(prompt_ids[i]), i))
    completions = [None] * len(prompt_ids)
    for i in range(0, len(order), chunk):
        indices = order[i : i + chunk]
        rows = [prompt_ids[j] for j in indices]
        max_len = max(map(len, rows))
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (max_len - len(r)) + r for r in rows], device=model.device)
        attention_mask = torch.tensor([[0] * (max_len - len(r)) + [1] * len(r) for r in rows], device=model.device)
        sampling = {"do_sample": False}
        if temperature > 0:
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=args.max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **sampling)
        for j, row in zip(indices, out[:, max_len:].tolist()):
            eos_at = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
            completions[j] = row[:eos_at]
    return completions
