"""New weights for a running target: (name, tensor) pairs under the HF parameter names, e.g. a trained policy's.

The engine's caches hold nothing derived from the weights between calls (KV slots are freed when a call ends),
so copying into the parameters in place is all an update needs.
"""

from typing import Iterable

import torch


def load_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy each tensor into `model`'s parameter of that name (cast to its dtype and device); every parameter must
    be written. Tied parameters may arrive under either name. Returns the number of tensors copied."""
    params = dict(model.named_parameters(remove_duplicate=False))  # tied weights under every name
    written: set[int] = set()
    num_copied = 0
    with torch.no_grad():
        for name, tensor in named_tensors:
            param = params.get(name)
            if param is None:
                raise ValueError(f"weight {name!r}: the target ({type(model).__name__}) has no parameter of that "
                                 "name; the policy and the generator's model must be the same architecture")
            if param.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, the target's {tuple(param.shape)};"
                                 " the policy and the generator's model must have the same config")
            param.copy_(tensor)
            written.add(id(param))
            num_copied += 1
    missing = sorted({n for n, p in params.items() if id(p) not in written})
    if missing:
        raise ValueError(f"weights for {len(missing)} target parameters were not given (e.g. {missing[:3]}); "
                         "pass every parameter of the policy")
    return num_copied
