"""Drift benchmark: how far each static K's speed over no speculation moves from one window of minutes to the next
on this machine, against what the noise within a window accounts for.

    python examples/bench_drift.py [--batch-size 128] [--ks 1,2,4] [--windows 8] [--repeats 8] [--output-dir DIR]

A window is `--repeats` interleaved repeats of no speculation and each static K at one batch size (the speculation
benchmark's repeats: the same prompts, seed and completions for every arm, the arm order rotated every repeat). Per
window and K, the mean over repeats of log(K's tokens/s over no speculation's on the same repeat), reported as a
ratio; its standard error, from that window's repeats; and across windows, the standard deviation of those means.
Were the machine's relative costs steady, the windows' means would spread by their standard errors alone (`noise`);
what they spread beyond that (`drift`: the square root of the difference of the two variances, 0 where it is
negative) is the machine changing which K is fastest. Adaptive verification chooses K from a cost model measured
and refined on this machine (spec/step_cost.py, spec/closed_batch.py), and the speculation benchmark's target compares
it with the best other arm in hindsight: where the Ks differ by less than the drift, whichever K is chosen, another
leads in some windows.
Writes bench_drift.json and bench_drift.png (default folder: examples/results).
"""

import argparse
import json
import math
import statistics
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench_speculation import WORKLOADS, _engine_arm, _interleaved, _repeat_ratios, _summarise, arms, load
from rollout import RolloutGenerator, default_model_paths


def window_stats(runs: dict[str, list[dict]], ks: list[int]) -> dict[str, dict]:
    """Per K: the window's mean log ratio over no speculation (as a ratio) and its standard error (in log units)."""
    stats, base = {}, _summarise(runs["no_spec"])
    for k in ks:
        logs = [math.log(ratio) for ratio in _repeat_ratios(_summarise(runs[f"K={k}"]), base)]
        stats[f"K={k}"] = {"ratio": math.exp(statistics.mean(logs)),
                           "stderr": statistics.stdev(logs) / math.sqrt(len(logs))}
    return stats


def drift(windows: list[dict], arm: str) -> dict:
    """Across windows: the mean ratio; the spread of the windows' mean log ratios, the part of it their standard errors
    explain, and the rest (module docstring), each in log units (about the relative change); and in how many windows
    the arm was the fastest K."""
    means = [math.log(w[arm]["ratio"]) for w in windows]
    spread = statistics.stdev(means)
    noise = math.sqrt(statistics.mean(w[arm]["stderr"] ** 2 for w in windows))
    return {"ratio": math.exp(statistics.mean(means)), "spread": spread, "noise": noise,
            "drift": math.sqrt(max(spread ** 2 - noise ** 2, 0.0)),
            "fastest_in": sum(max(w, key=lambda a: w[a]["ratio"]) == arm for w in windows)}


def plot(windows: list[dict], batch_size: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for arm in windows[0]:
        ratios = [w[arm]["ratio"] for w in windows]
        errors = [r * w[arm]["stderr"] for r, w in zip(ratios, windows)]
        ax.errorbar(range(1, len(windows) + 1), ratios, yerr=errors, marker="o", capsize=3, label=arm)
    ax.axhline(1.0, color="gray", linestyle=":")
    ax.set_xlabel("window")
    ax.set_ylabel("tokens/s over no speculation (paired)")
    ax.set_title(f"static K over no speculation, window by window, {batch_size} requests (bars: 1 standard error)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--ks", default="1,2,4")
    parser.add_argument("--workload", default="default", choices=sorted(WORKLOADS))
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=8, help="interleaved repeats of every arm per window")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output-dir", default="examples/results")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    if args.repeats < 2 or args.windows < 2:
        parser.error(f"--repeats {args.repeats} and --windows {args.windows}: each must be at least 2 (a standard "
                     "error needs 2 repeats, a spread 2 windows)")
    torch.manual_seed(0)
    target, draft = load("target"), load("draft")
    tokenizer = AutoTokenizer.from_pretrained(default_model_paths()["target"], padding_side="left")
    configs = {"no_spec": None, **{f"K={k}": {**arms()["K=1"], "num_speculative_tokens": k} for k in ks}}
    runners = {name: _engine_arm(RolloutGenerator(target, tokenizer=tokenizer, draft_model=draft,
                                                  speculative_config=config, max_num_seqs=args.batch_size))
               for name, config in configs.items()}
    make_prompts = WORKLOADS[args.workload]
    _interleaved(runners, make_prompts, args.batch_size, 1, args.max_tokens, seed=10_000)  # untimed warm-up
    windows = []
    for window in range(args.windows):
        runs = _interleaved(runners, make_prompts, args.batch_size, args.repeats, args.max_tokens,
                            seed=100_000 * (window + 1))
        windows.append(window_stats(runs, ks))
        print(f"window {window + 1}: " + "  ".join(f"{arm} {s['ratio']:.3f} (+-{s['stderr']:.3f})"
                                                    for arm, s in windows[-1].items()), flush=True)
    summary = {arm: drift(windows, arm) for arm in windows[0]}
    for arm, d in summary.items():
        print(f"{arm}: {d['ratio']:.3f} over all windows; windows spread {d['spread']:.3f}, noise {d['noise']:.3f}, "
              f"drift {d['drift']:.3f}; fastest in {d['fastest_in']} of {len(windows)} windows")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_drift.json").write_text(json.dumps({
        "batch_size": args.batch_size, "workload": args.workload, "repeats_per_window": args.repeats,
        "threads": torch.get_num_threads(), "windows": windows, "summary": summary}, indent=1))
    plot(windows, args.batch_size, out / "bench_drift.png")
    print(f"wrote {out / 'bench_drift.json'} and {out / 'bench_drift.png'}")


if __name__ == "__main__":
    main()
