"""The drafter protocol: what every proposer (draft model, n-gram, suffix, custom class) takes and returns.

Vocabulary (as in vLLM's spec decode): a proposer offers *draft tokens*; verification *accepts* a prefix of
them, then emits one more token: a *recovered* token (resampled at the first rejected position) or, when every
draft was accepted, a *bonus* token. A proposer's whole view of a request is its committed `token_ids`
(prompt + output so far): rejected drafts never appear there, so a stateful proposer rolls back by comparing
what it has cached with `token_ids` at the next call.
"""

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


class DrafterConfigError(ValueError):
    """A drafter that cannot work with this target or config (e.g. it proposes token ids outside the target's
    vocabulary): a bug to fix, so the engine fails the call instead of rolling out without the drafts."""


@dataclass
class DraftRequest:
    """One running request as a proposer sees it."""

    req_id: int  # unique for the request's lifetime
    group_id: int  # the prompt it samples; siblings (same prompt) share it
    token_ids: list[int]  # prompt + committed output
    num_prompt_tokens: int
    temperature: float = 0.0  # sampling settings, for drafters that sample from a processed q
    top_k: int = -1
    top_p: float = 1.0
    generator: torch.Generator | None = None  # the request's own seeded generator
    stop_ids: frozenset[int] = frozenset()  # tokens that end the request: drafts after one are never verified

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass
class Proposal:
    """Drafts for a batch of requests, in request order.

    token_ids[i]: up to max_num_tokens[i] draft tokens for request i (fewer or none allowed).
    confidence[i]: one value in [0, 1] per draft: the drafter's estimate that this draft is accepted given
        that the drafts before it were (draft-model probability, match frequency, ...).
    draft_probs: None when drafts are point proposals (q is one-hot at the draft token); otherwise, per
        request, the processed draft distribution each draft was sampled from, [len(token_ids[i]), vocab].
    forward_seconds: optional, (rows, seconds) of each of the drafter's forwards after its first one: what one
        more draft for that many rows cost, which adaptive verification's cost model learns from.
    """

    token_ids: list[list[int]]
    confidence: list[list[float]]
    draft_probs: list[torch.Tensor] | None = None
    forward_seconds: list[tuple[int, float]] | None = None

    @property
    def num_draft_tokens(self) -> list[int]:
        return [len(t) for t in self.token_ids]

    def prefix(self, lengths: Sequence[int]) -> "Proposal":
        """The first lengths[i] drafts of each request (self where that is all of them)."""
        if list(lengths) == self.num_draft_tokens:
            return self
        return Proposal(_cut(self.token_ids, lengths), _cut(self.confidence, lengths),
                        None if self.draft_probs is None else _cut(self.draft_probs, lengths),
                        self.forward_seconds)

    def validate(self, max_num_tokens: Sequence[int], source: str, vocab_size: int | None = None) -> None:
        """ValueError naming `source` when the proposal breaks the protocol; DrafterConfigError when a draft is not a
        token id of a vocabulary of `vocab_size` (when given)."""
        if len(self.token_ids) != len(max_num_tokens) or len(self.confidence) != len(max_num_tokens):
            raise ValueError(f"{source}: proposal has {len(self.token_ids)} token lists and {len(self.confidence)} "
                             f"confidence lists for {len(max_num_tokens)} requests; return one of each per request")
        for i, (tokens, conf, k) in enumerate(zip(self.token_ids, self.confidence, max_num_tokens)):
            if len(tokens) > k or len(conf) != len(tokens):
                raise ValueError(f"{source}: request {i} got {len(tokens)} drafts and {len(conf)} confidences "
                                 f"with at most {k} allowed; return at most k drafts and one confidence per draft")
            bad = [c for c in conf if not 0.0 <= c <= 1.0]
            if bad:
                raise ValueError(f"{source}: confidence {bad[0]!r} of request {i} is outside [0, 1]; "
                                 "return acceptance-probability estimates in [0, 1]")
        if vocab_size is not None:
            self._check_vocab(vocab_size, source)
        if self.draft_probs is not None:
            self._check_draft_probs(vocab_size, source)

    def _check_vocab(self, vocab_size: int, source: str) -> None:
        rows = [tokens for tokens in self.token_ids if tokens]
        if rows and not 0 <= min(map(min, rows)) <= max(map(max, rows)) < vocab_size:
            bad = next(t for tokens in rows for t in tokens if not 0 <= t < vocab_size)
            raise DrafterConfigError(
                f"{source}: draft token id {bad} is outside the target's vocabulary [0, {vocab_size}); that is a bug "
                "in the drafter or its configuration (another tokenizer or model than the target's?), not a "
                "transient fault, so the call fails; propose token ids of the target's vocabulary")

    def _check_draft_probs(self, vocab_size: int | None, source: str) -> None:
        """One finite [num_drafts, vocab] tensor per request."""
        if len(self.draft_probs) != len(self.token_ids):
            raise ValueError(f"{source}: proposal has {len(self.draft_probs)} draft_probs tensors for "
                             f"{len(self.token_ids)} requests; return one per request, or draft_probs=None")
        for i, (probs, tokens) in enumerate(zip(self.draft_probs, self.token_ids)):
            if probs.dim() != 2 or probs.shape[0] != len(tokens) or probs.shape[1] != (vocab_size or probs.shape[1]):
                raise ValueError(f"{source}: draft_probs[{i}] has shape {tuple(probs.shape)}; return one "
                                 f"[num_drafts={len(tokens)}, vocab={vocab_size or 'V'}] tensor per request")
        probs = [p for p in self.draft_probs if p.numel()]
        # each row's L1 norm, in one fused pass and no copy (a NaN or inf makes it non-finite)
        if probs and not bool(torch.isfinite(torch.stack(torch._foreach_norm(probs, 1))).all()):
            raise ValueError(f"{source}: draft_probs hold non-finite values (NaN or inf); return probabilities")


class Proposer(Protocol):
    """What the engine calls. `max_num_tokens[i]` caps the drafts of requests[i] this step (0 allowed).

    Faults. A propose that raises an Exception or returns a proposal that breaks the protocol costs the step its
    drafts, not the call (spec/drafting_host.py); a drafter whose state a failed step may have left half-done offers
    `release_all()`, which the engine calls then (and after a failed call) to drop every request's state: the next
    propose starts them afresh. Drafters without it are told `finish` for each request of a failed call."""

    def propose(self, requests: Sequence[DraftRequest], max_num_tokens: Sequence[int]) -> Proposal:
        ...

    def finish(self, request: DraftRequest) -> None:
        """The request is done (its token_ids are final): free its state, learn from its output."""
        ...


def _cut(rows: list, lengths: Sequence[int]) -> list:
    return [row[:n] for row, n in zip(rows, lengths)]
