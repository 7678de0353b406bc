"""Multi-epoch GRPO benchmark: a fixed prompt set of the default task revisited for several epochs while a GRPO
policy trains on the rollouts, every arm generating every step's batch on the same policy weights; so drafters that
learn from a prompt's earlier rollouts (`history`) are measured as a training run feeds them, against older policies.

    python examples/bench_epochs.py [--shapes 8x8,64x8] [--epochs 3] [--num-prompts 64] [--arms ...]
    python examples/bench_epochs.py --shapes 2x2 --epochs 2 --num-prompts 4 --max-completion-length 32 \\
        --output-dir /tmp/bench_epochs                                            # a smoke run (a few minutes)

Arms (`--arms`, default all; a table in `embedded_arms` and bench_epochs_worker.vllm_arms, one line each): the
embedded engine with no speculation (`no_spec`, always run), the shipped draft model with the default schedule
(`draft_schedule`), the project's suffix drafter (`suffix`: live siblings and a global cache, K = 4), suffix decoding
from each prompt's earlier rollouts (`history_k4`, `history_k8`: static K, trees 12 deep), that drafter with adaptive
verification under K = 8 (`history_adaptive`) and under the history drafter's tuned schedule
(`history_schedule_adaptive`: rollout.defaults.HISTORY_SCHEDULE caps each request, the policy cuts inside), whatever
`rollout.default_speculative_config()` returns now (`default`); vLLM's CPU build without speculation
(`vllm_no_spec`), with the shipped draft model and the default schedule (`vllm_draft_schedule`), with its own suffix
decoding at K = --vllm-k (`vllm_suffix`), with the project's history drafter through vLLM's custom_class hook at that
static K (`vllm_history`) and K = 8 (`vllm_history_k8`), with adaptive verification under --vllm-k (`vllm_adaptive`)
and under HISTORY_SCHEDULE
(`vllm_schedule_adaptive`), and with `rollout.default_speculative_config("vllm")` (`vllm_default`); each in its own
process run with --vllm-python, skipped with a message where that interpreter, or for vllm_suffix Arctic Inference,
is missing.
The vLLM arms run side by side, each with a KV cache for the whole batch: at 64x8 one arm takes 4.5 GiB, and a run
whose arms do not fit in the memory available is refused before they start (split the arms over runs; each keeps
vllm_no_spec for its ratios).

A shape PxG is P prompts generated G times per optimizer step; each shape is its own training run from the shipped
target (TRL GRPOTrainer, float32, constant learning rate after --lr-warmup-steps), over --epochs passes of
--num-prompts distinct prompts (an epoch is --num-prompts / P steps). The embedded arms share one generator (one
target, one KV cache, one weight sync); each keeps its drafter's state (its rollout history) across steps. Each
step, after the weight sync (written to a safetensors file for the vLLM processes), every arm generates the step's
batch with the same seed, timed, the arm order rotating per step; before the first step every arm rolls out
--warmup untimed batches of other prompts. The embedded arms' samples are the same token for token (lossless
verification, position-keyed randomness): the trainer trains on no_spec's, and every step checks the others
against them, records the check, and stops the run when one differs. vLLM's arms draw their own samples from the
same weights; they are timed, not trained on.

Writes bench_epochs.json (settings, every step's figures per arm, and per shape and epoch: tokens/s over no_spec as
the ratio of totals and the median of the steps' ratios, mean acceptance length, target forward passes per step,
mean reward) and bench_epochs.png to --output-dir, and prints a table. Epoch 1 is the fresh-prompt figure.
"""

import argparse
import dataclasses
import json
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

import bench_epochs_report as report
from bench_epochs_worker import timed_generate, vllm_arms
from bench_rollout import ROOT, Worker, available_arms, check_kv_memory, shapes
from bench_rollout_worker import embedded_configs
from rollout import RolloutGenerator, default_model_paths, default_prompts, default_speculative_config
from rollout.defaults import HISTORY_SCHEDULE
from rollout.default_task import reward
from rollout.sampling_params import mix_seed
from trainers import WeightSync, policy_weights
from trainers.rollout_func import plan_rollout, trainer_outputs

WARMUP_SEED = 10_000  # warm-up prompts are drawn from here, far from the fixed set's seed


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shapes", default="8x8,64x8", help="PROMPTSxGENERATIONS per step, comma-separated; each shape "
                   "is its own training run")
    p.add_argument("--epochs", type=int, default=3, help="passes over the fixed prompt set")
    p.add_argument("--num-prompts", type=int, default=64, help="the fixed prompt set (distinct prompts)")
    p.add_argument("--arms", default=",".join([*embedded_arms(), *vllm_arms(0)]))
    p.add_argument("--vllm-k", type=int, default=4, help="K of vllm_suffix and vllm_history")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--max-completion-length", type=int, default=320)
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rollouts (higher: "
                   "drafts survive less often)")
    p.add_argument("--learning-rate", type=float, default=5e-5)
    p.add_argument("--lr-warmup-steps", type=int, default=3, help="linear warm-up (as grpo_arithmetic.py); the first "
                   "step trains at learning rate 0 under any warm-up, and at 64x8 over 64 prompts an epoch is one step")
    p.add_argument("--warmup", type=int, default=1, help="untimed batches per arm before the first step")
    p.add_argument("--threads", type=int, default=2, help="torch threads here and OMP threads of the vLLM processes")
    p.add_argument("--device", default="cpu", help="the embedded generator's and the trainer's device")
    p.add_argument("--dtype", default="float32", help="the embedded generator's dtype (bfloat16 on a GPU); the "
                   "trainer's policy stays float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default=str(ROOT / "examples" / "results"))
    return p.parse_args(argv)


HISTORY = {"method": "history", "suffix_decoding_max_tree_depth": 12}  # the static arms' trees: the default's
ADAPTIVE = {**HISTORY, "num_speculative_tokens": 8, "enable_adaptive_verification": True}


def embedded_arms() -> dict[str, dict | None]:
    """Embedded arm -> speculative config (None: no speculation); adding an arm is one line."""
    return {
        "no_spec": None,
        "draft_schedule": embedded_configs(None)["schedule"],  # the shipped draft, K = 8, DEFAULT_SCHEDULE
        "suffix": {"method": "suffix", "num_speculative_tokens": 4},
        "history_k4": {**HISTORY, "num_speculative_tokens": 4},
        "history_k8": {**HISTORY, "num_speculative_tokens": 8},
        "history_adaptive": ADAPTIVE,  # adaptive verification under K = 8 at every batch size
        "history_schedule_adaptive": {**ADAPTIVE, "num_speculative_tokens_per_batch_size": HISTORY_SCHEDULE},
        "default": default_speculative_config(),  # the fastest of the arms above (rollout/defaults.py)
    }


def select_arms(args) -> dict[str, dict | None]:
    """The arms --arms names, in its order, -> config: no_spec always (the trainer trains on its rollouts, and every
    ratio is over it); vLLM arms whose interpreter or Arctic Inference is missing are left out with a message."""
    table = {**embedded_arms(), **vllm_arms(args.vllm_k)}
    names = [a for a in args.arms.split(",") if a]
    unknown = [a for a in names if a not in table]
    if unknown:
        raise ValueError(f"--arms: {unknown} unknown; choose from {list(table)}")
    if "no_spec" not in names:
        print("no_spec added to the arms: the trainer trains on its rollouts and every ratio is over it", flush=True)
        names.insert(0, "no_spec")
    names = available_arms(names, args.vllm_python)
    return {name: table[name] for name in names}


def is_vllm(arm: str) -> bool:
    return arm.startswith("vllm_")


def fixed_prompts(num_prompts: int, seed: int, exclude=()) -> list[str]:
    """The first num_prompts distinct prompts of default_prompts(..., seed) not in `exclude` (the task repeats short
    problems; a repeat inside an epoch would give the history arms a revisit in epoch 1)."""
    exclude = set(exclude)
    distinct = dict.fromkeys(p for p in default_prompts(8 * num_prompts + 64, seed=seed) if p not in exclude)
    if len(distinct) < num_prompts:
        raise ValueError(f"--num-prompts={num_prompts}: the default task has too few distinct prompts; ask for fewer")
    return list(distinct)[:num_prompts]


class ShapeRun:
    """One training run at one shape: its rollout_func has every arm generate each step's batch; the results so far
    are in `result` (a run that fails keeps the steps before it)."""

    def __init__(self, shape: tuple[int, int], arms: dict, prompts: list[str], args, output_dir: Path):
        self.args, self.arms = args, list(arms)
        self.num_prompts, self.num_generations = shape
        rows, self.max_model_len = shape[0] * shape[1], 64 + args.max_completion_length
        start = time.perf_counter()
        self.generator = RolloutGenerator("default", speculative_config=None, max_num_seqs=rows,
                                          max_model_len=self.max_model_len, device=args.device,
                                          dtype=getattr(torch, args.dtype), seed=args.seed)
        self.speculations = {a: self.generator.build_speculation(c) for a, c in arms.items() if not is_vllm(a)}
        startup = {"embedded": time.perf_counter() - start}
        if args.device == "cpu":  # vLLM's CPU build keeps its KV caches in host memory
            check_kv_memory({a: c for a, c in arms.items() if is_vllm(a)}, rows, self.max_model_len)
        self.workers = {a: self._start_worker(a, rows, output_dir) for a in arms if is_vllm(a)}
        startup.update({a: w.startup for a, w in self.workers.items()})
        self.weight_sync, self.weights_dir = WeightSync(self.generator), tempfile.mkdtemp(prefix="bench_epochs_")
        self.warmup_prompts = fixed_prompts(self.num_prompts * args.warmup, args.seed + WARMUP_SEED, exclude=prompts)
        self.visits: Counter = Counter()
        self.steps: list[dict] = []
        self.result = {"startup_s": startup, "warmup_s": {}, "steps": self.steps}

    def _start_worker(self, arm: str, rows: int, output_dir: Path) -> Worker:
        command = [self.args.vllm_python, str(Path(__file__).with_name("bench_epochs_worker.py")), "--arm", arm,
                   "--vllm-k", str(self.args.vllm_k), "--max-num-seqs", str(rows),
                   "--max-model-len", str(self.max_model_len), "--seed", str(self.args.seed)]
        env = {**os.environ, "OMP_NUM_THREADS": str(self.args.threads), "PYTHONPATH": str(ROOT)}
        shape = f"{self.num_prompts}x{self.num_generations}"
        worker = Worker(arm, command, env, output_dir / f"bench_epochs_{arm}_{shape}.log")
        print(f"started {arm} in {worker.startup:.1f} s", flush=True)
        return worker

    def rollout_func(self, prompts: list[str], trainer) -> dict:
        """TRL's rollout function: sync, every arm generates the step's batch (timed, rotating order), the check;
        the trainer gets no_spec's samples."""
        rollout = plan_rollout(self.generator, prompts, trainer)
        assert all(size == self.num_generations for _, size in rollout.spans)  # one process: whole groups
        self._sync(trainer)
        if not self.steps:
            self._warm_up(rollout.params)
        step = len(self.steps)
        group_ids, texts = [rollout.rows[s] for s, _ in rollout.spans], [prompts[s] for s, _ in rollout.spans]
        params = dataclasses.replace(rollout.params, seed=mix_seed(self.args.seed, step))
        order = self.arms[step % len(self.arms):] + self.arms[:step % len(self.arms)]
        records, batches = {}, {}
        for arm in order:
            records[arm], batches[arm] = self._generate(arm, group_ids, texts, params)
        identical = {a: same_completions(b, batches["no_spec"]) for a, b in batches.items() if b and a != "no_spec"}
        self.steps.append({"step": step, "epoch": self._epoch(texts), "order": order,
                           "mean_reward": records["no_spec"]["mean_reward"], "identical_to_no_spec": identical,
                           "arms": records})
        print(report.step_line(self.steps[-1], self.num_prompts, self.num_generations), flush=True)
        differ = [a for a, same in identical.items() if not same]
        if differ:
            raise RuntimeError(f"step {step}: the completions of {differ} differ from no_spec's (same seed, same "
                               "weights): lossless verification is broken")
        return trainer_outputs(batches["no_spec"], params.max_tokens)

    def _generate(self, arm: str, group_ids: list, texts: list[str], params) -> tuple[dict, object]:
        """(record, batch) of one arm's timed call; a vLLM arm's batch stays in its process (None)."""
        if is_vllm(arm):
            request = {"prompt_ids": group_ids, "prompts": texts, "num_generations": self.num_generations,
                       "sampling": dataclasses.asdict(params)}
            return self.workers[arm].ask(request), None
        self.generator.use_speculation(self.speculations[arm])
        return timed_generate(self.generator, group_ids, texts, self.num_generations, params)

    def _sync(self, trainer) -> None:
        """The policy into the embedded generator (once per optimizer step) and, through a safetensors file, into
        every vLLM process."""
        if not self.weight_sync.maybe_sync(trainer) or not self.workers:
            return
        from safetensors.torch import save_file
        path = os.path.join(self.weights_dir, "policy.safetensors")
        policy = trainer.accelerator.unwrap_model(trainer.model)
        save_file({name: tensor.detach().cpu().contiguous() for name, tensor in policy_weights(policy)}, path)
        for worker in self.workers.values():
            worker.ask({"weights": path})

    def _warm_up(self, params) -> None:
        """--warmup untimed batches per arm (first-call allocations; adaptive policies' first decisions) on prompts
        outside the fixed set."""
        p = self.num_prompts
        for i in range(self.args.warmup):
            texts = self.warmup_prompts[i * p:(i + 1) * p]
            warm = dataclasses.replace(params, seed=mix_seed(self.args.seed, WARMUP_SEED, i))
            for arm in self.arms:
                seconds = self._generate(arm, texts, texts, warm)[0]["seconds"]  # generate takes text prompts too
                self.result["warmup_s"][arm] = self.result["warmup_s"].get(arm, 0.0) + seconds

    def _epoch(self, texts: list[str]) -> int:
        """Which visit of its prompts this step is (1 = fresh); every prompt of a step must be on the same visit."""
        self.visits.update(texts)
        visits = {self.visits[t] for t in texts}
        if len(visits) != 1:
            raise RuntimeError(f"step {len(self.steps)} mixes visits {sorted(visits)} of its prompts: the trainer's "
                               "sampler did not pass over the prompt set epoch by epoch")
        return visits.pop()

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()


def same_completions(batch, reference) -> bool:
    return [s.completion_ids for s in batch.samples] == [s.completion_ids for s in reference.samples]


def train(run: ShapeRun, prompts: list[str], args) -> None:
    """GRPO from the shipped target over args.epochs passes of `prompts`, rolling out through run.rollout_func; the
    trainer's logs (loss, reward, grad norm, learning rate per optimizer step) go to run.result["trainer_log"]."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    if len(prompts) % run.num_prompts:
        raise ValueError(f"--num-prompts={len(prompts)} is not a multiple of the shape's {run.num_prompts} prompts "
                         "per step; change either")
    config = GRPOConfig(output_dir=run.weights_dir, max_steps=args.epochs * len(prompts) // run.num_prompts,
                        learning_rate=args.learning_rate, lr_scheduler_type="constant_with_warmup",
                        warmup_steps=args.lr_warmup_steps, per_device_train_batch_size=run.num_prompts *
                        run.num_generations, num_generations=run.num_generations, temperature=args.temperature,
                        max_completion_length=args.max_completion_length, bf16=False, logging_steps=1, report_to=[],
                        save_strategy="no", disable_tqdm=True, seed=args.seed, use_cpu=args.device == "cpu")
    policy = AutoModelForCausalLM.from_pretrained(default_model_paths()["target"], dtype=torch.float32)
    trainer = GRPOTrainer(model=policy, reward_funcs=reward_correct, args=config,
                          train_dataset=Dataset.from_dict({"prompt": prompts}),
                          processing_class=run.generator.tokenizer, rollout_func=run.rollout_func)
    train_logged(run, trainer)


def train_logged(run, trainer) -> None:
    """Train without TRL's printer, keeping the trainer's log in the run's result even where training fails."""
    from transformers import PrinterCallback
    trainer.remove_callback(PrinterCallback)
    try:
        trainer.train()
    finally:
        run.result["trainer_log"] = trainer.state.log_history


def reward_correct(prompts, completions, **kwargs) -> list[float]:
    return [reward(p, c) for p, c in zip(prompts, completions)]


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    arms = select_arms(args)
    prompts = fixed_prompts(args.num_prompts, args.seed)
    results = {"settings": vars(args), "arms": arms, "prompts": prompts, "shapes": {}}
    started = time.time()
    try:
        for shape in args.shapes.split(","):
            run = ShapeRun(shapes(shape)[0], arms, prompts, args, output_dir)
            results["shapes"][shape] = run.result
            try:
                train(run, prompts, args)
            finally:
                run.close()
            run.result["epochs"] = report.summarise(run.steps, list(arms))
    except BaseException as error:
        results["error"] = repr(error)
        raise
    finally:
        results["identical_check"] = report.identical_check(results)
        results["wall_s"] = time.time() - started
        (output_dir / "bench_epochs.json").write_text(json.dumps(results, indent=1))
    report.plot(results, output_dir / "bench_epochs.png")
    print(report.table(results))
    return results


if __name__ == "__main__":
    main()
