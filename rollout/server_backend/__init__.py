"""backend="server": running vLLM OpenAI servers (`python -m rollout serve`), over HTTP with the standard library.

    backend.py    ServerBackend: a pool of servers, each prompt's group routed to one, failover, weight syncs
    client.py     Server: one server as the backend uses it (what it serves, rollouts, reloads, worker calls)
    http.py       ServerClient: requests with retries and reconnection, ServerError
    history.py    ServerHistory: the pool's rollout history, each server holding its own prompts' share

Nothing is imported until a name is asked for (PEP 562).
"""

import importlib

_NAMES = {"ServerBackend": "rollout.server_backend.backend", "route": "rollout.server_backend.backend"}
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module 'rollout.server_backend' has no attribute {name!r}")
    return getattr(importlib.import_module(_NAMES[name]), name)
