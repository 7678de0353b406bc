"""Rollout history across processes and servers: `examples/grpo_arithmetic.py` over a small fixed problem set for
several epochs, one arm per engine layout, side by side in one run; per epoch, the mean acceptance length and the
rollout's tokens/s (from the trainer's logs).

    python examples/bench_sharing.py [--arms a,b,...] [--seeds 0,1,...] [--epochs 3] [--num-problems 16]

Arms (`ARMS`, one line each; `--arms` picks): the embedded engine on 1 process, and on 2 (`accelerate launch`, CPU)
with the history shared (the default) and not shared (`*_own`), with the default config (`default`) and static
`history` K = 8 (`hist8`); the same with `backend="vllm"` in each process (`vllm_*`, run with --vllm-python), with
vLLM's own suffix decoding (each process its engine, its own suffix cache) and without speculation on 2 processes;
and 2 trainer processes on `rollout serve` servers (`server1_*`: one server, `server2_*`: two, prompts routed by
hash), started here with a key and stopped after their arm (a fresh history each). Every arm trains from the
shipped target with the same seed; the no-speculation arms give the tokens/s the others are read against.

Each arm's policy follows its own samples (vLLM's draws differ with the drafts), and an epoch's rollout time is set by
its longest completions, so one run's tokens/s moves by 10-15% from seed to seed: `--seeds` runs every arm once per
seed (seeds outermost, so that each seed's arms run side by side) and reports each epoch's figures as the mean over
the seeds, each seed's beside them.

Writes bench_sharing.json (every arm's per-epoch figures and the ratios the README quotes) and bench_sharing.png to
--output-dir, and prints a table. On the 2-core CPU here a run takes about 45 minutes.
"""

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HIST8 = json.dumps({"method": "history", "num_speculative_tokens": 8})
SUFFIX = json.dumps({"method": "suffix", "num_speculative_tokens": 4})
# arm -> (backend, trainer processes, --speculative-config or None for the backend's default, shared, servers)
ARMS = {
    "default_1p": ("embedded", 1, None, True, 0),
    "default_2p": ("embedded", 2, None, True, 0),
    "default_2p_own": ("embedded", 2, None, False, 0),
    "hist8_1p": ("embedded", 1, HIST8, True, 0),
    "hist8_2p": ("embedded", 2, HIST8, True, 0),
    "hist8_2p_own": ("embedded", 2, HIST8, False, 0),
    "vllm_default_1p": ("vllm", 1, None, True, 0),
    "vllm_default_2p": ("vllm", 2, None, True, 0),
    "vllm_default_2p_own": ("vllm", 2, None, False, 0),
    "vllm_hist8_1p": ("vllm", 1, HIST8, True, 0),
    "vllm_hist8_2p": ("vllm", 2, HIST8, True, 0),
    "vllm_suffix_2p": ("vllm", 2, SUFFIX, True, 0),
    "vllm_no_spec_2p": ("vllm", 2, "none", True, 0),
    "server1_default_2p": ("server", 2, None, True, 1),
    "server2_default_2p": ("server", 2, None, True, 2),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--seeds", default="0", help="comma-separated; every arm runs once per seed")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--num-problems", type=int, default=16)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=320)
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: the processes run on the CPU (ACCELERATE_USE_CPU, one OpenMP thread each); cuda: one GPU "
                        "a process")
    p.add_argument("--output-dir", default=str(ROOT / "examples" / "results"))
    return p.parse_args(argv)


def run_arm(name: str, args, work: Path, seed: int = 0) -> dict:
    backend, num_processes, config, shared, num_servers = ARMS[name]
    python = sys.executable if backend == "embedded" else args.vllm_python
    command = [*launcher(python, num_processes), str(ROOT / "examples" / "grpo_arithmetic.py"),
               "--backend", backend, "--num-problems", str(args.num_problems),
               "--prompts-per-step", str(args.prompts_per_step), "--num-generations", str(args.num_generations),
               "--max-steps", str(args.epochs * args.num_problems // args.prompts_per_step),
               "--max-completion-length", str(args.max_completion_length), "--num-eval-problems", "0",
               "--num-held-out", "0", "--seed", str(seed), "--output-dir", str(work / name)]
    command += [] if config is None or backend == "server" else ["--speculative-config", config]
    command += [] if shared else ["--no-share-history"]
    key = secrets.token_urlsafe(16)
    env = {**os.environ, "VLLM_API_KEY": key, "PYTHONPATH": str(ROOT),
           **({"ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"} if args.device == "cpu" else {})}
    servers = [start_server(python, config, env, work / f"{name}_server{i}.log") for i in range(num_servers)]
    try:
        if servers:
            command += ["--base-url", ",".join(url for url, _ in servers)]
        start = time.perf_counter()
        with open(work / f"{name}.log", "w") as log:
            subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, check=True, cwd=ROOT)
        wall = time.perf_counter() - start
    finally:
        for _, process in servers:
            process.terminate()
            process.wait(timeout=120)
    return summarise(json.loads((work / name / "run.json").read_text()), args, wall)


def launcher(python: str, num_processes: int) -> list[str]:
    if num_processes == 1:
        return [python]
    return [python, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(num_processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]


def start_server(python: str, config: str | None, env: dict, log_path: Path) -> tuple[str, subprocess.Popen]:
    """`python -m rollout serve --model default` (its default config unless `config`) on a free port; (URL, process)
    once /health answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [python, "-m", "rollout", "serve", "--model", "default", "--port", str(port), "--max-num-seqs", "64",
               "--max-model-len", "512", *([] if config is None else ["--speculative-config", config])]
    process = subprocess.Popen(command, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return url, process
        except OSError:
            time.sleep(1)
    process.terminate()
    raise RuntimeError(f"the server was not up after 10 minutes: {log_path}")


def summarise(run: dict, args, wall: float) -> dict:
    """Per epoch: mean acceptance length, tokens/s (completion tokens over the rollouts' wall time, the slowest
    process's), the history's hit rate, and the sharing's share of the rollout time."""
    history, steps = run["history"], args.num_problems // args.prompts_per_step
    epochs = []
    for first in range(0, len(history), steps):
        logs = history[first:first + steps]
        rollout_s = sum(e["spec/rollout_s"] for e in logs)
        epochs.append({"mean_acceptance_length": run["epoch_mean_acceptance_length"][first // steps],
                       "tokens_per_s": sum(e["spec/num_completion_tokens"] for e in logs) / rollout_s,
                       "history_hit_rate": _mean(logs, "spec/history_hit_rate"),
                       "share_fraction": sum(e.get("spec/history_share_s", 0.0) for e in logs) / rollout_s,
                       "server_load_imbalance": _mean(logs, "spec/server_load_imbalance"),
                       "mean_reward": _mean(logs, "reward")})
    return {"epochs": epochs, "wall_s": wall}


def combine(runs: dict[int, dict]) -> dict:
    """An arm over its seeds: each epoch's figures the mean over the seeds (None where no seed has one), each seed's
    run kept under "seeds"."""
    epochs = []
    for per_seed in zip(*(run["epochs"] for run in runs.values())):
        fields = {}
        for field in per_seed[0]:
            values = [e[field] for e in per_seed if e[field] is not None]
            fields[field] = sum(values) / len(values) if values else None
        epochs.append(fields)
    return {"epochs": epochs, "wall_s": sum(run["wall_s"] for run in runs.values()), "seeds": runs}


def _mean(logs: list[dict], key: str) -> float | None:
    values = [e[key] for e in logs if key in e]
    return sum(values) / len(values) if values else None


def ratios(results: dict) -> dict:
    """The figures the README quotes: epochs 2-3 mean acceptance length of each 2-process (or server) arm over its
    1-process (or 1-server) arm, and vLLM's default over vLLM's suffix decoding, each over vLLM without speculation
    (over the seeds' means, and per seed)."""
    pairs = {f"{p}_2p / {p}_1p": (f"{p}_2p", f"{p}_1p") for p in ("default", "hist8", "vllm_default", "vllm_hist8")}
    pairs["server2 / server1"] = ("server2_default_2p", "server1_default_2p")
    out = {f"mean_acceptance_length {label}": _late(results[a], "mean_acceptance_length")
           / _late(results[b], "mean_acceptance_length") for label, (a, b) in pairs.items()
           if a in results and b in results}
    bar = ("vllm_default_2p", "vllm_suffix_2p", "vllm_no_spec_2p")
    if set(bar) <= set(results):
        default, suffix, plain = (results[a] for a in bar)
        speedup = {a: _late(results[a], "tokens_per_s") / _late(plain, "tokens_per_s") for a in bar[:2]}
        out.update({f"tokens_per_s {a} / vllm_no_spec_2p": v for a, v in speedup.items()})
        out["vllm_default_2p / vllm_suffix_2p (each over no spec)"] = speedup[bar[0]] / speedup[bar[1]]
        out["vllm_default_2p / vllm_suffix_2p, per seed"] = {
            seed: _late(default["seeds"][seed], "tokens_per_s") / _late(suffix["seeds"][seed], "tokens_per_s")
            for seed in default["seeds"] if seed in suffix["seeds"]}
    return out


def _late(result: dict, field: str) -> float:
    """The field's mean over epochs 2 on."""
    epochs = result["epochs"][1:]
    return sum(e[field] for e in epochs) / len(epochs)


def table(results: dict) -> str:
    lines = [f"{'arm':<22} " + "  ".join(f"epoch {i}: MAL  tok/s  hit" for i in (1, 2, 3))]
    for arm, result in results.items():
        cells = [f"{e['mean_acceptance_length']:.2f} {e['tokens_per_s']:6.0f} {e['history_hit_rate'] or 0:.2f}"
                 for e in result["epochs"]]
        lines.append(f"{arm:<22} " + "     ".join(cells))
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for arm, result in results.items():
        ax.plot(range(1, len(result["epochs"]) + 1), [e["mean_acceptance_length"] for e in result["epochs"]],
                marker="o", label=arm, linestyle="--" if arm.endswith("_own") else "-")
    ax.set_xlabel("epoch")
    ax.set_ylabel("mean acceptance length")
    ax.set_title("rollout history shared across processes and servers")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    args = parse_args(argv)
    names = [a for a in args.arms.split(",") if a]
    unknown = [a for a in names if a not in ARMS]
    if unknown:
        raise ValueError(f"--arms: {unknown} unknown; choose from {list(ARMS)}")
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_sharing_"))
    seeds = [int(seed) for seed in args.seeds.split(",") if seed]
    runs = {name: {} for name in names}
    for seed in seeds:
        (work / f"seed{seed}").mkdir()
        for name in names:
            print(f"running {name}, seed {seed} (logs: {work})", flush=True)
            runs[name][seed] = run_arm(name, args, work / f"seed{seed}", seed)
            print(f"  {name}: " + "  ".join(f"{e['mean_acceptance_length']:.2f}"
                                         for e in runs[name][seed]["epochs"]), flush=True)
    results = {name: combine(runs[name]) for name in names}
    out = {"settings": vars(args), "arms": {n: ARMS[n] for n in names}, "results": results, "ratios": ratios(results)}
    (output_dir / "bench_sharing.json").write_text(json.dumps(out, indent=1))
    plot(results, output_dir / "bench_sharing.png")
    print(table(results))
    print(json.dumps(out["ratios"], indent=1))
    return out


if __name__ == "__main__":
    main()
