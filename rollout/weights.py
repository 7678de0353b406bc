"""New weights for a running model: (name, tensor) pairs under the HF parameter names, e.g. a trained policy's.

Loading is atomic on every backend. `stage_weights` checks every tensor against the model's parameters (a parameter
of that name, the same shape, a floating-point dtype) and copies it into a staging buffer before anything is
written; only when the source is exhausted and every parameter was given does a backend write the staged tensors.
A bad name, shape or dtype, a missing parameter or a source that raises mid-stream leaves the model as it was. The
cost is one copy of the weights in memory while staging.

The embedded engine checks against its own model (`load_weights`). vLLM's models carry vLLM's parameter names and
repacked shapes, so the vLLM backends check against `parameter_skeleton(folder)`: the HF model built from the
folder's config on the meta device, which has the HF names and shapes and holds no memory.
"""

from typing import Iterable

import torch
from transformers import AutoConfig, AutoModelForCausalLM

NamedTensors = Iterable[tuple[str, torch.Tensor]]


def load_weights(model: torch.nn.Module, named_tensors: NamedTensors, role: str) -> int:
    """Stage, then copy each tensor into `model`'s parameter of that name (role names the model in errors: "target",
    "draft model"). Tied parameters may arrive under either name. Returns the number of tensors given."""
    params = dict(model.named_parameters(remove_duplicate=False))  # tied weights under every name
    staged, num_given = stage_weights(params, named_tensors, role, type(model).__name__)
    with torch.no_grad():
        for name, tensor in staged:
            params[name].copy_(tensor)
    return num_given


def stage_weights(params: dict[str, torch.Tensor], named_tensors: NamedTensors, role: str, model_name: str,
                  device=None, dtype=None) -> tuple[list[tuple[str, torch.Tensor]], int]:
    """([(name, staged copy)] with one entry per distinct parameter, number of tensors given). `params` maps every
    parameter name (tied ones under each of their names) to the parameter or a meta tensor of its shape; copies go
    to `device`/`dtype`, else the parameter's own. ValueError naming the tensor before anything is returned."""
    staged: dict[int, tuple[str, torch.Tensor]] = {}
    num_given = 0
    for name, tensor in named_tensors:
        param = params.get(name)
        _check(role, model_name, name, param, tensor)
        target_device = device if device is not None else param.device
        staged[id(param)] = (name, tensor.detach().to(target_device, dtype or param.dtype, copy=True))
        num_given += 1
    missing = sorted({n for n, p in params.items() if id(p) not in staged})
    if missing:
        raise ValueError(f"weights for {len(missing)} {role} parameters were not given (e.g. {missing[:3]}); pass "
                         "every parameter; nothing was loaded")
    return list(staged.values()), num_given


def parameter_skeleton(folder: str) -> tuple[dict[str, torch.Tensor], str]:
    """(every HF parameter name of the model saved in `folder`, tied ones under each name -> a meta tensor of its
    shape; the model's class name): the model built from the folder's config on the meta device, without reading
    its weights."""
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return dict(model.named_parameters(remove_duplicate=False)), type(model).__name__


def _check(role: str, model_name: str, name, param, tensor) -> None:
    if param is None:
        raise ValueError(f"weight {name!r}: the {role} ({model_name}) has no parameter of that name; the "
                         "source and the generator's model must be the same architecture; nothing was loaded")
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor; nothing was loaded")
    if tensor.shape != param.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, the {role}'s {tuple(param.shape)}; the "
                         "source and the generator's model must have the same config; nothing was loaded")
    if not tensor.is_floating_point():
        raise ValueError(f"weight {name!r} has dtype {tensor.dtype}; parameters take floating-point tensors (cast "
                         "from another float dtype is fine, from integers or bools it is not); nothing was loaded")


def no_draft_model(config) -> ValueError:
    """The error for a drafter-weight operation where the speculative method (config: a SpecConfig or None) has no
    draft model."""
    method = None if config is None else config.method
    return ValueError(f"the speculative method is {method!r}, which has no draft model; drafter weights need method "
                      "'draft_model'")
