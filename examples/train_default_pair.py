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
    python examples/train_default_pair.py --target-steps 2 --draft-steps 2 --target-batch-tokens 512 \\
        --draft-batch-tokens 512 --pool-size 64 --num-distill-samples 8 --num-eval-prompts 8 --rollout-prompts 2 \\
        --rollout-generations 2 --max-new-tokens 16 --out-dir /tmp/default_pair   # a smoke run (seconds)

This file holds the command line and the saving; the data, the training loops and the report are in
``train_default_pair_data.py``, ``train_default_pair_loops.py`` and ``train_default_pair_report.py``.

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
import random
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from train_default_pair_data import build_tokenizer  # noqa: E402
from train_default_pair_loops import num_params, train_draft, train_target  # noqa: E402
from train_default_pair_report import evaluate, timing  # noqa: E402


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
