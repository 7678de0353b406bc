"""Suffix decoding (vLLM's `method: "suffix"`; Oliaro et al. 2024, arXiv 2411.04975), adapted to RL rollouts, and
the rollout-history drafter (`method: "history"`) built on it.

Two sources of drafts, both count-annotated suffix tries (spec/proposers/suffix_tree.py):
- a group trie per prompt (request.group_id), one sequence per request of the group (its prompt and committed
  output, brought up to date at every propose()): a request matches its own tokens and its siblings', finished ones
  included. With a rollout history (spec/proposers/history.py) it also holds the prompt's earlier rollouts (prompt +
  output, each distinct output once, weighted by its count), inserted when the group's first request is seen; every
  finished output goes to the history. Freed when the group's last member finishes.
- a global trie of the last finished requests' outputs, at most max_cached_requests of them and max_cached_tokens
  tokens (both bounds apply), evicted oldest first; an output longer than max_cached_tokens is not cached.

Per request, with k = max_num_tokens[i]: each trie speculates from the longest suffix of token_ids it holds
(match_length), capped at min(k, ceil(max_spec_factor * match_length)) drafts; the proposal with the higher score
(sum of its drafts' conditional frequencies in their trie) wins, ties to the group trie. confidence[j] is draft j's
frequency times n / (n + MATCH_EVIDENCE), n the match length: a frequency alone cannot tell a prompt's earlier
rollout, matched over the whole prompt, from a continuation seen once after the same two tokens, and adaptive
verification calibrates confidences by value (spec/adaptive/calibration.py).
"""

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from spec.config_keys import check_keys
from spec.proposers.base import DraftRequest, Proposal
from spec.proposers.history import HistoryStore
from spec.proposers.suffix_tree import SuffixTree

MATCH_EVIDENCE = 4  # a match of 4 tokens halves a draft's confidence, one of 20 keeps 5/6 of it: on the shipped
# task a 1-2 token match continues right about one time in ten, a whole prompt's nine times in ten


@dataclass
class _Group:
    trie: SuffixTree
    had_history: bool  # the prompt had earlier rollouts in the history when the group started
    live_req_ids: set[int] = field(default_factory=set)  # seen and not finished


class SuffixProposer:
    """Model-free drafter; point proposals (draft_probs=None). Arguments are vLLM's `suffix_decoding_*` keys, and
    `history`: the rollout history that group tries start from and finished outputs go to (None: none)."""

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1, max_cached_tokens: int = 100_000, history: HistoryStore | None = None):
        check_keys(suffix_decoding_max_tree_depth=max_tree_depth, suffix_decoding_max_cached_requests=max_cached_requests,
                   suffix_decoding_max_spec_factor=max_spec_factor, suffix_decoding_min_token_prob=min_token_prob,
                   suffix_decoding_max_cached_tokens=max_cached_tokens)
        self.history = history
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_cached_tokens = max_cached_tokens
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._groups: dict[int, _Group] = {}
        self._global_trie = SuffixTree(max_tree_depth)
        self._cached_seq_ids: deque[int] = deque()  # global trie sequences, oldest first
        self._next_seq_ids = itertools.count()
        self._history_seq_ids = itertools.count(-1, -1)  # history sequences in group tries: never a req_id
        self._started: set[int] = set()  # running requests counted below (a group rebuilt after release_all keeps them)
        # requests started, and of them those whose prompt had history then (history_hit_rate in the batch stats)
        self.history_counts = {"num_requests": 0, "num_requests_with_history": 0}

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    @property
    def num_cached_requests(self) -> int:
        return len(self._cached_seq_ids)

    @property
    def num_cached_tokens(self) -> int:
        return self._global_trie.num_tokens

    @property
    def num_cached_nodes(self) -> int:
        """The global trie's size: at most 1 + num_cached_tokens x max_tree_depth nodes."""
        return self._global_trie.num_nodes

    def propose(self, requests: Sequence[DraftRequest], max_num_tokens: Sequence[int]) -> Proposal:
        if len(requests) != len(max_num_tokens):
            raise ValueError(f"got {len(requests)} requests and {len(max_num_tokens)} max_num_tokens; "
                             "pass one cap per request")
        for request in requests:  # every trie is current before any request reads it
            self._sync(request)
        token_ids, confidence = [], []
        for request, k in zip(requests, max_num_tokens):
            drafts, conf = self._propose_one(request, k)
            token_ids.append(drafts)
            confidence.append(conf)
        return Proposal(token_ids=token_ids, confidence=confidence, draft_probs=None)

    def finish(self, request: DraftRequest) -> None:
        group = self._groups.get(request.group_id)
        if group is not None and request.req_id in group.live_req_ids:
            group.live_req_ids.discard(request.req_id)
            if group.live_req_ids:
                self._extend(group.trie, request)  # the last tokens, for the siblings still running
            else:
                del self._groups[request.group_id]
        self._started.discard(request.req_id)
        self.add_rollouts([request.token_ids[:request.num_prompt_tokens]], [request.output_token_ids])

    def add_rollouts(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> None:
        """Finished rollouts, as token ids of each prompt and its output: every output goes to the global cache and
        to the prompt's rollout history, as a finished request's does. Rollouts from elsewhere (another process's)
        come in here too."""
        for prompt, output in zip(prompts, outputs):
            self._cache_output(list(output))
            if self.history is not None:
                self.history.add(prompt, output)

    def release_all(self) -> None:
        """Drop every group trie (a failed call's, or a faulted step's): the next propose rebuilds the tries of the
        requests it is given. The global cache and the history keep only finished outputs, so they stay."""
        self._groups.clear()

    def _sync(self, request: DraftRequest) -> None:
        group = self._groups.get(request.group_id)
        if group is None:
            trie = self._group_trie(request)
            group = self._groups[request.group_id] = _Group(trie, had_history=trie.num_seqs > 0)
        group.live_req_ids.add(request.req_id)
        if self.history is not None and request.req_id not in self._started:
            self._started.add(request.req_id)
            self.history_counts["num_requests"] += 1
            self.history_counts["num_requests_with_history"] += group.had_history
        self._extend(group.trie, request)

    def _group_trie(self, request: DraftRequest) -> SuffixTree:
        """A new group's trie: its prompt's rollout history, each distinct output once with its count."""
        trie = SuffixTree(self.max_tree_depth)
        if self.history is not None:
            prompt = list(request.token_ids[:request.num_prompt_tokens])
            for entry in self.history.outputs(prompt):
                trie.add(next(self._history_seq_ids), prompt + entry.tokens.tolist(), weight=entry.count)
        return trie

    def _extend(self, trie: SuffixTree, request: DraftRequest) -> None:
        """Insert the tokens of request.token_ids that its sequence in trie does not have yet."""
        if request.req_id not in trie:
            trie.add(request.req_id)
        if not trie.extend_to(request.req_id, request.token_ids):
            raise ValueError(f"request {request.req_id}: token_ids no longer start with the tokens seen at earlier "
                             "calls; pass committed tokens only (they may only grow), and give a new request a new "
                             "req_id")

    def _propose_one(self, request: DraftRequest, k: int) -> tuple[list[int], list[float]]:
        if k <= 0:
            return [], []
        # the request is a sequence of its group trie, brought up to date by _sync: no search for its tail there
        best = self._cap(*self._groups[request.group_id].trie.match_sequence(request.req_id, k, self.min_token_prob),
                         k)
        if self._global_trie.num_seqs:
            other = self._cap(*self._global_trie.match(request.token_ids, k, self.min_token_prob), k)
            if sum(other[1]) > sum(best[1]):
                best = other
        drafts, probs, match_length = best
        evidence = match_length / (match_length + MATCH_EVIDENCE)
        return drafts, [p * evidence for p in probs]

    def _cap(self, drafts: list[int], probs: list[float], match_length: int,
             k: int) -> tuple[list[int], list[float], int]:
        """At most min(k, ceil(max_spec_factor x match_length)) drafts."""
        # the epsilon keeps float error (0.1 * 30 = 3.0000000000000004) from adding a draft
        num_allowed = min(k, math.ceil(self.max_spec_factor * match_length - 1e-9))
        return drafts[:num_allowed], probs[:num_allowed], match_length

    def _cache_output(self, output_token_ids: list[int]) -> None:
        """Cache a finished output, first evicting the oldest ones until both bounds hold with it."""
        num_tokens = len(output_token_ids)
        if self.max_cached_requests == 0 or num_tokens > self.max_cached_tokens:
            return
        while self._cached_seq_ids and (len(self._cached_seq_ids) >= self.max_cached_requests
                                        or self.num_cached_tokens + num_tokens > self.max_cached_tokens):
            self._global_trie.remove(self._cached_seq_ids.popleft())
        seq_id = next(self._next_seq_ids)
        self._global_trie.add(seq_id, output_token_ids)
        self._cached_seq_ids.append(seq_id)

