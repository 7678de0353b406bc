"""This project's drafters inside vLLM, whichever runner calls them: what the custom_class proposer (proposer.py, vLLM's
V1 runner, 0.32-0.33) and the registered speculator (speculator.py, Model Runner V2, 0.34+) share. Each of those is a
thin adapter that turns its runner's step into `Row`s and token ids; everything else is here.

A config whose drafter implements the project's Proposer protocol (spec/proposers/base.py): `method: "history"` (the
rollout-history suffix drafter: each prompt's earlier rollouts, its live GRPO siblings and a global cache) or
`method: "custom_class"` (a user's class to that protocol) reaches vLLM with the project's whole config in vLLM's
`additional_config` under CONFIG_KEY (versions.py builds the rest); every worker (every TP rank, the OpenAI
server's worker) builds its own drafter from it.

Per step, for the rows the adapter reports:
- a request is known by vLLM's request id; its token ids are the adapter's, read from the committed tokens this class
  lacks (`missing`); a request whose tokens vLLM rewound is finished and started afresh;
- a request's group is its prompt (the same token ids): siblings of a GRPO group share their trie, and the history is
  keyed by prompt anyway;
- each request's drafts are capped at the step's K (the adapter's: the schedule's on V1, vLLM's on V2) and at what
  max_model_len leaves;
- with `enable_adaptive_verification`, the embedded engine's policy (spec/adaptive/policy.py) plans each request's
  drafts within its cap and cuts them to the prefix whose calibrated survival pays for its tokens; late_outcomes.py
  reports it each step's outcome (the tokens each request gained) and time at the next call (unknown where the
  step also prefilled or admitted a request);
- finished requests (`finish`) go to the history and the global cache;
- a drafter that raises drafts nothing that step (a warning, then `release_all`): vLLM would otherwise fail the
  engine. A DrafterConfigError (a drafter that cannot work with this target) still raises, as on the embedded engine.

Every rank builds its own drafter and sees the same steps, so with a deterministic drafter every rank proposes the
same drafts. The time spent here is counted (`stats`), and the backend reports it per call.
"""

import logging
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

from rollout.vllm_backend.late_outcomes import LateOutcomes
from rollout.vllm_common import CONFIG_KEY
from spec import SpecConfig
from spec.proposers import DrafterConfigError, DraftRequest, Proposal, build_proposer

logger = logging.getLogger(__name__)


@dataclass
class Row:
    """One request of a step, as the runner reports it."""

    vllm_id: str
    num_prompt_tokens: int
    num_tokens: int  # prompt + committed output, this step's sampled tokens included
    num_new_tokens: int  # tokens sampled this step (accepted drafts + 1); 0: a partial prefill, not drafted


def project_config(vllm_config, source: str) -> SpecConfig:
    """The project's speculative config from vLLM's additional_config; ValueError naming `source` where it is not."""
    additional = vllm_config.additional_config
    config = additional.get(CONFIG_KEY) if isinstance(additional, dict) else None
    if config is None:
        raise ValueError(f"{source} needs the project's speculative config in vLLM's additional_config under "
                         f"{CONFIG_KEY!r}; build the engine with RolloutGenerator(backend='vllm') or `python -m "
                         "rollout serve`, which pass it")
    return SpecConfig.from_dict(config)


class RolloutDrafting:
    """The drafter, the requests it knows and adaptive verification, for one worker (`source` names the adapter)."""

    def __init__(self, vllm_config, source: str):
        self.source = source
        self.config = project_config(vllm_config, source)
        self.max_model_len = vllm_config.model_config.max_model_len
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        # seconds in propose, drafts the drafter proposed (before adaptive verification's cut), drafter faults
        self.stats = {"seconds": 0.0, "num_draft_tokens": 0, "num_faults": 0}
        self.reset()

    def reset(self) -> None:
        """A fresh drafter and policy, no request known (vLLM's warm-up requests are forgotten so)."""
        self.drafter = build_proposer(self.config, max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len)
        self.policy = LateOutcomes(self.config.num_speculative_tokens) \
            if self.config.enable_adaptive_verification else None
        self._requests: dict[str, DraftRequest] = {}  # vLLM request id -> the drafter's view of it
        self._groups: dict[tuple, list[int]] = {}  # prompt token ids -> [group id, live requests]
        self._next_id = 0
        self._last_end = None  # perf_counter at the end of the last propose

    def tracked_ids(self) -> set[str]:
        return set(self._requests)

    def missing(self, rows: Sequence[Row]) -> list[int]:
        """Per row, the index of the first committed token this class lacks (0 for a request it does not know, or one
        vLLM rewound, which is finished here first); the adapter reads tokens [missing, num_tokens) of each row."""
        starts = []
        for row in rows:
            if not row.num_new_tokens:  # a partial prefill: nothing read, nothing drafted
                starts.append(row.num_tokens)
                continue
            request = self._requests.get(row.vllm_id)
            if request is not None and len(request.token_ids) > row.num_tokens:
                self._finish(row.vllm_id)
                request = None
            starts.append(0 if request is None else len(request.token_ids))
        return starts

    def propose(self, rows: Sequence[Row], tokens: Sequence[list[int]], k: int, start: float) -> list[list[int]]:
        """Each row's drafts (none for a partial prefill), at most k; `tokens[i]`: row i's token ids from
        missing()[i] on; `start`: perf_counter when the runner called the adapter."""
        drafted, requests, caps, is_new = [], [], [], False
        for i, (row, new_tokens) in enumerate(zip(rows, tokens)):
            if not row.num_new_tokens:
                continue
            is_new |= row.vllm_id not in self._requests
            drafted.append(i)
            requests.append(self._request(row, new_tokens))
            caps.append(max(min(k, self.max_model_len - row.num_tokens - 1), 0))
        if self.policy is not None:
            step_seconds = None if is_new or len(drafted) < len(rows) or self._last_end is None \
                else start - self._last_end
            self.policy.report({r.req_id: rows[i].num_new_tokens for i, r in zip(drafted, requests)}, step_seconds)
        drafts = [[] for _ in rows]
        if requests:
            for i, row_drafts in zip(drafted, self._draft(requests, caps, k)):
                drafts[i] = row_drafts
        self._last_end = time.perf_counter()
        self.stats["seconds"] += self._last_end - start
        return drafts

    def finish(self, vllm_ids: Iterable[str]) -> None:
        """These requests are done: their outputs (the tokens last reported) go to the drafter; unknown ids pass."""
        for vllm_id in vllm_ids:
            if vllm_id in self._requests:
                self._finish(vllm_id)

    def _request(self, row: Row, new_tokens: list[int]) -> DraftRequest:
        """The drafter's view of a running request, its token ids brought up to row.num_tokens."""
        request = self._requests.get(row.vllm_id)
        if request is None:
            prompt = new_tokens[:row.num_prompt_tokens]
            group = self._groups.setdefault(tuple(prompt), [self._new_id(), 0])
            group[1] += 1
            request = DraftRequest(self._new_id(), group[0], list(new_tokens), row.num_prompt_tokens)
            self._requests[row.vllm_id] = request
        else:
            request.token_ids.extend(new_tokens)
        return request

    def _draft(self, requests: list[DraftRequest], caps: list[int], k: int) -> list[list[int]]:
        """Each request's drafts: the drafter's, planned and cut by adaptive verification where it is on."""
        if self.policy is not None:
            caps = self.policy.limits([r.req_id for r in requests], caps, k)
        start = time.perf_counter()
        proposal = self._propose(requests, caps)
        self.stats["num_draft_tokens"] += sum(proposal.num_draft_tokens)
        if self.policy is None:
            return proposal.token_ids
        return proposal.prefix(self.policy.cut(proposal, time.perf_counter() - start)).token_ids

    def _propose(self, requests: list[DraftRequest], caps: list[int]) -> Proposal:
        try:
            proposal = self.drafter.propose(requests, caps)
            proposal.validate(caps, f"drafter {self.config.method!r}", self.vocab_size)
            if proposal.draft_probs is not None:
                raise DrafterConfigError(f"drafter {self.config.method!r} returned draft_probs: vLLM verifies the "
                                         "project's drafters' drafts as point proposals, which is lossless only for "
                                         "drafts that are not sampled from them; return draft_probs=None")
            return proposal
        except DrafterConfigError:
            raise
        except Exception as e:  # a faulty step costs its drafts, not vLLM's engine
            self.stats["num_faults"] += 1
            logger.warning("%s: the drafter failed a step (%s: %s); that step drafts nothing and its state is "
                           "released", self.source, type(e).__name__, e)
            self._release()
            return Proposal([[] for _ in requests], [[] for _ in requests])

    def _finish(self, vllm_id: str) -> None:
        request = self._requests.pop(vllm_id)
        key = tuple(request.token_ids[:request.num_prompt_tokens])
        group = self._groups[key]
        group[1] -= 1
        if not group[1]:
            del self._groups[key]
        try:
            self.drafter.finish(request)
        except Exception as e:
            self.stats["num_faults"] += 1
            logger.warning("%s: the drafter failed to finish a request (%s: %s)", self.source, type(e).__name__, e)
            self._release()

    def _release(self) -> None:
        release_all = getattr(self.drafter, "release_all", None)
        if release_all is not None:
            release_all()

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id
