"""Speculation benchmark: tokens/s of no speculation, static K, the per-batch-size schedule, adaptive
verification, and schedule + adaptive verification, side by side, on two workloads.

    python examples/bench_speculation.py [--batch-sizes 1,2,4,...,256] [--repeats 24] [--min-repeats 10]
        [--confirm-repeats 32] [--output-dir DIR]
    python examples/bench_speculation.py --batch-sizes 1,2 --repeats 1 --min-repeats 1 --warmup 1 \\
        --confirm-repeats 1 --max-tokens 16 --threads 1 --output-dir /tmp/bench_speculation   # a smoke run

Workloads: `default` (the default task's arithmetic prompts, which the draft predicts well) and `mixed` (half of
them, half strings of digits and signs that are not questions, on which the draft's acceptance is ~4x lower), so
that acceptance differs between requests. Every arm rolls out the same prompts with the same sampling settings and
seeds on the embedded default pair and the same in-memory weights, and so the same completions (verification's
randomness is keyed by position, spec/uniforms.py): the arms differ only in how fast they produce them. Runs are
interleaved (the arm order rotates every repeat) so that machine noise hits every arm alike. Each repeat draws new
prompts and a new seed (the same for every arm), and tokens/s is all repeats' tokens over their time: a small
batch's speed depends on how its completions happen to end, so it gets `--repeats` rollouts and larger batches
proportionally fewer, at least `--min-repeats` (the machine's timing noise is then what is left to average out).
Adaptive arms keep their calibration and fitted costs across calls, as a training run does, and start afresh for
each workload, as a new training run does; every arm runs once untimed first, and then `--warmup` untimed batches at
each batch size before its timed ones, as a training run repeats its batch size every step (the warm-up batches'
tokens/s are reported too). HF
`model.generate` on the same target is one more arm on the default workload. Also reported: verified tokens per
emitted token per arm, the adaptive arms over the schedule paired repeat by repeat (`paired_ratio`: robust to a slow
spell of the machine), and the speedup the measured step costs predict for each static K (spec/tuning.py).

The targets' comparison, the adaptive arms over the best other arm, is then measured again at each batch size on
`--confirm-repeats` fresh repeats of just those three arms (`confirm`; 4x that up to 16 requests and 2x at 32, where
a repeat is cheap: `confirm_repeats_at`), going round the batch sizes so that each size's repeats span the whole
stage: the best of several noisy arms is biased up (and the least of several paired ratios down), so the arm is
chosen on the first stage's repeats and measured on others; and three arms get ~2.7x the repeats that eight would in
the same time. This machine's timing noise needs them: two arms doing the same work read 0.81-0.92 to 1.11-1.16 of
each other (10th to 90th percentile of a repeat's ratio, 4 runs of 24 repeats) at 128 requests, 0.94-1.05 at 8; and
two runs at batch 8 alone, their confirmations a minute each, read adaptive verification 1.019 (90% interval
0.973-1.086) of K = 4 and 0.954 (0.902-0.984) of K = 8.
Writes bench_speculation.json and bench_speculation.png (default folder: examples/results).
"""

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout import RolloutGenerator, SamplingParams, default_model_paths, default_prompts
from rollout.defaults import DEFAULT_SCHEDULE
from rollout.tune import repeats_at
from spec.tuning import predicted_speedup

STATIC_KS = (1, 2, 4, 8)
MAX_K = max(STATIC_KS)
ADAPTIVE_ARMS = ("adaptive", "schedule_adaptive")
OWN_ARMS = ("schedule", *ADAPTIVE_ARMS)
INTERVAL = 0.90  # of the confirmed paired ratios (bootstrap)


def arms() -> dict[str, dict | None]:
    draft = {"method": "draft_model", "num_speculative_tokens": MAX_K}
    schedule = {**draft, "num_speculative_tokens_per_batch_size": DEFAULT_SCHEDULE}
    return {"no_spec": None, **{f"K={k}": {**draft, "num_speculative_tokens": k} for k in STATIC_KS},
            "schedule": schedule, "adaptive": {**draft, "enable_adaptive_verification": True},
            "schedule_adaptive": {**schedule, "enable_adaptive_verification": True}}


def mixed_prompts(num_prompts: int, seed: int) -> list[str]:
    """Every other prompt from the default task, the rest random strings of its digits and signs."""
    rng = random.Random(seed)
    questions = default_prompts(num_prompts, seed=seed)
    noise = ["".join(rng.choice("0123456789+-=") for _ in range(12)) for _ in range(num_prompts)]
    return [questions[i] if i % 2 == 0 else noise[i] for i in range(num_prompts)]


WORKLOADS = {"default": default_prompts, "mixed": mixed_prompts}


def load(name: str):
    return AutoModelForCausalLM.from_pretrained(default_model_paths()[name], dtype=torch.float32).eval()


def run_workload(workload: str, runners: dict, batch_sizes, repeats: int, min_repeats: int,
                 max_tokens: int, warmup: int, confirm_repeats: int) -> dict:
    """Per batch size: per arm, tokens/s over all repeats, mean verified tokens per emitted token, acceptance counts
    (`arms`); each arm's tokens/s over its untimed warm-up batches there (`warmup_tokens_per_s`); and the adaptive
    arms over the best other arm on fresh repeats (`confirmed`). Each repeat rolls out its own prompts and seed (the
    same for every arm): how soon a small batch drains depends on the completions drawn, so one prompt set would
    measure its own luck. The confirmation's repeats go round the batch sizes, so that each size's repeats span the
    stage: this machine's state moves a paired ratio by more than the target's 3% from one minute to another."""
    make_prompts = WORKLOADS[workload]
    for runner in runners.values():  # untimed: warm caches, and let adaptive arms calibrate once
        runner(make_prompts(16, seed=10_000), SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=0))
    results = {}
    for batch_size in batch_sizes:
        warm = _interleaved(runners, make_prompts, batch_size, warmup, max_tokens, seed=20_000)
        runs = _interleaved(runners, make_prompts, batch_size, max(min_repeats, repeats_at(batch_size, repeats)),
                            max_tokens, seed=0)
        results[batch_size] = {
            "arms": {name: _summarise(stats) for name, stats in runs.items()},
            "warmup_tokens_per_s": {name: _summarise(stats)["tokens_per_s"] for name, stats in warm.items() if stats}}
        print(f"[{workload}] {_row(batch_size, results[batch_size]['arms'])}", flush=True)
    best = {batch_size: best_other_arm(results[batch_size]["arms"]) for batch_size in batch_sizes}
    confirmation = {batch_size: {name: [] for name in [*ADAPTIVE_ARMS, best[batch_size]]} for batch_size in batch_sizes}
    counts = {batch_size: confirm_repeats_at(batch_size, confirm_repeats) for batch_size in batch_sizes}
    num_rounds = max(counts.values())
    for round_ in range(num_rounds):
        for batch_size, count in counts.items():  # each size's repeats spread evenly over the rounds
            if (round_ + 1) * count // num_rounds > round_ * count // num_rounds:
                repeat = len(confirmation[batch_size][best[batch_size]])
                _run_repeat(runners, confirmation[batch_size], make_prompts, batch_size, repeat, max_tokens,
                            seed=500_000)
    for batch_size in batch_sizes:
        results[batch_size]["confirmed"] = confirm(
            {name: _summarise(stats) for name, stats in confirmation[batch_size].items()}, best[batch_size])
    return results


def confirm_repeats_at(batch_size: int, repeats: int) -> int:
    """Confirmation repeats at a batch size: 4x `repeats` up to 16 requests, 2x at 32, `repeats` from 64 on. A small
    batch's repeat takes a fraction of a second, and its noise is the machine's, nearly independent from one run to
    the next (identical batches of 8 run back to back: 4.6% coefficient of variation, lag-1 autocorrelation 0.25):
    4x the repeats halve the interval for minutes of the stage's time."""
    return repeats * min(4, max(1, 64 // batch_size))


def _interleaved(runners: dict, make_prompts, batch_size: int, repeats: int, max_tokens: int,
                 seed: int) -> dict[str, list[dict]]:
    """Every arm's stats over `repeats` repeats in a row (_run_repeat)."""
    runs = {name: [] for name in runners}
    for repeat in range(repeats):
        _run_repeat(runners, runs, make_prompts, batch_size, repeat, max_tokens, seed)
    return runs


def _run_repeat(runners: dict, runs: dict[str, list[dict]], make_prompts, batch_size: int, repeat: int,
                max_tokens: int, seed: int) -> None:
    """One repeat of the arms in `runs` (appending each one's stats there), their order rotated by the repeat: the
    prompts of seed + 1000 x batch_size + repeat at sampling seed + repeat, the same for every arm."""
    prompts = make_prompts(batch_size, seed=seed + 1000 * batch_size + repeat)
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed + repeat)
    names = list(runs)
    for name in names[repeat % len(names):] + names[:repeat % len(names)]:
        runs[name].append(runners[name](prompts, params))


def _engine_arm(generator: RolloutGenerator):
    return lambda prompts, params: generator.generate(prompts, 1, params, use_tqdm=False).stats


def _hf_arm(model, tokenizer):
    """The same rollout through HF `model.generate` (padded batch, KV cache, multinomial sampling)."""

    @torch.inference_mode()
    def run(prompts, params: SamplingParams) -> dict:
        inputs = tokenizer(prompts, return_tensors="pt", padding=True)
        torch.manual_seed(params.seed)
        start = time.perf_counter()
        out = model.generate(**inputs, do_sample=True, temperature=params.temperature, top_k=0,
                             max_new_tokens=params.max_tokens, pad_token_id=tokenizer.pad_token_id)
        elapsed = time.perf_counter() - start
        completions = out[:, inputs["input_ids"].shape[1]:].tolist()
        return {"num_completion_tokens": sum(_length_to_eos(c, tokenizer.eos_token_id) for c in completions),
                "elapsed_s": elapsed}
    return run


def _summarise(stats: list[dict]) -> dict:
    summary = {"tokens_per_s": sum(s["num_completion_tokens"] for s in stats) / sum(s["elapsed_s"] for s in stats),
               "repeats": [[s["num_completion_tokens"], s["elapsed_s"]] for s in stats]}  # in repeat order
    if "num_drafted_per_position" in stats[0]:
        summary.update({
            "verified_tokens_per_emitted_token": statistics.mean(s["verified_tokens_per_emitted_token"] for s in stats),
            "mean_acceptance_length": statistics.mean(s["mean_acceptance_length"] for s in stats),
            "num_drafted_per_position": _column_sums(s["num_drafted_per_position"] for s in stats),
            "num_accepted_per_position": _column_sums(s["num_accepted_per_position"] for s in stats)})
    return summary


def _column_sums(rows) -> list[int]:
    return [sum(column) for column in zip(*rows)]


def pooled_acceptance(results: dict, arm: str) -> list[float]:
    """Acceptance rate per draft position of one arm, pooled over every batch size."""
    drafted = _column_sums(r[arm]["num_drafted_per_position"] for r in results.values())
    accepted = _column_sums(r[arm]["num_accepted_per_position"] for r in results.values())
    return [a / d for a, d in zip(accepted, drafted) if d]


def best_other_arm(arms_result: dict) -> str:
    """The fastest arm other than the adaptive ones and HF generate (tokens/s over all repeats)."""
    others = [name for name in arms_result if name not in (*ADAPTIVE_ARMS, "hf_generate")]
    return max(others, key=lambda name: arms_result[name]["tokens_per_s"])


def verdicts(arms_result: dict, confirmed: dict) -> dict:
    """The issue's targets at one batch size: the adaptive arms over the best other arm (as the first stage measured
    it, and confirmed on fresh repeats) and over the schedule; verified tokens per emitted token per arm."""
    tps = {name: r["tokens_per_s"] for name, r in arms_result.items() if name != "hf_generate"}
    best_static = max((n for n in tps if n.startswith("K=")), key=tps.get)
    best_other = best_other_arm(arms_result)
    verified = {n: r.get("verified_tokens_per_emitted_token") for n, r in arms_result.items()}
    return {"best_static_k": best_static, "best_other_arm": best_other,
            **{f"{arm}_over_best_other": tps[arm] / tps[best_other] for arm in ADAPTIVE_ARMS},
            **{f"{arm}_over_best_other_confirmed": confirmed[arm]["paired_ratio"] for arm in ADAPTIVE_ARMS},
            **{f"{arm}_over_schedule": tps[arm] / tps["schedule"] for arm in ADAPTIVE_ARMS},
            **{f"{arm}_over_schedule_paired": paired_ratio(arms_result, arm, "schedule") for arm in ADAPTIVE_ARMS},
            "best_static_over_no_spec": tps[best_static] / tps["no_spec"],
            "verified_per_emitted": {n: v for n, v in verified.items() if v is not None}}


def paired_ratio(arms_result: dict, arm: str, other: str) -> float:
    """The median over repeats of arm's tokens/s over other's on the same repeat. The arms roll out the same
    completions, so each repeat is a paired comparison made seconds apart; a slow spell of the machine that spans
    both runs cancels, and one that hits one of them is an outlier that the median ignores. On a noisy 2-core VM, the
    schedule and K = 8 (identical work up to 22 requests) came out 0.86-1.03 of each other as total tokens over total
    time, and 0.97-1.02 as this median (24 repeats each, the per-repeat ratios spanning 0.54-2.05)."""
    return statistics.median(_repeat_ratios(arms_result[arm], arms_result[other]))


def _repeat_ratios(arm: dict, other: dict) -> list[float]:
    return [(tokens / seconds) / (other_tokens / other_seconds)
            for (tokens, seconds), (other_tokens, other_seconds) in zip(arm["repeats"], other["repeats"])]


def confirm(arms_result: dict, best_other: str) -> dict:
    """Per adaptive arm, over best_other on the confirmation repeats: the paired ratio, its INTERVAL bootstrap
    interval (the repeats resampled 2000 times, fixed seed), and tokens/s over all repeats of both."""
    rng = random.Random(0)
    confirmed = {"best_other_arm": best_other, "repeats": len(arms_result[best_other]["repeats"])}
    for arm in ADAPTIVE_ARMS:
        ratios = _repeat_ratios(arms_result[arm], arms_result[best_other])
        medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
        tail = round((1 - INTERVAL) / 2 * len(medians))
        confirmed[arm] = {"paired_ratio": statistics.median(ratios), "interval": [medians[tail], medians[-1 - tail]],
                          "total_ratio": arms_result[arm]["tokens_per_s"] / arms_result[best_other]["tokens_per_s"]}
    return confirmed


def _row(batch_size: int, arms_result: dict) -> str:
    base = arms_result["no_spec"]["tokens_per_s"]
    cells = "  ".join(f"{n} {r['tokens_per_s'] / base:4.2f}x" for n, r in arms_result.items() if n != "no_spec")
    return f"B={batch_size:3d}  no_spec {base:7.1f} tok/s  {cells}"


def _length_to_eos(ids: list[int], eos: int) -> int:
    return ids.index(eos) + 1 if eos in ids else len(ids)


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(results), 2, figsize=(13, 4.5 * len(results)), squeeze=False)
    for (workload, by_batch), (ax_ratio, ax_verified) in zip(results.items(), axes):
        batch_sizes = sorted(by_batch)
        for name in by_batch[batch_sizes[0]]["arms"]:
            if name == "no_spec":
                continue
            arms_at = [by_batch[b]["arms"] for b in batch_sizes]
            ratio = [a[name]["tokens_per_s"] / a["no_spec"]["tokens_per_s"] for a in arms_at]
            style = dict(marker="o", linewidth=2.5 if name in OWN_ARMS else 1.0,
                         linestyle="--" if name == "hf_generate" else "-")
            ax_ratio.plot(batch_sizes, ratio, label=name, **style)
            if name != "hf_generate":
                ax_verified.plot(batch_sizes, [a[name]["verified_tokens_per_emitted_token"] for a in arms_at],
                                 label=name, **style)
        ax_ratio.axhline(1.0, color="gray", linestyle=":")
        for ax, title in ((ax_ratio, "speedup over no speculation"), (ax_verified, "verified / emitted tokens")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size")
            ax.set_title(f"{workload} workload: {title}")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--workloads", default="default,mixed")
    parser.add_argument("--repeats", type=int, default=24)
    parser.add_argument("--min-repeats", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="per completion; the K = 8 arm must draft at all 8 positions, so at least about 16")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed batches per arm at each batch size before the timed ones")
    parser.add_argument("--confirm-repeats", type=int, default=32,
                        help="fresh repeats of the adaptive arms and the best other arm at each batch size "
                             "from 64 requests (4x up to 16, 2x at 32)")
    parser.add_argument("--output-dir", default="examples/results")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's); 1 keeps a shared machine's other jobs from stalling "
                             "OpenMP's spinning threads")
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    # Every arm runs the same in-memory target (and draft) weights, so no arm pays for another's cache misses.
    target, draft = load("target"), load("draft")
    tokenizer = AutoTokenizer.from_pretrained(default_model_paths()["target"], padding_side="left")
    results = {}
    for workload in args.workloads.split(","):
        # A new training run per workload: adaptive arms start afresh
        generators = {name: RolloutGenerator(target, tokenizer=tokenizer, draft_model=draft if config else None,
                                             speculative_config=config, max_num_seqs=max(batch_sizes))
                          for name, config in arms().items()}
        prompt_ids = [tokenizer(p)["input_ids"] for p in WORKLOADS[workload](16, seed=30_000)]
        costs = generators[f"K={MAX_K}"].measure_step_times(prompt_ids, batch_sizes, [0, *STATIC_KS])  # whole steps
        runners = {name: _engine_arm(g) for name, g in generators.items()}
        if workload == "default":
            runners["hf_generate"] = _hf_arm(target, tokenizer)
        by_batch = run_workload(workload, runners, batch_sizes, args.repeats, args.min_repeats, args.max_tokens,
                                args.warmup, args.confirm_repeats)
        acceptance = pooled_acceptance({b: r["arms"] for b, r in by_batch.items()}, f"K={MAX_K}")
        results[workload] = {b: {**r, "verdicts": verdicts(r["arms"], r["confirmed"]),
                                 "predicted_speedup": {f"K={k}": predicted_speedup(acceptance, costs, b, k)
                                                       for k in STATIC_KS}} for b, r in by_batch.items()}
        results[workload]["acceptance_rate_per_position"] = acceptance
        results[workload]["step_seconds"] = costs.seconds  # by batch size and K
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_speculation.json").write_text(json.dumps({"schedule": DEFAULT_SCHEDULE,
                                                             "threads": torch.get_num_threads(),
                                                             "workloads": results}, indent=1))
    plot({w: {b: r for b, r in by.items() if isinstance(b, int)} for w, by in results.items()},
         out / "bench_speculation.png")
    for workload, by_batch in results.items():
        for b in batch_sizes:
            v, c = by_batch[b]["verdicts"], by_batch[b]["confirmed"]
            confirmed = "  ".join(f"{arm} {c[arm]['paired_ratio']:.3f} [{c[arm]['interval'][0]:.3f}, "
                                  f"{c[arm]['interval'][1]:.3f}]" for arm in ADAPTIVE_ARMS)
            print(f"[{workload}] B={b:3d} best other {v['best_other_arm']:>9}  over it, confirmed on {c['repeats']} "
                  f"repeats (paired, {INTERVAL:.0%} interval): {confirmed}  schedule+adaptive/schedule paired "
                  f"{v['schedule_adaptive_over_schedule_paired']:.2f}")
    print(f"wrote {out / 'bench_speculation.json'} and {out / 'bench_speculation.png'}")


if __name__ == "__main__":
    main()
