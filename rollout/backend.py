"""The backend protocol: what `RolloutGenerator` and the trainers ask of whatever runs the models, and
`build_backend`, which builds one.

The generator tokenises prompts, derives each call's seed and decodes; a backend turns token-id prompts into samples.
Backends: the embedded engine (rollout/embedded_backend/backend.py), vLLM in this process (rollout/vllm_backend/) and
running vLLM servers (rollout/server_backend/backend.py). Weight updates are atomic: every name, shape and dtype is
checked before anything is written, so a bad or failing source leaves the previous weights in place. Where a backend
cannot do what a method asks (the server cannot change its schedule), it raises NotImplementedError saying what to do
instead.
"""

from typing import Callable, Iterable, Protocol

import torch

from rollout.arguments import as_spec_config
from rollout.history import RolloutHistory
from rollout.loading import default_device_dtype
from rollout.outputs import RolloutBatch
from rollout.sampling_params import SamplingParams
from spec import SpecConfig
from spec.drafting_host import MAX_DRAFTER_FAULTS

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class Backend(Protocol):
    config: SpecConfig | None  # the speculative config it runs; None: no speculation
    max_model_len: int  # prompt + completion tokens at most
    max_num_seqs: int  # running requests at most
    eos_token_ids: set[int]  # tokens that end every completion
    is_shared: bool  # one engine for several trainer processes (a server): one process writes its weights
    base_url: str | None  # the shared engine's address; None where is_shared is False
    target_source: object  # where the target's tokenizer and config load from: a local folder, a loaded
    # PreTrainedModel, or None (a server's folder that is not on this machine)
    history: RolloutHistory | None  # the drafter's rollout history (rollout/history.py); None where it keeps none

    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams, seed: int,
                 decode: Callable[[list[int]], str | None], use_tqdm: bool) -> RolloutBatch:
        """num_generations samples per prompt, in input order; completion j of prompt i draws from
        mix_seed(seed, i, j)."""
        ...

    def load_weights(self, named_tensors: NamedTensors) -> int:
        """Replace the target's weights (HF parameter names, every parameter given); the number of tensors."""
        ...

    def load_draft_weights(self, named_tensors: NamedTensors) -> int:
        """Replace the draft model's weights likewise; ValueError where the method has no draft model."""
        ...

    def draft_model_copy(self) -> torch.nn.Module:
        """A trainable copy of the draft model as it runs now (drafter refresh distils it, then loads it back)."""
        ...

    def use_schedule(self, schedule: list[list[int]]) -> None:
        """Follow `schedule` ([[start, end, K], ...]) from the next call on (what `rollout tune` times)."""
        ...

    def build_speculation(self, config: SpecConfig | None, draft_model=None):
        """A drafter and speculation policy for `config` on the loaded target, to run with use_speculation
        (NotImplementedError where the engine is built with its config: vLLM)."""
        ...

    def use_speculation(self, speculation) -> None:
        """Run `speculation` (from build_speculation) from the next call on."""
        ...

    def measure_step_times(self, prompt_ids: list[list[int]], batch_sizes: list[int], ks: list[int]):
        """The engine's step seconds by batch size and K (a spec.tuning.StepTimes), for the schedule tuner;
        prompt_ids fill the timed batches where the backend times whole steps."""
        ...


def build_backend(backend: str, model, speculative_config, *, draft_model=None, tokenizer=None, max_num_seqs: int,
                  max_model_len: int | None, device=None, dtype=None, seed: int = 0,
                  vllm_kwargs: dict | None = None, base_url: str | None = None, server_kwargs: dict | None = None,
                  max_drafter_faults: int = MAX_DRAFTER_FAULTS) -> Backend:
    """The backend named `backend` ("embedded", "vllm", "server"), for arguments that
    rollout.arguments.check_generator_args has checked."""
    if backend == "server":
        from rollout.server_backend.backend import ServerBackend
        return ServerBackend(base_url, model=model, draft_model=draft_model, tokenizer=tokenizer,
                             **(server_kwargs or {}))
    config = as_spec_config(speculative_config, draft_model)  # a bad config fails before any loading
    if backend == "embedded":
        from rollout.embedded_backend.backend import EmbeddedBackend
        device, dtype = default_device_dtype(device, dtype)
        return EmbeddedBackend(model, config, draft_model=draft_model, max_num_seqs=max_num_seqs,
                               max_model_len=max_model_len, device=device, dtype=dtype,
                               max_drafter_faults=max_drafter_faults)
    from rollout.vllm_backend import VLLMBackend
    return VLLMBackend(model, config, draft_model=draft_model, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                       dtype=dtype, seed=seed, vllm_kwargs=vllm_kwargs, max_drafter_faults=max_drafter_faults)
