"""The embedded engine against vLLM's CPU build (`backend="vllm"`): tokens/s of each, with no speculation and with
the default per-batch-size schedule, on the embedded default pair (head_dim 64), same prompts, sampling and seeds.

    .venv-vllm/bin/python examples/bench_vllm.py [--batch-sizes 1,4,16,64] [--repeats 3] [--max-tokens 64]
                                                  [--threads 1]

Needs vLLM installed (README: "The vLLM backend"). Each (backend, arm) runs in its own process: vLLM's CPU worker
changes the threading of the process it runs in (torch.set_num_threads becomes a no-op), which would skew an
embedded arm sharing it. The arms take turns: each repeat starts the four processes one after another, and each
process times one call per batch size after an untimed one, so machine noise hits every arm alike; the median
over repeats is reported. Both engines get `--threads` OpenMP threads (default 1: on a shared 2-core machine, two
spinning OpenMP threads beside another busy process make a tiny matmul take 8 ms instead of 0.013 ms). vLLM runs
as its docs advise for CPU speculation (Intel OpenMP preloaded, and tcmalloc when installed). Start-up is the time
to build the generator plus its first call (vLLM's first call initialises its kernels). Writes bench_vllm.json and
bench_vllm.png (default folder: examples/results).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rollout import RolloutGenerator, SamplingParams, default_model_paths, default_prompts
from rollout.cli import DEFAULT_SCHEDULE

BACKENDS = ("embedded", "vllm")
ARMS = ("no_spec", "schedule")
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def speculative_config(arm: str) -> dict | None:
    if arm == "no_spec":
        return None
    return {"method": "draft_model", "model": default_model_paths()["draft"], "num_speculative_tokens": 8,
            "num_speculative_tokens_per_batch_size": DEFAULT_SCHEDULE}


def measure(backend: str, arm: str, batch_sizes: list[int], max_tokens: int) -> dict:
    """One (backend, arm): start-up time, then per batch size one untimed and one timed call."""
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=0)
    start = time.perf_counter()
    gen = RolloutGenerator("default", backend=backend, speculative_config=speculative_config(arm),
                           max_num_seqs=max(batch_sizes), seed=0)
    gen.generate(default_prompts(1, seed=1), sampling_params=params, use_tqdm=False)
    result = {"startup_s": time.perf_counter() - start, "torch_threads": torch.get_num_threads(), "by_batch": {}}
    for batch_size in batch_sizes:
        prompts = default_prompts(batch_size, seed=batch_size)
        gen.generate(prompts, sampling_params=params, use_tqdm=False)
        stats = gen.generate(prompts, sampling_params=params, use_tqdm=False).stats
        result["by_batch"][batch_size] = {name: stats[name] for name in (
            "tokens_per_s", "num_completion_tokens", "mean_acceptance_length", "verified_tokens_per_emitted_token")}
    return result


def vllm_env(threads: int) -> dict:
    """This process's environment with `threads` OpenMP threads and, as vLLM advises for CPU speculation, Intel's
    OpenMP (and tcmalloc when installed) preloaded."""
    preload = [str(Path(sys.prefix) / "lib" / "libiomp5.so"), TCMALLOC]
    preload = ":".join(p for p in preload if Path(p).exists())
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "LD_PRELOAD": preload}


def run_in_subprocess(backend: str, arm: str, args) -> dict:
    env = vllm_env(args.threads) if backend == "vllm" else {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, __file__, "--worker", backend, arm, "--output", out.name,
                        "--batch-sizes", args.batch_sizes, "--max-tokens", str(args.max_tokens)], env=env,
                       check=True)
        result = json.loads(Path(out.name).read_text())
    result["ld_preload"] = env.get("LD_PRELOAD", "")
    return result


def median_over_repeats(runs: list[dict]) -> dict:
    """One (backend, arm)'s repeats -> median start-up and tokens/s per batch size, with every run kept."""
    by_batch = {}
    for b in runs[0]["by_batch"]:
        cells = [run["by_batch"][b] for run in runs]
        by_batch[b] = {**cells[0], "tokens_per_s": statistics.median(c["tokens_per_s"] for c in cells),
                       "tokens_per_s_runs": [c["tokens_per_s"] for c in cells]}
    return {"startup_s": statistics.median(run["startup_s"] for run in runs),
            "startup_s_runs": [run["startup_s"] for run in runs], "torch_threads": runs[0]["torch_threads"],
            "ld_preload": runs[0]["ld_preload"], "by_batch": by_batch}


def ratios(results: dict) -> dict:
    """Per arm and batch size: embedded tokens/s over vLLM's (> 1: the embedded engine is faster)."""
    return {arm: {b: results["embedded"][arm]["by_batch"][b]["tokens_per_s"]
                  / results["vllm"][arm]["by_batch"][b]["tokens_per_s"]
                  for b in results["embedded"][arm]["by_batch"]} for arm in ARMS}


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_tps, ax_ratio) = plt.subplots(1, 2, figsize=(12, 4.5))
    for backend in BACKENDS:
        for arm in ARMS:
            by_batch = results[backend][arm]["by_batch"]
            sizes = sorted(by_batch, key=int)
            ax_tps.plot([int(b) for b in sizes], [by_batch[b]["tokens_per_s"] for b in sizes], marker="o",
                        linestyle="-" if backend == "embedded" else "--", label=f"{backend} {arm}")
    for arm, by_batch in ratios(results).items():
        sizes = sorted(by_batch, key=int)
        ax_ratio.plot([int(b) for b in sizes], [by_batch[b] for b in sizes], marker="o", label=arm)
    ax_ratio.axhline(1.0, color="gray", linestyle=":")
    ax_tps.set_yscale("log")
    save_batch_size_plot(fig, {ax_tps: "tokens/s", ax_ratio: "embedded / vLLM tokens/s"}, path)


def save_batch_size_plot(fig, titles: dict, path: Path) -> None:
    """Each axes (-> its title) over batch sizes on a log2 scale, with its legend; the figure saved to path."""
    for ax, title in titles.items():
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads of each engine")
    parser.add_argument("--output-dir", default="examples/results")
    parser.add_argument("--worker", nargs=2, metavar=("BACKEND", "ARM"), help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.worker:
        result = measure(*args.worker, batch_sizes, args.max_tokens)
        Path(args.output).write_text(json.dumps(result))
        return
    load_before = os.getloadavg()
    runs = {(backend, arm): [] for backend in BACKENDS for arm in ARMS}
    for _ in range(args.repeats):
        for backend, arm in runs:
            runs[backend, arm].append(run_in_subprocess(backend, arm, args))
    results = {backend: {arm: median_over_repeats(runs[backend, arm]) for arm in ARMS} for backend in BACKENDS}
    summary = {"settings": {"batch_sizes": batch_sizes, "repeats": args.repeats, "max_tokens": args.max_tokens,
                            "temperature": 1.0, "schedule": DEFAULT_SCHEDULE, "threads": args.threads,
                            "cpu_count": os.cpu_count(), "load_average_1m_before_after": [load_before[0],
                                                                                          os.getloadavg()[0]]},
               "results": results, "embedded_over_vllm": ratios(results)}
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_vllm.json").write_text(json.dumps(summary, indent=1))
    plot(results, out / "bench_vllm.png")
    print("batch | " + " | ".join(f"{b} {a} tok/s" for b in BACKENDS for a in ARMS) + " | embedded/vLLM no_spec, "
          "schedule")
    for b in map(str, batch_sizes):
        cells = [results[backend][arm]["by_batch"][b]["tokens_per_s"] for backend in BACKENDS for arm in ARMS]
        r = summary["embedded_over_vllm"]
        print(f"{b} | " + " | ".join(f"{c:.0f}" for c in cells) + f" | {r['no_spec'][b]:.2f}, {r['schedule'][b]:.2f}")
    print("start-up s: " + ", ".join(f"{b} {a} {results[b][a]['startup_s']:.1f}" for b in BACKENDS for a in ARMS))


if __name__ == "__main__":
    main()
