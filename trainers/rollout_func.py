"""A `RolloutGenerator`'s rollouts as TRL's rollout function (`SpecRolloutCallback.rollout_func`, trainers/callback.py).

The contract (TRL 1.16, `GRPOTrainer._generate`): each process calls `rollout_func(prompts, trainer)` with its
slice of the generation batch. A prompt fills `num_generations` adjacent rows (GRPOTrainer's RepeatSampler); the
global batch is the processes' slices in process order, so a slice whose size is not a multiple of
`num_generations` starts or ends inside a group. The result holds one completion per row, in row order:
`prompt_ids`, `completion_ids` (never empty, at most `max_completion_length` tokens) and `logprobs` (one per
completion token, under the sampling distribution). Every other key reaches the reward functions row by row:
here `acceptance`, each sample's acceptance record.

Each group of rows becomes one prompt with that many samples (shared prefill, sibling drafting). Sampling settings
come from `trainer.args` (the GRPOConfig), so the trainer recomputes logprobs of the distribution sampled from.
The trainer is read through `args`, `model`, `num_generations`, `num_generations_eval`, `processing_class`,
`accelerator.process_index` and `tools`.
"""

import dataclasses
import weakref
from dataclasses import dataclass

from rollout.outputs import RolloutBatch, Sample
from rollout.prompts import to_token_ids
from rollout.sampling_params import SamplingParams, mix_seed

ACCEPTANCE_KEY = "acceptance"
_verified_tokenizers = weakref.WeakKeyDictionary()  # trainer tokenizer -> generator tokenizer it matched


@dataclass
class TrainerRollout:
    """One rollout for a trainer, checked and laid out: token ids per row, the prompt groups of the slice as
    (first row, size), the GRPOConfig's sampling settings, and this process's index."""

    rows: list[list[int]]
    spans: list[tuple[int, int]]
    params: SamplingParams
    process_index: int


def plan_rollout(generator, prompts: list, trainer) -> TrainerRollout:
    """Check the trainer's call against what the generator can honour and lay its rows out in prompt groups; nothing
    is generated (weight sync comes between this and `run_rollout`)."""
    if getattr(trainer, "tools", None):
        raise NotImplementedError("GRPOTrainer tools are not supported with a RolloutGenerator's rollout function: "
                                  "TRL runs the tool-call turns with its own generation backend; drop tools=...")
    tokenizer = check_same_tokenizer(generator.tokenizer, _trainer_tokenizer(trainer))
    rows = _prompt_ids(prompts, tokenizer, trainer.args, generator.max_model_len)
    num_generations, process_index = _num_generations(trainer), _process_index(trainer)
    spans = group_spans(len(rows), num_generations, offset=process_index * len(rows) % num_generations)
    check_groups(rows, spans, num_generations)
    return TrainerRollout(rows, spans, sampling_params(trainer.args, generator.max_model_len), process_index)


def run_rollout(generator, rollout: TrainerRollout) -> RolloutBatch:
    """One `generate` call per distinct group size (a single call unless the slice cuts groups); the samples in row
    order, `prompt_index` numbering the groups of the slice."""
    rows, spans = rollout.rows, rollout.spans
    by_size: dict[int, list[int]] = {}  # group size -> indices of the groups of that size
    for g, (_, size) in enumerate(spans):
        by_size.setdefault(size, []).append(g)
    if len(by_size) == 1:
        return generator.generate([rows[start] for start, _ in spans], spans[0][1], _seeded(rollout, generator),
                                  use_tqdm=False)
    samples: list[Sample | None] = [None] * len(rows)
    elapsed = 0.0
    for size, groups in by_size.items():
        batch = generator.generate([rows[spans[g][0]] for g in groups], size, _seeded(rollout, generator),
                                   use_tqdm=False)
        elapsed += batch.stats["elapsed_s"]
        for s in batch.samples:
            group = groups[s.prompt_index]
            samples[spans[group][0] + s.sample_index] = dataclasses.replace(s, prompt_index=group)
    return RolloutBatch(samples, stats={"elapsed_s": elapsed, "num_generate_calls": len(by_size)})


def sampling_params(args, max_model_len: int) -> SamplingParams:
    """The GRPOConfig's sampling settings; ValueError for the ones the engine cannot honour."""
    if getattr(args, "min_p", None) is not None:
        raise ValueError(f"min_p={args.min_p!r}: the speculative engine samples with temperature, top_p and top_k "
                         "only; set min_p=None in the GRPOConfig")
    if getattr(args, "repetition_penalty", 1.0) != 1.0:
        raise ValueError(f"repetition_penalty={args.repetition_penalty!r}: the speculative engine has no repetition "
                         "penalty (the trainer's logprobs would not match it anyway); set repetition_penalty=1.0")
    if getattr(args, "generation_kwargs", None):
        raise ValueError(f"generation_kwargs={args.generation_kwargs!r}: the speculative engine takes temperature, "
                         "top_p, top_k and max_completion_length from the GRPOConfig only; set "
                         "generation_kwargs=None")
    top_k = getattr(args, "top_k", 0)
    max_tokens = getattr(args, "max_completion_length", None)
    return SamplingParams(temperature=args.temperature, top_p=getattr(args, "top_p", 1.0),
                          top_k=-1 if top_k in (None, 0) else top_k,  # TRL: 0 (or None) turns top-k off
                          max_tokens=max_model_len if max_tokens is None else max_tokens)


def check_same_tokenizer(generator_tokenizer, trainer_tokenizer):
    """The tokenizer to use; ValueError when the trainer's and the generator's differ (the trainer decodes and pads
    the generator's token ids with its own)."""
    if generator_tokenizer is None or trainer_tokenizer is None:
        return generator_tokenizer or trainer_tokenizer
    if trainer_tokenizer is generator_tokenizer or _verified_tokenizers.get(trainer_tokenizer) is generator_tokenizer:
        return generator_tokenizer
    if (trainer_tokenizer.get_vocab() != generator_tokenizer.get_vocab()
            or trainer_tokenizer.eos_token_id != generator_tokenizer.eos_token_id):
        raise ValueError(f"processing_class: the trainer's tokenizer ({trainer_tokenizer.name_or_path!r}) differs "
                         f"from the generator's ({generator_tokenizer.name_or_path!r}) in its vocabulary or EOS "
                         "token; pass processing_class=generator.tokenizer to the trainer, or build the "
                         "RolloutGenerator with tokenizer=<the trainer's tokenizer>")
    _verified_tokenizers[trainer_tokenizer] = generator_tokenizer
    return generator_tokenizer


def group_spans(num_rows: int, num_generations: int, offset: int = 0) -> list[tuple[int, int]]:
    """(start, size) of each prompt group in a slice of `num_rows` rows whose first row is `offset` rows into a
    group (0 <= offset < num_generations); only the first and the last group can be partial."""
    spans, start, size = [], 0, num_generations - offset
    while start < num_rows:
        size = min(size, num_rows - start)
        spans.append((start, size))
        start, size = start + size, num_generations
    return spans


def check_groups(rows: list[list[int]], spans: list[tuple[int, int]], num_generations: int) -> None:
    for start, size in spans:
        group = rows[start:start + size]
        num_distinct = len({tuple(r) for r in group})
        if num_distinct > 1:
            raise ValueError(f"num_generations={num_generations}: rows {start}..{start + size - 1} of this process's "
                             f"{len(rows)} prompts should be one prompt repeated (each prompt fills num_generations "
                             f"adjacent rows, as GRPOTrainer's RepeatSampler lays them out) but hold {num_distinct} "
                             "different prompts; make num_generations match how the prompts are repeated")


def trainer_outputs(batch: RolloutBatch, max_tokens: int) -> dict:
    for s in batch.samples:
        assert 1 <= len(s.completion_ids) <= max_tokens and len(s.logprobs) == len(s.completion_ids)
    return {"prompt_ids": [s.prompt_ids for s in batch.samples],
            "completion_ids": [s.completion_ids for s in batch.samples],
            "logprobs": [s.logprobs for s in batch.samples],
            ACCEPTANCE_KEY: [s.acceptance for s in batch.samples]}


def _seeded(rollout: TrainerRollout, generator) -> SamplingParams:
    """A base seed per generate call and process: processes sharing a prompt group must not draw the same samples."""
    seed = mix_seed(generator.seed, generator.num_calls, rollout.process_index)
    return dataclasses.replace(rollout.params, seed=seed)


def _prompt_ids(prompts: list, tokenizer, args, max_model_len: int) -> list[list[int]]:
    """Token ids per row; chat prompts are rendered as GRPOTrainer renders them (with its chat_template_kwargs)."""
    kwargs = dict(getattr(args, "chat_template_kwargs", None) or {})
    if kwargs and tokenizer is not None:
        prompts = [_render_chat(p, tokenizer, kwargs) if _is_chat(p) else p for p in prompts]
    return to_token_ids(list(prompts), tokenizer, max_model_len)


def _render_chat(messages: list, tokenizer, kwargs: dict) -> list[int]:
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False, **kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _is_chat(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(isinstance(m, dict) for m in prompt)


def _trainer_tokenizer(trainer):
    processing_class = getattr(trainer, "processing_class", None)
    return getattr(processing_class, "tokenizer", processing_class)  # a multimodal processor holds a tokenizer


def _num_generations(trainer) -> int:
    if getattr(trainer.model, "training", True):
        return trainer.num_generations
    return getattr(trainer, "num_generations_eval", None) or trainer.num_generations


def _process_index(trainer) -> int:
    return getattr(getattr(trainer, "accelerator", None), "process_index", 0)
