"""vLLM's own step times per batch size and K, for `python -m rollout tune --backend vllm` (spec/tuning.py
predicts each K's speedup from them and the measured acceptance).

One in-process engine, built with the largest K and a schedule (only then does vLLM's scheduler read its dense
batch-size -> K lookup, which `VLLMBackend.use_schedule` overwrites to force K). For each K and batch size B: time
B requests of `num_tokens` tokens (EOS ignored, so all B run to the end together) and the same with 1 token, and
count engine steps with vLLM's per-step histogram; the step time is (T(N) - T(1)) / (steps(N) - steps(1)), which
removes the prefill. The smallest over `repeats` is kept (noise on a shared machine only adds time). A step at K
includes the drafter's K forwards and the target's (K + 1)-token verification, whatever vLLM does per step besides.
"""

import time

from rollout.vllm_backend.inprocess import VLLMBackend
from spec.tuning import MeasuredSteps


def measure_step_times(backend: VLLMBackend, prompt_ids: list[list[int]], batch_sizes: list[int], ks: list[int],
                       num_tokens: int = 32, repeats: int = 2) -> MeasuredSteps:
    """MeasuredSteps over batch_sizes x ks; prompt_ids are cycled to fill a batch. The engine's schedule is left
    forcing the last K: the caller sets the one it wants next."""
    max_num_seqs = backend.max_num_seqs
    batches = {b: [prompt_ids[i % len(prompt_ids)] for i in range(b)] for b in batch_sizes}
    _seconds_per_step(backend, batches[max(batch_sizes)], num_tokens)  # untimed: the first calls pay for allocations
    seconds: dict[int, dict[int, float]] = {b: {} for b in batch_sizes}
    for k in ks:
        backend.use_schedule([[1, max_num_seqs, k]])
        for batch_size, prompts in batches.items():
            seconds[batch_size][k] = min(_seconds_per_step(backend, prompts, num_tokens) for _ in range(repeats))
    return MeasuredSteps(seconds)


def _seconds_per_step(backend: VLLMBackend, prompts: list[list[int]], num_tokens: int) -> float:
    short_s, short_steps = _timed(backend, prompts, 1)
    long_s, long_steps = _timed(backend, prompts, num_tokens)
    return (long_s - short_s) / max(long_steps - short_steps, 1)


def _timed(backend: VLLMBackend, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """(seconds, engine steps) of one call of len(prompts) requests, each running exactly max_tokens tokens."""
    import vllm
    from vllm.inputs import TokensPrompt
    params = vllm.SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=0, detokenize=False)
    before = backend.engine_counters()["num_steps"]
    start = time.perf_counter()
    backend.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, backend.engine_counters()["num_steps"] - before
