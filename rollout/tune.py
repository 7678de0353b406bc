"""`python -m rollout tune`: derive a target/draft pair's per-batch-size schedule on this hardware and print it as
speculative-config JSON, with the commands that accept it (accepted_by): `vllm serve --speculative-config` only for
vLLM's own drafters; this project's (`method: "history"`, `custom_class`) run in a server that `python -m rollout serve`
starts.

`--backend embedded` (default) tunes this package's engine; `--backend vllm` tunes vLLM's (`vllm.LLM` in this process,
built with the largest K and a schedule whose K the tuner overwrites, rollout/step_times.py).

Two steps. (1) Predict: roll out the prompts (`--prompts`, else the default task's) once at the largest K to measure
acceptance per draft position, measure the step costs, and predict each K's speedup per batch size (spec/tuning.py).
(2) Measure (unless `--predict-only`), which decides, as the prediction is a steady-state model: at each batch size of a
doubling grid, roll out the same prompts with every candidate K (0, powers of two up to the largest K, and the predicted
best) as a one-range schedule on the same generator, interleaved, over `--repeats` prompt sets, and keep the smallest K
that the fastest does not beat by `--min-gain`. Between grid points the schedule switches at their geometric mean.

With a drafter that keeps rollout history (`history`), each K would draft from the completions of the Ks run before it
(the same seed samples the same completions), so every comparison starts from one history state: each prompt set is
first rolled out untimed under another seed (its earlier epoch), that history is saved and loaded again before each K's
run (`SameHistory`), and the drafter's global cache of other prompts' outputs is off while timing.
"""

import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile

from rollout.default_task import default_prompts
from rollout.generator import RolloutGenerator
from rollout.prompt_files import read_prompts
from rollout.sampling_params import SamplingParams, mix_seed
from spec import SpecConfig
from spec.config import PROTOCOL_METHODS
from spec.schedule import BatchSizeSchedule
from spec.tuning import best_k, doubling_grid, smallest_k_within, tuned_schedule

_REPORTED_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def tune(args, base_config: dict) -> dict:
    """The tuned speculative config; a table of the predictions (and measurements) goes to stderr."""
    max_k = args.max_k or base_config["num_speculative_tokens"]
    static = {key: value for key, value in base_config.items()
              if key not in ("num_speculative_tokens_per_batch_size", "enable_adaptive_verification")}
    static["num_speculative_tokens"] = max_k
    if static["method"] == "history":
        static["suffix_decoding_max_cached_requests"] = 0  # while timing (module docstring)
    generator = _generator(args, static)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="rollout_tune_") as folder:
        history = SameHistory(generator, os.path.join(folder, "history.npz"))
        schedule, acceptance, predicted, measured = _tune(generator, args, params, history, max_k)
    BatchSizeSchedule(schedule, max(max_k, 1))  # valid by construction; a broken one fails here
    print(_report(acceptance, predicted, measured, args.min_gain), file=sys.stderr)
    return {**base_config, "num_speculative_tokens": max(1, max(k for *_, k in schedule)),
            "num_speculative_tokens_per_batch_size": schedule}


def _tune(generator: RolloutGenerator, args, params: SamplingParams, history: "SameHistory", max_k: int):
    """(schedule, acceptance per position, predicted (K, speedup) per reported batch size, measured tokens/s per grid
    batch size and K)."""
    pick = prompt_picker(args)
    prompts = pick(args.num_prompts, args.seed)
    history.revisit(prompts, args.num_generations, params)
    batch = generator.generate(prompts, args.num_generations, params, use_tqdm=not args.no_progress)
    acceptance = batch.stats["acceptance_rate_per_position"]
    costs = generator.measure_step_times([s.prompt_ids for s in batch.samples], doubling_grid(args.max_num_seqs),
                                         sorted({0, max_k, *_powers_of_two(max_k)}))
    predicted = {b: best_k(acceptance, costs, b, args.min_gain)
                 for b in _REPORTED_BATCH_SIZES if b <= args.max_num_seqs}
    if args.predict_only:
        return tuned_schedule(acceptance, costs, args.max_num_seqs, args.min_gain), acceptance, predicted, {}
    measured = {}
    for batch_size in doubling_grid(args.max_num_seqs):
        candidates = sorted({0, max_k, best_k(acceptance, costs, batch_size, args.min_gain)[0], *_powers_of_two(max_k)})
        measured[batch_size] = measure_speeds(generator, batch_size, candidates, params, args, pick, history)
        if not args.no_progress:
            print(f"measured batch size {batch_size}: " + "  ".join(
                f"K={k} {tps:.0f} tok/s" for k, tps in measured[batch_size].items()), file=sys.stderr)
    return schedule_from_measurements(measured, args.max_num_seqs, args.min_gain), acceptance, predicted, measured


def _powers_of_two(max_k: int) -> list[int]:
    return [2 ** i for i in range(max_k.bit_length()) if 2 ** i <= max_k]


class SameHistory:
    """One history state for every K of a comparison, where the drafter keeps rollout history (module docstring);
    nothing otherwise."""

    def __init__(self, generator: RolloutGenerator, path: str):
        self.generator, self.path = generator, path
        self.is_on = generator.rollout_history is not None

    def revisit(self, prompts: list, num_generations: int, params: SamplingParams, k: int | None = None) -> None:
        """Roll `prompts` out once, untimed, under another seed (their earlier epoch; at K = k where given), and save
        the history."""
        if self.is_on:
            earlier = dataclasses.replace(params, seed=mix_seed(params.seed or 0, 1))
            generator = self.generator if k is None else _use_k(self.generator, k)
            generator.generate(prompts, num_generations, earlier, use_tqdm=False)
            self.generator.rollout_history.save(self.path)

    def restore(self) -> None:
        if self.is_on:
            self.generator.rollout_history.load(self.path)


def _generator(args, static: dict) -> RolloutGenerator:
    """The generator timed: `static`'s K at every batch size; on vLLM as a one-range schedule (vLLM's scheduler
    reads the K lookup that use_schedule overwrites only when the engine has a schedule)."""
    if getattr(args, "backend", "embedded") == "embedded":
        return RolloutGenerator(args.model, draft_model=args.draft_model, speculative_config=static,
                                max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, seed=args.seed)
    config = {**static, "num_speculative_tokens_per_batch_size": [[1, args.max_num_seqs, static[
        "num_speculative_tokens"]]]}
    return RolloutGenerator(args.model, draft_model=args.draft_model, speculative_config=config, backend="vllm",
                            max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, seed=args.seed)


def prompt_picker(args):
    """(n, seed) -> n prompts: from the --prompts file (generate's format, rollout/prompt_files.py), a window starting
    at a seed-chosen line, cycled; else the default task's, generated from the seed."""
    path = getattr(args, "prompts", None)
    if path is None:
        return lambda n, seed: default_prompts(n, seed=seed)
    pool = read_prompts(path)
    return lambda n, seed: [pool[(seed + i) % len(pool)] for i in range(n)]


def measure_speeds(generator: RolloutGenerator, batch_size: int, ks: list[int], params: SamplingParams, args,
                   pick=None, history: SameHistory | None = None) -> dict[int, float]:
    """Tokens/s of each K at one batch size: K as a one-range schedule on the same generator (and models), the same
    prompts and history state for every K, a new prompt set and seed per repeat (more repeats for small batches,
    whose speed depends on how their few completions end), the K order rotating. Each K's speed is the first K's (all
    its repeats' tokens over all their seconds) times the median over repeats of its speed over the first K's in the
    same repeat: paired on the prompts, and a burst of load from another job on a shared machine moves one repeat's
    ratio, not the estimate."""
    pick = pick or (lambda n, seed: default_prompts(n, seed=seed))
    per_prompt = args.num_generations if batch_size % args.num_generations == 0 else 1
    speeds: dict[int, list[float]] = {k: [] for k in ks}
    tokens, seconds = 0, 0.0  # the first K's
    warm = SamplingParams(temperature=params.temperature, max_tokens=params.max_tokens, seed=args.seed)
    for k in ks:  # untimed: the first call at a batch size pays for allocations
        _use_k(generator, k).generate(pick(1, args.seed), 1, warm, use_tqdm=False)
    for repeat in range(repeats_at(batch_size, args.repeats)):
        prompts = pick(batch_size // per_prompt, args.seed + 1000 * batch_size + repeat)
        run_params = SamplingParams(temperature=params.temperature, max_tokens=params.max_tokens,
                                    seed=args.seed + repeat)
        if history is not None:  # the earlier epoch drafts at the largest K, as an untuned run would
            history.revisit(prompts, per_prompt, run_params, max(ks))
        for k in ks[repeat % len(ks):] + ks[:repeat % len(ks)]:
            if history is not None:
                history.restore()
            stats = _use_k(generator, k).generate(prompts, per_prompt, run_params, use_tqdm=False).stats
            speeds[k].append(stats["tokens_per_s"])
            if k == ks[0]:
                tokens, seconds = tokens + stats["num_completion_tokens"], seconds + stats["elapsed_s"]
    return {k: tokens / seconds * statistics.median(s / r for s, r in zip(speeds[k], speeds[ks[0]])) for k in ks}


def repeats_at(batch_size: int, repeats: int) -> int:
    """Rollouts to time at a batch size: `repeats` up to batch 16, proportionally fewer above, at least 3 (a small
    batch's speed depends on how its few completions happen to end)."""
    return max(3, repeats * 16 // max(batch_size, 16))


def _use_k(generator: RolloutGenerator, k: int) -> RolloutGenerator:
    """The generator with K drafts at every batch size (0: none), on the same engine and models."""
    generator.use_schedule([[1, generator.max_num_seqs, k]])
    return generator


def schedule_from_measurements(measured: dict[int, dict[int, float]], max_num_seqs: int,
                               min_gain: float) -> list[list[int]]:
    """[[start, end, K], ...] over 1 .. max_num_seqs from tokens/s per grid batch size and K (K = 0 included):
    smallest_k_within per grid point; between two grid points the choice switches at their geometric mean."""
    grid = sorted(measured)
    best = {batch_size: smallest_k_within(speeds, min_gain) for batch_size, speeds in measured.items()}
    ranges: list[list[int]] = []
    for batch_size in range(1, max_num_seqs + 1):
        upper = next((g for g in grid if g >= batch_size), grid[-1])
        lower = max((g for g in grid if g <= batch_size), default=grid[0])
        k = best[lower] if batch_size <= math.sqrt(lower * upper) else best[upper]
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = batch_size
        else:
            ranges.append([batch_size, batch_size, k])
    return ranges


def _report(acceptance: list[float], predicted: dict, measured: dict, min_gain: float) -> str:
    lines = ["acceptance per position: " + " ".join(f"{r:.2f}" for r in acceptance),
             "batch size  predicted K (speedup)" + ("  measured K (speedup over K=0)" if measured else "")]
    for batch_size, (k, speedup) in predicted.items():
        line = f"{batch_size:10d}  {k:2d} ({speedup:.2f}x)"
        if batch_size in measured:
            speeds = measured[batch_size]
            k = smallest_k_within(speeds, min_gain)
            line += f"             {k:2d} ({speeds[k] / speeds[0]:.2f}x)"
        lines.append(line)
    return "\n".join(lines)


def accepted_by(config: dict) -> str:
    """Which commands take `config` as their speculative config: the embedded engine's where it runs there; on
    vLLM, `python -m rollout serve` always, and `vllm serve` only for vLLM's own drafters (it cannot load this
    project's, which rollout serve installs through vLLM's custom_class hook)."""
    spec = SpecConfig.from_dict(config)
    is_project = spec.method in PROTOCOL_METHODS
    takers, refusals = [], []
    for check, names in ((spec.check_embedded, ["RolloutGenerator(speculative_config=...)", "python -m rollout generate"]),
                         (spec.check_vllm_protocol if is_project else spec.to_vllm,
                          ["RolloutGenerator(..., backend='vllm')", "python -m rollout serve"]
                          + ([] if is_project else ["vllm serve"]))):
        try:
            check()
            takers += names
        except NotImplementedError as e:
            refusals.append(str(e))
    if is_project:
        refusals.append(f"not vllm serve: method {spec.method!r} is this project's drafter, which only "
                        "python -m rollout serve installs into vLLM")
    return "this config is accepted by: " + (", ".join(takers) or "none") + "".join(f"; {r}" for r in refusals)


def main(args, base_config: dict) -> None:
    config = tune(args, base_config)
    text = json.dumps(config)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    print(accepted_by(config), file=sys.stderr)
    print(text)
