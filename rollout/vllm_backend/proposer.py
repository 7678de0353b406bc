"""This project's drafters inside vLLM: the proposer class vLLM's `custom_class` hook builds in each worker.

A config whose drafter implements this project's Proposer protocol (spec/proposers/base.py): `method: "history"` (the
rollout-history suffix drafter: each prompt's earlier rollouts, its live GRPO siblings and a global cache) or
`method: "custom_class"` (a user's class to that protocol), reaches vLLM as `{"method": "custom_class", "model":
PROPOSER_CLASS}` plus the project's whole config in vLLM's `additional_config` under CONFIG_KEY (engine_args.py).
vLLM imports PROPOSER_CLASS in every worker (every TP rank, the OpenAI server's worker) and builds it with its
VllmConfig; this class builds the drafter from the project's config there.

Each step vLLM's V1 model runner calls `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)`, one row per
running request, and verifies the lists returned (any length up to K) as point drafts with its lossless rejection
sampler. What the drafter needs beyond token ids, the runner's input batch has: the request ids and prompt lengths.
The runner hands this class no reference to it, so the first call takes it from the calling frame (the runner's
`propose_draft_token_ids`), checked to be the batch whose token ids were passed, and keeps the runner.

Per step:
- K is the config's schedule at the live batch size (`num_speculative_tokens_per_batch_size`, else
  num_speculative_tokens): vLLM tells a custom_class proposer no K, and the schedule is not sent to vLLM;
- with `enable_adaptive_verification`, each request's drafts are cut to the prefix whose calibrated survival pays
  for its tokens (spec/adaptive/observed.py: outcomes from the tokens each request gained since the last call, step
  costs from the time between calls);
- a request's group is its prompt (the same token ids): siblings of a GRPO group share their trie, and the history
  is keyed by prompt anyway;
- requests that left the input batch since the last step are finished: their outputs go to the history and the
  global cache. A call's last requests are finished at the next call's first step, before it drafts;
- a drafter that raises drafts nothing that step (a warning, then `release_all`): vLLM would otherwise fail the
  engine. A DrafterConfigError (a drafter that cannot work with this target) still raises, as on the embedded engine.

Every rank builds its own drafter and sees the same batches, so with a deterministic drafter every rank proposes the
same drafts. The time spent here is counted (`stats`), and the backend reports it per call.
"""

import logging
import sys
import time

from rollout.vllm_common import CONFIG_KEY, PROPOSER_CLASS
from spec import SpecConfig
from spec.adaptive.observed import ObservedPolicy
from spec.proposers import DrafterConfigError, DraftRequest, Proposal, build_proposer


logger = logging.getLogger(__name__)


class RolloutProposer:
    """Built by vLLM (`create_custom_proposer`) with its VllmConfig."""

    def __init__(self, vllm_config):
        config = (vllm_config.additional_config or {}).get(CONFIG_KEY) \
            if isinstance(vllm_config.additional_config, dict) else None
        if config is None:
            raise ValueError(f"{PROPOSER_CLASS} needs the project's speculative config in vLLM's additional_config "
                             f"under {CONFIG_KEY!r}; build the engine with RolloutGenerator(backend='vllm') or "
                             "`python -m rollout serve`, which pass it")
        self.config = SpecConfig.from_dict(config)
        self.max_model_len = vllm_config.model_config.max_model_len
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.drafter = build_proposer(self.config, max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
                                      max_model_len=self.max_model_len)
        self._runner = None
        self._requests: dict[str, DraftRequest] = {}  # vLLM request id -> the drafter's view of it
        self._groups: dict[tuple, list[int]] = {}  # prompt token ids -> [group id, live requests]
        self._next_id = 0
        self._last_end = None  # perf_counter at the end of the last propose
        # adaptive verification: how many of each request's drafts to return (spec/adaptive/observed.py)
        self.policy = ObservedPolicy(self.config.num_speculative_tokens) \
            if self.config.enable_adaptive_verification else None
        # seconds in propose, drafts the drafter proposed (before adaptive verification's cut), drafter faults
        self.stats = {"seconds": 0.0, "num_draft_tokens": 0, "num_faults": 0}

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        start = time.perf_counter()
        batch = self._input_batch(token_ids_cpu, sys._getframe(1))
        self._finish_departed(batch.req_id_to_index)
        k = self.config.schedule.k_for_batch_size(len(sampled_token_ids))
        rows, requests, caps, is_new = [], [], [], False
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:  # a partial prefill
                continue
            num_tokens = int(num_tokens_no_spec[i])
            is_new |= batch.req_ids[i] not in self._requests
            rows.append(i)
            requests.append(self._request(batch.req_ids[i], i, int(batch.num_prompt_tokens[i]), num_tokens,
                                          token_ids_cpu))
            caps.append(max(min(k, self.max_model_len - num_tokens - 1), 0))
        if self.policy is not None:
            step_seconds = None if is_new or len(rows) < len(sampled_token_ids) or self._last_end is None \
                else start - self._last_end
            self.policy.observe({r.req_id: len(sampled_token_ids[i]) for i, r in zip(rows, requests)}, step_seconds)
        drafts = [[] for _ in sampled_token_ids]
        if requests:
            for row, tokens in zip(rows, self._draft(requests, caps)):
                drafts[row] = tokens
        self._last_end = time.perf_counter()
        self.stats["seconds"] += self._last_end - start
        return drafts

    def load_model(self, *args, **kwargs) -> None:
        """vLLM's hook for a drafter's weights: the model-free drafters have none."""

    def _input_batch(self, token_ids_cpu, caller):
        """The runner's input batch whose token ids vLLM passed (module docstring)."""
        if self._runner is None:
            runner = caller.f_locals.get("self")
            if getattr(getattr(runner, "input_batch", None), "token_ids_cpu", None) is not token_ids_cpu:
                raise RuntimeError(f"{PROPOSER_CLASS} was called by {caller.f_code.co_name}, not by a vLLM model "
                                   "runner's propose_draft_token_ids with its input batch; this vLLM version calls "
                                   "custom_class proposers otherwise (tested with vLLM's V1 runner, 0.32-0.33)")
            self._runner = runner
        batch = self._runner.input_batch
        if batch.token_ids_cpu is not token_ids_cpu:
            raise RuntimeError(f"{PROPOSER_CLASS}: the runner's input batch changed under the proposer")
        return batch

    def _request(self, vllm_id: str, row: int, num_prompt_tokens: int, num_tokens: int, token_ids_cpu):
        """The drafter's view of a running request, its token ids brought up to the committed num_tokens."""
        request = self._requests.get(vllm_id)
        if request is None:
            prompt = token_ids_cpu[row, :num_prompt_tokens].tolist()
            group = self._groups.setdefault(tuple(prompt), [self._new_id(), 0])
            group[1] += 1
            request = self._requests[vllm_id] = DraftRequest(self._new_id(), group[0], prompt, num_prompt_tokens)
        tokens = request.token_ids
        if len(tokens) < num_tokens:
            tokens.extend(token_ids_cpu[row, len(tokens):num_tokens].tolist())
        elif len(tokens) > num_tokens:  # vLLM rewound it: finish what it had, start it afresh
            self._finish(vllm_id)
            return self._request(vllm_id, row, num_prompt_tokens, num_tokens, token_ids_cpu)
        return request

    def _draft(self, requests: list[DraftRequest], caps: list[int]) -> list[list[int]]:
        """Each request's drafts: the drafter's, cut by adaptive verification where it is on."""
        start = time.perf_counter()
        proposal = self._propose(requests, caps)
        self.stats["num_draft_tokens"] += sum(proposal.num_draft_tokens)
        if self.policy is None:
            return proposal.token_ids
        lengths = self.policy.choose([r.req_id for r in requests], proposal.confidence, time.perf_counter() - start)
        return proposal.prefix(lengths).token_ids

    def _propose(self, requests: list[DraftRequest], caps: list[int]) -> Proposal:
        try:
            proposal = self.drafter.propose(requests, caps)
            proposal.validate(caps, f"drafter {self.config.method!r}", self.vocab_size)
            if proposal.draft_probs is not None:
                raise DrafterConfigError(f"drafter {self.config.method!r} returned draft_probs: vLLM verifies a "
                                         "custom_class drafter's drafts as point proposals, which is lossless only "
                                         "for drafts that are not sampled from them; return draft_probs=None")
            return proposal
        except DrafterConfigError:
            raise
        except Exception as e:  # a faulty step costs its drafts, not vLLM's engine
            self.stats["num_faults"] += 1
            logger.warning("%s: the drafter failed a step (%s: %s); that step drafts nothing and its state is "
                           "released", PROPOSER_CLASS, type(e).__name__, e)
            self._release()
            return Proposal([[] for _ in requests], [[] for _ in requests])

    def _finish_departed(self, running) -> None:
        for vllm_id in [vllm_id for vllm_id in self._requests if vllm_id not in running]:
            self._finish(vllm_id)

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
            logger.warning("%s: the drafter failed to finish a request (%s: %s)", PROPOSER_CLASS, type(e).__name__, e)
            self._release()

    def _release(self) -> None:
        release_all = getattr(self.drafter, "release_all", None)
        if release_all is not None:
            release_all()

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id
