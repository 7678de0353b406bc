"""Policy -> generator weight sync, the way TRL syncs its vLLM engine (`trl/generation/vllm_generation.py`,
`VLLMGeneration._iter_named_params` and `sync_weights`, TRL 1.16).

Once per optimizer step, before the rollout that follows it: skipped while `trainer.state.global_step` has not
changed (gradient accumulation, evaluation, several generations per step). A PEFT policy is read with its adapters
merged into the base weights, under the base model's parameter names. Under DeepSpeed ZeRO-3 the parameters are
gathered from their shards first (every process takes part: gathering is a collective); FSDP is not supported.

An engine that trainer processes share (`generator.is_shared`: a vLLM server at `generator.base_url`) is written by
one process per server, its writer: the lowest-ranked process using that URL (all of them with one server, the main
process). Every process waits at a barrier, each writer loads the weights into its server, and every process
waits again, so that no process rolls out on old weights and no server is written twice.
"""

import contextlib
from typing import Iterator

import torch

from rollout import RolloutGenerator


class WeightSync:
    def __init__(self, generator: RolloutGenerator):
        self.generator = generator
        self.last_synced_step: int | None = None
        self.num_syncs = 0
        self.is_writer: bool | None = None  # this process writes its shared backend's weights (known after a sync)

    def maybe_sync(self, trainer) -> bool:
        """Copy the trainer's policy into the generator's target unless global_step is the one last synced."""
        if trainer.state.global_step == self.last_synced_step:
            return False
        self.sync(trainer)
        return True

    def sync(self, trainer) -> None:
        """Copy the trainer's policy into the generator's target now (every process must call it under ZeRO-3)."""
        accelerator = trainer.accelerator
        if getattr(accelerator.state, "fsdp_plugin", None) is not None:
            raise NotImplementedError("SpecRolloutCallback cannot sync weights from an FSDP policy; train with DDP "
                                      "or DeepSpeed ZeRO")
        is_zero3 = zero_stage(accelerator) == 3
        if is_zero3 and not getattr(trainer.args, "ds3_gather_for_generation", True):
            raise NotImplementedError("ds3_gather_for_generation=False: the generator needs the full weights each "
                                      "step; set ds3_gather_for_generation=True in the GRPOConfig")
        weights = policy_weights(accelerator.unwrap_model(trainer.model), is_zero3)
        if self.generator.is_shared:
            self._sync_shared(accelerator, weights)
        else:
            self.generator.load_weights(weights)
        self.last_synced_step = trainer.state.global_step
        self.num_syncs += 1

    def _sync_shared(self, accelerator, weights: Iterator) -> None:
        """Barrier, each server's writer loads `weights`, barrier (the others still iterate them under ZeRO-3:
        gathering a parameter is a collective)."""
        if self.is_writer is None:
            self.is_writer = is_writer(accelerator, self.generator.base_url)
        accelerator.wait_for_everyone()
        if self.is_writer:
            self.generator.load_weights(weights)
        else:
            for _ in weights:
                pass
        accelerator.wait_for_everyone()


def is_writer(accelerator, base_url: str) -> bool:
    """Whether this process is the lowest-ranked of the processes whose shared backend is at base_url (a
    collective: every process calls it)."""
    from accelerate.utils import gather_object
    urls = gather_object([base_url])  # one per process, in rank order
    return urls.index(base_url) == accelerator.process_index


def policy_weights(model: torch.nn.Module, is_zero3: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter the generator needs, one at a time, under the base model's names."""
    if not is_peft_model(model):
        for name, param in model.named_parameters():
            with gathered([param], is_zero3):
                yield _clean_name(name), param.data
        return
    # Merging adapters is not supported on shards: gather the whole model first, as TRL does.
    with gathered(list(model.parameters()), is_zero3):
        model.merge_adapter()
        try:
            for name, param in model.named_parameters():
                name = name.removeprefix("base_model.model.").replace(".base_layer", "")
                if model.prefix in name or "original_module" in name:  # adapter weights (merged already)
                    continue
                yield _clean_name(name, extra_prefixes=("modules_to_save.default.",)), param.data
        finally:
            model.unmerge_adapter()


def is_peft_model(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_adapter")


def zero_stage(accelerator) -> int:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin.zero_stage if plugin is not None else 0


@contextlib.contextmanager
def gathered(params: list, is_zero3: bool):
    """The full parameters under DeepSpeed ZeRO-3 (deepspeed.zero.GatheredParameters); a no-op otherwise."""
    if not is_zero3:
        yield
        return
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError("DeepSpeed ZeRO-3 is active but deepspeed cannot be imported: pip install deepspeed") from e
    with deepspeed.zero.GatheredParameters(params):
        yield


def _clean_name(name: str, extra_prefixes: tuple[str, ...] = ()) -> str:
    for prefix in ("_checkpoint_wrapped_module.", *extra_prefixes):
        name = name.replace(prefix, "")
    return name
