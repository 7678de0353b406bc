"""Run by tests/test_trainers_accelerate.py under `accelerate launch` with two CPU processes: two GRPO steps with a
RolloutGenerator as rollout function; each process writes what it was asked and what came back to
<output_dir>/rank<i>.json. Six rows per process and num_generations=4: the middle prompt of each step is split
between the processes."""

import json
import os
import sys
from pathlib import Path

from trainers import SpecRolloutCallback
from trainers_testing import grpo_config, grpo_trainer, tiny_generator, tiny_policy


def main(output_dir: str) -> None:
    args = grpo_config(output_dir, per_device_train_batch_size=6, num_generations=4, max_steps=2)
    generator = tiny_generator()
    calls = []
    callback = SpecRolloutCallback(generator)

    def rollout_func(prompts, trainer):  # the callback's, with a record of each call
        out = callback.rollout_func(prompts, trainer)
        calls.append({"prompts": list(prompts), "prompt_ids": out["prompt_ids"],
                      "completion_ids": out["completion_ids"], "num_logprobs": [len(x) for x in out["logprobs"]]})
        return out

    trainer = grpo_trainer(tiny_policy(0), rollout_func, args, callbacks=[callback])
    trainer.train()
    rank = trainer.accelerator.process_index
    logged = [e for e in trainer.state.log_history if "loss" in e]
    record = {"rank": rank, "world_size": trainer.accelerator.num_processes, "calls": calls,
              "num_syncs": callback.weight_sync.num_syncs, "logged": logged}
    Path(output_dir, f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as examples/grpo_arithmetic.py: gloo's teardown can hang or abort a finished rank
