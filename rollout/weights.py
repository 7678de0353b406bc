"""New weights for a running model: (name, tensor) pairs under the HF parameter names, e.g. a trained policy's.

Loading is atomic. Every tensor is checked (a parameter of that name, the same shape, a floating-point dtype) and
staged on the parameter's device and dtype before anything is written; only when the source is exhausted and every
parameter was given are the staged tensors copied in. A bad name, shape or dtype, a missing parameter or a source
that raises mid-stream leaves the model as it was. The cost is one copy of the weights in memory while staging.
The engine's caches hold nothing derived from the weights between calls (KV slots are freed when a call ends), so
copying into the parameters is all an update needs.
"""

from typing import Iterable

import torch


def load_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], role: str) -> int:
    """Stage, then copy each tensor into `model`'s parameter of that name (role names the model in errors: "target",
    "draft model"). Tied parameters may arrive under either name. Returns the number of tensors given."""
    params = dict(model.named_parameters(remove_duplicate=False))  # tied weights under every name
    staged: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
    num_given = 0
    for name, tensor in named_tensors:
        param = params.get(name)
        _check(role, model, name, param, tensor)
        staged[id(param)] = (param, tensor.detach().to(param.device, param.dtype, copy=True))
        num_given += 1
    missing = sorted({n for n, p in params.items() if id(p) not in staged})
    if missing:
        raise ValueError(f"weights for {len(missing)} {role} parameters were not given (e.g. {missing[:3]}); pass "
                         "every parameter; nothing was loaded")
    with torch.no_grad():
        for param, tensor in staged.values():
            param.copy_(tensor)
    return num_given


def _check(role: str, model, name, param, tensor) -> None:
    if param is None:
        raise ValueError(f"weight {name!r}: the {role} ({type(model).__name__}) has no parameter of that name; the "
                         "source and the generator's model must be the same architecture; nothing was loaded")
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor; nothing was loaded")
    if tensor.shape != param.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, the {role}'s {tuple(param.shape)}; the "
                         "source and the generator's model must have the same config; nothing was loaded")
    if not tensor.is_floating_point():
        raise ValueError(f"weight {name!r} has dtype {tensor.dtype}; parameters take floating-point tensors (cast "
                         "from another float dtype is fine, from integers or bools it is not); nothing was loaded")
