"""What a rollout returns: samples in input order and the aggregate stats."""

from dataclasses import dataclass, field

from spec import AcceptanceStats


@dataclass
class Sample:
    prompt_index: int  # position of its prompt in the input
    sample_index: int  # 0 .. num_generations - 1 within its prompt
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # the target's logprob of each completion token under the processed distribution
    text: str | None  # decoded completion (None without a tokenizer)
    finish_reason: str  # "stop" (EOS or a stop id, kept in completion_ids) or "length"
    acceptance: dict  # the per-request record (spec.metrics.RequestAcceptance fields)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class RolloutBatch:
    samples: list[Sample]
    stats: dict = field(default_factory=dict)  # acceptance aggregate + throughput (see RolloutGenerator)
    metrics: dict = field(default_factory=dict)  # flat `spec/...` scalars for trainer logs


def build_batch(samples: list[Sample], acceptance: AcceptanceStats, *, num_row_steps: int, num_steps: int,
                elapsed: float, stats: dict | None = None, metrics: dict | None = None) -> RolloutBatch:
    """The batch with the stats and `spec/...` metrics every backend reports, plus a backend's own `stats` and
    `metrics`. num_row_steps: the (request, step) pairs, each of which verified its drafts + 1 tokens."""
    num_tokens = sum(len(s.completion_ids) for s in samples)
    verified = (num_row_steps + acceptance.total.num_draft_tokens) / max(num_tokens, 1)
    tokens_per_s = num_tokens / max(elapsed, 1e-9)
    stats = {**acceptance.to_dict(), "num_steps": num_steps, "num_completion_tokens": num_tokens,
             "verified_tokens_per_emitted_token": verified, "elapsed_s": elapsed, "tokens_per_s": tokens_per_s,
             **(stats or {})}
    metrics = {**acceptance.to_metrics(), "spec/rollout_tokens_per_s": tokens_per_s,
               "spec/verified_tokens_per_emitted_token": verified, **(metrics or {})}
    return RolloutBatch(samples, stats, metrics)


def history_stats(counts: dict | None) -> tuple[dict, dict]:
    """(stats, metrics) of a history drafter's counts over a call: requests started ("num_requests") and those whose
    prompt had earlier rollouts in the history then ("num_requests_with_history"); nothing without counts."""
    if not counts or "num_requests" not in counts:
        return {}, {}
    rate = counts["num_requests_with_history"] / max(counts["num_requests"], 1)
    return ({"num_requests_with_history": counts["num_requests_with_history"], "history_hit_rate": rate},
            {"spec/history_hit_rate": rate})
