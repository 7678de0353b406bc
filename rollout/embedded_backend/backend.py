"""The embedded backend: this package's engine (rollout/embedded_backend/engine.py) on the models loaded here.

It owns the target and its runner (KV cache allocated up front for max_num_seqs x max_model_len positions), the
drafter, and the speculation policy: the static per-batch-size schedule, or, when the config enables it, adaptive
verification inside the schedule's cap (spec/adaptive/policy.py), which fits its step costs from the steps this
engine runs and prices the queries the runner pads (Runner.padded_queries).
"""

import copy
import itertools
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from rollout.embedded_backend.engine import Engine
from rollout.embedded_backend.request import Request
from rollout.history import DrafterHistory, keeps_history
from rollout.loading import check_same_vocab, default_max_model_len, eos_token_ids, load_model
from rollout.outputs import RolloutBatch, Sample, build_batch, history_stats
from rollout.sampling_params import SamplingParams, mix_seed
from rollout.weights import load_weights, no_draft_model
from spec import (
    BatchSizeSchedule,
    PositionUniforms,
    Proposer,
    RequestAcceptance,
    SpecConfig,
    SpeculationPolicy,
    StaticPolicy,
    build_proposer,
)
from spec.adaptive import build_policy
from spec.drafting_host import MAX_DRAFTER_FAULTS
from spec.model_runner import build_runner

NO_SPECULATION = BatchSizeSchedule([[1, 1, 0]], num_speculative_tokens=0)  # K = 0 at every batch size


@dataclass
class Speculation:
    """What drafts and decides on the embedded engine: the speculative config (None: no speculation), its drafter
    and its speculation policy. `RolloutGenerator.build_speculation` makes one; `use_speculation` runs it, so that
    several configs take turns on one loaded target (each keeps its drafter's and policy's state)."""

    config: SpecConfig | None
    proposer: Proposer | None
    policy: SpeculationPolicy

    @property
    def schedule(self) -> BatchSizeSchedule:
        return NO_SPECULATION if self.config is None else self.config.schedule


class EmbeddedBackend:
    """max_drafter_faults: drafter faults a call tolerates before it stops drafting (spec/drafting_host.py)."""

    is_shared = False  # one engine per trainer process
    base_url = None

    def __init__(self, model, config: SpecConfig | None, *, draft_model=None, max_num_seqs: int,
                 max_model_len: int | None, device: torch.device, dtype: torch.dtype,
                 max_drafter_faults: int = MAX_DRAFTER_FAULTS):
        self.max_drafter_faults = max_drafter_faults
        self.device, self.dtype = device, dtype
        self.max_num_seqs = max_num_seqs
        self.target_source = model
        self.model = load_model(model, device, dtype, field="model")
        self.max_model_len = default_max_model_len(self.model.config, max_model_len)
        self.eos_token_ids = eos_token_ids(self.model.generation_config, self.model.config)
        self.runner = build_runner(self.model, max_num_seqs, self.max_model_len, device, dtype)
        self._draft_models: dict = {}  # draft folder (or a loaded model's id) -> the loaded draft model
        self.speculation = self.build_speculation(config, draft_model)
        self._ids = itertools.count()  # request and prompt-group ids, unique across calls

    @property
    def config(self) -> SpecConfig | None:
        return self.speculation.config

    def build_speculation(self, config: SpecConfig | None, draft_model=None) -> Speculation:
        """A drafter and policy for `config` on this target: a draft model already loaded for another speculation
        is shared (`draft_model`, a folder or loaded model, overrides config.model)."""
        if config is None:
            return Speculation(None, None, StaticPolicy())
        loaded = self._draft_model(config, draft_model) if config.method == "draft_model" else None
        proposer = build_proposer(config, draft_model=loaded, max_num_seqs=self.max_num_seqs,
                                  max_model_len=self.max_model_len, device=self.device, dtype=self.dtype)
        return Speculation(config, proposer, build_policy(config, padding=self.runner.padded_queries))

    def use_speculation(self, speculation: Speculation) -> None:
        if not isinstance(speculation, Speculation):
            raise ValueError(f"speculation={speculation!r}: pass what build_speculation returned")
        self.speculation = speculation

    @property
    def history(self) -> DrafterHistory | None:
        """The running drafter's rollout history (rollout/history.py), None where it keeps none."""
        speculation = self.speculation
        if not keeps_history(speculation.config):
            return None
        return DrafterHistory(speculation.proposer, self.model.config.vocab_size)

    def use_schedule(self, schedule: list[list[int]]) -> None:
        """Follow `schedule` ([[start, end, K], ...]) from the next call on; the drafter drafts as many tokens as each
        step asks for, so only the config changes (what `rollout tune` times)."""
        self.speculation.config = self.config.with_schedule(schedule)

    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams, seed: int,
                 decode, use_tqdm: bool) -> RolloutBatch:
        speculation = self.speculation
        engine = Engine(self.runner, speculation.proposer, speculation.policy, speculation.schedule.k_for_batch_size,
                        max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                        vocab_size=self.model.config.vocab_size, max_drafter_faults=self.max_drafter_faults)
        requests = self._requests(prompt_ids, num_generations, params, seed)
        for request in requests:
            engine.add(request)
        counts_before = dict(getattr(speculation.proposer, "history_counts", {}))
        with tqdm(total=len(requests), desc="rollouts", unit="sample", disable=not use_tqdm) as bar:
            elapsed = engine.run(on_finish=lambda r: bar.update(1))  # a failed run releases what it held
        counts = {k: v - counts_before[k] for k, v in getattr(speculation.proposer, "history_counts", {}).items()}
        return self._batch(requests, engine, elapsed, decode, counts)

    def load_weights(self, named_tensors) -> int:
        return load_weights(self.runner.model, named_tensors, role="target")

    def load_draft_weights(self, named_tensors) -> int:
        return load_weights(self._drafter_model(), named_tensors, role="draft model")

    def draft_model_copy(self) -> torch.nn.Module:
        return copy.deepcopy(self._drafter_model())

    def measure_step_times(self, prompt_ids: list[list[int]], batch_sizes: list[int], ks: list[int]):
        """This engine's whole-step seconds at each batch size and K (rollout/step_times.py), for the schedule tuner."""
        from rollout.step_times import measure_step_times
        return measure_step_times(self, prompt_ids, batch_sizes, ks)

    def _draft_model(self, config: SpecConfig, draft_model) -> torch.nn.Module:
        source = draft_model if draft_model is not None else config.model
        key = source if isinstance(source, str) else id(source)
        if key not in self._draft_models:
            loaded = load_model(source, self.device, self.dtype, field="draft_model")
            check_same_vocab(self.model, loaded)
            self._draft_models[key] = loaded
        return self._draft_models[key]

    def _drafter_model(self) -> torch.nn.Module:
        runner = getattr(self.speculation.proposer, "runner", None)
        if runner is None:
            raise no_draft_model(self.config)
        return runner.model

    def _requests(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                  seed: int) -> list[Request]:
        num_spec_tokens = self.config.num_speculative_tokens if self.config else 0
        stop_ids = frozenset(params.stop_ids(self.eos_token_ids))
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

    def _batch(self, requests: list[Request], engine: Engine, elapsed: float, decode,
               history_counts: dict) -> RolloutBatch:
        samples = [Sample(r.prompt_index, r.sample_index, r.prompt_ids, r.output_ids, r.logprobs,
                          decode(r.output_ids), r.finish_reason, r.acceptance.to_dict()) for r in requests]
        policy = self.speculation.policy.stats()
        history, history_metrics = history_stats(history_counts)
        stats = {**policy, "num_proposed_draft_tokens": engine.num_proposed_drafts,
                 "num_drafter_faults": engine.num_drafter_faults, **history}
        metrics = {"spec/num_drafter_faults": float(engine.num_drafter_faults),
                   **{f"spec/{name}": float(value) for name, value in policy.items()}, **history_metrics}
        if engine.proposer is not None:  # proposing, as vLLM's workers report it (vllm_backend/common.py)
            stats["drafter_seconds"] = engine.host.seconds
            metrics["spec/drafter_time_fraction"] = engine.host.seconds / max(elapsed, 1e-9)
        return build_batch(samples, engine.stats, num_row_steps=len(engine.stats.total.k_per_step),
                           num_steps=engine.num_steps, elapsed=elapsed, stats=stats, metrics=metrics)

