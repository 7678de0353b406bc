"""The training loops of examples/train_default_pair.py: the Llama configs, AdamW with warmup and a cosine
schedule, the target's language-model loss on completions, and the draft's distillation (forward KL to the target on
the target's temperature-1 samples mixed with reference solutions)."""

import math
import time

import torch
import torch.nn.functional as F
from train_default_pair_data import batch_stream, completion_mask, eval_prompts, generate, reference_rows
from transformers import LlamaConfig, LlamaForCausalLM


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


def make_distill_loss(target):
    def distill_loss(draft, batch) -> torch.Tensor:
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
        with torch.no_grad():
            log_p = F.log_softmax(target(**inputs).logits[:, :-1].float(), dim=-1)  # [B, T-1, V]
        log_q = F.log_softmax(draft(**inputs).logits[:, :-1].float(), dim=-1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # forward KL(p_target || q_draft), [B, T-1]
        return kl[completion_mask(batch)].mean()

    return distill_loss


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
