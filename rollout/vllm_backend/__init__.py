"""vLLM for `RolloutGenerator`: the engine in this process (`backend="vllm"`, inprocess.py) and what a vLLM server
needs from this project (serve.py, the `python -m rollout serve` launcher); what it shares with the server client
is in rollout/vllm_common.py. The only package that imports vllm,
and only lazily: importing it (or `rollout`) does not import vllm; building an engine or running the launcher does.

    inprocess.py     VLLMBackend: vllm.LLM in this process
    engine_args.py   the settings the backends need (processed logprobs, per-request metrics, KV size, ...)
    versions.py      which vLLM is installed, and the form the project's drafters take on it (the plugin too)
    drafting.py      the project's drafters inside vLLM's workers, whichever runner calls them
    proposer.py      ... called by vLLM 0.32-0.33's V1 runner (its custom_class hook)
    speculator.py    ... called by vLLM 0.34+'s Model Runner V2 (a registered speculator; speculator_config.py)
    lazy_class.py    those two modules' classes on vLLM's bases, built when vLLM asks for them
    sampler_fix.py   the CPU build's sampler-kernel fix
    worker.py        the worker extension vLLM loads in its workers: the fix, draft-weight reloads, the drafter's RPCs
    serve.py         `python -m rollout serve`: vLLM's OpenAI server with those settings
    guard.py         the server's gate (vLLM --middleware): the key on every route, the client's RPCs only
"""

from rollout.vllm_backend.inprocess import INSTALL_HINT, VLLMBackend, import_vllm

__all__ = ["INSTALL_HINT", "VLLMBackend", "import_vllm"]
