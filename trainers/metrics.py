"""Acceptance metrics of each rollout, summed over processes and put where GRPOTrainer.log reads them.

Adding keys to `logs` in a callback's `on_log` reaches neither `log_history` nor the report_to integrations (they
have run by then). GRPOTrainer.log (TRL 1.16) averages `trainer._metrics[mode]` over the logging window and merges
it into the logs before either sees them, so rollout metrics go there, as TRL's own `completions/...` metrics do.

Counts are summed over processes before ratios are taken, so each process weighs by its drafts; the rollout's wall
time is the slowest process's, so `spec/rollout_tokens_per_s` is the aggregate throughput. Other `spec/` keys of
the batch (e.g. the adaptive verifier's) and `extra` values are averaged over processes.
"""

import math

import torch
from accelerate.utils import gather_object

from rollout import RolloutBatch

# Per-process count vector: these, then num_drafted per position, num_accepted per position, then elapsed_s.
_COUNTS = ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens", "num_row_steps", "sum_k",
           "num_completion_tokens")


def log_rollout_metrics(trainer, batch: RolloutBatch, num_positions: int, extra: dict | None = None) -> dict:
    """Append the rollout's `spec/...` metrics, over all processes, to `trainer._metrics[mode]`; returns them."""
    if not hasattr(trainer, "_metrics"):
        raise NotImplementedError(f"{type(trainer).__name__} has no _metrics dict (GRPOTrainer's, TRL 1.16): "
                                  "SpecRolloutCallback cannot put rollout metrics into its logs")
    accelerator = trainer.accelerator
    local = torch.tensor(rollout_counts(batch, num_positions), dtype=torch.float64, device=accelerator.device)
    per_process = accelerator.gather(local[None]).view(-1, local.numel())  # [num_processes, len]
    totals = per_process.sum(dim=0).tolist()
    totals[-1] = per_process[:, -1].max().item()  # elapsed_s: the slowest process
    metrics = spec_metrics(totals, num_positions)
    others = {k: v for k, v in batch.metrics.items() if k not in metrics and k.startswith("spec/")}
    metrics.update(_mean_over_processes(accelerator, {**others, **(extra or {})}))
    mode = "train" if trainer.model.training else "eval"
    for key, value in metrics.items():
        trainer._metrics[mode][key].append(value)
    return metrics


def rollout_counts(batch: RolloutBatch, num_positions: int) -> list[float]:
    """The additive counts of a rollout, from the samples' own acceptance records (their sum is the aggregate)."""
    counts = dict.fromkeys(_COUNTS, 0)
    drafted, accepted = [0] * num_positions, [0] * num_positions
    for sample in batch.samples:
        record = sample.acceptance
        for name in _COUNTS[:3]:
            counts[name] += record[name]
        counts["num_row_steps"] += len(record["k_per_step"])
        counts["sum_k"] += sum(record["k_per_step"])
        counts["num_completion_tokens"] += len(sample.completion_ids)
        for j, (d, a) in enumerate(zip(record["num_drafted_per_position"], record["num_accepted_per_position"])):
            drafted[j] += d
            accepted[j] += a
    return [*counts.values(), *drafted, *accepted, batch.stats["elapsed_s"]]


def spec_metrics(totals: list[float], num_positions: int) -> dict[str, float]:
    """The `spec/...` keys of RolloutBatch.metrics from summed counts. The mean acceptance length counts the
    bonus/recovered token; each row-step verifies k + 1 tokens."""
    counts = dict(zip(_COUNTS, totals))
    drafted = totals[len(_COUNTS):len(_COUNTS) + num_positions]
    accepted = totals[len(_COUNTS) + num_positions:len(_COUNTS) + 2 * num_positions]
    num_tokens, elapsed = counts["num_completion_tokens"], totals[-1]
    metrics = {
        "spec/acceptance_rate": counts["num_accepted_draft_tokens"] / max(counts["num_draft_tokens"], 1),
        "spec/mean_acceptance_length": 1 + counts["num_accepted_draft_tokens"] / max(counts["num_spec_steps"], 1),
        "spec/num_spec_steps": counts["num_spec_steps"],
        "spec/num_draft_tokens": counts["num_draft_tokens"],
        "spec/num_accepted_draft_tokens": counts["num_accepted_draft_tokens"],
        "spec/mean_k": counts["sum_k"] / max(counts["num_row_steps"], 1),
        "spec/verified_tokens_per_emitted_token": (counts["num_row_steps"] + counts["num_draft_tokens"])
        / max(num_tokens, 1),
        "spec/rollout_tokens_per_s": num_tokens / max(elapsed, 1e-9),
        "spec/num_completion_tokens": num_tokens,
        "spec/rollout_s": elapsed,
    }
    for j, (d, a) in enumerate(zip(drafted, accepted)):
        if d:
            metrics[f"spec/acceptance_rate_pos_{j}"] = a / d
    return metrics


def _mean_over_processes(accelerator, values: dict[str, float]) -> dict[str, float]:
    """Each key's mean over the processes that have it (every process must call this: it gathers)."""
    keys = sorted(set(gather_object(sorted(values))))  # every process needs the same keys, in the same order
    if not keys:
        return {}
    local = torch.tensor([float(values.get(k, math.nan)) for k in keys], dtype=torch.float64,
                         device=accelerator.device)
    means = accelerator.gather(local[None]).view(-1, len(keys)).nanmean(dim=0).tolist()
    return dict(zip(keys, means))
