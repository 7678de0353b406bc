"""This project's drafters inside vLLM, whichever runner calls them: what the custom_class proposer (proposer.py, V1,
0.32-0.33) and the registered speculator (speculator.py, Model Runner V2, 0.34+) share; each of those is a thin
adapter that turns its runner's step into `Row`s, token ids and stop ids. A config of the project's drafters
(`history`, or a `custom_class` to spec/proposers/base.py) reaches every worker (every TP rank, a server's worker) in
vLLM's additional_config (wire.CONFIG_KEY, and wire.FAULTS_KEY for max_drafter_faults); each builds its own drafter.

Per step, for the rows the adapter reports: a request is known by vLLM's request id, its token ids read from the
committed tokens this class lacks (`missing`; a request vLLM rewound is finished and started afresh); its group is
its prompt (spec.drafting_host.PromptGroups, as on the embedded engine); its drafts are capped at the step's K and
what max_model_len leaves. The drafting host (spec/drafting_host.py, the embedded engine's) plans, validates, cuts
at stop ids, counts and handles faults with the same policy as the embedded engine (adaptive where enabled, else the
static one); late_outcomes.py tells it each step's outcome at the next call. vLLM verifies point proposals only:
draft_probs are a DrafterConfigError. A run begins when a request comes to none and ends when the last finishes;
finished requests go to the history and the global cache.

Every rank builds its own drafter and sees the same steps, so with a deterministic drafter every rank proposes the
same drafts. The time spent here is counted (`stats`), and the backend reports it per call.
"""

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from rollout.vllm_backend.late_outcomes import LateOutcomes
from rollout.vllm_backend.wire import CONFIG_KEY, FAULTS_KEY
from spec import SpecConfig, StepInfo
from spec.adaptive import build_policy
from spec.drafting_host import MAX_DRAFTER_FAULTS, DraftingHost, PromptGroups
from spec.proposers import DraftRequest, build_proposer


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
    """The drafting host, the requests it knows and their outcomes, for one worker (`source` names the adapter).
    stop_ids(vLLM request id): the token ids that end that request."""

    def __init__(self, vllm_config, source: str, stop_ids: Callable[[str], frozenset[int]]):
        self.source = source
        self.stop_ids = stop_ids
        self.config = project_config(vllm_config, source)
        additional = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
        self.max_drafter_faults = additional.get(FAULTS_KEY, MAX_DRAFTER_FAULTS)
        self.max_model_len = vllm_config.model_config.max_model_len
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self.reset()

    def reset(self) -> None:
        """A fresh drafter and policy, no request known and nothing counted (vLLM's warm-up is forgotten so)."""
        drafter = build_proposer(self.config, max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len)
        self.host = DraftingHost(drafter, build_policy(self.config), vocab_size=self.vocab_size, verifies_draft_probs=False,
                                 max_drafter_faults=self.max_drafter_faults)
        self.late = LateOutcomes(self.host)
        self.seconds = 0.0  # in propose
        self._requests: dict[str, DraftRequest] = {}  # vLLM request id -> the drafter's view of it
        self._groups = PromptGroups()
        self._next_id = 0
        self._last_end = None  # perf_counter at the end of the last propose

    @property
    def drafter(self):
        return self.host.drafter

    @property
    def stats(self) -> dict:
        """Seconds in propose, drafts proposed (before the stop cut and the policy's), drafter faults."""
        return {"seconds": self.seconds, "num_draft_tokens": self.host.num_proposed_drafts,
                "num_faults": self.host.num_faults}

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
        drafted = [i for i, row in enumerate(rows) if row.num_new_tokens]
        is_new = any(rows[i].vllm_id not in self._requests for i in drafted)
        requests = [self._request(rows[i], tokens[i]) for i in drafted]
        step_seconds = None if is_new or len(drafted) < len(rows) or self._last_end is None \
            else start - self._last_end
        self.late.report({r.req_id: rows[i].num_new_tokens for i, r in zip(drafted, requests)}, step_seconds)
        drafts = [[] for _ in rows]
        if requests:
            for i, row_drafts in zip(drafted, self._draft(requests, k)):
                drafts[i] = row_drafts
        self._last_end = time.perf_counter()
        self.seconds += self._last_end - start
        return drafts

    def finish(self, vllm_ids: Iterable[str]) -> None:
        """These requests are done: their outputs (the tokens last reported) go to the drafter; unknown ids pass."""
        for vllm_id in vllm_ids:
            if vllm_id in self._requests:
                self._finish(vllm_id)

    def _request(self, row: Row, new_tokens: list[int]) -> DraftRequest:
        """The drafter's view of a running request, its token ids brought up to row.num_tokens; the first request to
        none begins a run."""
        request = self._requests.get(row.vllm_id)
        if request is not None:
            request.token_ids.extend(new_tokens)
            return request
        if not self._requests:
            self.host.begin_run()
        group = self._groups.join(new_tokens[:row.num_prompt_tokens], self._new_id())
        request = DraftRequest(self._new_id(), group, list(new_tokens), row.num_prompt_tokens,
                               stop_ids=frozenset(self.stop_ids(row.vllm_id)))
        self._requests[row.vllm_id] = request
        return request

    def _draft(self, requests: list[DraftRequest], k: int) -> list[list[int]]:
        """Each request's drafts, as the host plans, cuts and selects them within k and its room."""
        caps = [max(min(k, self.max_model_len - len(r.token_ids) - 1), 0) for r in requests]
        drafts = self.host.draft(StepInfo([r.req_id for r in requests], [1] * len(requests), caps, k),
                                 lambda: requests)
        self.late.drafted(drafts)
        return drafts.verified.token_ids

    def _finish(self, vllm_id: str) -> None:
        """The request leaves its group and goes to the drafter; the last one of a run ends it."""
        request = self._requests.pop(vllm_id)
        self._groups.leave(request.token_ids[:request.num_prompt_tokens])
        try:
            self.host.drafter.finish(request)
        except Exception as e:  # a drafter bug costs its state, not vLLM's engine
            self.host.fault(e)
        if not self._requests:
            self.late.report({}, None)  # the run's last step: its requests finished, its drafts go unjudged
            self.host.end_run()

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id
