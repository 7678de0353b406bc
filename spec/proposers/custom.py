"""`method: "custom_class"`: a user drafter named by its import path in `model` ("pkg.module.Class").

As in vLLM, the class is built from the config: `Class(spec_config)`; it implements the Proposer protocol
(spec/proposers/base.py). Its proposals are checked against the protocol every step, so a broken drafter
fails with a message naming it instead of corrupting verification.
"""

import importlib
from typing import Sequence

from spec.proposers.base import DraftRequest, Proposal


def load_class(path: str) -> type:
    """The class at "pkg.module.Class"; ValueError naming `model` when it cannot be imported."""
    module_name, _, class_name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"model={path!r}: custom_class needs a dotted path 'pkg.module.Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"model={path!r}: cannot import module {module_name!r} ({e}); "
                         "make it importable (installed or on PYTHONPATH)") from e
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"model={path!r}: module {module_name!r} has no class {class_name!r}")
    return cls


class CustomProposer:
    """Wraps the user's drafter and validates what it proposes."""

    def __init__(self, config):
        self.name = config.model
        self.inner = load_class(config.model)(config)
        if not callable(getattr(self.inner, "propose", None)):
            raise ValueError(f"model={self.name!r}: the class has no propose(requests, max_num_tokens) method")

    def propose(self, requests: Sequence[DraftRequest], max_num_tokens: Sequence[int]) -> Proposal:
        proposal = self.inner.propose(requests, max_num_tokens)
        if not isinstance(proposal, Proposal):
            raise ValueError(f"custom drafter {self.name!r} returned {type(proposal).__name__}; "
                             "return a spec.Proposal")
        proposal.validate(max_num_tokens, source=f"custom drafter {self.name!r}")
        return proposal

    def finish(self, request: DraftRequest) -> None:
        finish = getattr(self.inner, "finish", None)
        if finish is not None:
            finish(request)
