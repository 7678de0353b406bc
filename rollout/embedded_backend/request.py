"""One completion being generated: its tokens, logprobs, acceptance record and place in the engine."""

import enum
from dataclasses import dataclass, field

import torch

from rollout.sampling_params import SamplingParams
from spec import DraftRequest, PositionUniforms, RequestAcceptance


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(eq=False)
class Request:
    req_id: int  # unique for the generator's lifetime
    group_id: int  # shared by the live requests with the same prompt token ids (spec.drafting_host.PromptGroups)
    prompt_index: int  # position of the prompt in the call's input
    sample_index: int  # 0 .. num_generations - 1 within its prompt
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator  # the drafter's draws (probabilistic drafts)
    uniforms: PositionUniforms  # verification's, one pair per output position
    acceptance: RequestAcceptance
    stop_ids: frozenset[int]  # EOS and the params' stop_token_ids
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" or "length"
    slot: int | None = None  # the target runner's KV slot while running

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def append(self, token_id: int, logprob: float, max_model_len: int) -> bool:
        """Commit one token; True when it finishes the request (the stop token itself is kept)."""
        self.output_ids.append(token_id)
        self.logprobs.append(logprob)
        if token_id in self.stop_ids:
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.max_completion_len(max_model_len):
            self.finish_reason = "length"
        return self.finish_reason is not None

    def max_completion_len(self, max_model_len: int) -> int:
        """The most completion tokens the request has room for: max_tokens, or what max_model_len leaves."""
        return min(self.params.max_tokens, max_model_len - len(self.prompt_ids))

    def room_for_drafts(self, max_model_len: int) -> int:
        """The most drafts worth verifying: k drafts emit up to k + 1 tokens and put k + 1 tokens in the cache."""
        return max(0, self.max_completion_len(max_model_len) - len(self.output_ids) - 1)

    def draft_view(self) -> DraftRequest:
        p = self.params
        return DraftRequest(self.req_id, self.group_id, self.token_ids, len(self.prompt_ids),
                            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, generator=self.generator,
                            stop_ids=self.stop_ids)
