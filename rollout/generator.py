"""`RolloutGenerator`: the public entry point. Loads the models, tokenises prompts, runs the engine, returns
samples in input order with their logprobs and acceptance records."""

import gc
import itertools
import time

import torch
from tqdm.auto import tqdm

from rollout.default_models import default_model_paths
from rollout.engine import Engine
from rollout.loading import (check_same_vocab, default_device_dtype, default_max_model_len, eos_token_ids, load_model,
                             load_tokenizer)
from rollout.outputs import RolloutBatch, Sample
from rollout.prompts import to_token_ids
from rollout.request import Request
from rollout.sampling_params import SamplingParams, mix_seed
from spec import (AdaptiveVerifier, ConfidenceCalibrator, PositionUniforms, RequestAcceptance, SpecConfig,
                  StepCostModel, build_proposer)
from spec import cost_profile
from spec.model_runner import build_runner

_COST_SAVE_INTERVAL_S = 60.0  # refined step costs go back to the disk cache at most this often


class RolloutGenerator:
    """Rollouts from `model` (a local HF path, a loaded PreTrainedModel, or "default": the shipped target).

    speculative_config: the vLLM-style dict (or a SpecConfig); None = no speculation. For
    `method="draft_model"`, `draft_model` (path or loaded model) overrides the config's `model` path.
    max_num_seqs: running requests at most (each holds a KV slot of max_model_len positions).
    max_model_len: prompt + completion tokens at most (default: the model's max_position_embeddings, capped at
        DEFAULT_MAX_MODEL_LEN: the KV cache is allocated up front for max_num_seqs x max_model_len positions).
    seed: base seed; call i of `generate` draws from seeds derived from (seed, i, prompt, sample).
    step_costs: adaptive verification's step-cost table (a StepCostModel, its dict, or a JSON path; see
        spec/step_cost.py), used as given. None: measured here at start-up, or loaded from the on-disk cache of
        an earlier measurement (spec/cost_profile.py), and refined from the step times of every call.
    backend: "embedded" (this package's engine) or "vllm" (rollout/vllm_backend.py: `vllm.LLM` in this process,
        loading `model` and the drafter from their folders; device is vLLM's choice; same RolloutBatch).
    vllm_kwargs: extra `vllm.LLM` arguments for backend="vllm" (tensor_parallel_size, gpu_memory_utilization, ...).
    """

    def __init__(self, model, *, tokenizer=None, draft_model=None, speculative_config=None,
                 max_num_seqs: int = 64, max_model_len: int | None = None, device=None, dtype=None,
                 seed: int = 0, step_costs=None, backend: str = "embedded", vllm_kwargs: dict | None = None):
        if isinstance(model, str) and model == "default":
            model = default_model_paths()["target"]
        self.config = _as_config(speculative_config, draft_model)  # bad config fails before any loading
        self.vllm = _vllm_backend(backend, model, self.config, draft_model, max_num_seqs, max_model_len, dtype, seed,
                                  vllm_kwargs)
        if self.vllm is not None:  # vLLM loads and runs the models; the generator tokenises and decodes
            self.tokenizer, self.max_model_len = load_tokenizer(model, tokenizer), self.vllm.max_model_len
            self.model = self.runner = self.draft_model = self.proposer = self.adaptive = None
            self.max_num_seqs, self.seed, self.num_calls = max_num_seqs, seed, 0
            return
        user_costs = None if step_costs is None else _as_step_costs(step_costs)
        self.device, self.dtype = default_device_dtype(device, dtype)
        self.tokenizer = load_tokenizer(model, tokenizer)
        self.model = load_model(model, self.device, self.dtype, field="model")
        self.max_model_len = default_max_model_len(self.model.config, max_model_len)
        self.max_num_seqs = max_num_seqs
        self.runner = build_runner(self.model, max_num_seqs, self.max_model_len, self.device, self.dtype)
        self.draft_model = None
        if self.config is not None and self.config.method == "draft_model":
            self.draft_model = load_model(draft_model if draft_model is not None else self.config.model,
                                          self.device, self.dtype, field="draft_model")
            check_same_vocab(self.model, self.draft_model)
        self.adaptive = None
        if self.config is not None and self.config.enable_adaptive_verification:
            self.adaptive = AdaptiveVerifier(ConfidenceCalibrator(max_positions=self.config.num_speculative_tokens))
        self.proposer = None if self.config is None else build_proposer(
            self.config, draft_model=self.draft_model, max_num_seqs=max_num_seqs,
            max_model_len=self.max_model_len, device=self.device, dtype=self.dtype,
            keep_drafting=None if self.adaptive is None else self.adaptive.keep_drafting,
            reveal=None if self.adaptive is None else lambda: self.adaptive.traced)
        self._cost_key = None  # the disk-cache key of measured step costs (measure_step_costs)
        self._cost_saved_at = time.monotonic()
        if self.adaptive is not None:
            self.adaptive.costs = user_costs or self.measure_step_costs()
            self.adaptive.refine = user_costs is None
        self.seed = seed
        self.num_calls = 0
        self._ids = itertools.count()  # request and prompt-group ids, unique across calls
        _freeze_heap()

    @property
    def eos_token_ids(self) -> set[int]:
        if self.vllm is not None:
            return set(self.vllm.eos_token_ids)
        return eos_token_ids(self.model.generation_config, self.model.config)

    def k_for_batch_size(self, batch_size: int) -> int:
        return 0 if self.config is None else self.config.k_for_batch_size(batch_size)

    def generate(self, prompts, num_generations: int = 1, sampling_params: SamplingParams | None = None,
                 use_tqdm: bool = True) -> RolloutBatch:
        """num_generations samples per prompt, in input order (prompt 0's samples first).

        prompts: strings, chat message lists (the chat template is applied), token-id lists, or a
        datasets.Dataset with a "prompt" column.
        """
        params = sampling_params or SamplingParams()
        if not isinstance(num_generations, int) or num_generations < 1:
            raise ValueError(f"num_generations={num_generations!r}: must be an integer >= 1")
        prompt_ids = to_token_ids(prompts, self.tokenizer, self.max_model_len)
        if self.vllm is not None:
            batch = self.vllm.generate(prompt_ids, num_generations, params, self._call_seed(params), self._decode,
                                       use_tqdm)
            self.num_calls += 1
            return batch
        engine = Engine(self.runner, self.proposer, self.k_for_batch_size, max_num_seqs=self.max_num_seqs,
                        max_model_len=self.max_model_len, adaptive=self.adaptive)
        requests = self._requests(prompt_ids, num_generations, params)
        for request in requests:
            engine.add(request)
        with tqdm(total=len(requests), desc="rollouts", unit="sample", disable=not use_tqdm) as bar:
            try:
                elapsed = engine.run(on_finish=lambda r: bar.update(1))
            except BaseException:
                engine.abort()
                raise
        self.num_calls += 1
        if self.adaptive is not None and self.adaptive.refine:
            self._save_step_costs()
        return self._batch(requests, engine, elapsed)

    def _save_step_costs(self) -> None:
        """Write the refined step costs to the disk cache: after the first call, then at most once a minute."""
        if self.num_calls == 1 or time.monotonic() - self._cost_saved_at > _COST_SAVE_INTERVAL_S:
            cost_profile.save(self.adaptive.costs, self._cost_key)
            self._cost_saved_at = time.monotonic()

    def measure_step_costs(self, refresh: bool = False) -> StepCostModel:
        """The step-cost model of these models on this hardware (spec/step_cost.py): from the disk cache, or
        measured now (seconds on small models) and cached; refresh=True measures anew."""
        self._cost_key = cost_profile.cache_key(self.model, self.draft_model, self.dtype, self.device,
                                                self.max_num_seqs, self.config.num_speculative_tokens + 1)
        drafter = self.proposer if self.draft_model is not None else None  # model-free drafters: no draft cost
        return cost_profile.load_or_profile(self._cost_key, self.runner, drafter, self.max_model_len, refresh=refresh)

    def _call_seed(self, params: SamplingParams) -> int:
        """The base seed of this call's completions: the params' seed, else one derived from (seed, call number)."""
        return mix_seed(self.seed, self.num_calls) if params.seed is None else params.seed

    def _requests(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams):
        base = self._call_seed(params)
        num_spec_tokens = self.config.num_speculative_tokens if self.config else 0
        stop_ids = frozenset(self.eos_token_ids | set(params.stop_token_ids or ()))
        requests = []
        for i, ids in enumerate(prompt_ids):
            group_id = next(self._ids)
            for j in range(num_generations):
                seed = mix_seed(base, i, j)
                generator = torch.Generator(device=self.device).manual_seed(seed)
                uniforms = PositionUniforms(torch.Generator(device=self.device).manual_seed(mix_seed(seed, 1)))
                requests.append(Request(next(self._ids), group_id, i, j, list(ids), params, generator, uniforms,
                                        RequestAcceptance.sized(num_spec_tokens), stop_ids))
        return requests

    def _batch(self, requests: list[Request], engine: Engine, elapsed: float) -> RolloutBatch:
        samples = [Sample(r.prompt_index, r.sample_index, r.prompt_ids, r.output_ids, r.logprobs,
                          self._decode(r.output_ids), r.finish_reason, r.acceptance.to_dict()) for r in requests]
        num_tokens = sum(len(s.completion_ids) for s in samples)
        total = engine.stats.total
        num_verified = len(total.k_per_step) + total.num_draft_tokens  # each row-step verifies k + 1 tokens
        adaptive = {} if self.adaptive is None else {**self.adaptive.stats(), "draft_cap": _cap(engine, self.config)}
        stats = {**engine.stats.to_dict(), **adaptive, "num_steps": engine.num_steps,
                 "num_proposed_draft_tokens": engine.num_proposed_drafts, "num_completion_tokens": num_tokens,
                 "verified_tokens_per_emitted_token": num_verified / max(num_tokens, 1),
                 "elapsed_s": elapsed, "tokens_per_s": num_tokens / max(elapsed, 1e-9)}
        metrics = {**engine.stats.to_metrics(), "spec/rollout_tokens_per_s": stats["tokens_per_s"],
                   "spec/verified_tokens_per_emitted_token": stats["verified_tokens_per_emitted_token"],
                   **{f"spec/{name}": float(value) for name, value in adaptive.items()}}
        return RolloutBatch(samples, stats, metrics)

    def _decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    # Trainer integration. Hooks are objects with before_rollout(trainer) and after_rollout(trainer, batch), run
    # around each __call__ (trainers.SpecRolloutCallback registers one); the class-level default is empty.
    rollout_hooks: tuple = ()

    def __call__(self, prompts: list, trainer) -> dict:
        """TRL's rollout function: `trl.GRPOTrainer(rollout_func=generator)`. The contract is in
        rollout/rollout_func.py."""
        from rollout.rollout_func import rollout_for_trainer
        return rollout_for_trainer(self, prompts, trainer)

    def add_rollout_hook(self, hook) -> None:
        self.rollout_hooks = (*self.rollout_hooks, hook)

    def load_weights(self, named_tensors) -> int:
        """Copy (HF parameter name, tensor) pairs into the target the engine runs, e.g. a trained policy's; every
        parameter must be given. Returns the number of tensors copied."""
        if self.vllm is not None:  # into the running vLLM engine (rollout/vllm_backend.py)
            return self.vllm.load_weights(named_tensors)
        from rollout.weights import load_weights
        return load_weights(self.runner.model, named_tensors)


def _cap(engine: Engine, config: SpecConfig) -> int:
    """The most drafts per request the call's closed-batch K allowed (spec/closed_batch.py); the config's K where
    it set none."""
    k = config.num_speculative_tokens
    return k if engine.draft_cap is None else min(k, engine.draft_cap)


def _as_step_costs(step_costs) -> StepCostModel:
    if isinstance(step_costs, StepCostModel):
        return step_costs
    if isinstance(step_costs, dict):
        return StepCostModel.from_dict(step_costs)
    return StepCostModel.load(step_costs)


def _as_config(speculative_config, draft_model) -> SpecConfig | None:
    if speculative_config is None or isinstance(speculative_config, SpecConfig):
        return speculative_config
    config = dict(speculative_config)
    if draft_model is not None and config.get("method") == "draft_model" and not config.get("model"):
        config["model"] = draft_model if isinstance(draft_model, str) else draft_model.name_or_path or "draft"
    return SpecConfig.from_dict(config)


def _vllm_backend(backend, model, config, draft_model, max_num_seqs, max_model_len, dtype, seed, vllm_kwargs):
    """The running vLLM engine for backend="vllm" (rollout/vllm_backend.py), None for "embedded"."""
    if backend not in ("embedded", "vllm"):
        raise ValueError(f"backend={backend!r}: choose 'embedded' (this package's engine) or 'vllm'")
    if backend == "embedded":
        if vllm_kwargs is not None:
            raise ValueError("vllm_kwargs is only read with backend='vllm'; drop it or set backend='vllm'")
        return None
    from rollout.vllm_backend import VLLMBackend
    return VLLMBackend(model, config, draft_model=draft_model, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                       dtype=dtype, seed=seed, vllm_kwargs=vllm_kwargs)


def _freeze_heap() -> None:
    """Collect, then move every object alive now (models, tokenizer, runners: the start-up heap) out of the cyclic
    garbage collector's scans, as vLLM's engine core does after start-up. Its oldest generation is otherwise rescanned
    whole now and then: with the default pair loaded, 360k objects in 130-140 ms, about every 12 s of rollouts at 64
    requests (1% of the time; adaptive verification's per-request bookkeeping fills the young generation twice as
    fast there). Frozen objects are still freed when their last reference goes; only reference cycles among them are
    no longer collected."""
    gc.collect()
    gc.freeze()
