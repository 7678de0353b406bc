"""The engine settings the vLLM backends need, shared by the in-process engine (inprocess.py) and the server launcher
(serve.py). No vllm import: these are read from the model folders and the environment.

What the backends rely on, and why:
- processed logprobs (`logprobs_mode="processed_logprobs"`): the trainer's logprobs are the sampled tokens' under
  temperature, top-k and top-p, as the embedded engine reports them;
- per-request spec-decode metrics at the "detailed" level: each sample's acceptance record;
- `generation_config="vllm"`: vLLM's sampling defaults, not the model folder's (which would cap max_tokens);
- the worker extension (worker.py): the CPU sampler fix in every worker process, and draft-weight reloads;
- on CPU: eager mode (no compile warm-up: 20-60 s at start-up for the small models this runs on CPU), a KV cache
  sized for max_num_seqs x max_model_len tokens (vLLM's CPU default asks for 92% of the machine's memory), and for
  tensor parallelism one OpenMP core list per rank (VLLM_CPU_OMP_THREADS_BIND; the default wants a NUMA node per
  rank and fails on a one-node machine).
"""

import os
from pathlib import Path

import torch
from transformers import AutoConfig, PreTrainedModel

from rollout.vllm_backend.versions import drafter_speculative_config, runs_project_drafter
from spec import SpecConfig
from spec.config import PROTOCOL_METHODS
KV_SLACK_TOKENS = 64  # per request: vLLM allocates whole blocks and room for the drafts of the last step
# LLM(...) arguments the in-process backend sets from its own: passing them in vllm_kwargs would break what it returns.
FIXED_KWARGS = ("model", "tokenizer", "skip_tokenizer_init", "speculative_config", "per_request_spec_decode_metrics",
                "logprobs_mode", "disable_log_stats", "max_model_len", "max_num_seqs", "seed", "dtype",
                "generation_config", "worker_extension_cls")


def local_folder(path, field: str) -> str:
    """`path` as a string when it is a local folder; ValueError naming `field` otherwise."""
    if isinstance(path, PreTrainedModel):
        raise ValueError(f"{field}=<loaded {type(path).__name__}>: vLLM loads the model from disk; save it with "
                         "save_pretrained and pass its folder")
    if not isinstance(path, (str, Path)) or not Path(path).is_dir():
        raise ValueError(f"{field}={path!r}: expected a local model folder (nothing is downloaded)")
    return str(path)


def speculative_config(config: SpecConfig, draft_model) -> tuple[dict, dict]:
    """(vLLM's speculative_config dict, the additional_config entries it needs). vLLM's own drafters: to_vllm's dict,
    with `draft_model` (a folder) overriding the config's model, and no entries. This project's drafters
    (PROTOCOL_METHODS): the form the installed vLLM runs them in (versions.py), the whole config in
    additional_config[CONFIG_KEY]."""
    if config.method in PROTOCOL_METHODS:
        return drafter_speculative_config(config)
    spec = config.to_vllm()
    if draft_model is not None:
        spec["model"] = local_folder(draft_model, "draft_model")
    elif config.method == "draft_model":
        local_folder(config.model, "speculative_config['model']")
    return spec, {}


def drafter_folder(spec: dict | None) -> str | None:
    """The folder of the drafter a speculative config loads beside the target, whose KV cache counts too (None: none;
    the project's drafters load no model)."""
    return None if not spec or runs_project_drafter(spec) else spec.get("model")


def kv_cache_bytes(model_path: str, drafter: str | None, max_num_seqs: int, max_model_len: int,
                   dtype: torch.dtype) -> int:
    """Bytes of KV cache for max_num_seqs requests of max_model_len tokens (plus slack) in the target and the
    drafter (a drafter folder that cannot be read counts as large as the target)."""
    per_token = kv_bytes_per_token(model_path, dtype)
    if drafter:
        per_token += kv_bytes_per_token(drafter, dtype) if Path(drafter).is_dir() else per_token
    return per_token * max_num_seqs * (max_model_len + KV_SLACK_TOKENS)


def kv_bytes_per_token(path: str, dtype: torch.dtype) -> int:
    """Keys and values of one token in every attention layer of the model in `path`."""
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    config = getattr(config, "text_config", None) or config
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    return 2 * config.num_hidden_layers * num_kv_heads * head_dim * dtype.itemsize


def cpu_thread_binding(tensor_parallel_size: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tensor_parallel_size` ranks on this process's cores: the cores split into
    that many lists of consecutive cores ('0|1' for 2 ranks on 2 cores, '0,1,2,3|4,5,6,7' on 8), one per rank."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: this process may run on {len(cores)} "
                         "core(s), and vLLM's CPU build binds each rank to cores of its own; lower it or set "
                         "VLLM_CPU_OMP_THREADS_BIND yourself")
    size = len(cores) // tensor_parallel_size
    groups = [cores[rank * size:(rank + 1) * size] for rank in range(tensor_parallel_size)]
    return "|".join(",".join(map(str, group)) for group in groups)


def set_cpu_thread_binding(tensor_parallel_size: int) -> None:
    """Set VLLM_CPU_OMP_THREADS_BIND for tensor parallelism on CPU, unless the user set it."""
    if tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(tensor_parallel_size)
