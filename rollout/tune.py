"""`python -m rollout tune`: measure a target/draft pair's acceptance per draft position on a workload and its
step costs on this hardware, and print the per-batch-size schedule (spec/tuning.py) as the speculative-config
JSON that this engine and `vllm serve --speculative-config` both accept."""

import json
import sys

from rollout.default_task import default_prompts
from rollout.generator import RolloutGenerator
from rollout.sampling_params import SamplingParams
from spec.tuning import best_k, tuned_schedule

_REPORTED_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def tune(args, base_config: dict) -> dict:
    """The tuned speculative config; a table of the predictions goes to stderr."""
    max_k = args.max_k or base_config["num_speculative_tokens"]
    static = {key: value for key, value in base_config.items()
              if key not in ("num_speculative_tokens_per_batch_size", "enable_adaptive_verification")}
    static["num_speculative_tokens"] = max_k
    generator = RolloutGenerator(args.model, draft_model=args.draft_model, speculative_config=static,
                                 max_num_seqs=args.max_num_seqs, seed=args.seed)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    batch = generator.generate(default_prompts(args.num_prompts, seed=args.seed), args.num_generations, params,
                               use_tqdm=not args.no_progress)
    acceptance = batch.stats["acceptance_rate_per_position"]
    costs = generator.measure_step_costs(refresh=True)  # also caches them for adaptive verification
    schedule = tuned_schedule(acceptance, costs, args.max_num_seqs, args.min_gain)
    print(_report(acceptance, costs, args.max_num_seqs, args.min_gain), file=sys.stderr)
    return {**base_config, "num_speculative_tokens": max(1, max(k for *_, k in schedule)),
            "num_speculative_tokens_per_batch_size": schedule}


def _report(acceptance: list[float], costs, max_num_seqs: int, min_gain: float) -> str:
    lines = ["acceptance per position: " + " ".join(f"{r:.2f}" for r in acceptance),
             "batch size  K  predicted speedup"]
    for batch_size in (b for b in _REPORTED_BATCH_SIZES if b <= max_num_seqs):
        k, speedup = best_k(acceptance, costs, batch_size, min_gain)
        lines.append(f"{batch_size:10d} {k:2d}  {speedup:.2f}x")
    return "\n".join(lines)


def main(args, base_config: dict) -> None:
    config = tune(args, base_config)
    text = json.dumps(config)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    print(text)
