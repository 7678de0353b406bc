"""`RolloutGenerator`: the public entry point. Loads the models, tokenises prompts, runs the engine, returns
samples in input order with their logprobs and acceptance records."""

import itertools

import torch
from tqdm.auto import tqdm

from rollout.default_models import default_model_paths
from rollout.engine import Engine
from rollout.loading import check_same_vocab, load_model, load_tokenizer, default_device_dtype
from rollout.outputs import RolloutBatch, Sample
from rollout.prompts import to_token_ids
from rollout.request import Request
from rollout.sampling_params import SamplingParams
from spec import RequestAcceptance, SpecConfig, build_proposer
from spec.model_runner import build_runner

_SEED_MIX = 1_000_003
DEFAULT_MAX_MODEL_LEN = 2048


class RolloutGenerator:
    """Rollouts from `model` (a local HF path, a loaded PreTrainedModel, or "default": the shipped target).

    speculative_config: the vLLM-style dict (or a SpecConfig); None = no speculation. For
    `method="draft_model"`, `draft_model` (path or loaded model) overrides the config's `model` path.
    max_num_seqs: running requests at most (each holds a KV slot of max_model_len positions).
    max_model_len: prompt + completion tokens at most (default: the model's max_position_embeddings, capped at
        DEFAULT_MAX_MODEL_LEN: the KV cache is allocated up front for max_num_seqs x max_model_len positions).
    seed: base seed; call i of `generate` draws from seeds derived from (seed, i, prompt, sample).
    """

    def __init__(self, model, *, tokenizer=None, draft_model=None, speculative_config=None,
                 max_num_seqs: int = 64, max_model_len: int | None = None, device=None, dtype=None,
                 seed: int = 0):
        if isinstance(model, str) and model == "default":
            model = default_model_paths()["target"]
        self.config = _as_config(speculative_config, draft_model)  # bad config fails before any loading
        self.device, self.dtype = default_device_dtype(device, dtype)
        self.tokenizer = load_tokenizer(model, tokenizer)
        self.model = load_model(model, self.device, self.dtype, field="model")
        self.max_model_len = max_model_len or min(self.model.config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        self.max_num_seqs = max_num_seqs
        self.runner = build_runner(self.model, max_num_seqs, self.max_model_len, self.device, self.dtype)
        self.draft_model = None
        if self.config is not None and self.config.method == "draft_model":
            self.draft_model = load_model(draft_model if draft_model is not None else self.config.model,
                                          self.device, self.dtype, field="draft_model")
            check_same_vocab(self.model, self.draft_model)
        self.proposer = None if self.config is None else build_proposer(
            self.config, draft_model=self.draft_model, max_num_seqs=max_num_seqs,
            max_model_len=self.max_model_len, device=self.device, dtype=self.dtype)
        self.seed = seed
        self.num_calls = 0
        self._ids = itertools.count()  # request and prompt-group ids, unique across calls

    @property
    def eos_token_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        eos = self.model.config.eos_token_id if eos is None else eos
        return set(eos) if isinstance(eos, (list, tuple)) else ({eos} if eos is not None else set())

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
        engine = Engine(self.runner, self.proposer, self.k_for_batch_size, max_num_seqs=self.max_num_seqs,
                        max_model_len=self.max_model_len)
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
        return self._batch(requests, engine, elapsed)

    def _requests(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams):
        base = self.seed * _SEED_MIX + self.num_calls if params.seed is None else params.seed
        num_spec_tokens = self.config.num_speculative_tokens if self.config else 0
        stop_ids = frozenset(self.eos_token_ids | set(params.stop_token_ids or ()))
        requests = []
        for i, ids in enumerate(prompt_ids):
            group_id = next(self._ids)
            for j in range(num_generations):
                seed = ((base * _SEED_MIX + i) * _SEED_MIX + j) % (2 ** 63)
                generator = torch.Generator(device=self.device).manual_seed(seed)
                requests.append(Request(next(self._ids), group_id, i, j, list(ids), params, generator,
                                        RequestAcceptance.sized(num_spec_tokens), stop_ids))
        return requests

    def _batch(self, requests: list[Request], engine: Engine, elapsed: float) -> RolloutBatch:
        samples = [Sample(r.prompt_index, r.sample_index, r.prompt_ids, r.output_ids, r.logprobs,
                          self._decode(r.output_ids), r.finish_reason, r.acceptance.to_dict()) for r in requests]
        num_tokens = sum(len(s.completion_ids) for s in samples)
        total = engine.stats.total
        num_verified = len(total.k_per_step) + total.num_draft_tokens  # each row-step verifies k + 1 tokens
        stats = {**engine.stats.to_dict(), "num_steps": engine.num_steps, "num_completion_tokens": num_tokens,
                 "verified_tokens_per_emitted_token": num_verified / max(num_tokens, 1),
                 "elapsed_s": elapsed, "tokens_per_s": num_tokens / max(elapsed, 1e-9)}
        metrics = {**engine.stats.to_metrics(), "spec/rollout_tokens_per_s": stats["tokens_per_s"],
                   "spec/verified_tokens_per_emitted_token": stats["verified_tokens_per_emitted_token"]}
        return RolloutBatch(samples, stats, metrics)

    def _decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)


def _as_config(speculative_config, draft_model) -> SpecConfig | None:
    if speculative_config is None or isinstance(speculative_config, SpecConfig):
        return speculative_config
    config = dict(speculative_config)
    if draft_model is not None and config.get("method") == "draft_model" and not config.get("model"):
        config["model"] = draft_model if isinstance(draft_model, str) else draft_model.name_or_path or "draft"
    return SpecConfig.from_dict(config)

