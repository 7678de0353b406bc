"""The scheduler: plain Python, no model. Waiting queue -> running set -> finished, and each step's plan.

Every running request holds one KV slot of `max_model_len` positions in the target (and draft) cache, so the
KV capacity is `max_num_seqs` requests; requests are admitted in arrival order as slots free up, which is
what makes the batch size fluctuate from step to step.
"""

from collections import deque
from dataclasses import dataclass
from typing import Callable

from rollout.embedded_backend.request import Request, RequestStatus


@dataclass
class StepPlan:
    requests: list[Request]  # everything running this step, admitted ones included
    new_requests: list[Request]  # admitted this step: their prompts still need a prefill
    k_max: int  # K from the per-batch-size schedule for batch size len(requests)

    @property
    def batch_size(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(self, max_num_seqs: int, k_for_batch_size: Callable[[int], int]):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs}: must be >= 1")
        self.max_num_seqs = max_num_seqs
        self.k_for_batch_size = k_for_batch_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def plan(self) -> StepPlan:
        new_requests = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            new_requests.append(request)
        return StepPlan(list(self.running), new_requests, self.k_for_batch_size(len(self.running)))

    def finish(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED
        self.running.remove(request)

    def abort(self) -> list[Request]:
        """Take every running request out (a failed run) and return them."""
        running, self.running = self.running, []
        return running
