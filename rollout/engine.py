"""The engine loop: each step is plan -> propose -> verify -> commit -> finish.

Token ids only; tokenisation lives in the generator. Target cache invariant between steps: a running request's
slot holds every committed token but the last one, so the next verification feeds that token plus the drafts
and reads k + 1 logits: position j predicts draft j + 1, the last one the bonus token. After verification the
slot is cropped back to the invariant: rejected drafts vanish by moving the length back, nothing recomputed.

With adaptive verification (spec/adaptive.py) the proposal is trimmed per request before verification, and
after it the judged drafts teach the calibrator and the measured times refine the step-cost model. A run of two
or more requests that all start at its first step (a closed batch) offers every request up to the K that replaying
the last ones of its size found fastest, 0 included (spec/closed_batch.py), drafting as deep as its critical path
pays and, in steps of 32 rows or more, verifying each request's first draft and the further ones that pay at the
batch's rate (spec/adaptive.py); its outcome is replayed in turn (a draft model reveals what its drafts would have
done where none was verified: Proposal.revealed, and so does the first draft cut after drafts all accepted), and it
teaches the calibrator and the cost model, where its size's replays record it (ClosedBatchSchedule.records).
"""

import time
from typing import Callable

import torch

from rollout.request import Request
from rollout.scheduler import Scheduler, StepPlan
from spec import (AcceptanceStats, AdaptiveVerifier, Proposal, Proposer, SamplingTensors, VerifyResult,
                  rejection_sample)
from spec.batch_replay import BatchTiming
from spec.closed_batch import MIN_REQUESTS


class Engine:
    def __init__(self, runner, proposer: Proposer | None, k_for_batch_size: Callable[[int], int], *,
                 max_num_seqs: int, max_model_len: int, adaptive: AdaptiveVerifier | None = None):
        self.runner = runner
        self.proposer = proposer
        self.adaptive = adaptive
        self.scheduler = Scheduler(max_num_seqs, k_for_batch_size)
        self.max_model_len = max_model_len
        self.stats = AcceptanceStats()
        self.num_steps = 0
        self.num_proposed_drafts = 0  # before adaptive trimming; stats.total counts the verified ones
        self.draft_cap: int | None = None  # the run's closed-batch K, 0: no drafts (spec/closed_batch.py); None: no cap
        self.timing = BatchTiming()

    def add(self, request: Request) -> None:
        self.scheduler.add(request)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[Request]:
        """One engine step; returns the requests it finished."""
        start = time.perf_counter()
        plan = self.scheduler.plan()
        self._prefill(plan)
        clock = time.perf_counter()
        self._condense(plan.requests)
        condense_seconds = time.perf_counter() - clock
        # Rows in slot order: a batch in slots 0 .. n - 1 reads its keys as one slice of the cache, not a gather.
        requests = sorted(plan.requests, key=lambda r: r.slot)
        k_max = plan.k_max if self.draft_cap is None else min(plan.k_max, self.draft_cap)
        num_drafts = [min(k_max, r.room_for_drafts(self.max_model_len)) for r in requests]
        uncached = [] if self.adaptive is None else [r.num_tokens - self.runner.seq_len(r.slot) for r in requests]
        req_ids = None if self.adaptive is None else [r.req_id for r in requests]
        if self.adaptive is not None:
            self.adaptive.begin_step(len(requests), sum(uncached), k_max)
        clock = time.perf_counter()
        proposal = self._propose(requests, num_drafts)
        drafted, draft_seconds = proposal.num_draft_tokens, time.perf_counter() - clock
        self.num_proposed_drafts += sum(drafted)
        cut = None  # under a closed batch's cap, the drafts as drafted, before verified_under_cap cut them
        if self.adaptive is not None and self.adaptive.trims:
            # with no drafts too: the step's rate prices the next step's drafting
            proposal = self._allocate(req_ids, proposal, uncached, draft_seconds)
        elif self.adaptive is not None and self.adaptive.cuts_under_cap(drafted):
            cut, proposal = proposal, _trim(proposal, self.adaptive.verified_under_cap(req_ids, proposal.confidence))
            draft_seconds = time.perf_counter() - clock  # choosing the drafts to verify is part of drafting them
        clock = time.perf_counter()
        result = self._verify(requests, proposal)
        self.stats.observe_step(plan.batch_size, k_max)
        self.num_steps += 1
        if self.adaptive is not None:  # before the commit, which ends finished requests' adaptive records
            self.adaptive.observe(req_ids, proposal.confidence, result.num_accepted)
        revealing = cut is not None and self.adaptive.traced and cut.draft_probs is None
        starts = [len(r.output_ids) for r in requests] if revealing else None
        finished = self._commit(requests, proposal, result)
        if revealing:
            _reveal_cut(requests, starts, cut, proposal, result)
        verify_seconds = time.perf_counter() - clock
        if self.adaptive is not None:
            self.adaptive.observe_times(uncached, proposal.num_draft_tokens, verify_seconds)
        self.timing.observe_step(time.perf_counter() - start, draft_seconds, verify_seconds,
                                 sum(proposal.num_draft_tokens), condense_seconds)
        return finished

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

    def _propose(self, requests: list[Request], num_drafts: list[int]) -> Proposal:
        if self.proposer is None or not any(num_drafts):
            return Proposal([[] for _ in requests], [[] for _ in requests])
        proposal = self.proposer.propose([r.draft_view() for r in requests], num_drafts)
        proposal.validate(num_drafts, source=type(self.proposer).__name__)
        return self._cut_at_stop(requests, proposal)

    def _allocate(self, req_ids: list[int], proposal: Proposal, uncached: list[int], draft_seconds: float) -> Proposal:
        """Keep the prefix of each request's drafts that adaptive verification admits."""
        budget = self.adaptive.allocate(req_ids, proposal.confidence, uncached, draft_seconds)
        return _trim(proposal, budget.lengths)

    def _cut_at_stop(self, requests: list[Request], proposal: Proposal) -> Proposal:
        """Drop the drafts after a draft stop token: if the stop is accepted the request ends there, so
        verifying (and counting) what follows it would be wasted."""
        lengths = [next((j + 1 for j, t in enumerate(drafts) if t in r.stop_ids), len(drafts))
                   for r, drafts in zip(requests, proposal.token_ids)]
        return _trim(proposal, lengths)

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

    def _commit(self, requests: list[Request], proposal: Proposal, result: VerifyResult) -> list[Request]:
        finished = []
        for request, outcomes in zip(requests, proposal.revealed or ()):
            request.acceptance.revealed.update(outcomes)
        for request, drafts, tokens, logprobs, num_accepted in zip(
                requests, proposal.token_ids, result.token_ids, result.logprobs, result.num_accepted):
            request.acceptance.observe(len(drafts), num_accepted)
            # any() stops at the first token that finishes the request: tokens after a stop are dropped
            if any(request.append(t, lp, self.max_model_len) for t, lp in zip(tokens, logprobs)):
                self._finish(request)
                finished.append(request)
            else:
                self.runner.crop(request.slot, request.num_tokens - 1)
        return finished

    def _finish(self, request: Request) -> None:
        self._release(request)
        self.stats.add(request.acceptance)

    def _release(self, request: Request) -> None:
        self.scheduler.finish(request)
        if request.slot is not None:
            self.runner.free(request.slot)
            request.slot = None
        if self.proposer is not None:
            self.proposer.finish(request.draft_view())
        if self.adaptive is not None:
            self.adaptive.finish(request.req_id)

    def abort(self) -> None:
        """Release every running request's cache slots after an error, so the runner and drafter stay usable."""
        for request in list(self.scheduler.running):
            self._release(request)

    def run(self, on_finish: Callable[[Request], None] = lambda r: None) -> float:
        """Step until every added request is finished; returns the wall time in seconds."""
        start = time.perf_counter()
        schedule = None if self.adaptive is None else self.adaptive.closed_batch
        batch = list(self.scheduler.waiting)
        is_closed = (schedule is not None and not self.scheduler.running
                     and MIN_REQUESTS <= len(batch) <= self.scheduler.max_num_seqs)
        self.draft_cap = schedule.k_max(len(batch)) if is_closed else None
        if self.adaptive is not None:  # no per-step allocation under a closed batch's cap (spec/closed_batch.py)
            self.adaptive.trims = self.draft_cap is None
            self.adaptive.traced = is_closed and schedule.records(len(batch))
            self.adaptive.learns = not is_closed or self.adaptive.traced
        self.timing = BatchTiming()
        while self.has_unfinished:
            for request in self.step():
                on_finish(request)
        if is_closed:
            schedule.observe([len(r.output_ids) for r in batch],
                             [r.max_completion_len(self.max_model_len) for r in batch],
                             [r.acceptance for r in batch], self.timing, self.adaptive.costs,
                             k_limit=self.scheduler.k_for_batch_size(len(batch)))
        return time.perf_counter() - start


def _reveal_cut(requests: list[Request], starts: list[int], drafted: Proposal, verified: Proposal,
                result: VerifyResult) -> None:
    """Where a request verified all its drafts that were not cut, and accepted them, the token emitted after them
    stands where its first cut draft did: with point proposals that draft would have been accepted if and only if it
    is that token (spec/rejection.py). The trace of a closed batch reads it (RequestAcceptance.revealed); the drafter
    cannot reveal it, as its cache holds the cut draft (spec/proposers/draft_model.py)."""
    for request, start, full, kept, tokens in zip(requests, starts, drafted.token_ids, verified.token_ids,
                                                  result.token_ids):
        position = start + len(kept)
        if len(full) > len(kept) and len(tokens) > len(kept) and position < len(request.output_ids):
            request.acceptance.revealed[position] = full[len(kept)] == tokens[len(kept)]


def _trim(proposal: Proposal, lengths: list[int]) -> Proposal:
    """The first lengths[i] drafts of each request."""
    if lengths == proposal.num_draft_tokens:
        return proposal
    return Proposal(_cut(proposal.token_ids, lengths), _cut(proposal.confidence, lengths),
                    None if proposal.draft_probs is None else _cut(proposal.draft_probs, lengths), proposal.revealed)


def _cut(rows: list, lengths: list[int]) -> list:
    return [row[:n] for row, n in zip(rows, lengths)]

