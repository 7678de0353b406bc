"""`method: "custom_class"`: a user drafter named by its import path in `model` ("pkg.module.Class").

As in vLLM, the class is built from the config: `Class(spec_config)`; it implements the Proposer protocol
(spec/proposers/base.py). Its proposals are checked against the protocol every step, so a broken proposal is a
ValueError naming the drafter instead of corrupted verification: the engine drops that step's drafts and warns. A
drafter that cannot work with the config (no confidences or draft_probs under adaptive verification) is a
DrafterConfigError, which fails the call.

Confidence. A drafter that has no acceptance estimate may return `confidence=None`. Adaptive verification
ranks drafts by confidence, so it then needs a fallback named by the class attribute
`confidence_fallback = "acceptance_rate"`: every draft gets raw confidence 1.0 and the calibrator learns the
acceptance rate per position instead (spec/adaptive/calibration.py). A class that sets `gives_confidence = False` and no
fallback is refused at construction when adaptive verification is on.
"""

import importlib
from typing import Sequence

from spec.proposers.base import DrafterConfigError, DraftRequest, Proposal

CONFIDENCE_FALLBACKS = ("acceptance_rate",)


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
        self.is_adaptive = config.enable_adaptive_verification
        if not callable(getattr(self.inner, "propose", None)):
            raise ValueError(f"model={self.name!r}: the class has no propose(requests, max_num_tokens) method")
        self.confidence_fallback = getattr(self.inner, "confidence_fallback", None)
        if self.confidence_fallback not in (None, *CONFIDENCE_FALLBACKS):
            raise ValueError(f"custom drafter {self.name!r}: confidence_fallback={self.confidence_fallback!r} is not "
                             f"one of {list(CONFIDENCE_FALLBACKS)}")
        if self.is_adaptive and not getattr(self.inner, "gives_confidence", True) and not self.confidence_fallback:
            raise ValueError(self._no_confidence_message())

    def propose(self, requests: Sequence[DraftRequest], max_num_tokens: Sequence[int]) -> Proposal:
        proposal = self.inner.propose(requests, max_num_tokens)
        if not isinstance(proposal, Proposal):
            raise ValueError(f"custom drafter {self.name!r} returned {type(proposal).__name__}; "
                             "return a spec.Proposal")
        if proposal.confidence is None:
            if self.is_adaptive and not self.confidence_fallback:
                raise DrafterConfigError(self._no_confidence_message())
            proposal.confidence = [[1.0] * len(t) for t in proposal.token_ids]
        proposal.validate(max_num_tokens, source=f"custom drafter {self.name!r}")
        if self.is_adaptive and proposal.draft_probs is not None:
            raise DrafterConfigError(f"custom drafter {self.name!r} returned draft_probs with "
                                     "enable_adaptive_verification=True; adaptive verification stays lossless only "
                                     "for point proposals: return draft_probs=None, or turn adaptive verification off")
        return proposal

    def _no_confidence_message(self) -> str:
        return (f"custom drafter {self.name!r} gives no confidence and enable_adaptive_verification=True has "
                "nothing to rank its drafts by; return confidences in [0, 1], set the class attribute "
                "confidence_fallback = 'acceptance_rate', or turn adaptive verification off")

    def finish(self, request: DraftRequest) -> None:
        finish = getattr(self.inner, "finish", None)
        if finish is not None:
            finish(request)
