"""What a rollout returns: samples in input order and the aggregate stats."""

from dataclasses import dataclass, field


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
