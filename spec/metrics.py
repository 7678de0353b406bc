"""Acceptance counting: one record per request, and an aggregate that is exactly their sum.

Field names follow vLLM's per-request spec-decode metrics. A *spec step* is a verification step in which the
request was offered at least one draft token; steps with K = 0 still appear in `k_per_step`. The mean
acceptance length counts the bonus/recovered token: 1 + accepted / spec steps. Counting lives here; turning
counts into log lines or trainer metrics happens elsewhere (`AcceptanceStats.to_metrics`).
"""

from collections import Counter
from dataclasses import dataclass, field


def _grow(counts: list[int], length: int) -> None:
    counts.extend([0] * (length - len(counts)))


@dataclass
class RequestAcceptance:
    """One request's acceptance record, updated once per verification step."""

    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    acceptance_histogram: list[int] = field(default_factory=list)  # [k + 1]: steps by number accepted
    num_drafted_per_position: list[int] = field(default_factory=list)
    num_accepted_per_position: list[int] = field(default_factory=list)
    k_per_step: list[int] = field(default_factory=list)  # drafts offered at each step, 0 included
    num_accepted_per_step: list[int] = field(default_factory=list)  # of them accepted, at each step

    @classmethod
    def sized(cls, num_speculative_tokens: int) -> "RequestAcceptance":
        """A record whose histogram has num_speculative_tokens + 1 bins from the start, as vLLM's has."""
        k = num_speculative_tokens
        return cls(acceptance_histogram=[0] * (k + 1), num_drafted_per_position=[0] * k,
                   num_accepted_per_position=[0] * k)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        assert 0 <= num_accepted <= num_drafted
        self.k_per_step.append(num_drafted)
        self.num_accepted_per_step.append(num_accepted)
        if num_drafted == 0:
            return
        self.num_spec_steps += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_draft_tokens += num_accepted
        _grow(self.acceptance_histogram, num_drafted + 1)
        self.acceptance_histogram[num_accepted] += 1
        _grow(self.num_drafted_per_position, num_drafted)
        _grow(self.num_accepted_per_position, num_drafted)
        for j in range(num_drafted):
            self.num_drafted_per_position[j] += 1
            self.num_accepted_per_position[j] += j < num_accepted

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per spec step, bonus/recovered token included (1.0 when nothing was drafted)."""
        return 1.0 + self.num_accepted_draft_tokens / max(self.num_spec_steps, 1)

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_draft_tokens / max(self.num_draft_tokens, 1)

    def to_dict(self) -> dict:
        return {
            "num_spec_steps": self.num_spec_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            "acceptance_histogram": list(self.acceptance_histogram),
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "num_drafted_per_position": list(self.num_drafted_per_position),
            "num_accepted_per_position": list(self.num_accepted_per_position),
            "k_per_step": list(self.k_per_step),
            "num_accepted_per_step": list(self.num_accepted_per_step),
        }


@dataclass
class AcceptanceStats:
    """The aggregate: the sum of the per-request records, plus the K the engine chose per batch size."""

    total: RequestAcceptance = field(default_factory=RequestAcceptance)
    num_requests: int = 0
    k_per_batch_size: dict[int, Counter] = field(default_factory=dict)  # batch size -> Counter of K
    drafts_per_batch_size: Counter = field(default_factory=Counter)  # batch size -> drafts verified there, all rows

    def add(self, record: RequestAcceptance) -> None:
        """Fold in a finished request's record."""
        t = self.total
        self.num_requests += 1
        t.num_spec_steps += record.num_spec_steps
        t.num_draft_tokens += record.num_draft_tokens
        t.num_accepted_draft_tokens += record.num_accepted_draft_tokens
        for name in ("acceptance_histogram", "num_drafted_per_position", "num_accepted_per_position"):
            mine, theirs = getattr(t, name), getattr(record, name)
            _grow(mine, len(theirs))
            for i, count in enumerate(theirs):
                mine[i] += count
        t.k_per_step.extend(record.k_per_step)  # num_accepted_per_step stays per request: the histogram sums it up

    def observe_step(self, batch_size: int, k: int, num_drafts: int) -> None:
        """The engine ran a step of `batch_size` requests with K = k from the schedule (the cap), verifying num_drafts
        drafts in all (K per request, or fewer where adaptive verification cut them)."""
        self.k_per_batch_size.setdefault(batch_size, Counter())[k] += 1
        self.drafts_per_batch_size[batch_size] += num_drafts

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        t = self.total
        return [a / d for a, d in zip(t.num_accepted_per_position, t.num_drafted_per_position) if d]

    def to_metrics(self, prefix: str = "spec/") -> dict[str, float]:
        """Flat, slash-namespaced scalars for logs (per-position rates as `<prefix>acceptance_rate_pos_<j>`)."""
        t = self.total
        metrics = {
            f"{prefix}acceptance_rate": t.draft_acceptance_rate,
            f"{prefix}mean_acceptance_length": t.mean_acceptance_length,
            f"{prefix}num_draft_tokens": float(t.num_draft_tokens),
            f"{prefix}num_accepted_draft_tokens": float(t.num_accepted_draft_tokens),
            f"{prefix}mean_k": sum(t.k_per_step) / max(len(t.k_per_step), 1),
        }
        for j, rate in enumerate(self.acceptance_rate_per_position):
            metrics[f"{prefix}acceptance_rate_pos_{j}"] = rate
        return metrics

    def to_dict(self) -> dict:
        total = self.total.to_dict()
        k_offered = Counter(total.pop("k_per_step"))
        del total["num_accepted_per_step"]  # per request only (empty here)
        return {
            **total,
            "k_offered_histogram": {k: k_offered[k] for k in sorted(k_offered)},
            "num_requests": self.num_requests,
            "acceptance_rate_per_position": self.acceptance_rate_per_position,
            "k_per_batch_size": {b: dict(c) for b, c in sorted(self.k_per_batch_size.items())},
            "drafts_per_batch_size": dict(sorted(self.drafts_per_batch_size.items())),
        }
