"""Policy -> generator weight sync, the way TRL syncs its vLLM engine (`trl/generation/vllm_generation.py`,
`VLLMGeneration._iter_named_params` and `sync_weights`, TRL 1.16).

Once per optimizer step, before the rollout that follows it: skipped while `trainer.state.global_step` has not
changed (gradient accumulation, evaluation, several generations per step). A PEFT policy is read with its adapters
merged into the base weights, under the base model's parameter names. Under DeepSpeed ZeRO-3 the parameters are
gathered from their shards first (every process takes part: gathering is a collective); FSDP is not supported.
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
        policy = accelerator.unwrap_model(trainer.model)
        self.generator.load_weights(policy_weights(policy, is_zero3))
        self.last_synced_step = trainer.state.global_step
        self.num_syncs += 1


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
