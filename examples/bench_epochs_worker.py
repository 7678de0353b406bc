"""A vLLM arm of examples/bench_epochs.py in its own process (vLLM's engine is built for one config, and two engines
may not share a process): JSON lines in, JSON lines out, as bench_rollout.Worker speaks.

    .venv-vllm/bin/python examples/bench_epochs_worker.py --arm vllm_suffix --vllm-k 4 --max-num-seqs 64 \\
        --max-model-len 384 --seed 0

Requests (one JSON object per line on stdin):
- {"weights": PATH}: load the policy's weights from a safetensors file (every step, before the arms generate, so
  that this arm samples from the policy the embedded arms sample from); reply {"num_tensors"}.
- {"prompt_ids": [[ids], ...], "prompts": [text, ...], "num_generations": G, "sampling": {SamplingParams fields}}:
  generate, timed; reply `record(...)` (below).
The first reply is {"ready", "startup_s"}.

`record` is also what bench_epochs.py makes of an embedded arm's batch, so every arm reports the same fields.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout import RolloutGenerator, SamplingParams  # noqa: E402
from rollout.default_task import reward  # noqa: E402

from bench_rollout_worker import one_step_prefill, vllm_config  # noqa: E402


def vllm_arms(k: int) -> dict[str, dict | None]:
    """vLLM arm -> speculative config, from bench_rollout_worker.vllm_config: no speculation; the shipped draft model
    with the default schedule (`vllm_draft_schedule`); vLLM's own suffix decoding (Arctic Inference) at K = k; the
    project's history drafter through vLLM's custom_class hook at static K = k (`vllm_history`) and K = 8
    (`vllm_history_k8`), with adaptive verification under K = k (`vllm_adaptive`) and under
    rollout.defaults.HISTORY_SCHEDULE (`vllm_schedule_adaptive`); rollout.default_speculative_config("vllm")
    (`vllm_default`); and on vLLM 0.34+ vLLM's suffix decoding with its own adaptive verification
    (`vllm_suffix_adaptive`)."""
    names = {"vllm_no_spec": "vllm_no_spec", "vllm_draft_schedule": "vllm_schedule", "vllm_suffix": f"vllm_suffix_k{k}",
             "vllm_history": f"vllm_history_k{k}", "vllm_history_k8": "vllm_history_k8",
             "vllm_adaptive": f"vllm_history_adaptive_k{k}",
             "vllm_schedule_adaptive": "vllm_history_schedule_adaptive", "vllm_default": "vllm_default",
             "vllm_suffix_adaptive": f"vllm_suffix_adaptive_k{k}"}
    return {arm: vllm_config(name) for arm, name in names.items()}


def record(batch, seconds: float, prompts: list[str]) -> dict:
    """An arm's figures for one step: wall seconds of its generate call, completion tokens, engine steps (= target
    forward passes), acceptance counts (mean acceptance length = 1 + accepted / spec steps, the bonus token counted)
    and the batch's mean reward (samples of prompt i are rows i * G .. i * G + G - 1); drafter_seconds: the project's
    drafter's own time inside vLLM (None for other arms)."""
    stats = batch.stats
    num_generations = len(batch.samples) // len(prompts)
    rewards = [reward(prompts[i // num_generations], s.text) for i, s in enumerate(batch.samples)]
    return {"seconds": seconds, "num_tokens": stats["num_completion_tokens"],
            "tokens_per_s": stats["num_completion_tokens"] / seconds, "num_steps": stats["num_steps"],
            "num_spec_steps": stats["num_spec_steps"], "num_draft_tokens": stats["num_draft_tokens"],
            "num_accepted_draft_tokens": stats["num_accepted_draft_tokens"],
            "mean_acceptance_length": stats["mean_acceptance_length"],
            "mean_reward": sum(rewards) / len(rewards), "drafter_seconds": stats.get("drafter_seconds")}


def timed_generate(generator, prompt_ids: list[list[int]], prompts: list[str], num_generations: int,
                   params: SamplingParams) -> tuple[dict, object]:
    """(record, batch) of one timed generate call."""
    start = time.perf_counter()
    batch = generator.generate(prompt_ids, num_generations, params, use_tqdm=False)
    return record(batch, time.perf_counter() - start, prompts), batch


def serve(generator) -> None:
    from safetensors.torch import load_file
    for line in sys.stdin:
        request = json.loads(line)
        if "weights" in request:
            reply = {"num_tensors": generator.load_weights(load_file(request["weights"]).items())}
        else:
            params = SamplingParams(**request["sampling"])
            reply = timed_generate(generator, request["prompt_ids"], request["prompts"], request["num_generations"],
                                   params)[0]
        print(json.dumps(reply), flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arm", required=True, choices=list(vllm_arms(0)))
    p.add_argument("--vllm-k", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, required=True)
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    start = time.perf_counter()
    generator = RolloutGenerator("default", backend="vllm", speculative_config=vllm_arms(args.vllm_k)[args.arm],
                                 max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, seed=args.seed,
                                 vllm_kwargs=one_step_prefill(args.max_num_seqs))
    print(json.dumps({"ready": True, "startup_s": time.perf_counter() - start}), flush=True)
    serve(generator)


if __name__ == "__main__":
    main()
