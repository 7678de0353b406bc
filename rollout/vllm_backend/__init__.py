"""vLLM for `RolloutGenerator`: the engine in this process (`backend="vllm"`, inprocess.py) and what a vLLM server
needs from this project (serve.py, the `python -m rollout serve` launcher); what it shares with the server client is in
rollout/vllm_backend/common.py. The only package that imports vllm, and only lazily: importing it (or `rollout`) does
not import vllm; building an engine or running the launcher does. The package imports nothing itself: each process loads
only its own modules (the API server's gate and the plugin entry point the standard library and wire.py).

    inprocess.py     VLLMBackend: vllm.LLM in this process
    engine_args.py   the settings the backends need (processed logprobs, per-request metrics, KV size, ...)
    wire.py          what every process agrees on (standard library only): the worker-call table, keys, folders
    plugin.py        which vLLM is installed; the vllm.general_plugins entry point
    versions.py      the form the project's drafters take on the installed vLLM
    drafting.py      the project's drafters inside vLLM's workers, whichever runner calls them
    proposer.py      ... called by vLLM 0.32-0.33's V1 runner (its custom_class hook)
    speculator.py    ... called by vLLM 0.34+'s Model Runner V2 (a registered speculator; speculator_config.py)
    lazy_class.py    those two modules' classes on vLLM's bases, built when vLLM asks for them
    sampler_fix.py   the CPU build's sampler-kernel fix
    worker.py        the worker extension vLLM loads in its workers: the fix, draft-weight reloads, the drafter's RPCs
    serve.py         `python -m rollout serve`: vLLM's OpenAI server with those settings
    guard.py         the server's gate (vLLM --middleware): the key on every route, the client's RPCs only
"""

from rollout.lazy import lazy_getattr

_NAMES = {"INSTALL_HINT": "rollout.vllm_backend.inprocess", "VLLMBackend": "rollout.vllm_backend.inprocess",
          "import_vllm": "rollout.vllm_backend.inprocess"}
__all__ = sorted(_NAMES)
__getattr__ = lazy_getattr(__name__, _NAMES)
