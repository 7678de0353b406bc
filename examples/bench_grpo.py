"""GRPO benchmark on the default pair: the generation phase of a GRPO step with our rollout function against TRL's
own generation (use_vllm=False), and acceptance over a GRPO run with and without drafter refresh.

    python examples/bench_grpo.py [--batches 1x8,4x8,16x8] [--repeats 3] [--steps 50]
                                  [--output-dir examples/results]
    python examples/bench_grpo.py --batches 2x2 --repeats 1 --steps 2 \\
        --max-completion-length 16 --output-dir /tmp/bench_grpo          # a smoke run

Generation phase, per batch shape PxG (P prompts, each repeated G = num_generations times, as the trainer's sampler
delivers one process's generation batch: 1x8 is TRL's default per-device batch of 8 with 8 generations):
`GRPOTrainer._generate` on that batch, the same code for every arm but the backend: TRL's own `model.generate` path
(use_vllm=False), and a RolloutGenerator as rollout_func (with SpecRolloutCallback) with no speculation, with the
per-batch-size schedule, and with the schedule plus adaptive verification. Same weights (the shipped target,
float32), same sampling settings; every arm runs once untimed first, then the arms are interleaved (the order
rotates every repeat; each repeat draws a new batch, the same for every arm). Tokens/s is the completion tokens
each arm produced over its total time.
Also reported: the FLOP rate each arm reaches (2 x non-embedding parameters per completion token; prompts and
drafts not counted) against this CPU's measured float32 matmul peak, which bounds what any backend can gain here.

Acceptance run: examples/grpo_arithmetic.py for --steps steps, twice from the same start: drafter refresh off,
then on every --refresh-every steps; spec/acceptance_rate and the reward per step.

Writes bench_grpo.json and bench_grpo.png to --output-dir.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

import grpo_arithmetic  # examples/grpo_arithmetic.py, beside this script
from rollout import RolloutGenerator, default_model_paths, default_prompts
from rollout.cli import DEFAULT_SCHEDULE
from trainers import SpecRolloutCallback

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batches", default="1x8,4x8,16x8",
                   help="generation batch shapes, PROMPTSxGENERATIONS, comma-separated")
    p.add_argument("--max-completion-length", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--arms", default="trl_generate,no_spec,schedule,schedule_adaptive",
                   help="comma-separated subset of " + ",".join(ARMS))
    p.add_argument("--steps", type=int, default=50, help="GRPO steps of each acceptance run; 0 skips the runs")
    p.add_argument("--refresh-every", type=int, default=5, help="drafter refresh period of the second run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default=str(RESULTS_DIR))
    return p.parse_args(argv)


def _spec(adaptive: bool) -> dict:
    config = {"method": "draft_model", "model": default_model_paths()["draft"], "num_speculative_tokens": 8,
              "num_speculative_tokens_per_batch_size": DEFAULT_SCHEDULE}
    return {**config, "enable_adaptive_verification": True} if adaptive else config


# arm -> the RolloutGenerator's speculative_config; trl_generate has no generator (TRL generates itself)
ARMS = {"trl_generate": None, "no_spec": None, "schedule": _spec(False), "schedule_adaptive": _spec(True)}


def generation_trainer(arm: str, policy, tokenizer, args, num_prompts: int, num_generations: int,
                       output_dir: str) -> GRPOTrainer:
    rows = num_prompts * num_generations
    config = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=rows, num_generations=num_generations,
                        max_completion_length=args.max_completion_length, temperature=args.temperature,
                        bf16=False, report_to=[], save_strategy="no", seed=args.seed)
    rollout_func, callbacks = None, []
    if arm != "trl_generate":
        generator = RolloutGenerator("default", speculative_config=ARMS[arm], max_num_seqs=rows, seed=args.seed,
                                     device=config.device)
        rollout_func, callbacks = generator, [SpecRolloutCallback(generator)]
    dataset = Dataset.from_dict({"prompt": default_prompts(num_prompts, seed=args.seed)})  # unused: a
    # required argument; the benchmark calls _generate on its own batch
    return GRPOTrainer(model=policy, reward_funcs=grpo_arithmetic.reward_correct, args=config, train_dataset=dataset,
                       processing_class=tokenizer, rollout_func=rollout_func, callbacks=callbacks)


def time_generation(trainer: GRPOTrainer, prompts: list[str]) -> tuple[float, int]:
    """Seconds of one GRPOTrainer._generate call and the completion tokens it produced."""
    start = time.perf_counter()
    completion_ids = trainer._generate(prompts)[1]
    return time.perf_counter() - start, sum(len(ids) for ids in completion_ids)


def bench_generation(args, arms: list[str], num_prompts: int, num_generations: int) -> dict:
    paths = default_model_paths()
    tokenizer = AutoTokenizer.from_pretrained(paths["target"])
    policy = AutoModelForCausalLM.from_pretrained(paths["target"], dtype=torch.float32).eval()
    flops_per_token = 2 * sum(p.numel() for name, p in policy.named_parameters() if "embed_tokens" not in name)
    def batch(seed: int) -> list[str]:
        return [p for p in default_prompts(num_prompts, seed=seed) for _ in range(num_generations)]

    with tempfile.TemporaryDirectory() as output_dir:
        trainers = {arm: generation_trainer(arm, policy, tokenizer, args, num_prompts, num_generations, output_dir)
                    for arm in arms}
        policy.to(trainers[arms[0]].accelerator.device)
        for arm in arms:  # untimed: first-call costs, the first weight sync, adaptive calibration
            time_generation(trainers[arm], batch(args.seed))
        runs = {arm: [] for arm in arms}
        # a new batch per repeat (the same for every arm); small batches, whose time depends on how their few
        # completions end, get proportionally more repeats
        for repeat in range(max(args.repeats, args.repeats * 64 // (num_prompts * num_generations))):
            prompts = batch(args.seed + 1 + repeat)
            for arm in arms[repeat % len(arms):] + arms[:repeat % len(arms)]:
                runs[arm].append(time_generation(trainers[arm], prompts))
                print(f"  {num_prompts}x{num_generations} repeat {repeat} {arm:<18} {runs[arm][-1][0]:6.2f} s  "
                      f"{runs[arm][-1][1]} tokens", flush=True)
    results = {}
    for arm, timings in runs.items():
        seconds, tokens = sum(t for t, _ in timings), sum(n for _, n in timings)
        results[arm] = {"seconds": [t for t, _ in timings], "tokens": [n for _, n in timings],
                        "total_seconds": seconds, "tokens_per_s": tokens / seconds,
                        "gflops": tokens / seconds * flops_per_token / 1e9}
    if "trl_generate" in results:
        base = results["trl_generate"]
        for arm, result in results.items():
            result["speedup_tokens_per_s"] = result["tokens_per_s"] / base["tokens_per_s"]
            result["speedup_time"] = base["total_seconds"] / result["total_seconds"]
    return results


def matmul_peak_gflops(size: int = 2048, repeats: int = 10) -> float:
    """This CPU's float32 matmul rate at the current thread count: the ceiling of any forward pass here."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size ** 3 * repeats / (time.perf_counter() - start) / 1e9


def acceptance_runs(args) -> dict:
    runs = {}
    for name, refresh in (("no_refresh", 0), (f"refresh_every_{args.refresh_every}", args.refresh_every)):
        with tempfile.TemporaryDirectory() as output_dir:
            result = grpo_arithmetic.main(["--max-steps", str(args.steps), "--seed", str(args.seed),
                                           "--drafter-refresh-steps", str(refresh), "--num-held-out", "0",
                                           "--output-dir", output_dir])
        history = result["history"]
        runs[name] = {"acceptance_rate": [e["spec/acceptance_rate"] for e in history],
                      "mean_acceptance_length": [e["spec/mean_acceptance_length"] for e in history],
                      "reward": [e["reward"] for e in history],
                      "train_problems_reward_before_after": [result["reward_before"]["train_problems"],
                                                             result["reward_after"]["train_problems"]]}
    return runs


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    generation = results["generation"]
    shapes = list(generation)
    arms = list(next(iter(generation.values())))
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        xs = [j + i * width for j in range(len(shapes))]
        bars = left.bar(xs, [generation[s][arm]["tokens_per_s"] for s in shapes], width, label=arm)
        for bar, shape in zip(bars, shapes):
            ratio = generation[shape][arm].get("speedup_tokens_per_s")
            if ratio is not None and arm != "trl_generate":
                left.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                              va="bottom", fontsize=7)
    left.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], [f"{s} rows" for s in shapes])
    left.set_ylabel("completion tokens/s")
    left.set_title("generation phase of a GRPO step (ratio vs TRL generate)")
    left.legend(fontsize=8)
    for name, run in results.get("acceptance", {}).items():
        right.plot(range(1, len(run["acceptance_rate"]) + 1), run["acceptance_rate"], label=name)
    right.set_xlabel("GRPO step")
    right.set_ylabel("draft acceptance rate")
    right.set_title("acceptance over training")
    if results.get("acceptance"):
        right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    args = parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise ValueError(f"--arms: unknown {sorted(unknown)}; choose from {list(ARMS)}")
    results = {"settings": vars(args), "environment": {
        "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
        "device": "cuda" if torch.cuda.is_available() else "cpu", "num_threads": torch.get_num_threads()}}
    results["environment"]["matmul_peak_gflops"] = peak = matmul_peak_gflops()
    results["generation"] = {}
    for shape in args.batches.split(","):
        num_prompts, num_generations = (int(x) for x in shape.lower().split("x"))
        print(f"generation phase: {num_prompts} prompts x {num_generations} generations", flush=True)
        results["generation"][shape] = bench_generation(args, arms, num_prompts, num_generations)
    for shape, by_arm in results["generation"].items():
        for arm, result in by_arm.items():
            ratio = result.get("speedup_tokens_per_s")
            print(f"{shape:>6} {arm:<18} {result['total_seconds']:7.2f} s  {result['tokens_per_s']:8.0f} tok/s  "
                  f"{result['gflops']:5.1f} GFLOP/s ({result['gflops'] / peak:.0%} of the {peak:.0f} GFLOP/s "
                  "matmul peak)" + ("" if ratio is None else f"  {ratio:.2f}x TRL generate"))
    if args.steps > 0:
        results["acceptance"] = acceptance_runs(args)
        for name, run in results["acceptance"].items():
            rates = run["acceptance_rate"]
            k = max(1, len(rates) // 5)
            print(f"{name:<18} acceptance first {k} steps {statistics.mean(rates[:k]):.3f} -> last {k} steps "
                  f"{statistics.mean(rates[-k:]):.3f}")
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "bench_grpo.json").write_text(json.dumps(results, indent=2))
    plot(results, output_dir / "bench_grpo.png")
    print(f"wrote {output_dir / 'bench_grpo.json'} and bench_grpo.png")
    return results


if __name__ == "__main__":
    sys.exit(main() and 0)
