"""What examples/bench_rollout.py reports: tokens/s per arm and shape, the ratios its targets read, the bound over no
speculation from the measured step costs and acceptance, the table and the plot."""

import statistics

SPECULATIVE = ("k1", "k2", "k4", "k8", "schedule", "tuned", "adaptive", "schedule_adaptive")
STATIC = {"no_spec": 0, "k1": 1, "k2": 2, "k4": 4, "k8": 8}


def summarise(runs: dict, args, greedy: dict | None) -> dict:
    costs = step_costs(runs)
    acceptance = position_acceptance(runs)
    results = {"settings": {k: v for k, v in vars(args).items()}, "acceptance_per_position": acceptance,
               "step_costs": {str(k): {str(b): c for b, c in by_b.items()} for k, by_b in costs.items()},
               "greedy_check": greedy, "shapes": {}}
    for shape, by_arm in runs.items():
        arms = {arm: _arm(replies) for arm, replies in by_arm.items() if replies}
        drain = _drain(by_arm.get("no_spec", []))
        for arm, result in arms.items():
            for base in ("no_spec", "trl_generate", "vllm_no_spec", "vllm_schedule"):
                if base in arms and arm != base:
                    result[f"over_{base}"] = result["tokens_per_s"] / arms[base]["tokens_per_s"]
            if drain and (arm in STATIC or arm in ("schedule", "tuned")):
                result["bound_over_no_spec"] = bound(drain, costs, acceptance, _ks(arm, results["settings"]))
        best = max((a for a in arms if a in SPECULATIVE), key=lambda a: arms[a]["tokens_per_s"], default=None)
        summary = {"arms": arms, "best_embedded_speculative": best}
        if drain and best:
            summary["bound_over_no_spec"] = bound(drain, costs, acceptance, None)
            summary["best_over_bound"] = arms[best].get("over_no_spec", 0.0) / summary["bound_over_no_spec"]
        statics = [a for a in ("k1", "k2", "k4", "k8") if a in arms]
        if statics:
            best_static = max(statics, key=lambda a: arms[a]["tokens_per_s"])
            for arm in ("adaptive", "schedule_adaptive"):
                if arm in arms:
                    summary[f"{arm}_over_best_static"] = arms[arm]["tokens_per_s"] / arms[best_static]["tokens_per_s"]
        results["shapes"][shape] = summary
    return results


def _arm(replies: list[dict]) -> dict:
    seconds, tokens = sum(r["seconds"] for r in replies), sum(r["num_tokens"] for r in replies)
    lengths = sorted(n for r in replies for n in r["lengths"])
    return {"tokens_per_s": tokens / seconds, "seconds": [r["seconds"] for r in replies],
            "num_tokens": [r["num_tokens"] for r in replies], "median_length": statistics.median(lengths),
            "max_length": lengths[-1], "stats": replies[-1]["stats"]}


def step_costs(runs: dict) -> dict[int, dict[int, float]]:
    """K -> log2 batch size -> median seconds of the static arms' steps there (first steps, which prefill the
    prompts, left out)."""
    seconds: dict[int, dict[int, list[float]]] = {}
    for by_arm in runs.values():
        for arm, k in STATIC.items():
            for reply in by_arm.get(arm, []):
                for _, num_reqs, _, _, step_seconds in reply["steps"][1:]:
                    seconds.setdefault(k, {}).setdefault(num_reqs.bit_length(), []).append(step_seconds)
    return {k: {b: statistics.median(s) for b, s in by_b.items()} for k, by_b in seconds.items()}


def position_acceptance(runs: dict) -> list[float]:
    """r_j, the share of steps drafting at position j whose first j + 1 drafts were all accepted: from the arm that
    drafted deepest (the last repeat's figures)."""
    best: list[float] = []
    for by_arm in runs.values():
        for replies in by_arm.values():
            stats = replies[-1]["stats"] if replies else {}
            rates = [stats[f"spec/acceptance_rate_pos_{j}"] for j in range(16) if f"spec/acceptance_rate_pos_{j}" in stats]
            best = rates if len(rates) > len(best) else best
    return best


def _drain(replies: list[dict]) -> list[int]:
    """The no-speculation arm's running requests at each later step, over all its repeats."""
    return [num_reqs for reply in replies for _, num_reqs, *_ in reply["steps"][1:]]


def _ks(arm: str, settings: dict):
    if arm in STATIC:
        return lambda batch: STATIC[arm]
    from rollout.defaults import DEFAULT_SCHEDULE
    from spec import BatchSizeSchedule
    ranges = DEFAULT_SCHEDULE
    if arm == "tuned":
        import json
        from pathlib import Path
        ranges = json.loads(Path(settings["tuned_config"]).read_text())["num_speculative_tokens_per_batch_size"]
    return BatchSizeSchedule(ranges, 8).k_for_batch_size


def bound(drain: list[int], costs: dict, acceptance: list[float], k_of) -> float:
    """No speculation's time over the drain's, each step at batch size B costing c(B, K) / (1 + r_0 + .. +
    r_{K-1}) per token of no speculation's c(B, 0): K = k_of(B), or the cheapest K where k_of is None."""
    def per_token(k: int, b: int) -> float | None:
        cost = costs.get(k, {}).get(b)
        return None if cost is None else cost / (1 + sum(acceptance[:k]))

    plain = speculative = 0.0
    for num_reqs in drain:
        b = num_reqs.bit_length()
        if b not in costs.get(0, {}):
            continue
        options = [per_token(k_of(num_reqs), b)] if k_of else [per_token(k, b) for k in costs]
        options = [o for o in options if o is not None]
        if options:
            plain += costs[0][b]
            speculative += min(options)
    return plain / speculative if speculative else float("nan")


def table(results: dict) -> str:
    lines = []
    for shape, summary in results["shapes"].items():
        arms = summary["arms"]
        lines.append(f"{shape}: best embedded speculative {summary['best_embedded_speculative']}, bound over no spec "
                     f"{summary.get('bound_over_no_spec', float('nan')):.2f}, best over bound "
                     f"{summary.get('best_over_bound', float('nan')):.2f}")
        for arm, result in arms.items():
            ratios = "  ".join(f"{k.removeprefix('over_')} {v:.2f}x" for k, v in result.items() if k.startswith("over_"))
            lines.append(f"  {arm:<18} {result['tokens_per_s']:8.0f} tok/s  {ratios}")
    return "\n".join(lines)


def plot(results: dict, runs: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 5))
    shapes = list(results["shapes"])
    arms = list(results["shapes"][shapes[0]]["arms"])
    width = 0.85 / len(arms)
    for i, arm in enumerate(arms):
        left.bar([j + i * width for j in range(len(shapes))],
                 [results["shapes"][s]["arms"].get(arm, {}).get("tokens_per_s", 0) for s in shapes], width, label=arm)
    left.set_xticks([j + 0.425 for j in range(len(shapes))], shapes)
    left.set_ylabel("completion tokens/s (generation phase of a GRPO step)")
    left.legend(fontsize=7, ncol=2)
    last = shapes[-1]
    for arm, replies in runs[last].items():
        if replies and replies[-1]["steps"]:
            steps = replies[-1]["steps"]
            right.step([s[0] for s in steps], [s[1] for s in steps], where="post", label=f"{arm} (batch)")
            right.scatter([s[0] for s in steps], [s[1] for s in steps], c=[s[3] for s in steps], s=6, cmap="viridis",
                          vmin=0, vmax=8)
    right.set_yscale("log")
    right.set_xlabel(f"seconds into one {last} generation phase")
    right.set_ylabel("running requests (dots: verified drafts per request)")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
