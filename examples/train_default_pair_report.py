"""What examples/train_default_pair.py reports on the trained pair: the target's accuracy, entropy and completion
lengths, the draft's agreement with the target and greedy acceptance per draft position, the steps of one rollout
batch without speculation, and both models' decode-step times on the CPU (terms: train_default_pair.py's
docstring)."""

import random
import statistics
import time

import torch
import torch.nn.functional as F
from train_default_pair_data import (SPECIAL_TOKENS, completion_mask, encode, eval_prompts, generate, length_batches,
                                     pack)
from transformers import DynamicCache

from rollout import default_task

NUM_DRAFT_TOKENS = 4


def rewards(tokenizer, prompts: list[str], completions: list[list[int]]) -> list[float]:
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    return [default_task.reward(p, c) for p, c in zip(prompts, texts)]


def length_stats(lengths: list[int], num_truncated: int | None = None) -> dict:
    """Median, mean, 75th/90th percentile and max of ``lengths`` (tokens), and the tail ratios."""
    ordered = sorted(lengths)
    median = statistics.median(ordered)
    p75, p90 = (ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.75, 0.9))
    stats = {"count": len(ordered), "median": median, "mean": statistics.fmean(ordered), "p75": p75, "p90": p90,
             "max": ordered[-1], "p90_over_median": p90 / median, "max_over_median": ordered[-1] / median}
    if num_truncated is not None:
        stats["num_truncated"] = num_truncated
    return stats


def completion_stats(tokenizer, completions: list[list[int]]) -> dict:
    """``length_stats`` of ``completions``, counting those that stopped without <eos> as truncated."""
    truncated = sum(not c or c[-1] != tokenizer.eos_token_id for c in completions)
    return length_stats(list(map(len, completions)), truncated)


def rollout_steps(lengths: list[int]) -> dict:
    """Engine steps of one batch of ``lengths`` without speculation, and how many run below a quarter of it."""
    num_steps = max(lengths)
    running = [sum(n > t for n in lengths) for t in range(num_steps)]  # rows still decoding at step t
    below = sum(r < len(lengths) / 4 for r in running)
    return {"num_rows": len(lengths), "num_steps": num_steps, "steps_below_quarter": below,
            "fraction_of_steps_below_quarter": below / num_steps,
            "mean_running_rows": statistics.fmean(running)}


def accuracy_by_num_operands(prompts: list[str], scores: list[float]) -> dict[str, dict]:
    """Accuracy and count per number of operands of the question (``"2"``, ``"3"``, ...)."""
    groups: dict[int, list[float]] = {}
    for prompt, score in zip(prompts, scores):
        groups.setdefault(prompt.split("\n")[0].count("+") + 1, []).append(score)
    return {str(n): {"count": len(s), "accuracy": statistics.fmean(s)} for n, s in sorted(groups.items())}


def length_chunks(rows: list[tuple[list, list]], pad_id: int, batch_tokens: int = 16384):
    """Packed batches of ``rows`` of similar length, for teacher-forced measurements."""
    return [pack(batch, pad_id) for batch in length_batches(rows, batch_tokens, random.Random(0))]


@torch.inference_mode()
def teacher_forced(model, batch) -> torch.Tensor:
    """[B, T-1, V] float logits of ``model`` on a packed batch, on the CPU."""
    inputs = {k: batch[k].to(model.device) for k in ("input_ids", "attention_mask")}
    return model(**inputs).logits[:, :-1].float().cpu()


def mean_entropy(model, batches) -> float:
    total, count = 0.0, 0
    for batch in batches:
        log_p = F.log_softmax(teacher_forced(model, batch), dim=-1)
        entropy = -(log_p.exp() * log_p).sum(-1)[completion_mask(batch)]  # nats per completion position
        total, count = total + entropy.sum().item(), count + entropy.numel()
    return total / count


def agreement_stats(target, draft, batches) -> dict:
    """Draft/target argmax agreement and greedy acceptance per draft position on the batches' completions.

    On the target's greedy completion, a greedy draft window starting at t accepts its first k tokens
    iff the teacher-forced argmaxes agree at t..t+k-1: once the first draft token is accepted, the
    draft's next prefix is the completion's own prefix.
    """
    accepted = [0] * NUM_DRAFT_TOKENS
    num_windows = num_agree = num_positions = 0
    for batch in batches:
        match = teacher_forced(target, batch).argmax(-1) == teacher_forced(draft, batch).argmax(-1)  # [B, T-1]
        mask = completion_mask(batch)
        num_agree += match[mask].sum().item()
        num_positions += mask.sum().item()
        for row_match, row_mask in zip(match.tolist(), mask.tolist()):
            positions = [m for m, keep in zip(row_match, row_mask) if keep]
            for t in range(len(positions) - NUM_DRAFT_TOKENS + 1):
                num_windows += 1
                for k in range(NUM_DRAFT_TOKENS):
                    if not positions[t + k]:
                        break
                    accepted[k] += 1
    per_position = [a / max(1, num_windows) for a in accepted]
    return {"agreement": num_agree / num_positions, "acceptance_per_position": per_position,
            "mean_accepted_draft_tokens": sum(per_position)}


@torch.inference_mode()
def decode_step_ms(model, batch_size: int, prompt_len: int = 16, num_steps: int = 40, num_warmup: int = 5) -> float:
    """Median wall time of one single-token forward with a KV cache (HF ``model(...)`` call), in ms."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(len(SPECIAL_TOKENS), model.config.vocab_size, (batch_size, prompt_len), generator=g)
    cache = DynamicCache(config=model.config)
    next_ids = model(input_ids=input_ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    times = []
    for _ in range(num_warmup + num_steps):
        start = time.perf_counter()
        logits = model(input_ids=next_ids, past_key_values=cache, use_cache=True).logits
        times.append(time.perf_counter() - start)
        next_ids = logits[:, -1:].argmax(-1)
    return 1000 * statistics.median(times[num_warmup:])


def evaluate(args, tokenizer, target, draft) -> dict:
    start = time.perf_counter()
    prompts, prompt_ids = eval_prompts(tokenizer, args.num_eval_prompts, args.eval_seed)
    greedy = generate(target, tokenizer, prompt_ids, args, temperature=0.0, seed=args.seed)
    sampled = generate(target, tokenizer, prompt_ids, args, temperature=1.0, seed=args.seed)
    pad_id = tokenizer.pad_token_id
    greedy_batches = length_chunks(list(zip(prompt_ids, greedy)), pad_id)
    sampled_batches = length_chunks(list(zip(prompt_ids, sampled)), pad_id)
    on_greedy = agreement_stats(target, draft, greedy_batches)
    greedy_scores, sampled_scores = rewards(tokenizer, prompts, greedy), rewards(tokenizer, prompts, sampled)
    problem_rng = random.Random(args.eval_seed)  # the problems of default_prompts(num_eval_prompts, eval_seed)
    problems = [default_task.make_problem(problem_rng) for _ in range(args.num_eval_prompts)]
    reference = [len(ids) + 1 for ids in encode(tokenizer, [default_task.format_solution(q, a) for q, a in problems])]
    report = {
        "num_eval_prompts": len(prompts),
        "target/greedy_accuracy": statistics.fmean(greedy_scores),
        "target/temperature_1_accuracy": statistics.fmean(sampled_scores),
        "target/temperature_1_accuracy_by_num_operands": accuracy_by_num_operands(prompts, sampled_scores),
        "target/temperature_1_mean_entropy_nats": mean_entropy(target, sampled_batches),
        "target/greedy_mean_completion_tokens": statistics.fmean(map(len, greedy)),
        "target/temperature_1_completion_tokens": completion_stats(tokenizer, sampled),
        "target/greedy_completion_tokens": completion_stats(tokenizer, greedy),
        "reference_completion_tokens": length_stats(reference),
        "draft/greedy_agreement_on_target_greedy": on_greedy["agreement"],
        "draft/greedy_agreement_on_target_temperature_1": agreement_stats(target, draft, sampled_batches)["agreement"],
        "draft/acceptance_per_position_greedy_k4": on_greedy["acceptance_per_position"],
        "draft/mean_accepted_draft_tokens_greedy_k4": on_greedy["mean_accepted_draft_tokens"],
        "example_target_greedy_completion": prompts[0] + tokenizer.decode(greedy[0], skip_special_tokens=True),
    }
    rollout_texts = default_task.default_prompts(args.rollout_prompts, seed=0)
    rollout_ids = [[tokenizer.bos_token_id] + ids for ids in encode(tokenizer, rollout_texts)]
    rows = [i for i in range(len(rollout_ids)) for _ in range(args.rollout_generations)]
    rollout = generate(target, tokenizer, [rollout_ids[i] for i in rows], args, temperature=1.0, seed=args.seed + 2)
    report["rollout/temperature_1_accuracy"] = statistics.fmean(rewards(tokenizer, [rollout_texts[i] for i in rows],
                                                                        rollout))
    report["rollout/completion_tokens"] = completion_stats(tokenizer, rollout)
    report["rollout/steps"] = rollout_steps(list(map(len, rollout)))
    report["eval_seconds"] = time.perf_counter() - start
    return report


def timing(target, draft) -> dict:
    """Decode-step times of both models on this machine's CPU (where the engine's default pair runs)."""
    target, draft = target.cpu(), draft.cpu()
    report = {"timing/num_threads": torch.get_num_threads()}
    for batch_size in (1, 32):
        target_ms, draft_ms = decode_step_ms(target, batch_size), decode_step_ms(draft, batch_size)
        report[f"timing/target_decode_step_ms_bs{batch_size}"] = target_ms
        report[f"timing/draft_decode_step_ms_bs{batch_size}"] = draft_ms
        report[f"timing/draft_over_target_bs{batch_size}"] = draft_ms / target_ms
    return report
