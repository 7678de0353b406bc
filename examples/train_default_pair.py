"""Train the project's default model pair on ``rollout.default_task`` from nothing.

The target is a small ``LlamaForCausalLM`` trained on prompt + worked-solution sequences (loss on the
completion only), stopped short of perfect so that RL has something to improve. The draft is a much
shallower Llama with the same character-level tokenizer, distilled from the target by forward KL on
the target's own temperature-1 samples mixed with reference solutions. Both are saved in float16 with
their tokenizer to ``rollout/default_models/{target,draft}/``, next to ``training_report.json``; the
evaluation runs on the saved (float16-rounded) weights.

The task's completions are long-tailed (a few tokens to about 300), so training batches are cut from a
pool of rows sorted by length under a budget of padded tokens (short rows make wide batches, long rows
narrow ones), and the batches of a pool are shuffled; sampling runs on prompts sorted by length.

Everything is built from configs and generated data; nothing is downloaded. Seeded, and reproducible on
the same device:

    python examples/train_default_pair.py --device cuda   # the shipped pair: 2.5 minutes on one H200
    python examples/train_default_pair.py                 # on the CPU: about 2.5 hours on one thread
    python examples/train_default_pair.py --help

The shipped pair was trained on an H200 with the defaults (the report's `args`); a CPU run of the same
settings draws the same data but rounds differently, so its weights differ slightly.

Terms in the report: *agreement* is the fraction of completion positions where the draft's argmax
equals the target's argmax (teacher-forced on the target's completions); *acceptance at position k*
is the fraction of 4-token greedy-draft windows (starting at every completion position with 4 tokens
left) whose first k tokens all equal the target's greedy tokens, as greedy speculative decoding
would accept them. *Completion tokens* count the end-of-sequence token; a completion without one
stopped at ``--max-new-tokens`` (*truncated*). The *rollout* figures sample
``default_prompts(--rollout-prompts, seed=0)`` with ``--rollout-generations`` generations each at
temperature 1, as an RL generation phase would: without speculation an engine step advances every
running row by one token, so the number of steps is the longest completion and the batch size at step
t is the number of completions longer than t; *steps_below_quarter* counts the steps that run fewer
than a quarter of the starting rows.
"""

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, processors
from transformers import DynamicCache, GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rollout import default_task  # noqa: E402

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
NUM_DRAFT_TOKENS = 4


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[1] / "rollout" / "default_models"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=1, help="torch CPU threads for training and timing")
    p.add_argument("--device", default="cpu", help="where to train and evaluate (cpu, cuda); timing runs on the CPU")
    p.add_argument("--max-position-embeddings", type=int, default=512)
    p.add_argument("--p-drop-bos", type=float, default=0.1, help="fraction of training rows without <bos>")
    for role, hidden, layers, inter in (("target", 256, 8, 688), ("draft", 256, 2, 688)):
        p.add_argument(f"--{role}-hidden-size", type=int, default=hidden)
        p.add_argument(f"--{role}-num-layers", type=int, default=layers)
        p.add_argument(f"--{role}-intermediate-size", type=int, default=inter)
        p.add_argument(f"--{role}-head-dim", type=int, default=64, help="64 is what vLLM's CPU kernels need")
    p.add_argument("--target-steps", type=int, default=2000)
    p.add_argument("--target-batch-tokens", type=int, default=4096, help="padded tokens per training batch")
    p.add_argument("--target-lr", type=float, default=1.5e-3)
    p.add_argument("--draft-steps", type=int, default=800)
    p.add_argument("--draft-batch-tokens", type=int, default=4096, help="padded tokens per distillation batch")
    p.add_argument("--draft-lr", type=float, default=3e-3)
    p.add_argument("--pool-size", type=int, default=4096, help="rows drawn, sorted by length and cut into batches")
    p.add_argument("--num-distill-samples", type=int, default=2048, help="target temperature-1 samples to distill on")
    p.add_argument("--distill-sample-fraction", type=float, default=0.75, help="draft batch share of target samples")
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine schedule's final lr / peak lr")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-new-tokens", type=int, default=320)
    p.add_argument("--num-eval-prompts", type=int, default=512)
    p.add_argument("--eval-seed", type=int, default=12345, help="seed of the fresh evaluation prompts")
    p.add_argument("--rollout-prompts", type=int, default=64, help="prompts of the rollout measurement (seed 0)")
    p.add_argument("--rollout-generations", type=int, default=8, help="temperature-1 samples per rollout prompt")
    p.add_argument("--log-every", type=int, default=25)
    return p.parse_args(argv)


# ---------------------------------------------------------------- tokenizer


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


# ---------------------------------------------------------------- data


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


# ---------------------------------------------------------------- models


def build_model(args, role: str, tokenizer) -> LlamaForCausalLM:
    hidden, head_dim = getattr(args, f"{role}_hidden_size"), getattr(args, f"{role}_head_dim")
    if hidden % head_dim:
        raise ValueError(f"--{role}-hidden-size={hidden} must be a multiple of --{role}-head-dim={head_dim}")
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=getattr(args, f"{role}_intermediate_size"),
        num_hidden_layers=getattr(args, f"{role}_num_layers"), num_attention_heads=hidden // head_dim,
        num_key_value_heads=hidden // head_dim, head_dim=head_dim,
        max_position_embeddings=args.max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def make_optimizer(model, lr: float, steps: int, args):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))

    def lr_factor(step: int) -> float:  # linear warmup, then cosine down to min_lr_ratio
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, steps - args.warmup_steps)
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def train_loop(name: str, model, loss_fn, batch_fn, steps: int, lr: float, args) -> float:
    """Run ``steps`` AdamW steps of ``loss_fn(model, batch_fn(step))``; return seconds taken."""
    optimizer, scheduler = make_optimizer(model, lr, steps, args)
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        loss = loss_fn(model, {k: v.to(model.device) for k, v in batch_fn(step).items()})
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if step % args.log_every == 0 or step == steps - 1:
            lr_now, elapsed = scheduler.get_last_lr()[0], time.perf_counter() - start
            print(f"[{name}] step {step + 1}/{steps} loss {loss.item():.4f} lr {lr_now:.2e} {elapsed:.0f}s", flush=True)
    model.eval()
    return time.perf_counter() - start


def lm_loss(model, batch) -> torch.Tensor:
    return model(**batch).loss  # mean cross-entropy over the completion tokens (labels are -100 elsewhere)


def completion_mask(batch) -> torch.Tensor:
    """[B, T-1] True where the logit at t predicts a completion token at t+1."""
    return batch["labels"][:, 1:] != -100


def make_distill_loss(target):
    def distill_loss(draft, batch) -> torch.Tensor:
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
        with torch.no_grad():
            log_p = F.log_softmax(target(**inputs).logits[:, :-1].float(), dim=-1)  # [B, T-1, V]
        log_q = F.log_softmax(draft(**inputs).logits[:, :-1].float(), dim=-1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # forward KL(p_target || q_draft), [B, T-1]
        return kl[completion_mask(batch)].mean()

    return distill_loss


# ---------------------------------------------------------------- sampling and measuring


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


def eval_prompts(tokenizer, num_prompts: int, seed: int) -> tuple[list[str], list[list[int]]]:
    """``default_task.default_prompts(num_prompts, seed)`` and their token ids, <bos> first."""
    texts = default_task.default_prompts(num_prompts, seed=seed)
    return texts, [[tokenizer.bos_token_id] + ids for ids in encode(tokenizer, texts)]


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


# ---------------------------------------------------------------- main


def train_target(args, tokenizer, rng) -> tuple[LlamaForCausalLM, float]:
    target = build_model(args, "target", tokenizer).to(args.device)
    print(f"target: {num_params(target):,} parameters", flush=True)

    def make_rows(num_rows):
        return reference_rows(rng, tokenizer, num_rows, args.p_drop_bos)

    batch_fn = batch_stream(rng, make_rows, args.pool_size, args.target_batch_tokens, tokenizer.pad_token_id)
    seconds = train_loop("target", target, lm_loss, batch_fn, args.target_steps, args.target_lr, args)
    return target, seconds


def train_draft(args, tokenizer, rng, target) -> tuple[LlamaForCausalLM, float, float]:
    draft = build_model(args, "draft", tokenizer).to(args.device)
    if args.draft_hidden_size == args.target_hidden_size:  # start from the target's (tied) embeddings
        draft.get_input_embeddings().weight.data.copy_(target.get_input_embeddings().weight.data)
    print(f"draft: {num_params(draft):,} parameters", flush=True)
    start = time.perf_counter()
    _, prompts = eval_prompts(tokenizer, args.num_distill_samples, seed=args.seed + 1)
    samples = list(zip(prompts, generate(target, tokenizer, prompts, args, temperature=1.0, seed=args.seed + 1)))
    sample_seconds = time.perf_counter() - start
    print(f"[draft] sampled {len(samples)} target completions in {sample_seconds:.0f}s", flush=True)

    def make_rows(num_rows):
        num_sampled = round(num_rows * args.distill_sample_fraction)
        rows = rng.choices(samples, k=num_sampled)
        return rows + reference_rows(rng, tokenizer, num_rows - num_sampled, args.p_drop_bos)

    batch_fn = batch_stream(rng, make_rows, args.pool_size, args.draft_batch_tokens, tokenizer.pad_token_id)
    seconds = train_loop("draft", draft, make_distill_loss(target), batch_fn, args.draft_steps, args.draft_lr, args)
    return draft, seconds, sample_seconds


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


def save(model, tokenizer, path: Path, max_new_tokens: int) -> dict:
    """Save ``model`` in float16; it stays float16-rounded (in float32) so later measurements see the saved weights."""
    model.to(torch.float16)
    model.config.dtype = torch.float16
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, max_new_tokens=max_new_tokens,
    )
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    model.to(torch.float32)
    return {"weights_bytes": (path / "model.safetensors").stat().st_size,
            "dir_bytes": sum(f.stat().st_size for f in path.iterdir() if f.is_file())}


def architecture(model) -> dict:
    c = model.config
    return {"num_parameters": num_params(model), "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads, "head_dim": c.head_dim,
            "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size,
            "max_position_embeddings": c.max_position_embeddings}


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    out_dir = Path(args.out_dir)
    tokenizer = build_tokenizer(args.max_position_embeddings)
    start = time.perf_counter()
    target, target_seconds = train_target(args, tokenizer, rng)
    target_files = save(target, tokenizer, out_dir / "target", args.max_new_tokens)  # the draft distils these weights
    draft, draft_seconds, sample_seconds = train_draft(args, tokenizer, rng, target)
    draft_files = save(draft, tokenizer, out_dir / "draft", args.max_new_tokens)
    report = {"args": vars(args), "target": architecture(target) | target_files,
              "draft": architecture(draft) | draft_files,
              "total_weights_bytes": target_files["weights_bytes"] + draft_files["weights_bytes"],
              "train/target_seconds": target_seconds, "train/draft_seconds": draft_seconds,
              "train/distill_sampling_seconds": sample_seconds}
    report |= evaluate(args, tokenizer, target, draft)
    report |= timing(target, draft)
    report["total_seconds"] = time.perf_counter() - start
    (out_dir / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "args"}, indent=2))


if __name__ == "__main__":
    main()
