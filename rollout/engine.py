"""The engine loop: each step is plan -> propose -> select -> verify -> commit -> observe.

Token ids only; tokenisation lives in the generator. Target cache invariant between steps: a running request's
slot holds every committed token but the last one, so the next verification feeds that token plus the drafts
and reads k + 1 logits: position j predicts draft j + 1, the last one the bonus token. After verification the
slot is cropped back to the invariant: rejected drafts vanish by moving the length back, nothing recomputed.

How many drafts each request drafts and verifies is the speculation policy's call (spec/policy.py): the static
per-batch-size schedule, or adaptive verification (spec/adaptive/).
"""

import time
from typing import Callable

import torch

from rollout.request import Request
from rollout.scheduler import Scheduler, StepPlan
from spec import (AcceptanceStats, DraftPlan, Proposal, Proposer, RunOutcome, SamplingTensors, SpeculationPolicy,
                  StepInfo, StepOutcome, VerifyResult, rejection_sample)


class Engine:
    def __init__(self, runner, proposer: Proposer | None, policy: SpeculationPolicy,
                 k_for_batch_size: Callable[[int], int], *, max_num_seqs: int, max_model_len: int):
        self.runner = runner
        self.proposer = proposer
        self.policy = policy
        self.scheduler = Scheduler(max_num_seqs, k_for_batch_size)
        self.max_model_len = max_model_len
        self.stats = AcceptanceStats()
        self.num_steps = 0
        self.num_proposed_drafts = 0  # drafted, before the policy's select; stats.total counts the verified ones

    def add(self, request: Request) -> None:
        self.scheduler.add(request)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[Request]:
        """One engine step; returns the requests it finished."""
        start = time.perf_counter()
        requests, info, condense_seconds = self._plan()
        plan = self.policy.draft_limits(info)
        drafted, draft_seconds = self._timed(self._propose, requests, plan)
        proposal = drafted.prefix(self.policy.select(info, drafted, draft_seconds))
        (result, finished), verify_seconds = self._timed(self._verify_and_commit, requests, proposal, plan.k)
        self.policy.observe(info, StepOutcome(proposal, result.num_accepted, drafted.num_draft_tokens,
                                              time.perf_counter() - start, draft_seconds, verify_seconds,
                                              condense_seconds))
        return finished

    def run(self, on_finish: Callable[[Request], None] = lambda r: None) -> float:
        """Step until every added request is finished; returns the wall time in seconds."""
        start = time.perf_counter()
        requests = list(self.scheduler.waiting)
        is_closed = not self.scheduler.running and len(requests) <= self.scheduler.max_num_seqs
        self.policy.begin_run(len(requests), is_closed)
        while self.has_unfinished:
            for request in self.step():
                on_finish(request)
        self.policy.end_run(RunOutcome([len(r.output_ids) for r in requests],
                                       [r.max_completion_len(self.max_model_len) for r in requests],
                                       [r.acceptance for r in requests]))
        return time.perf_counter() - start

    def abort(self) -> None:
        """Release every running request's cache slots after an error, so the runner and drafter stay usable."""
        for request in list(self.scheduler.running):
            self._release(request)

    def _plan(self) -> tuple[list[Request], StepInfo, float]:
        """Schedule the step, give new requests their slots and move the batch into its lowest slots; the running
        requests in slot order (a batch in slots 0 .. n - 1 reads its keys as one slice of the cache, not a gather),
        the step as the policy sees it, and the seconds the moves took."""
        plan = self.scheduler.plan()
        self._prefill(plan)
        _, condense_seconds = self._timed(self._condense, plan.requests)
        requests = sorted(plan.requests, key=lambda r: r.slot)
        info = StepInfo([r.req_id for r in requests], [r.num_tokens - self.runner.seq_len(r.slot) for r in requests],
                        [min(plan.k_max, r.room_for_drafts(self.max_model_len)) for r in requests], plan.k_max)
        return requests, info, condense_seconds

    def _prefill(self, plan: StepPlan) -> None:
        """Give each admitted request a slot. A prompt that several requests share is computed once, by a
        running sibling or by the first new one, and copied into the others' slots; a prompt nobody shares is
        prefilled by the verification forward itself (its uncached tokens are the whole prompt)."""
        holders = {r.group_id: r for r in plan.requests if r.slot is not None}
        groups: dict[int, list[Request]] = {}
        for request in plan.new_requests:
            request.slot = self.runner.allocate()
            groups.setdefault(request.group_id, []).append(request)
        feed, copies = [], []
        for group_id, members in groups.items():
            holder = holders.get(group_id)
            if len(members[0].prompt_ids) == 1 or (holder is None and len(members) == 1):
                continue
            if holder is None:
                holder, members = members[0], members[1:]
                feed.append(holder)
            copies += [(holder, member) for member in members]
        if feed:
            self.runner.forward([r.slot for r in feed], [r.prompt_ids[:-1] for r in feed], [0] * len(feed))
        for holder, request in copies:
            self.runner.copy_prefix(holder.slot, request.slot, len(request.prompt_ids) - 1)

    def _condense(self, requests: list[Request]) -> None:
        """Move the requests in slots at or above n = len(requests) into the free slots below it, so that the batch
        holds slots 0 .. n - 1 (vLLM's InputBatch.condense, for the same reason). Requests finish out of slot order
        and leave holes, and attention over rows in scattered slots gathers every layer's keys and values: at 100
        rows of 60 tokens, 23.8 ms a forward against 15.8 from one slice. A move copies one row's cache once."""
        num_rows = len(requests)
        movers = [r for r in requests if r.slot >= num_rows]
        for request in movers:  # the runner hands out its lowest free slot: a hole below num_rows
            slot = self.runner.allocate()
            self.runner.copy_prefix(request.slot, slot, self.runner.seq_len(request.slot))
            self.runner.free(request.slot)
            request.slot = slot

    def _propose(self, requests: list[Request], plan: DraftPlan) -> Proposal:
        if self.proposer is None or not any(plan.num_drafts):
            return Proposal([[] for _ in requests], [[] for _ in requests])
        proposal = self.proposer.propose([r.draft_view() for r in requests], plan.num_drafts, reveal=plan.reveal)
        proposal.validate(plan.num_drafts, source=type(self.proposer).__name__)
        self.num_proposed_drafts += sum(proposal.num_draft_tokens)
        return self._cut_at_stop(requests, proposal)

    def _cut_at_stop(self, requests: list[Request], proposal: Proposal) -> Proposal:
        """Drop the drafts after a draft stop token: if the stop is accepted the request ends there, so
        verifying (and counting) what follows it would be wasted."""
        lengths = [next((j + 1 for j, t in enumerate(drafts) if t in r.stop_ids), len(drafts))
                   for r, drafts in zip(requests, proposal.token_ids)]
        return proposal.prefix(lengths)

    @staticmethod
    def _timed(function, *args):
        """function(*args) and the seconds it took."""
        start = time.perf_counter()
        return function(*args), time.perf_counter() - start

    def _verify_and_commit(self, requests: list[Request], proposal: Proposal,
                           k: int) -> tuple[VerifyResult, list[Request]]:
        result = self._verify(requests, proposal)
        return result, self._commit(requests, proposal, result, k)

    def _verify(self, requests: list[Request], proposal: Proposal) -> VerifyResult:
        """One target forward over sum(k_i + 1) tokens (each row's uncached tokens, then its drafts), then
        rejection sampling."""
        slots = [r.slot for r in requests]
        feeds = [r.token_ids[self.runner.seq_len(r.slot):] + d for r, d in zip(requests, proposal.token_ids)]
        logits = self.runner.forward(slots, feeds, [len(d) + 1 for d in proposal.token_ids])
        if not bool(torch.isfinite(logits).all()):
            raise ValueError("the target model produced non-finite logits (NaN or inf); check its weights and "
                             "dtype (e.g. float16 overflow on CPU: pass dtype=torch.float32)")
        sampling = SamplingTensors.build([r.params.temperature for r in requests], [r.params.top_k for r in requests],
                                         [r.params.top_p for r in requests], device=logits.device)
        uniforms = []  # each verified position's pair, read where the request's output stands (spec/uniforms.py)
        for request, drafts in zip(requests, proposal.token_ids):
            num_positions = len(drafts) + 1
            uniforms += ([[0.0, 0.0]] * num_positions if request.params.temperature == 0
                         else request.uniforms.take(len(request.output_ids), num_positions))
        return rejection_sample(logits, proposal.token_ids, sampling, torch.tensor(uniforms), proposal.draft_probs)

    def _commit(self, requests: list[Request], proposal: Proposal, result: VerifyResult, k: int) -> list[Request]:
        self.stats.observe_step(len(requests), k)
        self.num_steps += 1
        finished = []
        for request, outcomes in zip(requests, proposal.revealed or ()):
            request.acceptance.revealed.update(outcomes)
        for request, drafts, tokens, logprobs, num_accepted in zip(
                requests, proposal.token_ids, result.token_ids, result.logprobs, result.num_accepted):
            request.acceptance.observe(len(drafts), num_accepted)
            # any() stops at the first token that finishes the request: tokens after a stop are dropped
            if any(request.append(t, lp, self.max_model_len) for t, lp in zip(tokens, logprobs)):
                self._release(request)
                self.stats.add(request.acceptance)
                finished.append(request)
            else:
                self.runner.crop(request.slot, request.num_tokens - 1)
        return finished

    def _release(self, request: Request) -> None:
        self.scheduler.finish(request)
        if request.slot is not None:
            self.runner.free(request.slot)
            request.slot = None
        if self.proposer is not None:
            self.proposer.finish(request.draft_view())
