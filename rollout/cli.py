"""`python -m rollout generate | tune | serve`: roll out the default pair (or your own models and prompts), tune a
per-batch-size schedule, or start vLLM's server with the settings the server backend needs.

This module imports nothing heavy at the top (torch, transformers and the engine load inside the commands), so
`--help` and argument errors answer at once.
"""

import argparse
import json
import sys

from rollout.defaults import DEFAULT_MIN_GAIN, default_speculative_config

DEFAULT_NUM_PROMPTS = 32  # tune's acceptance rollout
GENERATE_DEFAULTS = {"num_generations": 8, "max_tokens": 320, "max_num_seqs": 128,  # one GRPO generation batch of
                     "max_num_seqs_help": "running requests at most"}  # the default task, long tail included, at once
GENERATE_NUM_PROMPTS = 16
TUNE_DEFAULTS = {"num_generations": 4, "max_tokens": 64, "max_num_seqs": 256,  # steady batches: tune times each size
                 "max_num_seqs_help": "the largest batch size the schedule covers"}
K_LEGEND = ("K by batch size: as the batch drains (completions finish), for each range of running requests, the "
            "cap on draft tokens per request most often used there (the schedule's K; 0 = no speculation), the "
            "drafts each request verified there on average (fewer than the cap where the drafter had fewer or "
            "adaptive verification cut them) and the engine steps that ran at those sizes")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless its help already says it."""

    def _get_help_string(self, action):
        return action.help if "default:" in (action.help or "") else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rollout", description=__doc__.split("\n\n")[0],
                                     formatter_class=_Formatter)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="roll out prompts with speculative decoding, write JSONL",
                              formatter_class=_Formatter, epilog=K_LEGEND)
    _add_common(gen, **GENERATE_DEFAULTS)
    _add_generate(gen)
    tune = commands.add_parser("tune", help="measure acceptance and step costs; print the per-batch-size schedule "
                                            "as --speculative-config JSON", formatter_class=_Formatter)
    _add_common(tune, **TUNE_DEFAULTS)
    _add_tune(tune)
    commands.add_parser("serve", help="start vLLM's OpenAI server for backend='server' (vLLM's flags, passed "
                                      "through; see rollout/vllm_backend/serve.py)", add_help=False)
    return parser


def _add_common(parser: argparse.ArgumentParser, num_generations: int, max_tokens: int, max_num_seqs: int,
                max_num_seqs_help: str) -> None:
    parser.add_argument("--model", default="default",
                        help="target: a local HF folder, a .gguf file (converted once to a cached folder), or "
                             "'default' (shipped pair)")
    parser.add_argument("--draft-model", default=None,
                        help="draft model folder; alone (without --speculative-config) it means method "
                             "draft_model with K = 8 and the default per-batch-size schedule")
    parser.add_argument("--speculative-config", default=None,
                        help="the same JSON as vLLM's --speculative-config; 'none' turns speculation off "
                             "(default: rollout.default_speculative_config(backend): the rollout-history drafter with "
                             "K = 4 and adaptive verification, which needs no draft model; on vllm inside vLLM's "
                             "workers)")
    parser.add_argument("--num-generations", type=_positive_int, default=num_generations, help="samples per prompt")
    parser.add_argument("--max-tokens", type=_positive_int, default=max_tokens,
                        help="completion tokens per sample at most")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0 = greedy)")
    parser.add_argument("--max-num-seqs", type=_positive_int, default=max_num_seqs,
                        help=max_num_seqs_help)
    parser.add_argument("--max-model-len", type=_positive_int, default=None,
                        help="prompt + completion tokens a request holds at most (default: the model's, capped at "
                             "2048); each running request's KV slot has this many positions")
    parser.add_argument("--seed", type=int, default=0, help="base seed of the prompts and of the sampling")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_generate(gen: argparse.ArgumentParser) -> None:
    source = gen.add_mutually_exclusive_group()
    source.add_argument("--prompts", default=None, metavar="FILE",
                        help="prompts file: .jsonl/.json, one JSON per line (a string, a chat messages list, or "
                             "an object with a 'prompt' key); any other extension: plain text, one prompt per line "
                             "(default: the default task's prompts)")
    source.add_argument("--dataset", default=None, metavar="PATH",
                        help="a datasets dataset saved with save_to_disk, with a 'prompt' column")
    gen.add_argument("--num-prompts", type=_positive_int, default=None,
                     help=f"prompts to roll out: drawn from the default task, or the first N of --prompts / "
                          f"--dataset (default: {GENERATE_NUM_PROMPTS} from the task; all of a file or "
                          "dataset)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    gen.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely tokens (-1 = off)")
    gen.add_argument("--output", default="rollouts.jsonl",
                     help="JSONL file, one line per sample; '-' writes to stdout (the summary then goes to stderr)")


def _add_tune(tune: argparse.ArgumentParser) -> None:
    tune.add_argument("--num-prompts", type=_positive_int, default=DEFAULT_NUM_PROMPTS,
                      help="default-task prompts of the acceptance-measuring rollout")
    tune.add_argument("--max-k", type=_positive_int, default=None,
                      help="largest K to consider (default: the config's num_speculative_tokens)")
    tune.add_argument("--min-gain", type=float, default=DEFAULT_MIN_GAIN,
                      help="the smallest K that the fastest does not beat by this factor (K = 0 unless "
                           "speculation wins by it)")
    tune.add_argument("--repeats", type=_positive_int, default=6,
                      help="prompt sets timed per K at batch sizes up to 16 (fewer above, at least 3)")
    tune.add_argument("--predict-only", action="store_true",
                      help="take the steady-state model's prediction, without timing rollouts per K")
    tune.add_argument("--output", default=None, help="also write the JSON to this file")
    tune.add_argument("--backend", choices=("embedded", "vllm"), default="embedded",
                      help="the engine whose step costs and rollouts are measured (vllm: vllm.LLM in this process)")
    tune.add_argument("--prompts", default=None, metavar="FILE",
                      help="your prompts, in generate's --prompts format (default: the default task's)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


def speculative_config_from_args(args) -> dict | None:
    if args.speculative_config is None:
        return default_speculative_config(getattr(args, "backend", "embedded"), args.draft_model)
    if args.speculative_config.strip().lower() == "none":
        return None
    from spec import SpecConfig
    return SpecConfig.parse_json(args.speculative_config, name="--speculative-config")


def generate(args) -> dict:
    """Checks the output path and reads the prompts before anything heavy is imported; writes the samples as
    JSONL, and the summary to stdout (to stderr with --output -, so that stdout stays JSONL)."""
    from rollout.prompt_files import check_output

    check_output(args.output)
    prompts = _prompts(args)
    from rollout.generator import RolloutGenerator
    from rollout.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens)
    _disable_weight_loading_bars()
    generator = RolloutGenerator(args.model, draft_model=args.draft_model, max_num_seqs=args.max_num_seqs,
                                 max_model_len=args.max_model_len, speculative_config=speculative_config_from_args(args),
                                 seed=args.seed)
    batch = generator.generate(prompts, args.num_generations, params, use_tqdm=not args.no_progress)
    lines = "".join(json.dumps(sample.to_dict()) + "\n" for sample in batch.samples)
    to_stdout = args.output == "-"
    if to_stdout:
        sys.stdout.write(lines)
        sys.stdout.flush()
    else:
        with open(args.output, "w") as f:
            f.write(lines)
    print(summary_table(batch.stats, "stdout" if to_stdout else args.output),
          file=sys.stderr if to_stdout else sys.stdout)
    return batch.stats


def _prompts(args) -> list:
    from rollout.prompt_files import load_dataset_prompts, read_prompts

    if args.prompts is None and args.dataset is None:
        from rollout.default_task import default_prompts
        return default_prompts(args.num_prompts or GENERATE_NUM_PROMPTS, seed=args.seed)
    source, prompts = (f"--prompts {args.prompts}", read_prompts(args.prompts)) if args.prompts is not None \
        else (f"--dataset {args.dataset}", load_dataset_prompts(args.dataset))
    if args.num_prompts is not None and args.num_prompts > len(prompts):
        raise ValueError(f"--num-prompts {args.num_prompts}: {source} holds {len(prompts)} prompts; pass at most "
                         f"{len(prompts)}, or leave --num-prompts out to use them all")
    return prompts[:args.num_prompts]


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
        ("K by batch size", drain(stats["k_per_batch_size"], stats["drafts_per_batch_size"])),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join([*(f"{name:<{width}}  {value}" for name, value in rows), f"({K_LEGEND})"])


def drain(k_per_batch_size: dict, drafts_per_batch_size: dict) -> str:
    """The batch's drain, largest sizes first: per range of running requests (powers of two), the K most used there
    (the cap), the drafts verified per request and step there, and the steps that ran there, e.g. "65-128: K 8,
    2.3 verified, 21 steps | ... | 1: K 8, 6.9 verified, 120 steps"."""
    ranges: dict[int, list] = {}  # bits -> [Counter of K, drafts verified, request-steps]
    for batch_size, counts in k_per_batch_size.items():
        merged = ranges.setdefault((int(batch_size) - 1).bit_length(), [{}, 0, 0])  # sizes 2^(b-1) + 1 .. 2^b
        for k, steps in counts.items():
            merged[0][k] = merged[0].get(k, 0) + steps
        merged[1] += drafts_per_batch_size.get(batch_size, 0)
        merged[2] += int(batch_size) * sum(counts.values())
    parts = []
    for bits in sorted(ranges, reverse=True):
        low, high = (2 ** (bits - 1) + 1, 2 ** bits) if bits else (1, 1)
        name = str(low) if low == high else f"{low}-{high}"
        counts, drafts, request_steps = ranges[bits]
        parts.append(f"{name}: K {max(counts, key=counts.get)}, {drafts / request_steps:.1f} verified, "
                     f"{sum(counts.values())} steps")
    return " | ".join(parts)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # vLLM's flags pass through: no parser of ours sees them
        from rollout.vllm_backend.serve import main as serve
        return serve(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "tune":
            config = speculative_config_from_args(args)
            if config is None:
                raise ValueError("tune needs a speculative config: pass --speculative-config or --draft-model (or "
                                 "use the default pair, --model default)")
            from rollout.tune import main as run_tune
            _disable_weight_loading_bars()
            run_tune(args, config)
        else:
            generate(args)
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _disable_weight_loading_bars() -> None:
    """Weight-loading bars off: ours shows the rollout."""
    import transformers
    transformers.logging.disable_progress_bar()
