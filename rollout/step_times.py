"""An engine's whole step times per batch size and K, for `python -m rollout tune` (spec/tuning.py predicts each K's
speedup from them and the measured acceptance), on either local engine: the same rollouts time the embedded engine
and vLLM's.

The backend forces K at every batch size through its schedule (`use_schedule`; on vLLM the engine is built with the
largest K and a schedule, since only then does vLLM's scheduler read the dense batch-size -> K lookup that
use_schedule overwrites). For each K and batch size B: time B requests of `num_tokens` tokens (EOS ignored, so all B
run to the end together) and the same with 1 token, counting engine steps; the step time is (T(N) - T(1)) /
(steps(N) - steps(1)), which removes the prefill. The smallest over `repeats` is kept (noise on a shared machine only
adds time). A step at K includes the drafter's work and the target's verification of what it drafted (at most K a
row), and whatever the engine does per step besides.
"""

import time

from rollout.sampling_params import SamplingParams
from spec.tuning import MeasuredSteps


def measure_step_times(backend, prompt_ids: list[list[int]], batch_sizes: list[int], ks: list[int],
                       num_tokens: int = 32, repeats: int = 2) -> MeasuredSteps:
    """MeasuredSteps over batch_sizes x ks on `backend` (rollout/backend.py); prompt_ids are cycled to fill a batch.
    The backend's schedule is left forcing the last K: the caller sets the one it wants next. ValueError without a
    speculative config: there is no drafter to draft the K tokens timed."""
    if backend.config is None:
        raise ValueError("measure_step_times times the steps of a speculative config's K; this generator runs without "
                         "one: build it with speculative_config=...")
    batches = {b: [prompt_ids[i % len(prompt_ids)] for i in range(b)] for b in batch_sizes}
    _seconds_per_step(backend, batches[max(batch_sizes)], num_tokens)  # untimed: the first calls pay for allocations
    seconds: dict[int, dict[int, float]] = {b: {} for b in batch_sizes}
    for k in ks:
        backend.use_schedule([[1, backend.max_num_seqs, k]])
        for batch_size, prompts in batches.items():
            seconds[batch_size][k] = min(_seconds_per_step(backend, prompts, num_tokens) for _ in range(repeats))
    return MeasuredSteps(seconds)


def _seconds_per_step(backend, prompts: list[list[int]], num_tokens: int) -> float:
    short_s, short_steps = _timed(backend, prompts, 1)
    long_s, long_steps = _timed(backend, prompts, num_tokens)
    return (long_s - short_s) / max(long_steps - short_steps, 1)


def _timed(backend, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """(seconds, engine steps) of one call of len(prompts) requests, each running exactly max_tokens tokens."""
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=0)
    start = time.perf_counter()
    batch = backend.generate(prompts, 1, params, 0, lambda ids: None, False)
    return time.perf_counter() - start, batch.stats["num_steps"]
