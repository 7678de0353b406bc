"""Drift benchmark: how far each static K's speed over no speculation moves from one window of minutes to the next
on this machine, against what the noise within a window accounts for.

    python examples/bench_drift.py [--batch-size 128] [--ks 1,2,4] [--windows 8] [--repeats 8]
                                   [--step-widths 2,3,5] [--step-windows 16] [--step-repeats 24] [--output-dir DIR]

A window is `--repeats` interleaved repeats of no speculation and each static K at one batch size (the speculation
benchmark's repeats: the same prompts, seed and completions for every arm, the arm order rotated every repeat). Per
window and K, the mean over repeats of log(K's tokens/s over no speculation's on the same repeat), reported as a
ratio; its standard error, from that window's repeats; and across windows, the standard deviation of those means.
Were the machine's relative costs steady, the windows' means would spread by their standard errors alone (`noise`);
what they spread beyond that (`drift`: the square root of the difference of the two variances, 0 where it is
negative) is the machine changing which K is fastest. Adaptive verification chooses K from a cost model measured
and refined on this machine (spec/adaptive/step_cost.py, spec/adaptive/closed_batch.py), and the speculation benchmark's target compares
it with the best other arm in hindsight: where the Ks differ by less than the drift, whichever K is chosen, another
leads in some windows.
The same question one level down, first: the verification step alone (a target forward and rejection sampling over
batch-size rows, as the start-up profile times it, spec/adaptive/cost_profile.py), each `--step-widths` tokens a row against 1,
in `--step-windows` windows of `--step-repeats` interleaved pairs. Its ratios are the slopes the step-cost model prices
K with; where they drift, a profile taken at one moment is off by that much at the next, however steady its own
timing.
Writes bench_drift.json and bench_drift.png (default folder: examples/results).
"""

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench_speculation import WORKLOADS, _engine_arm, _interleaved, _repeat_ratios, _summarise, arms, load
from rollout import RolloutGenerator, default_model_paths
from spec.adaptive.cost_profile import _CONTEXT, _verify


def window_stats(runs: dict[str, list[dict]], ks: list[int]) -> dict[str, dict]:
    """Per K: the window's mean log ratio over no speculation (as a ratio) and its standard error (in log units)."""
    stats, base = {}, _summarise(runs["no_spec"])
    for k in ks:
        logs = [math.log(ratio) for ratio in _repeat_ratios(_summarise(runs[f"K={k}"]), base)]
        stats[f"K={k}"] = mean_log(logs)
    return stats


def mean_log(logs: list[float]) -> dict:
    """A window's repeats of one log ratio: their mean, as a ratio, and its standard error (in log units)."""
    return {"ratio": math.exp(statistics.mean(logs)), "stderr": statistics.stdev(logs) / math.sqrt(len(logs))}


def step_windows(runner, rows: int, widths: list[int], windows: int, repeats: int) -> list[dict]:
    """Per window, per width w: the mean over repeats of log(seconds of a step of w tokens a row over one of 1 token a
    row) as a ratio, and its standard error; each repeat times the pair back to back, the order alternating."""
    slots = [runner.allocate() for _ in range(rows)]
    try:
        runner.forward(slots, [[3] * _CONTEXT] * rows, [0] * rows)

        def seconds(width: int) -> float:
            start = time.perf_counter()
            _verify(runner, slots, [width] * rows, _CONTEXT)
            return time.perf_counter() - start

        for width in [1, *widths]:  # warm-up
            seconds(width)
        result = []
        for _ in range(windows):
            logs = {w: [] for w in widths}
            for repeat in range(repeats):
                for w in widths:
                    if repeat % 2 == 0:
                        one, wide = seconds(1), seconds(w)
                    else:
                        wide, one = seconds(w), seconds(1)
                    logs[w].append(math.log(wide / one))
            result.append({f"{w} over 1": mean_log(xs) for w, xs in logs.items()})
        return result
    finally:
        for slot in slots:
            runner.free(slot)


def drift(windows: list[dict], arm: str) -> dict:
    """Across windows: the mean ratio; the spread of the windows' mean log ratios, the part of it their standard errors
    explain, and the rest (module docstring), each in log units (about the relative change)."""
    means = [math.log(w[arm]["ratio"]) for w in windows]
    spread = statistics.stdev(means)
    noise = math.sqrt(statistics.mean(w[arm]["stderr"] ** 2 for w in windows))
    return {"ratio": math.exp(statistics.mean(means)), "spread": spread, "noise": noise,
            "drift": math.sqrt(max(spread ** 2 - noise ** 2, 0.0))}


def fastest_in(windows: list[dict], arm: str) -> int:
    """In how many windows the arm was the fastest K."""
    return sum(max(w, key=lambda a: w[a]["ratio"]) == arm for w in windows)


def window_line(stats: dict[str, dict]) -> str:
    return "  ".join(f"{arm} {s['ratio']:.3f} (+-{s['stderr']:.3f})" for arm, s in stats.items())


def drift_line(d: dict) -> str:
    return (f"{d['ratio']:.3f} over all windows; windows spread {d['spread']:.3f}, noise {d['noise']:.3f}, "
            f"drift {d['drift']:.3f}")


def plot(steps: list[dict], windows: list[dict], batch_size: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 8))
    for ax, series, ylabel, title in (
            (top, steps, "step seconds over 1 token a row (paired)",
             f"verification steps of {batch_size} rows, window by window"),
            (bottom, windows, "tokens/s over no speculation (paired)",
             f"static K over no speculation, window by window, {batch_size} requests")):
        for arm in series[0]:
            ratios = [w[arm]["ratio"] for w in series]
            errors = [r * w[arm]["stderr"] for r, w in zip(ratios, series)]
            ax.errorbar(range(1, len(series) + 1), ratios, yerr=errors, marker="o", capsize=3, label=arm)
        if series is windows:
            ax.axhline(1.0, color="gray", linestyle=":")
        ax.set_xlabel("window")
        ax.set_ylabel(ylabel)
        ax.set_title(title + " (bars: 1 standard error)", fontsize=10)
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
    parser.add_argument("--step-widths", default="2,3,5", help="tokens a row timed against 1 in the step windows")
    parser.add_argument("--step-windows", type=int, default=16)
    parser.add_argument("--step-repeats", type=int, default=24, help="pairs per width per step window")
    parser.add_argument("--output-dir", default="examples/results")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    step_widths = [int(w) for w in args.step_widths.split(",")]
    if min(args.repeats, args.windows, args.step_repeats, args.step_windows) < 2:
        parser.error(f"--repeats {args.repeats}, --windows {args.windows}, --step-repeats {args.step_repeats} and "
                     f"--step-windows {args.step_windows}: each must be at least 2 (a standard error needs 2 repeats, "
                     "a spread 2 windows)")
    torch.manual_seed(0)
    target, draft = load("target"), load("draft")
    tokenizer = AutoTokenizer.from_pretrained(default_model_paths()["target"], padding_side="left")
    configs = {"no_spec": None, **{f"K={k}": {**arms()["K=1"], "num_speculative_tokens": k} for k in ks}}
    generators = {name: RolloutGenerator(target, tokenizer=tokenizer, draft_model=draft if config else None,
                                         speculative_config=config, max_num_seqs=args.batch_size)
                      for name, config in configs.items()}
    steps = step_windows(generators["no_spec"].backend.runner, args.batch_size, step_widths, args.step_windows,
                         args.step_repeats)
    for window, stats in enumerate(steps):
        print(f"step window {window + 1}: {window_line(stats)}", flush=True)
    runners = {name: _engine_arm(generator) for name, generator in generators.items()}
    make_prompts = WORKLOADS[args.workload]
    _interleaved(runners, make_prompts, args.batch_size, 1, args.max_tokens, seed=10_000)  # untimed warm-up
    windows = []
    for window in range(args.windows):
        runs = _interleaved(runners, make_prompts, args.batch_size, args.repeats, args.max_tokens,
                            seed=100_000 * (window + 1))
        windows.append(window_stats(runs, ks))
        print(f"window {window + 1}: {window_line(windows[-1])}", flush=True)
    step_summary = {width: drift(steps, width) for width in steps[0]}
    summary = {arm: {**drift(windows, arm), "fastest_in": fastest_in(windows, arm)} for arm in windows[0]}
    for width, d in step_summary.items():
        print(f"steps {width}: {drift_line(d)}")
    for arm, d in summary.items():
        print(f"{arm}: {drift_line(d)}; fastest in {d['fastest_in']} of {len(windows)} windows")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_drift.json").write_text(json.dumps({
        "batch_size": args.batch_size, "workload": args.workload, "repeats_per_window": args.repeats,
        "threads": torch.get_num_threads(),
        "steps": {"repeats_per_window": args.step_repeats, "windows": steps, "summary": step_summary},
        "windows": windows, "summary": summary}, indent=1))
    plot(steps, windows, args.batch_size, out / "bench_drift.png")
    print(f"wrote {out / 'bench_drift.json'} and {out / 'bench_drift.png'}")


if __name__ == "__main__":
    main()
