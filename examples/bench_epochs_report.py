"""What examples/bench_epochs.py reports: per shape and epoch, each arm's tokens/s over no speculation (the ratio of
the epoch's totals, and the median of its steps' ratios), mean acceptance length, target forward passes per step
(engine steps: the makespan in forward passes, independent of the hardware), and the batch's mean reward; the
step lines, the table and the plot."""

import statistics


def summarise(steps: list[dict], arms: list[str]) -> dict:
    """Epoch (as a string, JSON's keys) -> {"num_steps", "mean_reward" (no_spec's samples, the ones trained on),
    "arms": arm -> figures}."""
    epochs = {}
    for epoch in sorted({s["epoch"] for s in steps}):
        chosen = [s for s in steps if s["epoch"] == epoch]
        by_arm = {arm: _arm(chosen, arm) for arm in arms if all(arm in s["arms"] for s in chosen)}
        for arm, figures in by_arm.items():
            for base in {"no_spec", _base(arm, by_arm)} - {arm}:
                figures[f"over_{base}"] = figures["tokens_per_s"] / by_arm[base]["tokens_per_s"]
                figures[f"median_step_over_{base}"] = statistics.median(
                    s["arms"][arm]["tokens_per_s"] / s["arms"][base]["tokens_per_s"] for s in chosen)
                figures[f"forward_passes_over_{base}"] = (figures["forward_passes_per_step"]
                                                          / by_arm[base]["forward_passes_per_step"])
        epochs[str(epoch)] = {"num_steps": len(chosen), "mean_reward": statistics.mean(s["mean_reward"] for s in chosen),
                              "arms": by_arm}
    return epochs


def _arm(steps: list[dict], arm: str) -> dict:
    records = [s["arms"][arm] for s in steps]
    total = {key: sum(r[key] for r in records) for key in ("seconds", "num_tokens", "num_steps", "num_spec_steps",
                                                            "num_accepted_draft_tokens", "num_draft_tokens")}
    return {"tokens_per_s": total["num_tokens"] / total["seconds"], **total,
            "mean_acceptance_length": 1 + total["num_accepted_draft_tokens"] / max(total["num_spec_steps"], 1),
            "forward_passes_per_step": total["num_steps"] / len(records),
            "mean_reward": statistics.mean(r["mean_reward"] for r in records)}


def identical_check(results: dict) -> dict:
    """Whether every embedded arm's completions equalled no_spec's at every step, and where they did not."""
    checked, failures, num_steps = set(), [], 0
    for shape, result in results["shapes"].items():
        for step in result["steps"]:
            num_steps += 1
            checked.update(step["identical_to_no_spec"])
            failures += [{"shape": shape, "step": step["step"], "arm": arm}
                         for arm, same in step["identical_to_no_spec"].items() if same < 1]  # a bool or a share
    return {"passed": not failures and num_steps > 0, "num_steps": num_steps, "arms": sorted(checked),
            "failures": failures}


def step_line(step: dict, num_prompts: int, num_generations: int) -> str:
    """One printed line per step: reward, no_spec's tokens/s and every other arm's ratio over it (vLLM arms' over
    vllm_no_spec's, the first over no_spec's)."""
    records = step["arms"]
    ratios = "  ".join(f"{arm} {r['tokens_per_s'] / records[_base(arm, records)]['tokens_per_s']:.2f}x"
                       for arm, r in records.items() if arm != "no_spec")
    return (f"{num_prompts}x{num_generations} step {step['step']:3d} epoch {step['epoch']} reward "
            f"{step['mean_reward']:.3f}  no_spec {records['no_spec']['tokens_per_s']:6.0f} tok/s  {ratios}")


def _base(arm: str, arms) -> str:
    """What an arm's speed is compared with: vllm_no_spec for the other vLLM arms (where it runs), else no_spec."""
    return "vllm_no_spec" if arm.startswith("vllm_") and arm != "vllm_no_spec" and "vllm_no_spec" in arms \
        else "no_spec"


def table(results: dict) -> str:
    """Per shape, one row per arm and one column per epoch: tokens/s over no_spec (ratio of totals, median step
    ratio; vLLM arms over vllm_no_spec), mean acceptance length, target forward passes per step."""
    lines = []
    for shape, result in results["shapes"].items():
        epochs = result.get("epochs", {})
        if not epochs:
            continue
        lines.append(f"{shape}: per epoch: tok/s over no_spec (totals | median step; vLLM's speculative arms over "
                     "vllm_no_spec), mean acceptance length, target forwards per step")
        lines.append(f"  {'arm':<18}" + "".join(f"| epoch {e:<24}" for e in epochs))
        for arm in next(iter(epochs.values()))["arms"]:
            cells = [_cell(arm, epoch["arms"]) for epoch in epochs.values()]
            lines.append(f"  {_label(arm, results):<18}" + "".join(f"| {c:<30}" for c in cells))
        lines.append(f"  {'mean reward':<18}" + "".join(f"| {e['mean_reward']:<30.3f}" for e in epochs.values()))
    check = results.get("identical_check", {})
    lines.append(f"embedded arms identical to no_spec: {check.get('passed')} ({check.get('num_steps')} steps, "
                 f"{len(check.get('arms', []))} arms)")
    return "\n".join(lines)


def _cell(arm: str, by_arm: dict) -> str:
    figures = by_arm.get(arm)
    if figures is None:
        return "-"
    base = _base(arm, by_arm)
    total, median = figures.get(f"over_{base}", 1.0), figures.get(f"median_step_over_{base}", 1.0)
    return (f"{total:.2f}x|{median:.2f}x {figures['mean_acceptance_length']:.2f} "
            f"{figures['forward_passes_per_step']:.1f}")


def _label(arm: str, results: dict) -> str:
    config = results["arms"].get(arm) or {}
    return f"{arm} (K={config['num_speculative_tokens']})" if arm.startswith("vllm_") and config else arm


def plot(results: dict, path) -> None:
    """One column per shape: tokens/s over no_spec per epoch (top), target forward passes per step over no_spec's
    (bottom), a line per arm (dashed: vLLM's; its speculative arms over vllm_no_spec)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = [s for s, r in results["shapes"].items() if r.get("epochs")]
    if not shapes:
        return
    fig, axes = plt.subplots(2, len(shapes), figsize=(6 * len(shapes), 8), squeeze=False)
    for column, shape in enumerate(shapes):
        epochs = results["shapes"][shape]["epochs"]
        top, bottom = axes[0][column], axes[1][column]
        for arm in next(iter(epochs.values()))["arms"]:
            base = _base(arm, next(iter(epochs.values()))["arms"])
            if base == arm:
                continue
            xs = [int(e) for e, v in epochs.items() if f"over_{base}" in v["arms"].get(arm, {})]
            style = {"marker": "o", "label": f"{_label(arm, results)} / {base}",
                     "linestyle": "--" if arm.startswith("vllm_") else "-"}
            top.plot(xs, [epochs[str(e)]["arms"][arm][f"over_{base}"] for e in xs], **style)
            bottom.plot(xs, [epochs[str(e)]["arms"][arm][f"forward_passes_over_{base}"] for e in xs], **style)
        top.axhline(1.0, color="grey", linewidth=0.8)
        bottom.axhline(1.0, color="grey", linewidth=0.8)
        top.set_title(f"{shape} (prompts x generations per step)")
        top.set_ylabel("tokens/s over no speculation (epoch totals)")
        bottom.set_ylabel("target forward passes per step over no speculation's")
        bottom.set_xlabel("epoch (1 = fresh prompts)")
        for ax in (top, bottom):
            ax.set_xticks(sorted(int(e) for e in epochs))
        top.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
