"""Prompt lookup decoding (vLLM's `method: "ngram"`): draft by copying what followed the context's tail earlier on.

Rule, per request, with context = token_ids (prompt + committed output), L = len(context) and k = max_num_tokens:
for n from prompt_lookup_max down to prompt_lookup_min (skipping n >= L), the pattern is the last n tokens of the
context; its occurrences are the starts i with context[i:i+n] == pattern and i + n <= L - 1 (at least one
continuation token exists, so the suffix itself is excluded). The first n (the longest) with an occurrence wins:
the drafts are context[i+n : i+n+k] for the most recent occurrence (largest i), fewer when they run into the end
of the context. No occurrence for any n, or k == 0: no drafts.

Confidence is a match frequency: confidence[j] = (occurrences whose continuation agrees with the drafts on
positions 0..j) / (occurrences whose continuation agreed on 0..j-1 and has a position j), the conditional
frequency of draft j given the drafts before it. The most recent occurrence agrees everywhere, so each value
lies in (0, 1].
"""

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from spec.config_keys import check_prompt_lookup
from spec.proposers.base import DraftRequest, Proposal


class NgramProposer:
    """Stateless n-gram drafter; point proposals (draft_probs=None)."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        check_prompt_lookup(prompt_lookup_min, prompt_lookup_max)
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, requests: Sequence[DraftRequest], max_num_tokens: Sequence[int]) -> Proposal:
        if len(requests) != len(max_num_tokens):
            raise ValueError(f"got {len(requests)} requests and {len(max_num_tokens)} max_num_tokens; "
                             "pass one cap per request")
        token_ids, confidence = [], []
        for request, k in zip(requests, max_num_tokens):
            drafts, conf = self.propose_one(request.token_ids, k)
            token_ids.append(drafts)
            confidence.append(conf)
        return Proposal(token_ids=token_ids, confidence=confidence, draft_probs=None)

    def propose_one(self, token_ids: Sequence[int], k: int) -> tuple[list[int], list[float]]:
        """(drafts, confidence) for one context under the rule in the module docstring."""
        max_n = min(self.prompt_lookup_max, len(token_ids) - 1)
        if k <= 0 or max_n < self.prompt_lookup_min:
            return [], []
        context = np.asarray(token_ids, dtype=np.int64)
        match_lengths = common_suffix_lengths(context, max_n)
        n = int(match_lengths.max())
        if n < self.prompt_lookup_min:
            return [], []
        continuation_starts = np.flatnonzero(match_lengths >= n) + 1  # i + n, ascending in i
        return draft_with_confidence(context, continuation_starts, k)

    def finish(self, request: DraftRequest) -> None:
        pass


def common_suffix_lengths(context: np.ndarray, max_n: int) -> np.ndarray:
    """[L - 1]: entry e is the length, capped at max_n, of the longest common suffix of context[:e+1] and context.

    An occurrence of the last-n-token pattern ending at e (starting at e - n + 1) is an entry >= n; e <= L - 2
    leaves a continuation token. Requires 1 <= max_n <= L - 1.
    """
    num_tokens = len(context)
    padded = np.concatenate([np.zeros(max_n - 1, dtype=context.dtype), context[:-1]])
    windows = sliding_window_view(padded, max_n)  # [L - 1, max_n], row e = context[e-max_n+1 : e+1]
    is_equal = windows == context[-max_n:]  # [L - 1, max_n]
    run_lengths = np.cumprod(is_equal[:, ::-1], axis=1).sum(axis=1)  # trailing equal tokens
    return np.minimum(run_lengths, np.arange(1, num_tokens))  # a run into the padding stops at the context start


def draft_with_confidence(context: np.ndarray, continuation_starts: np.ndarray,
                          k: int) -> tuple[list[int], list[float]]:
    """Drafts copied after the most recent occurrence, with the conditional match frequency of each draft.

    continuation_starts: [num_occurrences], ascending; each is the index of an occurrence's first continuation token.
    """
    num_tokens = len(context)
    drafts = context[continuation_starts[-1]:continuation_starts[-1] + k]
    positions = continuation_starts[:, None] + np.arange(len(drafts))  # [num_occurrences, num_drafts]
    has_position = positions < num_tokens
    agrees = has_position & (context[np.minimum(positions, num_tokens - 1)] == drafts)
    agreed_through = np.cumprod(agrees, axis=1, dtype=bool)  # agreed on 0..j
    agreed_before = np.concatenate([np.ones_like(agreed_through[:, :1]), agreed_through[:, :-1]], axis=1)
    num_agreed = agreed_through.sum(axis=0)
    num_eligible = (agreed_before & has_position).sum(axis=0)
    return drafts.tolist(), (num_agreed / num_eligible).tolist()
