"""vLLM for `RolloutGenerator`: the engine in this process (`backend="vllm"`, inprocess.py) and what a vLLM server
needs from this project (serve.py, the `python -m rollout serve` launcher); what it shares with the server client
is in rollout/vllm_common.py. The only package that imports vllm,
and only lazily: importing it (or `rollout`) does not import vllm; building an engine or running the launcher does.

    inprocess.py     VLLMBackend: vllm.LLM in this process
    engine_args.py   the settings the backends need (processed logprobs, per-request metrics, KV size, ...)
    sampler_fix.py   the CPU build's sampler-kernel fix
    worker.py        the worker extension vLLM loads in its workers: the fix, draft-weight reloads
    step_times.py    vLLM's step time per batch size and K, for `rollout tune --backend vllm`
    serve.py         `python -m rollout serve`: vLLM's OpenAI server with those settings
    guard.py         the server's gate (vLLM --middleware): the key on every route, the client's RPCs only
"""

from rollout.vllm_backend.inprocess import INSTALL_HINT, VLLMBackend, import_vllm

__all__ = ["INSTALL_HINT", "VLLMBackend", "import_vllm"]
