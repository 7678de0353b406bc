"""`python -m rollout generate`: the main job on the embedded default pair (or your own models)."""

import argparse
import json
import sys

import transformers

from rollout.default_models import default_model_paths
from rollout.default_task import default_prompts
from rollout.generator import RolloutGenerator
from rollout.sampling_params import SamplingParams

# K by live batch size for the default pair on a 2-core CPU, read off the schedule benchmark
# (examples/bench_schedule.py, examples/results/): the best static K falls from 8 to 4 to 2 as the batch grows
# and the target's verification turns compute-bound. K stays >= 1 at large batches: at 256 rows K=2 is about
# even with no speculation, while K=0 there made the draft model re-read every context when the batch drained
# and K rose again (0.89x in one run).
DEFAULT_SCHEDULE = [[1, 2, 8], [3, 96, 4], [97, 1024, 2]]


def default_speculative_config() -> dict:
    return {"method": "draft_model", "model": default_model_paths()["draft"], "num_speculative_tokens": 8,
            "num_speculative_tokens_per_batch_size": DEFAULT_SCHEDULE}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rollout", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="roll out prompts with speculative decoding, write JSONL")
    gen.add_argument("--model", default="default", help="target: a local HF folder, or 'default' (shipped pair)")
    gen.add_argument("--draft-model", default=None, help="draft model folder (method draft_model)")
    gen.add_argument("--speculative-config", default=None,
                     help="the same JSON as vLLM's --speculative-config; 'none' turns speculation off "
                          "(default: the shipped draft with a per-batch-size schedule)")
    gen.add_argument("--num-prompts", type=int, default=32, help="prompts generated from the default task")
    gen.add_argument("--num-generations", type=int, default=4, help="samples per prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--max-num-seqs", type=int, default=64)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--output", default="rollouts.jsonl", help="JSONL file, one line per sample")
    gen.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def speculative_config_from_args(args) -> dict | None:
    if args.speculative_config is None:
        return default_speculative_config() if args.model == "default" and args.draft_model is None else None
    if args.speculative_config.strip().lower() == "none":
        return None
    try:
        return json.loads(args.speculative_config)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not valid JSON ({e}); e.g. "
                         '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from e


def generate(args) -> dict:
    generator = RolloutGenerator(args.model, draft_model=args.draft_model, max_num_seqs=args.max_num_seqs,
                                 speculative_config=speculative_config_from_args(args), seed=args.seed)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens)
    prompts = default_prompts(args.num_prompts, seed=args.seed)
    batch = generator.generate(prompts, args.num_generations, params, use_tqdm=not args.no_progress)
    with open(args.output, "w") as f:
        for sample in batch.samples:
            f.write(json.dumps(sample.to_dict()) + "\n")
    print(summary_table(batch.stats, args.output))
    return batch.stats


def summary_table(stats: dict, output: str) -> str:
    rows = [
        ("samples", f"{stats['num_requests']}  -> {output}"),
        ("completion tokens", stats["num_completion_tokens"]),
        ("engine steps", stats["num_steps"]),
        ("tokens/s", f"{stats['tokens_per_s']:.1f}"),
        ("acceptance rate", f"{stats['draft_acceptance_rate']:.3f}"),
        ("mean acceptance length", f"{stats['mean_acceptance_length']:.2f}"),
        ("verified / emitted tokens", f"{stats['verified_tokens_per_emitted_token']:.2f}"),
        ("acceptance per position", " ".join(f"{r:.2f}" for r in stats["acceptance_rate_per_position"])),
        ("K per batch size", " ".join(f"{b}:{_mode(c)}" for b, c in stats["k_per_batch_size"].items())),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _mode(counter: dict) -> int:
    return max(counter, key=counter.get)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    transformers.logging.disable_progress_bar()  # weight-loading bars; ours shows the rollout
    try:
        generate(args)
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
