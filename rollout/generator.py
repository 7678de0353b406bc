"""`RolloutGenerator`: the public entry point. One code path over a backend (rollout/backend.py): it tokenises
prompts, derives each call's seed, and returns samples in input order with their logprobs and acceptance records."""

import gc
import threading

from rollout.arguments import as_spec_config, check_call_args, check_generator_args, model_vocab_size
from rollout.backend import Backend, build_backend
from rollout.default_models import default_model_paths
from rollout.history import GeneratorHistory
from rollout.history_sharing import default_group, share
from rollout.loading import gguf_folder, load_tokenizer
from rollout.outputs import RolloutBatch
from rollout.prompts import to_token_ids
from rollout.sampling_params import SamplingParams, mix_seed
from spec import SpecConfig
from spec.drafting_host import MAX_DRAFTER_FAULTS


class RolloutGenerator:
    """Rollouts from `model` (a local HF path, a loaded PreTrainedModel, or "default": the shipped target). A `.gguf`
    file given as `model` or `draft_model` is converted once to a cached HF folder that every backend reads
    (rollout/gguf.py).

    speculative_config: the vLLM-style dict, its JSON string, or a SpecConfig; None = no speculation. For
    `method="draft_model"`, `draft_model` (path or loaded model) overrides the config's `model` path.
    device, dtype: torch objects or their names ("cuda:0", "bfloat16"); None: CUDA with bfloat16 when available,
        else CPU with float32.
    max_num_seqs: running requests at most (each holds a KV slot of max_model_len positions).
    max_model_len: prompt + completion tokens at most (default: the model's max_position_embeddings, capped at
        DEFAULT_MAX_MODEL_LEN: the KV cache is allocated up front for max_num_seqs x max_model_len positions).
    seed: base seed, an integer in [0, 2**32); call i of `generate` draws from seeds derived from (seed, i, prompt,
        sample).
    Every argument is checked before anything loads (rollout/arguments.py): a ValueError names it, its value and the
    fix; prompt and stop token ids are checked against the target's vocabulary at each call. backend: "embedded" (this
    package's engine, rollout/embedded_backend/backend.py), "vllm" (`vllm.LLM` in this process,
        rollout/vllm_backend/: it loads `model` and the drafter from their folders; device is vLLM's choice) or
        "server" (running vLLM OpenAI servers at `base_url`, rollout/server_backend/backend.py).
    vllm_kwargs: extra `vllm.LLM` arguments for backend="vllm" (tensor_parallel_size, gpu_memory_utilization, ...).
    base_url: the server's URL for backend="server", e.g. "http://127.0.0.1:8000", or a list of servers' URLs: each
        prompt's group then runs on one of them, chosen by a stable hash of its token ids, and on the next one in
        the list when that one is down. The servers' model, max_model_len, max_num_seqs and speculative config are
        read from them; `model` and `draft_model` are optional local copies
        of its folders (default: the server's own paths, when they exist on this machine), used for the tokenizer,
        EOS ids, weight checks and drafter refresh.
    server_kwargs: ServerBackend options for backend="server" (api_key, weights_dir, request_timeout_s, reconnect_s,
        max_concurrency, probe_timeout_s; rollout/server_backend/backend.py).
    max_drafter_faults: a drafter that raises or returns a malformed proposal costs its step's drafts, not the call
        (the tokens are the same, only slower); each call warns at its first fault, counts them
        (stats["num_drafter_faults"]) and stops drafting after this many, on the embedded engine and inside vLLM
        (where a run is a busy stretch of the engine); 0: the first fails the call. A server runs the limit it was
        started with (`rollout serve --max-drafter-faults`).

    One call at a time: concurrent `generate` and `load_weights` calls from several threads wait for each other.
    """

    def __init__(self, model=None, *, tokenizer=None, draft_model=None, speculative_config=None,
                 max_num_seqs: int = 64, max_model_len: int | None = None, device=None, dtype=None,
                 seed: int = 0, backend: str = "embedded", vllm_kwargs: dict | None = None,
                 base_url: str | None = None, server_kwargs: dict | None = None,
                 max_drafter_faults: int = MAX_DRAFTER_FAULTS):
        if isinstance(model, str) and model == "default":
            model = default_model_paths()["target"]
        check_generator_args(model=model, tokenizer=tokenizer, draft_model=draft_model, max_num_seqs=max_num_seqs,
                             max_model_len=max_model_len, device=device, seed=seed, backend=backend,
                             vllm_kwargs=vllm_kwargs, base_url=base_url,
                             server_kwargs=server_kwargs, speculative_config=speculative_config,
                             max_drafter_faults=max_drafter_faults)
        model, draft_model = gguf_folder(model), gguf_folder(draft_model)
        self.backend: Backend = build_backend(
            backend, model, speculative_config, draft_model=draft_model, tokenizer=tokenizer,
            max_num_seqs=max_num_seqs, max_model_len=max_model_len, device=device, dtype=dtype, seed=seed,
            vllm_kwargs=vllm_kwargs, base_url=base_url, server_kwargs=server_kwargs,
            max_drafter_faults=max_drafter_faults)
        target = self.backend.target_source
        self.tokenizer = load_tokenizer(target, tokenizer)
        self.vocab_size = None if target is None else model_vocab_size(target)
        self.seed = seed
        self.num_calls = 0
        self._lock = threading.Lock()  # the backend's caches serve one call, and call seeds count calls
        _freeze_heap()

    @property
    def config(self) -> SpecConfig | None:
        return self.backend.config

    @property
    def max_model_len(self) -> int:
        return self.backend.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.backend.max_num_seqs

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.backend.eos_token_ids)

    @property
    def is_shared(self) -> bool:
        """Several trainer processes share this generator's engine (a server): one of them writes its weights."""
        return self.backend.is_shared

    @property
    def base_url(self) -> str | None:
        """The shared engine's address (backend="server"); None otherwise."""
        return self.backend.base_url

    def generate(self, prompts, num_generations: int = 1, sampling_params: SamplingParams | None = None,
                 use_tqdm: bool = True) -> RolloutBatch:
        """num_generations samples per prompt, in input order (prompt 0's samples first).

        prompts: strings, chat message lists (the chat template is applied), token-id lists, or a
        datasets.Dataset with a "prompt" column.
        """
        params = SamplingParams() if sampling_params is None else sampling_params
        check_call_args(params, num_generations, use_tqdm, self.vocab_size)
        prompt_ids = to_token_ids(prompts, self.tokenizer, self.max_model_len, self.vocab_size)
        with self._lock:
            batch = self.backend.generate(prompt_ids, num_generations, params, self._call_seed(params), self._decode,
                                          use_tqdm)
            self.num_calls += 1
        return batch

    def load_weights(self, named_tensors) -> int:
        """Replace the target's weights with (HF parameter name, tensor) pairs, e.g. a trained policy's; every
        parameter must be given. Atomic: nothing is written unless all of them check out. Returns the number of
        tensors."""
        with self._lock:
            return self.backend.load_weights(named_tensors)

    def load_draft_weights(self, named_tensors) -> int:
        """Replace the draft model's weights likewise (method "draft_model")."""
        with self._lock:
            return self.backend.load_draft_weights(named_tensors)

    def draft_model_copy(self):
        """A trainable copy of the draft model as it runs now (method "draft_model"): what the drafter refresh
        distils before loading it back with load_draft_weights."""
        with self._lock:
            return self.backend.draft_model_copy()

    def use_schedule(self, schedule: list[list[int]]) -> None:
        """Follow `schedule` ([[start, end, K], ...], the rules of num_speculative_tokens_per_batch_size) from the next
        call on, on the same engine and models. backend="vllm" needs an engine built with a schedule; a server keeps
        the one it was started with (NotImplementedError)."""
        with self._lock:
            self.backend.use_schedule(schedule)

    def build_speculation(self, speculative_config):
        """A drafter and speculation policy for `speculative_config` (as the constructor takes it; None: none) on
        this generator's loaded target, to run with use_speculation: several configs then take turns on one target
        and one KV cache, each keeping its drafter's and policy's state (benchmarks, A/B runs). A draft model already
        loaded is shared. Embedded backend only (NotImplementedError on vLLM, built with its config)."""
        config = as_spec_config(speculative_config, None)
        with self._lock:
            return self.backend.build_speculation(config)

    def use_speculation(self, speculation) -> None:
        """Run `speculation` (from build_speculation) from the next call on."""
        with self._lock:
            self.backend.use_speculation(speculation)

    @property
    def rollout_history(self) -> GeneratorHistory | None:
        """The drafter's rollout history (method "history": each prompt's latest rollouts), None where the drafter
        keeps none: `add(prompt_ids, completion_ids)` rollouts from anywhere, as if this generator had rolled them
        out (rollout i is prompt_ids[i] followed by completion_ids[i]; ValueError, nothing added, for lists of
        different lengths, an empty prompt or ids outside the target's vocabulary), `save(path)` to one .npz file,
        `load(path)` (ValueError, the history unchanged, for a file that is not a complete history for this model).
        On backend="server" each prompt's rollouts live on the server its group runs on (rollout/history.py).
        SpecRolloutCallback saves it with each trainer checkpoint and shares it between processes."""
        history = self.backend.history
        return None if history is None else GeneratorHistory(history, self._lock, self.vocab_size)

    def share_rollout_history(self, batch: RolloutBatch, group=None) -> dict:
        """Send this process's rollouts (`batch`, the last generate's) to every process of the job and add theirs to
        this generator's history (rollout/history_sharing.py): one all-gather on `group`, torch.distributed's default
        group unless given. Every process of the group must call it after each rollout (SpecRolloutCallback does).
        Nothing happens with one process, a drafter that keeps no history, or backend="server" (each prompt runs on
        one server, whose history every trainer process feeds). Drafts change, samples never; a failed collective
        warns and leaves the history as it was. Returns {"num_shared": rollouts added, "seconds": time spent}."""
        group = default_group() if group is None else group
        if group is None or self.is_shared or self.rollout_history is None:
            return {"num_shared": 0, "seconds": 0.0}
        return share(self, batch, group)

    def measure_step_times(self, prompt_ids: list[list[int]], batch_sizes: list[int], ks: list[int]):
        """This engine's whole-step seconds by batch size and K (a spec.tuning.StepTimes), what `rollout tune` predicts
        from: batches of prompt_ids timed at each batch size and K (rollout/step_times.py; the schedule is left
        forcing the last K)."""
        with self._lock:
            return self.backend.measure_step_times(prompt_ids, batch_sizes, ks)

    def _call_seed(self, params: SamplingParams) -> int:
        """The base seed of this call's completions: the params' seed, else one derived from (seed, call number)."""
        return mix_seed(self.seed, self.num_calls) if params.seed is None else params.seed

    def _decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)


def _freeze_heap() -> None:
    """Collect, then move every object alive now (models, tokenizer, runners: the start-up heap) out of the cyclic
    garbage collector's scans, as vLLM's engine core does after start-up. Its oldest generation is otherwise rescanned
    whole now and then: with the default pair loaded, 360k objects in 130-140 ms, about every 12 s of rollouts at 64
    requests. Frozen objects are still freed when their last reference goes; only reference cycles among them are no
    longer collected."""
    gc.collect()
    gc.freeze()
