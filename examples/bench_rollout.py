"""GRPO-step benchmark: the whole generation phase of one GRPO step, until its last sample, on the long-tailed default
task, for every way this project (and TRL, and vLLM) can generate it.

    python examples/bench_rollout.py [--shapes 8x8,32x8,64x8] [--repeats 3] [--arms ...] [--output-dir DIR]
    python examples/bench_rollout.py --shapes 2x2 --repeats 1 --arms no_spec,k4,trl_generate \\
        --max-completion-length 32 --threads 1 --greedy-check 2 --output-dir /tmp/bench_rollout   # a smoke run

Arms (`--arms`, default all): TRL's own generation (`trl_generate`: GRPOTrainer with use_vllm=False); vLLM's CPU build
through backend="vllm" with no speculation, the draft model at static K = --vllm-k and with the default schedule,
its own suffix decoding at that K, the project's history drafter through its custom_class hook at that K, and
`rollout.default_speculative_config("vllm")` (`vllm_no_spec`, `vllm_k4`, `vllm_schedule`, `vllm_suffix_k4`,
`vllm_history_k4`, `vllm_default`; run with --vllm-python, skipped where that interpreter, or for suffix decoding
Arctic Inference, is missing); the embedded engine with no
speculation, static K in {1, 2, 4, 8}, the default schedule, the schedule `python -m rollout tune` derives for this
task on this machine (`tuned`, run first unless --tuned-config is given), adaptive verification, and schedule +
adaptive. A shape PxG is P prompts each generated G times: the rows one process generates in one GRPO step.

Every arm is timed through `GRPOTrainer._generate` on the same prompts with the same sampling settings (temperature
1) and weights; each arm serves from its own process (examples/bench_rollout_worker.py; the embedded arms share one),
so one arm's threads and memory never skew another's, and the arms take turns: every repeat draws new prompts (the
same for every arm) and rotates the arm order. Adaptive arms first roll out --warmup untimed batches of each shape
(their calibration and step costs learn from them, as from a training run's repeated steps).

The bound: from the embedded arms' own steps, the measured seconds of a step at each batch size and K (static arms,
batch sizes bucketed by powers of two) and the measured acceptance per draft position, a step at batch size B with K
drafts emits (1 + r_0 + .. + r_{K-1}) tokens per row for its cost c(B, K). Over the no-speculation arm's drain (its
steps' batch sizes), the best K at each batch size gives the bound over no speculation: sum of c(B_t, 0) over sum of
min_K c(B_t, K) / (1 + r_0 + .. + r_{K-1}); each arm's own bound takes its own K per batch size instead.

Writes bench_rollout.json and bench_rollout.png (tokens/s per arm and shape; the running batch size and K over one
64x8 step) to --output-dir.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import bench_rollout_report as report
from bench_rollout_worker import STATIC_KS, vllm_config
from rollout import default_model_paths
from rollout.vllm_backend.engine_args import drafter_folder, kv_cache_bytes

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ("no_spec", *(f"k{k}" for k in STATIC_KS), "schedule", "tuned", "adaptive", "schedule_adaptive")
VLLM = ("vllm_no_spec", "vllm_k{k}", "vllm_schedule", "vllm_suffix_k{k}", "vllm_history_k{k}", "vllm_default")
ADAPTIVE = ("adaptive", "schedule_adaptive", "vllm_default")
VLLM_PROCESS_BYTES = 2**30  # a vLLM CPU arm's memory besides its KV cache (0.9 GiB measured with the default pair)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shapes", default="8x8,32x8,64x8", help="PROMPTSxGENERATIONS per process, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of the largest shape; a shape of R rows "
                   "gets max(repeats, repeats x the largest shape's rows / R / 2)")
    p.add_argument("--warmup", type=int, default=3, help="untimed batches per shape for the adaptive arms")
    p.add_argument("--arms", default=",".join(("trl_generate", *VLLM, *EMBEDDED)))
    p.add_argument("--vllm-k", type=int, default=4, help="K of the vLLM static arms")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--tuned-config", default=None, help="a `rollout tune` JSON; default: tuned here first")
    p.add_argument("--max-completion-length", type=int, default=320)
    p.add_argument("--threads", type=int, default=2, help="torch threads of every arm")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--greedy-check", type=int, default=16, help="prompts whose greedy completions each embedded arm "
                   "must reproduce token for token from HF generate (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default=str(ROOT / "examples" / "results"))
    return p.parse_args(argv)


class Worker:
    """An arm process: one JSON line per request and per reply (stdin / stdout); its stderr goes to `log`. Its first
    line reports {"startup_s"}. examples/bench_epochs.py runs its vLLM arms through it too."""

    def __init__(self, name: str, command: list[str], env: dict, log: Path):
        self.name = name
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                        stderr=log.open("w"))
        self.startup = self._read()["startup_s"]

    def ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read()

    def _read(self) -> dict:
        """The next JSON line; other lines (vLLM logs to stdout) are skipped."""
        while True:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"an arm process ({self.name}) died; its log is in the output folder")
            if line.startswith("{"):
                return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def available_arms(arms: list[str], vllm_python: str) -> list[str]:
    """arms without the vLLM ones that cannot run, each with a message: all of them without the vLLM interpreter,
    vLLM's suffix decoding (`vllm_suffix*`) where that vLLM has none (before 0.34 it needs arctic_inference)."""
    if any(a.startswith("vllm_") for a in arms) and not Path(vllm_python).exists():
        print(f"no vLLM interpreter at {vllm_python}: the vLLM arms are skipped", flush=True)
        return [a for a in arms if not a.startswith("vllm_")]
    suffix = [a for a in arms if a.startswith("vllm_suffix")]
    check = "from rollout.vllm_backend.plugin import has_suffix_decoding; raise SystemExit(not has_suffix_decoding())"
    if suffix and subprocess.run([vllm_python, "-c", check], capture_output=True, cwd=ROOT).returncode:
        print(f"{vllm_python}'s vLLM has no suffix decoding (before vLLM 0.34 it needs arctic_inference): {suffix} "
              "skipped", flush=True)
        return [a for a in arms if a not in suffix]
    return arms


def check_kv_memory(vllm_configs: dict, rows: int, max_model_len: int) -> None:
    """ValueError before any vLLM arm starts when their processes (each a KV cache sized for `rows` requests of
    max_model_len tokens, as the backend sizes it, and VLLM_PROCESS_BYTES) exceed the memory available now: the arms
    run side by side, and the last to start would die in vLLM's start-up."""
    target = default_model_paths()["target"]
    need = {a: VLLM_PROCESS_BYTES + kv_cache_bytes(target, drafter_folder(c), rows, max_model_len, torch.float32)
            for a, c in vllm_configs.items()}
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    if sum(need.values()) > available:
        gib = {a: round(n / 2**30, 1) for a, n in need.items()}
        raise ValueError(f"--arms: the vLLM arms at {rows} rows need {sum(gib.values()):.1f} GiB "
                         f"({gib}), {available / 2**30:.1f} GiB is available; run fewer vLLM arms per run (each "
                         "ratio is over the same run's no_spec, so runs with vllm_no_spec in each compare)")


def worker_command(arms: list[str], python: str, args) -> list[str]:
    """bench_rollout_worker.py serving `arms`."""
    command = [python, str(Path(__file__).with_name("bench_rollout_worker.py")), "--arms", ",".join(arms),
               "--max-rows", str(max_rows(args.shapes)), "--max-completion-length", str(args.max_completion_length),
               "--max-model-len", str(64 + args.max_completion_length), "--device", args.device,
               "--dtype", args.dtype, "--seed", str(args.seed)]
    if args.tuned_config and "tuned" in arms:
        command += ["--tuned-config", args.tuned_config]
    return command


def shapes(spec: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in shape.split("x")) for shape in spec.split(",")]


def max_rows(spec: str) -> int:
    """The rows of the largest shape in `spec`."""
    return max(p * g for p, g in shapes(spec))


def tune(args, output_dir: Path) -> str:
    """The schedule `python -m rollout tune` derives for the default pair at the largest shape's batch sizes."""
    path = output_dir / "bench_rollout_tuned_config.json"
    subprocess.run([sys.executable, "-m", "rollout", "tune", "--max-num-seqs", str(max_rows(args.shapes)),
                    "--max-k", "8", "--max-tokens", str(args.max_completion_length), "--output", str(path),
                    "--no-progress"],
                   check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    return str(path)


def start_workers(arms: list[str], args, output_dir: Path) -> dict[str, Worker]:
    """One process for the embedded arms, one for each other arm."""
    groups = [[a for a in arms if a in EMBEDDED]] + [[a] for a in arms if a not in EMBEDDED]
    workers = {}
    for group in [g for g in groups if g]:
        python = args.vllm_python if group[0].startswith("vllm_") else sys.executable
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
        worker = Worker(",".join(group), worker_command(group, python, args), env,
                        output_dir / f"bench_rollout_{group[0]}.log")
        print(f"started {','.join(group)} in {worker.startup:.1f} s", flush=True)
        workers.update(dict.fromkeys(group, worker))
    return workers


def run(args, arms: list[str], workers: dict[str, Worker]) -> dict:
    runs = {shape: {arm: [] for arm in arms} for shape in args.shapes.split(",")}
    for shape in runs:
        num_prompts, num_generations = shapes(shape)[0]
        request = {"num_prompts": num_prompts, "num_generations": num_generations}
        for arm in arms:  # untimed: first-call costs; adaptive arms calibrate and refine their costs
            for warm in range(args.warmup if arm in ADAPTIVE else 1):
                workers[arm].ask({**request, "arm": arm, "prompt_seed": 10_000 + warm})
        num_repeats = max(args.repeats, args.repeats * max_rows(args.shapes) // (num_prompts * num_generations) // 2)
        for repeat in range(num_repeats):
            order = arms[repeat % len(arms):] + arms[:repeat % len(arms)]
            for arm in order:
                reply = workers[arm].ask({**request, "arm": arm, "prompt_seed": args.seed + repeat})
                runs[shape][arm].append(reply)
                print(f"{shape} repeat {repeat} {arm:<18} {reply['seconds']:7.2f} s {reply['num_tokens']:6d} tokens",
                      flush=True)
    return runs


def main(argv=None) -> dict:
    args = parse_args(argv)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    arms = [a.replace("{k}", str(args.vllm_k)) for a in args.arms.split(",") if a]
    arms = available_arms(arms, args.vllm_python)
    if args.device == "cpu":  # vLLM's CPU build keeps its KV caches in host memory
        check_kv_memory({a: vllm_config(a) for a in arms if a.startswith("vllm_")}, max_rows(args.shapes),
                        64 + args.max_completion_length)
    if "tuned" in arms and args.tuned_config is None:
        args.tuned_config = tune(args, output_dir)
    workers = start_workers(arms, args, output_dir)
    started = time.time()
    try:
        runs = run(args, arms, workers)
        greedy = workers["no_spec"].ask({"greedy_check": args.greedy_check}) if args.greedy_check and \
            "no_spec" in workers else None
    finally:
        for worker in set(workers.values()):
            worker.close()
    results = report.summarise(runs, args, greedy)
    results["wall_s"] = time.time() - started
    (output_dir / "bench_rollout.json").write_text(json.dumps(results, indent=1))
    report.plot(results, runs, output_dir / "bench_rollout.png")
    print(report.table(results))
    return results


if __name__ == "__main__":
    main()
