"""A vLLM arm of examples/bench_real.py in its own process (vLLM's engine is built for one config): JSON lines in,
JSON lines out, as bench_rollout.Worker speaks; bench_epochs_worker.py's protocol on a real model and HumanEval.

    .venv-vllm/bin/python examples/bench_real_worker.py --model FOLDER --speculative-config '{"method": "suffix",
        "num_speculative_tokens": 4}' --max-num-seqs 64 --max-model-len 580 --max-num-batched-tokens 20736

Requests (one JSON object per line on stdin):
- {"weights": PATH}: load the policy's weights from a safetensors file; reply {"num_tensors"}.
- {"prompts": [chat messages or token ids, ...], "problems": [{"test", "entry_point", "code_prompt"}, ...],
  "num_generations": G, "sampling": {SamplingParams fields}}: generate, timed; reply `record(...)` and the samples'
  "completions" (token ids, in row order).
The first reply is {"ready", "startup_s"}.

`record` is also what bench_real.py makes of an embedded arm's batch, so every arm reports the same fields.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout import RolloutGenerator, SamplingParams  # noqa: E402
from trainers.code_reward import code_reward  # noqa: E402

PROBLEM_COLUMNS = ("test", "entry_point", "code_prompt")  # the HumanEval columns code_reward reads
COUNTS = ("num_steps", "num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens", "mean_acceptance_length")


def record(batch, seconds: float, problems: list[dict]) -> dict:
    """An arm's figures for one batch, bench_epochs_worker.record's fields: wall seconds of its generate call,
    completion tokens, tokens/s, engine steps (= target forward passes), acceptance counts, and the mean code reward
    (trainers/code_reward.py) of its samples; problems[i] holds prompt i's PROBLEM_COLUMNS."""
    stats, num_tokens = batch.stats, batch.stats["num_completion_tokens"]
    rows = [problems[s.prompt_index] for s in batch.samples]
    rewards = code_reward(None, [s.text for s in batch.samples], **{c: [r[c] for r in rows] for c in PROBLEM_COLUMNS})
    return {"seconds": seconds, "num_tokens": num_tokens, "tokens_per_s": num_tokens / seconds,
            **{key: stats[key] for key in COUNTS}, "mean_reward": statistics.mean(rewards),
            "drafter_seconds": stats.get("drafter_seconds")}


def timed_generate(generator, prompts: list, problems: list[dict], num_generations: int,
                   params: SamplingParams) -> tuple[dict, object]:
    """(record, batch) of one timed generate call."""
    start = time.perf_counter()
    batch = generator.generate(prompts, num_generations, params, use_tqdm=False)
    return record(batch, time.perf_counter() - start, problems), batch


def reply(generator, request: dict) -> dict:
    if "weights" in request:
        from safetensors.torch import load_file
        return {"num_tensors": generator.load_weights(load_file(request["weights"]).items())}
    figures, batch = timed_generate(generator, request["prompts"], request["problems"], request["num_generations"],
                                    SamplingParams(**request["sampling"]))
    return {**figures, "completions": [s.completion_ids for s in batch.samples]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the target's HF folder")
    p.add_argument("--speculative-config", default="null", help="JSON; null: no speculation")
    p.add_argument("--max-num-seqs", type=int, required=True)
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--max-num-batched-tokens", type=int, required=True,
                   help="at least a full batch's prompt tokens: vLLM's CPU build aborts seeded sampling when it "
                        "chunks a prefill (bench_rollout_worker.one_step_prefill)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", help="vLLM's dtype of the model")
    args = p.parse_args(argv)
    start = time.perf_counter()
    generator = RolloutGenerator(args.model, backend="vllm", speculative_config=json.loads(args.speculative_config),
                                 max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, dtype=args.dtype,
                                 seed=args.seed, vllm_kwargs={"max_num_batched_tokens": args.max_num_batched_tokens})
    print(json.dumps({"ready": True, "startup_s": time.perf_counter() - start}), flush=True)
    for line in sys.stdin:
        print(json.dumps(reply(generator, json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
