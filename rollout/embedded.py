"""The embedded backend: this package's engine (rollout/engine.py) on the models loaded here.

It owns the target and its runner (KV cache allocated up front for max_num_seqs x max_model_len positions), the
drafter, and the speculation policy: the static per-batch-size schedule, or adaptive verification when the config
enables it, whose step-cost model is measured here at start-up (or read from the disk cache of an earlier
measurement, spec/adaptive/cost_profile.py) and refined from the step times of every call.
"""

import copy
import itertools
import time

import torch
from tqdm.auto import tqdm

from rollout.engine import Engine
from rollout.loading import check_same_vocab, default_max_model_len, eos_token_ids, load_model
from rollout.outputs import RolloutBatch, Sample
from rollout.request import Request
from rollout.sampling_params import SamplingParams, mix_seed
from rollout.weights import load_weights
from spec import PositionUniforms, RequestAcceptance, SpecConfig, StaticPolicy, build_proposer
from spec.adaptive import AdaptivePolicy, ConfidenceCalibrator, StepCostModel, cost_profile
from spec.model_runner import build_runner

_COST_SAVE_INTERVAL_S = 60.0  # refined step costs go back to the disk cache at most this often


class EmbeddedBackend:
    """step_costs: adaptive verification's cost table (a StepCostModel, its dict, or a JSON path), used as given;
    None: measured here, or loaded from the disk cache, and refined from every call's step times.
    max_drafter_faults: drafter faults a call tolerates before it stops drafting (rollout/engine.py)."""

    def __init__(self, model, config: SpecConfig | None, *, draft_model=None, max_num_seqs: int,
                 max_model_len: int | None, device: torch.device, dtype: torch.dtype, step_costs=None,
                 max_drafter_faults: int = 8):
        user_costs = None if step_costs is None else _as_step_costs(step_costs)  # a bad table fails before loading
        if type(max_drafter_faults) is not int or max_drafter_faults < 0:
            raise ValueError(f"max_drafter_faults={max_drafter_faults!r}: must be an integer >= 0 (drafter faults a "
                             "call tolerates before it stops drafting; 0 makes the first one fail the call)")
        self.max_drafter_faults = max_drafter_faults
        self.config = config
        self.device, self.dtype = device, dtype
        self.max_num_seqs = max_num_seqs
        self.model = load_model(model, device, dtype, field="model")
        self.max_model_len = default_max_model_len(self.model.config, max_model_len)
        self.eos_token_ids = eos_token_ids(self.model.generation_config, self.model.config)
        self.runner = build_runner(self.model, max_num_seqs, self.max_model_len, device, dtype)
        self.draft_model = None
        if config is not None and config.method == "draft_model":
            self.draft_model = load_model(draft_model if draft_model is not None else config.model, device, dtype,
                                          field="draft_model")
            check_same_vocab(self.model, self.draft_model)
        self.proposer = None if config is None else build_proposer(
            config, draft_model=self.draft_model, max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
            device=device, dtype=dtype)
        self.policy = StaticPolicy()
        self._cost_key = None  # the disk-cache key of measured step costs
        self._cost_saved_at = None  # when refined costs last went back to the disk cache
        if config is not None and config.enable_adaptive_verification:
            self.policy = self._adaptive_policy(user_costs)
        self._ids = itertools.count()  # request and prompt-group ids, unique across calls

    is_shared = False  # one engine per trainer process

    def k_for_batch_size(self, batch_size: int) -> int:
        return 0 if self.config is None else self.config.k_for_batch_size(batch_size)

    def use_schedule(self, schedule: list[list[int]]) -> None:
        """Follow `schedule` ([[start, end, K], ...]) from the next call on; the drafter drafts as many tokens as each
        step asks for, so only the config changes (what `rollout tune` times)."""
        self.config = self.config.with_schedule(schedule)

    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams, seed: int,
                 decode, use_tqdm: bool) -> RolloutBatch:
        engine = Engine(self.runner, self.proposer, self.policy, self.k_for_batch_size,
                        max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                        vocab_size=self.model.config.vocab_size, max_drafter_faults=self.max_drafter_faults)
        requests = self._requests(prompt_ids, num_generations, params, seed)
        for request in requests:
            engine.add(request)
        with tqdm(total=len(requests), desc="rollouts", unit="sample", disable=not use_tqdm) as bar:
            elapsed = engine.run(on_finish=lambda r: bar.update(1))  # a failed run releases what it held
        self._save_step_costs()
        return self._batch(requests, engine, elapsed, decode)

    def load_weights(self, named_tensors) -> int:
        return load_weights(self.runner.model, named_tensors, role="target")

    def load_draft_weights(self, named_tensors) -> int:
        return load_weights(self._drafter_model(), named_tensors, role="draft model")

    def draft_model_copy(self) -> torch.nn.Module:
        return copy.deepcopy(self._drafter_model())

    def measure_step_costs(self, refresh: bool = False):
        """The step-cost model of these models on this hardware (spec/adaptive/step_cost.py): from the disk cache,
        or measured now (seconds on small models) and cached; refresh=True measures anew."""
        self._cost_key = cost_profile.cache_key(self.model, self.draft_model, self.dtype, self.device,
                                                self.max_num_seqs, self.config.num_speculative_tokens + 1)
        drafter = self.proposer if self.draft_model is not None else None  # model-free drafters: no draft cost
        return cost_profile.load_or_profile(self._cost_key, self.runner, drafter, self.max_model_len, refresh=refresh)

    def _adaptive_policy(self, user_costs: StepCostModel | None) -> AdaptivePolicy:
        policy = AdaptivePolicy(ConfidenceCalibrator(max_positions=self.config.num_speculative_tokens),
                                refine=user_costs is None)
        policy.costs = user_costs or self.measure_step_costs()
        return policy

    def _save_step_costs(self) -> None:
        """Write refined step costs to the disk cache: after the first call, then at most once a minute."""
        if self._cost_key is None or not getattr(self.policy, "refine", False):
            return
        if self._cost_saved_at is None or time.monotonic() - self._cost_saved_at > _COST_SAVE_INTERVAL_S:
            cost_profile.save(self.policy.costs, self._cost_key)
            self._cost_saved_at = time.monotonic()

    def _drafter_model(self) -> torch.nn.Module:
        runner = getattr(self.proposer, "runner", None)
        if runner is None:
            method = self.config.method if self.config is not None else None
            raise ValueError(f"the speculative method is {method!r}, which has no draft model; drafter weights need "
                             "method 'draft_model'")
        return runner.model

    def _requests(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                  seed: int) -> list[Request]:
        num_spec_tokens = self.config.num_speculative_tokens if self.config else 0
        stop_ids = frozenset(self.eos_token_ids | set(params.stop_token_ids or ()))
        requests = []
        for i, ids in enumerate(prompt_ids):
            group_id = next(self._ids)
            for j in range(num_generations):
                request_seed = mix_seed(seed, i, j)
                generator = torch.Generator(device=self.device).manual_seed(request_seed)
                uniforms = PositionUniforms(torch.Generator(device=self.device).manual_seed(mix_seed(request_seed, 1)))
                requests.append(Request(next(self._ids), group_id, i, j, list(ids), params, generator, uniforms,
                                        RequestAcceptance.sized(num_spec_tokens), stop_ids))
        return requests

    def _batch(self, requests: list[Request], engine: Engine, elapsed: float, decode) -> RolloutBatch:
        samples = [Sample(r.prompt_index, r.sample_index, r.prompt_ids, r.output_ids, r.logprobs,
                          decode(r.output_ids), r.finish_reason, r.acceptance.to_dict()) for r in requests]
        num_tokens = sum(len(s.completion_ids) for s in samples)
        total = engine.stats.total
        num_verified = len(total.k_per_step) + total.num_draft_tokens  # each row-step verifies k + 1 tokens
        policy = self.policy.stats()
        stats = {**engine.stats.to_dict(), **policy, "num_steps": engine.num_steps,
                 "num_proposed_draft_tokens": engine.num_proposed_drafts, "num_completion_tokens": num_tokens,
                 "num_drafter_faults": engine.num_drafter_faults,
                 "verified_tokens_per_emitted_token": num_verified / max(num_tokens, 1),
                 "elapsed_s": elapsed, "tokens_per_s": num_tokens / max(elapsed, 1e-9)}
        metrics = {**engine.stats.to_metrics(), "spec/rollout_tokens_per_s": stats["tokens_per_s"],
                   "spec/verified_tokens_per_emitted_token": stats["verified_tokens_per_emitted_token"],
                   "spec/num_drafter_faults": float(engine.num_drafter_faults),
                   **{f"spec/{name}": float(value) for name, value in policy.items()}}
        return RolloutBatch(samples, stats, metrics)


def _as_step_costs(step_costs) -> StepCostModel:
    if isinstance(step_costs, StepCostModel):
        return step_costs
    if isinstance(step_costs, dict):
        return StepCostModel.from_dict(step_costs)
    return StepCostModel.load(step_costs)
