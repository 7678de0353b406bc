"""The engine loop: each step is plan -> propose -> select -> verify -> commit -> observe.

Token ids only; tokenisation lives in the generator. Target cache invariant between steps: a running request's
slot holds every committed token but the last one, so the next verification feeds that token plus the drafts
and reads k + 1 logits: position j predicts draft j + 1, the last one the bonus token. After verification the
slot is cropped back to the invariant: rejected drafts vanish by moving the length back, nothing recomputed.

Proposing, selecting and observing are the drafting host's (spec/drafting_host.py), which vLLM's workers share: the
speculation policy (spec/policy.py) decides how many drafts each request drafts and verifies, drafts are cut at stop
ids, and a drafter fault costs only its step's drafts (with point proposals, seeded runs emit the very same tokens).
Requests of the call with the same prompt token ids are one group (PromptGroups): they share a prefill.

Failures. A run that raises anywhere (KeyboardInterrupt included) leaves no request behind: on its way out `run`
frees every cache slot of the target and the drafter and drops the drafter's per-request state, the error it
re-raises is the original one, and a cleanup that fails too is noted on it.
"""

import time
from typing import Callable

import torch

from rollout.embedded_backend.request import Request
from rollout.embedded_backend.scheduler import Scheduler, StepPlan
from spec import (
    AcceptanceStats,
    Proposal,
    Proposer,
    Runner,
    SamplingTensors,
    SpeculationPolicy,
    StepInfo,
    VerifyResult,
    rejection_sample,
)
from spec.drafting_host import MAX_DRAFTER_FAULTS, DraftingHost, PromptGroups


class Engine:
    """runner: the target's (spec/runner.py). vocab_size: the target's, which drafts must come from.
    max_drafter_faults: drafter faults a run tolerates before it stops drafting (spec/drafting_host.py); 0: none, the
    first fails the run. clock: seconds; every time the engine measures (a run's, each step's and its parts', which the
    policy is told) is read from it alone, so that a test can pass a fake one."""

    def __init__(self, runner: Runner, proposer: Proposer | None, policy: SpeculationPolicy,
                 k_for_batch_size: Callable[[int], int], *, max_num_seqs: int, max_model_len: int, vocab_size: int,
                 max_drafter_faults: int = MAX_DRAFTER_FAULTS, clock: Callable[[], float] = time.perf_counter):
        self.runner = runner
        self.clock = clock
        self.proposer = proposer
        self.host = DraftingHost(proposer, policy, vocab_size=vocab_size, verifies_draft_probs=True,
                                 max_drafter_faults=max_drafter_faults, clock=clock)
        self.prompt_groups = PromptGroups()
        self.scheduler = Scheduler(max_num_seqs, k_for_batch_size)
        self.max_model_len = max_model_len
        self.stats = AcceptanceStats()
        self.num_steps = 0

    @property
    def num_proposed_drafts(self) -> int:
        """Drafted, before the stop cut and the policy's select; stats.total counts the verified ones."""
        return self.host.num_proposed_drafts

    @property
    def num_drafter_faults(self) -> int:
        return self.host.num_faults

    def add(self, request: Request) -> None:
        """Queue a request; it joins the group of the call's requests with its prompt token ids."""
        request.group_id = self.prompt_groups.join(request.prompt_ids, request.group_id)
        self.scheduler.add(request)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[Request]:
        """One engine step; returns the requests it finished."""
        start = self.clock()
        requests, info, prefill_seconds, condense_seconds = self._plan()
        drafts = self.host.draft(info, lambda: [r.draft_view() for r in requests])
        (result, finished), verify_seconds = self._timed(self._verify_and_commit, requests, drafts.verified,
                                                         drafts.plan.k)
        # the step's seconds leave out the shared prompts' prefill, a forward of its own that no draft changes
        seconds = self.clock() - start - prefill_seconds
        self.host.observe(drafts, result.num_accepted, seconds, verify_seconds, condense_seconds)
        return finished

    def run(self, on_finish: Callable[[Request], None] = lambda r: None) -> float:
        """Step until every added request is finished; returns the seconds it took, by the clock (the wall time
        unless a test's). On an error, nothing of the run stays behind (module docstring)."""
        start = self.clock()
        try:
            self.host.begin_run()
            while self.has_unfinished:
                for request in self.step():
                    on_finish(request)
            self.host.end_run()
        except BaseException as error:
            self._release_all(error)
            raise
        return self.clock() - start

    def _release_all(self, error: BaseException) -> None:
        """Every running request leaves the scheduler and the drafter, and every cache slot is freed, whatever the
        failed step left half-done (a slot allocated and not yet recorded, a move between slots): the runner's and
        the drafter's `release_all` reset them whole."""
        running = self.scheduler.abort()
        _cleanup(error, self.runner.release_all)
        release = getattr(self.proposer, "release_all", None)
        if release is not None:
            _cleanup(error, release)
        elif self.proposer is not None:
            for request in running:
                _cleanup(error, self.proposer.finish, request.draft_view())

    def _plan(self) -> tuple[list[Request], StepInfo, float, float]:
        """Schedule the step, give new requests their slots and move the batch into its lowest slots; the running
        requests in slot order (a batch in slots 0 .. n - 1 reads its keys as one slice of the cache, not a gather),
        the step as the policy sees it, and the seconds the shared prefill and the moves took."""
        plan = self.scheduler.plan()
        _, prefill_seconds = self._timed(self._prefill, plan)
        _, condense_seconds = self._timed(self._condense, plan.requests)
        requests = sorted(plan.requests, key=lambda r: r.slot)
        info = StepInfo([r.req_id for r in requests], [r.num_tokens - self.runner.seq_len(r.slot) for r in requests],
                        [min(plan.k_max, r.room_for_drafts(self.max_model_len)) for r in requests], plan.k_max,
                        [r.max_completion_len(self.max_model_len) - len(r.output_ids) for r in requests],
                        len(self.scheduler.waiting))
        return requests, info, prefill_seconds, condense_seconds

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
            request.slot, old = slot, request.slot  # request.slot always names a slot that holds its cache
            self.runner.free(old)

    def _timed(self, function, *args):
        """function(*args) and the seconds it took."""
        start = self.clock()
        return function(*args), self.clock() - start

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
            raise ValueError(_non_finite_message(logits, requests, proposal))
        sampling = SamplingTensors.build([r.params.temperature for r in requests], [r.params.top_k for r in requests],
                                         [r.params.top_p for r in requests], device=logits.device)
        uniforms = []  # each verified position's pair, read where the request's output stands (spec/uniforms.py)
        for request, drafts in zip(requests, proposal.token_ids):
            num_positions = len(drafts) + 1
            uniforms += ([[0.0, 0.0]] * num_positions if request.params.temperature == 0
                         else request.uniforms.take(len(request.output_ids), num_positions))
        return rejection_sample(logits, proposal.token_ids, sampling, torch.tensor(uniforms), proposal.draft_probs)

    def _commit(self, requests: list[Request], proposal: Proposal, result: VerifyResult, k: int) -> list[Request]:
        self.stats.observe_step(len(requests), k, sum(proposal.num_draft_tokens))
        self.num_steps += 1
        finished = []
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
        if self.proposer is not None:  # first: where it raises, the request is still running for the cleanup
            self.proposer.finish(request.draft_view())
        self.scheduler.finish(request)
        self.prompt_groups.leave(request.prompt_ids)
        slot, request.slot = request.slot, None
        self.runner.free(slot)


def _cleanup(error: BaseException, function, *args) -> None:
    """function(*args); where it raises too, a note on `error`, which stays the one to see (a second Ctrl-C too)."""
    try:
        function(*args)
    except BaseException as secondary:
        error.add_note(f"releasing the run's cache slots and drafter state after this error also raised "
                       f"{type(secondary).__name__}: {secondary}")


def _non_finite_message(logits: torch.Tensor, requests: list[Request], proposal: Proposal) -> str:
    """What a verification forward with non-finite logits saw, and what usually causes it."""
    is_bad = (~torch.isfinite(logits)).any(dim=-1).tolist()  # per logit row, each request's k + 1 in order
    bad, offset = [], 0
    for request, drafts in zip(requests, proposal.token_ids):
        if any(is_bad[offset:offset + len(drafts) + 1]):
            bad.append(request.prompt_index)
        offset += len(drafts) + 1
    return (f"the target produced non-finite logits (NaN or inf) in a verification forward, for {len(bad)} of "
            f"{len(requests)} running requests (of prompts {sorted(set(bad))[:8]}); likely causes: non-finite target "
            "weights (e.g. loaded from a diverged training step) or a float16/bfloat16 overflow in the forward (on "
            "CPU pass dtype=torch.float32); the call stopped and released its cache slots")
