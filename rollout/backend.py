"""The backend protocol: what `RolloutGenerator` and the trainers ask of whatever runs the models.

The generator tokenises prompts, derives each call's seed and decodes; a backend turns token-id prompts into samples.
Backends: the embedded engine (rollout/embedded.py), vLLM in this process (rollout/vllm_backend/) and a running
vLLM server (rollout/server_backend.py). Weight updates are atomic: every name, shape and dtype is checked before
anything is written, so a bad or failing source leaves the previous weights in place.
"""

from typing import Callable, Iterable, Protocol

import torch

from rollout.outputs import RolloutBatch
from rollout.sampling_params import SamplingParams
from spec import SpecConfig

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class Backend(Protocol):
    config: SpecConfig | None  # the speculative config it runs; None: no speculation
    max_model_len: int  # prompt + completion tokens at most
    eos_token_ids: set[int]  # tokens that end every completion
    is_shared: bool  # one engine for several trainer processes (a server): one process writes its weights

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
