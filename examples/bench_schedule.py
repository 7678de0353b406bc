"""Schedule benchmark: tokens/s of no speculation, static K and the per-batch-size schedule, side by side.

    python examples/bench_schedule.py [--batch-sizes 1,2,4,8,16,32,64,128,256] [--repeats 5] [--output-dir DIR]

Every arm rolls out the same prompts with the same sampling settings and seeds on the embedded default pair;
runs are interleaved (the arm order rotates every repeat) so that machine noise hits every arm alike, and the
median is reported. Alongside: the measured cost of a target forward by tokens per row and of a draft forward,
the acceptance per position and the speedup the cost model predicts for each K; HF `model.generate` on the
same target runs as one more interleaved arm, against the engine with no speculation. Writes
bench_schedule.json and bench_schedule.png (default folder: examples/results).
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout import RolloutGenerator, SamplingParams, default_model_paths, default_prompts
from rollout.cli import DEFAULT_SCHEDULE
from spec.model_runner import build_runner

STATIC_KS = (1, 2, 4, 8)


def arms() -> dict[str, dict | None]:
    spec = {f"K={k}": {"method": "draft_model", "num_speculative_tokens": k} for k in STATIC_KS}
    schedule = {"method": "draft_model", "num_speculative_tokens": max(k for *_, k in DEFAULT_SCHEDULE),
                "num_speculative_tokens_per_batch_size": DEFAULT_SCHEDULE}
    return {"no_spec": None, **spec, "schedule": schedule}


def load(name: str):
    path = default_model_paths()[name]
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def run_arms(batch_sizes, repeats: int, max_tokens: int) -> dict:
    """tokens/s per arm and batch size (median of interleaved repeats), plus acceptance counts per position.
    HF `model.generate` on the same target is one of the interleaved arms."""
    # Every arm runs the same in-memory target (and draft) weights, so no arm pays for another's cache misses.
    target, draft = load("target"), load("draft")
    tokenizer = AutoTokenizer.from_pretrained(default_model_paths()["target"], padding_side="left")
    runners = {name: _engine_arm(RolloutGenerator(target, tokenizer=tokenizer, draft_model=draft,
                                                  speculative_config=config, max_num_seqs=max(batch_sizes)))
               for name, config in arms().items()}
    runners["hf_generate"] = _hf_arm(target, tokenizer)
    results = {}
    for batch_size in batch_sizes:
        prompts = default_prompts(batch_size, seed=batch_size)
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=batch_size)
        names = list(runners)
        runs = {name: [] for name in names}
        for repeat in range(repeats):
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                runs[name].append(runners[name](prompts, params))
        results[batch_size] = {name: _summarise(stats) for name, stats in runs.items()}
        print(_row(batch_size, results[batch_size]), flush=True)
    return results


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
        return {"tokens_per_s": sum(_length_to_eos(c, tokenizer.eos_token_id) for c in completions) / elapsed}
    return run


def _summarise(stats: list[dict]) -> dict:
    if "num_drafted_per_position" not in stats[0]:
        return {"tokens_per_s": statistics.median(s["tokens_per_s"] for s in stats)}
    return {"tokens_per_s": statistics.median(s["tokens_per_s"] for s in stats),
            "mean_acceptance_length": statistics.mean(s["mean_acceptance_length"] for s in stats),
            "num_drafted_per_position": _column_sums(s["num_drafted_per_position"] for s in stats),
            "num_accepted_per_position": _column_sums(s["num_accepted_per_position"] for s in stats)}


def _column_sums(rows) -> list[int]:
    return [sum(column) for column in zip(*rows)]


def pooled_acceptance(arm_results: dict, arm: str) -> list[float]:
    """Acceptance rate per draft position of one arm, pooled over every batch size."""
    drafted = _column_sums(r[arm]["num_drafted_per_position"] for r in arm_results.values())
    accepted = _column_sums(r[arm]["num_accepted_per_position"] for r in arm_results.values())
    return [a / d for a, d in zip(accepted, drafted) if d]


def _row(batch_size: int, arms_result: dict) -> str:
    base = arms_result["no_spec"]["tokens_per_s"]
    cells = "  ".join(f"{n} {r['tokens_per_s'] / base:4.2f}x" for n, r in arms_result.items() if n != "no_spec")
    return f"B={batch_size:3d}  no_spec {base:7.1f} tok/s  {cells}"


@torch.inference_mode()
def measure_costs(batch_sizes, max_tokens_per_row: int = 9, repeats: int = 5) -> dict:
    """Seconds per forward: target by (batch size, tokens per row), draft by batch size (1 token per row)."""
    costs = {"target": {}, "draft": {}}
    for name in ("target", "draft"):
        model = load(name)
        runner = build_runner(model, max(batch_sizes), model.config.max_position_embeddings)
        slots = [runner.allocate() for _ in range(max(batch_sizes))]
        widths = range(1, max_tokens_per_row + 1) if name == "target" else (1,)
        for batch_size in batch_sizes:
            costs[name][batch_size] = {n: _time_forward(runner, slots[:batch_size], n, repeats) for n in widths}
    return costs


def _time_forward(runner, slots, tokens_per_row: int, repeats: int) -> float:
    context = 40  # a typical mid-rollout context: prompt + part of the completion
    times = []
    for _ in range(repeats):
        for slot in slots:
            runner.crop(slot, 0)
        runner.forward(slots, [[5] * context] * len(slots), [0] * len(slots))
        start = time.perf_counter()
        runner.forward(slots, [[5] * tokens_per_row] * len(slots), [tokens_per_row] * len(slots))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def predicted_speedup(costs: dict, acceptance: list[float], batch_size: int, k: int) -> float:
    """E[tokens per step] x cost(no spec) / cost(step with K drafts), forward costs only: the bound a perfect
    engine would reach. acceptance[j] is the share of drafts whose position j was accepted (vLLM's per-position
    rate, which already includes the positions before it), so E[tokens per step] = 1 + sum of the first K."""
    expected_tokens = 1.0 + sum(acceptance[:k])
    target = costs["target"][batch_size]
    step = target[k + 1] + k * costs["draft"][batch_size][1]
    return expected_tokens * target[1] / step


def _length_to_eos(ids: list[int], eos: int) -> int:
    return ids.index(eos) + 1 if eos in ids else len(ids)


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    batch_sizes = sorted(results)
    fig, (ax_tps, ax_ratio) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in results[batch_sizes[0]]["arms"]:
        if name == "hf_generate":
            continue
        tps = [results[b]["arms"][name]["tokens_per_s"] for b in batch_sizes]
        ratio = [t / results[b]["arms"]["no_spec"]["tokens_per_s"] for t, b in zip(tps, batch_sizes)]
        style = dict(marker="o", linewidth=2.5 if name == "schedule" else 1.2)
        ax_tps.plot(batch_sizes, tps, label=name, **style)
        ax_ratio.plot(batch_sizes, ratio, label=name, **style)
    ax_tps.plot(batch_sizes, [results[b]["arms"]["hf_generate"]["tokens_per_s"] for b in batch_sizes], "k--",
                label="HF generate")
    ax_ratio.axhline(1.0, color="gray", linestyle=":")
    for ax, title in ((ax_tps, "tokens/s"), (ax_ratio, "speedup over no speculation")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output-dir", default="examples/results")
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    torch.manual_seed(0)
    arm_results = run_arms(batch_sizes, args.repeats, args.max_tokens)
    costs = measure_costs(batch_sizes)
    acceptance = pooled_acceptance(arm_results, f"K={max(STATIC_KS)}")
    results = {}
    for b in batch_sizes:
        target_cost = costs["target"][b]
        results[b] = {
            "arms": arm_results[b],
            "draft_target_cost_ratio": costs["draft"][b][1] / target_cost[1],
            "target_cost_s_by_tokens_per_row": target_cost,
            "predicted_speedup": {f"K={k}": predicted_speedup(costs, acceptance, b, k) for k in STATIC_KS},
        }
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_schedule.json").write_text(json.dumps({"acceptance_rate_per_position": acceptance,
                                                          "batch_sizes": results}, indent=2))
    plot(results, out / "bench_schedule.png")
    for b in batch_sizes:
        r = results[b]
        print(f"B={b:3d} draft/target cost {r['draft_target_cost_ratio']:.2f}  predicted " +
              " ".join(f"{k} {v:.2f}x" for k, v in r["predicted_speedup"].items()))
    print(f"wrote {out / 'bench_schedule.json'} and {out / 'bench_schedule.png'}")


if __name__ == "__main__":
    main()
