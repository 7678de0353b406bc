"""Draft-model drafter (vLLM's `method: "draft_model"`): a small causal LM proposes k tokens autoregressively.

Per request the drafter keeps a model-runner slot and `cached`, the token ids whose keys/values that slot
holds. A step for requests with k > 0:

1. `sync`: roll each cache back to the longest common prefix of `cached` and the request's committed
   `token_ids` (rejected drafts are dropped; nothing is recomputed), keeping at least one token uncached so
   that there is a logit to draft from. New requests get a slot; one whose sibling (same `group_id`) already
   holds the shared prompt copies it instead of prefilling it again.
2. One ragged forward over every row's uncached tokens (one logit per row), then up to k - 1 one-token
   forwards over the rows still drafting. After k drafts the cache holds token_ids + drafts[:k-1].
   A row stops at a stop token of its request. A row given no drafts is neither synced nor fed: its uncached
   tokens wait for a later step's first forward. Each forward after the first is timed
   (`Proposal.forward_seconds`): it is what one more draft costs.

The draft distribution q is `processed_logprobs` under the request's temperature / top-k / top-p.
`draft_sample_method="greedy"`: the draft is argmax q, a point proposal (draft_probs=None).
`"probabilistic"`: the draft is sampled from q with the request's generator and draft_probs holds the q rows
(one-hot rows for temperature-0 requests, which the target verifies greedily). Either way confidence = q(draft).
"""

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from spec.config import DRAFT_SAMPLE_METHODS
from spec.model_runner import build_runner
from spec.proposers.base import DraftRequest, Proposal
from spec.sampling import SamplingTensors, draw_uniforms, inverse_cdf_sample, processed_logprobs


@dataclass
class _DraftState:
    slot: int
    group_id: int
    cached: list[int]  # token ids whose keys/values the slot holds
    num_committed: int = 0  # len(token_ids) at the last sync; cached[:num_committed] holds committed tokens


class _Drafts:
    """Per-request drafts, their confidences and (probabilistic) q rows, filled one step at a time."""

    def __init__(self, num_reqs: int):
        self.token_ids: list[list[int]] = [[] for _ in range(num_reqs)]
        self.confidence: list[list[float]] = [[] for _ in range(num_reqs)]
        self.probs: list[list[torch.Tensor]] = [[] for _ in range(num_reqs)]
        self.forward_seconds: list[tuple[int, float]] = []  # (rows, seconds) of each forward after the first

    def add(self, rows: list[int], tokens: list[int], confidence: list[float], q: torch.Tensor | None) -> None:
        for j, i in enumerate(rows):
            self.token_ids[i].append(tokens[j])
            self.confidence[i].append(confidence[j])
            if q is not None:
                self.probs[i].append(q[j])

    def merge(self, rows: list[int], other: "_Drafts") -> None:
        for j, i in enumerate(rows):
            self.token_ids[i], self.confidence[i] = other.token_ids[j], other.confidence[j]
            self.probs[i] = other.probs[j]
        self.forward_seconds += other.forward_seconds


class DraftModelProposer:
    """Drafts with a loaded HF causal LM through `build_runner` (RaggedRunner when the architecture allows)."""

    def __init__(self, model, *, max_num_seqs: int, max_model_len: int, draft_sample_method: str = "greedy",
                 device=None, dtype=None):
        if draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"draft_sample_method={draft_sample_method!r} is not one of {DRAFT_SAMPLE_METHODS}")
        self.draft_sample_method = draft_sample_method
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.runner = build_runner(model, max_num_seqs, max_model_len, device=device, dtype=dtype)
        self._states: dict[int, _DraftState] = {}

    def propose(self, requests: Sequence[DraftRequest], max_num_tokens: Sequence[int]) -> Proposal:
        if len(requests) != len(max_num_tokens):
            raise ValueError(f"propose got {len(requests)} requests and {len(max_num_tokens)} max_num_tokens")
        ks = [self._num_drafts(r, k) for r, k in zip(requests, max_num_tokens)]
        active = [i for i, k in enumerate(ks) if k > 0]
        drafts = _Drafts(len(requests))
        if active:
            drafts.merge(active, self._draft([requests[i] for i in active], [ks[i] for i in active]))
        if self.draft_sample_method == "greedy":
            return Proposal(drafts.token_ids, drafts.confidence, forward_seconds=drafts.forward_seconds)
        empty = torch.empty(0, self._vocab_size(), device=self.runner.device)
        draft_probs = [torch.stack(q) if q else empty for q in drafts.probs]
        return Proposal(drafts.token_ids, drafts.confidence, draft_probs, forward_seconds=drafts.forward_seconds)

    def _num_drafts(self, request: DraftRequest, k: int) -> int:
        """k capped by the room left: the cache holds token_ids + drafts[:k-1]. A request that is already
        too long keeps k > 0, so that sync() reports it."""
        room = self.max_model_len - len(request.token_ids) + 1
        return max(0, k) if room < 1 else max(0, min(k, room))

    @property
    def num_requests(self) -> int:
        """Requests holding a cache slot."""
        return len(self._states)

    def finish(self, request: DraftRequest) -> None:
        state = self._states.pop(request.req_id, None)
        if state is not None:
            self.runner.free(state.slot)

    def release_all(self) -> None:
        """Drop every request's state and free every slot, whatever a failed step left half-done (base.py);
        the next propose starts each request afresh (a prefill of its tokens)."""
        self._states.clear()
        self.runner.release_all()

    def _draft(self, requests: list[DraftRequest], ks: list[int]) -> "_Drafts":
        """Up to ks[i] > 0 drafts for each request: one forward over the uncached tokens, then one token at a
        time."""
        drafts = _Drafts(len(requests))
        uncached = self.sync(requests)
        states = [self._states[r.req_id] for r in requests]
        sampling = SamplingTensors.build([r.temperature for r in requests], [r.top_k for r in requests],
                                         [r.top_p for r in requests], device=self.runner.device)
        logits = self._feed(states, uncached)  # [rows, vocab]
        rows = list(range(len(requests)))
        start = None  # each forward after the first is timed with the drafts it samples
        for step in range(max(ks)):
            drafts.add(rows, *self._sample(logits, [requests[i] for i in rows], sampling.select(rows)))
            if start is not None:
                drafts.forward_seconds.append((len(rows), time.perf_counter() - start))
            # a row that drafted a stop token is done: the engine verifies nothing after it
            rows = [i for i in rows if ks[i] > step + 1 and drafts.token_ids[i][-1] not in requests[i].stop_ids]
            if not rows:
                break
            start = time.perf_counter()
            logits = self._feed([states[i] for i in rows], [drafts.token_ids[i][-1:] for i in rows])  # [rows, vocab]
        return drafts

    def _feed(self, states: list[_DraftState], token_ids: list[list[int]]) -> torch.Tensor:
        """Append token_ids to the rows' caches; the logits after each row's last token [rows, vocab]."""
        logits = self.runner.forward([s.slot for s in states], token_ids, [1] * len(states))
        for state, tokens in zip(states, token_ids):
            state.cached.extend(tokens)
        return logits

    def _sample(self, logits: torch.Tensor, requests: list[DraftRequest], sampling: SamplingTensors):
        """Drafts [n], their q probabilities [n] and, when probabilistic, the q rows [n, vocab]."""
        logq = processed_logprobs(logits, sampling)  # [n, vocab]
        drafts = logq.argmax(dim=-1)
        if self.draft_sample_method == "greedy":
            return drafts.tolist(), _probability_of(logq, drafts), None
        one_hot = torch.nn.functional.one_hot(drafts, logq.shape[-1]).float()
        q = torch.where(sampling.is_greedy[:, None], one_hot, logq.exp())  # [n, vocab]
        if not bool(sampling.is_greedy.all()):
            wanted = (~sampling.is_greedy).tolist()  # one draw per sampled request, none for greedy ones
            uniform = draw_uniforms([r.generator for r in requests], wanted, q.device)
            drafts = torch.where(sampling.is_greedy, drafts, inverse_cdf_sample(q, uniform))
        return drafts.tolist(), _probability_of(logq, drafts), q

    def sync(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Roll every request's cache back to what it shares with token_ids; the uncached token ids per request.

        Every returned list has at least one token. Committed token_ids only ever grow (base.py), so the
        comparison starts at what was known to be committed at the previous step.
        """
        new = [r for r in requests if r.req_id not in self._states]
        self._check_fits(requests, len(new))
        for request in requests:
            if request.req_id in self._states:
                self._rollback(self._states[request.req_id], request.token_ids)
        for request in new:
            self._admit(request, new)
        return [r.token_ids[len(self._states[r.req_id].cached):] for r in requests]

    def _check_fits(self, requests: Sequence[DraftRequest], num_new: int) -> None:
        if num_new > self.runner.num_free_slots:
            raise ValueError(f"DraftModelProposer: {num_new} new requests need a cache slot but only "
                             f"{self.runner.num_free_slots} of max_num_seqs={self.max_num_seqs} are "
                             "free; raise max_num_seqs or call finish() for finished requests")
        for r in requests:
            if not 1 <= len(r.token_ids) <= self.max_model_len:
                raise ValueError(f"DraftModelProposer: request {r.req_id} has {len(r.token_ids)} tokens; it needs "
                                 f"between 1 and max_model_len={self.max_model_len}")

    def _rollback(self, state: _DraftState, token_ids: list[int]) -> None:
        """Crop the cache to the common prefix of cached and token_ids, at most len(token_ids) - 1."""
        keep = min(state.num_committed, len(token_ids))
        limit = min(len(state.cached), len(token_ids) - 1)  # at least one uncached token
        while keep < limit and state.cached[keep] == token_ids[keep]:
            keep += 1
        keep = min(keep, limit)
        self.runner.crop(state.slot, keep)
        del state.cached[keep:]
        state.num_committed = len(token_ids)

    def _admit(self, request: DraftRequest, new: list[DraftRequest]) -> None:
        """A slot for a new request, starting from a sibling's cached prefix where one exists. The state is recorded
        with its slot, before anything can fail: `cached` only grows after the forward or copy that fills it, and
        the next sync crops the slot to `cached` (so a failed prefill leaves the slot recorded and consistent)."""
        donor, length = self._best_donor(request)
        state = self._states[request.req_id] = _DraftState(self.runner.allocate(), request.group_id, cached=[])
        if donor is not None:
            self.runner.copy_prefix(donor.slot, state.slot, length)
            state.cached = request.token_ids[:length]
        elif any(r is not request and r.group_id == request.group_id for r in new):
            # The first of several new siblings prefills the shared prompt alone; the others copy it.
            prompt = request.token_ids[:min(request.num_prompt_tokens, len(request.token_ids) - 1)]
            if prompt:
                self.runner.forward([state.slot], [prompt], [0])
                state.cached = list(prompt)
        state.num_committed = len(request.token_ids)

    def _best_donor(self, request: DraftRequest) -> tuple[_DraftState | None, int]:
        """The sibling state sharing the longest cached prefix with the request (at most len - 1 tokens)."""
        best, best_length = None, 0
        limit = len(request.token_ids) - 1
        for state in self._states.values():
            if state.group_id != request.group_id:
                continue
            length = _common_prefix_length(state.cached, request.token_ids, limit)
            if length > best_length:
                best, best_length = state, length
        return best, best_length

    def _vocab_size(self) -> int:
        return self.runner.model.config.vocab_size


def _probability_of(logq: torch.Tensor, tokens: torch.Tensor) -> list[float]:
    """q(token) of each row: logq [n, vocab], tokens [n]."""
    return logq.gather(1, tokens[:, None]).squeeze(1).exp().clamp(0.0, 1.0).tolist()


def _common_prefix_length(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid)
    return lo
