"""backend="embedded": this package's own engine, in this process.

    backend.py    EmbeddedBackend: the target, its drafter and speculation policy, a call's requests and batch
    engine.py     Engine: plan -> draft (spec/drafting_host.py) -> verify -> commit -> observe, step by step
    scheduler.py  admission of waiting requests and the step's K, in plain Python
    request.py    one running sample: its tokens, logprobs, stop rule, uniforms and acceptance record

Nothing is imported until a name is asked for (PEP 562).
"""

from rollout.lazy import lazy_getattr

_NAMES = {"EmbeddedBackend": "rollout.embedded_backend.backend", "Speculation": "rollout.embedded_backend.backend"}
__all__ = sorted(_NAMES)
__getattr__ = lazy_getattr(__name__, _NAMES)
