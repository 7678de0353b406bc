"""backend="server": running vLLM OpenAI servers (`python -m rollout serve`), over HTTP with the standard library.

    backend.py    ServerBackend: a pool of servers, each prompt's group routed to one, failover, weight syncs
    client.py     Server: one server as the backend uses it (what it serves, rollouts, reloads, worker calls)
    http.py       ServerClient: requests with retries and reconnection, ServerError
    history.py    ServerHistory: the pool's rollout history, each server holding its own prompts' share

Nothing is imported until a name is asked for (PEP 562).
"""

from rollout.lazy import lazy_getattr

_NAMES = {"ServerBackend": "rollout.server_backend.backend", "route": "rollout.server_backend.backend"}
__all__ = sorted(_NAMES)
__getattr__ = lazy_getattr(__name__, _NAMES)
