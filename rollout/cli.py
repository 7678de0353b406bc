"""`python -m rollout generate | tune | serve`: roll out the default pair (or your own models), tune a per-batch-size
schedule, or start vLLM's server with the settings the server backend needs (rollout/vllm_backend/serve.py)."""

import argparse
import json
import sys

import transformers

from rollout.default_models import default_model_paths
from rollout.default_task import default_prompts
from rollout.generator import RolloutGenerator
from rollout.sampling_params import SamplingParams
from rollout.tune import main as run_tune
from spec.adaptive.tuning import MIN_GAIN

# K by live batch size for the default pair: the table `python -m rollout tune --max-k 8` printed on the 2-core
# CPU this project is developed on (2 torch threads, every K timed on real rollouts at batch sizes 1..256; the
# steady-state model alone predicted K = 6-8 throughout and measured slower). Re-run tune on other hardware.
DEFAULT_SCHEDULE = [[1, 22, 8], [23, 90, 4], [91, 256, 2]]


def default_speculative_config() -> dict:
    return {"method": "draft_model", "model": default_model_paths()["draft"], "num_speculative_tokens": 8,
            "num_speculative_tokens_per_batch_size": DEFAULT_SCHEDULE}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rollout", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="roll out prompts with speculative decoding, write JSONL")
    _add_common(gen, max_num_seqs=64)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--output", default="rollouts.jsonl", help="JSONL file, one line per sample")
    tune = commands.add_parser("tune", help="measure acceptance and step costs; print the per-batch-size schedule "
                                            "as --speculative-config JSON")
    _add_common(tune, max_num_seqs=256)
    tune.add_argument("--max-k", type=int, default=None,
                      help="largest K to consider (default: the config's num_speculative_tokens)")
    tune.add_argument("--min-gain", type=float, default=MIN_GAIN,
                      help="the smallest K that the fastest does not beat by this factor (K = 0 unless "
                           "speculation wins by it)")
    tune.add_argument("--repeats", type=int, default=6,
                      help="prompt sets timed per K at batch sizes up to 16 (fewer above, at least 3)")
    tune.add_argument("--predict-only", action="store_true",
                      help="take the steady-state model's prediction, without timing rollouts per K")
    tune.add_argument("--output", default=None, help="also write the JSON to this file")
    tune.add_argument("--backend", choices=("embedded", "vllm"), default="embedded",
                      help="the engine whose step costs and rollouts are measured (vllm: vllm.LLM in this process)")
    tune.add_argument("--prompts", default=None,
                      help="your prompts: JSONL with a 'prompt' field, or a text file with one prompt a line "
                           "(a literal \\n is a newline); default: the default task's")
    commands.add_parser("serve", help="start vLLM's OpenAI server for backend='server' (vLLM's flags, passed "
                                      "through; see rollout/vllm_backend/serve.py)", add_help=False)
    return parser


def _add_common(parser: argparse.ArgumentParser, max_num_seqs: int) -> None:
    parser.add_argument("--model", default="default", help="target: a local HF folder, or 'default' (shipped pair)")
    parser.add_argument("--draft-model", default=None, help="draft model folder (method draft_model)")
    parser.add_argument("--speculative-config", default=None,
                        help="the same JSON as vLLM's --speculative-config; 'none' turns speculation off "
                             "(default: the shipped draft with a per-batch-size schedule)")
    parser.add_argument("--num-prompts", type=int, default=32, help="prompts generated from the default task")
    parser.add_argument("--num-generations", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-num-seqs", type=int, default=max_num_seqs,
                        help="running requests at most (tune: the largest batch size the schedule covers)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


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
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # vLLM's flags pass through: no parser of ours sees them
        from rollout.vllm_backend.serve import main as serve
        return serve(argv[1:])
    args = build_parser().parse_args(argv)
    transformers.logging.disable_progress_bar()  # weight-loading bars; ours shows the rollout
    try:
        if args.command == "tune":
            config = speculative_config_from_args(args)
            if config is None:
                raise ValueError("tune needs a speculative config: pass --speculative-config (or use the default "
                                 "pair, --model default)")
            run_tune(args, config)
        else:
            generate(args)
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
